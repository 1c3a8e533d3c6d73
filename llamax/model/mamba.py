"""The mamba architecture (llama.cpp's llm_build_mamba, Mamba-1) over a recurrent memory.

Per layer: RMSNorm -> in-projection to x and z -> causal depthwise convolution of x over the
sequence's conv state, + bias, SiLU (native) -> x-projection to dt, B, C (each RMS-normed for
Falcon-Mamba's dt_b_c_rms) -> dt-projection + bias -> selective scan over the sequence's SSM state,
+ x * D, gated by SiLU(z) (native) -> out-projection -> residual. Then RMSNorm and the output (tied to
the token embedding when the GGUF has no output.weight). The states live in the memory
(llamax/memory/recurrent.py); the ubatch comes split equally (n_seqs sequences of n_t tokens), so the
native steps run each sequence's tokens in order through its own state. When the memory keeps
rollback rows (reserve_rollback), the view carries them and the same steps write the state after each
of a sequence's last tokens into them.

The products' bits do not depend on the rest of the batch: the GEMM for the quantized types it has,
the ordered float product (matmul.mul_mat_f32_ordered) for the weights GGUFs keep unquantized (ssm_x,
ssm_dt, and any f32 / f16 one). So a prompt gives the same logits in one batch, token by token or in
chunks.

forward runs every layer in one native call (llamax._native.mamba_layer, csrc/mamba_layer.h: no
Python between the layers); forward_reference composes the same steps in Python (mamba_mixer), the
reference the native step equals bit for bit (tests/test_mamba_layer.py).
"""
from __future__ import annotations

import numpy as np

from llamax._native import gemm, matmul
from llamax._native import ssm as _ssm
from llamax._native.mamba_layer import MambaStack
from llamax.memory.recurrent import RecurrentView
from llamax.model.gguf import MAMBA, GGUFFile, HParams
from llamax.model.linear import Linear, rms_norm
from llamax.model.model import Model


class OrderedProduct:
    """y = x @ W.T for a float weight kept unquantized (a Mamba's ssm_x and ssm_dt), W in float32 and
    every output one fixed-order sum (matmul.mul_mat_f32_ordered): a row's bits do not depend on the
    other rows, as the GEMM's do not."""

    def __init__(self, w: np.ndarray, n_threads: int) -> None:
        self.w = np.ascontiguousarray(w, dtype=np.float32)   # [n_out, n_in]
        self.n_threads = n_threads

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return matmul.mul_mat_f32_ordered(self.w, np.ascontiguousarray(x, dtype=np.float32), self.n_threads)


def _product(g: GGUFFile, name: str, n_threads: int) -> Linear | OrderedProduct:
    """A weight's product: Linear when its type has the GEMM, else the ordered float32 product
    (both give a row the same bits whatever the batch)."""
    if gemm.supported(g.ggml_type(name)):
        return Linear.load(g, name, n_threads)
    return OrderedProduct(g.f32(name, n_threads), n_threads)


class MambaMixer:
    """A Mamba-1 mixer's weights (llama.cpp's build_mamba_layer)."""

    def __init__(self, g: GGUFFile, il: int, n_threads: int) -> None:
        p = f"blk.{il}."
        self.ssm_in = _product(g, p + "ssm_in.weight", n_threads)
        self.conv_w = g.f32(p + "ssm_conv1d.weight")          # [d_inner, d_conv]
        self.conv_b = g.f32(p + "ssm_conv1d.bias")
        self.ssm_x = _product(g, p + "ssm_x.weight", n_threads)
        self.ssm_dt = _product(g, p + "ssm_dt.weight", n_threads)
        self.dt_b = g.f32(p + "ssm_dt.bias")
        self.A = g.f32(p + "ssm_a")                            # [d_inner, d_state]: -exp(A_log)
        self.D = g.f32(p + "ssm_d")
        self.ssm_out = _product(g, p + "ssm_out.weight", n_threads)
        # Jamba's RMS norms of dt, B and C (absent in a Mamba)
        self.dt_norm, self.b_norm, self.c_norm = (g.f32(p + n) if p + n in g.tensors else None for n in
                                                  ("ssm_dt_norm.weight", "ssm_b_norm.weight", "ssm_c_norm.weight"))


def _native_product(P: Linear | OrderedProduct) -> list | np.ndarray:
    """A product as the native layer takes it: a Linear's parts, or an OrderedProduct's float32 matrix."""
    return P.w if isinstance(P, OrderedProduct) else list(P.parts)


