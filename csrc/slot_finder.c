/* slot_finder.c: see slot_finder.h. */
#include "slot_finder.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

uint32_t lx_slot_n_parts(const lx_kv_meta *kv, const lx_ubatch_view *ub) {
    return kv->n_stream > 1 ? ub->n_seqs_unq : 1;
}

bool lx_slot_is_contiguous(uint32_t n_parts, uint32_t n_per, const uint32_t *idxs) {
    for (uint32_t p = 0; p < n_parts; ++p) {
        const uint32_t *ix = idxs + (size_t) p * n_per;
        for (uint32_t j = 1; j < n_per; ++j) {
            if (ix[j] != ix[0] + j) return false;
        }
    }
    return true;
}

/* can a token take cell i? yes if it is empty, or held by one sequence alone whose sliding window
 * no longer reaches it (llama.cpp always compares with that sequence's max position + 1) */
static inline bool cell_usable(const lx_kv_meta *kv, const lx_cells *c, uint32_t i) {
    if (lx_cell_is_empty(c, i)) return true;
    if (kv->swa_type == LX_SWA_NONE || lx_cell_seq_count(c, i) != 1) return false;
    const lx_seq_id s = lx_cell_seq_get(c, i);
    return lx_is_masked_swa(kv->n_swa, kv->swa_type, lx_cell_pos_get(c, i), lx_cells_seq_pos_max(c, s) + 1);
}

lx_status lx_find_slot(const lx_kv_meta *kv, const lx_ubatch_view *ub, bool cont,
                       uint32_t *strm, uint32_t *idxs) {
    const uint32_t n_parts = lx_slot_n_parts(kv, ub);
    assert(n_parts > 0 && ub->n_tokens % n_parts == 0);
    const uint32_t n_tokens = ub->n_tokens / n_parts;

    for (uint32_t p = 0; p < n_parts; ++p) {
        const uint32_t st = kv->n_stream > 1 ? kv->seq_to_stream[ub->seq_id_unq[p]] : 0;
        const lx_cells *c = kv->cells[st];
        const uint32_t size = lx_cells_size(c);
        uint32_t *out = idxs + (size_t) p * n_tokens;
        uint32_t n_found = 0;

        strm[p] = st;
        if (n_tokens > size) return LX_ERR_NO_SLOT;

        uint32_t head = kv->heads[st];
        /* many free cells before the head: better to search from the start and fill them */
        if (head > lx_cells_get_used(c) + 2 * n_tokens) head = 0;

        const uint32_t n_test = cont ? n_tokens : 1;
        uint32_t n_tested = 0;
        for (;;) {
            if (head + n_test > size) {
                n_tested += size - head;
                head = 0;
                continue;
            }
            for (uint32_t j = 0; j < n_test; ++j) {
                const uint32_t i = head++;
                n_tested++;
                if (cell_usable(kv, c, i)) {
                    out[n_found++] = i;
                } else if (cont) {
                    break;
                }
            }
            if (n_found == n_tokens) break;
            if (cont) n_found = 0;
            if (n_tested >= size) return LX_ERR_NO_SLOT;
        }
    }
    return LX_OK;
}

/* a journal of cell states overwritten during prepare, replayed backwards to undo it */
typedef struct {
    uint32_t      *strm;
    uint32_t      *idx;
    lx_cell_state *state;
    size_t         n, cap;
} journal;

static lx_status journal_push(journal *jr, const lx_kv_meta *kv, uint32_t st, uint32_t i) {
    if (!jr) return LX_OK;
    if (jr->n == jr->cap) {
        const size_t cap = jr->cap ? 2 * jr->cap : 256;
        uint32_t *s = realloc(jr->strm, cap * sizeof(uint32_t));
        if (!s) return LX_ERR_NOMEM;
        jr->strm = s;
        uint32_t *x = realloc(jr->idx, cap * sizeof(uint32_t));
        if (!x) return LX_ERR_NOMEM;
        jr->idx = x;
        lx_cell_state *y = realloc(jr->state, cap * sizeof(lx_cell_state));
        if (!y) return LX_ERR_NOMEM;
        jr->state = y;
        jr->cap = cap;
    }
    jr->strm[jr->n] = st;
    jr->idx[jr->n] = i;
    lx_cells_cp(kv->cells[st], &i, 1, &jr->state[jr->n]);
    jr->n++;
    return LX_OK;
}

