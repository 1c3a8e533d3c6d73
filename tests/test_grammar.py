"""llamax.Grammar over llguidance: constructors and their errors, the tokenizer bridge (llguidance sees
llamax's bytes for every token), the mask against what the grammar allows, end of generation, the
compile caches, and greedy constrained decoding with both registry vocabularies (SmolLM2: 49152 BPE
tokens, Gemma 3: 262144 SentencePiece tokens)."""
import json
import pickle
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from llamax import Batch, Context, Grammar
from llamax.grammar import GrammarMatcher, _Encoder, _fingerprint, _vocabulary
from llamax.model import ModelInfo
from llamax.model.tokenizer import Tokenizer, read_gguf_metadata

MODELS = ["model", "gemma"]  # conftest's session fixtures: SmolLM2-135M and Gemma 3 270M

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(params=MODELS)
def any_model(request):
    return request.getfixturevalue(request.param)


def allowed(matcher: GrammarMatcher) -> np.ndarray:
    """bool [n_vocab]: the matcher's mask as one flag per token."""
    buf = np.zeros(matcher.mask_words, np.uint32)
    matcher.fill_mask(buf)
    return np.unpackbits(buf.view(np.uint8), bitorder="little")[:matcher.n_vocab].astype(bool)


def greedy(model, grammar: Grammar, prompt: str, max_tokens: int = 160) -> tuple[str, GrammarMatcher]:
    """Greedy constrained decoding: argmax over the logits the mask allows, until an end-of-generation
    token. Checks at every step that the end-of-generation ids are allowed exactly where the grammar
    accepts, and that accept takes the chosen token."""
    matcher = grammar.matcher(model)
    eog = np.array(sorted(model.tokenizer.eog_ids))
    ctx = Context(model, n_ctx=512)
    text = model.apply_chat_template([{"role": "user", "content": prompt}])
    ctx.decode(Batch(model.tokenize(text, parse_special=True)))
    out: list[int] = []
    for _ in range(max_tokens):
        ok = allowed(matcher)
        assert ok.any()
        accepting = matcher.is_accepting or matcher.is_stopped
        assert ok[eog].all() == accepting and ok[eog].any() == accepting
        logits = ctx.get_logits_ith(-1)
        tok = int(np.argmax(np.where(ok, logits, -np.inf)))
        assert matcher.accept(tok)
        if tok in model.tokenizer.eog_ids:
            assert matcher.is_stopped and matcher.error is None
            return model.tokenizer.detokenize_bytes(out).decode("utf-8"), matcher
        out.append(tok)
        ctx.decode(Batch([tok]))
    raise AssertionError(f"no end of generation after {max_tokens} tokens: {model.detokenize(out)!r}")


# ---- constructors ----------------------------------------------------------------------------

def test_constructors_kind_source_equality_and_repr():
    g = Grammar.json_schema(PERSON)
    assert g.kind == "json_schema" and json.loads(g.source) == PERSON
    assert list(json.loads(g.source)["properties"]) == list(PERSON["properties"])  # order kept
    assert Grammar.json_schema(json.dumps(PERSON, indent=2)) == g
    assert hash(Grammar.json_schema(json.dumps(PERSON))) == hash(g)
    assert Grammar.regex("[0-9]+") == Grammar.regex("[0-9]+") != Grammar.lark('start: /[0-9]+/')
    assert Grammar.regex("a") != Grammar.lark("start: /a/") and Grammar.regex("a") != "a"
    assert len({Grammar.json(), Grammar.json(), Grammar.regex("x"), Grammar.gbnf('root ::= "x"')}) == 3
    assert repr(Grammar.json()) == "Grammar.json()"
    assert repr(Grammar.regex("[0-9]{3}")) == "Grammar.regex('[0-9]{3}')"
    assert repr(Grammar.gbnf('root ::= "a"')).startswith("Grammar.gbnf(")
    assert repr(Grammar.lark("start: /x/")).startswith("Grammar.lark(")
    assert repr(g).startswith("Grammar.json_schema(") and len(repr(g)) < 90


