"""llamax.model.tokenizer and llamax.model.chat against llama.cpp.

The oracle is llama.cpp itself: shared/reference/<model>/tokenization.json (llama_tokenize with
add_special and parse_special false/true, token pieces, the chat prompt) and the prompts of
ref_logits.json, for SmolLM2 (byte-level BPE, pre-tokenizer "smollm") and Gemma 3 (SPM). The
vocabularies come from the registry GGUFs (fetched on first use). Toy vocabularies built here cover
the rules the real ones do not exercise (user-defined tokens, RSTRIP, clean_spaces, byte fallback).
"""
from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest
from helpers import reference_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamax.model.chat import (
    BUILTIN_TEMPLATES,
    ChatTemplateError,
    apply_chat_template,
    builtin_for_arch,
    detect_builtin,
    render_builtin,
)
from llamax.model.tokenizer import (
    ATTR_CONTROL,
    ATTR_USER_DEFINED,
    TOKEN_NULL,
    TextStream,
    Tokenizer,
    read_gguf_metadata,
    unicode_class,
)

MODELS = {"smollm2-135m": "smollm2-135m-instruct-q4_1", "gemma3-270m": "gemma-3-270m-q4_k_m"}
def _reference(name: str, file: str) -> dict:
    return json.loads((reference_dir(MODELS[name]) / file).read_text())


def _gguf(name: str) -> Path:
    from llamax import models

    if models.is_cached(name):
        return models.cache_path(name)
    if os.environ.get("LLAMAX_NO_REFERENCE") == "1":
        pytest.skip(f"model {name} is not cached and downloads are off here")
    return models.path(name)


_TOKENIZERS: dict[str, tuple[Tokenizer, dict]] = {}


def _load(name: str) -> tuple[Tokenizer, dict]:
    if name not in _TOKENIZERS:
        meta = read_gguf_metadata(_gguf(name))
        _TOKENIZERS[name] = (Tokenizer(meta), meta)
    return _TOKENIZERS[name]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return _load("smollm2-135m")[0]


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return _load("gemma3-270m")[0]


def _texts(name: str) -> list[dict]:
    return _reference(name, "tokenization.json")["texts"]


def _text_params():
    # (model, entry name); the entries are read inside the test so a missing file fails there
    names = ["prose", "code", "unicode_cjk", "emoji", "leading_spaces", "empty", "single_space", "newlines",
             "chat_template"]
    return [pytest.param(m, n, id=f"{m}-{n}") for m in MODELS for n in names]


# ---------------------------------------------------------------------------------------------
# llama.cpp's own outputs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,entry", _text_params())
def test_ids_and_pieces_match_llama_cpp(model, entry):
    tok, _ = _load(model)
    ref = {t["name"]: t for t in _texts(model)}
    if entry not in ref:
        pytest.fail(f"{model}: tokenization.json has no text {entry!r}")
    t = ref[entry]
    assert tok.tokenize(t["text"], add_special=True, parse_special=False) == t["ids_parse_special_false"]
    ids = tok.tokenize(t["text"], add_special=True, parse_special=True)
    assert ids == t["ids_parse_special_true"]
    assert tok.tokenize(t["text"], add_special=False, parse_special=True) == t["ids_no_add_special"]
    pieces = [tok.token_to_piece(i).decode("utf-8", "backslashreplace") for i in ids]
    assert pieces == t["pieces_parse_special_true"]
    assert tok.detokenize(ids, remove_special=True, unparse_special=True) == t["detok_roundtrip"]


@pytest.mark.parametrize("model", list(MODELS))
def test_ref_logits_prompts_match_llama_cpp(model):
    """The prompts of the logits reference, among them a 1.3k-token text."""
    tok, _ = _load(model)
    for p in _reference(model, "ref_logits.json")["prompts"]:
        assert tok.tokenize(p["text"], add_special=True, parse_special=p["parse_special"]) == p["tokens"], p["name"]


@pytest.mark.parametrize("model", list(MODELS))
def test_add_bos_eos_as_llama_cpp(model):
    tok, _ = _load(model)
    ref = _reference(model, "tokenization.json")
    assert tok.add_bos == ref["add_bos"] and tok.add_eos == ref["add_eos"]
    empty = tok.tokenize("", add_special=True)
    assert empty == ([tok.bos] if ref["add_bos"] else [])
    assert tok.tokenize("", add_special=False) == []


