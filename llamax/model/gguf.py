"""Reading a GGUF file: metadata, hyperparameters and tensors.

The file is memory-mapped once (llamax.model.gguf_reader.GGUFReader, our own parser of the container;
the `gguf` package's reader takes 14 s on Gemma's 262144-token vocabulary); tensors are read as views
of the mapping and dequantized to float32 on request. Every failure to read or to find something is a
ModelError.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llamax._native import quants
from llamax.errors import ModelError
from llamax.model.gguf_reader import GGUFReader, GGUFValueType

#: the recurrent architectures, each a Model subclass in llamax/model/<arch>.py; the transformer families
#: are described by data (llamax/model/family.py) and run by llamax/model/decoder.py
RECURRENT_ARCHS = ("mamba", "jamba", "mamba2", "granitehybrid", "nemotron_h", "qwen35")
#: the recurrent architectures whose recurrent layers are Mamba-2 ones (ssm.group_count; heads of the scan)
MAMBA2_ARCHS = ("mamba2", "granitehybrid", "nemotron_h")
DENSE_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "smollm3", "granite", "granitemoe",
               "olmo2")
#: every architecture with a forward pass
ARCHS = DENSE_ARCHS + RECURRENT_ARCHS


@dataclass(frozen=True)
class HParams:
    """The hyperparameters llama.cpp reads from a GGUF (llama_hparams), for one architecture."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    n_ctx_train: int
    n_vocab: int
    rms_eps: float
    n_rot: int
    rope_kind: str                      # "norm" or "neox" (llama.cpp's rope type of the arch)
    rope_freq_base: float
    rope_freq_scale: float = 1.0
    n_swa: int = 0
    swa_type: str = "none"
    swa_layers: tuple[int, ...] = ()
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    tied_output: bool = True
    # the selective state space (llama.cpp's ssm_*; 0 for an attention-only model) and the layers that
    # keep a recurrent state instead of K/V cells (every layer of a Mamba)
    # (left out of the model fingerprint at their defaults: the states of attention models saved before
    # these fields existed still load)
    ssm_d_conv: int = field(default=0, metadata={"omit_default": True})
    ssm_d_inner: int = field(default=0, metadata={"omit_default": True})
    ssm_d_state: int = field(default=0, metadata={"omit_default": True})
    ssm_dt_rank: int = field(default=0, metadata={"omit_default": True})
    ssm_dt_b_c_rms: bool = field(default=False, metadata={"omit_default": True})
    # llama.cpp's ssm_n_group (0: a Mamba-1): Mamba-2's groups of B and C (its scan has ssm_dt_rank heads of
    # ssm_d_inner / ssm_dt_rank channels); a gated delta net's key heads (qwen35)
    ssm_n_group: int = field(default=0, metadata={"omit_default": True})
    recurrent_layers: tuple[int, ...] = field(default=(), metadata={"omit_default": True})
    # the layers that are an FFN alone (nemotron_h: neither attention nor a recurrent state)
    ffn_layers: tuple[int, ...] = field(default=(), metadata={"omit_default": True})
    # llama.cpp's f_attention_scale: the factor Q is multiplied by before attention (0: 1/sqrt(n_embd_head_k)).
    # Derived from the fields above, so it is left out of comparisons (and of the model fingerprint).
    attn_scale: float = field(default=0.0, compare=False)
    # the transformer families' extras (llamax/model/family.py), each at a default that means "as llama":
    # RoPE scaling (YaRN's extrapolation mix and attention factor, the original context of YaRN / LongRoPE,
    # 0: n_ctx_train), the kq scale ({arch}.attention.scale, 0: 1/sqrt(n_embd_head_k)), Granite's scales
    # (0: none), the layers without RoPE, and a mixture of experts' sizes (0: a dense FFN)
    rope_ext_factor: float = field(default=0.0, metadata={"omit_default": True})
    rope_attn_factor: float = field(default=1.0, metadata={"omit_default": True})
    n_ctx_orig: int = field(default=0, metadata={"omit_default": True})
    kq_scale: float = field(default=0.0, metadata={"omit_default": True})
    embd_scale: float = field(default=0.0, metadata={"omit_default": True})
    residual_scale: float = field(default=0.0, metadata={"omit_default": True})
    logit_scale: float = field(default=0.0, metadata={"omit_default": True})
    nope_layers: tuple[int, ...] = field(default=(), metadata={"omit_default": True})
    n_expert: int = field(default=0, metadata={"omit_default": True})
    n_expert_used: int = field(default=0, metadata={"omit_default": True})
    n_ff_exp: int = field(default=0, metadata={"omit_default": True})
    # the shared expert's FFN length beside a mixture of experts (granitehybrid's; 0: none)
    n_ff_shexp: int = field(default=0, metadata={"omit_default": True})
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def ssm_conv_dim(self) -> int:
        """The channels of a recurrent layer's convolution: d_inner (Mamba-1: x), d_inner + 2 * n_group *
        d_state (Mamba-2: x, B and C)."""
        return self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state

    @property
    def r_shape(self) -> tuple[int, int]:
        """One sequence's conv state in a recurrent layer (llama.cpp's n_embd_r): [ssm_conv_dim, d_conv - 1]."""
        return (self.ssm_conv_dim, self.ssm_d_conv - 1)

    @property
    def s_shape(self) -> tuple[int, ...]:
        """One sequence's SSM state in a recurrent layer (llama.cpp's n_embd_s): [d_inner, d_state] (Mamba-1),
        [n_head, head_dim, d_state] (Mamba-2: n_head = dt_rank, head_dim = d_inner / n_head; a gated delta net's
        [n_v_heads, d_state, d_state], its d_inner being n_v_heads * d_state)."""
        if self.ssm_n_group:
            return (self.ssm_dt_rank, self.ssm_d_inner // self.ssm_dt_rank, self.ssm_d_state)
        return (self.ssm_d_inner, self.ssm_d_state)


class GGUFFile:
    """An opened GGUF file: metadata fields and tensors by name.

    Raises:
        ModelError: the file is missing, is not a GGUF, or cannot be parsed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"no model file at {self.path}")
        self.reader = GGUFReader(self.path)  # raises ModelError for anything malformed
        self.tensors = {t.name: t for t in self.reader.tensors}

    # ---- metadata ------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = ModelError) -> Any:
        """The value of a metadata key (strings decoded, arrays as lists)."""
        if key not in self.reader.fields:
            if default is ModelError:
                raise ModelError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        v = self.reader.fields[key]
        return v.tolist() if isinstance(v, np.ndarray) else list(v) if isinstance(v, list) else v

    def array(self, key: str, dtype=None) -> np.ndarray | None:
        """A numeric array field as numpy (no per-element Python objects), None if absent."""
        v = self.reader.fields.get(key)
        if v is None:
            return None
        if not isinstance(v, np.ndarray):
            raise ModelError(f"{self.path.name}: metadata {key!r} is not a numeric array")
        return v.astype(dtype) if dtype is not None else v

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture"))

    # ---- tensors -------------------------------------------------------------------------------
    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name}: tensor {name!r} is missing")
        return t

    def ggml_type(self, name: str) -> int:
        return self.tensor(name).ggml_type

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order (ggml's ne reversed)."""
        return tuple(self.tensor(name).np_shape)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, row_bytes] (a view of the mapping)."""
        t = self.tensor(name)
        rows = int(np.prod(t.np_shape[:-1])) if len(t.shape) > 1 else 1
        return self.reader.tensor_data(name).reshape(rows, -1)

    def release(self, name: str) -> None:
        """The tensor's pages leave the resident set (a copy of its bytes is kept elsewhere)."""
        self.reader.release(name)

    def f32(self, name: str, n_threads: int | None = None) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order (native, bit-exact with ggml).

        Raises:
            ModelError: a tensor type that cannot be dequantized.
        """
        t = self.ggml_type(name)
        if not quants.can_dequantize(t):
            raise ModelError(f"{self.path.name}: tensor {name!r} has type {t}, which cannot be dequantized")
        return quants.dequantize(t, np.ascontiguousarray(self.raw(name)), self.shape(name), n_threads)


def _brief(v: list) -> str:
    return str(v) if len(v) <= 8 else str(v[:8])[:-1] + ", ...]"


def _brief_value(v: Any) -> str:
    """A metadata value for a message: an array as its first values, a long string cut."""
    return _brief(v) if isinstance(v, list) else repr(v)[:80]


class _Keys:
    """Typed reads of one architecture's keys ({arch}.<key>), each failure a ModelError naming the key."""

    def __init__(self, g: GGUFFile, arch: str) -> None:
        self.g, self.arch, self.file = g, arch, g.path.name

    def key(self, k: str) -> str:
        return f"{self.arch}.{k}"

    def has(self, k: str) -> bool:
        return self.g.has(self.key(k))

    def integer(self, k: str, default: Any = ModelError, *, minimum: int = 1, value: Any = None) -> int:
        """An integer key (bools, floats and strings are not integers), at least `minimum`."""
        v = self.g.get(self.key(k), default) if value is None else value
        if isinstance(v, bool) or not isinstance(v, int):
            raise ModelError(f"{self.file}: {self.key(k)} is {_brief_value(v)}, not an integer")
        if v < minimum:
            raise ModelError(f"{self.file}: {self.key(k)} is {v}; it must be "
                             + ("positive" if minimum == 1 else f"at least {minimum}"))
        return v

    def per_layer(self, k: str, n_layer: int, default: Any = ModelError) -> int:
        """A key llama.cpp reads with get_key_or_arr: one value, or an array of one value per layer.
        llamax's forward passes take one value for all layers, so the array's values must agree."""
        v = self.g.get(self.key(k), default)
        if isinstance(v, list):
            if len(v) != n_layer:
                raise ModelError(f"{self.file}: {self.key(k)} has {len(v)} values, expected one per layer "
                                 f"(block_count {n_layer})")
            if any(x != v[0] for x in v):
                raise ModelError(f"{self.file}: {self.key(k)} differs between layers ({_brief(v)}); llamax "
                                 f"supports one value for all layers")
            v = v[0]
        return self.integer(k, value=v)

    def number(self, k: str, default: Any = ModelError, *, positive: bool = False) -> float:
        """A finite number (an int or a float, not a bool); > 0 when positive, else >= 0."""
        v = self.g.get(self.key(k), default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelError(f"{self.file}: {self.key(k)} is {_brief_value(v)}, not a number")
        v = float(v)
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ModelError(f"{self.file}: {self.key(k)} is {v}; it must be finite and "
                             + ("positive" if positive else "at least 0"))
        return v


def _n_vocab(g: GGUFFile) -> int:
    """The vocabulary's token count (llama.cpp's vocab.n_tokens()).

    Raises:
        ModelError: no tokenizer.ggml.tokens, or not an array of strings."""
    toks = g.reader.fields.get("tokenizer.ggml.tokens")
    if toks is None or (isinstance(toks, list) and not toks):
        raise ModelError(f"{g.path.name}: no vocabulary (tokenizer.ggml.tokens)")
    if g.reader.field_type("tokenizer.ggml.tokens") != (GGUFValueType.ARRAY, GGUFValueType.STRING):
        raise ModelError(f"{g.path.name}: tokenizer.ggml.tokens is "
                         f"{g.reader.field_type('tokenizer.ggml.tokens')[0].name}"
                         f"{'' if not isinstance(toks, np.ndarray) else ' of ' + str(toks.dtype)}, "
                         "expected an array of strings")
    assert isinstance(toks, list)
    return len(toks)


def read_ssm(g: GGUFFile, k: _Keys) -> HParams:
    """llama.cpp's hyperparameters of LLM_ARCH_MAMBA (Mamba-1: no attention, every layer recurrent),
    LLM_ARCH_JAMBA (a layer whose attention.head_count_kv is 0 is a Mamba layer, the others attend
    without RoPE; every layer has a dense FFN), LLM_ARCH_MAMBA2 (Mamba-2: every layer recurrent) and
    LLM_ARCH_GRANITE_HYBRID (Mamba-2 layers where attention.head_count_kv is 0, attention with RoPE
    unless rope.scaling.finetuned is false, Granite's scales, dense FFNs or experts) and LLM_ARCH_NEMOTRON_H
    (each layer attention without RoPE, Mamba-2 or an FFN alone: _read_nemotron_h_layers).

    Checks: block_count, embedding_length, context_length and the ssm sizes (conv_kernel at most
    the native kernel's widest, inner_size, state_size, time_step_rank) positive integers; Mamba-1:
    no ssm.group_count; Mamba-2: ssm.group_count a positive integer dividing time_step_rank (its heads),
    which divides inner_size; for the hybrids, head_count and feed_forward_length one value (or one
    per layer, all equal), head_count_kv one per layer, the same for every attention layer and dividing
    head_count; granitehybrid's experts as _read_granitehybrid; a vocabulary."""
    from llamax._native import ssm as _ssm

    if k.arch == "qwen35":
        return read_qwen35(g, k)
    f = g.path.name
    n_layer = k.integer("block_count")
    attn: dict[str, Any] = dict(n_head=0, n_head_kv=0, n_embd_head_k=0, n_embd_head_v=0, n_ff=0)
    extra: dict[str, Any] = {}
    recurrent = tuple(range(n_layer))
    if k.arch in ("jamba", "granitehybrid"):
        kv = g.get(k.key("attention.head_count_kv"))
        kv = kv if isinstance(kv, list) else [kv] * n_layer
        if len(kv) != n_layer or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in kv):
            raise ModelError(f"{f}: {k.key('attention.head_count_kv')} is {_brief_value(kv)}: expected one count "
                             f">= 0 per layer (0 for a Mamba layer)")
        recurrent = tuple(il for il, x in enumerate(kv) if x == 0)
        counts = {x for x in kv if x > 0}
        if len(counts) > 1:
            raise ModelError(f"{f}: {k.key('attention.head_count_kv')} differs between attention layers "
                             f"({_brief(kv)}); llamax supports one value for all of them")
        n_head = k.per_layer("attention.head_count", n_layer)
        n_head_kv = counts.pop() if counts else n_head
        if n_head % n_head_kv or k.integer("embedding_length") % n_head:
            raise ModelError(f"{f}: {k.key('attention.head_count')} {n_head} must divide "
                             f"{k.key('embedding_length')} and be a multiple of head_count_kv {n_head_kv}")
        head = k.integer("embedding_length") // n_head
        attn = dict(n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=head, n_embd_head_v=head,
                    n_ff=k.per_layer("feed_forward_length", n_layer))
    if k.arch == "granitehybrid":
        extra = _read_granitehybrid(g, k, n_layer, attn["n_embd_head_k"])
    ffn_only: tuple[int, ...] = ()
    if k.arch == "nemotron_h":
        attn, recurrent, ffn_only = _read_nemotron_h_layers(g, k, n_layer)
    n_group = 0
    if k.arch in MAMBA2_ARCHS:
        n_group = k.integer("ssm.group_count")
        n_ssm_head, d_inner = k.integer("ssm.time_step_rank"), k.integer("ssm.inner_size")
        if n_ssm_head % n_group or d_inner % n_ssm_head:
            raise ModelError(f"{f}: {k.key('ssm.group_count')} {n_group} must divide {k.key('ssm.time_step_rank')} "
                             f"{n_ssm_head} (the scan's heads), which must divide {k.key('ssm.inner_size')} {d_inner}")
    elif k.has("ssm.group_count") and k.integer("ssm.group_count", minimum=0) > 0:
        raise ModelError(f"{f}: {k.key('ssm.group_count')} is set: a Mamba-2 model, but llama.cpp's {k.arch} is "
                         f"Mamba-1 (llamax runs Mamba-2 as mamba2 / granitehybrid)")
    d_conv = k.integer("ssm.conv_kernel")
    if d_conv > _ssm.MAX_CONV:
        raise ModelError(f"{f}: {k.key('ssm.conv_kernel')} {d_conv} is wider than llamax's convolution "
                         f"({_ssm.MAX_CONV})")
    dt_b_c_rms = g.get(k.key("ssm.dt_b_c_rms"), False)
    if not isinstance(dt_b_c_rms, bool):
        raise ModelError(f"{f}: {k.key('ssm.dt_b_c_rms')} is {_brief_value(dt_b_c_rms)}, not a bool")
    return HParams(
        arch=k.arch, n_layer=n_layer, n_embd=k.integer("embedding_length"), **attn,
        n_ctx_train=k.integer("context_length"), n_vocab=_n_vocab(g),
        rms_eps=k.number("attention.layer_norm_rms_epsilon", k.number("attention.layer_norm_epsilon")
                         if k.arch == "nemotron_h" else ModelError),
        **(extra or dict(n_rot=0, rope_kind="none", rope_freq_base=10000.0)),
        tied_output="output.weight" not in g.tensors,
        ssm_d_conv=d_conv, ssm_d_inner=k.integer("ssm.inner_size"), ssm_d_state=k.integer("ssm.state_size"),
        ssm_dt_rank=k.integer("ssm.time_step_rank"), ssm_dt_b_c_rms=dt_b_c_rms, ssm_n_group=n_group,
        recurrent_layers=recurrent, ffn_layers=ffn_only)


