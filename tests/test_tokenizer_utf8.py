"""Tokenizing bytes that are not valid UTF-8, id for id as llama.cpp's llama_tokenize.

The reference, tests/reference/tokenize_invalid_utf8.json, holds llama.cpp's ids for a few hundred
byte strings per registry model (made by the dev script tests/reference/gen_invalid_utf8.py, which
the tests do not run): lone continuation bytes, truncated, overlong and surrogate sequences, code
points above U+10FFFF, F5..FF lead bytes, all alone and among ASCII, spaces, newlines, digits, CJK
and emoji; special tokens beside invalid bytes; valid strings as a control; add_special off and on.
SmolLM2 (BPE) decodes leniently as unicode_cpts_from_utf8 does; Gemma 3 (SPM) splits the raw bytes
by lead-byte length and falls back to byte tokens. Where llama.cpp aborts (ids null: a BPE code
point above U+10FFFF), llamax raises ValueError.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REFERENCE = Path(__file__).parent / "reference" / "tokenize_invalid_utf8.json"


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_tokenize_bytes_matches_llamacpp(request, reference, name):
    m = request.getfixturevalue("model" if name == "smollm2-135m" else "gemma")
    cases = reference["models"][name]["cases"]
    assert len(cases) > 500
    wrong = []
    for h, add_special, parse_special, want in cases:
        data = bytes.fromhex(h)
        if want is None:                    # llama.cpp aborts
            with pytest.raises(ValueError, match="U\\+10FFFF"):
                m.tokenize(data, add_special=add_special, parse_special=parse_special)
            continue
        got = m.tokenize(data, add_special=add_special, parse_special=parse_special)
        if got != want:
            wrong.append((h, add_special, parse_special, got, want))
    assert not wrong, f"{len(wrong)} of {len(cases)} differ from llama.cpp, e.g. {wrong[:5]}"


def test_reference_covers_the_classes(reference):
    """The reference holds what it promises: aborts for BPE only, both add_special values,
    overlong and surrogate forms, and valid control strings."""
    bpe = reference["models"]["smollm2-135m"]["cases"]
    spm = reference["models"]["gemma3-270m"]["cases"]
    assert any(c[3] is None for c in bpe) and not any(c[3] is None for c in spm)
    for cases in (bpe, spm):
        hexes = {c[0] for c in cases}
        assert {"c08a", "eda080", "f4908080", "ff", "80", "e282"} <= hexes
        assert {c[1] for c in cases} == {False, True} and {c[2] for c in cases} == {False, True}
        assert any(_valid(h) and len(h) > 8 for h in hexes)
    # the example: an overlong newline is "\n" for BPE, two byte tokens for SPM
    assert [c[3] for c in bpe if c[0] == "c08a" and not c[1]] == [[198]]


def _valid(h: str) -> bool:
    try:
        bytes.fromhex(h).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_pieces_of_invalid_input(request, reference, name):
    """Whatever tokenize returns for invalid bytes, token_to_piece and detokenize render."""
    m = request.getfixturevalue("model" if name == "smollm2-135m" else "gemma")
    tok = m.tokenizer
    for h, add_special, parse_special, want in reference["models"][name]["cases"]:
        if want is None:
            continue
        data = bytes.fromhex(h)
        ids = m.tokenize(data, add_special=add_special, parse_special=parse_special)
        pieces = b"".join(tok.token_to_piece(t, special=True) for t in ids)
        assert isinstance(m.detokenize(ids), str)
        assert isinstance(tok.detokenize_bytes(ids, unparse_special=True), bytes)
        if name == "gemma3-270m" and not add_special:
            # SPM keeps every byte (byte fallback): the pieces are the space-escaped text, where
            # an escaped space that went out as byte tokens stays U+2581
            sp = "\u2581".encode()
            assert not tok.add_space_prefix       # Gemma 3 puts no space before the text
            assert pieces.replace(sp, b" ") == data.replace(sp, b" "), h


def test_bpe_lenient_decoding(model):
    """unicode_cpts_from_utf8: overlong forms decode, surrogates stay code points, an invalid byte is
    one U+FFFD, a code point above U+10FFFF is refused (llama.cpp aborts in unicode_cpt_to_utf8)."""
    tok = model.tokenizer
    assert tok.tokenize(b"\xc0\x8a", add_special=False) == tok.tokenize("\n", add_special=False)
    assert tok.tokenize(b"\xc1\x81", add_special=False) == tok.tokenize("A", add_special=False)
    assert tok.tokenize(b"\xe0\x80\xaf", add_special=False) == tok.tokenize("/", add_special=False)
    assert tok.tokenize(b"\x80\x80", add_special=False) == tok.tokenize("\ufffd\ufffd", add_special=False)
    assert tok.tokenize(b"\xe2\x82", add_special=False) == tok.tokenize("\ufffd\ufffd", add_special=False)
    with pytest.raises(ValueError, match="U\\+10FFFF"):
        tok.tokenize(b"ok \xf4\x90\x80\x80")
    # a str with a lone surrogate is still refused (it has no UTF-8 form)
    with pytest.raises(ValueError, match="surrogate"):
        tok.tokenize("a\ud800b")


def test_spm_raw_bytes(gemma):
    """SPM splits raw bytes by lead-byte length: C3 then 'A' is one symbol, two byte tokens."""
    tok = gemma.tokenizer
    b = [tok.text_to_token(f"<0x{x:02X}>") for x in (0xC3, 0x41)]
    assert tok.tokenize(b"\xc3A", add_special=False)[-2:] == b
    # valid text given as bytes or str tokenizes alike
    s = "Grüße, 世界 😀"
    assert tok.tokenize(s.encode()) == tok.tokenize(s)
