/* kv_cells.c: see kv_cells.h.
 *
 * The per-sequence position multisets are treaps (key = position, with a count) whose nodes come
 * from one pool per table, addressed by index so the pool can grow with realloc. The pool always has
 * room for one node per (sequence, cell) membership: every op that adds memberships reserves first,
 * so the later inserts cannot fail and a failed reservation leaves the table unchanged.
 */
#include "kv_cells.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define NIL (-1)

typedef struct {
    lx_pos   key;
    uint32_t cnt;
    int32_t  l, r;
    uint32_t prio;
} lx_node;

struct lx_cells {
    uint32_t     n;
    lx_pos      *pos;     /* [n] */
    lx_pos      *shift;   /* [n] */
    lx_cell_ext *ext;     /* [n] */
    lx_seq_bits *seq;     /* [n] */
    uint64_t    *used_bits; /* [(n + 63) / 64] */
    uint32_t     used;
    bool         has_shift;

    /* position multisets */
    int32_t      root[LX_MAX_SEQ];
    uint32_t     n_cells_seq[LX_MAX_SEQ]; /* cells holding each sequence */
    lx_node     *pool;
    uint32_t     pool_cap;
    uint64_t     n_members;               /* (seq, cell) memberships: an upper bound of nodes in use */
    int32_t      free_head;               /* free list through .l */
    uint32_t     rng;
};

/* ---------------------------------------------------------------- treap ---- */

static uint32_t next_prio(lx_cells *c) {
    uint32_t x = c->rng;
    x ^= x << 13; x ^= x >> 17; x ^= x << 5;
    c->rng = x;
    return x;
}

static int32_t node_new(lx_cells *c, lx_pos key) {
    const int32_t k = c->free_head;
    assert(k != NIL && "pool exhausted: reserve before inserting");
    c->free_head = c->pool[k].l;
    c->pool[k] = (lx_node){ .key = key, .cnt = 1, .l = NIL, .r = NIL, .prio = next_prio(c) };
    return k;
}

static void node_free(lx_cells *c, int32_t k) {
    c->pool[k].l = c->free_head;
    c->free_head = k;
}

/* split t into keys < key (*a) and keys >= key (*b) */
static void treap_split(lx_node *p, int32_t t, lx_pos key, int32_t *a, int32_t *b) {
    if (t == NIL) { *a = *b = NIL; return; }
    if (p[t].key < key) {
        treap_split(p, p[t].r, key, &p[t].r, b);
        *a = t;
    } else {
        treap_split(p, p[t].l, key, a, &p[t].l);
        *b = t;
    }
}

/* every key of a is below every key of b */
static int32_t treap_merge(lx_node *p, int32_t a, int32_t b) {
    if (a == NIL) return b;
    if (b == NIL) return a;
    if (p[a].prio > p[b].prio) {
        p[a].r = treap_merge(p, p[a].r, b);
        return a;
    }
    p[b].l = treap_merge(p, a, p[b].l);
    return b;
}

static void mset_inc(lx_cells *c, lx_seq_id s, lx_pos key) {
    lx_node *p = c->pool;
    for (int32_t t = c->root[s]; t != NIL; t = key < p[t].key ? p[t].l : p[t].r) {
        if (p[t].key == key) { p[t].cnt++; return; }
    }
    const int32_t k = node_new(c, key);
    p = c->pool;
    int32_t a, b;
    treap_split(p, c->root[s], key, &a, &b);
    c->root[s] = treap_merge(p, treap_merge(p, a, k), b);
}

static int32_t treap_erase(lx_cells *c, int32_t t, lx_pos key) {
    lx_node *p = c->pool;
    assert(t != NIL && "position not in the multiset");
    if (p[t].key == key) {
        const int32_t m = treap_merge(p, p[t].l, p[t].r);
        node_free(c, t);
        return m;
    }
    if (key < p[t].key) p[t].l = treap_erase(c, p[t].l, key);
    else                p[t].r = treap_erase(c, p[t].r, key);
    return t;
}

static void mset_dec(lx_cells *c, lx_seq_id s, lx_pos key) {
    lx_node *p = c->pool;
    for (int32_t t = c->root[s]; t != NIL; t = key < p[t].key ? p[t].l : p[t].r) {
        if (p[t].key == key) {
            if (--p[t].cnt == 0) c->root[s] = treap_erase(c, c->root[s], key);
            return;
        }
    }
    assert(0 && "position not in the multiset");
}

