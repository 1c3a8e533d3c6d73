# Declarations of csrc/slot_finder.h (1:1, no logic).
from libc.stdint cimport int32_t, uint32_t
from llamax._native.kv_cells cimport lx_cells, lx_pos, lx_seq_id, lx_token, lx_seq_bits, lx_status, lx_swa_type

cdef extern from "slot_finder.h" nogil:
    ctypedef struct lx_kv_meta:
        lx_cells **cells
        uint32_t *heads
        const uint32_t *seq_to_stream
        uint32_t n_stream
        int32_t n_swa
        lx_swa_type swa_type
    ctypedef struct lx_ubatch_view:
        uint32_t n_tokens
        const lx_pos *pos
        const lx_seq_bits *seq
        const lx_token *token
        uint32_t n_seqs_unq
        const lx_seq_id *seq_id_unq

    uint32_t lx_slot_n_parts(const lx_kv_meta *kv, const lx_ubatch_view *ub)
    lx_status lx_find_slot(const lx_kv_meta *kv, const lx_ubatch_view *ub, bint cont, uint32_t *strm, uint32_t *idxs)
    lx_status lx_apply_ubatch(const lx_kv_meta *kv, const lx_ubatch_view *ub, const uint32_t *strm, const uint32_t *idxs)
    lx_status lx_prepare(const lx_kv_meta *kv, const lx_ubatch_view *ubs, uint32_t n_ubatches, bint cont,
                         uint32_t *strm_out, uint32_t *idxs_out)
    bint lx_slot_is_contiguous(uint32_t n_parts, uint32_t n_per, const uint32_t *idxs)
