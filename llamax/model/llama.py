"""The llama architecture (llama.cpp's llm_build_llama) over llamax's memory.

Per layer: RMSNorm -> Q/K/V projections -> RoPE (llama.cpp's NORM type for this arch) -> K/V
written into the cache -> attention over the cache in the native kernel -> output projection ->
residual -> RMSNorm -> SwiGLU FFN -> residual. Logits only for the tokens that asked for them.
The weights stay in their GGUF blocks (llamax/model/linear.py). Everything is whole-ubatch numpy
or native calls; no Python loop runs per token.
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


class _Layer:
    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        self.attn_norm = g.f32(p + "attn_norm.weight")
        self.wqkv = Linear.concat(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], n_threads)
        self.wo = Linear.load(g, p + "attn_output.weight", n_threads)
        self.ffn_norm = g.f32(p + "ffn_norm.weight")
        self.w_gate_up = Linear.concat(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], n_threads)
        self.w_down = Linear.load(g, p + "ffn_down.weight", n_threads)


class Llama(Model, arch="llama"):
    """A llama-architecture model: its weights and forward pass."""

    # llama.cpp's llama_model_llama::load_arch_tensors for a dense model without biases or RoPE factors:
    # each tensor's shape in ggml order (ne0 first)
    TENSORS = DENSE_DECODER

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.layers = [_Layer(g, il, n_threads) for il in range(hp.n_layer)]
        self.rope = RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_kind)
        self.kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
        self.stack = self._native_stack(self.layers, [self.rope] * hp.n_layer, kq_scale=self.kq_scale)

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states, see
        Model._out) after writing its K/V into mem: the layers in one native stack call (csrc/layer.h)."""
        return self._out(self._run_stack(mem, ub, self.tok_embd.rows(ub.token)), embd)

    def forward_reference(self, mem, ub) -> np.ndarray:
        """forward composed in Python, step by step: the products, RoPE, the memory's store and
        attend, and the per-row norm and gate of llamax._native.layer. The reference of the native
        layer step (tests/test_layer.py: the same bits)."""
        hp, n = self.hp, ub.n_tokens
        nq, nk = hp.n_head * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_k
        x = self.tok_embd.rows(ub.token)
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, hp.rms_eps)
            qkv = L.wqkv(h)
            q = np.ascontiguousarray(qkv[:, :nq]).reshape(n, hp.n_head, hp.n_embd_head_k)
            k = np.ascontiguousarray(qkv[:, nq:nq + nk]).reshape(n, hp.n_head_kv, hp.n_embd_head_k)
            v = qkv[:, nq + nk:].reshape(n, hp.n_head_kv, hp.n_embd_head_v)
            _rope.rope_f32(q, ub.pos, hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, self.rope.mode, self.n_threads)
            _rope.rope_f32(k, ub.pos, hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, self.rope.mode, self.n_threads)
            mem.store(il, ub, k, v)
            a = mem.attend(il, ub, q, scale=self.kq_scale)
            x += L.wo(a.reshape(n, -1))
            h = rms_norm(x, L.ffn_norm, hp.rms_eps)
            x += L.w_down(_layer.gated(L.w_gate_up(h), hp.n_ff, "silu"))
        return self._head(x, ub)
