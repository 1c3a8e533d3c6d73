/* slot_finder.h: where the tokens of a ubatch go in the KV cache (llama_kv_cache::find_slot,
 * apply_ubatch and prepare).
 *
 * The cells of a stream form a ring searched from the stream's head:
 *
 *        head
 *         v
 *   [x x x . . x . . . . x x]      x = used, . = free (or SWA-masked for its only sequence)
 *            ^-----------^ -> wraps to 0, gives up after testing every cell once
 *
 * With one stream per sequence (n_stream > 1) the ubatch holds n_seqs_unq equal groups of tokens, one
 * sequence each, and each group is placed in its sequence's stream. A slot is described by
 *   strm [n_parts]            the stream of each part
 *   idxs [n_parts * n_per]    the cells of part p in idxs[p*n_per .. (p+1)*n_per), in token order
 */
#ifndef LX_SLOT_FINDER_H
#define LX_SLOT_FINDER_H

#include "common.h"
#include "kv_cells.h"

/* the metadata side of one KV cache: its streams, their heads, the sequence -> stream map */
typedef struct {
    lx_cells       **cells;          /* [n_stream] */
    uint32_t        *heads;          /* [n_stream] */
    const uint32_t  *seq_to_stream;  /* [LX_MAX_SEQ] */
    uint32_t         n_stream;
    int32_t          n_swa;
    lx_swa_type      swa_type;
} lx_kv_meta;

/* one ubatch, as far as slots are concerned */
typedef struct {
    uint32_t           n_tokens;
    const lx_pos      *pos;          /* [n_tokens] */
    const lx_seq_bits *seq;          /* [n_tokens] every sequence of each token */
    const lx_token    *token;        /* [n_tokens] or NULL; stored in the cells' ext.tok */
    uint32_t           n_seqs_unq;
    const lx_seq_id   *seq_id_unq;   /* [n_seqs_unq] */
} lx_ubatch_view;

/* number of parts of a slot for this ubatch: n_seqs_unq with several streams, else 1 */
uint32_t lx_slot_n_parts(const lx_kv_meta *kv, const lx_ubatch_view *ub);

/* find cells for the ubatch without changing anything; cont: the cells of each part must be
 * consecutive. Returns LX_OK and fills strm [n_parts] and idxs [n_tokens], or LX_ERR_NO_SLOT. */
lx_status lx_find_slot(const lx_kv_meta *kv, const lx_ubatch_view *ub, bool cont,
                       uint32_t *strm, uint32_t *idxs);

/* write the ubatch into the slot: overwritten cells are emptied, then every sequence that lost a
 * cell is purged up to the largest position it lost, so it stays a contiguous range; each head moves
 * past its part. LX_ERR_NOMEM (nothing changed) if the position pool cannot grow. */
lx_status lx_apply_ubatch(const lx_kv_meta *kv, const lx_ubatch_view *ub,
                          const uint32_t *strm, const uint32_t *idxs);

/* place every ubatch in turn (find_slot + apply), then restore every touched cell and every head,
 * so the cells end exactly as they began. Returns LX_OK with strm_out [sum of parts] and idxs_out
 * [sum of n_tokens] filled, or LX_ERR_NO_SLOT / LX_ERR_NOMEM with nothing changed. */
lx_status lx_prepare(const lx_kv_meta *kv, const lx_ubatch_view *ubs, uint32_t n_ubatches, bool cont,
                     uint32_t *strm_out, uint32_t *idxs_out);

/* true if the cells of every part are consecutive (slot_info::is_contiguous) */
bool lx_slot_is_contiguous(uint32_t n_parts, uint32_t n_per, const uint32_t *idxs);

#endif /* LX_SLOT_FINDER_H */
