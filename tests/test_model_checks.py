"""Model.load checks the hyperparameters and every tensor's shape, as llama.cpp's load_hparams and
load_tensors (create_tensor -> check_tensor_dims, done_getting_tensors) do, and raises ModelError
naming the key or tensor and both values or shapes before any weight is read.

Each case writes a tiny synthetic model (float32 tensors, a 32-token BPE vocabulary) with
gguf.GGUFWriter and breaks one thing. Shapes here are in ggml order (ne0 first), as llama.cpp
writes them and as the messages print them: attn_k.weight is [n_embd, n_embd_k_gqa].
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from llamax import Batch, Context, Model
from llamax.errors import ModelError

N_LAYER = {"llama": 2, "gemma3": 6}  # gemma3: layers 0-4 slide, layer 5 is global (pattern 6)
N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 32, 4, 2, 48
HEAD = {"llama": 8, "gemma3": 16}    # llama: n_embd / n_head; gemma3: attention.key_length (as Gemma's 270M)
TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "bc", "cd", "de", "ef", "fg"]
MERGES = ["a b", "b c", "c d", "d e", "e f", "f g"]
N_VOCAB = len(TOKENS)  # 32

LLAMA_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
               "ffn_down")
GEMMA3_LAYER = LLAMA_LAYER + ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")


def _keys(arch: str) -> dict:
    keys = {"block_count": N_LAYER[arch], "context_length": 256, "embedding_length": N_EMBD,
            "feed_forward_length": N_FF, "attention.head_count": N_HEAD, "attention.head_count_kv": N_HEAD_KV,
            "attention.layer_norm_rms_epsilon": 1e-5}
    if arch == "gemma3":
        keys |= {"attention.key_length": HEAD[arch], "attention.value_length": HEAD[arch],
                 "attention.sliding_window": 4}
    return keys


def _shapes(arch: str, output: bool = False) -> dict[str, tuple[int, ...]]:
    """The valid model's tensors, ggml order."""
    d, e, f = HEAD[arch], N_EMBD, N_FF
    s = {"token_embd.weight": (e, N_VOCAB), "output_norm.weight": (e,)}
    if output:
        s["output.weight"] = (e, N_VOCAB)
    per = {"attn_norm": (e,), "attn_q": (e, N_HEAD * d), "attn_k": (e, N_HEAD_KV * d), "attn_v": (e, N_HEAD_KV * d),
           "attn_output": (N_HEAD * d, e), "ffn_norm": (e,), "ffn_gate": (e, f), "ffn_up": (e, f), "ffn_down": (f, e),
           "attn_q_norm": (d,), "attn_k_norm": (d,), "post_attention_norm": (e,), "post_ffw_norm": (e,)}
    for il in range(N_LAYER[arch]):
        for n in LLAMA_LAYER if arch == "llama" else GEMMA3_LAYER:
            s[f"blk.{il}.{n}.weight"] = per[n]
    return s


def _add_key(w: gguf.GGUFWriter, key: str, v) -> None:
    T = gguf.GGUFValueType
    if isinstance(v, list):
        sub = T.BOOL if isinstance(v[0], bool) else T.UINT32
        w.add_key_value(key, v, T.ARRAY, sub_type=sub)
    elif isinstance(v, bool):
        w.add_key_value(key, v, T.BOOL)
    elif isinstance(v, int):
        w.add_key_value(key, v, T.UINT32 if v >= 0 else T.INT32)
    elif isinstance(v, float):
        w.add_key_value(key, v, T.FLOAT32)
    else:
        w.add_key_value(key, v, T.STRING)


