"""llamax.Grammar: a constraint on generated tokens, compiled once per model vocabulary (llguidance).

The pieces, from the grammar text to the sampler's bit mask:

    Grammar                 what the caller wrote: (kind, source), immutable, hashable, picklable.
                            Built by Grammar.json_schema / json / regex / gbnf / lark, each turned
                            into llguidance's grammar text and validated without a tokenizer, so a
                            bad grammar is a ValueError at construction naming the problem.
    _Vocabulary             the tokenizer bridge: llguidance's LLTokenizer over llamax's own
                            vocabulary, built once per vocabulary (see below).
    compiled grammar        llguidance's LLMatcher made from the grammar text for one vocabulary,
                            cached in that vocabulary (LRU, `COMPILED_CACHE_SIZE` grammars).
    GrammarMatcher          one request's state: a deep copy of the compiled grammar. fill_mask
                            writes the allowed tokens, accept consumes the sampled one.

Tokenizer bridge. llguidance sees each token as bytes: for token t the bytes of
``Tokenizer.token_to_piece(t)``, the bytes llamax's detokenizer emits for it (byte-level BPE text and
SentencePiece's U+2581 already turned into real bytes, <0x0A> byte tokens into their byte). Tokens that
are no text are marked the way llguidance expects (docs/special_tokens.md: the byte 0xFF in front):
CONTROL and UNKNOWN tokens, USER_DEFINED tokens that look like ``<...>`` (as llguidance's own llama.cpp
bridge does), BOS and every end-of-generation token. A marked token is never produced by text; a Lark
grammar may still name it (``<|im_start|>``). Token ids past the tokenizer's vocabulary (an output
layer padded beyond it) are empty and never allowed. llguidance tokenizes forced text (to fast-forward
through the bytes a grammar fixes) with llamax's tokenizer; a SentencePiece vocabulary that adds a
space prefix is given a control-byte sentinel in front that is cut off again (llguidance's llama.cpp
bridge does the same).

Caches. Building the bridge reads every token once (O(n_vocab) in Python, then llguidance builds its
token trie: about 0.5 s for SmolLM2's 49152 tokens, 2 to 4 s for Gemma 3's 262144), so it is built
once per vocabulary: a Tokenizer object maps (weakly) to the SHA-256 of its token bytes, special marks
and end-of-generation ids, and that fingerprint to the `_Vocabulary` (LRU, `VOCAB_CACHE_SIZE`), so two
loads of the same GGUF share one. Each vocabulary keeps its compiled grammars keyed by (kind, source); a second request
with the same schema takes the cached LLMatcher and copies it (microseconds) instead of compiling.

Mask layout. fill_mask(buf) writes into a numpy uint32 array of (n_vocab + 31) // 32 words, token t
allowed iff bit (t & 31) of word (t >> 5) is set (little-endian bit order within a word):

    word 0: bits  0..31 = tokens  0..31      word 1: tokens 32..63      ...
    the bits past n_vocab in the last word are 0

llguidance computes straight into the buffer (no Python loop over the vocabulary, the GIL released).

End of generation. The LLTokenizer is given every end-of-generation id of the model (Gemma's <eos>
and <end_of_turn>, SmolLM2's <|endoftext|> and <|im_end|>, ...) as its EOS set: where the grammar
accepts, the mask allows all of them, and nowhere else (they are marked special, so no text reaches
them). Accepting any of them ends the matcher (is_stopped); once the grammar can go no further (a
complete match, an error, or a vocabulary that cannot continue it) the mask holds exactly the
end-of-generation ids, so a sampler that obeys it always ends.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import gbnf_to_lark

from llamax.checks import integer
from llamax.errors import ModelError
from llamax.model.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED, TOKEN_NULL, Tokenizer

if TYPE_CHECKING:
    from llamax.model import ModelInfo

__all__ = ["COMPILED_CACHE_SIZE", "VOCAB_CACHE_SIZE", "Grammar", "GrammarKind", "GrammarMatcher", "closed"]

GrammarKind = Literal["json_schema", "json", "regex", "gbnf", "lark"]
_KINDS: tuple[str, ...] = ("json_schema", "json", "regex", "gbnf", "lark")

#: compiled grammars kept per vocabulary (least recently used dropped first)
COMPILED_CACHE_SIZE = 128
#: vocabularies (LLTokenizers) kept (least recently used dropped first)
VOCAB_CACHE_SIZE = 8

#: JSON compile options given to every JSON grammar; a schema's own "x-guidance" wins. Whitespace
#: between JSON tokens is allowed, but at most a line break and an indentation's worth, so that a
#: small model cannot spend its whole budget on blank lines.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_pattern": r"[\x20\x09]{0,16}(\x0A[\x20\x09]{0,24})?"}

#: stop reasons of a matcher that ended without the grammar being satisfied
_ABNORMAL_STOPS = {
    "NoExtensionBias": "no token of the vocabulary can continue the grammar",
    "MaxTokensTotal": "the grammar's token limit was reached",
    "MaxTokensParser": "the grammar's token limit was reached",
    "ParserTooComplex": "the grammar is too complex to parse here (parser limit)",
    "LexerTooComplex": "the grammar is too complex to lex here (lexer limit)",
    "InternalError": "llguidance internal error",
}


# ---------------------------------------------------------------------------------------------
# Grammar
# ---------------------------------------------------------------------------------------------

class Grammar:
    """A constraint on generated text: immutable, hashable by (kind, source), picklable.

    Build one with a constructor: `json_schema`, `json`, `regex`, `gbnf`, `lark`. The source is
    checked at construction (llguidance's validator, no tokenizer needed); a grammar that one
    vocabulary cannot express (a Lark grammar naming a special token it lacks) raises at `matcher`.

    Attributes:
        kind: "json_schema", "json", "regex", "gbnf" or "lark".
        source: the text given; a JSON schema as compact JSON text (its key order kept: properties
            are generated in that order), "" for `json`.
    """

    __slots__ = ("kind", "source", "_ll")
    kind: GrammarKind
    source: str
    _ll: str  # llguidance's grammar text (a serialized TopLevelGrammar)

    def __init__(self, kind: GrammarKind, source: str) -> None:
        """A grammar of `kind` from `source` (the constructors below are the usual way in).

        Raises:
            TypeError: `source` is not a str.
            ValueError: an unknown kind, or a source llguidance rejects (the message names it).
        """
        if kind not in _KINDS:
            raise ValueError(f"unknown grammar kind {kind!r} (known: {', '.join(_KINDS)})")
        if not isinstance(source, str):
            raise TypeError(f"a {kind} grammar's source must be a str, not {type(source).__name__}")
        ll = _to_llguidance(kind, source)
        err = LLMatcher.validate_grammar(ll)
        if err:
            raise ValueError(f"invalid {kind} grammar: {err.strip()}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "_ll", ll)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """JSON text valid under a JSON schema (a dict, or its JSON text); llguidance's subset of
        JSON Schema (docs/json_schema.md). Properties are generated in the schema's order. Between
        JSON tokens up to one line break and some indentation are allowed (not unbounded whitespace,
        which a small model can loop on); the schema's "x-guidance" object overrides this and the
        other options of llguidance's JSON compiler (whitespace_flexible, item_separator, ...).

        Raises:
            TypeError: not a dict or str, or a value JSON cannot hold.
            ValueError: not JSON, not a JSON object, or a schema llguidance rejects (unknown type,
                dangling $ref, unsupported keyword, ...), named in the message.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid json_schema grammar: the schema is not JSON: {e}") from None
        elif not isinstance(schema, dict):
            raise TypeError(f"a JSON schema must be a dict or its JSON text, not {type(schema).__name__}")
        if not isinstance(schema, dict):
            raise ValueError(f"invalid json_schema grammar: a JSON schema must be a JSON object, not "
                             f"{json.dumps(schema)[:40]} (Grammar.json() allows any JSON value)")
        try:
            source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the JSON schema holds a value JSON cannot: {e}") from None
        return cls("json_schema", source)

    @classmethod
    def json(cls) -> Grammar:
        """Any JSON value (object, array, string, number, true, false, null)."""
        return cls("json", "")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching the whole of `pattern` (Rust regex syntax, anchored at both ends).

        Raises:
            TypeError: not a str. ValueError: a pattern that does not parse (named in the message).
        """
        return cls("regex", pattern)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """A grammar in llama.cpp's GBNF (grammars/README.md; the start rule is `root`), converted to
        Lark by llguidance's converter.

        Raises:
            TypeError: not a str. ValueError: GBNF that does not parse or convert (an undefined
                rule, no root, a bad escape, ...), or a converted grammar llguidance rejects.
        """
        return cls("gbnf", text)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (docs/syntax.md; the start rule is `start`).

        Raises:
            TypeError: not a str. ValueError: a grammar llguidance rejects (named in the message).
        """
        return cls("lark", text)

    # ---- use ---------------------------------------------------------------------------------
    def matcher(self, model: ModelInfo) -> GrammarMatcher:
        """A fresh matcher of this grammar over `model`'s vocabulary (a Model or a ModelInfo).

        The vocabulary's bridge is built on its first use and the grammar compiled on its first use
        with that vocabulary; both are cached, so later calls cost a copy (microseconds).

        Raises:
            TypeError: `model` has no llamax tokenizer.
            ValueError: the grammar cannot be compiled for this vocabulary (llguidance's message).
        """
        tokenizer = getattr(model, "tokenizer", None)
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"Grammar.matcher needs a llamax Model (or ModelInfo), not {type(model).__name__}")
        vocab = _vocabulary(tokenizer, integer(model.n_vocab, "n_vocab"))
        return GrammarMatcher(self, vocab, vocab.compiled(self))

    # ---- value semantics ---------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Grammar is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Grammar is immutable (cannot delete {name!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Grammar):
            return NotImplemented
        return (self.kind, self.source) == (other.kind, other.source)

    def __hash__(self) -> int:
        return hash((self.kind, self.source))

    def __reduce__(self) -> tuple[type[Grammar], tuple[str, str]]:
        return (Grammar, (self.kind, self.source))

    def __repr__(self) -> str:
        if self.kind == "json":
            return "Grammar.json()"
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Grammar.{self.kind}({src!r})"


