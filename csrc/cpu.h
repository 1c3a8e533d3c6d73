/* cpu.h: the SIMD level the kernels run at: one probe of this CPU, one numbering for every unit.
 *
 * Builds use a portable baseline; every unit of the native library picks its fast path from
 * lx_simd_level() at each call, so a cap set for testing (lx_set_simd_level) reaches all of them.
 * A unit with no path at some level runs the next lower one it has (the GEMM and the quantized
 * products have no AVX-512 path without VNNI: they run AVX2 at LX_SIMD_AVX512).
 */
#ifndef LX_CPU_H
#define LX_CPU_H

enum {
    LX_SIMD_PORTABLE = 0,   /* C only (any CPU)                               */
    LX_SIMD_AVX2     = 1,   /* avx2 + fma + f16c                              */
    LX_SIMD_AVX512   = 2,   /* + avx512 f, bw, vl, dq                         */
    LX_SIMD_VNNI512  = 3,   /* + avx512 vnni                                  */
    LX_SIMD_AMX      = 4,   /* + amx tile + amx int8, the tile state granted  */
    LX_SIMD_N_LEVELS = 5,
};

/* the best level this CPU runs (LX_SIMD_PORTABLE off x86-64); probed once, safe from any thread */
int lx_cpu_simd_level(void);

/* the level the kernels run at: the CPU's best, or the cap when one is set and lower */
int lx_simd_level(void);

/* testing hook: cap every kernel at `level` (LX_SIMD_*); -1 lifts the cap. Meant to be set between
 * calls: a kernel running in another thread may finish at the old level. */
void lx_set_simd_level(int level);

#endif /* LX_CPU_H */
