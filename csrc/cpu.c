/* cpu.c: the one CPU probe and the level cap of the native library (cpu.h). */
#define _GNU_SOURCE   /* syscall (arch_prctl) under -std=c11 */
#include "cpu.h"

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static int probed = -1;     /* the CPU's best level, once known */
static int cap = -1;        /* testing hook; -1: none */

/* AMX tiles usable: the CPU has amx-tile and amx-int8 and the kernel grants this process the tile data
 * state (XFEATURE_XTILEDATA, 18; without the grant the first tile instruction faults). Asked once. */
static int amx_granted(void) {
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8"))) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

static int probe(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return LX_SIMD_PORTABLE;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return LX_SIMD_AVX2;
    if (!__builtin_cpu_supports("avx512vnni")) return LX_SIMD_AVX512;
    return amx_granted() ? LX_SIMD_AMX : LX_SIMD_VNNI512;
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