def write_model(path: Path, arch: str = "llama", *, keys: dict | None = None, shapes: dict | None = None,
                drop: tuple[str, ...] = (), output: bool = False, tokens: list[str] = TOKENS,
                raw: dict | None = None, meta: dict | None = None) -> Path:
    """A tiny model: `keys` overrides {arch}.<key> metadata (None removes a key), `shapes` overrides or
    adds tensors (ggml order), `drop` removes tensors, `raw` gives tensors by their bytes and ggml type (the shape
    from `shapes` or the valid model's; int8 so that the writer takes the shape as given), `meta` sets any key
    to (value, GGUFValueType[, element type]) in place of the tokenizer's own (None removes it)."""
    T = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (_keys(arch) | (keys or {})).items():
        if v is not None:
            _add_key(w, f"{arch}.{k}", v)
    tok = {"tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
           "tokenizer.ggml.token_type": ([1] * len(tokens), T.ARRAY, T.INT32),
           "tokenizer.ggml.merges": (MERGES, T.ARRAY, T.STRING)}
    for k, v in (tok | (meta or {})).items():
        if v is not None:
            w.add_key_value(k, v[0], v[1], sub_type=v[2] if len(v) > 2 else None)
    rng = np.random.default_rng(0)
    for name, ne in (_shapes(arch, output) | (shapes or {})).items():
        if name in drop:
            continue
        if raw and name in raw:
            data, t = raw[name]
            w.add_tensor(name, data.view(np.int8), raw_shape=ne[::-1], raw_dtype=t)
            continue
        x = (rng.standard_normal(ne[::-1]) * 0.1).astype(np.float32)
        w.add_tensor(name, x + 1.0 if len(ne) == 1 else x)   # norms near 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _decodes(m: Model) -> None:
    ctx = Context(m)
    ctx.decode(Batch.one([1, 2, 3]))
    logits = ctx.get_logits()
    assert logits.shape == (1, m.n_vocab) and np.isfinite(logits).all()


def _raises(path: Path, *patterns: str) -> str:
    """Model.load(path) raises ModelError whose message starts with the file name and holds each
    pattern (plain text)."""
    with pytest.raises(ModelError) as e:
        Model.load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path.name}: "), msg
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


# ---- valid models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("output", [False, True], ids=["tied", "output"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_model_loads_and_decodes(tmp_path, arch, output):
    m = Model.load(write_model(tmp_path / f"{arch}.gguf", arch, output=output))
    hp = m.hparams
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_embd_head_k, hp.n_ff, hp.n_vocab) == \
        (N_LAYER[arch], N_EMBD, N_HEAD, N_HEAD_KV, HEAD[arch], N_FF, N_VOCAB)
    assert hp.tied_output is not output
    _decodes(m)


def test_per_layer_arrays_of_one_value_load(tmp_path):
    """head_count, head_count_kv and feed_forward_length may be per-layer arrays (get_key_or_arr)."""
    n = N_LAYER["llama"]
    m = Model.load(write_model(tmp_path / "m.gguf", keys={"attention.head_count": [N_HEAD] * n,
                                                          "attention.head_count_kv": [N_HEAD_KV] * n,
                                                          "feed_forward_length": [N_FF] * n}))
    assert (m.hparams.n_head, m.hparams.n_head_kv, m.hparams.n_ff) == (N_HEAD, N_HEAD_KV, N_FF)
    _decodes(m)


@pytest.mark.parametrize("pattern, swa", [(None, (0, 1, 2, 3, 4)), (3, (0, 1, 3, 4)), (0, (0, 1, 2, 3, 4, 5)),
                                          ([True, False, True, False, True, False], (0, 2, 4))],
                         ids=["default6", "3", "0-all", "array"])
def test_gemma3_sliding_window_pattern(tmp_path, pattern, swa):
    """gemma3.attention.sliding_window_pattern: a period (layer il slides iff il % n < n - 1; 0: all
    slide) or one bool per layer (llama_model_base::load_swa_pattern), 6 when absent."""
    m = Model.load(write_model(tmp_path / "g.gguf", "gemma3", keys={"attention.sliding_window_pattern": pattern}))
    assert m.hparams.swa_layers == swa
    _decodes(m)


def test_registry_models_pass_the_checks(model, gemma):
    assert (model.arch, model.n_vocab, model.hparams.n_layer) == ("llama", 49152, 30)
    assert (gemma.arch, gemma.n_vocab, gemma.hparams.n_layer) == ("gemma3", 262144, 18)


