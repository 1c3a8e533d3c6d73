"""The mamba2 architecture (llama.cpp's build_mamba2_layer, Mamba-2) over a recurrent memory.

Per layer: RMSNorm -> in-projection to z, x|B|C and dt (one dt per head) -> causal depthwise convolution
of x, B and C together over the sequence's conv state, + bias, SiLU (csrc/ssm.h's convolution) -> dt +
bias -> the Mamba-2 selective scan over the sequence's SSM state (csrc/ssd.h: n_head = ssm.time_step_rank
heads of d_inner / n_head channels, a scalar A and D per head, B and C shared by the heads of each of
ssm.group_count groups), + x * D, gated by SiLU(z) -> RMS norm of y per group (ssm_norm) ->
out-projection -> residual. Then RMSNorm and the output (tied to the token embedding when the GGUF has no
output.weight).

The memory's rows (llama.cpp's n_embd_r / n_embd_s): conv [d_inner + 2 * n_group * d_state, d_conv - 1],
ssm [n_head, head_dim, d_state] (HParams.r_shape / s_shape). The ubatch comes split equally (n_seqs
sequences of n_t tokens), so the native steps run each sequence's tokens in order through its own state;
when the memory keeps rollback rows (reserve_rollback) both steps write the state after each of a
sequence's last tokens into them, as Mamba-1's do. As for Mamba-1 (llamax/model/mamba.py), a row's bits
do not depend on the rest of the batch: a prompt gives the same logits in one batch, token by token or
in chunks, and for any thread count.

The mixer runs natively in one call (llamax._native.mamba2_layer, csrc/mamba2_layer.h): a Mamba2Mixer
called on h, as the hybrids call it, and for the mamba2 architecture every layer with its norm and
residual in one call (Mamba2.forward). mamba2_mixer composes the same kernels in Python, the reference
the native step equals bit for bit (tests/test_mamba2_layer.py); Mamba2.forward_reference uses it.
"""
from __future__ import annotations

import numpy as np

from llamax._native import ssd as _ssd
from llamax._native import ssm as _ssm
from llamax._native.mamba2_layer import Mamba2Layers
from llamax.memory.recurrent import RecurrentView
from llamax.model.gguf import MAMBA2, GGUFFile, HParams
from llamax.model.linear import rms_norm
from llamax.model.mamba import _native_product, _product, stack_forward
from llamax.model.model import Model


class Mamba2Mixer:
    """A Mamba-2 mixer's weights (llama.cpp's build_mamba2_layer); called on normed hidden states, the
    native mixer (mamba2_mixer's bits)."""

    def __init__(self, g: GGUFFile, il: int, hp: HParams, n_threads: int) -> None:
        p = f"blk.{il}."
        self.ssm_in = _product(g, p + "ssm_in.weight", n_threads)     # -> [z | x, B, C | dt]
        self.conv_w = g.f32(p + "ssm_conv1d.weight")                   # [conv_dim, d_conv]
        self.conv_b = g.f32(p + "ssm_conv1d.bias")                     # [conv_dim]
        self.dt_b = g.f32(p + "ssm_dt.bias")                           # [n_head]
        self.A = np.ascontiguousarray(g.f32(p + "ssm_a").reshape(-1))  # [n_head]: -exp(A_log)
        self.D = np.ascontiguousarray(g.f32(p + "ssm_d").reshape(-1))  # [n_head]
        self.norm = g.f32(p + "ssm_norm.weight")                       # [n_group, d_inner / n_group]
        self.ssm_out = _product(g, p + "ssm_out.weight", n_threads)
        self.native: Mamba2Layers | None = None   # the model's native layers holding this mixer (link_native)
        self.index = -1

    def __call__(self, h: np.ndarray, view: RecurrentView, n_t: int, hp: HParams, n_threads: int) -> np.ndarray:
        """The mixer on the normed hidden states h [n, n_embd] in one native call (mamba2_mixer's arguments
        and bits)."""
        assert self.native is not None, "a mixer runs natively once its model linked it (link_native)"
        return self.native.mixer(self.index, h, view, n_t, n_threads)


def link_native(mixers: list[Mamba2Mixer], hp: HParams, norms: list[np.ndarray] | None = None) -> Mamba2Layers:
    """One Mamba2Layers over a model's mixers (with their pre-norms for a mamba2 model's forward), each mixer
    linked to its layer there: the model's mixers share one native object and one work buffer."""
    layers = Mamba2Layers([native_layer(L, norms[j] if norms is not None else None, hp)
                           for j, L in enumerate(mixers)])
    for j, L in enumerate(mixers):
        L.native, L.index = layers, j
    return layers


