"""Token ids given to the tokenizer: integers only (numpy integers welcome), inside the vocabulary.

A float, a bool or a str is a TypeError (never a truncation: token_to_piece(1.5) used to give
token 1's piece); an integer outside [0, n_vocab) is a ValueError naming it (llama.cpp aborts
there), also for ints beyond the C range (no OverflowError). is_eog takes any integer, as
llama_vocab_is_eog does. detokenize checks a whole list in one pass (see _check_many).
"""
from __future__ import annotations

import numpy as np
import pytest

NON_INTEGERS = [1.5, 2.0, np.float32(3.0), True, False, np.bool_(True), "5", b"5", None, 1j, [1]]
OUT_OF_RANGE = [-1, -2, 2**31, 2**63, 2**64 + 3, -(2**70)]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def tok(request):
    return request.getfixturevalue("model" if request.param == "smollm2-135m" else "gemma").tokenizer


@pytest.mark.parametrize("method", ["token_to_piece", "token_text", "token_attr", "token_score", "is_control",
                                    "is_eog"])
@pytest.mark.parametrize("bad", NON_INTEGERS, ids=repr)
def test_non_integer_id_is_type_error(tok, method, bad):
    with pytest.raises(TypeError, match="token id must be an integer"):
        getattr(tok, method)(bad)


@pytest.mark.parametrize("method", ["token_to_piece", "token_text", "token_attr", "token_score", "is_control"])
def test_id_outside_vocab_is_value_error(tok, method):
    for bad in OUT_OF_RANGE + [tok.n_vocab, tok.n_vocab + 1]:
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            getattr(tok, method)(bad)


def test_numpy_integers_are_welcome(tok):
    t = tok.tokenize("Hello world", add_special=False)[0]
    want = tok.token_to_piece(t)
    for kind in (np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64, np.intp):
        if np.iinfo(kind).max >= t:
            assert tok.token_to_piece(kind(t)) == want
            assert tok.token_text(kind(t)) == tok.token_text(t)
    assert tok.token_to_piece(tok.n_vocab - 1) is not None
    assert tok.token_to_piece(np.int64(t), lstrip=np.int32(1)) == want.removeprefix(b" ")
    with pytest.raises(TypeError, match="lstrip"):
        tok.token_to_piece(t, lstrip=1.0)


def test_is_eog_takes_any_integer(tok):
    assert tok.is_eog(tok.eos) and tok.is_eog(np.int32(tok.eos))
    for t in (-1, tok.n_vocab, 2**80, -(2**80)):
        assert tok.is_eog(t) is False


def test_detokenize_checks_every_id(tok):
    ids = tok.tokenize("Hello world, again", add_special=False)
    text = tok.detokenize(ids)
    assert tok.detokenize(tuple(ids)) == text
    assert tok.detokenize(iter(ids)) == text
    assert tok.detokenize(np.array(ids, dtype=np.int32)) == text
    assert tok.detokenize(np.array(ids, dtype=np.uint32)) == text
    assert tok.detokenize([np.int64(t) for t in ids]) == text
    assert tok.detokenize(np.array(ids, dtype=object)) == text
    assert tok.detokenize([]) == "" and tok.detokenize(np.array([], dtype=np.int64)) == ""
    for bad in NON_INTEGERS:
        with pytest.raises(TypeError, match=r"token id \(at index 1\) must be an integer"):
            tok.detokenize([ids[0], bad, ids[-1]])
    for bad in OUT_OF_RANGE + [tok.n_vocab]:
        with pytest.raises(ValueError, match=rf"token id {bad} \(at index 2\) is outside the vocabulary"):
            tok.detokenize([ids[0], ids[1], bad])
        with pytest.raises(ValueError):
            tok.detokenize_bytes([bad])
    with pytest.raises(ValueError, match=r"token id -1 \(at index 0\)"):
        tok.detokenize(np.array([-1, 3], dtype=np.int64))
    with pytest.raises(ValueError, match=rf"token id {tok.n_vocab} \(at index 1\)"):
        tok.detokenize(np.array([3, tok.n_vocab], dtype=np.uint64))
    for arr in (np.array(ids, dtype=np.float64), np.array(ids, dtype=bool), np.array([ids, ids])):
        with pytest.raises(TypeError, match="1-D integer array"):
            tok.detokenize(arr)
    for bad in ("abc", b"abc", 5, 5.0):
        with pytest.raises(TypeError):
            tok.detokenize(bad)


def test_detokenize_same_as_pieces(tok):
    """The one-pass detokenize gives what token_to_piece per id gives (specials, lstrip)."""
    if tok.clean_spaces:
        pytest.skip("the cleanup passes change the bytes; covered in test_tokenizer.py")
    text = "<|im_start|>user\n Hello <start_of_turn> wörld 😀<|im_end|>"
    for add_special in (False, True):
        ids = tok.tokenize(text, add_special=add_special, parse_special=True)
        for unparse in (False, True):
            want = b"".join(tok.token_to_piece(t, special=unparse, lstrip=int(i == 0 and tok.add_space_prefix))
                            for i, t in enumerate(ids))
            assert tok.detokenize_bytes(ids, unparse_special=unparse) == want


def test_model_methods_check_too(model):
    with pytest.raises(TypeError):
        model.token_to_piece(1.5)
    with pytest.raises(TypeError):
        model.is_eog(2.0)
    with pytest.raises(ValueError):
        model.token_to_piece(2**64)
    with pytest.raises(TypeError):
        model.detokenize([1, 2.5])