# ---- hyperparameters -------------------------------------------------------------------------------
KEY_CASES = {
    # id: (arch, key overrides, the texts the message holds)
    "head_count_0": ("llama", {"attention.head_count": 0}, ["llama.attention.head_count is 0"]),
    "n_embd_0": ("llama", {"embedding_length": 0}, ["llama.embedding_length is 0"]),
    "head_count_kv_0": ("llama", {"attention.head_count_kv": 0}, ["llama.attention.head_count_kv is 0"]),
    "block_count_0": ("llama", {"block_count": 0}, ["llama.block_count is 0"]),
    "n_ff_0": ("llama", {"feed_forward_length": 0}, ["llama.feed_forward_length is 0"]),
    "context_length_0": ("llama", {"context_length": 0}, ["llama.context_length is 0"]),
    "key_length_0": ("gemma3", {"attention.key_length": 0}, ["gemma3.attention.key_length is 0"]),
    "head_count_not_dividing_n_embd": ("llama", {"attention.head_count": 5, "attention.head_count_kv": 5},
                                       ["llama.embedding_length 32", "llama.attention.head_count 5"]),
    "head_count_kv_not_dividing": ("llama", {"attention.head_count_kv": 3},
                                   ["llama.attention.head_count_kv 3", "llama.attention.head_count 4"]),
    "head_count_kv_above_head_count": ("llama", {"attention.head_count_kv": 8},
                                       ["llama.attention.head_count_kv 8", "llama.attention.head_count 4"]),
    "llama_n_rot_not_head": ("llama", {"rope.dimension_count": 4}, ["llama.rope.dimension_count 4", "8"]),
    "gemma3_n_rot_above_head": ("gemma3", {"rope.dimension_count": 32}, ["gemma3.rope.dimension_count 32", "16"]),
    "n_rot_odd": ("gemma3", {"rope.dimension_count": 7}, ["gemma3.rope.dimension_count 7"]),
    "value_length_not_key_length": ("gemma3", {"attention.value_length": 8},
                                    ["gemma3.attention.value_length 8", "gemma3.attention.key_length 16"]),
    "head_count_array_length": ("llama", {"attention.head_count": [4, 4, 4]},
                                ["llama.attention.head_count", "3 values", "block_count 2"]),
    "head_count_varies": ("llama", {"attention.head_count": [4, 2]}, ["llama.attention.head_count", "[4, 2]"]),
    "n_ff_varies": ("llama", {"feed_forward_length": [48, 64]}, ["llama.feed_forward_length", "[48, 64]"]),
    "head_count_not_int": ("llama", {"attention.head_count": 4.0}, ["llama.attention.head_count"]),
    "swa_pattern_array_length": ("gemma3", {"attention.sliding_window_pattern": [True, False]},
                                 ["gemma3.attention.sliding_window_pattern", "2 values", "block_count 6"]),
    "rope_scaling_unknown": ("llama", {"rope.scaling.type": "su"}, ["llama.rope.scaling.type", "'su'"]),
    "llama_with_experts": ("llama", {"expert_count": 4}, ["llama.expert_count 4", "mixture of experts"]),
}


@pytest.mark.parametrize("case", KEY_CASES)
def test_bad_hyperparameter(tmp_path, case):
    arch, keys, texts = KEY_CASES[case]
    _raises(write_model(tmp_path / f"{arch}.gguf", arch, keys=keys), *texts)


# ---- metadata of another type than llama.cpp reads (found by tests/fuzz/gguf.py) ------------------------
_T = gguf.GGUFValueType
META_CASES = {
    # id: (key -> (value, type[, element type]), the texts the message holds); each used to leak a
    # TypeError, ValueError or OverflowError out of Model.load
    "tokens_not_strings": ({"tokenizer.ggml.tokens": (list(range(N_VOCAB)), _T.ARRAY, _T.INT32)},
                           ["tokenizer.ggml.tokens", "expected an array of strings"]),
    "tokens_a_scalar": ({"tokenizer.ggml.tokens": (7, _T.UINT32)}, ["tokenizer.ggml.tokens"]),
    "scores_a_scalar": ({"tokenizer.ggml.scores": (1.5, _T.FLOAT32)}, ["tokenizer.ggml.scores", "array of numbers"]),
    "scores_strings": ({"tokenizer.ggml.scores": (TOKENS, _T.ARRAY, _T.STRING)}, ["tokenizer.ggml.scores"]),
    "token_type_a_scalar": ({"tokenizer.ggml.token_type": (3, _T.INT32)}, ["tokenizer.ggml.token_type"]),
    "token_type_floats": ({"tokenizer.ggml.token_type": ([1.0] * N_VOCAB, _T.ARRAY, _T.FLOAT32)},
                          ["tokenizer.ggml.token_type", "integers"]),
    "bos_id_nan": ({"tokenizer.ggml.bos_token_id": (float("nan"), _T.FLOAT32)},
                   ["tokenizer.ggml.bos_token_id", "expected an integer"]),
    "eos_id_inf": ({"tokenizer.ggml.eos_token_id": (float("inf"), _T.FLOAT64)}, ["tokenizer.ggml.eos_token_id"]),
    "bos_id_array": ({"tokenizer.ggml.bos_token_id": ([1, 2], _T.ARRAY, _T.UINT32)}, ["tokenizer.ggml.bos_token_id"]),
    "model_array": ({"tokenizer.ggml.model": (["gpt2", "x"], _T.ARRAY, _T.STRING)},
                    ["tokenizer.ggml.model", "expected a string"]),
    "name_array": ({"general.name": ([1, 2, 3], _T.ARRAY, _T.UINT8)}, ["general.name"]),
    "merges_ints": ({"tokenizer.ggml.merges": ([1, 2], _T.ARRAY, _T.INT32)}, ["tokenizer.ggml.merges"]),
    "add_bos_array": ({"tokenizer.ggml.add_bos_token": ([True, False], _T.ARRAY, _T.BOOL)},
                      ["tokenizer.ggml.add_bos_token", "expected a bool"]),
    "chat_template_int": ({"tokenizer.chat_template": (3, _T.UINT32)}, ["tokenizer.chat_template", "not a string"]),
}


