/* buffers.h: bulk byte moves for state I/O (llama_state_* get/set of K/V rows).
 *
 * A state blob of a long sequence is tens of MB assembled from many row runs. Python's
 * b"".join copies them into a fresh bytes object whose 4 KiB pages fault one by one; here the
 * destination is advised to use transparent huge pages first and the runs are copied by several
 * threads. No policy: the caller decides what goes where.
 */
#ifndef LX_BUFFERS_H
#define LX_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

/* Ask the kernel to back [p, p + n) with transparent huge pages (madvise MADV_HUGEPAGE on the
 * 2 MiB-aligned interior). A hint: does nothing where unsupported. Call before first touch. */
void lx_advise_huge(void *p, size_t n);

/* Copy n_parts buffers back to back into dst: srcs[i] ([lens[i]] bytes) lands at dst + sum of
 * lens[0..i). dst must hold the sum of lens and overlap no source. OpenMP over byte ranges of
 * equal size (n_threads >= 1); the result does not depend on n_threads. */
void lx_gather(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts, int n_threads);

/* Scalar oracle of lx_gather: one memcpy per part, in order. */
void lx_gather_ref(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts);

#endif /* LX_BUFFERS_H */
