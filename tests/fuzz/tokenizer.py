"""Fuzz target (d): the tokenizer (llamax/model/tokenizer.py) of SmolLM2 (byte-level BPE), Gemma 3
(SPM with user-defined whitespace tokens) and the tiny model (SPM with byte fallback).

A case tokenizes random bytes (invalid UTF-8 included) or random text (any code point: lone
surrogates, controls, combining marks, special-token texts, whitespace runs; sometimes 20 000+
characters), then detokenizes random ids (inside and outside the vocabulary, non-integers) and
renders random token pieces.

Contract checked (the docstrings of tokenize / detokenize / token_to_piece): tokenize returns ids in
[0, n_vocab), raises ValueError for a str holding a lone surrogate (always) and CodePointError (a
ValueError) only for BPE bytes that decode above U+10FFFF; detokenize returns a str, token_to_piece
bytes, or TypeError (not an integer) / ValueError (outside the vocabulary), nothing else. The round
trip detokenize(tokenize(text)) == text holds where llama.cpp's tokenizers keep the text (as
tests/test_tokenizer.py states it): SmolLM2 for text whose bytes all have a token, with or
without parsing special tokens; Gemma for text without U+2581 (SPM's escaped space).
"""
from __future__ import annotations

import functools

import numpy as np

from llamax import models
from llamax.model.tokenizer import TOKEN_NULL, CodePointError, Tokenizer
from tests.fuzz.common import Draw, Finding, tiny_model

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
            "<s>", "</s>", "<unk>", "<pad>", "<0x41>", "\u2581", "  ", "\n\n", "\t", "\r\n", " ", "'s", "12345",
            "é", "e\u0301", "🦙", "日本語", "\ufeff", "\x00", "\ud800", "\udfff", "\U0010ffff", "\u200d")


@functools.lru_cache(maxsize=None)
def tokenizers() -> dict[str, Tokenizer]:
    return {"smollm2": Tokenizer.from_gguf(models.path("smollm2-135m")),
            "gemma3": Tokenizer.from_gguf(models.path("gemma3-270m")),
            "tiny": tiny_model().tokenizer}


def _smol_bytes_ok(tok: Tokenizer, text: str) -> bool:
    from llamax.model.tokenizer import _BYTE_TO_CHAR

    return all(tok.text_to_token(_BYTE_TO_CHAR[b]) != TOKEN_NULL for b in text.encode("utf-8"))


def _text(d: Draw) -> str:
    parts = []
    for _ in range(d.below(12)):
        k = d.below(5)
        if k == 0:
            parts.append(d.pick(SPECIALS))
        elif k == 1:
            parts.append(chr(d.below(0x110000)))
        elif k == 2:
            parts.append(chr(d.below(0x80)) * (1 + d.below(3)))
        elif k == 3:
            parts.append(d.bytes(d.below(12)).decode("utf-8", "replace"))
        else:
            parts.append(d.bytes(d.below(8)).decode("latin-1"))
    text = "".join(parts)
    if d.chance(1, 64):                       # a very long input
        text = (text or "a b") * (20000 // max(len(text), 1) + 1)
    return text


def _ids(d: Draw, n_vocab: int) -> list:
    ids = [d.below(n_vocab) for _ in range(d.below(24))]
    if ids and d.chance(1, 3):
        ids[d.below(len(ids))] = d.pick((-1, n_vocab, 2**31, 2**63, -(2**70), 1.0, True, "3", None, np.int64(5),
                                         np.uint8(1), np.float32(2)))
    return ids


def _expect_ids(ids, n_vocab: int, what: str) -> None:
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < n_vocab for t in ids):
        raise Finding(f"{what} returned ids outside [0, {n_vocab}): {ids[:20]!r}")


def one_input(data: bytes) -> None:
    d = Draw(data)
    name = d.pick(("smollm2", "gemma3", "tiny"))
    tok = tokenizers()[name]
    n = tok.n_vocab
    add_special, parse_special = bool(d.below(2)), bool(d.below(2))
    # ---- tokenize --------------------------------------------------------------------------------
    if d.chance(1, 3):
        raw = d.bytes(d.below(64))
        if d.chance(1, 64):
            raw = raw * (20000 // max(len(raw), 1) + 1)
        try:
            ids = tok.tokenize(raw if d.below(2) else bytearray(raw), add_special, parse_special)
        except CodePointError:
            if tok.vocab_type != "bpe":
                raise Finding(f"{name}: CodePointError for SPM bytes {raw[:40]!r}") from None
        else:
            _expect_ids(ids, n, f"{name}.tokenize(bytes)")
    else:
        text = _text(d)
        lone = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        try:
            ids = tok.tokenize(text, add_special, parse_special)
        except ValueError:
            if not lone:
                raise
        else:
            if lone:
                raise Finding(f"{name}: tokenize took a str with a lone surrogate: {text[:40]!r}")
            _expect_ids(ids, n, f"{name}.tokenize(str)")
            if name == "smollm2" and _smol_bytes_ok(tok, text):
                back = tok.detokenize(tok.tokenize(text, parse_special=parse_special), unparse_special=parse_special)
                if back != text:
                    raise Finding(f"smollm2 round trip: {text[:60]!r} -> {back[:60]!r}")
            elif name == "gemma3" and "\u2581" not in text:
                ids = tok.tokenize(text)
                back = tok.detokenize(ids, remove_special=True)
                if ids[:1] != [tok.bos] or back != text:
                    raise Finding(f"gemma3 round trip: {text[:60]!r} -> {back[:60]!r}")
    # ---- detokenize and pieces -------------------------------------------------------------------
    ids = _ids(d, n)
    bad = any(not (isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) and 0 <= t < n)
              for t in ids)
    try:
        text = tok.detokenize(ids, remove_special=bool(d.below(2)), unparse_special=bool(d.below(2)))
    except (TypeError, ValueError):
        if not bad:
            raise
    else:
        if bad:
            raise Finding(f"{name}: detokenize took {ids!r}")
        if not isinstance(text, str):
            raise Finding(f"{name}: detokenize returned {type(text).__name__}")
        text.encode("utf-8")                 # valid Unicode (U+FFFD for invalid UTF-8), no surrogate
    t = ids[0] if ids else d.below(n)
    t_ok = isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) and 0 <= t < n
    try:
        piece = tok.token_to_piece(t, special=bool(d.below(2)), lstrip=d.below(3))
    except (TypeError, ValueError):
        if t_ok:
            raise
    else:
        if not t_ok:
            raise Finding(f"{name}: token_to_piece took {t!r}")
        if not isinstance(piece, bytes):
            raise Finding(f"{name}: token_to_piece({t!r}) returned {type(piece).__name__}")
