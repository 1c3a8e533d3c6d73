"""A tiny, valid llama GGUF written with the gguf package's GGUFWriter: the seed the GGUF fuzzer
mutates, and a real llamax Model (SPM vocabulary with byte fallback, one layer, f32 weights) small
enough that the server fuzzer's Engine answers in milliseconds.

Deterministic: the same bytes on every call (weights from a seeded generator).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_CTX = 16, 2, 1, 32, 1, 256
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def vocab() -> tuple[list[str], list[float], list[int]]:
    """(texts, scores, token types) of the SPM vocabulary: unk, bos, eos, the 256 byte tokens,
    two chatml control tokens, then some pieces."""
    texts = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3] + [6] * 256 + [3, 3]            # UNKNOWN, CONTROL, BYTE, CONTROL
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
             ["\u2581" + w for w in ("the", "a", "is", "of", "and", "to", "in", "hello", "world")] + \
             ["th", "he", "in", "er", "an", "é", "日本", "\u2581\u2581"]
    texts += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (len(texts) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return texts, scores, types


def write(path: str | os.PathLike) -> Path:
    """Write the tiny model to path; returns it."""
    import gguf

    path = Path(path)
    texts, scores, types = vocab()
    n_vocab = len(texts)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("llamax-fuzz-tiny")
    w.add_block_count(N_LAYER)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(texts)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    hd = N_EMBD // N_HEAD

    def t(name, *np_shape, scale=0.3):
        w.add_tensor(name, (rng.standard_normal(np_shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, N_EMBD, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    for il in range(N_LAYER):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, np.float32))
        t(p + "attn_q.weight", N_HEAD * hd, N_EMBD)
        t(p + "attn_k.weight", N_HEAD_KV * hd, N_EMBD)
        t(p + "attn_v.weight", N_HEAD_KV * hd, N_EMBD)
        t(p + "attn_output.weight", N_EMBD, N_HEAD * hd)
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, np.float32))
        t(p + "ffn_gate.weight", N_FF, N_EMBD)
        t(p + "ffn_up.weight", N_FF, N_EMBD)
        t(p + "ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_bytes() -> bytes:
    """The tiny model's file content."""
    with tempfile.TemporaryDirectory() as d:
        return write(Path(d) / "tiny.gguf").read_bytes()