def test_grammars_are_immutable_and_picklable():
    g = Grammar.gbnf('root ::= "yes" | "no"')
    with pytest.raises(AttributeError):
        g.kind = "regex"
    with pytest.raises(AttributeError):
        g.source = "x"
    with pytest.raises(AttributeError):
        del g.source
    with pytest.raises(AttributeError):
        g.other = 1
    h = pickle.loads(pickle.dumps(g))
    assert h == g and h.kind == "gbnf" and h.source == g.source


@pytest.mark.parametrize("make, arg, words", [
    (Grammar.json_schema, "{not json", "not JSON"),
    (Grammar.json_schema, "[1, 2]", "JSON object"),
    (Grammar.json_schema, {"type": "foo"}, "Invalid type: foo"),
    (Grammar.json_schema, {"$ref": "#/$defs/missing"}, "/$defs/missing"),
    (Grammar.json_schema, {"type": "string", "format": "weird"}, "weird"),
    (Grammar.regex, "[0-9", "unclosed character class"),
    (Grammar.regex, "a{2,1}", "repetition"),
    (Grammar.gbnf, "root ::= digit", "'digit' not found"),
    (Grammar.gbnf, 'item ::= "a"', "root"),
    (Grammar.gbnf, 'root ::= "a', "end of input"),
    (Grammar.gbnf, 'root := "a"', "::="),
    (Grammar.lark, "start: foo", 'unknown name: "foo"'),
    (Grammar.lark, 'start: "a', "lexer error"),
])
def test_an_invalid_grammar_is_a_value_error_at_construction(make, arg, words):
    with pytest.raises(ValueError, match="invalid ") as e:
        make(arg)
    assert words in str(e.value)


def test_wrong_types_are_type_errors():
    with pytest.raises(TypeError):
        Grammar.json_schema(["type", "object"])
    with pytest.raises(TypeError):
        Grammar.json_schema({"type": "object", "default": object()})
    for make in (Grammar.regex, Grammar.gbnf, Grammar.lark):
        with pytest.raises(TypeError):
            make(b"[0-9]")
    with pytest.raises(ValueError, match="unknown grammar kind"):
        Grammar("ebnf", "x")
    with pytest.raises(TypeError, match="llamax Model"):
        Grammar.json().matcher(object())


# ---- the tokenizer bridge --------------------------------------------------------------------

def test_llguidance_sees_llamax_bytes_for_every_token(any_model):
    tok = any_model.tokenizer
    vocab = _vocabulary(tok, any_model.n_vocab)
    llt = vocab.lltokenizer
    assert llt.vocab_size == any_model.n_vocab and sorted(llt.eos_tokens) == sorted(tok.eog_ids)
    _, pieces, special = _fingerprint(tok)
    ids = list(range(tok.n_vocab))
    # decode_bytes renders a special token by its text, as token_to_piece(special=True) does. The one
    # exception: SentencePiece's <0xFF> byte token, whose single byte is llguidance's special marker
    # itself (it decodes as nothing and no UTF-8 grammar can reach it).
    ff = tok.text_to_token("<0xFF>")
    bad = [t for t in ids if llt.decode_bytes([t]) != tok.token_to_piece(t) and t != ff]
    assert bad == []
    assert pieces == [tok.token_to_piece(t) for t in ids]
    flags = np.array([llt.is_special_token(t) and t != ff for t in ids])
    assert np.flatnonzero(flags).tolist() == special
    assert set(tok.eog_ids) <= set(special) and tok.bos in special
    for t in tok.special_tokens:  # CONTROL tokens are special; their bytes are their text
        if tok.is_control(t):
            assert flags[t]
    # byte-fallback and SentencePiece tokens map to real bytes
    if tok.vocab_type == "spm":
        nl = tok.text_to_token("<0x0A>")
        assert llt.decode_bytes([nl]) == b"\n" and not flags[nl]
        sp = tok.text_to_token("\u2581the")
        assert llt.decode_bytes([sp]) == b" the"
    else:
        assert llt.decode_bytes([tok.text_to_token("\u0120the")]) == b" the"
        assert llt.decode_bytes([tok.text_to_token("\u010a")]) == b"\n"
    text = "Grammar: {\"a\": [1, 2.5, \"é\"]}\n  ok"
    assert llt.decode_bytes(llt.tokenize_str(text)) == text.encode()
    assert llt.tokenize_str(text) == tok.tokenize(text, add_special=False)