@pytest.mark.parametrize("case", META_CASES)
def test_metadata_of_another_type(tmp_path, case):
    meta, texts = META_CASES[case]
    path = write_model(tmp_path / "m.gguf", meta=meta)
    with pytest.raises(ModelError) as e:
        Model.load(path)
    for t in texts:
        assert t in str(e.value), str(e.value)


@pytest.mark.parametrize("key,value", [("rope.freq_base", -10000.0), ("rope.freq_base", 0.0),
                                       ("rope.freq_base", float("nan")), ("rope.freq_base", float("inf")),
                                       ("attention.layer_norm_rms_epsilon", float("nan")),
                                       ("attention.layer_norm_rms_epsilon", -0.5),
                                       ("rope.scaling.factor", float("inf")), ("rope.scaling.factor", -2.0)])
def test_numbers_out_of_range(tmp_path, key, value):
    # a negative RoPE base leaked RoPE's ValueError out of Model.load; NaN and inf loaded a broken model
    _raises(write_model(tmp_path / "m.gguf", keys={key: value}), f"llama.{key} is {value}")


# ---- tensors ---------------------------------------------------------------------------------------
def _shape_str(ne) -> str:
    return "[" + ", ".join(map(str, ne)) + "]"


# (arch, tensor, wrong shape (ggml order)); the expected shape comes from the valid model's table
SHAPE_CASES = [("llama", "blk.1.attn_q.weight", (N_EMBD, 24)), ("llama", "blk.1.attn_k.weight", (N_EMBD, 8)),
               ("llama", "blk.1.attn_v.weight", (N_EMBD, 24)), ("llama", "blk.1.attn_output.weight", (N_EMBD, 24)),
               ("llama", "blk.1.ffn_gate.weight", (N_EMBD, 40)), ("llama", "blk.1.ffn_up.weight", (24, N_FF)),
               ("llama", "blk.1.ffn_down.weight", (N_FF, N_FF)), ("llama", "blk.0.attn_norm.weight", (24,)),
               ("llama", "blk.1.ffn_norm.weight", (N_EMBD, 1)), ("llama", "output_norm.weight", (24,)),
               ("llama", "token_embd.weight", (24, N_VOCAB)), ("gemma3", "blk.5.attn_q_norm.weight", (8,)),
               ("gemma3", "blk.2.attn_k_norm.weight", (32,)), ("gemma3", "blk.0.post_attention_norm.weight", (16,)),
               ("gemma3", "blk.4.post_ffw_norm.weight", (16,)), ("gemma3", "blk.3.attn_k.weight", (N_EMBD, 16)),
               ("gemma3", "blk.0.attn_q.weight", (N_EMBD, 32))]


@pytest.mark.parametrize("arch, name, ne", SHAPE_CASES, ids=[f"{a}-{n}" for a, n, _ in SHAPE_CASES])
def test_wrong_tensor_shape(tmp_path, arch, name, ne):
    want = _shapes(arch)[name]
    _raises(write_model(tmp_path / f"{arch}.gguf", arch, shapes={name: ne}),
            f"tensor '{name}' has shape {_shape_str(ne)}, expected {_shape_str(want)}")


def test_wrong_shape_message_explains_the_dimensions(tmp_path):
    msg = _raises(write_model(tmp_path / "m.gguf", shapes={"blk.1.attn_k.weight": (N_EMBD, 8)}))
    assert msg.endswith("tensor 'blk.1.attn_k.weight' has shape [32, 8], expected [32, 16] (n_embd 32 from "
                        "llama.embedding_length, n_embd_k_gqa 16 = n_head_kv 2 * n_embd_head_k 8)"), msg


def test_wrong_untied_output_shape(tmp_path):
    _raises(write_model(tmp_path / "m.gguf", output=True, shapes={"output.weight": (N_EMBD, N_VOCAB - 1)}),
            "tensor 'output.weight' has shape [32, 31], expected [32, 32]")