def _per_layer_list(g: GGUFFile, k: _Keys, key: str, n_layer: int) -> list[int]:
    """A key of one count >= 0 per layer (or one count for all), as a list of n_layer."""
    v = g.get(k.key(key))
    v = v if isinstance(v, list) else [v] * n_layer
    if len(v) != n_layer or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise ModelError(f"{g.path.name}: {k.key(key)} is {_brief_value(v)}: expected one count >= 0 per layer")
    return v


def _one_value(g: GGUFFile, k: _Keys, key: str, v: list[int], layers: list[int]) -> int:
    """The one value of a per-layer key over some layers (0 when there are none)."""
    vals = {v[il] for il in layers}
    if len(vals) > 1:
        raise ModelError(f"{g.path.name}: {k.key(key)} differs between the layers that use it ({_brief(v)}); "
                         f"llamax supports one value for all of them")
    return vals.pop() if vals else 0


def _read_nemotron_h_layers(g: GGUFFile, k: _Keys, n_layer: int) -> tuple[dict[str, Any], tuple[int, ...],
                                                                            tuple[int, ...]]:
    """nemotron_h's three kinds of layer (llama_model_nemotron_h::load_arch_hparams): an FFN alone where
    feed_forward_length is not 0, attention (no RoPE) where head_count_kv is not 0, else Mamba-2. Returns the
    attention sizes (head_count, head_count_kv and feed_forward_length one value over the layers that use them,
    the head size key_length, else embedding_length / head_count), the recurrent layers and the FFN layers.
    Experts (expert_count, a Nemotron-H MoE) are refused."""
    f = g.path.name
    if k.integer("expert_count", 0, minimum=0) > 0:
        raise ModelError(f"{f}: {k.key('expert_count')} is set: a mixture of experts, which llamax's nemotron_h "
                         f"does not support")
    kv = _per_layer_list(g, k, "attention.head_count_kv", n_layer)
    ff = _per_layer_list(g, k, "feed_forward_length", n_layer)
    ffn = [il for il in range(n_layer) if ff[il] > 0]
    att = [il for il in range(n_layer) if ff[il] == 0 and kv[il] > 0]
    recurrent = tuple(il for il in range(n_layer) if ff[il] == 0 and kv[il] == 0)
    n_head = _one_value(g, k, "attention.head_count", _per_layer_list(g, k, "attention.head_count", n_layer), att)
    n_head_kv = _one_value(g, k, "attention.head_count_kv", kv, att)
    n_embd = k.integer("embedding_length")
    head = 0
    if att:
        if n_head % n_head_kv:
            raise ModelError(f"{f}: {k.key('attention.head_count_kv')} {n_head_kv} does not divide "
                             f"{k.key('attention.head_count')} {n_head}")
        if not k.has("attention.key_length") and n_embd % n_head:
            raise ModelError(f"{f}: {k.key('embedding_length')} {n_embd} is not a multiple of "
                             f"{k.key('attention.head_count')} {n_head} (the head size, as no key_length is given)")
        head = k.integer("attention.key_length", n_embd // n_head)
        if k.integer("attention.value_length", head) != head:
            raise ModelError(f"{f}: {k.key('attention.value_length')} differs from {k.key('attention.key_length')} "
                             f"{head}; llamax's nemotron_h takes one head size")
    attn = dict(n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=head, n_embd_head_v=head,
                n_ff=_one_value(g, k, "feed_forward_length", ff, ffn))
    return attn, recurrent, tuple(ffn)


def _read_granitehybrid(g: GGUFFile, k: _Keys, n_layer: int, head: int) -> dict[str, Any]:
    """granitehybrid's attention and scales (llama_model_granite_hybrid::load_arch_hparams): RoPE (NORM) in every
    attention layer unless rope.scaling.finetuned is false, rope.dimension_count (even, at most the head size),
    rope.freq_base, a linear rope.scaling.factor; attention.scale, embedding_scale, residual_scale, logit_scale
    (0 or absent: none). A mixture of experts when expert_count > 0 (Granite-4.0-H-Tiny / Small): expert_used_count
    of them (at most the count), each of feed_forward_length, and a shared expert of
    expert_shared_feed_forward_length (0 or absent: none); the router's softmax weights normalised over the
    chosen experts, unscaled (llama.cpp reads no expert_weights_scale for granitehybrid)."""
    f = g.path.name
    moe: dict[str, Any] = {}
    n_expert = k.integer("expert_count", 0, minimum=0)
    if n_expert:
        n_used = k.integer("expert_used_count")
        if n_used > n_expert:
            raise ModelError(f"{f}: {k.key('expert_used_count')} {n_used} exceeds {k.key('expert_count')} {n_expert}")
        moe = dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=k.per_layer("feed_forward_length", n_layer),
                   n_ff_shexp=k.integer("expert_shared_feed_forward_length", 0, minimum=0))
    n_rot = k.integer("rope.dimension_count", head)
    if n_rot % 2 or n_rot > head:
        raise ModelError(f"{f}: {k.key('rope.dimension_count')} {n_rot} must be even and at most the head size {head}")
    scaling = g.get(k.key("rope.scaling.type"), "linear")
    if scaling not in ("none", "linear"):
        raise ModelError(f"{f}: {k.key('rope.scaling.type')} {_brief_value(scaling)} is not supported for "
                         f"granitehybrid (none, linear)")
    freq_scale = 1.0 if scaling == "none" else 1.0 / (k.number("rope.scaling.factor", 1.0) or 1.0)
    rope = g.get(k.key("rope.scaling.finetuned"), True)
    if not isinstance(rope, bool):
        raise ModelError(f"{f}: {k.key('rope.scaling.finetuned')} is {_brief_value(rope)}, not a bool")
    return dict(n_rot=n_rot, rope_kind="norm", rope_freq_base=k.number("rope.freq_base", 10000.0, positive=True),
                rope_freq_scale=freq_scale, nope_layers=() if rope else tuple(range(n_layer)),
                kq_scale=k.number("attention.scale", 0.0), embd_scale=k.number("embedding_scale", 0.0),
                residual_scale=k.number("residual_scale", 0.0), logit_scale=k.number("logit_scale", 0.0), **moe)


