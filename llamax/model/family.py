"""The dense and mixture-of-experts transformer families, described by data.

One table (FAMILIES) says how each architecture's decoder layer differs from llama's: where its norms
sit, whether Q and K are RMS-normed per head or over the whole projection, its gate activation, its
embedding / residual / logit scales and softcaps, its RoPE kind, which layers slide or skip RoPE, and
whether its FFN is a mixture of experts. llamax/model/decoder.py runs every entry through the one native
layer step (csrc/layer.h); read_dense reads an entry's hyperparameters (llama.cpp's load_hparams and the
architecture's load_arch_hparams, src/models/<arch>.cpp), and tensor_table lists the tensors its
load_arch_tensors creates, for check_tensors.

A family this table cannot express gets its own module (llamax/model/mamba.py, jamba.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llamax.errors import ModelError
from llamax.model.gguf import (ARCHS, RECURRENT_ARCHS, GGUFFile, HParams, TensorTable, _brief_value, _Keys,
                               _n_vocab, read_ssm)
from llamax.rope import yarn_attn_factor


@dataclass(frozen=True)
class Family:
    """How an architecture's decoder differs from llama's (llm_build_llama)."""

    arch: str
    rope: str = "norm"                # llama.cpp's rope type of the arch: "norm" or "neox"
    n_rot_is_head: bool = True        # the graph asserts n_rot == n_embd_head (most do)
    qk_norm: str | None = None        # "head": RMS norm of each Q / K head (weight [d_k]); "full": of the whole
                                      # Q and K projections (OLMo 2: weights [n_head d_k], [n_head_kv d_k])
    pre_norm: bool = True             # attn_norm before attention, ffn_norm before the FFN
    post_norm: bool = False           # post_attention_norm / post_ffw_norm on each block's output
    act: str = "silu"                 # the FFN gate: "silu" or "gelu_table" (ggml's f16 GELU)
    embd_scale: str | None = None     # "sqrt_n_embd" (Gemma) or "key" ({arch}.embedding_scale, Granite)
    q_scale: str | None = None        # Q scaled before attention, kq scale 1: "attn_scale" (Gemma's
                                      # f_attention_scale) or "head" (1/sqrt(d_k), Phi-3)
    kq_scale_key: bool = False        # {arch}.attention.scale is the kq scale when set (llama, granite, smollm3)
    residual_scale: bool = False      # {arch}.residual_scale on each block's output (Granite)
    logit_scale: bool = False         # logits divided by {arch}.logit_scale (Granite)
    attn_softcap: bool = False        # attention logits soft-capped ({arch}.attn_logit_softcapping, Gemma 2)
    final_softcap: str | None = None  # "always" (Gemma 2: {arch}.final_logit_softcapping, default 30) or
                                      # "no_swa" (Gemma 3 without a window)
    swa: tuple[int, int] | None = None   # (default period, default window): layer il slides iff il % period <
                                         # period - 1; the window from {arch}.attention.sliding_window
    swa_needs_key: bool = False       # sliding only when {arch}.attention.sliding_window is set (OLMo 2 / 3)
    swa_plain_rope: bool = False      # sliding layers rotate without scaling (OLMo 3)
    swa_disabled: bool = False        # a window in the GGUF is ignored (Phi-3, as llama.cpp does)
    nope_step: int = 0                # every nope_step-th layer applies no RoPE (SmolLM3: 4)
    fused: bool = False               # attn_qkv may be one tensor, ffn_up holds [gate | up] (Phi-3)
    biases: bool = False              # optional Q/K/V biases (Qwen 2)
    rope_factors: bool = False        # rope_freqs (Llama 3) / rope_factors_long, _short (LongRoPE) tensors
    moe: bool = False                 # the FFN is a mixture of experts (softmax gating, top-k normalised)


FAMILIES: dict[str, Family] = {f.arch: f for f in (
    Family("llama", kq_scale_key=True, biases=True, rope_factors=True),
    Family("qwen2", rope="neox", biases=True),
    Family("qwen3", rope="neox", qk_norm="head"),
    Family("qwen3moe", rope="neox", qk_norm="head", moe=True),
    Family("phi3", rope="neox", n_rot_is_head=False, fused=True, q_scale="head", rope_factors=True,
           swa_disabled=True),
    Family("gemma2", rope="neox", n_rot_is_head=False, post_norm=True, act="gelu_table", embd_scale="sqrt_n_embd",
           q_scale="attn_scale", attn_softcap=True, final_softcap="always", swa=(2, 4096)),
    Family("gemma3", rope="neox", n_rot_is_head=False, qk_norm="head", post_norm=True, act="gelu_table",
           embd_scale="sqrt_n_embd", q_scale="attn_scale", final_softcap="no_swa", swa=(6, 0)),
    Family("smollm3", kq_scale_key=True, nope_step=4),
    Family("granite", kq_scale_key=True, embd_scale="key", residual_scale=True, logit_scale=True,
           rope_factors=True),
    Family("granitemoe", kq_scale_key=True, embd_scale="key", residual_scale=True, logit_scale=True,
           rope_factors=True, moe=True),
    Family("olmo2", rope="neox", qk_norm="full", pre_norm=False, post_norm=True, swa=(4, 0), swa_needs_key=True,
           swa_plain_rope=True),
)}

_SCALING = ("none", "linear", "yarn", "longrope")


def _yarn(k: _Keys, scaling: str, freq_scale: float) -> dict[str, Any]:
    """llama_context's YaRN parameters: ext_factor 1 for YaRN scaling (else 0), and the attention factor
    (llamax.rope.yarn_attn_factor for YaRN; {arch}.rope.scaling.attn_factor, 1 when absent, in any case)."""
    attn = k.number("rope.scaling.attn_factor", 1.0, positive=True)
    if scaling != "yarn":
        return dict(rope_ext_factor=0.0, rope_attn_factor=attn)
    return dict(rope_ext_factor=1.0, rope_attn_factor=yarn_attn_factor(freq_scale, rope_attn_factor=attn))


def read_hparams(g: GGUFFile) -> HParams:
    """llama_model::load_hparams for the supported architectures, with every value checked before it
    is used (no division by a zero head count, no head size that does not divide out): the transformer
    families' by read_dense, the recurrent ones' by llamax.model.gguf.read_ssm. The tensors are checked
    against these by check_tensors.

    Raises:
        ModelError: unknown architecture, a missing required key, or a value failing a check.
    """
    arch = g.arch
    if arch not in ARCHS:
        raise ModelError(f"{g.path.name}: architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    k = _Keys(g, arch)
    return read_ssm(g, k) if arch in RECURRENT_ARCHS else read_dense(g, k)


def read_dense(g: GGUFFile, k: _Keys) -> HParams:
    """llama_model::load_hparams and FAMILIES[arch]'s load_arch_hparams, every value checked before use.

    Checks (each a ModelError naming the key and the values): block_count, embedding_length,
    head_count, head_count_kv, feed_forward_length, context_length, key/value_length positive
    integers; head_count, head_count_kv and feed_forward_length one value or one per layer, all
    equal; head_count_kv dividing head_count; embedding_length a multiple of head_count when the
    head size is not given; key_length == value_length; rope.dimension_count even and at most the
    head size (equal to it where llama.cpp's graph asserts so); no SWA-specific head size or RoPE
    dimensions; RoPE scaling none, linear, yarn or longrope; a vocabulary (n_vocab is its token count);
    a sliding-window pattern a period or one bool per layer; the experts' counts of a MoE."""
    arch, f = k.arch, g.path.name
    fam = FAMILIES[arch]
    n_layer = k.integer("block_count")
    n_embd = k.integer("embedding_length")
    n_head = k.per_layer("attention.head_count", n_layer)
    n_head_kv = k.per_layer("attention.head_count_kv", n_layer, n_head)
    if n_head % n_head_kv:
        raise ModelError(f"{f}: {k.key('attention.head_count_kv')} {n_head_kv} does not divide "
                         f"{k.key('attention.head_count')} {n_head} (each KV head serves a whole group of heads)")
    # a MoE's dense FFN length is unused (its experts have their own)
    n_ff = 0 if fam.moe and not k.has("feed_forward_length") else k.per_layer("feed_forward_length", n_layer)
    heads = {}
    for what in ("key_length", "value_length"):
        if k.has(f"attention.{what}"):
            heads[what] = k.integer(f"attention.{what}")
        elif n_embd % n_head:
            raise ModelError(f"{f}: {k.key('embedding_length')} {n_embd} is not a multiple of "
                             f"{k.key('attention.head_count')} {n_head} (the head size, as "
                             f"{k.key('attention.' + what)} is not given)")
        else:
            heads[what] = n_embd // n_head
    head_k, head_v = heads["key_length"], heads["value_length"]
    if head_v != head_k:
        raise ModelError(f"{f}: {k.key('attention.value_length')} {head_v} differs from "
                         f"{k.key('attention.key_length')} {head_k}; llamax's {arch} takes one head size")
    n_rot = k.integer("rope.dimension_count", head_k)
    if n_rot % 2 or n_rot > head_k or (fam.n_rot_is_head and n_rot != head_k):
        need = "equal to" if fam.n_rot_is_head else "even and at most"
        raise ModelError(f"{f}: {k.key('rope.dimension_count')} {n_rot} must be {need} the head size "
                         f"n_embd_head_k {head_k}")
    for swa_key, full in (("attention.key_length_swa", head_k), ("attention.value_length_swa", head_v),
                          ("rope.dimension_count_swa", n_rot)):
        if k.has(swa_key) and k.integer(swa_key) != full:
            raise ModelError(f"{f}: {k.key(swa_key)} {k.integer(swa_key)} differs from the full layers' {full}; "
                             f"llamax does not support another head size for sliding-window layers")
    scaling = g.get(k.key("rope.scaling.type"), "linear")
    if scaling not in _SCALING:
        raise ModelError(f"{f}: {k.key('rope.scaling.type')} {_brief_value(scaling)} is not supported "
                         f"({', '.join(_SCALING)})")
    freq_scale = 1.0 / (k.number("rope.scaling.factor", 1.0) or 1.0)   # 0: none, as llama.cpp
    if scaling == "none":
        freq_scale = 1.0
    n_ctx_train = k.integer("context_length")
    hp: dict[str, Any] = dict(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=head_k,
        n_embd_head_v=head_v, n_ff=n_ff, n_ctx_train=n_ctx_train, n_vocab=_n_vocab(g),
        rms_eps=k.number("attention.layer_norm_rms_epsilon"), n_rot=n_rot, rope_kind=fam.rope,
        rope_freq_base=k.number("rope.freq_base", 10000.0, positive=True), rope_freq_scale=freq_scale,
        tied_output="output.weight" not in g.tensors, **_yarn(k, scaling, freq_scale))
    n_ctx_orig = k.integer("rope.scaling.original_context_length", n_ctx_train)
    if n_ctx_orig != n_ctx_train:   # else the default 0 (kept out of the fingerprint)
        hp["n_ctx_orig"] = n_ctx_orig
    if fam.kq_scale_key:
        hp["kq_scale"] = k.number("attention.scale", 0.0)
    if fam.embd_scale == "key":
        hp["embd_scale"] = k.number("embedding_scale", 0.0)
    if fam.residual_scale:
        hp["residual_scale"] = k.number("residual_scale", 0.0)
    if fam.logit_scale:
        hp["logit_scale"] = k.number("logit_scale", positive=True)
    if fam.q_scale == "attn_scale":
        # Gemma: Q times 1/sqrt(n_embd_head_k), 1/sqrt(n_embd / n_head) for the 27B (Gemma 2: 46 layers,
        # Gemma 3: 62)
        big = n_layer == (46 if arch == "gemma2" else 62)
        hp["attn_scale"] = 1.0 / math.sqrt(n_embd // n_head if big else head_k)
    if fam.attn_softcap:
        hp["attn_logit_softcap"] = k.number("attn_logit_softcapping", 50.0, positive=True)
    if fam.nope_step:
        hp["nope_layers"] = tuple(il for il in range(n_layer) if (il + 1) % fam.nope_step == 0)
    if arch == "granite" and g.get(k.key("rope.scaling.finetuned"), True) is False:
        hp["nope_layers"] = tuple(range(n_layer))   # Granite's switch for RoPE
    if fam.moe:
        hp.update(_read_moe(k, n_layer, n_ff))
    elif k.integer("expert_count", 0, minimum=0) > 0:
        raise ModelError(f"{f}: {k.key('expert_count')} {k.integer('expert_count')}: a mixture of experts, which "
                         f"llamax's {arch} does not support (qwen3moe does)")
    hp.update(_read_swa(g, k, fam, n_layer, hp))
    if fam.final_softcap == "always" or (fam.final_softcap == "no_swa" and not hp.get("n_swa")):
        hp["final_logit_softcap"] = k.number("final_logit_softcapping",
                                             30.0 if fam.final_softcap == "always" else 0.0)
    return HParams(**hp)


def _read_moe(k: _Keys, n_layer: int, n_ff: int) -> dict[str, Any]:
    """expert_count, expert_used_count (at most the count) and each expert's FFN length: granitemoe's is
    feed_forward_length, qwen3moe's expert_feed_forward_length (n_ff / n_expert_used without it). Shared
    experts (expert_shared_feed_forward_length, Granite MoE Shared) are not supported."""
    n_expert = k.integer("expert_count")
    n_used = k.integer("expert_used_count")
    if n_used > n_expert:
        raise ModelError(f"{k.file}: {k.key('expert_used_count')} {n_used} exceeds {k.key('expert_count')} {n_expert}")
    if k.integer("expert_shared_feed_forward_length", 0, minimum=0) > 0:
        raise ModelError(f"{k.file}: {k.key('expert_shared_feed_forward_length')} is set: shared experts, which "
                         f"llamax does not support")
    if k.arch == "granitemoe":
        n_ff_exp = n_ff
    elif k.has("expert_feed_forward_length"):
        n_ff_exp = k.per_layer("expert_feed_forward_length", n_layer)
    else:
        n_ff_exp = n_ff // n_used
    if n_ff_exp < 1:
        raise ModelError(f"{k.file}: no expert FFN length ({k.key('expert_feed_forward_length')})")
    return dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp)


def _read_swa(g: GGUFFile, k: _Keys, fam: Family, n_layer: int, hp: dict) -> dict[str, Any]:
    """The sliding-window layers, window and their RoPE (llama.cpp's load_swa_pattern and the arch's keys)."""
    f = g.path.name
    if fam.swa is None:
        if not fam.swa_disabled and k.integer("attention.sliding_window", 0, minimum=0) > 0:
            raise ModelError(f"{f}: {k.key('attention.sliding_window')} is set, but llama.cpp's {fam.arch} "
                             f"has no sliding-window attention")
        return {}
    period, window = fam.swa
    n_swa = k.integer("attention.sliding_window", window, minimum=0)
    if n_swa == 0:
        return {}
    pattern = g.get(k.key("attention.sliding_window_pattern"), period)
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ModelError(f"{f}: {k.key('attention.sliding_window_pattern')} has {len(pattern)} values, "
                             f"expected one per layer (block_count {n_layer})")
        swa_layers = tuple(il for il, s in enumerate(pattern) if s)
    else:
        n = k.integer("attention.sliding_window_pattern", value=pattern, minimum=0)
        swa_layers = tuple(il for il in range(n_layer) if n == 0 or il % n < n - 1)
    if fam.arch == "gemma3":   # sliding layers: base 10000, no scaling (llama.cpp's gemma3)
        base, scale = 10000.0, 1.0
    else:
        base = k.number("rope.freq_base_swa", hp["rope_freq_base"], positive=True)
        scale = 1.0 if fam.swa_plain_rope else hp["rope_freq_scale"]
    return dict(n_swa=n_swa, swa_type="standard", swa_layers=swa_layers, rope_freq_base_swa=base,
                rope_freq_scale_swa=scale)


# ---- tensors -------------------------------------------------------------------------------------------
def tensor_table(fam: Family, hp: HParams, g: GGUFFile) -> TensorTable:
    """The tensors FAMILIES[arch]'s load_arch_tensors creates, for check_tensors; where llama.cpp takes one
    of two layouts (fused or separate QKV) or optional biases / RoPE factors, the file's choice (layer 0's
    tensors) decides and every layer must follow it."""
    model: dict[str, tuple[str, ...]] = {"token_embd.weight": ("n_embd", "n_vocab"), "output_norm.weight": ("n_embd",)}
    optional: dict[str, tuple[str, ...]] = {"output.weight": ("n_embd", "n_vocab")}
    layer: dict[str, tuple[str, ...]] = {}
    has = g.tensors.__contains__
    if fam.pre_norm:
        layer["attn_norm.weight"] = ("n_embd",)
        layer["ffn_norm.weight"] = ("n_embd",)
    if fam.fused and has("blk.0.attn_qkv.weight"):
        layer["attn_qkv.weight"] = ("n_embd", "n_embd_qkv")
    else:
        layer |= {"attn_q.weight": ("n_embd", "n_embd_q"), "attn_k.weight": ("n_embd", "n_embd_k_gqa"),
                  "attn_v.weight": ("n_embd", "n_embd_v_gqa")}
        if fam.biases and has("blk.0.attn_q.bias"):
            layer |= {"attn_q.bias": ("n_embd_q",), "attn_k.bias": ("n_embd_k_gqa",),
                      "attn_v.bias": ("n_embd_v_gqa",)}
    layer["attn_output.weight"] = ("n_embd_q", "n_embd")
    if fam.qk_norm == "head":
        layer |= {"attn_q_norm.weight": ("n_embd_head_k",), "attn_k_norm.weight": ("n_embd_head_k",)}
    elif fam.qk_norm == "full":
        layer |= {"attn_q_norm.weight": ("n_embd_q",), "attn_k_norm.weight": ("n_embd_k_gqa",)}
    if fam.post_norm:
        layer |= {"post_attention_norm.weight": ("n_embd",), "post_ffw_norm.weight": ("n_embd",)}
    if fam.moe:
        layer |= {"ffn_gate_inp.weight": ("n_embd", "n_expert"),
                  "ffn_gate_exps.weight": ("n_embd", "n_ff_exp", "n_expert"),
                  "ffn_up_exps.weight": ("n_embd", "n_ff_exp", "n_expert"),
                  "ffn_down_exps.weight": ("n_ff_exp", "n_embd", "n_expert")}
    elif fam.fused and not has("blk.0.ffn_gate.weight"):
        layer |= {"ffn_up.weight": ("n_embd", "2*n_ff"), "ffn_down.weight": ("n_ff", "n_embd")}
    else:
        layer |= {"ffn_gate.weight": ("n_embd", "n_ff"), "ffn_up.weight": ("n_embd", "n_ff"),
                  "ffn_down.weight": ("n_ff", "n_embd")}
    if fam.rope_factors:
        for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            optional[name] = ("n_rot/2",)
    return TensorTable(model, layer, optional)
