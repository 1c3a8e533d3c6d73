"""The transformer families of llamax/model/family.py over llamax's memory: one Model class for all of them.

Per layer (csrc/layer.h, one native call): [RMSNorm] -> Q/K/V projections [+ bias] -> [Q/K RMS norms, per
head or over the whole projection] -> RoPE (the layer's: NORM or NEOX, frequency factors, YaRN; none in a
NoPE layer) -> [Q scale] -> K/V written into the cache -> attention over it (kq scale, [softcap]) ->
output projection -> [RMSNorm] -> [x residual scale] -> residual -> [RMSNorm] -> gated FFN (SiLU or GELU;
or a mixture of experts) -> [RMSNorm] -> [x residual scale] -> residual. Before the layers the embedding
rows (dequantized per ubatch) [times the embedding scale]; after them the final RMSNorm and the output
layer (token_embd when the GGUF has no output.weight), [divided by the logit scale], [soft-capped].
[..] where FAMILIES[arch] and the GGUF say so. The weights stay in their GGUF blocks
(llamax/model/linear.py); no Python loop runs per token.

LongRoPE (Phi-3): the frequency factors depend on the context (llama.cpp's get_rope_factors: the long
factors when a sequence's context exceeds the original one), so a model keeps one native stack per choice,
and create_memory records which one a memory's contexts use.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from llamax._native import layer as _layer
from llamax._native import rope as _rope
from llamax.memory import Memory
from llamax.model.family import FAMILIES, Family, tensor_table
from llamax.model.gguf import DENSE_ARCHS, GGUFFile, HParams, TensorTable
from llamax.model.linear import Linear, rms_norm
from llamax.model.model import Model
from llamax.params import ContextParams
from llamax.rope import RoPE

_GELU_COEF_A = 0.044715
_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_gelu_table_f16: np.ndarray | None = None


def gelu_table() -> np.ndarray:
    """ggml's ggml_table_gelu_f16 as float32: the tanh GELU of every f16 value, rounded to f16."""
    global _gelu_table_f16
    if _gelu_table_f16 is None:
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        a, c = np.float32(_GELU_COEF_A), np.float32(_SQRT_2_OVER_PI)
        with np.errstate(all="ignore"):  # the inf / nan entries are never looked up (|x| >= 10 is not)
            y = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * x * (np.float32(1.0) + a * x * x)))
        _gelu_table_f16 = y.astype(np.float16).astype(np.float32)
    return _gelu_table_f16


class _Layer:
    """One decoder layer's weights, as FAMILIES[arch] and the file lay them out."""

    def __init__(self, g: GGUFFile, il: int, fam: Family, hp: HParams, n_threads: int) -> None:
        p = f"blk.{il}."
        opt = (lambda n: g.f32(p + n) if p + n in g.tensors else None)
        self.attn_norm, self.ffn_norm = opt("attn_norm.weight"), opt("ffn_norm.weight")
        if p + "attn_qkv.weight" in g.tensors:
            self.wqkv = Linear.load(g, p + "attn_qkv.weight", n_threads)
        else:
            self.wqkv = Linear.concat(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], n_threads)
        self.bqkv = (np.concatenate([g.f32(p + f"attn_{x}.bias") for x in "qkv"])
                     if p + "attn_q.bias" in g.tensors else None)
        self.q_norm, self.k_norm = opt("attn_q_norm.weight"), opt("attn_k_norm.weight")
        self.wo = Linear.load(g, p + "attn_output.weight", n_threads)
        self.post_attn_norm, self.post_ffw_norm = opt("post_attention_norm.weight"), opt("post_ffw_norm.weight")
        self.moe = None
        if fam.moe:
            from llamax._native.moe import MoE

            def experts(name: str) -> tuple[np.ndarray, int]:
                raw = g.raw(p + name)
                return raw.reshape(hp.n_expert, -1, raw.shape[1]), g.ggml_type(p + name)

            router = g.raw(p + "ffn_gate_inp.weight")
            raws = {n: experts(f"ffn_{n}_exps.weight") for n in ("gate", "up", "down")}
            self.moe = MoE((np.ascontiguousarray(router), g.ggml_type(p + "ffn_gate_inp.weight")),
                           raws["gate"], raws["up"], raws["down"], n_used=hp.n_expert_used, norm_w=True,
                           act=fam.act, gelu_table=gelu_table() if fam.act == "gelu_table" else None)
            for n, (raw, _) in raws.items():   # repacked (r8): the mapping's pages of the tensor are not needed
                if getattr(self.moe, n) is not raw:
                    g.release(p + f"ffn_{n}_exps.weight")
        elif p + "ffn_gate.weight" in g.tensors:
            self.w_gate_up = Linear.concat(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], n_threads)
        else:   # Phi-3: ffn_up holds [gate | up]
            self.w_gate_up = Linear.load(g, p + "ffn_up.weight", n_threads)
        if not fam.moe:
            self.w_down = Linear.load(g, p + "ffn_down.weight", n_threads)