def _imrope_sections_cover(sections: list[int], n_rot: int) -> bool:
    """Whether interleaved M-RoPE with these 4 sections (ggml's ggml_mrope_cache_init, imrope) gives every
    rotated pair i < n_rot / 2 one of the first three positions, all the token's position for text (llama.cpp
    sets the 4th to 0): then it is NEOX RoPE over n_rot dimensions."""
    t, h, w, _ = sections
    n = sum(sections)
    for i in range(n_rot // 2):
        sector = i % n if n else i
        if not ((sector % 3 == 1 and sector < 3 * h) or (sector % 3 == 2 and sector < 3 * w)
                or (sector % 3 == 0 and sector < 3 * t)):
            return False
    return True


def read_qwen35(g: GGUFFile, k: _Keys) -> HParams:
    """llama.cpp's hyperparameters of LLM_ARCH_QWEN35 (Qwen3.5, dense FFNs): gated-delta-net layers (the
    recurrent ones: attention.recurrent_layers, else every layer but each full_attention_interval-th,
    default 4) and full-attention layers (Q with a gate, Q/K norms, partial interleaved M-RoPE).

    Checks: block_count, embedding_length, context_length, head_count, head_count_kv (one value, or one
    per layer, all equal; dividing head_count), key_length == value_length (default embedding_length /
    head_count), feed_forward_length, the ssm sizes (conv_kernel at most the native convolution's widest;
    inner_size = time_step_rank * state_size; group_count dividing time_step_rank) positive integers;
    rope.dimension_count even and at most the head size; rope.dimension_sections 4 counts that give every
    rotated pair the token's position; no expert_count (qwen35moe is not supported), no rope scaling, no
    nextn_predict_layers (the MTP head); at least one recurrent and one attention layer; a vocabulary."""
    from llamax._native import ssm as _ssm

    f = g.path.name
    n_layer = k.integer("block_count")
    if k.has("expert_count") and k.integer("expert_count", minimum=0) > 0:
        raise ModelError(f"{f}: {k.key('expert_count')} is set: a mixture of experts (qwen35moe), which llamax's "
                         "qwen35 does not support")
    if k.has("nextn_predict_layers") and k.integer("nextn_predict_layers", minimum=0) > 0:
        raise ModelError(f"{f}: {k.key('nextn_predict_layers')} is set: llamax does not run the MTP layers")
    scaling = g.get(k.key("rope.scaling.type"), "none")
    if scaling != "none":
        raise ModelError(f"{f}: {k.key('rope.scaling.type')} is {_brief_value(scaling)}; llamax's qwen35 "
                         "supports none")
    n_embd = k.integer("embedding_length")
    n_head = k.per_layer("attention.head_count", n_layer)
    n_head_kv = k.per_layer("attention.head_count_kv", n_layer)
    if n_head % n_head_kv:
        raise ModelError(f"{f}: {k.key('attention.head_count')} {n_head} must be a multiple of head_count_kv "
                         f"{n_head_kv}")
    if not k.has("attention.key_length") and n_embd % n_head:
        raise ModelError(f"{f}: {k.key('embedding_length')} {n_embd} is not a multiple of head_count {n_head}")
    head_k = k.integer("attention.key_length", n_embd // n_head)
    head_v = k.integer("attention.value_length", head_k)
    if head_k != head_v:
        raise ModelError(f"{f}: {k.key('attention.key_length')} {head_k} != value_length {head_v}")
    n_rot = k.integer("rope.dimension_count", head_k)
    if n_rot % 2 or n_rot > head_k:
        raise ModelError(f"{f}: {k.key('rope.dimension_count')} {n_rot} must be even and at most the head size "
                         f"{head_k}")
    sections = g.get(k.key("rope.dimension_sections"))
    if not isinstance(sections, list) or len(sections) != 4 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in sections) or not any(sections[:3]):
        raise ModelError(f"{f}: {k.key('rope.dimension_sections')} is {_brief_value(sections)}: expected 4 "
                         "counts >= 0, one of the first three positive")
    if not _imrope_sections_cover(sections, n_rot):
        raise ModelError(f"{f}: {k.key('rope.dimension_sections')} {sections} leave some of the {n_rot // 2} "
                         "rotated pairs to the 4th position (vision input), which llamax does not support")
    rec = g.get(k.key("attention.recurrent_layers"), None)
    if rec is not None:
        rec = rec if isinstance(rec, list) else [rec] * n_layer
        if len(rec) != n_layer or any(not isinstance(x, (bool, int)) for x in rec):
            raise ModelError(f"{f}: {k.key('attention.recurrent_layers')} is {_brief_value(rec)}: expected one "
                             "flag per layer")
        recurrent = tuple(il for il, x in enumerate(rec) if x)
    else:
        interval = k.integer("full_attention_interval", 4)
        recurrent = tuple(il for il in range(n_layer) if (il + 1) % interval != 0)
    if not recurrent or len(recurrent) == n_layer:
        raise ModelError(f"{f}: the layers are all {'attention' if not recurrent else 'recurrent'} layers; "
                         "llamax's qwen35 runs a mix of both")
    d_conv = k.integer("ssm.conv_kernel")
    if d_conv > _ssm.MAX_CONV:
        raise ModelError(f"{f}: {k.key('ssm.conv_kernel')} {d_conv} is wider than llamax's convolution "
                         f"({_ssm.MAX_CONV})")
    d_inner, d_state = k.integer("ssm.inner_size"), k.integer("ssm.state_size")
    dt_rank, n_group = k.integer("ssm.time_step_rank"), k.integer("ssm.group_count")
    if d_inner != dt_rank * d_state or dt_rank % n_group:
        raise ModelError(f"{f}: {k.key('ssm.inner_size')} {d_inner} must be time_step_rank {dt_rank} * state_size "
                         f"{d_state}, and group_count {n_group} must divide time_step_rank")
    kq_scale = k.number("attention.scale", 0.0)
    return HParams(
        arch=k.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=head_k,
        n_embd_head_v=head_v, n_ff=k.per_layer("feed_forward_length", n_layer),
        n_ctx_train=k.integer("context_length"), n_vocab=_n_vocab(g),
        rms_eps=k.number("attention.layer_norm_rms_epsilon"), n_rot=n_rot, rope_kind="neox",
        rope_freq_base=k.number("rope.freq_base", 10000.0, positive=True), tied_output="output.weight" not in g.tensors,
        ssm_d_conv=d_conv, ssm_d_inner=d_inner, ssm_d_state=d_state, ssm_dt_rank=dt_rank, ssm_n_group=n_group,
        recurrent_layers=recurrent, kq_scale=kq_scale)


# ---- the tensors against the hyperparameters ---------------------------------------------------------
@dataclass(frozen=True)
class TensorTable:
    """An architecture's tensors, as its llama.cpp load_arch_tensors creates them: each name with its
    shape in ggml order (ne0 first, as llama.cpp writes {n_embd, n_vocab}), the dimensions named as in
    llama.cpp (see _dims). `model` and `layer` tensors are required, `layer` names once per layer after
    "blk.{il}."; an `optional` tensor is checked when present."""

    model: dict[str, tuple[str, ...]]
    layer: dict[str, tuple[str, ...]]
    optional: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a hybrid model's two kinds of layer: these per attention layer / per recurrent layer (hp.recurrent_layers)
    attn_layer: dict[str, tuple[str, ...]] = field(default_factory=dict)
    recr_layer: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # and per FFN-only layer (hp.ffn_layers, nemotron_h)
    ffn_layer: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def with_layer(self, extra: dict[str, tuple[str, ...]]) -> "TensorTable":
        """This table with more per-layer tensors."""
        return TensorTable(self.model, self.layer | extra, self.optional, self.attn_layer, self.recr_layer,
                           self.ffn_layer)


#: the head every table has: the embedding, the final norm, the output (tied when absent)
Shapes = dict[str, tuple[str, ...]]
HEAD: Shapes = {"token_embd.weight": ("n_embd", "n_vocab"), "output_norm.weight": ("n_embd",)}
HEAD_OPTIONAL: Shapes = {"output.weight": ("n_embd", "n_vocab")}
#: a dense SwiGLU FFN's weights
SWIGLU: Shapes = {"ffn_gate.weight": ("n_embd", "n_ff"), "ffn_up.weight": ("n_embd", "n_ff"), "ffn_down.weight": ("n_ff", "n_embd")}
#: plain attention's Q, K, V and output weights (no biases)
ATTN_QKVO: Shapes = {"attn_q.weight": ("n_embd", "n_embd_q"), "attn_k.weight": ("n_embd", "n_embd_k_gqa"),
                     "attn_v.weight": ("n_embd", "n_embd_v_gqa"), "attn_output.weight": ("n_embd_q", "n_embd")}

#: the dense decoder both architectures start from (llama.cpp's llama load_arch_tensors without
#: biases or RoPE factors): output.weight absent means the output is token_embd
DENSE_DECODER = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",), **ATTN_QKVO, "ffn_norm.weight": ("n_embd",), **SWIGLU})


#: a Mamba-1 mixer's tensors (llama.cpp's build_mamba_layer); ssm_a and ssm_d have no ".weight"
MAMBA_MIXER = {"ssm_in.weight": ("n_embd", "2*d_inner"),
               "ssm_conv1d.weight": ("d_conv", "d_inner"),
               "ssm_conv1d.bias": ("d_inner",),
               "ssm_x.weight": ("d_inner", "dt_rank+2*d_state"),
               "ssm_dt.weight": ("dt_rank", "d_inner"),
               "ssm_dt.bias": ("d_inner",),
               "ssm_a": ("d_state", "d_inner"),
               "ssm_d": ("d_inner",),
               "ssm_out.weight": ("d_inner", "n_embd")}

#: llama.cpp's LLM_ARCH_MAMBA tensors (Mamba-1)
MAMBA = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",), **MAMBA_MIXER})

#: a Mamba-2 mixer's tensors (llama.cpp's build_mamba2_layer): the in-projection to z, x, B, C and dt (one per
#: head), the convolution over x, B and C, the scalar A and D per head, the grouped RMS norm of y
MAMBA2_MIXER = {"ssm_in.weight": ("n_embd", "d_in_proj"),
                "ssm_conv1d.weight": ("d_conv", "conv_dim"),
                "ssm_conv1d.bias": ("conv_dim",),
                "ssm_dt.bias": ("dt_rank",),
                "ssm_a": ("1", "dt_rank"),
                "ssm_d": ("1", "dt_rank"),
                "ssm_norm.weight": ("d_inner/n_group", "n_group"),
                "ssm_out.weight": ("d_inner", "n_embd")}

#: llama.cpp's LLM_ARCH_MAMBA2 tensors
MAMBA2 = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",), **MAMBA2_MIXER})

#: llama.cpp's LLM_ARCH_GRANITE_HYBRID tensors with dense FFNs and no biases: every layer a norm, a mixer and a
#: SwiGLU FFN; the mixer is attention or Mamba-2
GRANITEHYBRID = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",),
           "ffn_norm.weight": ("n_embd",), **SWIGLU},
    attn_layer=ATTN_QKVO,
    recr_layer=MAMBA2_MIXER)



