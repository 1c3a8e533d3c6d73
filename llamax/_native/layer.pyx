# cython: language_level=3
"""The decoder layers of a dense model, each run by one native call (csrc/layer.h): norms,
projections, RoPE, the K/V stores into the cells the memory chose, attention over the cache,
the gated FFN and the residuals, with the GIL released for the whole stack.

Stack(layers) takes, per layer, its constants and its weights (float32 norms, and each product's
parts: (uint8 [rows, row_bytes] GGUF rows, ggml type), or (uint8 packed, ggml type, rows, True) for
gemm.pack_r8's layout of `rows` rows); Stack.forward(x, pos, views,
out_rows) runs every layer over one ubatch, views[il] being the memory's LayerView of layer il
(llamax.memory.LayerView: its K/V buffers from the ubatch's first stream, the cell of every
token, the KQ mask).
"""
import threading

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint32_t
from libc.stdlib cimport calloc, free

from llamax._native.moe cimport MoE
from llamax._native.product cimport LX_PRODUCT_NONE, lx_product_kind_of
from llamax._native.quants cimport lx_row_bytes, lx_type
from llamax._native.rope cimport LX_ROPE_NEOX, LX_ROPE_NORM, lx_pos, lx_rope_kind, lx_rope_params

cnp.import_array()

from llamax.threads import resolve_n_threads

#: gate activations: "silu" (llama), "gelu_table" (Gemma: ggml's f16 GELU table)
ACTS = {"silu": LX_ACT_SILU, "gelu_table": LX_ACT_GELU_TABLE}


def _set_team(bint on) -> None:
    """A testing aid: False runs a stack's layers with an OpenMP region per product instead of one
    team for the step (csrc/layer.h lx_layers_forward); the results are the same bits."""
    lx_layer_set_team(on)


def _team_runs() -> int:
    """A testing aid: how many stack calls of this process ran as one team (lx_layer_team_runs)."""
    return lx_layer_team_runs()


def rms_norm(x, w, float eps, n_threads=1, ref=False):
    """ggml's rms_norm times the weight over the last axis: a new float32 array (csrc/layer.h);
    ref: through the scalar reference (the same bits)."""
    cdef int nt = resolve_n_threads(n_threads)
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if x.ndim < 1 or w.ndim != 1 or w.shape[0] != x.shape[x.ndim - 1]:
        raise ValueError(f"x [..., n] and w [n] expected, got {x.shape} and {w.shape}")
    y = np.empty_like(x)
    cdef int64_t n = x.shape[x.ndim - 1], rows = x.size // n if n else 0
    cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef const float *wp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> w)
    cdef float *yp = <float *> cnp.PyArray_DATA(<cnp.ndarray> y)
    cdef bint use_ref = ref
    if rows:
        with nogil:
            if use_ref:
                lx_rms_norm_ref(xp, wp, yp, rows, n, eps)
            else:
                lx_rms_norm(xp, wp, yp, rows, n, eps, nt)
    return y


def gated(gu, int64_t n_ff, str act="silu", gelu_table=None, n_threads=1, ref=False):
    """act(gate) * up for gu = [gate | up] rows [n, 2 n_ff]: a new float32 [n, n_ff] (csrc/layer.h);
    ref: through the scalar reference (the same bits)."""
    cdef int nt = resolve_n_threads(n_threads)
    if act not in ACTS:
        raise ValueError(f"activation {act!r}, known: {sorted(ACTS)}")
    gu = np.ascontiguousarray(gu, dtype=np.float32)
    if gu.ndim != 2 or gu.shape[1] != 2 * n_ff:
        raise ValueError(f"gu must be [n, {2 * n_ff}], got {gu.shape}")
    keep = []
    cdef const float *tp = _f32(gelu_table, 65536, "gelu_table", keep)
    if ACTS[act] == LX_ACT_GELU_TABLE and tp == NULL:
        raise ValueError("the gelu_table activation needs its table")
    y = np.empty((gu.shape[0], n_ff), dtype=np.float32)
    cdef int64_t n = gu.shape[0]
    cdef lx_layer_act k = ACTS[act]
    cdef const float *gp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> gu)
    cdef float *yp = <float *> cnp.PyArray_DATA(<cnp.ndarray> y)
    cdef bint r = ref
    if n:
        with nogil:
            if r:
                lx_gated_ref(k, tp, gp, yp, n, n_ff)
            else:
                lx_gated(k, tp, gp, yp, n, n_ff, nt)
    return y


