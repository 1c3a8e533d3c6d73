"""A tiny synthetic GGUF of llama.cpp's qwen35 architecture (Qwen3.5: gated delta net and attention layers), for
the tests.

`write_qwen35` writes a 4-layer model from a seed with gguf's GGUFWriter, the same tensors for the same seed;
the tokenizer is copied from a real GGUF (as tests/synthetic.py's writers take it). Keys, tensor names and
shapes are the ones llama.cpp's loader reads (src/models/qwen35.cpp at llama.cpp 0c1e57098): layers 0 and 2
are gated-delta-net layers (full_attention_interval 2), 1 and 3 full attention (Qwen3-Next style: Q with a
gate, Q/K RMS norms, partial interleaved M-RoPE whose sections give every rotated pair the token's position,
the output gated by a sigmoid); each layer has a post-attention norm and a dense SwiGLU FFN. llama.cpp's
outputs on the seed-0 model are in tests/data/qwen35/ (made by its record.py).
"""
import functools
import os
from pathlib import Path

import gguf
import numpy as np

from synthetic import _norm, _normal, _tokenizer, finish

N_EMBD = 64
N_LAYER = 4
FULL_ATTENTION_INTERVAL = 2          # layers 1 and 3 attend, 0 and 2 are gated delta nets
RMS_EPS = 1e-6
N_CTX_TRAIN = 4096
N_FF = 128
# attention
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 16
N_ROT = 8                            # partial RoPE: the first 8 of 16 dimensions
ROPE_SECTIONS = (2, 1, 1, 0)         # interleaved: pairs 0..3 take t, h, w, t (all the position for text)
ROPE_FREQ_BASE = 10000000.0
# gated delta net
D_CONV = 4
D_STATE = 16                         # head_k_dim = head_v_dim
N_GROUP = 2                          # key heads
DT_RANK = 4                          # value heads
D_INNER = DT_RANK * D_STATE          # value_dim
KEY_DIM = N_GROUP * D_STATE
CONV_DIM = 2 * KEY_DIM + D_INNER

_RESIDUAL_GAIN = 8.0
#: the weights written as Q8_0 in the quantized variant (write_qwen35(..., q8_0=Q8_0_WEIGHTS)): every matrix
#: but token_embd (Q4_0) and the delta nets' beta / alpha (float32, as converters keep them small)
Q8_0_WEIGHTS = ("attn_qkv.weight", "attn_gate.weight", "ssm_out.weight", "attn_q.weight", "attn_k.weight",
                "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@functools.lru_cache(maxsize=4)
def _vocab(vocab_gguf: str) -> dict:
    """The tokenizer keys of a vocabulary GGUF (synthetic._tokenizer), read once per path (only read after)."""
    return _tokenizer(vocab_gguf)


def _gdn_block(rng: np.random.Generator, il: int) -> dict[str, np.ndarray]:
    """One gated delta net's tensors (numpy shapes), initialised as Qwen3-Next does: A_log = log(U(1, 16))
    stored as ssm_a = -exp(A_log), dt_bias 1."""
    p = f"blk.{il}."
    return {
        p + "attn_qkv.weight": _normal(rng, (CONV_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_gate.weight": _normal(rng, (D_INNER, N_EMBD), N_EMBD ** -0.5),
        p + "ssm_conv1d.weight": _normal(rng, (CONV_DIM, D_CONV), D_CONV ** -0.5),
        p + "ssm_dt.bias": np.ones(DT_RANK, np.float32),
        p + "ssm_a": (-rng.uniform(1.0, 16.0, DT_RANK)).astype(np.float32),
        p + "ssm_beta.weight": _normal(rng, (DT_RANK, N_EMBD), N_EMBD ** -0.5),
        p + "ssm_alpha.weight": _normal(rng, (DT_RANK, N_EMBD), N_EMBD ** -0.5),
        p + "ssm_norm.weight": _norm(rng, D_STATE),
        p + "ssm_out.weight": _normal(rng, (N_EMBD, D_INNER), _RESIDUAL_GAIN * D_INNER ** -0.5),
    }


def _attn_block(rng: np.random.Generator, il: int) -> dict[str, np.ndarray]:
    """One full-attention layer's tensors: Q and its gate interleaved per head in attn_q, Q/K norms."""
    p = f"blk.{il}."
    return {
        p + "attn_q.weight": _normal(rng, (2 * N_HEAD * HEAD_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_k.weight": _normal(rng, (N_HEAD_KV * HEAD_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_v.weight": _normal(rng, (N_HEAD_KV * HEAD_DIM, N_EMBD), N_EMBD ** -0.5),
        p + "attn_output.weight": _normal(rng, (N_EMBD, N_HEAD * HEAD_DIM), _RESIDUAL_GAIN * N_EMBD ** -0.5),
        p + "attn_q_norm.weight": _norm(rng, HEAD_DIM),
        p + "attn_k_norm.weight": _norm(rng, HEAD_DIM),
    }


def write_qwen35(path: str | os.PathLike, vocab_gguf: str | os.PathLike, seed: int = 0,
                 overrides: dict | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                 q8_0: tuple[str, ...] = ()) -> Path:
    """The 4-layer qwen35 model (n_embd 64; delta nets of 2 key and 4 value heads of 16, d_conv 4; attention of
    4 query and 2 KV heads of 16, RoPE over 8 dimensions; FFN 128) with vocab_gguf's tokenizer, written to
    path; the same seed gives the same tensors. overrides maps a metadata key to (value, gguf.GGUFValueType),
    or to (None, None) to leave it out; extra_tensors adds tensors (numpy shapes), for the loader's tests;
    the tensors whose names end with one of q8_0 are written as Q8_0 (the rest float32, token_embd Q4_0)."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokenizer = _vocab(str(vocab_gguf))
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][2])
    tensors = {"token_embd.weight": _normal(rng, (n_vocab, N_EMBD), 1.0), "output_norm.weight": _norm(rng, N_EMBD)}
    for il in range(N_LAYER):
        p = f"blk.{il}."
        tensors[p + "attn_norm.weight"] = _norm(rng, N_EMBD)
        tensors.update(_attn_block(rng, il) if (il + 1) % FULL_ATTENTION_INTERVAL == 0 else _gdn_block(rng, il))
        tensors[p + "post_attention_norm.weight"] = _norm(rng, N_EMBD)
        tensors[p + "ffn_gate.weight"] = _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5)
        tensors[p + "ffn_up.weight"] = _normal(rng, (N_FF, N_EMBD), N_EMBD ** -0.5)
        tensors[p + "ffn_down.weight"] = _normal(rng, (N_EMBD, N_FF), _RESIDUAL_GAIN * N_FF ** -0.5)
    tensors.update(extra_tensors or {})
    w = gguf.GGUFWriter(path, "qwen35")
    w.add_name("llamax synthetic qwen35")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_dimension_count(N_ROT)
    w.add_rope_dimension_sections(list(ROPE_SECTIONS))
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(D_INNER)
    w.add_ssm_state_size(D_STATE)
    w.add_ssm_time_step_rank(DT_RANK)
    w.add_ssm_group_count(N_GROUP)
    for key, (value, vtype) in (overrides or {}).items():   # a bad value for a loader test (None: no key)
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = gguf.GGUFValue(value, vtype, None)
    for name in [n for n in tensors if q8_0 and n.endswith(q8_0)]:
        w.add_tensor(name, gguf.quants.quantize(tensors.pop(name), gguf.GGMLQuantizationType.Q8_0),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    return finish(w, tokenizer, tensors, path)