def granitehybrid_table(hp: HParams) -> TensorTable:
    """GRANITEHYBRID, with a mixture of experts in place of the dense FFN when hp.n_expert (the router and the
    experts' gate, up and down), and the shared expert's when hp.n_ff_shexp."""
    if not hp.n_expert:
        return GRANITEHYBRID
    ffn = {"attn_norm.weight": ("n_embd",),
           "ffn_norm.weight": ("n_embd",),
           "ffn_gate_inp.weight": ("n_embd", "n_expert"),
           "ffn_gate_exps.weight": ("n_embd", "n_ff_exp", "n_expert"),
           "ffn_up_exps.weight": ("n_embd", "n_ff_exp", "n_expert"),
           "ffn_down_exps.weight": ("n_ff_exp", "n_embd", "n_expert")}
    if hp.n_ff_shexp:
        ffn |= {"ffn_gate_shexp.weight": ("n_embd", "n_ff_shexp"),
                "ffn_up_shexp.weight": ("n_embd", "n_ff_shexp"),
                "ffn_down_shexp.weight": ("n_ff_shexp", "n_embd")}
    return TensorTable(GRANITEHYBRID.model, ffn, GRANITEHYBRID.optional, GRANITEHYBRID.attn_layer,
                       GRANITEHYBRID.recr_layer)


