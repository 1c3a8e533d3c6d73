/* cpu.c: the one CPU probe and the level cap of the native library (cpu.h). */
#include "cpu.h"

static int probed = -1;     /* the CPU's best level, once known */
static int cap = -1;        /* testing hook; -1: none */

static int probe(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return LX_SIMD_PORTABLE;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return LX_SIMD_AVX2;
    return __builtin_cpu_supports("avx512vnni") ? LX_SIMD_VNNI512 : LX_SIMD_AVX512;
#else
    return LX_SIMD_PORTABLE;
#endif
}

int lx_cpu_simd_level(void) {
    int lv = __atomic_load_n(&probed, __ATOMIC_RELAXED);
    if (lv < 0) {                   /* every thread computes the same value */
        lv = probe();
        __atomic_store_n(&probed, lv, __ATOMIC_RELAXED);
    }
    return lv;
}

int lx_simd_level(void) {
    const int best = lx_cpu_simd_level();
    const int c = __atomic_load_n(&cap, __ATOMIC_RELAXED);
    return c >= 0 && c < best ? c : best;
}

void lx_set_simd_level(int level) { __atomic_store_n(&cap, level, __ATOMIC_RELAXED); }