lx_status lx_cells_reserve(lx_cells *c, uint64_t extra) {
    const uint64_t need = c->n_members + extra;
    if (need <= c->pool_cap) return LX_OK;
    if (need > INT32_MAX) return LX_ERR_NOMEM;
    uint64_t cap = c->pool_cap ? c->pool_cap : 64;
    while (cap < need) cap *= 2;
    if (cap > INT32_MAX) cap = INT32_MAX;
    lx_node *p = realloc(c->pool, cap * sizeof(lx_node));
    if (!p) return LX_ERR_NOMEM;
    /* chain the new nodes in front of the free list */
    for (uint64_t k = cap; k-- > c->pool_cap;) {
        p[k].l = c->free_head;
        c->free_head = (int32_t) k;
    }
    c->pool = p;
    c->pool_cap = (uint32_t) cap;
    return LX_OK;
}

/* ------------------------------------------------------------ bookkeeping ---- */

static inline void used_insert(lx_cells *c, uint32_t i) {
    assert(!((c->used_bits[i >> 6] >> (i & 63)) & 1));
    c->used_bits[i >> 6] |= (uint64_t) 1 << (i & 63);
    c->used++;
}

static inline void used_erase(lx_cells *c, uint32_t i) {
    assert((c->used_bits[i >> 6] >> (i & 63)) & 1);
    c->used_bits[i >> 6] &= ~((uint64_t) 1 << (i & 63));
    c->used--;
}

/* add / remove the position of cell i to / from the multiset of each of its sequences */
static void seq_pos_add(lx_cells *c, uint32_t i) {
    for (int k = 0; k < LX_SEQ_WORDS; ++k) {
        for (uint64_t w = c->seq[i].w[k]; w; w &= w - 1) {
            mset_inc(c, k * 64 + __builtin_ctzll(w), c->pos[i]);
        }
    }
}

static void seq_pos_rm(lx_cells *c, uint32_t i) {
    for (int k = 0; k < LX_SEQ_WORDS; ++k) {
        for (uint64_t w = c->seq[i].w[k]; w; w &= w - 1) {
            mset_dec(c, k * 64 + __builtin_ctzll(w), c->pos[i]);
        }
    }
}

/* drop every membership of cell i (the multisets must already be updated) */
static void seq_clear(lx_cells *c, uint32_t i) {
    for (int k = 0; k < LX_SEQ_WORDS; ++k) {
        for (uint64_t w = c->seq[i].w[k]; w; w &= w - 1) {
            c->n_cells_seq[k * 64 + __builtin_ctzll(w)]--;
            c->n_members--;
        }
        c->seq[i].w[k] = 0;
    }
}

static void cell_empty(lx_cells *c, uint32_t i) {
    c->pos[i] = -1;
    c->shift[i] = 0;
    c->ext[i] = (lx_cell_ext){ 0, 0, LX_TOKEN_NULL };
    used_erase(c, i);
}

/* ------------------------------------------------------------------ table ---- */

lx_cells *lx_cells_new(uint32_t n) {
    lx_cells *c = calloc(1, sizeof(lx_cells));
    if (!c) return NULL;
    c->n = n;
    const size_t nn = n ? n : 1;
    c->pos = malloc(nn * sizeof(lx_pos));
    c->shift = malloc(nn * sizeof(lx_pos));
    c->ext = malloc(nn * sizeof(lx_cell_ext));
    c->seq = malloc(nn * sizeof(lx_seq_bits));
    c->used_bits = malloc(((nn + 63) / 64) * sizeof(uint64_t));
    c->free_head = NIL;
    c->rng = 0x9E3779B9u;
    if (!c->pos || !c->shift || !c->ext || !c->seq || !c->used_bits || lx_cells_reserve(c, nn) != LX_OK) {
        lx_cells_free(c);
        return NULL;
    }
    lx_cells_reset(c);
    return c;
}

void lx_cells_free(lx_cells *c) {
    if (!c) return;
    free(c->pos);
    free(c->shift);
    free(c->ext);
    free(c->seq);
    free(c->used_bits);
    free(c->pool);
    free(c);
}

void lx_cells_reset(lx_cells *c) {
    for (uint32_t i = 0; i < c->n; ++i) {
        c->pos[i] = -1;
        c->shift[i] = 0;
        c->ext[i] = (lx_cell_ext){ 0, 0, LX_TOKEN_NULL };
    }
    memset(c->seq, 0, (size_t) c->n * sizeof(lx_seq_bits));
    memset(c->used_bits, 0, ((c->n + 63) / 64) * sizeof(uint64_t));
    c->used = 0;
    c->has_shift = false;
    for (int s = 0; s < LX_MAX_SEQ; ++s) {
        c->root[s] = NIL;
        c->n_cells_seq[s] = 0;
    }
    c->n_members = 0;
    c->free_head = NIL;
    for (uint32_t k = c->pool_cap; k-- > 0;) {
        c->pool[k].l = c->free_head;
        c->free_head = (int32_t) k;
    }
}