#: llama.cpp's LLM_ARCH_NEMOTRON_H tensors without biases or experts: every layer a norm and one of attention
#: (no RoPE), Mamba-2 or a ReLU^2 FFN (up, down)
NEMOTRON_H = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",)},
    attn_layer=ATTN_QKVO,
    recr_layer=MAMBA2_MIXER,
    ffn_layer={"ffn_up.weight": ("n_embd", "n_ff"), "ffn_down.weight": ("n_ff", "n_embd")})

#: llama.cpp's LLM_ARCH_JAMBA tensors with dense FFNs: every layer a norm, a mixer and a SwiGLU FFN; the mixer
#: is attention (no biases) or Mamba-1 with RMS norms of dt, B and C
JAMBA = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",),
           "ffn_norm.weight": ("n_embd",), **SWIGLU},
    attn_layer=ATTN_QKVO,
    recr_layer={**MAMBA_MIXER,
                "ssm_dt_norm.weight": ("dt_rank",),
                "ssm_b_norm.weight": ("d_state",),
                "ssm_c_norm.weight": ("d_state",)})


#: llama.cpp's LLM_ARCH_QWEN35 tensors (dense FFNs): every layer a norm, a mixer, a post-attention norm and a
#: SwiGLU FFN; the mixer is a gated delta net (its q, k, v in one projection, the output gate, the convolution,
#: the decay's bias and scale, beta and alpha, the gated norm) or attention (Q with its gate, Q/K norms)
QWEN35 = TensorTable(
    model=HEAD,
    optional=HEAD_OPTIONAL,
    layer={"attn_norm.weight": ("n_embd",),
           "post_attention_norm.weight": ("n_embd",), **SWIGLU},
    attn_layer={"attn_q.weight": ("n_embd", "2*n_embd_q"),
                "attn_k.weight": ("n_embd", "n_embd_k_gqa"),
                "attn_v.weight": ("n_embd", "n_embd_v_gqa"),
                "attn_output.weight": ("n_embd_q", "n_embd"),
                "attn_q_norm.weight": ("n_embd_head_k",),
                "attn_k_norm.weight": ("n_embd_head_k",)},
    recr_layer={"attn_qkv.weight": ("n_embd", "conv_dim"),
                "attn_gate.weight": ("n_embd", "d_inner"),
                "ssm_conv1d.weight": ("d_conv", "conv_dim"),
                "ssm_dt.bias": ("dt_rank",),
                "ssm_a": ("dt_rank",),
                "ssm_beta.weight": ("n_embd", "dt_rank"),
                "ssm_alpha.weight": ("n_embd", "dt_rank"),
                "ssm_norm.weight": ("d_state",),
                "ssm_out.weight": ("d_inner", "n_embd")})


