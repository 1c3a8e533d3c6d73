"""Tiny synthetic GGUF models of llama.cpp's recurrent architectures, for the tests.

`write_mamba` (Mamba-1, arch "mamba"), `write_jamba` (arch "jamba": Mamba and attention layers, each with
a dense SwiGLU FFN), `write_mamba2` (Mamba-2, arch "mamba2") and `write_granitehybrid` (Mamba-2 and attention
layers with Granite's scales; `write_granitehybrid_moe` with experts and a shared expert) and `write_nemotron_h` (Mamba-2, attention and
FFN layers) write a model from a seed with gguf's GGUFWriter, the same tensors for the same seed;
the tokenizer is copied from a real GGUF. Keys, tensor names and shapes are the ones llama.cpp's loader
reads (src/models/mamba.cpp, jamba.cpp, mamba2.cpp, granite-hybrid.cpp, nemotron-h.cpp at llama.cpp 0c1e57098). llama.cpp's outputs on the seed-0 models
are in tests/data/recurrent/ (made by its record.py). `content_hash` names a model's weights and
hyperparameters independently of the file layout. `write_truncated` copies a real GGUF with only its first
blocks (a smaller model of the same vocabulary, e.g. a draft model for speculative decoding).
"""
import hashlib
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

N_EMBD = 64
N_LAYER = 4
D_CONV = 4
D_INNER = 2 * N_EMBD  # llama.cpp supports only an expansion factor of 2
D_STATE = 16
DT_RANK = 4
RMS_EPS = 1e-5
N_CTX_TRAIN = 2048

JAMBA_ATTN_LAYERS = (1, 3)
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128

# Gains over 1/sqrt(fan_in) that keep the seed-0 models far from degenerate: the blocks' outputs outweigh the
# (tied) token embedding in the residual stream, else the logits mostly pick the input token and greedy text
# repeats one token; larger B and C make Mamba-1's state carry the context (Jamba normalises them).
_RESIDUAL_GAIN = 8.0
_BC_GAIN = 3.0


_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}