def test_a_space_prefix_vocabulary_tokenizes_through_a_sentinel(gemma):
    """A SentencePiece vocabulary that adds a space in front of every text (Llama 2's, Mistral's): the
    bridge's tokenize must not add it to forced text in the middle of an output."""
    meta = read_gguf_metadata(gemma.path)
    meta["tokenizer.ggml.add_space_prefix"] = True
    tok = Tokenizer(meta)
    pieces = [tok.token_to_piece(t) for t in range(tok.n_vocab)]
    assert b"".join(pieces[t] for t in tok.tokenize("a", add_special=False)) == b" a"  # the prefix
    enc = _Encoder(tok, pieces)
    for text in ("a", "\"name\": ", "}\n", " x", "12"):
        assert b"".join(pieces[t] for t in enc(text.encode())) == text.encode()
    plain = _Encoder(gemma.tokenizer, _fingerprint(gemma.tokenizer)[1])
    assert plain("a") == gemma.tokenizer.tokenize("a", add_special=False)  # no sentinel needed there


# ---- the mask --------------------------------------------------------------------------------

def test_regex_mask_allows_exactly_the_grammar(any_model):
    tok = any_model.tokenizer
    eog = sorted(tok.eog_ids)
    m = Grammar.regex("[0-9]{3}").matcher(any_model)
    ok = allowed(m)
    ids = np.flatnonzero(ok).tolist()
    for t in ids:
        piece = tok.token_to_piece(t)
        assert piece.isdigit() and 1 <= len(piece) <= 3, (t, piece)
    singles = {tok.tokenize(d, add_special=False)[0] for d in "0123456789"}
    assert singles <= set(ids)
    assert not ok[eog].any()
    # every token of the vocabulary made of 1..3 digits is allowed (the text decides, not the id)
    digits = [t for t in range(tok.n_vocab)
              if (p := tok.token_to_piece(t)).isdigit() and len(p) <= 3 and not tok.token_attr(t) & 0x28]
    assert set(digits) <= set(ids)
    assert m.accept(singles.pop()) and not allowed(m)[eog].any() and not m.is_accepting
    assert m.accept(tok.tokenize("7", add_special=False)[0])
    ok = allowed(m)
    assert not ok[eog].any() and all(len(tok.token_to_piece(t)) == 1 for t in np.flatnonzero(ok))
    assert not m.accept(eog[0]) and m.n_accepted == 2  # eog refused, nothing changed
    assert m.accept(tok.tokenize("5", add_special=False)[0])
    assert m.is_accepting and m.is_stopped and m.stop_reason == "NoExtension" and m.error is None
    ok = allowed(m)
    assert np.flatnonzero(ok).tolist() == eog  # only the end of generation, every one of them
    assert not m.accept(tok.tokenize("1", add_special=False)[0])


def test_mask_and_accept_agree(any_model):
    """accept(t) is True exactly for the tokens the mask allows (and a False changes nothing)."""
    rng = np.random.default_rng(0)
    eog = sorted(any_model.tokenizer.eog_ids)
    m = Grammar.json_schema(PERSON).matcher(any_model)
    prefix = any_model.tokenize('{"name": "Ada", "age": 3', add_special=False)
    for state in range(len(prefix) + 1):
        ok = allowed(m)
        on, off = np.flatnonzero(ok), np.flatnonzero(~ok)
        sample = [*rng.choice(on, min(40, len(on)), replace=False), *rng.choice(off, 40, replace=False), *eog]
        for t in sample:
            took = m.accept(int(t))
            assert took == ok[t], (state, int(t))
            if took:
                m.rollback(1)
        assert (allowed(m) == ok).all()
        if state < len(prefix):
            assert m.accept(prefix[state])


