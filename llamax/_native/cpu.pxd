# cpu.pxd: mirrors csrc/cpu.h (declarations only).


cdef extern from "cpu.h" nogil:
    enum:
        LX_SIMD_PORTABLE
        LX_SIMD_AVX2
        LX_SIMD_AVX512
        LX_SIMD_VNNI512
        LX_SIMD_AMX
        LX_SIMD_N_LEVELS
    int lx_cpu_simd_level()
    int lx_simd_level()
    void lx_set_simd_level(int level)