def _read_gguf(path: str | os.PathLike) -> tuple[dict, list[tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], bytes]]]:
    """A GGUF file's metadata {key: (type, array element type or None, value)} and tensors
    [(name, type, ggml shape, data bytes)], read directly: gguf.GGUFReader takes seconds per
    vocabulary of 50k tokens."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        off = 0

        def scalar(fmt: str):
            nonlocal off
            (v,) = struct.unpack_from("<" + fmt, buf, off)
            off += struct.calcsize("<" + fmt)
            return v

        def string() -> str:
            nonlocal off
            n = scalar("Q")
            off += n
            return buf[off - n:off].decode()

        def array(sub: gguf.GGUFValueType, n: int) -> list:
            nonlocal off
            if sub == gguf.GGUFValueType.STRING:
                return [string() for _ in range(n)]
            dtype = np.dtype("<" + _SCALAR_FORMATS[sub])
            off += n * dtype.itemsize
            return np.frombuffer(buf, dtype, n, off - n * dtype.itemsize).tolist()

        magic, version, n_tensors, n_kv = (scalar(c) for c in "IIQQ")
        assert magic == gguf.GGUF_MAGIC and version == 3, path
        meta: dict[str, tuple[gguf.GGUFValueType, gguf.GGUFValueType | None, Any]] = {}
        for _ in range(n_kv):
            key, vtype, sub = string(), gguf.GGUFValueType(scalar("I")), None
            value: Any
            if vtype == gguf.GGUFValueType.ARRAY:
                sub = gguf.GGUFValueType(scalar("I"))
                value = array(sub, scalar("Q"))
            elif vtype == gguf.GGUFValueType.STRING:
                value = string()
            else:
                value = scalar(_SCALAR_FORMATS[vtype])
            meta[key] = (vtype, sub, value)
        infos = []
        for _ in range(n_tensors):
            name = string()
            shape = tuple(scalar("Q") for _ in range(scalar("I")))
            infos.append((name, gguf.GGMLQuantizationType(scalar("I")), shape, scalar("Q")))
        align = meta.get("general.alignment", (None, None, gguf.GGUF_DEFAULT_ALIGNMENT))[2]
        start = -(-off // align) * align
        tensors = []
        for name, ttype, shape, rel in infos:
            block, size = gguf.GGML_QUANT_SIZES[ttype]
            nbytes = int(np.prod(shape)) // block * size
            tensors.append((name, ttype, shape, buf[start + rel:start + rel + nbytes]))
    return meta, tensors


def _tokenizer(vocab_gguf: str | os.PathLike) -> dict:
    """vocab_gguf's tokenizer.ggml.* keys and tokenizer.chat_template, as _read_gguf gives them."""
    meta, _ = _read_gguf(vocab_gguf)
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.") or k == "tokenizer.chat_template"}


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float | np.ndarray) -> np.ndarray:
    """float32 normal samples times scale (a number or an array broadcasting to shape)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    """An RMS-norm weight near 1."""
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _mamba_block(rng: np.random.Generator, il: int, bcdt_norms: bool) -> dict[str, np.ndarray]:
    """One Mamba-1 mixer's tensors (numpy shapes, i.e. ggml's reversed), initialised as Mamba does:
    A = -[1..d_state] per channel (the converter stores -exp(A_log)), D = 1, dt's bias the inverse
    softplus of dt in [1e-3, 1e-1] (log-uniform). bcdt_norms adds Jamba's RMS norms of dt, B and C."""
    p = f"blk.{il}."
    x_scale = np.repeat([1.0, _BC_GAIN], [DT_RANK, 2 * D_STATE])[:, None] * D_INNER ** -0.5  # dt, B, C rows
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), D_INNER))
    t = {
        p + "ssm_in.weight": _normal(rng, (2 * D_INNER, N_EMBD), N_EMBD ** -0.5),
        p + "ssm_conv1d.weight": _normal(rng, (D_INNER, D_CONV), D_CONV ** -0.5),
        p + "ssm_conv1d.bias": _normal(rng, (D_INNER,), 0.1),
        p + "ssm_x.weight": _normal(rng, (DT_RANK + 2 * D_STATE, D_INNER), x_scale),
        p + "ssm_dt.weight": _normal(rng, (D_INNER, DT_RANK), DT_RANK ** -0.5),
        p + "ssm_dt.bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),
        p + "ssm_a": -np.tile(np.arange(1, D_STATE + 1, dtype=np.float32), (D_INNER, 1)),
        p + "ssm_d": np.ones(D_INNER, np.float32),
        p + "ssm_out.weight": _normal(rng, (N_EMBD, D_INNER), _RESIDUAL_GAIN * D_INNER ** -0.5),
    }
    if bcdt_norms:
        t[p + "ssm_dt_norm.weight"] = _norm(rng, DT_RANK)
        t[p + "ssm_b_norm.weight"] = _norm(rng, D_STATE)
        t[p + "ssm_c_norm.weight"] = _norm(rng, D_STATE)
    return t


