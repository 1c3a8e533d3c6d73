/* common.h: types shared by every unit of the llamax C core.
 *
 * Plain C11, no Python.h. Each unit (kv_cells, slot_finder, kq_mask, rope,
 * quants, attention) includes only this header and its own.
 */
#ifndef LX_COMMON_H
#define LX_COMMON_H

#include <stdbool.h>
#include <stdint.h>

typedef int32_t lx_pos;     /* token position; -1 marks an empty cell   */
typedef int32_t lx_seq_id;  /* sequence id in [0, LX_MAX_SEQ)           */
typedef int32_t lx_token;   /* token id; LX_TOKEN_NULL when unknown     */

#define LX_MAX_SEQ      256
#define LX_SEQ_WORDS    (LX_MAX_SEQ / 64)   /* uint64 words in a seq bitset */
#define LX_TOKEN_NULL   (-1)
#define LX_POS_MAX      INT32_MAX

/* a set of sequence ids, one bit per id */
typedef struct { uint64_t w[LX_SEQ_WORDS]; } lx_seq_bits;

typedef enum {
    LX_OK           = 0,
    LX_ERR_NO_SLOT  = 1,   /* the ubatch does not fit (llama_decode's 1) */
    LX_ERR_NOMEM    = 2,   /* an allocation failed                       */
    LX_ERR_INVALID  = 3,   /* an argument is out of range                */
} lx_status;

/* sliding-window attention types, as llama_swa_type */
typedef enum {
    LX_SWA_NONE      = 0,
    LX_SWA_STANDARD  = 1,
    LX_SWA_CHUNKED   = 2,
    LX_SWA_SYMMETRIC = 3,
} lx_swa_type;

/* true if a query at position p1 must not see a key at position p0 because of
 * the sliding window (llama_hparams::is_masked_swa). */
static inline bool lx_is_masked_swa(int32_t n_swa, lx_swa_type swa_type, lx_pos p0, lx_pos p1) {
    switch (swa_type) {
        case LX_SWA_NONE:
            return false;
        case LX_SWA_STANDARD:
            return p1 - p0 >= n_swa;
        case LX_SWA_CHUNKED:
            return p0 < (p1 / n_swa) * n_swa;
        case LX_SWA_SYMMETRIC: {
            const int32_t half = n_swa / 2;
            const int32_t d = p1 - p0;
            return d < -half || d > half;
        }
    }
    return false;
}

static inline bool lx_seq_bits_test(const lx_seq_bits *b, lx_seq_id s) {
    return (b->w[s >> 6] >> (s & 63)) & 1u;
}

static inline void lx_seq_bits_set(lx_seq_bits *b, lx_seq_id s) {
    b->w[s >> 6] |= (uint64_t) 1 << (s & 63);
}

static inline void lx_seq_bits_reset(lx_seq_bits *b, lx_seq_id s) {
    b->w[s >> 6] &= ~((uint64_t) 1 << (s & 63));
}

static inline int lx_seq_bits_count(const lx_seq_bits *b) {
    int n = 0;
    for (int k = 0; k < LX_SEQ_WORDS; ++k) n += __builtin_popcountll(b->w[k]);
    return n;
}

static inline bool lx_seq_bits_none(const lx_seq_bits *b) {
    uint64_t any = 0;
    for (int k = 0; k < LX_SEQ_WORDS; ++k) any |= b->w[k];
    return any == 0;
}

/* lowest sequence id in the set, -1 if empty */
static inline lx_seq_id lx_seq_bits_first(const lx_seq_bits *b) {
    for (int k = 0; k < LX_SEQ_WORDS; ++k) {
        if (b->w[k]) return k * 64 + __builtin_ctzll(b->w[k]);
    }
    return -1;
}

#endif /* LX_COMMON_H */