class Decoder(Model, arch=DENSE_ARCHS):
    """A model of one of the transformer families (FAMILIES): its weights and forward pass."""

    def tensor_table(self, g: GGUFFile, hp: HParams) -> TensorTable:
        return tensor_table(FAMILIES[hp.arch], hp, g)

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self.family = fam = FAMILIES[hp.arch]
        self._load_head(g)
        self.layers = [_Layer(g, il, fam, hp, n_threads) for il in range(hp.n_layer)]
        self.factors = {k: g.f32(f"{name}.weight") for k, name in (("freqs", "rope_freqs"),
                        ("long", "rope_factors_long"), ("short", "rope_factors_short")) if f"{name}.weight" in g.tensors}
        self.embd_scale = (np.float32(math.sqrt(hp.n_embd)) if fam.embd_scale == "sqrt_n_embd" else
                           np.float32(hp.embd_scale) if hp.embd_scale else None)
        d = hp.n_embd_head_k
        if fam.q_scale == "attn_scale":
            self.q_scale, self.kq_scale = float(np.float32(hp.attn_scale)), 1.0
        elif fam.q_scale == "head":
            self.q_scale, self.kq_scale = float(np.float32(1.0 / math.sqrt(d))), 1.0
        else:
            self.q_scale, self.kq_scale = 1.0, hp.kq_scale or 1.0 / math.sqrt(d)
        self._stacks: dict[str, object] = {}
        self._variants: weakref.WeakKeyDictionary[Memory, str] = weakref.WeakKeyDictionary()
        self._stack_of(self._variant(hp.n_ctx_train))   # built at load: the weights' checks run now

    @property
    def stack(self):
        """The native stack of a context of the trained length (the layers as one native call)."""
        return self._stack_of(self._variant(self.hp.n_ctx_train))

    # ---- RoPE per layer ----------------------------------------------------------------------------
    def _variant(self, n_ctx_seq: int) -> str:
        """Which frequency factors a context of n_ctx_seq cells per sequence uses (get_rope_factors):
        rope_freqs when the GGUF has them, else LongRoPE's long factors beyond the original context, else
        the short ones; "" for none."""
        if "freqs" in self.factors:
            return "freqs"
        if "long" in self.factors and n_ctx_seq > (self.hp.n_ctx_orig or self.hp.n_ctx_train):
            return "long"
        return "short" if "short" in self.factors else ""

    def layer_ropes(self, n_ctx_seq: int) -> list[RoPE | None]:
        """Each layer's RoPE in a context of n_ctx_seq cells per sequence (None: the layer has none)."""
        hp, fam = self.hp, self.family
        f = self.factors.get(self._variant(n_ctx_seq))
        factors = tuple(float(x) for x in f) if f is not None else None
        swa = set(hp.swa_layers) if hp.n_swa > 0 else set()
        n_ctx_orig = hp.n_ctx_orig or hp.n_ctx_train
        full = RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_kind, freq_factors=factors,
                    ext_factor=hp.rope_ext_factor, attn_factor=hp.rope_attn_factor, n_ctx_orig=n_ctx_orig)
        plain = fam.swa_plain_rope or hp.arch == "gemma3"
        slide = RoPE(hp.n_rot, hp.rope_freq_base_swa, hp.rope_freq_scale_swa, hp.rope_kind, freq_factors=factors,
                     ext_factor=0.0 if plain else hp.rope_ext_factor,
                     attn_factor=1.0 if plain else hp.rope_attn_factor, n_ctx_orig=n_ctx_orig)
        return [None if il in hp.nope_layers else slide if il in swa else full for il in range(hp.n_layer)]

    def _ropes_of(self, variant: str) -> list[RoPE | None]:
        """layer_ropes for a choice of frequency factors (_variant)."""
        return self.layer_ropes((self.hp.n_ctx_orig or self.hp.n_ctx_train) + 1 if variant == "long" else 1)

    def _variant_of(self, mem: Memory) -> str:
        """The choice of frequency factors of the contexts of a memory (create_memory's)."""
        return self._variants.get(mem, self._variant(self.hp.n_ctx_train))

    def _stack_of(self, variant: str):
        """The native stack of this choice of frequency factors (built on first use)."""
        st = self._stacks.get(variant)
        if st is None:
            st = self._stacks[variant] = self._native_stack(self.layers, self._ropes_of(variant))
        return st

    def _native_stack(self, layers, ropes):
        hp, fam = self.hp, self.family
        dicts = []
        for L, r in zip(layers, ropes):
            dicts.append(dict(
                n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv, d_k=hp.n_embd_head_k,
                d_v=hp.n_embd_head_v, n_ff=hp.n_ff_exp if fam.moe else hp.n_ff, eps=hp.rms_eps, rope=r,
                q_scale=self.q_scale, kq_scale=self.kq_scale, softcap=hp.attn_logit_softcap, act=fam.act,
                gelu_table=gelu_table() if fam.act == "gelu_table" else None,
                qk_norm_full=fam.qk_norm == "full", residual_scale=hp.residual_scale or 1.0,
                attn_norm=L.attn_norm, ffn_norm=L.ffn_norm, q_norm=L.q_norm, k_norm=L.k_norm, bqkv=L.bqkv,
                post_attn_norm=L.post_attn_norm, post_ffw_norm=L.post_ffw_norm,
                wqkv=L.wqkv.parts, wo=L.wo.parts,
                **(dict(moe=L.moe) if L.moe is not None else
                   dict(w_gate_up=L.w_gate_up.parts, w_down=L.w_down.parts))))
        return _layer.Stack(dicts)

    def create_memory(self, params: ContextParams, ropes: list[RoPE | None] | None = None) -> Memory:
        """Model.create_memory with each layer's RoPE in a context of these parameters (ropes: as given)."""
        mem = super().create_memory(params, ropes if ropes is not None else self.layer_ropes(params.n_ctx_seq))
        self._variants[mem] = self._variant(params.n_ctx_seq)
        return mem

    # ---- forward ------------------------------------------------------------------------------------
    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.tok_embd.rows(tokens, self.embd_scale)

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states, see
        Model._out) after writing its K/V into mem: the layers in one native stack call (csrc/layer.h)."""
        rows = None if ub.n_tokens == 1 and ub.output[0] else np.flatnonzero(ub.output)   # None: every row
        stack = self._stack_of(self._variant_of(mem))
        x = self._embed(ub.token)
        with mem.lock:   # the cells stay as the views show them until the stack is done
            by_layer = mem.layer_views(ub)
            h = stack.forward(x, ub.pos, [by_layer[il] for il in range(self.hp.n_layer)], out_rows=rows,
                              n_threads=self.n_threads)
        return self._out(h, embd)

    def _logits(self, xo: np.ndarray) -> np.ndarray:
        """The output layer, then Granite's logit scale and Gemma's final softcap (ggml_scale by the
        reciprocals, as llama.cpp)."""
        hp = self.hp
        logits = super()._logits(xo)
        if hp.logit_scale:
            logits *= np.float32(1.0 / hp.logit_scale)
        if hp.final_logit_softcap > 0.0:
            c = np.float32(hp.final_logit_softcap)
            logits *= np.float32(1.0) / c
            np.tanh(logits, out=logits)
            logits *= c
        return logits

    def _block_out(self, o: np.ndarray, post_norm: np.ndarray | None, rs: np.float32) -> np.ndarray:
        """A block's output on its way into the residual: [its post-norm], [times the residual scale]."""
        if post_norm is not None:
            o = rms_norm(o, post_norm, self.hp.rms_eps)
        if rs != 1:
            o *= rs
        return o

    def forward_reference(self, mem, ub) -> np.ndarray:
        """forward composed in Python, step by step: the products, RoPE, the memory's store and attend,
        and the per-row norm and gate of llamax._native.layer. The reference of the native layer step
        (tests/test_layer.py: the same bits)."""
        hp, fam, n, nt = self.hp, self.family, ub.n_tokens, self.n_threads
        nh, nkv, dk = hp.n_head, hp.n_head_kv, hp.n_embd_head_k
        nq, nk = nh * dk, nkv * dk
        ropes = self._ropes_of(self._variant_of(mem))
        out = ub.output
        rs = np.float32(hp.residual_scale or 1.0)
        x = self._embed(ub.token)
        last = hp.n_layer - 1
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, hp.rms_eps) if L.attn_norm is not None else x.copy()
            qkv = L.wqkv(h)
            if L.bqkv is not None:
                qkv += L.bqkv
            q, k = np.ascontiguousarray(qkv[:, :nq]), np.ascontiguousarray(qkv[:, nq:nq + nk])
            v = qkv[:, nq + nk:].reshape(n, nkv, hp.n_embd_head_v)
            if L.q_norm is not None:
                full = fam.qk_norm == "full"
                q = rms_norm(q if full else q.reshape(n, nh, dk), L.q_norm, hp.rms_eps)
                assert L.k_norm is not None   # the table has both or neither
                k = rms_norm(k if full else k.reshape(n, nkv, dk), L.k_norm, hp.rms_eps)
            q, k = np.ascontiguousarray(q.reshape(n, nh, dk)), np.ascontiguousarray(k.reshape(n, nkv, dk))
            r = ropes[il]
            if r is not None:
                for t in (q, k):
                    _rope.rope_f32(t, ub.pos, r.n_rot, r.freq_base, r.freq_scale, r.mode, nt, **r.scaling_kwargs)
            if self.q_scale != 1.0:
                q *= np.float32(self.q_scale)
            mem.store(il, ub, k, v)
            a = mem.attend(il, ub, q, scale=self.kq_scale, softcap=hp.attn_logit_softcap).reshape(n, -1)
            if il == last:  # the rest only for the rows that asked for logits (llama.cpp's inp_out_ids)
                if not out.all():
                    a, x = a[out], x[out]
                if a.shape[0] == 0:
                    return np.zeros((0, hp.n_vocab), np.float32)
            x += self._block_out(L.wo(a), L.post_attn_norm, rs)
            h = rms_norm(x, L.ffn_norm, hp.rms_eps) if L.ffn_norm is not None else x.copy()
            if L.moe is not None:
                o = L.moe.forward(h, n_threads=nt)
            else:
                o = L.w_down(_layer.gated(L.w_gate_up(h), hp.n_ff, fam.act,
                                          gelu_table() if fam.act == "gelu_table" else None))
            x += self._block_out(o, L.post_ffw_norm, rs)
        return self._logits(rms_norm(x, self.output_norm, hp.rms_eps))