def native_layer(L: MambaMixer, norm: np.ndarray, hp: HParams, ffn: dict | None = None) -> dict:
    """The dict of one layer for llamax._native.mamba_layer.MambaStack: the mixer L after the RMSNorm of
    weight norm (Falcon-Mamba's unweighted dt/B/C norms as weights of ones: the same bits), and ffn
    (ffn_norm, w_gate_up: Linear, w_down: Linear, n_ff) when a SwiGLU FFN block follows the mixer
    (Jamba)."""
    norms: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]
    if hp.ssm_dt_b_c_rms:
        norms = (np.ones(hp.ssm_dt_rank, np.float32), np.ones(hp.ssm_d_state, np.float32),
                 np.ones(hp.ssm_d_state, np.float32))
    elif L.dt_norm is not None and L.b_norm is not None and L.c_norm is not None:
        norms = (L.dt_norm, L.b_norm, L.c_norm)
    else:
        norms = (None, None, None)
    d = dict(n_embd=hp.n_embd, d_inner=hp.ssm_d_inner, d_state=hp.ssm_d_state, dt_rank=hp.ssm_dt_rank,
             d_conv=L.conv_w.shape[1], eps=hp.rms_eps, norm=norm, ssm_in=_native_product(L.ssm_in),
             conv_w=L.conv_w, conv_b=L.conv_b, ssm_x=_native_product(L.ssm_x), dt_norm=norms[0], b_norm=norms[1],
             c_norm=norms[2], ssm_dt=_native_product(L.ssm_dt), dt_b=L.dt_b, A=L.A, D=L.D,
             ssm_out=_native_product(L.ssm_out))
    if ffn is not None:
        d.update(n_ff=ffn["n_ff"], ffn_norm=ffn["ffn_norm"], w_gate_up=_native_product(ffn["w_gate_up"]),
                 w_down=_native_product(ffn["w_down"]))
    return d


def mamba_mixer(L: MambaMixer, h: np.ndarray, view: RecurrentView, n_t: int, hp: HParams, n_threads: int) -> np.ndarray:
    """One Mamba-1 mixer (llama.cpp's build_mamba_layer) on the normed hidden states h [n, n_embd] of an
    equally split ubatch, its states read and updated in view (and the rollback rows written when the view has
    them); returns [n, n_embd] (before the residual)."""
    di, ds, dr = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
    xz = L.ssm_in(h)                                                        # [n, 2 * d_inner]
    x = _ssm.conv(view.conv, view.cells, xz[:, :di], L.conv_w, L.conv_b, n_t, n_threads,
                  hist=view.conv_hist, hist_row=view.hist_row)
    xdb = L.ssm_x(x)                                                        # [n, dt_rank + 2 * d_state]
    dt, B, C = xdb[:, :dr], xdb[:, dr:dr + ds], xdb[:, dr + ds:]
    if hp.ssm_dt_b_c_rms:   # Falcon-Mamba: each RMS-normed, without a weight
        dt, B, C = (rms_norm(a, np.ones(a.shape[1], np.float32), hp.rms_eps) for a in (dt, B, C))
    elif L.dt_norm is not None and L.b_norm is not None and L.c_norm is not None:   # Jamba: RMS-normed, weighted
        dt, B, C = (rms_norm(a, w, hp.rms_eps) for a, w in ((dt, L.dt_norm), (B, L.b_norm), (C, L.c_norm)))
    dt = L.ssm_dt(np.ascontiguousarray(dt))
    dt += L.dt_b
    y = _ssm.scan(view.ssm, view.cells, x, dt, L.A, B, C, L.D, xz[:, di:], n_t, n_threads,
                  hist=view.ssm_hist, hist_row=view.hist_row, undo=view.ssm_undo, undo_slot=view.undo_slot)
    return L.ssm_out(y)


def stack_forward(model, mem, ub, embd: bool) -> np.ndarray:
    """A recurrent model's forward whose every layer is one native stack (model.stack: MambaStack or
    mamba2_layer.Mamba2Layers): the embeddings, the stack over each layer's view, the head."""
    x = model.tok_embd.rows(ub.token)
    with mem.lock:   # the cells stay as the views show them until every layer ran
        views = [mem.recurrent_view(il, ub) for il in range(model.hp.n_layer)]
        model.stack.forward(x, views, ub.n_seq_tokens, model.n_threads)
    return model._head(x, ub, embd)


class Mamba(Model, arch="mamba"):
    """A mamba-architecture model (Mamba-1): its weights and forward pass over a RecurrentMemory."""

    TENSORS = MAMBA

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.norms = [g.f32(f"blk.{il}.attn_norm.weight") for il in range(hp.n_layer)]
        self.layers = [MambaMixer(g, il, n_threads) for il in range(hp.n_layer)]
        self.stack = MambaStack([native_layer(L, norm, hp) for norm, L in zip(self.norms, self.layers)])

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states) after folding the ubatch's tokens
        into their sequences' states: every layer in one native call (csrc/mamba_layer.h)."""
        return stack_forward(self, mem, ub, embd)

    def forward_reference(self, mem, ub, embd: bool = False) -> np.ndarray:
        """forward composed in Python, step by step (rms_norm, mamba_mixer, the residual): the reference
        of the native layer step (tests/test_mamba_layer.py: the same bits)."""
        hp = self.hp
        x = self.tok_embd.rows(ub.token)
        with mem.lock:   # the cells stay as the views show them until every layer ran
            for il, (norm, L) in enumerate(zip(self.norms, self.layers)):
                h = rms_norm(x, norm, hp.rms_eps)
                x += mamba_mixer(L, h, mem.recurrent_view(il, ub), ub.n_seq_tokens, hp, self.n_threads)
        return self._head(x, ub, embd)