def test_smollm_has_no_bos_because_bpe_defaults_off():
    """llama.cpp: a BPE vocab adds BOS only for some pre-tokenizers (llama3, tekken, ...) unless
    tokenizer.ggml.add_bos_token says so; SmolLM2's GGUF says false, and without the key the
    "smollm" pre-tokenizer's default is off too."""
    _, meta = _load("smollm2-135m")
    assert meta["tokenizer.ggml.add_bos_token"] is False
    no_key = {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert Tokenizer(no_key).add_bos is False
    llama3 = dict(no_key, **{"tokenizer.ggml.pre": "llama-bpe"})
    assert Tokenizer(llama3).add_bos is True                 # that pre-tokenizer's default
    forced = dict(meta, **{"tokenizer.ggml.add_bos_token": True})
    assert Tokenizer(forced).tokenize("hi")[0] == 1          # bos_token_id


def test_smollm_special_ids_and_eog(smol):
    # llama.cpp's log: BOS 1, EOS 2, EOT 0, UNK 0, PAD 2, LF 198, FIM REP 4, EOG {0, 2, 4}
    assert (smol.bos, smol.eos, smol.eot, smol.unk, smol.pad, smol.nl) == (1, 2, 0, 0, 2, 198)
    assert smol.special_id("fim_rep") == 4
    assert smol.eog_ids == {0, 2, 4}
    assert smol.is_eog(2) and smol.is_eog(0) and smol.is_eog(4)
    assert not smol.is_eog(1) and not smol.is_eog(198) and not smol.is_eog(TOKEN_NULL)
    assert len(smol.special_tokens) == 17 and smol.n_unused == 0
    assert smol.n_vocab == 49152


def test_gemma_special_ids_and_eog(gemma):
    # llama.cpp's log: BOS 2, EOS 1, EOT 106, UNK 3, PAD 0, LF 248, EOG {1, 106, 212 '</s>'},
    # 6242 unused tokens, special tokens cache size 6414
    assert (gemma.bos, gemma.eos, gemma.eot, gemma.unk, gemma.pad, gemma.nl) == (2, 1, 106, 3, 0, 248)
    assert gemma.eog_ids == {1, 106, 212}
    assert gemma.n_unused == 6242 and len(gemma.special_tokens) == 6414
    assert gemma.token_attr(212) & ATTR_CONTROL                 # '</s>' forced to CONTROL as EOG
    assert gemma.token_attr(212) & ATTR_USER_DEFINED


# ---------------------------------------------------------------------------------------------
# special tokens
# ---------------------------------------------------------------------------------------------

def test_control_tokens_need_parse_special(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    on = smol.tokenize(text, parse_special=True)
    off = smol.tokenize(text, parse_special=False)
    assert on[0] == 1 and on[-1] == 2 and 1 not in off[1:] and 2 not in off
    assert smol.detokenize(off) == text                       # spelled out as plain text
    assert smol.detokenize(on, unparse_special=True) == text
    assert smol.detokenize(on, unparse_special=False) == "user\nhi"
    assert smol.token_to_piece(1, special=False) == b"" and smol.token_to_piece(1) == b"<|im_start|>"
    # a special token is never split, wherever it sits
    assert smol.tokenize("a<|im_end|><|im_end|>b", parse_special=True).count(2) == 2


def test_gemma_user_defined_tokens_match_without_parse_special(gemma):
    # "<table>" is USER_DEFINED: cut out even when parse_special is off; "<start_of_turn>" is
    # CONTROL: only with parse_special; "</s>" became CONTROL when llama.cpp marked it EOG
    assert gemma.tokenize("<table>x", parse_special=False)[:2] == [2, 168]
    assert 105 not in gemma.tokenize("<start_of_turn>", parse_special=False)
    assert gemma.tokenize("<start_of_turn>", parse_special=True) == [2, 105]
    assert 212 not in gemma.tokenize("a</s>", parse_special=False)
    assert gemma.tokenize("a</s>", parse_special=True)[-1] == 212
    # whitespace runs are user-defined tokens too: longest first
    assert gemma.tokenize("\n\n\n\n", add_special=False) == [110]


# ---------------------------------------------------------------------------------------------
# round trips (Hypothesis)
# ---------------------------------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
_mixed = st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "\n", "a", "é", "🦙", "12",
                                   "  ", "'s", "\t"]) | _text, max_size=8).map("".join)