def test_end_of_generation_ids_are_allowed_only_where_the_grammar_accepts(any_model):
    tok = any_model.tokenizer
    eog = sorted(tok.eog_ids)
    assert len(eog) >= 2  # Gemma: <eos>, <end_of_turn>; SmolLM2: <|endoftext|>, <|im_end|>
    g = Grammar.json()
    text = '[1, {"a": true}]'
    for e in eog:
        m = g.matcher(any_model)
        for t in tok.tokenize(text, add_special=False):
            assert not allowed(m)[eog].any()
            assert m.accept(t)
        assert m.is_accepting
        before = allowed(m)
        assert before[eog].all()
        assert m.accept(e) and m.is_stopped and m.stop_reason in ("EndOfSentence", "NoExtension")
        assert not m.accept(tok.tokenize(" ", add_special=False)[0])
        assert m.error is None
        m.rollback(1)  # the end of generation taken back: the same choices as before it
        assert m.is_accepting and (allowed(m) == before).all()


def test_rollback_and_reset(model):
    tok = model.tokenizer
    eog = sorted(tok.eog_ids)
    d = [tok.tokenize(c, add_special=False)[0] for c in "123"]
    m = Grammar.regex("[0-9]{3}").matcher(model)
    fresh = allowed(m)
    for t in d:
        assert m.accept(t)
    assert m.is_stopped and m.accept(eog[0]) and m.accept(eog[-1]) and m.n_accepted == 5
    m.rollback(3)  # both end-of-generation ids (llguidance recorded neither) and the third digit
    assert m.n_accepted == 2 and not m.is_stopped and not m.is_accepting
    ok = allowed(m)
    assert ok[d[2]] and not ok[eog].any()
    assert m.accept(d[2]) and m.is_accepting
    m.rollback(0)
    assert m.n_accepted == 3
    with pytest.raises(ValueError, match="cannot roll back 4"):
        m.rollback(4)
    with pytest.raises(ValueError):
        m.rollback(-1)
    with pytest.raises(TypeError):
        m.rollback(1.0)
    assert m.n_accepted == 3 and m.is_stopped
    m.reset()
    assert m.n_accepted == 0 and (allowed(m) == fresh).all()
    # an end of generation where the grammar could still go on: llguidance records it
    m = Grammar.regex("[0-9]+").matcher(model)
    assert m.accept(d[0]) and m.is_accepting and not m.is_stopped
    assert m.accept(eog[1]) and m.is_stopped and m.stop_reason == "EndOfSentence"
    assert np.flatnonzero(allowed(m)).tolist() == eog
    m.rollback(1)
    assert m.n_accepted == 1 and not m.is_stopped and m.is_accepting and allowed(m)[d[1]]