void lx_cells_reset_shift(lx_cells *c) {
    memset(c->shift, 0, (size_t) c->n * sizeof(lx_pos));
    c->has_shift = false;
}

uint32_t lx_cells_size(const lx_cells *c) { return c->n; }
uint32_t lx_cells_get_used(const lx_cells *c) { return c->used; }
bool lx_cells_get_has_shift(const lx_cells *c) { return c->has_shift; }
const lx_pos *lx_cells_pos_data(const lx_cells *c) { return c->pos; }
const lx_pos *lx_cells_shift_data(const lx_cells *c) { return c->shift; }
const lx_seq_bits *lx_cells_seq_data(const lx_cells *c) { return c->seq; }

uint32_t lx_cells_used_min(const lx_cells *c) {
    const uint32_t nw = (c->n + 63) / 64;
    for (uint32_t k = 0; k < nw; ++k) {
        if (c->used_bits[k]) return k * 64 + __builtin_ctzll(c->used_bits[k]);
    }
    return 0;
}

uint32_t lx_cells_used_max_p1(const lx_cells *c) {
    for (uint32_t k = (c->n + 63) / 64; k-- > 0;) {
        if (c->used_bits[k]) return k * 64 + (63 - __builtin_clzll(c->used_bits[k])) + 1;
    }
    return 0;
}

/* ------------------------------------------------------------------- cell ---- */

bool lx_cell_is_empty(const lx_cells *c, uint32_t i) {
    assert(i < c->n);
    return c->pos[i] == -1;
}

lx_pos lx_cell_pos_get(const lx_cells *c, uint32_t i) {
    assert(i < c->n && c->pos[i] != -1);
    return c->pos[i];
}

lx_pos lx_cell_get_shift(const lx_cells *c, uint32_t i) {
    assert(i < c->n);
    return c->shift[i];
}

lx_cell_ext lx_cell_ext_get(const lx_cells *c, uint32_t i) {
    assert(i < c->n);
    return c->ext[i];
}

void lx_cell_ext_set(lx_cells *c, uint32_t i, lx_cell_ext ext) {
    assert(i < c->n);
    c->ext[i] = ext;
}

int lx_cell_seq_count(const lx_cells *c, uint32_t i) {
    assert(i < c->n);
    return lx_seq_bits_count(&c->seq[i]);
}

bool lx_cell_seq_has(const lx_cells *c, uint32_t i, lx_seq_id s) {
    assert(i < c->n && s >= 0 && s < LX_MAX_SEQ);
    return lx_seq_bits_test(&c->seq[i], s);
}

lx_seq_id lx_cell_seq_get(const lx_cells *c, uint32_t i) {
    assert(lx_seq_bits_count(&c->seq[i]) == 1);
    return lx_seq_bits_first(&c->seq[i]);
}

void lx_cell_rm(lx_cells *c, uint32_t i) {
    assert(i < c->n && c->pos[i] != -1);
    seq_pos_rm(c, i);
    seq_clear(c, i);
    cell_empty(c, i);
}

void lx_cell_pos_set(lx_cells *c, uint32_t i, lx_pos p) {
    assert(i < c->n && c->pos[i] == -1 && lx_seq_bits_none(&c->seq[i]));
    assert(p >= 0);
    c->pos[i] = p;
    used_insert(c, i);
}

lx_status lx_cell_seq_add(lx_cells *c, uint32_t i, lx_seq_id s) {
    assert(i < c->n && c->pos[i] != -1 && !lx_seq_bits_test(&c->seq[i], s));
    if (lx_cells_reserve(c, 1) != LX_OK) return LX_ERR_NOMEM;
    lx_seq_bits_set(&c->seq[i], s);
    c->n_cells_seq[s]++;
    c->n_members++;
    mset_inc(c, s, c->pos[i]);
    return LX_OK;
}

bool lx_cell_seq_rm(lx_cells *c, uint32_t i, lx_seq_id s) {
    assert(i < c->n && c->pos[i] != -1 && lx_seq_bits_test(&c->seq[i], s));
    lx_seq_bits_reset(&c->seq[i], s);
    c->n_cells_seq[s]--;
    c->n_members--;
    mset_dec(c, s, c->pos[i]);
    if (lx_seq_bits_none(&c->seq[i])) {
        cell_empty(c, i);
        return true;
    }
    return false;
}

