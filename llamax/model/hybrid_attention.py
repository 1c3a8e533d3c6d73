"""The attention layer of the hybrid models (Jamba, Granite 4.0-H, Nemotron-H) over a HybridMemory's KV cache.

Q, K and V in one product (attn_q / attn_k / attn_v concatenated), RoPE on Q and K when the model has one
(granitehybrid; Jamba's and Nemotron-H's attention has none: positions only mask), K and V stored in the
memory's KV cache, attention over it in the native kernel, the output product. No biases, no Q/K norms.
"""
from __future__ import annotations

import numpy as np

from llamax._native import rope as _rope
from llamax.memory import HybridMemory
from llamax.model.gguf import GGUFFile, HParams
from llamax.model.linear import Linear
from llamax.rope import RoPE


class HybridAttention:
    """Layer il's attention weights: wqkv (Q, K, V in one Linear) and wo."""

    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        self.wqkv = Linear.concat(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], n_threads)
        self.wo = Linear.load(g, p + "attn_output.weight", n_threads)

    def __call__(self, mem: HybridMemory, il: int, ub, h: np.ndarray, hp: HParams, kq_scale: float,
                 rope: RoPE | None, n_threads: int) -> np.ndarray:
        """The layer's output [n, n_embd] for the normed hidden states h [n, n_embd] of ubatch ub (before the
        residual), its K and V written into mem.attn."""
        n, d_k = h.shape[0], hp.n_embd_head_k
        nq, nk = hp.n_head * d_k, hp.n_head_kv * d_k
        qkv = self.wqkv(h)
        q = np.ascontiguousarray(qkv[:, :nq]).reshape(n, hp.n_head, d_k)
        k = np.ascontiguousarray(qkv[:, nq:nq + nk]).reshape(n, hp.n_head_kv, d_k)
        v = np.ascontiguousarray(qkv[:, nq + nk:]).reshape(n, hp.n_head_kv, hp.n_embd_head_v)
        if rope is not None:
            for t in (q, k):
                _rope.rope_f32(t, ub.pos, rope.n_rot, rope.freq_base, rope.freq_scale, rope.mode, n_threads,
                               **rope.scaling_kwargs)
        mem.attn.store(il, ub, k, v)
        return self.wo(mem.attn.attend(il, ub, q, scale=kq_scale).reshape(n, -1))
