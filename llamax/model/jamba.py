"""The jamba architecture (llama.cpp's llm_build_jamba) over a hybrid memory, with dense FFNs.

Per layer: RMSNorm -> the mixer -> residual -> RMSNorm -> SwiGLU FFN -> residual. The mixer is a
Mamba-1 one (llamax/model/mamba.py, with Jamba's RMS norms of dt, B and C) in the layers whose
attention.head_count_kv is 0, its states in the hybrid memory's recurrent part; else attention without
RoPE over the hybrid memory's KV cache (the positions only order the causal mask). Then RMSNorm and
the output (tied to the token embedding when the GGUF has no output.weight). Jamba's MoE FFNs are not
supported (check_tensors names the router tensor).

forward runs each layer as one native call: a Mamba layer with its FFN through
llamax._native.mamba_layer (csrc/mamba_layer.h), an attention layer with its FFN through
llamax._native.layer's Stack (csrc/layer.h, without RoPE); only the rows with outputs go past the last
layer's attention when the last layer is an attention one. forward_reference composes the same steps
in Python, the reference the native steps equal bit for bit (tests/test_mamba_layer.py).
"""
from __future__ import annotations

import math

import numpy as np

from llamax._native import layer as _layer
from llamax._native.mamba_layer import MambaStack
from llamax.memory import HybridMemory
from llamax.model.gguf import JAMBA, GGUFFile, HParams
from llamax.model.hybrid_attention import HybridAttention
from llamax.model.linear import Linear, rms_norm
from llamax.model.mamba import MambaMixer, mamba_mixer, native_layer
from llamax.model.model import Model


class _Layer:
    def __init__(self, g: GGUFFile, il: int, hp: HParams, n_threads: int) -> None:
        p = f"blk.{il}."
        self.attn_norm = g.f32(p + "attn_norm.weight")
        self.mixer: MambaMixer | HybridAttention = (MambaMixer(g, il, n_threads) if il in hp.recurrent_layers
                                               else HybridAttention(g, il, n_threads))
        self.ffn_norm = g.f32(p + "ffn_norm.weight")
        self.w_gate_up = Linear.concat(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], n_threads)
        self.w_down = Linear.load(g, p + "ffn_down.weight", n_threads)


class Jamba(Model, arch="jamba"):
    """A jamba-architecture model (Mamba-1 and attention layers, dense FFNs) over a HybridMemory."""

    TENSORS = JAMBA

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.layers = [_Layer(g, il, hp, n_threads) for il in range(hp.n_layer)]
        self.kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
        self.native = [self._native(L) for L in self.layers]

    def _native(self, L: _Layer) -> MambaStack | _layer.Stack:
        """One layer's native step: its mixer and FFN in one call."""
        hp = self.hp
        if isinstance(L.mixer, MambaMixer):
            return MambaStack([native_layer(L.mixer, L.attn_norm, hp, dict(
                n_ff=hp.n_ff, ffn_norm=L.ffn_norm, w_gate_up=L.w_gate_up, w_down=L.w_down))])
        return _layer.Stack([dict(
            n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv, d_k=hp.n_embd_head_k, d_v=hp.n_embd_head_v,
            n_ff=hp.n_ff, eps=hp.rms_eps, rope=None, q_scale=1.0, kq_scale=self.kq_scale, softcap=0.0, act="silu",
            attn_norm=L.attn_norm, ffn_norm=L.ffn_norm, wqkv=L.mixer.wqkv.parts, wo=L.mixer.wo.parts,
            w_gate_up=L.w_gate_up.parts, w_down=L.w_down.parts)])

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states) after folding the ubatch into the
        recurrent states and writing its K/V into the attention cache (mem: a HybridMemory): one native call
        per layer."""
        assert isinstance(mem, HybridMemory), "a jamba model runs over the hybrid memory create_memory made"
        x = self.tok_embd.rows(ub.token)
        last = len(self.native) - 1
        with mem.lock:   # the cells stay as the views show them until every layer ran
            kv = mem.attn.layer_views(ub)   # the attention layers' views (one check and one mask)
            for il, step in enumerate(self.native):
                if isinstance(step, MambaStack):
                    step.forward(x, [mem.recr.recurrent_view(il, ub)], ub.n_seq_tokens, self.n_threads)
                elif il == last:   # only the rows with outputs go on after its attention
                    return self._out(step.forward(x, ub.pos, [kv[il]], out_rows=np.flatnonzero(ub.output),
                                                  n_threads=self.n_threads), embd)
                else:
                    step.forward(x, ub.pos, [kv[il]], n_threads=self.n_threads)
        return self._head(x, ub, embd)

    def forward_reference(self, mem, ub, embd: bool = False) -> np.ndarray:
        """forward composed in Python, step by step (the memory's store and attend, mamba_mixer, the norms,
        products and gate): the reference of the native steps (tests/test_mamba_layer.py: the same bits)."""
        assert isinstance(mem, HybridMemory), "a jamba model runs over the hybrid memory create_memory made"
        hp = self.hp
        x = self.tok_embd.rows(ub.token)
        with mem.lock:   # the cells stay as the views show them until every layer ran
            for il, L in enumerate(self.layers):
                h = rms_norm(x, L.attn_norm, hp.rms_eps)
                if isinstance(L.mixer, MambaMixer):
                    x += mamba_mixer(L.mixer, h, mem.recr.recurrent_view(il, ub), ub.n_seq_tokens, hp, self.n_threads)
                else:
                    x += L.mixer(mem, il, ub, h, self.hp, self.kq_scale, None, self.n_threads)
                h = rms_norm(x, L.ffn_norm, hp.rms_eps)
                x += L.w_down(_layer.gated(L.w_gate_up(h), hp.n_ff, "silu"))
        return self._head(x, ub, embd)