bool lx_cell_seq_keep(lx_cells *c, uint32_t i, lx_seq_id s) {
    assert(i < c->n);
    if (lx_seq_bits_test(&c->seq[i], s)) {
        /* drop the other sequences of the cell */
        for (int k = 0; k < LX_SEQ_WORDS; ++k) {
            for (uint64_t w = c->seq[i].w[k]; w; w &= w - 1) {
                const lx_seq_id o = k * 64 + __builtin_ctzll(w);
                if (o == s) continue;
                mset_dec(c, o, c->pos[i]);
                c->n_cells_seq[o]--;
                c->n_members--;
            }
        }
        memset(&c->seq[i], 0, sizeof(lx_seq_bits));
        lx_seq_bits_set(&c->seq[i], s);
        return false;
    }
    if (!lx_seq_bits_none(&c->seq[i])) {
        seq_pos_rm(c, i);
        seq_clear(c, i);
        cell_empty(c, i);
        return true;
    }
    assert(c->pos[i] == -1);
    return false;
}

bool lx_cell_pos_add(lx_cells *c, uint32_t i, lx_pos d) {
    assert(i < c->n && c->pos[i] != -1);
    seq_pos_rm(c, i);
    c->pos[i] += d;
    c->shift[i] += d;
    c->has_shift = true;
    if (c->pos[i] < 0) {
        seq_clear(c, i);
        cell_empty(c, i);
        return true;
    }
    seq_pos_add(c, i);
    return false;
}

void lx_cell_pos_div(lx_cells *c, uint32_t i, int d) {
    assert(i < c->n && c->pos[i] != -1 && d > 0);
    const lx_pos p_old = c->pos[i];
    seq_pos_rm(c, i);
    c->pos[i] /= d;
    /* note: llama.cpp records p_old - p_new here; the K-shift must rotate by the change p_new - p_old */
    c->shift[i] += c->pos[i] - p_old;
    seq_pos_add(c, i);
    c->has_shift = true;
}

/* --------------------------------------------------------------- sequence ---- */

lx_pos lx_cells_seq_pos_min(const lx_cells *c, lx_seq_id s) {
    assert(s >= 0 && s < LX_MAX_SEQ);
    int32_t t = c->root[s];
    if (t == NIL) return -1;
    while (c->pool[t].l != NIL) t = c->pool[t].l;
    return c->pool[t].key;
}

lx_pos lx_cells_seq_pos_max(const lx_cells *c, lx_seq_id s) {
    assert(s >= 0 && s < LX_MAX_SEQ);
    int32_t t = c->root[s];
    if (t == NIL) return -1;
    while (c->pool[t].r != NIL) t = c->pool[t].r;
    return c->pool[t].key;
}

uint32_t lx_cells_seq_n_cells(const lx_cells *c, lx_seq_id s) {
    assert(s >= 0 && s < LX_MAX_SEQ);
    return c->n_cells_seq[s];
}

/* ------------------------------------------------------------------ range ---- */

static inline void norm_range(lx_pos *p0, lx_pos *p1) {
    if (*p0 < 0) *p0 = 0;
    if (*p1 < 0) *p1 = LX_POS_MAX;
}

static inline bool pos_in(const lx_cells *c, uint32_t i, lx_pos p0, lx_pos p1) {
    return c->pos[i] >= p0 && c->pos[i] < p1;
}

bool lx_cells_seq_rm(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, uint32_t *head) {
    norm_range(&p0, &p1);
    uint32_t new_head = c->n;
    for (uint32_t i = 0; i < c->n; ++i) {
        if (!pos_in(c, i, p0, p1)) continue;
        if (s < 0) {
            lx_cell_rm(c, i);
            if (new_head == c->n) new_head = i;
        } else if (lx_seq_bits_test(&c->seq[i], s) && lx_cell_seq_rm(c, i, s)) {
            if (new_head == c->n) new_head = i;
        }
    }
    /* a freed cell below the head: the next search starts there */
    if (new_head != c->n && new_head < *head) *head = new_head;
    return true;
}