def _dims(hp: HParams) -> dict[str, tuple[int, str]]:
    """llama.cpp's names of the dimensions (LLAMA_LOAD_LOCALS): each value and where it comes from."""
    a, k, v = hp.arch, hp.n_embd_head_k, hp.n_embd_head_v
    if hp.ssm_d_inner:
        di, ds, dr = hp.ssm_d_inner, hp.ssm_d_state, hp.ssm_dt_rank
        ssm = {
            "d_inner": (di, f"d_inner {di} from {a}.ssm.inner_size"),
            "2*d_inner": (2 * di, f"2 * d_inner {di} from {a}.ssm.inner_size"),
            "d_conv": (hp.ssm_d_conv, f"d_conv {hp.ssm_d_conv} from {a}.ssm.conv_kernel"),
            "d_state": (ds, f"d_state {ds} from {a}.ssm.state_size"),
            "dt_rank": (dr, f"dt_rank {dr} from {a}.ssm.time_step_rank"),
            "dt_rank+2*d_state": (dr + 2 * ds, f"dt_rank {dr} + 2 * d_state {ds}"),
        }
        if hp.ssm_n_group:   # Mamba-2 (dt_rank: the scan's heads) or a gated delta net (q, k: n_group heads, v)
            ng, cd = hp.ssm_n_group, hp.ssm_conv_dim
            ssm.update({
                "1": (1, "1"),
                "n_group": (ng, f"n_group {ng} from {a}.ssm.group_count"),
                "d_inner/n_group": (di // ng, f"d_inner {di} / n_group {ng}"),
                "conv_dim": (cd, f"conv_dim {cd} = d_inner {di} + 2 * n_group {ng} from {a}.ssm.group_count "
                                 f"* d_state {ds}"),
                "d_in_proj": (di + cd + dr, f"2 * d_inner {di} + 2 * n_group {ng} * d_state {ds} + n_head dt_rank {dr}"),
            })
    else:
        ssm = {}
    head_k = (f"n_embd_head_k {k} = n_embd {hp.n_embd} / n_head {hp.n_head}" if k * hp.n_head == hp.n_embd
              else f"n_embd_head_k {k} from {a}.attention.key_length")
    return {
        "n_embd": (hp.n_embd, f"n_embd {hp.n_embd} from {a}.embedding_length"),
        "n_vocab": (hp.n_vocab, f"n_vocab {hp.n_vocab} from tokenizer.ggml.tokens"),
        "n_ff": (hp.n_ff, f"n_ff {hp.n_ff} from {a}.feed_forward_length"),
        "n_embd_head_k": (k, head_k),
        "n_embd_q": (hp.n_head * k, f"n_embd_q {hp.n_head * k} = n_head {hp.n_head} * n_embd_head_k {k}"),
        "2*n_embd_q": (2 * hp.n_head * k, f"2 * n_embd_q {hp.n_head * k} (Q and its gate)"),
        "n_embd_k_gqa": (hp.n_head_kv * k, f"n_embd_k_gqa {hp.n_head_kv * k} = n_head_kv {hp.n_head_kv} * "
                                           f"n_embd_head_k {k}"),
        "n_embd_v_gqa": (hp.n_head_kv * v, f"n_embd_v_gqa {hp.n_head_kv * v} = n_head_kv {hp.n_head_kv} * "
                                           f"n_embd_head_v {v}"),
        "n_embd_qkv": (hp.n_head * k + 2 * hp.n_head_kv * v,
                       f"n_embd_qkv {hp.n_head * k + 2 * hp.n_head_kv * v} = (n_head {hp.n_head} + 2 n_head_kv "
                       f"{hp.n_head_kv}) * n_embd_head_k {k}"),
        "2*n_ff": (2 * hp.n_ff, f"2 * n_ff {hp.n_ff} from {a}.feed_forward_length"),
        "n_rot/2": (hp.n_rot // 2, f"n_rot / 2 = {hp.n_rot // 2} from {a}.rope.dimension_count"),
        "n_expert": (hp.n_expert, f"n_expert {hp.n_expert} from {a}.expert_count"),
        "n_ff_exp": (hp.n_ff_exp, f"n_ff_exp {hp.n_ff_exp} from {a}.expert_feed_forward_length"),
        "n_ff_shexp": (hp.n_ff_shexp, f"n_ff_shexp {hp.n_ff_shexp} from {a}.expert_shared_feed_forward_length"),
        **ssm,
    }


def _fmt(ne) -> str:
    return "[" + ", ".join(str(int(x)) for x in ne) + "]"


_BLK = re.compile(r"blk\.(\d+)\.")


def check_tensors(g: GGUFFile, hp: HParams, table: TensorTable) -> None:
    """llama.cpp's create_tensor -> check_tensor_dims for every tensor of the table, then
    done_getting_tensors: no tensor of the file is left over. Reads tensor infos only; O(n_tensors).

    The rank must match exactly (llama.cpp also takes trailing dimensions of 1, which llamax's loaders
    do not reshape away), and every tensor's type must be one llamax can dequantize.

    Raises:
        ModelError: a tensor missing, of another shape (the message gives both shapes and the
            hyperparameters behind the expected one), of an unusable type, of a layer >= block_count,
            or not in the table at all (llama.cpp's optional biases, RoPE factors or fused QKV, which
            llamax's forward passes do not use).
    """
    f, dims, seen = g.path.name, _dims(hp), set()

    def check(name: str, spec: tuple[str, ...], required: bool) -> None:
        want = tuple(dims[d][0] for d in spec)
        why = ", ".join(dict.fromkeys(dims[d][1] for d in spec))
        t = g.tensors.get(name)
        if t is None:
            if required:
                raise ModelError(f"{f}: tensor {name!r} is missing (expected {_fmt(want)}: {why})")
            return
        if tuple(int(x) for x in t.shape) != want:
            raise ModelError(f"{f}: tensor {name!r} has shape {_fmt(t.shape)}, expected {_fmt(want)} ({why})")
        if not quants.can_dequantize(t.ggml_type):
            raise ModelError(f"{f}: tensor {name!r} has type {quants.type_name(t.ggml_type)}, which llamax "
                             f"cannot dequantize (an activation-only format)")
        seen.add(name)

    for name, spec in table.model.items():
        check(name, spec, True)
    for name, spec in table.optional.items():
        check(name, spec, False)
    for il in range(hp.n_layer):
        kind = (table.recr_layer if il in hp.recurrent_layers else table.ffn_layer if il in hp.ffn_layers
                else table.attn_layer)
        for name, spec in (table.layer | kind).items():
            check(f"blk.{il}.{name}", spec, True)
    for name in g.tensors:
        if name in seen:
            continue
        m = _BLK.match(name)
        if m and int(m.group(1)) >= hp.n_layer:
            raise ModelError(f"{f}: tensor {name!r} is for layer {m.group(1)}, but {hp.arch}.block_count is "
                             f"{hp.n_layer}")
        raise ModelError(f"{f}: unexpected tensor {name!r}: llamax's {hp.arch} does not use it (nor does "
                         f"llama.cpp's {hp.arch}, or it is an optional part llamax does not support)")
