# buffers.pxd: mirrors csrc/buffers.h (declarations only).
from libc.stdint cimport int64_t, uint8_t


cdef extern from "buffers.h" nogil:
    # dst [sum(lens)], srcs[i] [lens[i]]
    void lx_gather(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts, int n_threads)
    void lx_gather_ref(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts)
