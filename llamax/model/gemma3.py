"""The Gemma 3 architecture (llama.cpp's llm_build_gemma3) over llamax's memory.

Embedding rows scaled by sqrt(n_embd); per layer: RMSNorm -> Q/K/V projections -> RMSNorm of each
Q and K head (over head_dim) -> RoPE NEOX with the layer's base (sliding-window layers 10000, global
layers gemma3.rope.freq_base and the GGUF's scaling) -> Q times f_attention_scale -> attention over
the cache (kq scale 1) -> output projection -> RMSNorm -> residual -> RMSNorm -> GELU-gated FFN ->
RMSNorm -> residual. Final RMSNorm, then the tied output (token_embd). The GGUF's norm weights
already hold Gemma's "+1" (convert_hf_to_gguf adds it), so they are used as stored.

The 262144 x 640 tied embedding stays in its quantized blocks (Q8_0, 178 MB) instead of a 671 MB
float32 copy: the input rows are dequantized per ubatch, and the logits come from the native
GEMM over those blocks (llamax/model/linear.py). Everything is whole-ubatch numpy or native calls.
"""
from __future__ import annotations

import math

import numpy as np

from llamax._native import layer as _layer
from llamax._native import rope as _rope
from llamax.model.gguf import DENSE_DECODER, GGUFFile, HParams
from llamax.model.linear import Linear, rms_norm
from llamax.model.model import Model
from llamax.rope import RoPE

_GELU_COEF_A = 0.044715
_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_gelu_table_f16: np.ndarray | None = None


def _gelu_table() -> np.ndarray:
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
    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        self.attn_norm = g.f32(p + "attn_norm.weight")
        self.wqkv = Linear.concat(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], n_threads)
        self.q_norm = g.f32(p + "attn_q_norm.weight")
        self.k_norm = g.f32(p + "attn_k_norm.weight")
        self.wo = Linear.load(g, p + "attn_output.weight", n_threads)
        self.post_attn_norm = g.f32(p + "post_attention_norm.weight")
        self.ffn_norm = g.f32(p + "ffn_norm.weight")
        self.w_gate_up = Linear.concat(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], n_threads)
        self.w_down = Linear.load(g, p + "ffn_down.weight", n_threads)
        self.post_ffw_norm = g.f32(p + "post_ffw_norm.weight")


class Gemma3(Model, arch="gemma3"):
    """A gemma3-architecture model: its weights and forward pass."""

    # llama.cpp's llama_model_gemma3::load_arch_tensors (without the embedding models' dense_2/dense_3):
    # the dense decoder's tensors plus the Q/K head norms and the post-attention / post-FFN norms
    TENSORS = DENSE_DECODER.with_layer({"attn_q_norm.weight": ("n_embd_head_k",),
                                        "attn_k_norm.weight": ("n_embd_head_k",),
                                        "post_attention_norm.weight": ("n_embd",),
                                        "post_ffw_norm.weight": ("n_embd",)})

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self.n_threads = n_threads
        self._load_head(g)
        self.layers = [_Layer(g, il, n_threads) for il in range(hp.n_layer)]
        swa = set(hp.swa_layers) if hp.n_swa > 0 else set()
        full = RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_kind)
        slide = RoPE(hp.n_rot, hp.rope_freq_base_swa, hp.rope_freq_scale_swa, hp.rope_kind)
        self.ropes = [slide if il in swa else full for il in range(hp.n_layer)]   # the layer's RoPE
        self.embd_scale = np.float32(math.sqrt(hp.n_embd))
        self.q_scale = np.float32(hp.attn_scale or 1.0 / math.sqrt(hp.n_embd_head_k))
        self.stack = self._native_stack(self.layers, self.ropes, kq_scale=1.0, q_scale=float(self.q_scale),
                                        act="gelu_table", gelu_table=_gelu_table())

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states, see
        Model._out) after writing its K/V into mem: the layers in one native stack call (csrc/layer.h)."""
        x = self.tok_embd.rows(ub.token)
        x *= self.embd_scale
        return self._out(self._run_stack(mem, ub, x), embd)

    def _logits(self, xo: np.ndarray) -> np.ndarray:
        """The tied output layer, then Gemma's final logit softcap."""
        hp = self.hp
        logits = super()._logits(xo)
        if hp.final_logit_softcap > 0.0:
            c = np.float32(hp.final_logit_softcap)
            logits /= c
            np.tanh(logits, out=logits)
            logits *= c
        return logits

    def forward_reference(self, mem, ub) -> np.ndarray:
        """forward composed in Python, step by step: the products, RoPE, the memory's store and
        attend, and the per-row norm and gate of llamax._native.layer. The reference of the native
        layer step (tests/test_layer.py: the same bits)."""
        hp, n, nt = self.hp, ub.n_tokens, self.n_threads
        nh, nkv, dk = hp.n_head, hp.n_head_kv, hp.n_embd_head_k
        nq, nk = nh * dk, nkv * dk
        out = ub.output
        x = self.tok_embd.rows(ub.token)
        x *= self.embd_scale
        last = hp.n_layer - 1
        for il, L in enumerate(self.layers):
            r = self.ropes[il]
            h = rms_norm(x, L.attn_norm, hp.rms_eps)
            qkv = L.wqkv(h)
            q = rms_norm(qkv[:, :nq].reshape(n, nh, dk), L.q_norm, hp.rms_eps)
            k = rms_norm(qkv[:, nq:nq + nk].reshape(n, nkv, dk), L.k_norm, hp.rms_eps)
            v = qkv[:, nq + nk:].reshape(n, nkv, hp.n_embd_head_v)
            _rope.rope_f32(q, ub.pos, hp.n_rot, r.freq_base, r.freq_scale, r.mode, nt)
            _rope.rope_f32(k, ub.pos, hp.n_rot, r.freq_base, r.freq_scale, r.mode, nt)
            q *= self.q_scale
            mem.store(il, ub, k, v)
            a = mem.attend(il, ub, q, scale=1.0).reshape(n, -1)
            if il == last:  # the rest only for the rows that asked for logits (llama.cpp's inp_out_ids)
                if not out.all():
                    a, x = a[out], x[out]
                if a.shape[0] == 0:
                    return np.zeros((0, hp.n_vocab), np.float32)
            x += rms_norm(L.wo(a), L.post_attn_norm, hp.rms_eps)
            h = rms_norm(x, L.ffn_norm, hp.rms_eps)
            act = _layer.gated(L.w_gate_up(h), hp.n_ff, "gelu_table", _gelu_table())
            x += rms_norm(L.w_down(act), L.post_ffw_norm, hp.rms_eps)
        return self._logits(rms_norm(x, self.output_norm, hp.rms_eps))
