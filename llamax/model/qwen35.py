"""The qwen35 architecture (llama.cpp's llama_model_qwen35: Qwen3.5 with dense FFNs) over a hybrid memory.

Per layer: RMSNorm -> the mixer -> residual -> RMSNorm (post_attention_norm) -> SwiGLU FFN -> residual. Then
RMSNorm and the output (tied to the token embedding when the GGUF has no output.weight).

The mixer of a recurrent layer is a gated delta net (build_layer_attn_linear): one projection gives the
mixed q, k, v, the output gate z, beta and alpha; q, k, v go through the causal depthwise convolution over
the sequence's conv state and SiLU (csrc/ssm.h's, without a bias); q and k are L2-normed per head
(ggml_rms_norm with eps / d, times 1 / sqrt(d)); g = softplus(alpha + dt_bias) * ssm_a (ssm_a = -exp(A_log))
is the per-head log decay, sigmoid(beta) the write strength; the gated delta rule runs over the sequence's
state (csrc/delta_net.h); each head's output is RMS-normed (ssm_norm), times silu(z), and projected out.
Its conv and delta-rule states live in the hybrid memory's recurrent part, [conv_dim, d_conv - 1] and
[n_v_heads, d_state, d_state] per sequence, with rollback rows when reserve_rollback asked for them.

The mixer of an attention layer (build_layer_attn, Qwen3-Next style): attn_q gives each head's query and
its gate side by side; Q and K are RMS-normed per head, rotated by NEOX RoPE over the first n_rot
dimensions (llama.cpp's interleaved M-RoPE, whose sections give every rotated pair the token's position
for text: read_qwen35 checks so), K/V written into the hybrid memory's KV cache and attended; the result
is multiplied by sigmoid(gate) and projected out.

Float weights (every one of the synthetic models) take the ordered float product, the quantized ones the
GEMM: a row's bits do not depend on the rest of the batch, so a prompt gives the same logits in one batch,
token by token or in chunks. Mixtures of experts (qwen35moe) are refused by read_qwen35.
"""
from __future__ import annotations

import math

import numpy as np

from llamax._native import delta_net as _dn
from llamax._native import gemm
from llamax._native import layer as _layer
from llamax._native import rope as _rope
from llamax._native import ssm as _ssm
from llamax.memory import HybridMemory, Memory
from llamax.memory.recurrent import RecurrentView
from llamax.model.gguf import QWEN35, GGUFFile, HParams
from llamax.model.linear import Linear, rms_norm
from llamax.model.mamba import OrderedProduct
from llamax.model.model import Model
from llamax.params import ContextParams
from llamax.rope import RoPE


class _Product:
    """y = x @ W.T for weights stacked along n_out, each run of consecutive weights through the product
    mamba's choose for it: the GEMM where the type has it (Linear), else the ordered float32 product
    (mamba.OrderedProduct); either way a row's bits do not depend on the other rows."""

    def __init__(self, g: GGUFFile, names: list[str], n_threads: int) -> None:
        runs: list[tuple[bool, list[str]]] = []
        for n in names:
            quantized = gemm.supported(g.ggml_type(n))
            if runs and runs[-1][0] == quantized:
                runs[-1][1].append(n)
            else:
                runs.append((quantized, [n]))
        self.parts: list[Linear | OrderedProduct] = [
            Linear.concat(g, run, n_threads) if quantized
            else OrderedProduct(np.concatenate([g.f32(n, n_threads) for n in run]), n_threads)
            for quantized, run in runs]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        ys = [f(x) for f in self.parts]
        return ys[0] if len(ys) == 1 else np.concatenate(ys, axis=1)


