"""The one native library: one CPU probe, one level numbering, one cap that reaches every kernel."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

from llamax._native import cpu

MODULES = ["cpu", "cells", "kq_mask", "rope", "hadamard", "attention", "quants", "matmul", "gemm", "layer",
           "buffers", "sampling"]


@pytest.fixture(autouse=True)
def _lift_cap():
    yield
    cpu.set_simd_level(-1)


def test_levels_and_cap():
    best = cpu.ceiling()  # the CPU's best, or LLAMAX_SIMD's level when this run is capped
    assert best <= cpu.cpu_level()
    assert cpu.levels() == tuple(range(best + 1))
    assert cpu.simd_level() == best
    assert len(cpu.LEVEL_NAMES) == cpu.AMX + 1
    cpu.set_simd_level(cpu.PORTABLE)
    assert cpu.simd_level() == cpu.PORTABLE
    cpu.set_simd_level(cpu.AMX)              # a cap above the CPU's best is the CPU's best
    assert cpu.simd_level() == best
    cpu.set_simd_level(-1)
    assert cpu.simd_level() == best
    for bad in (-2, cpu.AMX + 1):
        with pytest.raises(ValueError, match="SIMD level"):
            cpu.set_simd_level(bad)
    assert cpu.simd_level() == best


def run_capped(value: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLAMAX_SIMD": value}
    return subprocess.run([sys.executable, "-c", "import llamax\nfrom llamax._native import cpu\n" + code],
                          env=env, capture_output=True, text=True)


@pytest.mark.parametrize("name", cpu.LEVEL_NAMES)
def test_llamax_simd_sets_a_ceiling(name):
    """LLAMAX_SIMD=name runs as on a CPU whose best is that level: levels() stops there and a lifted
    cap (-1) or a higher one comes back to it, not to the CPU's best."""
    top = min(cpu.LEVEL_NAMES.index(name), cpu.cpu_level())
    r = run_capped(name, "cpu.set_simd_level(-1); a = cpu.simd_level()\n"
                         "cpu.set_simd_level(cpu.AMX); b = cpu.simd_level()\n"
                         "cpu.set_simd_level(cpu.PORTABLE); c = cpu.simd_level()\n"
                         "print(','.join(map(str, cpu.levels())), cpu.ceiling(), a, b, c)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [",".join(str(i) for i in range(top + 1)), str(top), str(top), str(top), "0"]


def test_llamax_simd_unknown_name_is_a_clear_error():
    r = run_capped("sse9", "pass")
    assert r.returncode != 0 and "LLAMAX_SIMD='sse9': one of portable, avx2, avx512, avx512-vnni" in r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (ELF builds)")
def test_one_library_mapped_once():
    """Every extension links the same libllamax: one file mapped, none of csrc inside an extension."""
    mods = [importlib.import_module(f"llamax._native.{m}") for m in MODULES]
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if line.rstrip().endswith("libllamax.so")}
    assert len(libs) == 1, libs
    (lib,) = libs
    assert os.path.dirname(lib) == os.path.dirname(mods[0].__file__)
    for m in mods:   # the probe is defined in the library only
        with open(m.__file__, "rb") as f:
            assert b"lx_cpu_simd_level" not in f.read() or m.__name__.endswith(".cpu"), m.__name__


@pytest.mark.skipif(cpu.ceiling() < cpu.AVX2, reason="needs a fast path to cap (a CPU, and LLAMAX_SIMD, with AVX2)")
def test_cap_reaches_the_kernels_of_other_modules():
    """The cap set here changes the path of attention (another extension): its portable C rounds
    differently from its AVX2 lanes, and each level repeats its own bits."""
    from llamax._native import attention as A
    rng = np.random.default_rng(3)
    q = rng.uniform(-1, 1, (4, 4, 64)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, 300, 2, 64)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, 300, 2, 64)).astype(np.float32)
    mask = np.zeros((1, 4, 300), np.float32)
    kw = dict(n_kv=300, scale=0.125, n_threads=1)
    best = A.attn(q, k, v, mask, **kw)
    cpu.set_simd_level(cpu.PORTABLE)
    portable = A.attn(q, k, v, mask, **kw)
    assert np.array_equal(portable, A.attn(q, k, v, mask, **kw))
    cpu.set_simd_level(-1)
    assert np.array_equal(best, A.attn(q, k, v, mask, **kw))
    assert not np.array_equal(best, portable)
    np.testing.assert_allclose(best, portable, rtol=0, atol=1e-5)


def test_the_probe_finds_amx_where_the_cpu_has_it():
    """On Linux the CPU's level is AMX exactly where /proc/cpuinfo lists AVX-512 VNNI, amx_tile and amx_int8
    (the kernel grants the tile state to any process that asks, from Linux 5.16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    has = {"avx512_vnni", "amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags)
    assert (cpu.cpu_level() == cpu.AMX) == has
