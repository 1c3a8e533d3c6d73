/* kq_mask.h: the attention mask of one ubatch over the KV cache cells
 * (llama.cpp's llama_kv_cache::set_input_kq_mask).
 *
 * One row per query token, one column per cell; streams are stacked:
 *
 *                 cell j ->   0     1     2     3     4   ...  n_kv-1
 *   stream 0  token 0      [  0     0   -inf  -inf    0   ...  -inf ]   0    : the token sees the cell
 *             token 1      [  0     0     0   -inf    0   ...  -inf ]   -inf : it does not
 *             ...                                                       -|p_cell - p_tok| with ALiBi
 *             pad rows     [-inf  -inf  -inf  -inf  -inf  ...  -inf ]   rows [n_tps, n_tps_pad)
 *   stream 1  token 0      [ ... cells of stream 1 ...               ]
 *
 *   mask: float [n_stream][n_tps_pad][n_kv], row-major
 *         (ggml's ne = [n_kv, n_tps_pad, 1, n_stream]).
 *
 * Query token i of stream s (i in [0, n_tps), global index s*n_tps + i) with position p1
 * and primary sequence q (llama.cpp's seq_id[i][0]) sees cell j of stream s iff
 *   - the cell is not empty (pos >= 0; llama.cpp marks empty cells with -1),
 *   - the cell holds sequence q,
 *   - not (causal and p0 > p1), where p0 is the cell's position,
 *   - not lx_is_masked_swa(n_swa, swa_type, p0, p1).
 *
 * Rows of one sequence share everything but the cells near the batch's positions, so the
 * fast fill computes the first row of each sequence in full and derives the others from it
 * (llama.cpp's row reuse, PR 18842); with ALiBi every row is computed. See kq_mask.c.
 */
#ifndef LX_KQ_MASK_H
#define LX_KQ_MASK_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

/* Padding of the token dimension of the mask. ggml's GGML_KQ_MASK_PAD was 32, then 64, and was
 * removed from ggml (llama.cpp PRs 16309 / 17910, Dec 2025): the newest llama.cpp allocates
 * exactly n_tps rows, which is a pad of 1. */
#define LX_KQ_MASK_PAD 1

/* rows of the mask per stream for n_tps query tokens per stream: n_tps rounded up to LX_KQ_MASK_PAD */
int64_t lx_kq_mask_n_tps_pad(int64_t n_tps);

/* the inputs of one mask fill; every pointer is borrowed and read only */
typedef struct {
    int64_t n_stream;                    /* streams in the ubatch, >= 1                            */
    int64_t n_tps;                       /* query tokens per stream, >= 1                          */
    int64_t n_tps_pad;                   /* rows per stream in the output, >= n_tps                */
    int64_t n_kv;                        /* cells per stream covered by the mask, >= 0             */
    const lx_pos      *const *cell_pos;  /* [n_stream] -> [n_kv] cell positions, < 0 = empty      */
    const lx_seq_bits *const *cell_seq;  /* [n_stream] -> [n_kv] cell sequence sets                */
    const lx_pos    *tok_pos;            /* [n_stream*n_tps] query positions, >= 0                 */
    const lx_seq_id *tok_seq;            /* [n_stream*n_tps] primary sequence, in [0, LX_MAX_SEQ)  */
    bool        causal;                  /* mask cells with a position after the token's          */
    int32_t     n_swa;                   /* window size; > 0 when swa_type != LX_SWA_NONE          */
    lx_swa_type swa_type;
    bool        alibi;                   /* visible cells get -|p0 - p1| instead of 0              */
} lx_kq_mask_args;

/* Bytes of scratch that lx_kq_mask_fill uses for its shortcuts: per stream the list of cells
 * whose value can differ between tokens of one sequence (row reuse), per token the row it is
 * derived from, and compact per-stream columns of the sequence bits that several full rows read. */
size_t lx_kq_mask_work_size(int64_t n_stream, int64_t n_tps, int64_t n_kv);

/* Fill mask [n_stream][n_tps_pad][n_kv] for the ubatch described by a; bit-identical to
 * lx_kq_mask_fill_ref. work: lx_kq_mask_work_size(n_stream, n_tps, n_kv) bytes, 8-byte aligned, or
 * NULL (then no shortcut: every row is computed by the specialised scan over the cells).
 * n_threads >= 1 (OpenMP over the rows of large masks). Writes every element of mask. */
void lx_kq_mask_fill(const lx_kq_mask_args *a, float *mask, void *work, int n_threads);

/* Scalar oracle: the definition above, one (token, cell) pair at a time. */
void lx_kq_mask_fill_ref(const lx_kq_mask_args *a, float *mask);

/* The column order's question (kv_cache.py's _column_order): 1 if, for each of the n_seqs sequences
 * seqs, the cells [0, n_kv) holding it have strictly increasing positions in cell order (as a
 * sequence decoded alone leaves them), else 0. O(n_kv) for all of them together. */
int lx_kq_cells_in_order(const lx_pos *pos, const lx_seq_bits *bits, int64_t n_kv, const lx_seq_id *seqs,
                         int n_seqs);

#endif /* LX_KQ_MASK_H */