def _smol_bytes_ok(tok: Tokenizer, text: str) -> bool:
    """True if every UTF-8 byte of `text` has a single-byte token in SmolLM2's vocabulary.

    21 bytes have none (\x04 \x06 \x13 \x14 \x16 \x1d, 0xC0 0xC1, 0xF1 0xF2, 0xF5-0xFF); a
    symbol made of such a byte is dropped by llama.cpp's fallback (see test below), so only texts
    without them come back exactly. All merge results are tokens, so nothing else is lost.
    """
    from llamax.model.tokenizer import _BYTE_TO_CHAR

    return all(tok.text_to_token(_BYTE_TO_CHAR[b]) != TOKEN_NULL for b in text.encode("utf-8"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_text)
def test_smollm_roundtrip_any_text(smol, text):
    # byte-level BPE without clean_spaces: text comes back byte for byte
    if _smol_bytes_ok(smol, text):
        assert smol.detokenize(smol.tokenize(text)) == text


def test_smollm_drops_bytes_without_a_token_like_llama_cpp(smol):
    # U+40000 is F1 80 80 80; "\xf1" has no token, and llama.cpp's per-byte fallback looks up the
    # one-byte strings of the symbol's UTF-8 ("\xc3", "\xb1"), finds none and emits nothing
    assert smol.tokenize("\U00040000") == [218, 218, 218]
    assert smol.tokenize("a\x04b") == [smol.text_to_token("a"), smol.text_to_token("b")]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mixed)
def test_smollm_roundtrip_with_special_tokens(smol, text):
    tok = smol
    if not _smol_bytes_ok(tok, text):
        return
    assert tok.detokenize(tok.tokenize(text, parse_special=True), unparse_special=True) == text
    assert tok.detokenize(tok.tokenize(text, parse_special=False), unparse_special=False) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_text.filter(lambda s: "\u2581" not in s))
def test_gemma_roundtrip_text_without_escaped_space(gemma, text):
    # SPM escapes " " as U+2581 and unescapes it back, so a literal U+2581 reads back as a space
    tok = gemma
    ids = tok.tokenize(text)
    assert ids[0] == tok.bos
    assert tok.detokenize(ids, remove_special=True) == text


def _naive_bpe(tok: Tokenizer, word: str) -> list[int]:
    """The textbook merge loop: merge the lowest-ranked adjacent pair, leftmost first, repeat."""
    from llamax.model.tokenizer import _BYTE_TO_CHAR

    syms = [_BYTE_TO_CHAR[b] for b in word.encode("utf-8")]
    while True:
        best = None
        for i in range(len(syms) - 1):
            r = tok._ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return [tok.text_to_token(s) for s in syms]


@settings(max_examples=300, deadline=None)
@given(_text)
def test_bpe_merge_queue_equals_naive_merge_loop(smol, text):
    tok = smol
    for word in tok.pre_tokenize(text):
        if _smol_bytes_ok(tok, word):
            assert list(tok._bpe_word(word)) == _naive_bpe(tok, word)


def test_pre_tokenizer_splits_digits_and_spaces(smol):
    # "smollm": every \p{N} alone, then GPT-2's regex; a space run before a word keeps its last
    # space for the word, a run before a digit or at the end stays whole
    assert smol.pre_tokenize("ab  cd 12x ٣  \t\n") == ["ab", " ", " cd", " ", "1", "2", "x", " ", "٣", "  \t\n"]
    assert smol.pre_tokenize("it's I'M") == ["it", "'s", " I", "'", "M"]


# ---------------------------------------------------------------------------------------------
# toy vocabularies: rules the real ones do not exercise
# ---------------------------------------------------------------------------------------------

def _toy_bpe(pre: str = "gpt-2", name: str = "toy", extra: dict | None = None) -> Tokenizer:
    from llamax.model.tokenizer import _BYTE_TO_CHAR

    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<tag>"] + list(_BYTE_TO_CHAR)
    tokens += [m.replace(" ", "") for m in merges if m.replace(" ", "") not in tokens]
    types = [3, 3, 4] + [1] * (len(tokens) - 3)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0, "general.name": name}
    meta.update(extra or {})
    return Tokenizer(meta)


