/* buffers.h: bulk byte moves for state I/O (llama_state_* get/set of K/V rows).
 *
 * A state blob of a long sequence is tens of MB assembled from many row runs into a fresh bytes
 * object, whose pages fault on first touch: most of the cost. Here several threads copy (and so
 * fault) disjoint ranges at once. (Advising transparent huge pages was tried: 17 ms instead of 19
 * for 47 MB when huge pages were at hand, but 65 ms whenever the kernel had to compact memory for
 * them, so it is not done.) No policy: the caller decides what goes where.
 */
#ifndef LX_BUFFERS_H
#define LX_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

/* Copy n_parts buffers back to back into dst: srcs[i] ([lens[i]] bytes) lands at dst + sum of
 * lens[0..i). dst must hold the sum of lens and overlap no source. OpenMP over byte ranges of
 * equal size (n_threads >= 1); the result does not depend on n_threads. */
void lx_gather(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts, int n_threads);

/* Scalar oracle of lx_gather: one memcpy per part, in order. */
void lx_gather_ref(uint8_t *dst, const uint8_t *const *srcs, const size_t *lens, int64_t n_parts);

#endif /* LX_BUFFERS_H */