def test_bad_buffers_and_tokens_are_refused(model):
    m = Grammar.regex("[a-z]+").matcher(model)
    n = m.mask_words
    assert n == (model.n_vocab + 31) // 32
    with pytest.raises(TypeError, match="uint32"):
        m.fill_mask(np.zeros(n, np.int32))
    with pytest.raises(TypeError, match="uint32"):
        m.fill_mask([0] * n)
    with pytest.raises(ValueError, match="shape"):
        m.fill_mask(np.zeros(n + 1, np.uint32))
    with pytest.raises(ValueError, match="shape"):
        m.fill_mask(np.zeros((1, n), np.uint32))
    with pytest.raises(ValueError, match="contiguous"):
        m.fill_mask(np.zeros(2 * n, np.uint32)[::2])
    ro = np.zeros(n, np.uint32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        m.fill_mask(ro)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.accept(model.n_vocab)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.accept(-1)
    with pytest.raises(TypeError):
        m.accept(3.0)
    assert m.n_accepted == 0 and not m.is_stopped
    assert m.accept(np.int64(model.tokenize("a", add_special=False)[0]))


def test_gemma_mask(gemma):
    """Gemma 3's 262144-token vocabulary: the last word of the mask, SentencePiece spaces, byte tokens."""
    tok = gemma.tokenizer
    m = Grammar.regex(" ?[a-z]+\n").matcher(gemma)
    buf = np.full(m.mask_words, 0xFFFFFFFF, np.uint32)
    m.fill_mask(buf)
    ok = np.unpackbits(buf.view(np.uint8), bitorder="little").astype(bool)
    assert ok.size == gemma.n_vocab == 262144
    ids = np.flatnonzero(ok)
    for t in ids:
        p = tok.token_to_piece(int(t))
        assert re.fullmatch(rb" ?[a-z]*| ?[a-z]+\n", p), (int(t), p)  # a prefix of the language
    assert tok.text_to_token("\u2581the") in ids and tok.text_to_token("the") in ids
    assert tok.text_to_token("<0x61>") in ids  # the byte token of "a"
    assert tok.text_to_token("\u2581The") not in ids and tok.text_to_token("<0x0A>") not in ids
    for t in tok.tokenize(" hello", add_special=False):
        assert m.accept(t)
    ok = allowed(m)
    nl = [tok.text_to_token("<0x0A>"), tok.text_to_token("\n")]
    assert all(ok[t] for t in nl if t >= 0)
    assert m.accept(tok.text_to_token("\n"))
    assert np.flatnonzero(allowed(m)).tolist() == sorted(tok.eog_ids)


# ---- caches ----------------------------------------------------------------------------------

def test_compiled_once_per_vocabulary_and_grammar(any_model):
    g1 = Grammar.json_schema(PERSON)
    g2 = Grammar.json_schema(json.dumps(PERSON))
    m1, m2 = g1.matcher(any_model), g2.matcher(any_model)
    assert m1._compiled is m2._compiled  # the second request took the cached compilation
    assert m1._ll is not m2._ll
    # a second Tokenizer object of the same GGUF shares the vocabulary and its compilations
    info = ModelInfo.read(any_model.path)
    assert info.tokenizer is not any_model.tokenizer
    assert _vocabulary(info.tokenizer, info.n_vocab) is _vocabulary(any_model.tokenizer, any_model.n_vocab)
    assert g1.matcher(info)._compiled is m1._compiled
    assert Grammar.json_schema({**PERSON, "required": ["name"]}).matcher(any_model)._compiled is not m1._compiled
    # each matcher is its own copy
    start = allowed(m2)
    assert m1.accept(any_model.tokenize("{", add_special=False)[0])
    assert (allowed(m2) == start).all() and m2.n_accepted == 0


def _toy_model(n_extra: int = 0) -> SimpleNamespace:
    """A model-like object over a 7-token SentencePiece vocabulary with no byte tokens (so "c" cannot be
    written), its output layer padded by n_extra rows."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a"]
    tok = Tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
                     "tokenizer.ggml.scores": [0.0] * 3 + [-1.0] * 4, "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1],
                     "tokenizer.ggml.add_space_prefix": False})
    return SimpleNamespace(tokenizer=tok, n_vocab=len(tokens) + n_extra)


def test_a_grammar_the_vocabulary_cannot_continue_ends_with_an_error():
    toy = _toy_model(n_extra=40)
    m = Grammar.regex("a(b|c)c").matcher(toy)
    assert m.mask_words == 2
    buf = np.full(2, 0xFFFFFFFF, np.uint32)
    m.fill_mask(buf)
    bits = np.unpackbits(buf.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [4]  # "a"; not the padding rows 7..46, nor bits 47..63
    assert m.accept(4) and np.flatnonzero(allowed(m)).tolist() == [5]  # "b" ("c" has no token)
    assert m.accept(5) and m.error is None
    assert np.flatnonzero(allowed(m)).tolist() == [2]  # nothing writes "c": only the end of generation
    assert m.is_stopped and not m.is_accepting
    assert "no token of the vocabulary can continue the grammar" in m.error
    assert m.accept(2) and m.n_accepted == 3
    with pytest.raises(ValueError, match="error state"):
        m.rollback(1)
    m.reset()
    assert m.error is None and m.accept(4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.accept(47)
    with pytest.raises(ValueError, match="smaller than its tokenizer"):
        Grammar.regex("a").matcher(SimpleNamespace(tokenizer=toy.tokenizer, n_vocab=5))


def test_json_whitespace_is_bounded_unless_the_schema_says_otherwise(model):
    tok = model.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    pieces = {}
    for name, extra in (("ours", {}), ("compact", {"x-guidance": {"whitespace_flexible": False}})):
        m = Grammar.json_schema({**schema, **extra}).matcher(model)
        assert m.accept(tok.tokenize("{", add_special=False)[0])
        pieces[name] = {tok.token_to_piece(int(t)) for t in np.flatnonzero(allowed(m))}
    assert b"\n" in pieces["ours"] and b"  " in pieces["ours"]
    assert all(p.count(b"\n") <= 1 and len(p) - len(p.lstrip()) <= 26 for p in pieces["ours"])
    assert b'"' in pieces["compact"] and not any(p.strip() != p for p in pieces["compact"])


def test_a_grammar_the_vocabulary_lacks_fails_at_matcher(model, gemma):
    g = Grammar.lark('start: "a" <|im_end|>')
    assert g.matcher(model).accept(model.tokenize("a", add_special=False)[0])
    with pytest.raises(ValueError, match="unknown special token"):
        g.matcher(gemma)


# ---- greedy constrained decoding -------------------------------------------------------------

def test_greedy_json_schema_output_validates(any_model):
    text, _ = greedy(any_model, Grammar.json_schema(PERSON),
                     "Describe a fictional person as JSON: name, age, role, tags and address.")
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert list(value) == list(PERSON["properties"])


def test_greedy_regex_output_matches(any_model):
    pattern = r"[A-Z][a-z]{2,12} (is|was) [0-9]{1,3} years old\."
    text, _ = greedy(any_model, Grammar.regex(pattern), "Tell me someone's name and age in one sentence.")
    assert re.fullmatch(pattern, text), text


def test_greedy_gbnf_output_matches(any_model):
    gbnf = r'''
root   ::= "color: " color ", count: " count ("!" | "")
color  ::= "red" | "green" | "blue"
count  ::= [1-9] [0-9]?
'''
    text, _ = greedy(any_model, Grammar.gbnf(gbnf), "Name a color and a number.")
    assert re.fullmatch(r"color: (red|green|blue), count: [1-9][0-9]?!?", text), text


def test_any_json_value(model):
    """Grammar.json() takes every kind of JSON value and refuses what is not JSON."""
    g = Grammar.json()
    for text in ('"x"', "3.5e2", "-0", "null", "true", '[true, {"a": [], "b": {"c": "d"}}]', "{}"):
        m = g.matcher(model)
        assert all(m.accept(t) for t in model.tokenize(text, add_special=False)), text
        assert m.is_accepting, text
        json.loads(text)
    for text, bad in (("{a", "a"), ("[1,]", "]"), ("tru e", " e")):
        m = g.matcher(model)
        toks = model.tokenize(text, add_special=False)
        k = next(i for i, t in enumerate(toks) if not m.accept(t))  # the first refused token
        assert model.detokenize(toks[k:]) == bad and m.n_accepted == k
        assert not m.is_accepting and m.error is None