def test_toy_bpe_merges_and_partition():
    tok = _toy_bpe()
    hello, world = tok.text_to_token("hello"), tok.text_to_token("Ġworld")
    assert tok.tokenize("hello world") == [hello, world]
    assert tok.eos == 0 and tok.is_eog(0)                     # <|endoftext|> is EOG by its text
    ids = tok.tokenize("<|im_start|>hello<tag> world", parse_special=False)
    assert 1 not in ids and ids[-3:] == [hello, 2, world]     # user-defined <tag> always cut out
    assert tok.tokenize("<|im_start|>hello<tag> world", parse_special=True) == [1, hello, 2, world]


def test_rstrip_tokens_swallow_following_spaces():
    # llama.cpp marks every special token RSTRIP for Phi-3 models (by general.name)
    tok = _toy_bpe(name="Phi-3 mini")
    hello = tok.text_to_token("hello")
    assert tok.tokenize("<|im_start|>   hello", parse_special=True) == [1, hello]
    assert tok.tokenize("<|endoftext|>   hello", parse_special=True)[1] != hello   # except <|endoftext|>


def test_clean_spaces_passes():
    tok = _toy_bpe()                                          # "gpt-2": clean_up_tokenization_spaces
    assert tok.clean_spaces

    def rt(s: str) -> str:
        return tok.detokenize(tok.tokenize(s))

    assert rt("a , b . c ? d !") == "a, b. c? d!"
    assert rt("a ' b") == "a'b"
    assert rt("it 's we 're they 've I 'm") == "it's we're they've I'm"
    assert rt("don 't I 'd we 'll") == "don 't I 'd we 'll"
    assert rt(" .x") == ".x"
    smollm = _toy_bpe(pre="smollm")
    assert not smollm.clean_spaces and smollm.detokenize(smollm.tokenize("a , b")) == "a , b"


def _toy_spm() -> Tokenizer:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = [("▁", -1.0), ("h", -2.0), ("i", -2.0), ("▁h", -1.5), ("▁hi", -1.0), ("hi", -1.2)]
    tokens = pieces + [w for w, _ in words]
    scores = [0.0] * len(pieces) + [s for _, s in words]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    return Tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
                      "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types})


def test_toy_spm_scores_byte_fallback_and_space_prefix():
    tok = _toy_spm()
    assert tok.add_bos and tok.add_space_prefix                 # SPM defaults without metadata
    t = tok.text_to_token
    assert tok.tokenize("hi") == [1, t("▁hi")]                  # " hi" with the space prefix
    ids = tok.tokenize("hié", add_special=False)
    assert ids == [t("▁hi"), t("<0xC3>"), t("<0xA9>")]          # é is no token: its UTF-8 bytes
    assert tok.detokenize(ids) == "hié"                         # leading space removed again
    assert tok.token_to_piece(t("<0xC3>")) == b"\xc3"
    # llama.cpp quirk: when remove_special drops a leading BOS it keeps the prefix space
    assert tok.detokenize([1] + ids, remove_special=True) == " hié"
    assert tok.detokenize([1] + ids) == " hié"                  # the invisible BOS took the lstrip


# ---------------------------------------------------------------------------------------------
# streaming text
# ---------------------------------------------------------------------------------------------

def test_text_stream_holds_back_split_characters(smol):
    ids = smol.tokenize("I love 🦙 llamas! 👍🏽 日本語")
    stream = TextStream(smol)
    outs = [stream.push(i) for i in ids]
    assert "".join(outs) + stream.flush() == "I love 🦙 llamas! 👍🏽 日本語"
    assert all("\ufffd" not in o for o in outs)
    llama = [i for i, p in enumerate(ids) if smol.token_to_piece(p) in (b"\xa6",)]
    assert llama and outs[llama[0]] == ""                       # middle byte of the llama emoji


def test_text_stream_flush_and_specials(smol):
    stream = TextStream(smol)
    first = smol.tokenize(" 🦙")[0]                             # ' \xf0\x9f' (incomplete)
    assert stream.push(first) == " " and stream.flush() == "\ufffd"
    assert stream.push(smol.text_to_token("hi")) == "hi"       # restarted after flush
    assert stream.push(2) == ""                                  # <|im_end|> not rendered by default
    assert TextStream(smol, special=True).push(2) == "<|im_end|>"


