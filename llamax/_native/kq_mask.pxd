# Mirrors csrc/kq_mask.h (declarations only).
from libc.stdint cimport int32_t, int64_t, uint64_t

cdef extern from "common.h" nogil:
    ctypedef int32_t lx_pos
    ctypedef int32_t lx_seq_id
    ctypedef struct lx_seq_bits:
        uint64_t w[4]
    ctypedef enum lx_swa_type:
        LX_SWA_NONE
        LX_SWA_STANDARD
        LX_SWA_CHUNKED
        LX_SWA_SYMMETRIC
    int LX_MAX_SEQ
    int LX_SEQ_WORDS

cdef extern from "kq_mask.h" nogil:
    int LX_KQ_MASK_PAD

    int64_t lx_kq_mask_n_tps_pad(int64_t n_tps)

    ctypedef struct lx_kq_mask_args:
        int64_t n_stream
        int64_t n_tps
        int64_t n_tps_pad
        int64_t n_kv
        const lx_pos * const * cell_pos          # [n_stream] -> [n_kv]
        const lx_seq_bits * const * cell_seq     # [n_stream] -> [n_kv]
        const lx_pos * tok_pos                   # [n_stream*n_tps]
        const lx_seq_id * tok_seq                # [n_stream*n_tps]
        bint causal
        int32_t n_swa
        lx_swa_type swa_type
        bint alibi

    size_t lx_kq_mask_work_size(int64_t n_stream, int64_t n_tps, int64_t n_kv)
    void lx_kq_mask_fill(const lx_kq_mask_args * a, float * mask, void * work, int n_threads)
    void lx_kq_mask_fill_ref(const lx_kq_mask_args * a, float * mask)
    int lx_kq_cells_in_order(const lx_pos * pos, const lx_seq_bits * bits, int64_t n_kv, const lx_seq_id * seqs,
                             int n_seqs)