class DeltaNet:
    """A gated delta net's weights (llama.cpp's build_layer_attn_linear)."""

    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        # [qkv | z | beta | alpha] in one product
        self.w_in = _Product(g, [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                                 p + "ssm_alpha.weight"], n_threads)
        self.conv_w = g.f32(p + "ssm_conv1d.weight")      # [conv_dim, d_conv]
        self.dt_b = g.f32(p + "ssm_dt.bias")               # [n_v_heads]
        self.a = g.f32(p + "ssm_a")                         # [n_v_heads]: -exp(A_log)
        self.norm = g.f32(p + "ssm_norm.weight")           # [d_state]
        self.w_out = _Product(g, [p + "ssm_out.weight"], n_threads)


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """llama.cpp's build_gdn_l2_norm over the last axis (d): rms_norm with eps / d, times 1 / sqrt(d)."""
    d = x.shape[-1]
    y = rms_norm(x, np.ones(d, np.float32), eps / d)
    y *= np.float32(1.0 / math.sqrt(d))
    return y


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml_sigmoid: 1 / (1 + e^-x) (0 where e^-x overflows)."""
    with np.errstate(over="ignore"):
        return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _silu(x: np.ndarray) -> np.ndarray:
    """ggml_silu: x / (1 + e^-x)."""
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    """ggml_softplus: log(1 + e^x), x itself above 20."""
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(x))).astype(np.float32)


def delta_net_inputs(L: DeltaNet, h: np.ndarray, hp: HParams) -> tuple[np.ndarray, ...]:
    """The in-projection's parts for the normed hidden states h [n, n_embd]: qkv [n, conv_dim] (before the
    convolution), z [n, d_inner], g (the log decay) and beta (sigmoid) [n, n_v_heads]."""
    nv, ki, di = hp.ssm_dt_rank, hp.ssm_n_group * hp.ssm_d_state, hp.ssm_d_inner
    cd = 2 * ki + di
    y = L.w_in(h)
    qkv, z = y[:, :cd], y[:, cd:cd + di]
    beta = _sigmoid(np.ascontiguousarray(y[:, cd + di:cd + di + nv]))
    alpha = y[:, cd + di + nv:] + L.dt_b
    g = np.ascontiguousarray(_softplus(alpha) * L.a)
    return qkv, z, g, beta


def delta_net_mixer(L: DeltaNet, h: np.ndarray, view: RecurrentView, n_t: int, hp: HParams,
                    n_threads: int) -> np.ndarray:
    """One gated delta net on the normed hidden states h [n, n_embd] of an equally split ubatch, its states
    read and updated in view (and the rollback rows written when the view has them); returns [n, n_embd]
    (before the residual)."""
    n, ds, nv, ki = h.shape[0], hp.ssm_d_state, hp.ssm_dt_rank, hp.ssm_n_group * hp.ssm_d_state
    qkv, z, g, beta = delta_net_inputs(L, h, hp)
    x = _ssm.conv(view.conv, view.cells, qkv, L.conv_w, None, n_t, n_threads,
                  hist=view.conv_hist, hist_row=view.hist_row)                      # silu(conv) [n, conv_dim]
    q = l2_norm(x[:, :ki].reshape(n, -1, ds), hp.rms_eps).reshape(n, ki)
    k = l2_norm(x[:, ki:2 * ki].reshape(n, -1, ds), hp.rms_eps).reshape(n, ki)
    o = _dn.rule(view.ssm, view.cells, q, k, x[:, 2 * ki:], g, beta, n_t, n_threads,
                 hist=view.ssm_hist, hist_row=view.hist_row, undo=view.ssm_undo,
                 undo_slot=view.undo_slot)                                          # [n, n_v_heads, d_state]
    o = rms_norm(o, L.norm, hp.rms_eps)
    o *= _silu(z.reshape(n, nv, ds))
    return L.w_out(o.reshape(n, nv * ds))


class _Attention:
    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        self.wqkv = _Product(g, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], n_threads)
        self.wo = _Product(g, [p + "attn_output.weight"], n_threads)
        self.q_norm = g.f32(p + "attn_q_norm.weight")
        self.k_norm = g.f32(p + "attn_k_norm.weight")


class _Layer:
    def __init__(self, g: GGUFFile, il: int, hp: HParams, n_threads: int) -> None:
        p = f"blk.{il}."
        self.attn_norm = g.f32(p + "attn_norm.weight")
        self.mixer: DeltaNet | _Attention = (DeltaNet(g, il, n_threads) if il in hp.recurrent_layers
                                             else _Attention(g, il, n_threads))
        self.post_norm = g.f32(p + "post_attention_norm.weight")
        self.w_gate_up = _Product(g, [p + "ffn_gate.weight", p + "ffn_up.weight"], n_threads)
        self.w_down = _Product(g, [p + "ffn_down.weight"], n_threads)


class Qwen35(Model, arch="qwen35"):
    """A qwen35-architecture model (gated delta nets and gated attention, dense FFNs) over a HybridMemory."""

    TENSORS = QWEN35

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.layers = [_Layer(g, il, hp, n_threads) for il in range(hp.n_layer)]
        self.kq_scale = hp.kq_scale or 1.0 / math.sqrt(hp.n_embd_head_k)
        self.rope = RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, "neox")

    def create_memory(self, params: ContextParams, ropes: list[RoPE | None] | None = None) -> Memory:
        """Model.create_memory (the delta-net layers' states: hp.r_shape [conv_dim, d_conv - 1], hp.s_shape
        [n_v_heads, d_state, d_state], each head's matrix transposed as llama.cpp keeps it, csrc/delta_net.h)
        with the attention layers' RoPE for the KV cache's K-shift (ropes: each layer's, as given)."""
        return super().create_memory(params, ropes if ropes is not None else [self.rope] * self.hp.n_layer)

    def _attention(self, A: _Attention, mem: HybridMemory, il: int, ub, h: np.ndarray) -> np.ndarray:
        hp, n, d = self.hp, h.shape[0], self.hp.n_embd_head_k
        nq, nk = 2 * hp.n_head * d, hp.n_head_kv * d
        qkv = A.wqkv(h)
        qg = qkv[:, :nq].reshape(n, hp.n_head, 2 * d)
        q = rms_norm(qg[:, :, :d], A.q_norm, hp.rms_eps)                       # [n, n_head, d], contiguous
        gate = qg[:, :, d:].reshape(n, hp.n_head * d)
        k = rms_norm(qkv[:, nq:nq + nk].reshape(n, hp.n_head_kv, d), A.k_norm, hp.rms_eps)
        v = np.ascontiguousarray(qkv[:, nq + nk:]).reshape(n, hp.n_head_kv, hp.n_embd_head_v)
        r = self.rope
        for t in (q, k):
            _rope.rope_f32(t, ub.pos, r.n_rot, r.freq_base, r.freq_scale, r.mode, self.n_threads, **r.scaling_kwargs)
        mem.attn.store(il, ub, k, v)
        a = mem.attn.attend(il, ub, q, scale=self.kq_scale).reshape(n, -1)
        a *= _sigmoid(gate)
        return A.wo(a)

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states) after folding
        the ubatch into the delta nets' states and writing its K/V into the attention cache (mem: the
        HybridMemory create_memory made)."""
        assert isinstance(mem, HybridMemory), "a qwen35 model runs over the hybrid memory create_memory made"
        hp = self.hp
        x = self.tok_embd.rows(ub.token)
        with mem.lock:   # the cells stay as the views show them until every layer ran
            for il, L in enumerate(self.layers):
                h = rms_norm(x, L.attn_norm, hp.rms_eps)
                if isinstance(L.mixer, DeltaNet):
                    x += delta_net_mixer(L.mixer, h, mem.recr.recurrent_view(il, ub), ub.n_seq_tokens, hp,
                                         self.n_threads)
                else:
                    x += self._attention(L.mixer, mem, il, ub, h)
                h = rms_norm(x, L.post_norm, hp.rms_eps)
                x += L.w_down(_layer.gated(L.w_gate_up(h), hp.n_ff, "silu"))
        return self._head(x, ub, embd)