static lx_status apply_impl(const lx_kv_meta *kv, const lx_ubatch_view *ub,
                            const uint32_t *strm, const uint32_t *idxs, journal *jr) {
    const uint32_t n_parts = lx_slot_n_parts(kv, ub);
    const uint32_t n_per = ub->n_tokens / n_parts;

    /* room for every new (sequence, cell) entry first, so nothing below can fail half-way */
    uint64_t n_members = 0;
    for (uint32_t t = 0; t < ub->n_tokens; ++t) n_members += (uint64_t) lx_seq_bits_count(&ub->seq[t]);
    for (uint32_t p = 0; p < n_parts; ++p) {
        if (lx_cells_reserve(kv->cells[strm[p]], n_members) != LX_OK) return LX_ERR_NOMEM;
    }

    /* the largest position each sequence loses to an overwrite (only SWA caches overwrite) */
    lx_pos max_rm[LX_MAX_SEQ];
    bool any_rm = false;
    for (int s = 0; s < LX_MAX_SEQ; ++s) max_rm[s] = -1;

    for (uint32_t p = 0; p < n_parts; ++p) {
        lx_cells *c = kv->cells[strm[p]];
        for (uint32_t j = 0; j < n_per; ++j) {
            const uint32_t t = p * n_per + j;
            const uint32_t i = idxs[t];
            if (journal_push(jr, kv, strm[p], i) != LX_OK) return LX_ERR_NOMEM;
            if (!lx_cell_is_empty(c, i)) {
                const lx_seq_id s = lx_cell_seq_get(c, i);
                const lx_pos pi = lx_cell_pos_get(c, i);
                if (pi > max_rm[s]) max_rm[s] = pi;
                any_rm = true;
                lx_cell_rm(c, i);
            }
            lx_cell_pos_set(c, i, ub->pos[t]);
            lx_cell_ext_set(c, i, (lx_cell_ext){ 0, 0, ub->token ? ub->token[t] : LX_TOKEN_NULL });
            for (int k = 0; k < LX_SEQ_WORDS; ++k) {
                for (uint64_t w = ub->seq[t].w[k]; w; w &= w - 1) {
                    lx_cell_seq_add(c, i, k * 64 + __builtin_ctzll(w));
                }
            }
        }
    }

    /* keep every sequence a contiguous range: purge what lies below an overwritten position */
    for (int s = 0; any_rm && s < LX_MAX_SEQ; ++s) {
        if (max_rm[s] < 0) continue;
        const uint32_t st = kv->seq_to_stream[s];
        lx_cells *c = kv->cells[st];
        const lx_pos pmin = lx_cells_seq_pos_min(c, s);
        if (pmin < 0 || pmin > max_rm[s]) continue;
        if (jr) {
            const lx_pos *pos = lx_cells_pos_data(c);
            for (uint32_t i = 0; i < lx_cells_size(c); ++i) {
                if (pos[i] >= pmin && pos[i] <= max_rm[s] && lx_cell_seq_has(c, i, s)) {
                    if (journal_push(jr, kv, st, i) != LX_OK) return LX_ERR_NOMEM;
                }
            }
        }
        lx_cells_seq_rm(c, s, pmin, max_rm[s] + 1, &kv->heads[st]);
    }

    for (uint32_t p = 0; p < n_parts; ++p) {
        kv->heads[strm[p]] = idxs[(size_t) p * n_per + n_per - 1] + 1;
    }
    return LX_OK;
}

lx_status lx_apply_ubatch(const lx_kv_meta *kv, const lx_ubatch_view *ub,
                          const uint32_t *strm, const uint32_t *idxs) {
    return apply_impl(kv, ub, strm, idxs, NULL);
}

lx_status lx_prepare(const lx_kv_meta *kv, const lx_ubatch_view *ubs, uint32_t n_ubatches, bool cont,
                     uint32_t *strm_out, uint32_t *idxs_out) {
    lx_status st = LX_OK;
    journal jr = { 0 };
    uint32_t *heads_old = malloc((size_t) kv->n_stream * sizeof(uint32_t));
    if (!heads_old) return LX_ERR_NOMEM;
    memcpy(heads_old, kv->heads, (size_t) kv->n_stream * sizeof(uint32_t));

    size_t o_strm = 0, o_idx = 0;
    for (uint32_t u = 0; u < n_ubatches && st == LX_OK; ++u) {
        const lx_ubatch_view *ub = &ubs[u];
        st = lx_find_slot(kv, ub, cont, strm_out + o_strm, idxs_out + o_idx);
        if (st != LX_OK) break;
        st = apply_impl(kv, ub, strm_out + o_strm, idxs_out + o_idx, &jr);
        o_strm += lx_slot_n_parts(kv, ub);
        o_idx += ub->n_tokens;
    }

    /* undo, newest first, so every cell ends in its oldest recorded state */
    for (size_t k = jr.n; k-- > 0;) {
        const lx_status rs = lx_cells_set(kv->cells[jr.strm[k]], &jr.idx[k], 1, &jr.state[k]);
        (void) rs;
        assert(rs == LX_OK); /* restoring never needs more entries than the cells held before */
    }
    memcpy(kv->heads, heads_old, (size_t) kv->n_stream * sizeof(uint32_t));

    free(heads_old);
    free(jr.strm);
    free(jr.idx);
    free(jr.state);
    return st;
}
