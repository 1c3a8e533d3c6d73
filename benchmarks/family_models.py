"""Synthetic GGUF models at the real dimensions of each transformer and Mamba-2 family, for speed measurements.

`write(path, family, qtype, seed)` writes the model FAMILIES[family] — random weights, the shapes, keys and
tensor names of the real model it is named after — quantized as real GGUFs are: every 2D weight and every 3D
expert tensor (token_embd and output included) in Q8_0 or Q4_0 (gguf.quants.quantize, ggml's reference
quantization); norms, biases, RoPE factors and the MoE router (ffn_gate_inp) float32. In a Mamba-2 mixer
ssm_in and ssm_out are quantized, the rest float32 as llama.cpp's converter leaves it (ssm_conv1d weight and
bias, ssm_dt.bias, ssm_a, ssm_d, the grouped ssm_norm). The tokenizer is the SmolLM2 registry model's, padded
to the family's real n_vocab with unused tokens "[PAD<id>]" (token type 5, UNUSED, as llama.cpp's converter
pads a vocabulary), so the embedding and output matrices have their real size. Weights are normal with std
1/sqrt(fan_in) (token_embd std 1), norms near 1, biases small; in a Mamba-2 mixer A = -[1, 16) per head, D = 1
and dt's bias the inverse softplus of dt log-uniform in [1e-3, 1e-1], as Mamba-2 initialises them. A tensor's
values come from (seed, its name) alone.

The tensors are generated, quantized and written one at a time (a few row blocks at a time for the large
ones), so writing needs about one quantized tensor of memory, not the model's. A sidecar `<file>.json`
records what the file holds (the family's spec, qtype, seed, the vocabulary's sha256, this writer's version:
`spec_sha256`) and the file's sha256; `write` returns at once when both still match.

    python benchmarks/family_models.py qwen3 llama --qtype q4_0      # writes into DEFAULT_DIR, prints sizes

Families (the model whose dimensions they take; "of N" = fewer layers than the real model's N):

    qwen3      Qwen3-0.6B          per-head Q/K norms, head 128, tied
    qwen2      Qwen2.5-0.5B        Q/K/V biases, tied
    llama      Llama-3.2-1B        rope_freqs (Llama 3.1 scaling, factor 32), tied
    olmo2      OLMo-2-0425-1B      no pre-norms, post norms, full-width Q/K norms, untied
    granite    Granite-3.1-2B      12 of 40 layers; embedding/residual/attention/logit scales, tied
    smollm3    SmolLM3-3B          12 of 36 layers; NoPE every 4th layer, tied
    gemma2     gemma-2-2b          8 of 26 layers; post norms, softcaps, SWA 4096 on every other layer
    gemma3     gemma-3-1b          post norms, per-head Q/K norms, SWA 512 on 5 of 6 layers
    phi3       Phi-4-mini          8 of 32 layers; fused attn_qkv and ffn_up, LongRoPE, partial RoPE (96 of 128)
    qwen3moe   (a small Qwen3-MoE) 8 layers, 64 experts of n_ff 512, 8 used, untied
    mamba2     mamba2-370m         48 Mamba-2 layers of d_inner 2048 (32 heads of 64), d_state 128, 1 group,
                                   d_conv 4; no FFN, tied
    granitehybrid                  Granite-4.0-H-1B, 20 of 40 layers: Mamba-2 mixers of d_inner 3072 (48 heads
                                   of 64), d_state 128, 1 group, d_conv 4; attention (12 heads, 4 KV, head 128,
                                   no RoPE) in layers 9 and 19 (the real 9:1 pattern); a dense SwiGLU FFN of
                                   4096 after every mixer; Granite's scales (illustrative values), tied
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from llamax import models
from llamax.model.gguf_reader import GGUFReader
from llamax.rope import llama3_freq_factors

#: where the models go (outside the repository)
DEFAULT_DIR = Path.home() / ".cache" / "llamax-dev" / "family-models"
#: the registry model whose tokenizer every family takes
VOCAB_MODEL = "smollm2-135m"
#: bump when the bytes written for the same spec change (the sidecars of older files then no longer match)
WRITER_VERSION = 1
QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
_CHUNK = 1 << 24      # elements generated and quantized at a time


@dataclass(frozen=True)
class Family:
    """One family's architecture and dimensions (the GGUF keys llama.cpp's load_arch_hparams reads)."""

    source: str                      # the model whose dimensions these are
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    rms_eps: float
    head_dim: int = 0                # 0: n_embd / n_head (attention.key_length not written)
    n_rot: int = 0                   # 0: the head size (rope.dimension_count not written)
    tied: bool = True                # no output.weight: the output is token_embd
    qkv_bias: bool = False
    qk_norm: str = ""                # "head": per-head RMS norms of Q and K; "full": over the whole projection
    pre_norms: bool = True           # attn_norm / ffn_norm before the blocks
    post_norms: bool = False         # post_attention_norm / post_ffw_norm after them
    fused: bool = False              # phi3: attn_qkv = [q; k; v], ffn_up = [gate; up]
    rope_freqs: tuple = ()           # Llama 3.1 scaling: (factor, low_freq_factor, high_freq_factor, original ctx)
    longrope: int = 0                # LongRoPE: the original context (rope_factors_long / _short)
    swa: tuple = ()                  # (window, attention.sliding_window_pattern or 0: the arch's default)
    softcaps: tuple = ()             # (attention logit softcap, final logit softcap)
    granite: tuple = ()              # (embedding, residual, attention, logit) scales
    moe: tuple = ()                  # (n_expert, n_expert_used, n_ff_exp)
    ssm: tuple = ()                  # Mamba-2 mixers: (d_inner, d_state, n_ssm_head, n_group, d_conv)
    attn_layers: tuple = ()          # with ssm: the attention layers (the others Mamba-2; none: all Mamba-2)

    @property
    def head(self) -> int:
        return self.head_dim or (self.n_embd // self.n_head if self.n_head else 0)

    @property
    def is_recurrent(self) -> bool:
        return bool(self.ssm)

    def is_attn(self, il: int) -> bool:
        """Layer il has attention (else a Mamba-2 mixer, in a model with ssm)."""
        return not self.ssm or il in self.attn_layers


#: fields added for the recurrent families: left out of a spec at their default, so the files of the
#: transformer families written before them stay current
_RECURRENT_FIELDS = ("ssm", "attn_layers")


FAMILIES: dict[str, Family] = {
    "qwen3": Family("Qwen3-0.6B", "qwen3", n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, head_dim=128,
                    n_ff=3072, n_vocab=151936, n_ctx_train=40960, rope_base=1e6, rms_eps=1e-6, qk_norm="head"),
    "qwen2": Family("Qwen2.5-0.5B", "qwen2", n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864,
                    n_vocab=151936, n_ctx_train=32768, rope_base=1e6, rms_eps=1e-6, qkv_bias=True),
    "llama": Family("Llama-3.2-1B", "llama", n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                    n_vocab=128256, n_ctx_train=131072, rope_base=500000.0, rms_eps=1e-5,
                    rope_freqs=(32.0, 1.0, 4.0, 8192)),
    "olmo2": Family("OLMo-2-0425-1B", "olmo2", n_embd=2048, n_layer=16, n_head=16, n_head_kv=16, n_ff=8192,
                    n_vocab=100352, n_ctx_train=4096, rope_base=500000.0, rms_eps=1e-6, tied=False,
                    qk_norm="full", pre_norms=False, post_norms=True),
    "granite": Family("Granite-3.1-2B (12 of 40 layers)", "granite", n_embd=2048, n_layer=12, n_head=32,
                      n_head_kv=8, n_ff=8192, n_vocab=49155, n_ctx_train=131072, rope_base=5e6, rms_eps=1e-5,
                      granite=(12.0, 0.22, 0.015625, 8.0)),
    "smollm3": Family("SmolLM3-3B (12 of 36 layers)", "smollm3", n_embd=2048, n_layer=12, n_head=16, n_head_kv=4,
                      n_ff=11008, n_vocab=128256, n_ctx_train=65536, rope_base=5e6, rms_eps=1e-6),
    "gemma2": Family("gemma-2-2b (8 of 26 layers)", "gemma2", n_embd=2304, n_layer=8, n_head=8, n_head_kv=4,
                     head_dim=256, n_ff=9216, n_vocab=256000, n_ctx_train=8192, rope_base=10000.0, rms_eps=1e-6,
                     post_norms=True, swa=(4096, 0), softcaps=(50.0, 30.0)),
    "gemma3": Family("gemma-3-1b", "gemma3", n_embd=1152, n_layer=26, n_head=4, n_head_kv=1, head_dim=256,
                     n_ff=6912, n_vocab=262144, n_ctx_train=32768, rope_base=1e6, rms_eps=1e-6, qk_norm="head",
                     post_norms=True, swa=(512, 6)),
    "phi3": Family("Phi-4-mini (8 of 32 layers)", "phi3", n_embd=3072, n_layer=8, n_head=24, n_head_kv=8,
                   n_ff=8192, n_vocab=200064, n_ctx_train=131072, rope_base=10000.0, rms_eps=1e-5, n_rot=96,
                   fused=True, longrope=4096),
    "qwen3moe": Family("a small Qwen3-MoE", "qwen3moe", n_embd=1024, n_layer=8, n_head=16, n_head_kv=4,
                       head_dim=128, n_ff=3072, n_vocab=151936, n_ctx_train=40960, rope_base=1e6, rms_eps=1e-6,
                       tied=False, qk_norm="head", moe=(64, 8, 512)),
    # as llama.cpp's converter writes Mamba-2: context 2**20, feed_forward_length and head_count 0, no KV heads
    "mamba2": Family("mamba2-370m", "mamba2", n_embd=1024, n_layer=48, n_head=0, n_head_kv=0, n_ff=0,
                     n_vocab=50288, n_ctx_train=2 ** 20, rope_base=0.0, rms_eps=1e-5, ssm=(2048, 128, 32, 1, 4)),
    # Granite 4.0's converter writes no RoPE (rope.scaling.finetuned false) and context 2**20 for a hybrid
    "granitehybrid": Family("Granite-4.0-H-1B (20 of 40 layers)", "granitehybrid", n_embd=1536, n_layer=20,
                            n_head=12, n_head_kv=4, n_ff=4096, n_vocab=100352, n_ctx_train=2 ** 20,
                            rope_base=10000.0, rms_eps=1e-5, granite=(12.0, 0.22, 0.0078125, 6.0),
                            ssm=(3072, 128, 48, 1, 4), attn_layers=(9, 19)),
}


# ---- the tensors ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """One tensor to write: its numpy shape and how its values are made."""

    name: str
    shape: tuple[int, ...]
    kind: str                 # "weight" (normal * scale, quantized), "dense" (normal * scale, float32), "norm",
                              # "bias", "router", "ssm_a", "ssm_dt_bias", "values"
    scale: float = 1.0
    values: np.ndarray | None = None     # kind "values": the data itself (RoPE factors)

    @property
    def quantized(self) -> bool:
        return self.kind == "weight"


def _w(name: str, shape: tuple[int, ...], scale: float | None = None) -> _Tensor:
    """A weight of std 1/sqrt(fan_in) (fan_in the last numpy dimension) unless scale is given."""
    return _Tensor(name, shape, "weight", shape[-1] ** -0.5 if scale is None else scale)


def _tensors(f: Family) -> list[_Tensor]:
    """Every tensor of the model, in the order they are written (token_embd, output norm and head, then
    the blocks, then RoPE factors)."""
    E, hd = f.n_embd, f.head
    nq, nkv = f.n_head * hd, f.n_head_kv * hd
    t = [_w("token_embd.weight", (f.n_vocab, E), 1.0), _Tensor("output_norm.weight", (E,), "norm")]
    if not f.tied:
        t.append(_w("output.weight", (f.n_vocab, E)))
    for il in range(f.n_layer):
        p = f"blk.{il}."
        if f.is_recurrent:
            t.append(_Tensor(p + "attn_norm.weight", (E,), "norm"))
            if not f.is_attn(il):
                t += _mamba2_tensors(f, p)
            else:
                t += [_w(p + "attn_q.weight", (nq, E)), _w(p + "attn_k.weight", (nkv, E)),
                      _w(p + "attn_v.weight", (nkv, E)), _w(p + "attn_output.weight", (E, nq))]
            if f.n_ff:
                t += [_Tensor(p + "ffn_norm.weight", (E,), "norm"), _w(p + "ffn_gate.weight", (f.n_ff, E)),
                      _w(p + "ffn_up.weight", (f.n_ff, E)), _w(p + "ffn_down.weight", (E, f.n_ff))]
            continue
        if f.pre_norms:
            t.append(_Tensor(p + "attn_norm.weight", (E,), "norm"))
        if f.fused:
            t.append(_w(p + "attn_qkv.weight", (nq + 2 * nkv, E)))
        else:
            t += [_w(p + "attn_q.weight", (nq, E)), _w(p + "attn_k.weight", (nkv, E)),
                  _w(p + "attn_v.weight", (nkv, E))]
        if f.qkv_bias:
            t += [_Tensor(p + "attn_q.bias", (nq,), "bias"), _Tensor(p + "attn_k.bias", (nkv,), "bias"),
                  _Tensor(p + "attn_v.bias", (nkv,), "bias")]
        if f.qk_norm == "head":
            t += [_Tensor(p + "attn_q_norm.weight", (hd,), "norm"), _Tensor(p + "attn_k_norm.weight", (hd,), "norm")]
        elif f.qk_norm == "full":
            t += [_Tensor(p + "attn_q_norm.weight", (nq,), "norm"), _Tensor(p + "attn_k_norm.weight", (nkv,), "norm")]
        t.append(_w(p + "attn_output.weight", (E, nq)))
        if f.post_norms:
            t.append(_Tensor(p + "post_attention_norm.weight", (E,), "norm"))
        if f.pre_norms:
            t.append(_Tensor(p + "ffn_norm.weight", (E,), "norm"))
        if f.moe:
            n_exp, _, n_ff_exp = f.moe
            t += [_Tensor(p + "ffn_gate_inp.weight", (n_exp, E), "router", E ** -0.5),
                  _w(p + "ffn_gate_exps.weight", (n_exp, n_ff_exp, E)),
                  _w(p + "ffn_up_exps.weight", (n_exp, n_ff_exp, E)),
                  _w(p + "ffn_down_exps.weight", (n_exp, E, n_ff_exp))]
        elif f.fused:
            t.append(_w(p + "ffn_up.weight", (2 * f.n_ff, E)))        # [gate; up]
        else:
            t += [_w(p + "ffn_gate.weight", (f.n_ff, E)), _w(p + "ffn_up.weight", (f.n_ff, E))]
        if not f.moe:
            t.append(_w(p + "ffn_down.weight", (E, f.n_ff)))
        if f.post_norms:
            t.append(_Tensor(p + "post_ffw_norm.weight", (E,), "norm"))
    n_pairs = (f.n_rot or hd) // 2
    if f.rope_freqs:
        t.append(_Tensor("rope_freqs.weight", (n_pairs,), "values", values=np.array(llama3_freq_factors(
            f.n_rot or f.head, f.rope_base, *f.rope_freqs), np.float32)))
    if f.longrope:   # factors of the shape Phi-3.5 / Phi-4-mini ship: long ones growing, short ones near 1
        t.append(_Tensor("rope_factors_long.weight", (n_pairs,), "values",
                         values=np.geomspace(1.0, 40.0, n_pairs).astype(np.float32)))
        t.append(_Tensor("rope_factors_short.weight", (n_pairs,), "values",
                         values=np.linspace(1.0, 1.5, n_pairs, dtype=np.float32)))
    return t


def _mamba2_tensors(f: Family, p: str) -> list[_Tensor]:
    """One Mamba-2 mixer's tensors (numpy shapes, ggml's reversed), as llama.cpp's converter writes them: the
    in-projection [z; x, B, C; dt] and ssm_out quantized, the rest float32."""
    E = f.n_embd
    d_inner, d_state, n_head, n_group, d_conv = f.ssm
    conv_dim = d_inner + 2 * n_group * d_state
    return [_w(p + "ssm_in.weight", (d_inner + conv_dim + n_head, E)),
            _Tensor(p + "ssm_conv1d.weight", (conv_dim, d_conv), "dense", d_conv ** -0.5),
            _Tensor(p + "ssm_conv1d.bias", (conv_dim,), "bias"),
            _Tensor(p + "ssm_dt.bias", (n_head,), "ssm_dt_bias"),
            _Tensor(p + "ssm_a", (n_head, 1), "ssm_a"),
            _Tensor(p + "ssm_d", (n_head, 1), "values", values=np.ones((n_head, 1), np.float32)),
            _Tensor(p + "ssm_norm.weight", (n_group, d_inner // n_group), "norm"),
            _w(p + "ssm_out.weight", (E, d_inner))]


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _data(t: _Tensor, seed: int, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The tensor's bytes as written: quantized rows (uint8) for a weight, float32 otherwise."""
    rng = _rng(seed, t.name)
    if t.kind == "values":
        return t.values
    if t.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)
    if t.kind == "bias":
        return (0.1 * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)
    if t.kind in ("router", "dense"):
        return (t.scale * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)
    if t.kind == "ssm_a":          # -exp(A_log), A in [1, 16) as Mamba-2 initialises it
        return -rng.uniform(1.0, 16.0, t.shape).astype(np.float32)
    if t.kind == "ssm_dt_bias":    # softplus(bias) = dt, dt log-uniform in [1e-3, 1e-1]
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), t.shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    n_cols = t.shape[-1]
    n_rows = int(np.prod(t.shape[:-1]))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((n_rows, n_cols // block * size), np.uint8)
    step = max(1, _CHUNK // n_cols)
    for r0 in range(0, n_rows, step):
        x = rng.standard_normal((min(step, n_rows - r0), n_cols), dtype=np.float32)
        x *= np.float32(t.scale)
        out[r0:r0 + len(x)] = gguf.quants.quantize(x, qtype)
    return out.reshape(*t.shape[:-1], -1)


def _nbytes(t: _Tensor, qtype: gguf.GGMLQuantizationType) -> int:
    n = int(np.prod(t.shape))
    if not t.quantized:
        return 4 * n
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return n // block * size


# ---- the tokenizer -----------------------------------------------------------------------------------
def _tokenizer(vocab_gguf: Path, n_vocab: int) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """vocab_gguf's tokenizer.ggml.* keys and chat template as [(key, value, type, element type)], the token
    list and types padded to n_vocab with "[PAD<id>]" tokens of type UNUSED (5).

    Raises:
        ValueError: n_vocab is smaller than the vocabulary.
    """
    r = GGUFReader(vocab_gguf)
    out = []
    for key, value in r.fields.items():
        if not (key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template"):
            continue
        vtype, sub = (gguf.GGUFValueType(int(v)) if v is not None else None for v in r.field_type(key))
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            n = len(value)
            if n > n_vocab:
                raise ValueError(f"n_vocab {n_vocab} is smaller than {vocab_gguf.name}'s {n} tokens")
            pad = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n, n_vocab)],
                   "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (n_vocab - n),
                   "tokenizer.ggml.scores": [0.0] * (n_vocab - n)}[key]
            value = list(value) + pad
        out.append((key, value, vtype, sub))
    return out


# ---- the file ----------------------------------------------------------------------------------------
def spec(family: str, qtype: str = "q8_0", seed: int = 0) -> dict:
    """What a written file holds, as recorded in its sidecar (without the file's own hash).

    Raises:
        ValueError: an unknown family or qtype.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r} (known: {', '.join(QTYPES)})")
    return {"writer_version": WRITER_VERSION, "family": family, "qtype": qtype, "seed": seed,
            "vocab": {"model": VOCAB_MODEL, "sha256": models.spec(VOCAB_MODEL).sha256},
            "hparams": {k: v for k, v in dataclasses.asdict(FAMILIES[family]).items()
                        if not (k in _RECURRENT_FIELDS and not v)}}


def _spec_sha256(s: dict) -> str:
    return hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + ".json")


def default_path(family: str, qtype: str = "q8_0", seed: int = 0) -> Path:
    """DEFAULT_DIR/<family>-<qtype>[-s<seed>].gguf"""
    return DEFAULT_DIR / f"{family}-{qtype}{f'-s{seed}' if seed else ''}.gguf"


def is_current(path: str | os.PathLike, family: str, qtype: str = "q8_0", seed: int = 0) -> bool:
    """The file at path exists and its sidecar records this spec and the file's current sha256."""
    path = Path(path)
    try:
        side = json.loads(sidecar_path(path).read_text())
    except (OSError, ValueError):
        return False
    return (path.is_file() and side.get("spec_sha256") == _spec_sha256(spec(family, qtype, seed))
            and side.get("size") == path.stat().st_size and side.get("file_sha256") == _file_sha256(path))


def _write_gguf(path: Path, f: Family, tensors: list[_Tensor], tokenizer: list, qtype: gguf.GGMLQuantizationType,
                seed: int) -> None:
    w = gguf.GGUFWriter(path, f.arch)
    w.add_name(f"llamax synthetic {f.source}")   # not the arch alone: llama.cpp gives a "phi3" name special tokens
    w.add_file_type({gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                     gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(f.n_ctx_train)
    w.add_embedding_length(f.n_embd)
    w.add_block_count(f.n_layer)
    w.add_feed_forward_length(f.n_ff)
    w.add_head_count(f.n_head)
    if f.is_recurrent:   # Mamba-2's keys; a layer with no KV heads is a Mamba-2 layer
        d_inner, d_state, n_head, n_group, d_conv = f.ssm
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(n_head)
        w.add_ssm_group_count(n_group)
        if f.attn_layers:
            w.add_head_count_kv([f.n_head_kv if f.is_attn(il) else 0 for il in range(f.n_layer)])
            w.add_rope_scaling_finetuned(False)
    else:
        w.add_head_count_kv(f.n_head_kv)
    w.add_layer_norm_rms_eps(f.rms_eps)
    if f.rope_base:
        w.add_rope_freq_base(f.rope_base)
    if f.head_dim:
        w.add_key_length(f.head_dim)
        w.add_value_length(f.head_dim)
    if f.n_rot:
        w.add_rope_dimension_count(f.n_rot)
    if f.moe:
        n_exp, n_used, n_ff_exp = f.moe
        w.add_expert_count(n_exp)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(n_ff_exp)
    if f.longrope:
        w.add_rope_scaling_orig_ctx_len(f.longrope)
        scale = f.n_ctx_train / f.longrope
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(f.longrope)))
    if f.swa:
        window, pattern = f.swa
        w.add_sliding_window(window)
        if f.arch == "gemma3":   # Gemma 3's converter writes no pattern: llama.cpp's default is 6
            assert pattern == 6
    if f.softcaps:
        w.add_attn_logit_softcapping(f.softcaps[0])
        w.add_final_logit_softcapping(f.softcaps[1])
    if f.granite:
        emb, res, att, logit = f.granite
        w.add_embedding_scale(emb)
        w.add_residual_scale(res)
        w.add_attention_scale(att)
        w.add_logit_scale(logit)
    for key, value, vtype, sub in tokenizer:
        w.add_key_value(key, value, vtype, sub)
    for t in tensors:
        if t.quantized:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), _nbytes(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(t, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(_data(t, seed, qtype))
    w.close()


def write(path: str | os.PathLike, family: str, qtype: str = "q8_0", seed: int = 0) -> Path:
    """Write the model FAMILIES[family] with weights in qtype to path (and its sidecar path + ".json"),
    unless the file there already holds it (is_current). The same (family, qtype, seed) gives the same bytes.
    Written to a temporary file beside path first, then renamed: an interrupted write leaves no model.

    Args:
        path: the .gguf file to write (its directory is created).
        family: a key of FAMILIES.
        qtype: "q8_0" or "q4_0": the type of every 2D weight and 3D expert tensor.
        seed: the random weights' seed.

    Returns:
        path.

    Raises:
        ValueError: an unknown family or qtype, or a negative seed (nothing is written).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    s = spec(family, qtype, seed)
    path = Path(path)
    if is_current(path, family, qtype, seed):
        return path
    f = FAMILIES[family]
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = _tokenizer(models.pull(VOCAB_MODEL, progress=False), f.n_vocab)
    tmp = path.with_name(path.name + ".part")
    try:
        _write_gguf(tmp, f, _tensors(f), tokenizer, QTYPES[qtype], seed)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    side = {"spec": s, "spec_sha256": _spec_sha256(s), "size": path.stat().st_size,
            "file_sha256": _file_sha256(path), "write_seconds": round(time.perf_counter() - t0, 1)}
    sidecar_path(path).write_text(json.dumps(side, indent=1) + "\n")
    return path


def n_params(family: str) -> int:
    """The model's parameter count (token_embd counted once when the output is tied)."""
    return sum(int(np.prod(t.shape)) for t in _tensors(FAMILIES[family]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="+", choices=sorted(FAMILIES), metavar="FAMILY",
                   help=f"one of: {', '.join(FAMILIES)}")
    p.add_argument("--qtype", choices=sorted(QTYPES), default="q8_0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where the files go (default {DEFAULT_DIR})")
    a = p.parse_args(argv)
    for fam in a.families:
        path = a.dir / default_path(fam, a.qtype, a.seed).name
        t0 = time.perf_counter()
        write(path, fam, a.qtype, a.seed)
        dt = time.perf_counter() - t0
        print(f"{fam:9s} {a.qtype}  {n_params(fam) / 1e6:8.1f} M params  {path.stat().st_size / 2**20:8.1f} MiB  "
              f"{dt:6.1f} s  {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
