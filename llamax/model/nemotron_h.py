"""The nemotron_h architecture (llama.cpp's llama_model_nemotron_h, NVIDIA Nemotron-H) over a hybrid memory,
without experts.

Every layer is RMSNorm -> one block -> residual, the block one of: a Mamba-2 mixer (llamax/model/mamba2.py)
where attention.head_count_kv and feed_forward_length are 0, its states in the hybrid memory's recurrent
part; attention without RoPE (kq scale 1/sqrt(head size)) where head_count_kv is not 0, over the hybrid
memory's KV cache; an FFN alone where feed_forward_length is not 0: down(relu(up(h))^2). Then RMSNorm and
the output (tied to the token embedding when the GGUF has no output.weight).

As llama.cpp's hybrid memory for nemotron_h, the KV cache has the attention layers only, the recurrent memory
the Mamba-2 layers only (the FFN layers keep nothing). Without RoPE a shift only renumbers positions.
"""
from __future__ import annotations

import math

import numpy as np

from llamax.memory import HybridMemory
from llamax.model.gguf import NEMOTRON_H, GGUFFile, HParams
from llamax.model.hybrid_attention import HybridAttention
from llamax.model.linear import Linear, rms_norm
from llamax.model.mamba2 import Mamba2Mixer, link_native
from llamax.model.model import Model


class _ReluSqrFFN:
    """llama.cpp's build_ffn with LLM_FFN_RELU_SQR and no gate: down(relu(up(h))^2)."""

    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        self.up = Linear.load(g, p + "ffn_up.weight", n_threads)
        self.down = Linear.load(g, p + "ffn_down.weight", n_threads)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        u = self.up(h)
        np.maximum(u, np.float32(0.0), out=u)
        u *= u
        return self.down(u)


class NemotronH(Model, arch="nemotron_h"):
    """A nemotron_h-architecture model (Mamba-2, attention and FFN layers) over a HybridMemory."""

    TENSORS = NEMOTRON_H

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.norms = [g.f32(f"blk.{il}.attn_norm.weight") for il in range(hp.n_layer)]
        self.blocks: list[Mamba2Mixer | HybridAttention | _ReluSqrFFN] = [
            Mamba2Mixer(g, il, hp, n_threads) if il in hp.recurrent_layers else
            _ReluSqrFFN(g, il, n_threads) if il in hp.ffn_layers else HybridAttention(g, il, n_threads)
            for il in range(hp.n_layer)]
        link_native([B for B in self.blocks if isinstance(B, Mamba2Mixer)], hp)   # one native object
        self.kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k) if hp.n_embd_head_k else 1.0

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states) after folding
        the ubatch into the recurrent states and writing its K/V into the attention cache (mem: a HybridMemory)."""
        assert isinstance(mem, HybridMemory), "a nemotron_h model runs over the hybrid memory create_memory made"
        hp = self.hp
        x = self.tok_embd.rows(ub.token)
        with mem.lock:   # the cells stay as the views show them until every layer ran
            for il, (norm, B) in enumerate(zip(self.norms, self.blocks)):
                h = rms_norm(x, norm, hp.rms_eps)
                if isinstance(B, Mamba2Mixer):
                    x += B(h, mem.recr.recurrent_view(il, ub), ub.n_seq_tokens, hp, self.n_threads)
                elif isinstance(B, _ReluSqrFFN):
                    x += B(h)
                else:
                    x += B(mem, il, ub, h, self.hp, self.kq_scale, None, self.n_threads)
        return self._head(x, ub, embd)