cdef const float *_f32(object a, int64_t n, str what, list keep) except? NULL:
    if a is None:
        return NULL
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{what}: expected float32 [{n}], got shape {a.shape}")
    keep.append(a)
    return <const float *> cnp.PyArray_DATA(<cnp.ndarray> a)


cdef int set_linear(lx_linear *l, object parts, int64_t n_in, int64_t n_out, str what, list keep) except -1:
    if not 1 <= len(parts) <= LX_LINEAR_MAX_PARTS:
        raise ValueError(f"{what}: 1 to {LX_LINEAR_MAX_PARTS} parts, got {len(parts)}")
    l.n_parts = len(parts)
    l.n_in, l.n_out = n_in, n_out
    cdef int64_t rows = 0
    for i, part in enumerate(parts):
        if len(part) not in (2, 4):
            raise ValueError(f"{what}: a part is (raw, type) or (packed, type, rows, r8)")
        raw, t = part[0], part[1]
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < 64 \
                or lx_product_kind_of(<lx_type> <int> int(t), 0) == LX_PRODUCT_NONE:
            raise ValueError(f"{what}: ggml type {t} has no native product")
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
            raise ValueError(f"{what}: a part must be C-contiguous uint8 [rows, row_bytes]")
        ti = int(t)
        rb = lx_row_bytes(<lx_type> <int> ti, n_in)
        if raw.shape[1] != rb:
            raise ValueError(f"{what}: rows of {raw.shape[1]} bytes, expected {rb}")
        n_rows, r8 = (raw.shape[0], False) if len(part) == 2 else (part[2], bool(part[3]))
        if r8 and (lx_product_kind_of(<lx_type> <int> ti, 1) == LX_PRODUCT_NONE or raw.shape[0] % 8
                   or not raw.shape[0] - 8 < n_rows <= raw.shape[0]):
            raise ValueError(f"{what}: not an r8 layout of {n_rows} rows of type {ti}")
        if not r8 and n_rows != raw.shape[0]:
            raise ValueError(f"{what}: {n_rows} rows given for {raw.shape[0]} GGUF rows")
        keep.append(raw)
        l.w[i] = cnp.PyArray_DATA(<cnp.ndarray> raw)
        l.type[i] = <lx_type> <int> ti
        l.rows[i] = n_rows
        l.r8[i] = 1 if r8 else 0
        rows += n_rows
    if rows != n_out:
        raise ValueError(f"{what}: {rows} rows in all, expected {n_out}")
    return 0


