# cython: language_level=3
"""The SIMD level of the native library (csrc/cpu.h): one probe of this CPU, one numbering.

Every kernel (quants, matmul, gemm, attention, rope, kq_mask, layer, sampling, hadamard) picks its
path from `simd_level()` at each call; `set_simd_level` caps them all at once, for the tests that
hold each fast path against its scalar reference.

LLAMAX_SIMD=portable|avx2|avx512|avx512-vnni|amx (read once, when this module loads) sets a ceiling:
the process runs as on a CPU whose best level is that one. `levels()` stops there, and
`set_simd_level` never goes above it, so the whole test suite runs at each level on one machine.
"""
import os
# the declarations of csrc/cpu.h come from cpu.pxd (same module name)

PORTABLE = LX_SIMD_PORTABLE
AVX2 = LX_SIMD_AVX2          # avx2 + fma + f16c
AVX512 = LX_SIMD_AVX512      # + avx512 f, bw, vl, dq
VNNI512 = LX_SIMD_VNNI512    # + avx512 vnni
AMX = LX_SIMD_AMX            # + amx tile / int8 (the prompt GEMM's tile path)
LEVEL_NAMES = ("portable", "avx2", "avx512", "avx512-vnni", "amx")


def _ceiling_from_env() -> int:
    name = os.environ.get("LLAMAX_SIMD", "").strip().lower()
    if not name:
        return LX_SIMD_N_LEVELS - 1
    if name not in LEVEL_NAMES:
        raise ValueError(f"LLAMAX_SIMD={name!r}: one of {', '.join(LEVEL_NAMES)} (or unset: this CPU's best)")
    return LEVEL_NAMES.index(name)


_CEILING = _ceiling_from_env()


def ceiling() -> int:
    """The best level this process may use: the CPU's, or LLAMAX_SIMD's when lower."""
    return min(_CEILING, lx_cpu_simd_level())


def cpu_level() -> int:
    """The best level this CPU runs."""
    return lx_cpu_simd_level()


def simd_level() -> int:
    """The level the kernels run at: the CPU's best, or the cap when a lower one is set."""
    return lx_simd_level()


def set_simd_level(int level) -> None:
    """Testing hook: cap every kernel at `level` (PORTABLE .. AMX, never above ceiling());
    -1 lifts the cap back to ceiling()."""
    if level < -1 or level >= LX_SIMD_N_LEVELS:
        raise ValueError(f"SIMD level {level} is not in -1 .. {LX_SIMD_N_LEVELS - 1}")
    top = ceiling()
    if level == -1 or level > top:
        level = -1 if top == lx_cpu_simd_level() else top
    lx_set_simd_level(level)


def levels() -> tuple:
    """The levels this process can run (up to ceiling()), lowest first (what a test sweeps)."""
    return tuple(range(ceiling() + 1))


set_simd_level(-1)  # the ceiling from LLAMAX_SIMD, if any
