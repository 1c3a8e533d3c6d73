/* kv_cells.h: the cell table of one KV-cache stream (llama.cpp's llama_kv_cells).
 *
 * One cell holds the K/V rows of one token in every layer. The table keeps, per cell:
 *
 *     idx    0    1    2    3    4    5   ...  n-1
 *     pos   [0]  [1]  [2]  [-1] [7]  [-1]      [-1]     -1 = empty
 *     seq   {0}  {0,1}{0,1} {}   {2}  {}        {}      which sequences see the cell
 *     shift  0    0    0    0   +3    0         0       pending K-shift (new pos - old pos)
 *     ext   (x, y, tok)                                  2-D position (M-RoPE) and the token
 *
 * and, per sequence, the multiset of the positions it holds, so that seq_pos_min/max cost O(log n).
 * Cells of one sequence may repeat a position (after seq_div, or from images), hence a multiset.
 *
 * Range operations follow llama_kv_cache's seq_* semantics for one stream: half-open [p0, p1),
 * p0 < 0 means 0, p1 < 0 means infinity. They update the stream's head as llama.cpp does.
 * Operations that can add position entries return LX_ERR_NOMEM, before changing anything, if the
 * entry pool cannot grow.
 */
#ifndef LX_KV_CELLS_H
#define LX_KV_CELLS_H

#include "common.h"

typedef struct lx_cells lx_cells;

typedef struct {
    lx_pos   x;     /* 2-D position, used by M-RoPE */
    lx_pos   y;
    lx_token tok;   /* the token stored in the cell, LX_TOKEN_NULL if unknown */
} lx_cell_ext;

/* the saved state of one cell (lx_cells_cp / lx_cells_set) */
typedef struct {
    lx_pos      pos;
    lx_pos      shift;
    lx_cell_ext ext;
    lx_seq_bits seq;
} lx_cell_state;

/* a new table of n empty cells; NULL if an allocation fails */
lx_cells *lx_cells_new(uint32_t n);
void      lx_cells_free(lx_cells *c);

/* empty every cell and every sequence; clear pending shifts */
void lx_cells_reset(lx_cells *c);
/* forget pending shifts (after the K-shift was applied to the K rows) */
void lx_cells_reset_shift(lx_cells *c);

uint32_t lx_cells_size(const lx_cells *c);
uint32_t lx_cells_get_used(const lx_cells *c);      /* number of non-empty cells              */
uint32_t lx_cells_used_min(const lx_cells *c);      /* first non-empty cell, 0 if none        */
uint32_t lx_cells_used_max_p1(const lx_cells *c);   /* last non-empty cell + 1, 0 if none     */
bool     lx_cells_get_has_shift(const lx_cells *c); /* some cell has a pending shift          */

/* read-only views of the arrays, for the mask and the K-shift (valid until lx_cells_free) */
const lx_pos      *lx_cells_pos_data(const lx_cells *c);    /* [n] */
const lx_pos      *lx_cells_shift_data(const lx_cells *c);  /* [n] */
const lx_seq_bits *lx_cells_seq_data(const lx_cells *c);    /* [n] */

/* ---- one cell (note: i < size) ---- */
bool        lx_cell_is_empty(const lx_cells *c, uint32_t i);
lx_pos      lx_cell_pos_get(const lx_cells *c, uint32_t i);     /* note: call only if the cell is not empty */
lx_pos      lx_cell_get_shift(const lx_cells *c, uint32_t i);
lx_cell_ext lx_cell_ext_get(const lx_cells *c, uint32_t i);
void        lx_cell_ext_set(lx_cells *c, uint32_t i, lx_cell_ext ext);
int         lx_cell_seq_count(const lx_cells *c, uint32_t i);
bool        lx_cell_seq_has(const lx_cells *c, uint32_t i, lx_seq_id s);
/* the only sequence of the cell; note: call only if seq_count == 1 */
lx_seq_id   lx_cell_seq_get(const lx_cells *c, uint32_t i);
/* empty a non-empty cell */
void        lx_cell_rm(lx_cells *c, uint32_t i);
/* set the position of an empty cell; note: the cell gets sequences with lx_cell_seq_add */
void        lx_cell_pos_set(lx_cells *c, uint32_t i, lx_pos p);
/* add sequence s to a non-empty cell that lacks it; LX_ERR_NOMEM if the position pool cannot grow */
lx_status   lx_cell_seq_add(lx_cells *c, uint32_t i, lx_seq_id s);
/* remove s from a cell that has it; returns true if the cell became empty */
bool        lx_cell_seq_rm(lx_cells *c, uint32_t i, lx_seq_id s);
/* keep only s in the cell; returns true if the cell became empty (it did not hold s) */
bool        lx_cell_seq_keep(lx_cells *c, uint32_t i, lx_seq_id s);
/* pos += d, shift += d; a cell pushed below 0 is emptied and true returned */
bool        lx_cell_pos_add(lx_cells *c, uint32_t i, lx_pos d);
/* pos /= d (d > 0), shift += new - old */
void        lx_cell_pos_div(lx_cells *c, uint32_t i, int d);

/* ---- one sequence ---- */
lx_pos   lx_cells_seq_pos_min(const lx_cells *c, lx_seq_id s);  /* -1 when the sequence is empty */
lx_pos   lx_cells_seq_pos_max(const lx_cells *c, lx_seq_id s);
uint32_t lx_cells_seq_n_cells(const lx_cells *c, lx_seq_id s);  /* cells holding s */

/* ---- ranges of one stream (llama_kv_cache::seq_*); head is the stream's search head ---- */
/* remove s (or every sequence when s == -1) from cells with pos in [p0, p1); always true */
bool      lx_cells_seq_rm(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, uint32_t *head);
/* add dst to the cells of src with pos in [p0, p1) that lack it (no data is copied) */
lx_status lx_cells_seq_cp(lx_cells *c, lx_seq_id src, lx_seq_id dst, lx_pos p0, lx_pos p1);
/* reset dst_c, then give it the cells of sequence src of src_c as cells of sequence dst, at the
 * same indices, with the same pending shifts (cross-stream seq_cp; the rows are copied by the caller) */
lx_status lx_cells_seq_cp_stream(lx_cells *dst_c, const lx_cells *src_c, lx_seq_id src, lx_seq_id dst);
/* drop every sequence but s */
void      lx_cells_seq_keep(lx_cells *c, lx_seq_id s, uint32_t *head);
/* pos += shift for the cells of s in [p0, p1); marks shifts */
void      lx_cells_seq_add(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, lx_pos shift, uint32_t *head);
/* pos /= d (d > 0) for the cells of s in [p0, p1); marks shifts */
void      lx_cells_seq_div(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, int d);

/* ---- save / restore ---- */
/* copy the state of cells idxs[0..n) into out[0..n) */
void      lx_cells_cp(const lx_cells *c, const uint32_t *idxs, uint32_t n, lx_cell_state *out);
/* set cells idxs[0..n) to the saved states; LX_ERR_NOMEM (nothing changed) if the pool cannot grow */
lx_status lx_cells_set(lx_cells *c, const uint32_t *idxs, uint32_t n, const lx_cell_state *in);

/* make room for `extra` more (sequence, cell) entries; the ops above call it themselves */
lx_status lx_cells_reserve(lx_cells *c, uint64_t extra);

#endif /* LX_KV_CELLS_H */
