"""The granitehybrid architecture (llama.cpp's llama_model_granite_hybrid, IBM Granite 4.0-H) over a hybrid
memory, with dense FFNs.

Per layer: RMSNorm -> the mixer -> [x residual scale] -> residual -> RMSNorm -> SwiGLU FFN -> [x residual
scale] -> residual. The mixer is a Mamba-2 one (llamax/model/mamba2.py) in the layers whose
attention.head_count_kv is 0, its states in the hybrid memory's recurrent part; else attention over the
hybrid memory's KV cache, with RoPE (NORM) unless rope.scaling.finetuned is false, and the kq scale
attention.scale (1/sqrt(head size) when 0). Before the layers the embedding rows [times embedding_scale];
after them the final RMSNorm and the output (tied to the token embedding when the GGUF has no
output.weight) [divided by logit_scale]. With expert_count (Granite-4.0-H-Tiny / Small) the FFN is a mixture of experts (the
native MoE of csrc/moe.h: softmax router, the chosen experts' weights normalised) plus a shared expert,
added, as llama.cpp's build_layer_ffn.

The hybrid memory's KV cache has the attention layers' RoPE, so it shifts positions (seq_add / seq_div rotate
the cached K, the recurrent states' positions move); without RoPE (rope.scaling.finetuned false) it cannot.
"""
from __future__ import annotations

import math

import numpy as np

from llamax._native import layer as _layer
from llamax.memory import HybridMemory, Memory
from llamax.model.gguf import GGUFFile, HParams, TensorTable, granitehybrid_table
from llamax.model.hybrid_attention import HybridAttention
from llamax.model.linear import Linear, rms_norm
from llamax.model.mamba2 import Mamba2Mixer, link_native
from llamax.model.model import Model
from llamax.params import ContextParams
from llamax.rope import RoPE


class _SwiGLU:
    """A dense SwiGLU FFN: down(silu(gate(h)) * up(h)) (llama.cpp's build_ffn, LLM_FFN_SILU, LLM_FFN_PAR)."""

    def __init__(self, g: GGUFFile, gate: str, up: str, down: str, n_ff: int, n_threads: int) -> None:
        self.w_gate_up = Linear.concat(g, [gate, up], n_threads)
        self.w_down = Linear.load(g, down, n_threads)
        self.n_ff = n_ff

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return self.w_down(_layer.gated(self.w_gate_up(h), self.n_ff, "silu"))


class _Experts:
    """The mixture of experts (llama.cpp's build_moe_ffn: softmax router, the chosen experts' weights normalised,
    SiLU-gated experts; the native MoE of csrc/moe.h), plus the shared expert when the file has one."""

    def __init__(self, g: GGUFFile, il: int, hp: HParams, n_threads: int) -> None:
        from llamax._native.moe import MoE

        p = f"blk.{il}."

        def experts(name: str) -> tuple[np.ndarray, int]:
            raw = g.raw(p + name)
            return raw.reshape(hp.n_expert, -1, raw.shape[1]), g.ggml_type(p + name)

        raws = {n: experts(f"ffn_{n}_exps.weight") for n in ("gate", "up", "down")}
        self.moe = MoE((np.ascontiguousarray(g.raw(p + "ffn_gate_inp.weight")), g.ggml_type(p + "ffn_gate_inp.weight")),
                       raws["gate"], raws["up"], raws["down"], n_used=hp.n_expert_used, norm_w=True, act="silu")
        self.shared = (_SwiGLU(g, p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight", p + "ffn_down_shexp.weight",
                               hp.n_ff_shexp, n_threads) if hp.n_ff_shexp else None)
        self.n_threads = n_threads

    def __call__(self, h: np.ndarray) -> np.ndarray:
        o = self.moe.forward(h, n_threads=self.n_threads)
        if self.shared is not None:
            o += self.shared(h)
        return o


class _Layer:
    def __init__(self, g: GGUFFile, il: int, hp: HParams, n_threads: int) -> None:
        p = f"blk.{il}."
        self.attn_norm = g.f32(p + "attn_norm.weight")
        self.mixer: Mamba2Mixer | HybridAttention = (Mamba2Mixer(g, il, hp, n_threads) if il in hp.recurrent_layers
                                                else HybridAttention(g, il, n_threads))
        self.ffn_norm = g.f32(p + "ffn_norm.weight")
        self.ffn: _SwiGLU | _Experts = (_Experts(g, il, hp, n_threads) if hp.n_expert else
                                        _SwiGLU(g, p + "ffn_gate.weight", p + "ffn_up.weight", p + "ffn_down.weight",
                                                hp.n_ff, n_threads))


class GraniteHybrid(Model, arch="granitehybrid"):
    """A granitehybrid-architecture model (Mamba-2 and attention layers, dense FFNs or experts, Granite's scales)
    over a HybridMemory."""

    def tensor_table(self, g: GGUFFile, hp: HParams) -> TensorTable:
        return granitehybrid_table(hp)

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.layers = [_Layer(g, il, hp, n_threads) for il in range(hp.n_layer)]
        link_native([L.mixer for L in self.layers if isinstance(L.mixer, Mamba2Mixer)], hp)   # one native object
        self.kq_scale = hp.kq_scale or 1.0 / math.sqrt(hp.n_embd_head_k)
        self.rope = None if hp.nope_layers else RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_kind)
        self.embd_scale = np.float32(hp.embd_scale) if hp.embd_scale else None
        self.residual_scale = np.float32(hp.residual_scale) if hp.residual_scale else None

    def create_memory(self, params: ContextParams, ropes: list[RoPE | None] | None = None) -> Memory:
        """Model.create_memory with the attention layers' RoPE for the KV cache's K-shift (ropes: as given)."""
        return super().create_memory(params, ropes if ropes is not None else [self.rope] * self.hparams.n_layer)

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states) after folding
        the ubatch into the recurrent states and writing its K/V into the attention cache (mem: a HybridMemory)."""
        assert isinstance(mem, HybridMemory), "a granitehybrid model runs over the hybrid memory create_memory made"
        hp, rs = self.hp, self.residual_scale
        x = self.tok_embd.rows(ub.token)
        if self.embd_scale is not None:
            x *= self.embd_scale
        with mem.lock:   # the cells stay as the views show them until every layer ran
            for il, L in enumerate(self.layers):
                h = rms_norm(x, L.attn_norm, hp.rms_eps)
                if isinstance(L.mixer, Mamba2Mixer):
                    o = L.mixer(h, mem.recr.recurrent_view(il, ub), ub.n_seq_tokens, hp, self.n_threads)
                else:
                    o = L.mixer(mem, il, ub, h, self.hp, self.kq_scale, self.rope, self.n_threads)
                if rs is not None:
                    o *= rs
                x += o
                h = rms_norm(x, L.ffn_norm, hp.rms_eps)
                o = L.ffn(h)
                if rs is not None:
                    o *= rs
                x += o
        return self._head(x, ub, embd)

    def _logits(self, xo: np.ndarray) -> np.ndarray:
        """The output layer, then Granite's logit scale (ggml_scale by its reciprocal, as llama.cpp)."""
        logits = super()._logits(xo)
        if self.hp.logit_scale:
            logits *= np.float32(1.0 / self.hp.logit_scale)
        return logits