def test_wrong_n_ff_names_the_first_ffn_tensor(tmp_path):
    """feed_forward_length disagreeing with the tensors is caught at load, not in decode's matmul."""
    _raises(write_model(tmp_path / "m.gguf", keys={"feed_forward_length": 40}),
            "tensor 'blk.0.ffn_gate.weight' has shape [32, 48], expected [32, 40]",
            "n_ff 40 from llama.feed_forward_length")


def test_wrong_head_count_kv_names_attn_k(tmp_path):
    _raises(write_model(tmp_path / "m.gguf", keys={"attention.head_count_kv": 4}),
            "tensor 'blk.0.attn_k.weight' has shape [32, 16], expected [32, 32]", "n_head_kv 4")


@pytest.mark.parametrize("arch, name", [("llama", "blk.1.ffn_down.weight"), ("llama", "output_norm.weight"),
                                        ("llama", "token_embd.weight"), ("gemma3", "blk.5.attn_k_norm.weight"),
                                        ("gemma3", "blk.0.post_ffw_norm.weight")])
def test_missing_tensor(tmp_path, arch, name):
    _raises(write_model(tmp_path / f"{arch}.gguf", arch, drop=(name,)), f"tensor '{name}' is missing",
            _shape_str(_shapes(arch)[name]))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("n_tokens", [N_VOCAB + 1, N_VOCAB - 1], ids=["longer", "shorter"])
def test_vocabulary_length_differs_from_token_embd(tmp_path, arch, n_tokens):
    """n_vocab is the token count (llama.cpp's vocab.n_tokens()); token_embd must have that many rows,
    or tokenize could return ids the embedding has no row for."""
    tokens = (TOKENS + ["gh"])[:n_tokens]
    _raises(write_model(tmp_path / f"{arch}.gguf", arch, tokens=tokens),
            f"tensor 'token_embd.weight' has shape [32, 32], expected [32, {n_tokens}]",
            f"n_vocab {n_tokens} from tokenizer.ggml.tokens")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_block_count_below_the_layers_present(tmp_path, arch):
    n = N_LAYER[arch] - 1
    _raises(write_model(tmp_path / f"{arch}.gguf", arch, keys={"block_count": n}),
            f"tensor 'blk.{n}.", f"layer {n}", f"{arch}.block_count is {n}")


def test_block_count_above_the_layers_present(tmp_path):
    _raises(write_model(tmp_path / "m.gguf", keys={"block_count": 3}), "tensor 'blk.2.attn_norm.weight' is missing")


@pytest.mark.parametrize("name", ["blk.0.attn_output.bias", "blk.0.ffn_up.bias", "blk.1.attn_qkv.weight"])
def test_unexpected_tensor(tmp_path, name):
    """A tensor llamax would not use (llama.cpp's optional output / FFN biases, a fused QKV where the arch has
    none) is not ignored."""
    _raises(write_model(tmp_path / "m.gguf", shapes={name: (N_EMBD,)}), f"unexpected tensor '{name}'")


def test_tensor_type_that_cannot_be_dequantized(tmp_path):
    """Q8_1 is an activation format: no weight of that type is usable (Gemma's embedding stays raw at load)."""
    q8_1 = np.zeros((N_VOCAB, 36), np.uint8)   # one block of 32 values per row: f16 d, f16 s, 32 int8
    path = write_model(tmp_path / "g.gguf", "gemma3", raw={"token_embd.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    _raises(path, "tensor 'token_embd.weight' has type q8_1")


def test_checks_run_before_the_weights_are_read(tmp_path, monkeypatch):
    """A shape error is found from the tensor infos alone: no tensor is dequantized."""
    from llamax.model import gguf as g

    def no_read(*a, **k):
        raise AssertionError("a tensor was read before the checks")

    monkeypatch.setattr(g.GGUFFile, "f32", no_read)
    monkeypatch.setattr(g.GGUFFile, "raw", no_read)
    _raises(write_model(tmp_path / "m.gguf", shapes={"blk.1.ffn_down.weight": (N_FF, N_FF)}),
            "tensor 'blk.1.ffn_down.weight'")


def test_the_registry_models_keep_their_fingerprints(model, gemma):
    """A state saved by an earlier llamax still loads: hyperparameters added since (the SSM sizes) leave the
    fingerprint of a model that does not use them as it was."""
    assert model.fingerprint == "c497f5816a083d1dbb9156a36c428e0b"
    assert gemma.fingerprint == "0030fab32e49222dbcad45fa69778025"
