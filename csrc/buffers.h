/* buffers.h: bulk byte moves for state I/O (llama_state_* get/set of K/V rows).
 *
 * A state blob's data region is a sequence of chunks (K rows of a run of cells, V rows or V
 * columns), each padded to 8 bytes; its checksum is the XOR of the region's little-endian uint64
 * words. A get copies rows of the cache into the blob and must checksum them; a set checks the
 * blob's checksum, then copies its rows into the cache. Both copies are lists of strided moves,
 * done here in one call (OpenMP over equal byte ranges) with the checksum taken while the bytes
 * are hot in L1, so a get costs one pass over the bytes, not a copy plus a checksum pass.
 *
 *   a move: rows x n bytes                       the checksummed stream (the blob's data region)
 *     src  row 0 [n] ---------------------->  dst  ... | row 0 | row 1 | row 2 | pad | ...
 *          (src_stride apart)                            ^ at: the byte lane of dst row 0 is at % 8
 *          row 1 [n] ...                                 rows back to back: row r at at + r * n
 *
 * (Advising transparent huge pages for a fresh blob was tried: 17 ms instead of 19 for 47 MB when
 * huge pages were at hand, but 65 ms whenever the kernel had to compact memory for them, so it is
 * not done.) No policy: the caller decides what goes where.
 */
#ifndef LX_BUFFERS_H
#define LX_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

/* One strided copy: row r (n bytes) from src + r * src_stride to dst + r * dst_stride. */
typedef struct {
    uint8_t *dst;          /* [rows, dst_stride] */
    const uint8_t *src;    /* [rows, src_stride] */
    size_t n;              /* bytes per row */
    size_t rows;
    size_t dst_stride, src_stride;
    size_t at;             /* offset of row 0 in the checksummed stream; row r at at + r * n */
} lx_move;

/* Do every move and return the XOR of the little-endian uint64 words of the stream they describe
 * (byte j of row r at offset at + r * n + j; bytes no move covers count as zeros): the state
 * format's data checksum when the moves fill the data region, else a value to ignore.
 * note: no dst byte may be written twice or overlap a source. OpenMP over equal byte ranges
 * (n_threads >= 1); the copies and the result do not depend on n_threads. */
uint64_t lx_move_xor(const lx_move *moves, int64_t n_moves, int n_threads);

/* Scalar oracle of lx_move_xor: one memcpy per row, then the checksum byte by byte. */
uint64_t lx_move_xor_ref(const lx_move *moves, int64_t n_moves);

/* The XOR of the little-endian uint64 words of p[0, n) zero-padded to a multiple of 8 (p need not
 * be aligned). OpenMP over equal word ranges; the result does not depend on n_threads. */
uint64_t lx_xor64(const uint8_t *p, size_t n, int n_threads);

/* Scalar oracle of lx_xor64: byte by byte. */
uint64_t lx_xor64_ref(const uint8_t *p, size_t n);

/* memcpy(dst, src, n) whose stores go around the caches (non-temporal) when n >= 4096 (then an sfence
 * before it returns): for a copy nobody reads soon, which then moves 2 bytes per byte copied, not 3
 * (the recurrent kernels' undo rows, ssm.h). Below 4096 bytes, or without SSE2, a plain memcpy. */
void lx_stream_copy(void *dst, const void *src, size_t n);

#endif /* LX_BUFFERS_H */
