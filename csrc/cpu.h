/* cpu.h: what this CPU can run, read once (runtime dispatch of the fast kernel paths).
 *
 * Builds use a portable baseline; each unit picks its AVX2 / AVX-512 path from these flags.
 */
#ifndef LX_CPU_H
#define LX_CPU_H

enum {
    LX_CPU_AVX2    = 1 << 0,   /* avx2 + fma + f16c              */
    LX_CPU_AVX512  = 1 << 1,   /* avx512 f + bw + vl + dq         */
    LX_CPU_VNNI512 = 1 << 2,   /* avx512 vnni (with LX_CPU_AVX512) */
};

/* the LX_CPU_* flags of this CPU (0 off x86-64); computed once, safe from any thread */
static inline int lx_cpu_features(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    static int cached = -1;
    int f = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (f < 0) {
        __builtin_cpu_init();
        f = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
            f |= LX_CPU_AVX2;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
                f |= LX_CPU_AVX512;
                if (__builtin_cpu_supports("avx512vnni")) f |= LX_CPU_VNNI512;
            }
        }
        __atomic_store_n(&cached, f, __ATOMIC_RELAXED);
    }
    return f;
#else
    return 0;
#endif
}

#endif /* LX_CPU_H */
