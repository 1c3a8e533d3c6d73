/* buffers.c: see buffers.h. */
#include "buffers.h"

#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

void lx_gather_ref(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts) {
    for (int64_t i = 0; i < n_parts; i++) {
        memcpy(dst, srcs[i], lens[i]);
        dst += lens[i];
    }
}

/* Copy the bytes [b0, b1) of the concatenation: the parts (or pieces of parts) that fall there. */
static void gather_range(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts,
                         size_t b0, size_t b1) {
    size_t off = 0;
    for (int64_t i = 0; i < n_parts && off < b1; i++) {
        size_t s = off, e = off + lens[i];
        off = e;
        if (e <= b0) {
            continue;
        }
        size_t lo = s > b0 ? s : b0, hi = e < b1 ? e : b1;
        memcpy(dst + lo, srcs[i] + (lo - s), hi - lo);
    }
}

void lx_gather(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts, int n_threads) {
    size_t total = 0;
    for (int64_t i = 0; i < n_parts; i++) {
        total += lens[i];
    }
    int nt = n_threads < 1 ? 1 : n_threads;
    if (total < ((size_t)1 << 20)) {
        nt = 1;  /* not worth waking threads */
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
    for (int t = 0; t < nt; t++) {
        size_t per = (total + (size_t)nt - 1) / (size_t)nt;
        size_t b0 = per * (size_t)t, b1 = b0 + per < total ? b0 + per : total;
        if (b0 < b1) {
            gather_range(dst, srcs, lens, n_parts, b0, b1);
        }
    }
}