cdef int _rope_params(lx_rope_params *rp, object r, int il, list keep) except -1:
    """rp from a llamax.rope.RoPE, None (a layer without RoPE: n_rot 0), or (n_rot, freq_base, freq_scale,
    kind) for a plain RoPE."""
    rp.n_rot, rp.freq_base, rp.freq_scale, rp.kind = 0, 10000.0, 1.0, LX_ROPE_NORM
    rp.freq_factors, rp.ext_factor, rp.attn_factor = NULL, 0.0, 1.0
    rp.corr_dims[0], rp.corr_dims[1] = 0.0, 0.0
    if r is None:
        return 0
    if isinstance(r, tuple):
        n_rot, base, scale, kind = r
    else:
        n_rot, base, scale, kind = r.n_rot, r.freq_base, r.freq_scale, r.mode
        rp.ext_factor, rp.attn_factor = r.ext_factor, r.attn_factor
        rp.corr_dims[0], rp.corr_dims[1] = r.corr_dims
        if r.factors is not None:
            rp.freq_factors = _f32(r.factors, n_rot // 2, "rope freq_factors", keep)
    if kind not in (0, 2):
        raise ValueError(f"layer {il}: RoPE kind {kind} (0 norm, 2 neox)")
    rp.n_rot, rp.freq_base, rp.freq_scale = n_rot, base, scale
    rp.kind = LX_ROPE_NEOX if kind == 2 else LX_ROPE_NORM
    return 0


cdef class Stack:
    """A model's decoder layers for the native step (one C call per layer, GIL released)."""

    cdef lx_layer_params *params
    cdef lx_layer_weights *weights
    cdef readonly int n_layer
    cdef readonly int64_t n_embd
    cdef list _keep
    cdef object _work     # threading.local: .buf, the calling thread's work buffer, kept between calls

    def __cinit__(self):
        self.params = NULL
        self.weights = NULL

    def __dealloc__(self):
        free(self.params)
        free(self.weights)

    def __init__(self, list layers):
        """layers: one dict per layer with
            n_embd, n_head, n_head_kv, d_k, d_v, n_ff, eps,
            rope: a llamax.rope.RoPE, None (no RoPE in the layer), or (n_rot, freq_base, freq_scale,
                kind 0 norm / 2 neox),
            q_scale, kq_scale, softcap, act ("silu" | "gelu_table"), gelu_table (float32 [65536] or None),
            attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffw_norm (float32 or None),
            qk_norm_full (q_norm / k_norm over whole rows), residual_scale (1.0), bqkv (float32 or None),
            moe (a llamax._native.moe.MoE in place of w_gate_up and w_down),
            wqkv, wo, w_gate_up, w_down: lists of parts, (raw uint8 [rows, row_bytes], ggml type)
                or (packed r8 uint8, ggml type, rows, True)."""
        self.n_layer = len(layers)
        if self.n_layer < 1:
            raise ValueError("a stack needs at least one layer")
        self.params = <lx_layer_params *> calloc(self.n_layer, sizeof(lx_layer_params))
        self.weights = <lx_layer_weights *> calloc(self.n_layer, sizeof(lx_layer_weights))
        if self.params == NULL or self.weights == NULL:
            raise MemoryError()
        self._keep = []
        self._work = threading.local()
        cdef lx_layer_params *p
        cdef lx_layer_weights *w
        for il, d in enumerate(layers):
            p, w = &self.params[il], &self.weights[il]
            p.n_embd, p.n_head, p.n_head_kv = d["n_embd"], d["n_head"], d["n_head_kv"]
            p.d_k, p.d_v, p.n_ff, p.eps = d["d_k"], d["d_v"], d["n_ff"], d["eps"]
            _rope_params(&p.rope, d["rope"], il, self._keep)
            p.q_scale, p.kq_scale, p.softcap = d["q_scale"], d["kq_scale"], d["softcap"]
            p.qk_norm_full = 1 if d.get("qk_norm_full") else 0
            p.residual_scale = d.get("residual_scale", 1.0)
            if d["act"] not in ACTS:
                raise ValueError(f"layer {il}: activation {d['act']!r}, known: {sorted(ACTS)}")
            p.act = ACTS[d["act"]]
            p.gelu_table = _f32(d.get("gelu_table"), 65536, "gelu_table", self._keep)
            if p.act == LX_ACT_GELU_TABLE and p.gelu_table == NULL:
                raise ValueError(f"layer {il}: gelu_table activation without its table")
            E, nq = p.n_embd, p.n_head * p.d_k
            w.attn_norm = _f32(d.get("attn_norm"), E, "attn_norm", self._keep)
            w.ffn_norm = _f32(d.get("ffn_norm"), E, "ffn_norm", self._keep)
            w.q_norm = _f32(d.get("q_norm"), nq if p.qk_norm_full else p.d_k, "q_norm", self._keep)
            w.k_norm = _f32(d.get("k_norm"), p.n_head_kv * p.d_k if p.qk_norm_full else p.d_k, "k_norm",
                            self._keep)
            w.bqkv = _f32(d.get("bqkv"), nq + p.n_head_kv * (p.d_k + p.d_v), "bqkv", self._keep)
            w.post_attn_norm = _f32(d.get("post_attn_norm"), E, "post_attn_norm", self._keep)
            w.post_ffw_norm = _f32(d.get("post_ffw_norm"), E, "post_ffw_norm", self._keep)
            set_linear(&w.wqkv, d["wqkv"], E, nq + p.n_head_kv * (p.d_k + p.d_v), "wqkv", self._keep)
            set_linear(&w.wo, d["wo"], p.n_head * p.d_v, E, "wo", self._keep)
            moe = d.get("moe")
            if moe is not None:
                if not isinstance(moe, MoE) or (<MoE> moe).p.n_embd != E:
                    raise ValueError(f"layer {il}: moe must be a llamax._native.moe.MoE of n_embd {E}")
                p.moe = (<MoE> moe).p
                w.moe = &(<MoE> moe).w
                self._keep.append(moe)
            else:
                set_linear(&w.w_gate_up, d["w_gate_up"], E, 2 * p.n_ff, "w_gate_up", self._keep)
                set_linear(&w.w_down, d["w_down"], p.n_ff, E, "w_down", self._keep)
        self.n_embd = self.params[0].n_embd

    def forward(self, x, pos, list views, out_rows=None, n_threads=None):
        """Run every layer over one ubatch.

        Args:
            x: float32 [n_tokens, n_embd], C-contiguous: the embeddings; overwritten.
            pos: int32 [n_tokens], the tokens' positions.
            views: [n_layer] LayerView of each layer (llamax.memory), for this ubatch.
            out_rows: int64 ascending rows that go on after the last layer's attention (the
                ones with logits); None: all.
        Returns:
            x[:len(out_rows)] (a view): the hidden states of those rows after the last layer.
        Raises:
            ValueError: a shape, type or view does not fit (nothing of the cache written by the
                failing layer; earlier layers have stored their K/V).
        """
        cdef int nt = resolve_n_threads(n_threads)
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous \
                or not x.flags.writeable or x.shape[1] != self.n_embd:
            raise ValueError(f"x must be writeable C-contiguous float32 [n, {self.n_embd}]")
        cdef int64_t n = x.shape[0]
        if len(views) != self.n_layer:
            raise ValueError(f"{len(views)} views for {self.n_layer} layers")
        pos = np.ascontiguousarray(pos, dtype=np.int32)
        if pos.shape != (n,):
            raise ValueError(f"pos must be [{n}], got {pos.shape}")
        cdef int64_t n_out = n
        rows = None
        if out_rows is not None:
            rows = np.ascontiguousarray(out_rows, dtype=np.int64)
            n_out = rows.shape[0]
        cdef lx_kv_layer *kvs = <lx_kv_layer *> calloc(self.n_layer, sizeof(lx_kv_layer))
        if kvs == NULL:
            raise MemoryError()
        cdef size_t need = 0, s
        cdef int il
        cdef lx_status st = LX_OK
        cdef int failed = -1
        cdef float *xp = <float *> cnp.PyArray_DATA(<cnp.ndarray> x)
        cdef const lx_pos *pp = <const lx_pos *> cnp.PyArray_DATA(<cnp.ndarray> pos)
        cdef const int64_t *rp = NULL
        cdef void *wp
        try:
            keep = []
            for il in range(self.n_layer):
                _view(&kvs[il], views[il], n, keep, &kvs[il - 1] if il else NULL, views[il - 1] if il else None)
                _check_sizes(&self.params[il], &kvs[il], views[il])
                s = lx_layer_work_size(&self.params[il], &self.weights[il], &kvs[il], n, nt)
                need = s if s > need else need
            # one buffer per calling thread, grown as needed: a decode step allocates nothing, and
            # two contexts decoding this model from two threads do not share it
            work = getattr(self._work, "buf", None)
            if work is None or work.size < need:
                work = self._work.buf = np.empty(need, dtype=np.uint8)
            wp = cnp.PyArray_DATA(<cnp.ndarray> work)
            if rows is not None:
                rp = <const int64_t *> cnp.PyArray_DATA(<cnp.ndarray> rows)
            with nogil:
                st = lx_layers_forward(self.params, self.weights, kvs, self.n_layer, xp, n, pp, rp, n_out, wp, nt,
                                       &failed)
        finally:
            free(kvs)
        if st != LX_OK:
            raise ValueError(f"layer {failed}: the native step refused its arguments (shapes, types, cells "
                             f"or out_rows)")
        return x[:n_out]


cdef inline bint _c_array(object a):
    return isinstance(a, np.ndarray) and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray> a)