def native_layer(L: Mamba2Mixer, norm: np.ndarray | None, hp: HParams) -> dict:
    """The dict of one layer for llamax._native.mamba2_layer.Mamba2Layers: the mixer L, after the RMSNorm of
    weight norm (None: a mixer run alone)."""
    return dict(n_embd=hp.n_embd, d_inner=hp.ssm_d_inner, d_state=hp.ssm_d_state, n_group=hp.ssm_n_group,
                n_head=hp.ssm_dt_rank, d_conv=L.conv_w.shape[1], eps=hp.rms_eps, norm=norm,
                ssm_in=_native_product(L.ssm_in), conv_w=L.conv_w, conv_b=L.conv_b, dt_b=L.dt_b, A=L.A, D=L.D,
                ssm_norm=L.norm.reshape(hp.ssm_n_group, -1), ssm_out=_native_product(L.ssm_out))


def mamba2_mixer(L: Mamba2Mixer, h: np.ndarray, view: RecurrentView, n_t: int, hp: HParams,
                 n_threads: int) -> np.ndarray:
    """One Mamba-2 mixer (llama.cpp's build_mamba2_layer) on the normed hidden states h [n, n_embd] of an
    equally split ubatch, its states read and updated in view (and the rollback rows written when the view
    has them); returns [n, n_embd] (before the residual)."""
    di, ds, ng, cd = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_n_group, hp.ssm_conv_dim
    n = h.shape[0]
    zxbcdt = L.ssm_in(h)                                                    # [n, d_inner + conv_dim + n_head]
    xbc = _ssm.conv(view.conv, view.cells, zxbcdt[:, di:di + cd], L.conv_w, L.conv_b, n_t, n_threads,
                    hist=view.conv_hist, hist_row=view.hist_row)            # [n, conv_dim]
    dt = zxbcdt[:, di + cd:] + L.dt_b                                       # [n, n_head]
    y = _ssd.scan(view.ssm, view.cells, xbc[:, :di], dt, L.A, xbc[:, di:di + ng * ds], xbc[:, di + ng * ds:],
                  L.D, zxbcdt[:, :di], n_t, ng, n_threads, hist=view.ssm_hist, hist_row=view.hist_row,
                  undo=view.ssm_undo, undo_slot=view.undo_slot)
    # the grouped RMS norm: each group of d_inner / n_group channels normed, then times its own weights
    gs = di // ng
    y = rms_norm(y.reshape(n * ng, gs), np.ones(gs, np.float32), hp.rms_eps).reshape(n, ng, gs)
    y *= L.norm
    return L.ssm_out(y.reshape(n, di))


class Mamba2(Model, arch="mamba2"):
    """A mamba2-architecture model (Mamba-2): its weights and forward pass over a RecurrentMemory."""

    TENSORS = MAMBA2

    def __init__(self, g: GGUFFile, hp: HParams, n_threads: int) -> None:
        super().__init__(g, hp, n_threads)
        self.hp = hp
        self._load_head(g)
        self.norms = [g.f32(f"blk.{il}.attn_norm.weight") for il in range(hp.n_layer)]
        self.layers = [Mamba2Mixer(g, il, hp, n_threads) for il in range(hp.n_layer)]
        self.stack = link_native(self.layers, hp, self.norms)

    def forward(self, mem, ub, embd: bool = False) -> np.ndarray:
        """Logits [n outputs of the ubatch, n_vocab] (ubatch order; embd: the normed hidden states) after folding
        the ubatch's tokens into their sequences' states: every layer in one native call."""
        return stack_forward(self, mem, ub, embd)

    def forward_reference(self, mem, ub, embd: bool = False) -> np.ndarray:
        """forward composed in Python, step by step (rms_norm, mamba2_mixer, the residual): the reference of
        the native step (the same bits)."""
        hp = self.hp
        x = self.tok_embd.rows(ub.token)
        with mem.lock:   # the cells stay as the views show them until every layer ran
            for il, (norm, L) in enumerate(zip(self.norms, self.layers)):
                h = rms_norm(x, norm, hp.rms_eps)
                x += mamba2_mixer(L, h, mem.recurrent_view(il, ub), ub.n_seq_tokens, hp, self.n_threads)
        return self._head(x, ub, embd)
