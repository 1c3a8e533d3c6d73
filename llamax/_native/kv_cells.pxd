# Declarations of csrc/kv_cells.h (1:1, no logic).
from libc.stdint cimport int32_t, uint32_t, uint64_t

cdef extern from "common.h" nogil:
    ctypedef int32_t lx_pos
    ctypedef int32_t lx_seq_id
    ctypedef int32_t lx_token
    enum: LX_MAX_SEQ
    enum: LX_SEQ_WORDS
    enum: LX_TOKEN_NULL
    ctypedef struct lx_seq_bits:
        uint64_t w[4]
    ctypedef enum lx_status:
        LX_OK
        LX_ERR_NO_SLOT
        LX_ERR_NOMEM
        LX_ERR_INVALID
    ctypedef enum lx_swa_type:
        LX_SWA_NONE
        LX_SWA_STANDARD
        LX_SWA_CHUNKED
        LX_SWA_SYMMETRIC
    bint lx_is_masked_swa(int32_t n_swa, lx_swa_type swa_type, lx_pos p0, lx_pos p1)

cdef extern from "kv_cells.h" nogil:
    ctypedef struct lx_cells:
        pass
    ctypedef struct lx_cell_ext:
        lx_pos x
        lx_pos y
        lx_token tok
    ctypedef struct lx_cell_state:
        lx_pos pos
        lx_pos shift
        lx_cell_ext ext
        lx_seq_bits seq

    lx_cells *lx_cells_new(uint32_t n)
    void lx_cells_free(lx_cells *c)
    void lx_cells_reset(lx_cells *c)
    void lx_cells_reset_shift(lx_cells *c)
    uint32_t lx_cells_size(const lx_cells *c)
    uint32_t lx_cells_get_used(const lx_cells *c)
    uint32_t lx_cells_used_min(const lx_cells *c)
    uint32_t lx_cells_used_max_p1(const lx_cells *c)
    bint lx_cells_get_has_shift(const lx_cells *c)
    const lx_pos *lx_cells_pos_data(const lx_cells *c)
    const lx_pos *lx_cells_shift_data(const lx_cells *c)
    const lx_seq_bits *lx_cells_seq_data(const lx_cells *c)

    bint lx_cell_is_empty(const lx_cells *c, uint32_t i)
    lx_pos lx_cell_pos_get(const lx_cells *c, uint32_t i)
    lx_pos lx_cell_get_shift(const lx_cells *c, uint32_t i)
    lx_cell_ext lx_cell_ext_get(const lx_cells *c, uint32_t i)
    void lx_cell_ext_set(lx_cells *c, uint32_t i, lx_cell_ext ext)
    int lx_cell_seq_count(const lx_cells *c, uint32_t i)
    bint lx_cell_seq_has(const lx_cells *c, uint32_t i, lx_seq_id s)
    lx_seq_id lx_cell_seq_get(const lx_cells *c, uint32_t i)
    void lx_cell_rm(lx_cells *c, uint32_t i)
    void lx_cell_pos_set(lx_cells *c, uint32_t i, lx_pos p)
    lx_status lx_cell_seq_add(lx_cells *c, uint32_t i, lx_seq_id s)
    bint lx_cell_seq_rm(lx_cells *c, uint32_t i, lx_seq_id s)
    bint lx_cell_seq_keep(lx_cells *c, uint32_t i, lx_seq_id s)
    bint lx_cell_pos_add(lx_cells *c, uint32_t i, lx_pos d)
    void lx_cell_pos_div(lx_cells *c, uint32_t i, int d)

    lx_pos lx_cells_seq_pos_min(const lx_cells *c, lx_seq_id s)
    lx_pos lx_cells_seq_pos_max(const lx_cells *c, lx_seq_id s)
    uint32_t lx_cells_seq_n_cells(const lx_cells *c, lx_seq_id s)

    bint lx_cells_seq_rm(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, uint32_t *head)
    lx_status lx_cells_seq_cp(lx_cells *c, lx_seq_id src, lx_seq_id dst, lx_pos p0, lx_pos p1)
    lx_status lx_cells_seq_cp_stream(lx_cells *dst_c, const lx_cells *src_c, lx_seq_id src, lx_seq_id dst)
    void lx_cells_seq_keep(lx_cells *c, lx_seq_id s, uint32_t *head)
    void lx_cells_seq_add(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, lx_pos shift, uint32_t *head)
    void lx_cells_seq_div(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, int d)

    void lx_cells_cp(const lx_cells *c, const uint32_t *idxs, uint32_t n, lx_cell_state *out)
    lx_status lx_cells_set(lx_cells *c, const uint32_t *idxs, uint32_t n, const lx_cell_state *inp)
    lx_status lx_cells_reserve(lx_cells *c, uint64_t extra)