cdef int _view(lx_kv_layer *kv, object v, int64_t n, list keep, const lx_kv_layer *prev, object prev_v) except -1:
    """kv <- a LayerView (k, v, type_k, type_v, v_trans, mask, idxs, rot_k, rot_v, perm). prev / prev_v:
    the layer before's (NULL / None for the first): a mask, idxs and perm it shares (the same
    objects over as many cells, as every layer of one cache has) are not checked again."""
    k, vv, mask, idxs, perm = v.k, v.v, v.mask, v.idxs, v.perm
    for a, what in ((k, "k"), (vv, "v")):
        if not _c_array(a):
            raise ValueError(f"LayerView.{what} must be a C-contiguous array")
    if not cnp.PyArray_ISWRITEABLE(<cnp.ndarray> k) or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray> vv):
        raise ValueError("LayerView.k / .v must be writeable")
    cdef int kd = cnp.PyArray_NDIM(<cnp.ndarray> k)
    cdef cnp.npy_intp *ks = cnp.PyArray_DIMS(<cnp.ndarray> k)
    cdef bint shared = (prev != NULL and mask is prev_v.mask and idxs is prev_v.idxs and perm is prev_v.perm
                        and kd >= 2 and ks[1] == prev.kv_size)   # (perm's cells checked against this kv_size)
    if not shared:
        for a, what in ((mask, "mask"), (idxs, "idxs")):
            if not _c_array(a):
                raise ValueError(f"LayerView.{what} must be a C-contiguous array")
        if cnp.PyArray_TYPE(<cnp.ndarray> mask) != cnp.NPY_FLOAT32 or cnp.PyArray_NDIM(<cnp.ndarray> mask) != 3:
            raise ValueError("LayerView.mask must be float32 [n_stream, n_tps_pad, n_kv]")
        if (cnp.PyArray_TYPE(<cnp.ndarray> idxs) != cnp.NPY_UINT32 or cnp.PyArray_NDIM(<cnp.ndarray> idxs) != 1
                or cnp.PyArray_DIM(<cnp.ndarray> idxs, 0) != n):
            raise ValueError(f"LayerView.idxs must be uint32 [{n}]")
    if kd < 2 or ks[0] != cnp.PyArray_DIM(<cnp.ndarray> mask, 0):
        raise ValueError("LayerView.k must hold the mask's streams")
    keep.append(k)
    keep.append(vv)
    kv.k = cnp.PyArray_DATA(<cnp.ndarray> k)
    kv.v = cnp.PyArray_DATA(<cnp.ndarray> vv)
    cdef int tk = int(v.type_k), tv = int(v.type_v)
    kv.type_k, kv.type_v = <lx_type> tk, <lx_type> tv
    kv.v_trans = 1 if v.v_trans else 0
    kv.kv_size = ks[1]
    kv.rot_k, kv.rot_v = v.rot_k, v.rot_v
    if shared:   # (kept by the layer before)
        kv.n_stream, kv.n_tps_pad, kv.n_kv = prev.n_stream, prev.n_tps_pad, prev.n_kv
        kv.mask, kv.idxs, kv.perm = prev.mask, prev.idxs, prev.perm
        return 0
    keep.append(mask)
    keep.append(idxs)
    kv.n_stream = cnp.PyArray_DIM(<cnp.ndarray> mask, 0)
    kv.n_tps_pad = cnp.PyArray_DIM(<cnp.ndarray> mask, 1)
    kv.n_kv = cnp.PyArray_DIM(<cnp.ndarray> mask, 2)
    kv.mask = <const float *> cnp.PyArray_DATA(<cnp.ndarray> mask)
    kv.idxs = <const uint32_t *> cnp.PyArray_DATA(<cnp.ndarray> idxs)
    kv.perm = NULL
    if perm is not None:
        if (not _c_array(perm) or cnp.PyArray_TYPE(<cnp.ndarray> perm) != cnp.NPY_INT32
                or perm.shape != (mask.shape[0], mask.shape[2])):
            raise ValueError("LayerView.perm must be None or C-contiguous int32 [n_stream, n_kv]")
        if perm.size and (perm.min() < 0 or perm.max() >= k.shape[1]):
            raise ValueError("LayerView.perm holds a cell outside the stream")
        keep.append(perm)
        kv.perm = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> perm)
    return 0


cdef int _check_sizes(const lx_layer_params *p, const lx_kv_layer *kv, object v) except -1:
    """The view's K/V buffers hold n_stream * kv_size cells of this layer's heads."""
    cdef int64_t cells = kv.n_stream * kv.kv_size
    if cnp.PyArray_NBYTES(<cnp.ndarray> v.k) != cells * lx_row_bytes(kv.type_k, p.n_head_kv * p.d_k):
        raise ValueError(f"LayerView.k holds {v.k.nbytes} bytes, not {cells} cells of type {kv.type_k}")
    if cnp.PyArray_NBYTES(<cnp.ndarray> v.v) != cells * lx_row_bytes(kv.type_v, p.n_head_kv * p.d_v):
        raise ValueError(f"LayerView.v holds {v.v.nbytes} bytes, not {cells} cells of type {kv.type_v}")
    return 0