lx_status lx_cells_seq_cp(lx_cells *c, lx_seq_id src, lx_seq_id dst, lx_pos p0, lx_pos p1) {
    if (src == dst) return LX_OK;
    norm_range(&p0, &p1);
    if (lx_cells_reserve(c, c->n_cells_seq[src]) != LX_OK) return LX_ERR_NOMEM;
    for (uint32_t i = 0; i < c->n; ++i) {
        if (!pos_in(c, i, p0, p1)) continue;
        if (lx_seq_bits_test(&c->seq[i], src) && !lx_seq_bits_test(&c->seq[i], dst)) {
            lx_cell_seq_add(c, i, dst);
        }
    }
    return LX_OK;
}

lx_status lx_cells_seq_cp_stream(lx_cells *dst_c, const lx_cells *src_c, lx_seq_id src, lx_seq_id dst) {
    assert(dst_c != src_c && dst_c->n == src_c->n);
    if (lx_cells_reserve(dst_c, src_c->n_cells_seq[src]) != LX_OK) return LX_ERR_NOMEM;
    lx_cells_reset(dst_c);
    for (uint32_t i = 0; i < src_c->n; ++i) {
        if (!lx_seq_bits_test(&src_c->seq[i], src)) continue;
        const lx_pos shift = src_c->shift[i];
        /* the cell enters at its unshifted position, then takes the same pending shift */
        lx_cell_pos_set(dst_c, i, src_c->pos[i] - shift);
        lx_cell_seq_add(dst_c, i, dst);
        if (shift != 0) lx_cell_pos_add(dst_c, i, shift);
        dst_c->ext[i] = src_c->ext[i];
    }
    return LX_OK;
}

void lx_cells_seq_keep(lx_cells *c, lx_seq_id s, uint32_t *head) {
    uint32_t new_head = c->n;
    for (uint32_t i = 0; i < c->n; ++i) {
        if (lx_cell_seq_keep(c, i, s) && new_head == c->n) new_head = i;
    }
    if (new_head != c->n && new_head < *head) *head = new_head;
}

void lx_cells_seq_add(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, lx_pos shift, uint32_t *head) {
    if (shift == 0) return;
    norm_range(&p0, &p1);
    if (p0 == p1) return;
    uint32_t new_head = c->n;
    for (uint32_t i = 0; i < c->n; ++i) {
        if (!pos_in(c, i, p0, p1) || !lx_seq_bits_test(&c->seq[i], s)) continue;
        if (lx_cell_pos_add(c, i, shift) && new_head == c->n) new_head = i;
    }
    /* a freed cell: the next search starts there; otherwise from the beginning */
    *head = new_head != c->n ? new_head : 0;
}

void lx_cells_seq_div(lx_cells *c, lx_seq_id s, lx_pos p0, lx_pos p1, int d) {
    assert(d > 0);
    if (d == 1) return;
    norm_range(&p0, &p1);
    if (p0 == p1) return;
    for (uint32_t i = 0; i < c->n; ++i) {
        if (!pos_in(c, i, p0, p1) || !lx_seq_bits_test(&c->seq[i], s)) continue;
        lx_cell_pos_div(c, i, d);
    }
}

/* ------------------------------------------------------- save / restore ---- */

void lx_cells_cp(const lx_cells *c, const uint32_t *idxs, uint32_t n, lx_cell_state *out) {
    for (uint32_t j = 0; j < n; ++j) {
        const uint32_t i = idxs[j];
        assert(i < c->n);
        out[j].pos = c->pos[i];
        out[j].shift = c->shift[i];
        out[j].ext = c->ext[i];
        out[j].seq = c->seq[i];
    }
}

lx_status lx_cells_set(lx_cells *c, const uint32_t *idxs, uint32_t n, const lx_cell_state *in) {
    uint64_t extra = 0;
    for (uint32_t j = 0; j < n; ++j) extra += (uint64_t) lx_seq_bits_count(&in[j].seq);
    if (lx_cells_reserve(c, extra) != LX_OK) return LX_ERR_NOMEM;
    for (uint32_t j = 0; j < n; ++j) {
        const uint32_t i = idxs[j];
        assert(i < c->n);
        if (c->pos[i] != -1) lx_cell_rm(c, i);
        if (in[j].pos == -1) continue;
        lx_cell_pos_set(c, i, in[j].pos);
        c->shift[i] = in[j].shift;
        if (in[j].shift != 0) c->has_shift = true;
        c->ext[i] = in[j].ext;
        c->seq[i] = in[j].seq;
        for (int k = 0; k < LX_SEQ_WORDS; ++k) {
            for (uint64_t w = in[j].seq.w[k]; w; w &= w - 1) {
                c->n_cells_seq[k * 64 + __builtin_ctzll(w)]++;
                c->n_members++;
            }
        }
        seq_pos_add(c, i);
    }
    return LX_OK;
}