def _attn_block(rng: np.random.Generator, il: int) -> dict[str, np.ndarray]:
    """One attention layer's tensors (no biases, no RoPE in Jamba)."""
    p = f"blk.{il}."
    return {
        p + "attn_q.weight": _normal(rng, (N_HEAD * HEAD_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_k.weight": _normal(rng, (N_HEAD_KV * HEAD_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_v.weight": _normal(rng, (N_HEAD_KV * HEAD_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_output.weight": _normal(rng, (N_EMBD, N_HEAD * HEAD_DIM), _RESIDUAL_GAIN * N_EMBD ** -0.5),
    }


def _ffn_block(rng: np.random.Generator, il: int) -> dict[str, np.ndarray]:
    """One dense SwiGLU FFN with its norm."""
    p = f"blk.{il}."
    return {
        p + "ffn_norm.weight": _norm(rng, N_EMBD),
        p + "ffn_gate.weight": _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5),
        p + "ffn_up.weight": _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5),
        p + "ffn_down.weight": _normal(rng, (N_EMBD, N_FF), _RESIDUAL_GAIN * N_FF ** -0.5),
    }


def _write(path: str | os.PathLike, arch: str, tokenizer: dict, tensors: dict[str, np.ndarray],
           set_hparams: Callable[[gguf.GGUFWriter], None], overrides: dict | None = None) -> Path:
    """Write the GGUF: the shared hyperparameters, the rest by set_hparams(writer), the tokenizer
    (_tokenizer's keys), then the tensors (float32; token_embd as Q4_0, so the file stays under 5 MB; the
    output head tied to it)."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"llamax synthetic {arch}")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_ssm_conv_kernel(D_CONV)
    writer.add_ssm_inner_size(D_INNER)
    writer.add_ssm_state_size(D_STATE)
    writer.add_ssm_time_step_rank(DT_RANK)
    set_hparams(writer)
    for key, (value, vtype) in (overrides or {}).items():   # a bad value for a loader test (None: no key)
        if value is None:
            writer.kv_data[0].pop(key, None)
        else:
            writer.kv_data[0][key] = gguf.GGUFValue(value, vtype, None)
    return finish(writer, tokenizer, tensors, path)


def finish(writer: gguf.GGUFWriter, tokenizer: dict, tensors: dict[str, np.ndarray], path: Path) -> Path:
    """The tokenizer's keys (_tokenizer's) and the tensors (float32; token_embd as Q4_0, so a file stays small)
    into writer, then the file written and closed; path returned."""
    for key, (vtype, sub, value) in tokenizer.items():
        writer.add_key_value(key, value, vtype, sub)
    for name, data in tensors.items():
        if name == "token_embd.weight":
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _embeddings(rng: np.random.Generator, tokenizer: dict) -> dict[str, np.ndarray]:
    """The token embeddings (one row per token of the tokenizer) and the output norm."""
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][2])
    return {"token_embd.weight": _normal(rng, (n_vocab, N_EMBD), 1.0),
            "output_norm.weight": _norm(rng, N_EMBD)}


def write_mamba(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0,
                overrides: dict | None = None) -> Path:
    """A 4-layer Mamba-1 model (arch "mamba", n_embd 64, d_inner 128, d_state 16, dt_rank 4, d_conv 4)
    with vocab_gguf's tokenizer, written to path; the same seed gives the same tensors. overrides maps a
    metadata key to (value, gguf.GGUFValueType), or to (None, None) to leave the key out."""
    rng = np.random.default_rng(seed)
    tokenizer = _tokenizer(vocab_gguf)
    tensors = _embeddings(rng, tokenizer)
    for il in range(N_LAYER):
        tensors[f"blk.{il}.attn_norm.weight"] = _norm(rng, N_EMBD)
        tensors.update(_mamba_block(rng, il, bcdt_norms=False))

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_feed_forward_length(0)  # unused; written as llama.cpp's converter does
        w.add_head_count(0)
        w.add_ssm_dt_b_c_rms(False)

    return _write(path, "mamba", tokenizer, tensors, hparams, overrides)


def write_jamba(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0) -> Path:
    """A 4-layer Jamba model (arch "jamba"): Mamba-1 mixers (sizes as write_mamba's, with dt/B/C norms)
    in layers 0 and 2, attention (4 query and 2 KV heads of 16, no RoPE) in layers 1 and 3, a dense
    SwiGLU FFN of 128 after every mixer; vocab_gguf's tokenizer. The same seed gives the same tensors."""
    rng = np.random.default_rng(seed)
    tokenizer = _tokenizer(vocab_gguf)
    tensors = _embeddings(rng, tokenizer)
    for il in range(N_LAYER):
        tensors[f"blk.{il}.attn_norm.weight"] = _norm(rng, N_EMBD)
        if il in JAMBA_ATTN_LAYERS:
            tensors.update(_attn_block(rng, il))
        else:
            tensors.update(_mamba_block(rng, il, bcdt_norms=True))
        tensors.update(_ffn_block(rng, il))

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        # a layer with no KV heads is a Mamba layer
        w.add_head_count_kv([N_HEAD_KV if il in JAMBA_ATTN_LAYERS else 0 for il in range(N_LAYER)])

    return _write(path, "jamba", tokenizer, tensors, hparams)


# Mamba-2 (write_mamba2, write_granitehybrid): d_inner 128 in 8 heads of 16 channels, B and C in 2 groups
MAMBA2_N_HEAD = 8
MAMBA2_N_GROUP = 2
MAMBA2_CONV_DIM = D_INNER + 2 * MAMBA2_N_GROUP * D_STATE
GRANITEHYBRID_ATTN_LAYERS = (1, 3)
# Granite's scales (embedding, residual, logit, attention), away from 1 so that each one matters
GRANITE_SCALES = {"embedding_scale": 1.5, "residual_scale": 0.5, "logit_scale": 1.25, "attention.scale": 0.2}


def _mamba2_block(rng: np.random.Generator, il: int) -> dict[str, np.ndarray]:
    """One Mamba-2 mixer's tensors (numpy shapes, i.e. ggml's reversed), initialised as Mamba-2 does: A =
    -[1, 16) per head (the converter stores -exp(A_log)), D = 1, dt's bias the inverse softplus of dt in
    [1e-3, 1e-1] (log-uniform); the in-projection's B and C rows larger (_BC_GAIN), the grouped norm near 1."""
    p = f"blk.{il}."
    gs = MAMBA2_N_GROUP * D_STATE
    in_scale = np.repeat([1.0, _BC_GAIN, 1.0], [2 * D_INNER, 2 * gs, MAMBA2_N_HEAD])[:, None] * N_EMBD ** -0.5
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), MAMBA2_N_HEAD))
    return {
        p + "ssm_in.weight": _normal(rng, (2 * D_INNER + 2 * gs + MAMBA2_N_HEAD, N_EMBD), in_scale),
        p + "ssm_conv1d.weight": _normal(rng, (MAMBA2_CONV_DIM, D_CONV), D_CONV ** -0.5),
        p + "ssm_conv1d.bias": _normal(rng, (MAMBA2_CONV_DIM,), 0.1),
        p + "ssm_dt.bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),
        p + "ssm_a": -rng.uniform(1.0, 16.0, (MAMBA2_N_HEAD, 1)).astype(np.float32),
        p + "ssm_d": np.ones((MAMBA2_N_HEAD, 1), np.float32),
        p + "ssm_norm.weight": np.stack([_norm(rng, D_INNER // MAMBA2_N_GROUP) for _ in range(MAMBA2_N_GROUP)]),
        p + "ssm_out.weight": _normal(rng, (N_EMBD, D_INNER), _RESIDUAL_GAIN * D_INNER ** -0.5),
    }


def write_mamba2(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0,
                 overrides: dict | None = None) -> Path:
    """A 4-layer Mamba-2 model (arch "mamba2", n_embd 64, d_inner 128 in 8 heads of 16, d_state 16, 2 groups,
    d_conv 4) with vocab_gguf's tokenizer, written to path; the same seed gives the same tensors. overrides as
    write_mamba's."""
    rng = np.random.default_rng(seed)
    tokenizer = _tokenizer(vocab_gguf)
    tensors = _embeddings(rng, tokenizer)
    for il in range(N_LAYER):
        tensors[f"blk.{il}.attn_norm.weight"] = _norm(rng, N_EMBD)
        tensors.update(_mamba2_block(rng, il))

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_feed_forward_length(0)  # unused; written as llama.cpp's converter does
        w.add_head_count(0)
        w.add_ssm_group_count(MAMBA2_N_GROUP)

    over = {"mamba2.ssm.time_step_rank": (MAMBA2_N_HEAD, gguf.GGUFValueType.UINT32), **(overrides or {})}
    return _write(path, "mamba2", tokenizer, tensors, hparams, over)


def write_granitehybrid(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0,
                        overrides: dict | None = None) -> Path:
    """A 4-layer Granite hybrid model (arch "granitehybrid"): Mamba-2 mixers (sizes as write_mamba2's) in layers
    0 and 2, attention with RoPE (4 query and 2 KV heads of 16) in layers 1 and 3, a dense SwiGLU FFN of 128
    after every mixer, Granite's scales (GRANITE_SCALES); vocab_gguf's tokenizer. The same seed gives the same
    tensors; overrides as write_mamba's."""
    return _granitehybrid(path, vocab_gguf, seed, overrides, moe=False)


def write_granitehybrid_moe(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0,
                            overrides: dict | None = None) -> Path:
    """write_granitehybrid's model with Granite-4.0-H-Tiny's FFN: a mixture of GRANITE_MOE[0] experts of 128
    (GRANITE_MOE[1] used) and a shared expert of GRANITE_MOE[2] in every layer."""
    return _granitehybrid(path, vocab_gguf, seed, overrides, moe=True)


GRANITE_MOE = (4, 2, 96)   # experts, used, the shared expert's FFN length


def _moe_block(rng: np.random.Generator, il: int) -> dict[str, np.ndarray]:
    """A mixture of experts' tensors with its norm and a shared expert (GRANITE_MOE; each expert of N_FF)."""
    p = f"blk.{il}."
    n_exp, _, n_sh = GRANITE_MOE
    return {
        p + "ffn_norm.weight": _norm(rng, N_EMBD),
        p + "ffn_gate_inp.weight": _normal(rng, (n_exp, N_EMBD), 1.0),
        p + "ffn_gate_exps.weight": _normal(rng, (n_exp, N_FF, N_EMBD), N_EMBD ** -0.5),
        p + "ffn_up_exps.weight": _normal(rng, (n_exp, N_FF, N_EMBD), N_EMBD ** -0.5),
        p + "ffn_down_exps.weight": _normal(rng, (n_exp, N_EMBD, N_FF), _RESIDUAL_GAIN * N_FF ** -0.5),
        p + "ffn_gate_shexp.weight": _normal(rng, (n_sh, N_EMBD), N_EMBD ** -0.5),
        p + "ffn_up_shexp.weight": _normal(rng, (n_sh, N_EMBD), N_EMBD ** -0.5),
        p + "ffn_down_shexp.weight": _normal(rng, (N_EMBD, n_sh), _RESIDUAL_GAIN * n_sh ** -0.5),
    }


def _granitehybrid(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int, overrides: dict | None,
                   moe: bool) -> Path:
    rng = np.random.default_rng(seed)
    tokenizer = _tokenizer(vocab_gguf)
    tensors = _embeddings(rng, tokenizer)
    for il in range(N_LAYER):
        tensors[f"blk.{il}.attn_norm.weight"] = _norm(rng, N_EMBD)
        if il in GRANITEHYBRID_ATTN_LAYERS:
            tensors.update(_attn_block(rng, il))
        else:
            tensors.update(_mamba2_block(rng, il))
        tensors.update(_moe_block(rng, il) if moe else _ffn_block(rng, il))

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        # a layer with no KV heads is a Mamba-2 layer
        w.add_head_count_kv([N_HEAD_KV if il in GRANITEHYBRID_ATTN_LAYERS else 0 for il in range(N_LAYER)])
        w.add_ssm_group_count(MAMBA2_N_GROUP)
        w.add_rope_freq_base(10000.0)
        w.add_embedding_scale(GRANITE_SCALES["embedding_scale"])
        w.add_residual_scale(GRANITE_SCALES["residual_scale"])
        w.add_logit_scale(GRANITE_SCALES["logit_scale"])
        w.add_attention_scale(GRANITE_SCALES["attention.scale"])
        if moe:
            w.add_expert_count(GRANITE_MOE[0])
            w.add_expert_used_count(GRANITE_MOE[1])
            w.add_expert_shared_feed_forward_length(GRANITE_MOE[2])

    over = {"granitehybrid.ssm.time_step_rank": (MAMBA2_N_HEAD, gguf.GGUFValueType.UINT32), **(overrides or {})}
    return _write(path, "granitehybrid", tokenizer, tensors, hparams, over)


NEMOTRON_H_PATTERN = "M*-M"   # llama.cpp's converter's letters: Mamba-2, attention, FFN, Mamba-2


def write_nemotron_h(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0,
                     overrides: dict | None = None) -> Path:
    """A 4-layer Nemotron-H model (arch "nemotron_h", NEMOTRON_H_PATTERN): Mamba-2 mixers (sizes as write_mamba2's)
    in layers 0 and 3, attention without RoPE (4 query and 2 KV heads of 16) in layer 1, a ReLU^2 FFN of 128 (up,
    down) in layer 2, each after an RMS norm; vocab_gguf's tokenizer. The same seed gives the same tensors;
    overrides as write_mamba's."""
    rng = np.random.default_rng(seed)
    tokenizer = _tokenizer(vocab_gguf)
    tensors = _embeddings(rng, tokenizer)
    for il, kind in enumerate(NEMOTRON_H_PATTERN):
        p = f"blk.{il}."
        tensors[p + "attn_norm.weight"] = _norm(rng, N_EMBD)
        if kind == "M":
            tensors.update(_mamba2_block(rng, il))
        elif kind == "*":
            tensors.update(_attn_block(rng, il))
        else:
            tensors[p + "ffn_up.weight"] = _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5)
            tensors[p + "ffn_down.weight"] = _normal(rng, (N_EMBD, N_FF), _RESIDUAL_GAIN * N_FF ** -0.5)

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_head_count(N_HEAD)
        w.add_head_count_kv([N_HEAD_KV if c == "*" else 0 for c in NEMOTRON_H_PATTERN])
        w.add_feed_forward_length([N_FF if c == "-" else 0 for c in NEMOTRON_H_PATTERN])
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_layer_norm_eps(RMS_EPS)
        w.add_ssm_group_count(MAMBA2_N_GROUP)

    over = {"nemotron_h.ssm.time_step_rank": (MAMBA2_N_HEAD, gguf.GGUFValueType.UINT32), **(overrides or {})}
    return _write(path, "nemotron_h", tokenizer, tensors, hparams, over)


_FLOAT_TYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def write_truncated(path: str | os.PathLike, source_gguf: str | os.PathLike, n_layer: int, *,
                    token_texts: dict[int, str] | None = None,
                    metadata: dict[str, tuple[gguf.GGUFValueType, gguf.GGUFValueType | None, Any] | None] | None = None,
                    ) -> Path:
    """source_gguf with only its first n_layer blocks: every metadata key and tensor of the source (tensor
    data copied byte for byte, quantized or not) but the blk.{i}.* tensors of i >= n_layer; {arch}.block_count
    set to n_layer and the per-layer arrays of {arch}.* cut to n_layer entries. The vocabulary is the
    source's, but for token_texts (id -> text), which replaces those tokens' texts (a vocabulary that differs
    in one token, for the vocabulary checks). metadata (key -> (type, array element type or None, value))
    adds or replaces keys after that, e.g. {"tokenizer.ggml.pre": (GGUFValueType.STRING, None, "qwen2")} (the
    source's vocabulary under another pre-tokenizer); a value of None instead of the triple drops the key."""
    meta, tensors = _read_gguf(source_gguf)
    if metadata:
        meta = dict(meta)
        for key, entry in metadata.items():
            if key in ("general.architecture", "general.alignment"):
                raise ValueError(f"write_truncated cannot replace {key}")
            if entry is None:
                meta.pop(key, None)
            else:
                meta[key] = entry
    arch = meta["general.architecture"][2]
    n_src = meta[f"{arch}.block_count"][2]
    assert 0 < n_layer <= n_src, (n_layer, n_src)
    writer = gguf.GGUFWriter(Path(path), arch)
    for key, (vtype, sub, value) in meta.items():
        if key in ("general.architecture", "general.alignment"):
            continue  # the writer writes these itself
        if key == f"{arch}.block_count":
            value = n_layer
        elif key.startswith(arch + ".") and vtype == gguf.GGUFValueType.ARRAY and len(value) == n_src:
            value = value[:n_layer]
        elif key == "tokenizer.ggml.tokens" and token_texts:
            value = list(value)
            for i, text in token_texts.items():
                value[i] = text
        writer.add_key_value(key, value, vtype, sub)
    for name, ttype, shape, data in tensors:
        if name.startswith("blk.") and int(name.split(".")[1]) >= n_layer:
            continue
        np_shape = tuple(reversed(shape))
        if ttype in _FLOAT_TYPES:
            raw = np.frombuffer(data, _FLOAT_TYPES[ttype]).reshape(np_shape)
        else:  # quantized: the writer takes rows of bytes
            block, size = gguf.GGML_QUANT_SIZES[ttype]
            raw = np.frombuffer(data, np.uint8).reshape(*np_shape[:-1], np_shape[-1] // block * size)
        writer.add_tensor(name, raw, raw_dtype=ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def content_hash(path: str | os.PathLike) -> str:
    """sha256 (hex) over general.architecture, the architecture's hyperparameter keys (name, types,
    value) and every tensor's name, type, shape and data, in name order: equal for equal models
    whatever the file layout."""
    meta, tensors = _read_gguf(path)
    arch = meta["general.architecture"][2]
    h = hashlib.sha256()
    for key in sorted(meta):
        if key == "general.architecture" or key.startswith(arch + "."):
            vtype, sub, value = meta[key]
            h.update(repr((key, vtype.name, sub and sub.name, value)).encode())
    for name, ttype, shape, data in sorted(tensors):
        h.update(repr((name, ttype.name, shape)).encode())
        h.update(data)
    return h.hexdigest()