def _to_llguidance(kind: str, source: str) -> str:
    """llguidance's grammar text for (kind, source). Raises ValueError for a source that cannot be
    turned into one (JSON that is not an object, GBNF that does not convert)."""
    if kind == "json_schema":
        own = json.loads(source).get("x-guidance")
        if isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own):
            return LLMatcher.grammar_from_json_schema(source)  # the schema's whitespace, not ours
        return LLMatcher.grammar_from_json_schema(source, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json":
        return LLMatcher.grammar_from_json_schema("{}", defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "gbnf":
        try:
            lark = gbnf_to_lark(source)
        except Exception as e:  # the converter raises GbnfToLarkError and plain Exceptions
            raise ValueError(f"invalid gbnf grammar: {e}") from None
        return LLMatcher.grammar_from_lark(lark)
    assert kind == "lark"
    return LLMatcher.grammar_from_lark(source)


# ---------------------------------------------------------------------------------------------
# GrammarMatcher
# ---------------------------------------------------------------------------------------------

class GrammarMatcher:
    """One generation's position in a grammar over one vocabulary (from `Grammar.matcher`).

    Protocol per generated token: fill_mask(buf), sample among the allowed tokens, accept(token).
    Not thread-safe: one matcher serves one sequence.
    """

    __slots__ = ("grammar", "_vocab", "_compiled", "_ll", "_n_recorded", "_n_phantom")

    def __init__(self, grammar: Grammar, vocab: _Vocabulary, compiled: LLMatcher) -> None:
        self.grammar = grammar
        self._vocab = vocab
        self._compiled = compiled
        self._ll = compiled.deep_copy()
        self._n_recorded = 0  # tokens llguidance recorded (what its rollback can take back)
        self._n_phantom = 0   # end-of-generation ids accepted after llguidance stopped (it records none)

    @property
    def n_vocab(self) -> int:
        """Tokens in the mask (the model's n_vocab)."""
        return self._vocab.n_vocab

    @property
    def mask_words(self) -> int:
        """Length of the uint32 mask buffer: (n_vocab + 31) // 32."""
        return (self._vocab.n_vocab + 31) // 32

    @property
    def n_accepted(self) -> int:
        """Tokens accepted since creation or the last reset (what rollback may take back)."""
        return self._n_recorded + self._n_phantom

    def fill_mask(self, buf: np.ndarray) -> None:
        """Write the tokens allowed next into `buf`: bit (t & 31) of word (t >> 5) set iff token t is
        allowed (see the module docstring). Where the grammar accepts, every end-of-generation id is
        allowed; once it is stopped (complete, in error, or unable to go on) only those are.

        Args:
            buf: np.ndarray of uint32 [mask_words], C-contiguous, writable; overwritten whole.
        Raises:
            TypeError: not a uint32 numpy array. ValueError: wrong shape, not contiguous or read-only.
        """
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint32:
            what = f"a {buf.dtype} array" if isinstance(buf, np.ndarray) else type(buf).__name__
            raise TypeError(f"the mask buffer must be a numpy uint32 array, not {what}")
        n_words = self.mask_words
        if buf.shape != (n_words,):
            raise ValueError(f"the mask buffer has shape {buf.shape}, expected ({n_words},) "
                             f"for n_vocab = {self._vocab.n_vocab}")
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("the mask buffer must be C-contiguous and writable")
        self._ll.unsafe_compute_mask_ptr(buf.__array_interface__["data"][0], 4 * n_words)

    def accept(self, token: int) -> bool:
        """Consume a sampled token. True iff fill_mask would allow it now; False changes nothing.

        An end-of-generation id is accepted where the grammar accepts (or has stopped), and ends
        the matcher.

        Raises:
            TypeError: not an integer. ValueError: outside [0, n_vocab).
        """
        t = integer(token, "token id")
        if not 0 <= t < self._vocab.n_vocab:
            raise ValueError(f"token id {t} is outside the vocabulary [0, n_vocab = {self._vocab.n_vocab})")
        ll = self._ll
        if t in self._vocab.eog_ids and ll.is_stopped():
            self._n_phantom += 1  # llguidance takes it without recording it
            return True
        if ll.try_consume_tokens([t]) == 1:
            self._n_recorded += 1
            return True
        return False

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (an end-of-generation id would be accepted)."""
        return bool(self._ll.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Nothing but an end-of-generation id can follow: the grammar is complete and cannot go on,
        an end-of-generation id was accepted, or the matcher failed (see `error`)."""
        return bool(self._ll.is_stopped())

    @property
    def stop_reason(self) -> str:
        """llguidance's stop reason: "NotStopped", "NoExtension" (complete), "EndOfSentence" (an
        end-of-generation id accepted), or one of the failures `error` describes."""
        return str(self._ll.stop_reason())

    @property
    def error(self) -> str | None:
        """Why the matcher failed (an error state, a limit, a vocabulary that cannot continue the
        grammar), or None. A failed matcher allows only the end-of-generation ids."""
        msg = str(self._ll.get_error()).split("\n<state>", 1)[0].strip()  # without llguidance's state dump
        reason = msg or self._ll.stop_reason()
        if msg and msg not in _ABNORMAL_STOPS:
            return msg
        if reason in _ABNORMAL_STOPS:
            return f"{_ABNORMAL_STOPS[reason]} ({reason})"
        return None

    def reset(self) -> None:
        """Back to the start of the grammar (a fresh copy of the compiled grammar; clears errors)."""
        self._ll = self._compiled.deep_copy()
        self._n_recorded = self._n_phantom = 0

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens (rejected draft tokens of speculative decoding).

        Raises:
            TypeError: not an integer. ValueError: n outside [0, n_accepted], or a matcher in an
                error state (reset it instead).
        """
        n = integer(n, "n")
        if not 0 <= n <= self.n_accepted:
            raise ValueError(f"cannot roll back {n} tokens: {self.n_accepted} accepted")
        if self._ll.is_error():
            raise ValueError(f"cannot roll back a matcher in an error state ({self.error}); reset it instead")
        k = min(n, self._n_phantom)
        self._n_phantom -= k
        n -= k
        if n:
            ok = self._ll.rollback(n)
            assert ok, self._ll.get_error()
            self._n_recorded -= n

    def __repr__(self) -> str:
        return (f"GrammarMatcher({self.grammar!r}, n_vocab={self._vocab.n_vocab}, accepted={self.n_accepted}, "
                f"stop={self.stop_reason})")


# ---------------------------------------------------------------------------------------------
# The tokenizer bridge and its caches
# ---------------------------------------------------------------------------------------------

class _Encoder:
    """llguidance's tokenize callback: text (as UTF-8 bytes) -> llamax token ids, no BOS/EOS.

    A vocabulary whose tokenizer puts something in front of every text (SentencePiece's space
    prefix) gets a sentinel byte in front that is cut off again: a control byte that is a token of its
    own and starts no longer token, alone or after a space (llguidance's llama.cpp bridge).
    """

    def __init__(self, tokenizer: Tokenizer, pieces: Sequence[bytes]) -> None:
        self._tok = tokenizer
        self._sentinel = b""
        self._sentinel_ids: list[int] = []
        if b"".join(pieces[t] for t in self._raw(b"a")) != b"a":  # a space (or BOS) put in front
            self._sentinel, self._sentinel_ids = self._find_sentinel(pieces)

    def _raw(self, data: bytes) -> list[int]:
        return self._tok.tokenize(data, add_special=False, parse_special=False)

    def _find_sentinel(self, pieces: Sequence[bytes]) -> tuple[bytes, list[int]]:
        ordered = sorted(pieces)

        def has_extensions(prefix: bytes) -> bool:
            i = bisect.bisect_right(ordered, prefix)
            return i < len(ordered) and ordered[i].startswith(prefix)

        ids = set(pieces)
        for b in range(1, 32):
            s = bytes([b])
            if s in ids and not has_extensions(s) and not has_extensions(b" " + s):
                sentinel_ids = self._raw(s)
                if self._raw(s + b"a")[:len(sentinel_ids)] == sentinel_ids:
                    return s, sentinel_ids
        raise ValueError("this vocabulary adds a prefix to every text and has no control byte to cut it off with")

    def __call__(self, text: bytes | str) -> list[int]:
        """The ids of `text`; [] where the vocabulary cannot write it (a byte without a token): an
        exception must not cross into llguidance (it would fail the matcher), and no ids only means
        no forced tokens, the mask then says what can follow."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return []
        try:
            ids = self._raw(self._sentinel + data)
        except (ModelError, ValueError):
            return []
        k = len(self._sentinel_ids)
        if ids[:k] != self._sentinel_ids:  # the sentinel merged with the text (it was chosen not to)
            return []
        return ids[k:]


class _TokenSource:
    """What llguidance.TokenizerWrapper reads (eos_token_id, bos_token_id, tokens, special_token_ids,
    and the tokenize call)."""

    def __init__(self, tokens: list[bytes], special_ids: list[int], eos: int, bos: int | None,
                 encoder: _Encoder) -> None:
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos
        self.bos_token_id = bos
        self._encoder = encoder

    def __call__(self, text: bytes | str) -> list[int]:
        return self._encoder(text)


class _Vocabulary:
    """llguidance's view of one vocabulary (the LLTokenizer) and the grammars compiled for it."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, pieces: list[bytes], special_ids: list[int]) -> None:
        eog = sorted(tokenizer.eog_ids)
        if not eog:
            raise ValueError("the vocabulary has no end-of-generation token; a grammar cannot end")
        self.n_vocab = n_vocab
        self.eog_ids: frozenset[int] = frozenset(eog)
        bos = tokenizer.bos if 0 <= tokenizer.bos < n_vocab else None
        source = _TokenSource(pieces, special_ids, eog[0], bos, _Encoder(tokenizer, pieces))
        self.lltokenizer = LLTokenizer(TokenizerWrapper(source), n_vocab=n_vocab, eos_token=eog)
        self._compiled: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compiled(self, grammar: Grammar) -> LLMatcher:
        """The grammar's LLMatcher for this vocabulary, compiled on first use (LRU cache).

        Raises:
            ValueError: llguidance cannot build it for this vocabulary (its message).
        """
        key = (grammar.kind, grammar.source)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        m = LLMatcher(self.lltokenizer, grammar._ll, log_level=0)
        if m.is_error():
            raise ValueError(f"{grammar!r} cannot be compiled for this vocabulary: {m.get_error().strip()}")
        with self._lock:
            m = self._compiled.setdefault(key, m)  # another thread may have compiled it meanwhile
            self._compiled.move_to_end(key)
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return m


_fingerprints: weakref.WeakKeyDictionary[Tokenizer, tuple[str, list[bytes], list[int]]] = weakref.WeakKeyDictionary()
_vocabularies: OrderedDict[tuple[str, int], _Vocabulary] = OrderedDict()
_cache_lock = threading.Lock()   # guards the two dicts above
_build_lock = threading.Lock()   # serializes building a vocabulary (seconds for a large one)


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids llguidance must see as special (marked with 0xFF): CONTROL and UNKNOWN tokens,
    USER_DEFINED ones written like <...>, BOS and every end-of-generation id."""
    out = set(tokenizer.eog_ids)
    if tokenizer.bos != TOKEN_NULL:
        out.add(tokenizer.bos)
    for t in tokenizer.special_tokens:
        attr = tokenizer.token_attr(t)
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            out.add(t)
        elif attr & ATTR_USER_DEFINED:
            piece = tokenizer.token_to_piece(t)
            if piece.startswith(b"<") and piece.endswith(b">"):
                out.add(t)
    return sorted(out)


def _fingerprint(tokenizer: Tokenizer) -> tuple[str, list[bytes], list[int]]:
    """(SHA-256 of the vocabulary as llguidance sees it, token bytes, special ids), once per Tokenizer."""
    with _cache_lock:
        hit = _fingerprints.get(tokenizer)
    if hit is not None:
        return hit
    pieces = [tokenizer.token_to_piece(t) for t in range(tokenizer.n_vocab)]
    special = _special_ids(tokenizer)
    h = hashlib.sha256()
    h.update(np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)).tobytes())
    h.update(b"".join(pieces))
    h.update(np.asarray(special, dtype=np.int64).tobytes())
    h.update(np.asarray(sorted(tokenizer.eog_ids), dtype=np.int64).tobytes())
    h.update(repr((tokenizer.bos, tokenizer.vocab_type, tokenizer.add_space_prefix)).encode())
    out = (h.hexdigest(), pieces, special)
    with _cache_lock:
        _fingerprints[tokenizer] = out
    return out


def _vocabulary(tokenizer: Tokenizer, n_vocab: int) -> _Vocabulary:
    """The (cached) _Vocabulary of a tokenizer whose model has n_vocab output rows.

    Raises:
        ValueError: the model has fewer output rows than the tokenizer has tokens.
    """
    if n_vocab < tokenizer.n_vocab:
        raise ValueError(f"the model's n_vocab = {n_vocab} is smaller than its tokenizer's {tokenizer.n_vocab}")
    with _build_lock:  # one build at a time: a second thread waits for the first one's result
        fp, pieces, special = _fingerprint(tokenizer)
        key = (fp, n_vocab)
        with _cache_lock:
            hit = _vocabularies.get(key)
            if hit is not None:
                _vocabularies.move_to_end(key)
                return hit
        tokens = pieces + [b""] * (n_vocab - len(pieces))  # llguidance marks the special ids itself
        vocab = _Vocabulary(tokenizer, n_vocab, tokens, special)
        with _cache_lock:
            _vocabularies[key] = vocab
            while len(_vocabularies) > VOCAB_CACHE_SIZE:
                _vocabularies.popitem(last=False)
        return vocab


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
               "contains", "propertyNames", "not", "if", "then", "else")


def closed(schema: Any) -> Any:
    """schema with every object that lists `properties` and says nothing of others closed to them
    (additionalProperties: false): llama.cpp's reading of a missing additionalProperties
    (json-schema-to-grammar), which the server and tool calling follow so that llama-server's clients
    get the same outputs. The input is not modified. Only the keywords that hold schemas are walked:
    a property named "enum" or "properties" is a property."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed(sub) for sub in schema[key]]
    for key in _SCHEMA_ONE:
        if key in schema:
            sub = schema[key]
            out[key] = [closed(x) for x in sub] if isinstance(sub, list) else closed(sub)  # draft 4's items list
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