@settings(max_examples=100, deadline=None)
@given(_text)
def test_text_stream_equals_detokenize(smol, text):
    tok = smol
    stream = TextStream(tok)
    ids = tok.tokenize(text)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.detokenize(ids)


# ---------------------------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", list(MODELS))
def test_chat_template_matches_llama_cpp(model):
    tok, meta = _load(model)
    ref = _reference(model, "tokenization.json")
    out = apply_chat_template(meta.get("tokenizer.chat_template"), ref["chat_messages"], add_generation_prompt=True,
                              bos_token=tok.token_text(tok.bos), eos_token=tok.token_text(tok.eos),
                              arch=meta["general.architecture"])
    assert out == ref["chat_formatted"]


def test_smollm_jinja_template_adds_its_default_system_prompt():
    _, meta = _load("smollm2-135m")
    tmpl = meta["tokenizer.chat_template"]
    out = apply_chat_template(tmpl, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_start|>user\nHi<|im_end|>\n")
    assert detect_builtin(tmpl) == "chatml"


def test_builtin_templates_by_name():
    msgs = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert render_builtin("chatml", msgs[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_builtin("gemma", msgs) == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                             "<start_of_turn>model\nHello<end_of_turn>\n"
                                             "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert apply_chat_template(None, msgs[1:2], arch="gemma3") == render_builtin("gemma", msgs[1:2])
    assert apply_chat_template(None, msgs[1:2], arch="llama") == render_builtin("chatml", msgs[1:2])
    assert apply_chat_template("chatml", msgs[1:2], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    assert builtin_for_arch("gemma3") == "gemma" and builtin_for_arch(None) == "chatml"
    assert set(BUILTIN_TEMPLATES) >= {"chatml", "gemma"}
    assert detect_builtin("{{ '<start_of_turn>' }}") == "gemma"


def test_jinja_helpers_and_errors():
    tmpl = ("{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
            "{% for m in messages %}{{ m.content|tojson }}{% endfor %}{{ bos_token }}")
    assert apply_chat_template(tmpl, [{"role": "user", "content": "é"}], bos_token="<s>") == '"é"<s>'
    with pytest.raises(ChatTemplateError, match="no messages"):
        apply_chat_template(tmpl, [])
    with pytest.raises(ChatTemplateError):
        apply_chat_template("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        apply_chat_template(tmpl, [{"content": "no role"}])
    with pytest.raises(ChatTemplateError):                      # the sandbox refuses attribute games
        apply_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                            [{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------------------------

def test_unicode_table_agrees_with_python_unicodedata():
    """Our embedded Unicode 15.1 classes agree with Python's database wherever both assign."""
    py_version = tuple(int(x) for x in unicodedata.unidata_version.split("."))
    for cp in range(0x110000):
        cat = unicodedata.category(chr(cp))
        if cat == "Cn":
            continue
        py = "C" if cat[0] == "C" else cat[0]
        ours = unicode_class(cp)
        if ours == "U":
            assert py_version > (15, 1, 0), f"U+{cp:04X} ({cat}) unassigned in our table"
            continue
        assert ours == py, f"U+{cp:04X}: {ours} vs Python's {cat}"


def test_metadata_reader_matches_gguf_reader():
    import gguf

    from llamax.model.tokenizer import _fields_of_reader

    path = _gguf("smollm2-135m")
    fast = read_gguf_metadata(path, "tokenizer.")
    slow = _fields_of_reader(gguf.GGUFReader(str(path)))
    assert fast.keys() <= slow.keys()
    for key, value in fast.items():
        assert slow[key] == value, key
    a, b = Tokenizer.from_gguf(path), Tokenizer.from_gguf(fast)
    assert a.tokenize("Hello, world! 123") == b.tokenize("Hello, world! 123")


def test_errors():
    tok = _toy_bpe()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_to_piece(tok.n_vocab)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.detokenize([-1])
    with pytest.raises(ValueError, match="surrogate"):
        tok.tokenize("a\ud800")
    assert tok.tokenize(b"he\xffllo") == tok.tokenize("he\ufffdllo")   # one U+FFFD per bad byte
    from llamax.errors import ModelError

    with pytest.raises(ModelError, match="pre-tokenizer"):
        _toy_bpe(pre="no-such-pre")
    with pytest.raises(ModelError, match="not supported"):
        Tokenizer({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelError, match="duplicate"):
        Tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "a"]})
