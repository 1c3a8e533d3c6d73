"""The draft-model drafter of speculative decoding: a small model sharing the target's vocabulary runs
greedily in its own context and proposes the tokens the target then verifies in one decode.

    check_vocab(target, draft)     llama.cpp's common_speculative_are_compatible, raising ModelError
    DraftModel(model, target)      the drafter: draft(seqs), release(key), close(), stats

A DraftModel keeps, per key (sequence k of its own context), `held`: the tokens its cache holds, the
token at position i being held[i]. The target's sequence comes in position order (tokens[i] at position
i), so the draft cache mirrors the target's positions. One draft() call runs in two phases:

    sync     each request keeps the common prefix of held and tokens (at most len(tokens) - 1, so
             its last token is decoded again for its logits); seq_rm(key, n_common, -1) drops the
             rest: the target's rejected drafts, or everything after a difference. ONE decode holds
             every request's missing tokens (more only when they exceed n_batch), logits on each
             request's last token.
    rounds   per round, each still-drafting request takes the greedy token of its logits row
             (argmax, ties to the lowest id) and stops when that token's softmax probability is
             below p_min (llama.cpp's draft p_min test; the token is then not proposed), at n_max
             tokens, or when the next draft would pass the context; ONE decode then holds one token
             per request that goes on.

Drafted tokens stay in the cache (held grows by every decoded draft; the last proposed token is never
decoded, nothing needs its logits): the next call's sync removes whatever the target rejected, so the
draft cache stays aligned with the target (same positions, rejected tail removed) and a draft of the
same tokens is the same whatever came before.

Costs: a call decodes the tokens the target added since the last call (the accepted drafts are
already held) plus one token per drafted token but the last. When the target's sequence changed
before the end of held (a context shift slid its tokens down, or a different prompt came for the key),
only the common prefix stays and everything after it is decoded again: correct, at the price of a
prefill of the rest (after a shift: of everything after the kept n_keep tokens). The sequence starts
over from position 0 when the kept prefix cannot be used: a recurrent draft model outside its rollback
window (seq_rm returns False), or a sliding-window cache that no longer holds the window of the first
position to decode (its oldest position above n_common - n_swa, llama-server's test).

draft() never raises for lack of room: a request whose tokens fill the draft context (len(tokens) >=
n_ctx_seq; size the draft context for the target's sequences) gets [], and a round stops a request whose
next draft would pass it. When a decode finds no cell (NoKVSlotError) its requests are decoded one by one:
in the sync phase a request that still does not fit gets [] and is cut back to its common prefix (it holds
no cell another request could use); in a round it keeps the tokens drafted so far. held is always exactly
what the cache holds.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llamax import checks
from llamax.batch import Batch
from llamax.context import Context
from llamax.errors import ModelError, NoKVSlotError
from llamax.params import ContextParams
from llamax.sampling import rows_logprobs

if TYPE_CHECKING:
    from llamax.model import Model, ModelInfo

__all__ = ["DRAFT_N_CTX_MAX", "VOCAB_CHECK_START", "VOCAB_MAX_SIZE_DIFFERENCE", "DraftModel", "DraftStats",
           "check_vocab"]

#: llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: the vocabularies' sizes may differ by at most this much
VOCAB_MAX_SIZE_DIFFERENCE = 128
#: llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID: token texts are compared from this id up
VOCAB_CHECK_START = 5
#: n_ctx=0 gives each sequence the draft model's training context, capped at this many cells
DRAFT_N_CTX_MAX = 4096

_TOKENS_KEY = "tokenizer.ggml.tokens"


def _show(b: bytes) -> str:
    """A token's stored text for an error message."""
    return repr(b.decode("utf-8", errors="backslashreplace"))


def check_vocab(target: ModelInfo, draft: ModelInfo) -> None:
    """Check that draft can draft for target (llama.cpp's common_speculative_are_compatible): the same
    vocabulary type, the same BOS / EOS ids and add_bos / add_eos, vocabulary sizes at most
    VOCAB_MAX_SIZE_DIFFERENCE apart, and every token's stored text equal from id VOCAB_CHECK_START up
    to the smaller vocabulary. O(n_vocab), the texts compared in numpy.

    Args:
        target, draft: llamax.Model or llamax.ModelInfo (ModelInfo.read checks a file without its weights).

    Raises:
        TypeError: an argument is not a Model / ModelInfo.
        ModelError: the first difference, named: "vocabulary type: 'bpe' in the target, 'spm' in the
            draft", ..., "token 1234: 'abc' in the target, 'abd' in the draft".
    """
    from llamax.model import ModelInfo

    for what, m in (("target", target), ("draft", draft)):
        if not isinstance(m, ModelInfo):
            raise TypeError(f"check_vocab: {what} must be a llamax.Model or ModelInfo, not {type(m).__name__}")
    tt, td = target.tokenizer, draft.tokenizer

    def differ(what: str, a: object, b: object) -> None:
        if a != b:
            raise ModelError(f"the draft model cannot draft for the target: {what}: {a!r} in the target, "
                             f"{b!r} in the draft")

    differ("vocabulary type", tt.vocab_type, td.vocab_type)
    differ("add_bos", tt.add_bos, td.add_bos)
    differ("add_eos", tt.add_eos, td.add_eos)
    differ("BOS token", tt.bos, td.bos)
    differ("EOS token", tt.eos, td.eos)
    n_t, n_d = target.n_vocab, draft.n_vocab
    if abs(n_t - n_d) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise ModelError(f"the draft model cannot draft for the target: vocabulary size: {n_t} in the target, "
                         f"{n_d} in the draft (difference {abs(n_t - n_d)}, at most {VOCAB_MAX_SIZE_DIFFERENCE})")
    n = min(n_t, n_d)
    a = target.gguf.reader.string_array_bytes(_TOKENS_KEY)[VOCAB_CHECK_START:n]
    b = draft.gguf.reader.string_array_bytes(_TOKENS_KEY)[VOCAB_CHECK_START:n]
    if a == b:
        return
    diff = np.flatnonzero(np.asarray(a, dtype=object) != np.asarray(b, dtype=object))
    i = int(diff[0])
    raise ModelError(f"the draft model cannot draft for the target: token {VOCAB_CHECK_START + i}: "
                     f"{_show(a[i])} in the target, {_show(b[i])} in the draft")


@dataclass
class DraftStats:
    """What a DraftModel did, summed over its draft() calls."""

    n_calls: int = 0      # draft() calls
    n_drafted: int = 0    # tokens proposed
    n_decode: int = 0     # decode calls (sync and rounds)
    n_synced: int = 0     # tokens the sync phase decoded (the target's new tokens, or re-decoded ones)
    draft_s: float = 0.0  # wall time inside draft()
    rounds_s: float = 0.0  # of it, the drafting rounds (the sync phase excluded)

    @property
    def s_per_token(self) -> float:
        """Seconds of draft() per proposed token (0 before any)."""
        return self.draft_s / self.n_drafted if self.n_drafted else 0.0


class _Request:
    """One (key, tokens, n_max) of a draft() call while it runs."""

    __slots__ = ("key", "tokens", "n_max", "base", "draft", "row", "live")

    def __init__(self, key: int, tokens: np.ndarray, n_max: int) -> None:
        self.key, self.tokens, self.n_max = key, tokens, n_max
        self.base = 0                       # the tokens held before the sync phase decodes
        self.draft: list[int] = []
        self.row = np.zeros(0, np.float32)  # the logits row of the next draft (set by a decode)
        self.live = True


class DraftModel:
    """A draft model in its own context, drafting for the target's sequences (the Drafter protocol of
    llamax.speculative: draft, release, close).

    Args:
        model: the draft model: a llamax.Model, or a registry name / GGUF path (then checked against
            the target before its weights load).
        target: the target llamax.Model (only its vocabulary is read).
        n_seq_max: keys 0 .. n_seq_max - 1, key k on sequence k of the draft context (one unified cache).
        n_ctx: cells of the draft context, shared by its sequences; 0: min(the draft model's training
            context, DRAFT_N_CTX_MAX) per sequence, times n_seq_max. A sequence's positions stay below
            the context's n_ctx_seq (= n_ctx, padded to 256).
        n_threads: threads of a model loaded here and of the context's memory (None: all cores).
        p_min: a greedy token whose softmax probability is below p_min ends the draft (not proposed);
            0 drafts n_max tokens, above 1 drafts nothing.
        type_k, type_v: the draft cache's element types.

    Attributes:
        model: the draft Model. ctx: its Context (RuntimeError once closed; `closed` tells).
        n_ctx_seq: the positions a sequence can use. stats: DraftStats.

    Raises:
        TypeError / ValueError: a bad argument (nothing is loaded).
        ModelError: the vocabularies differ (check_vocab), or the model cannot be loaded.
    """

    def __init__(self, model: Model | str | os.PathLike, target: Model, *, n_seq_max: int = 1, n_ctx: int = 0,
                 n_threads: int | None = None, p_min: float = 0.75, type_k: str = "f16", type_v: str = "f16") -> None:
        from llamax.model import Model, ModelInfo

        if not isinstance(target, ModelInfo):
            raise TypeError(f"target must be a llamax.Model, not {type(target).__name__}")
        if not isinstance(model, (Model, str, os.PathLike)):
            raise TypeError(f"model must be a llamax.Model, a registry name or a GGUF path, not {type(model).__name__}")
        n_seq_max = checks.positive(n_seq_max, "n_seq_max", 257)
        n_ctx = checks.integer(n_ctx, "n_ctx")
        if n_ctx < 0:
            raise ValueError(f"n_ctx = {n_ctx} must be >= 0 (0: the draft model's training context)")
        p = checks.real(p_min, "p_min")
        if p < 0:
            raise ValueError(f"p_min = {p} must be >= 0")
        params = ContextParams(n_ctx=n_ctx, n_seq_max=n_seq_max, kv_unified=True, type_k=type_k, type_v=type_v,
                               n_threads=n_threads)  # validates type_k / type_v / n_threads
        if isinstance(model, Model):
            check_vocab(target, model)
        else:
            check_vocab(target, ModelInfo.read(model))
            model = Model.load(model, n_threads=n_threads)
        if n_ctx == 0:
            n_train = model.hparams.n_ctx_train
            per_seq = min(n_train, DRAFT_N_CTX_MAX) if n_train > 0 else DRAFT_N_CTX_MAX
            params = dataclasses.replace(params, n_ctx=per_seq * n_seq_max)
        self.model = model
        self._ctx: Context | None = Context(model, params)
        self.p_min = p
        self.n_seq_max = n_seq_max
        self.n_ctx_seq = self._ctx.params.n_ctx_seq
        self._n_batch = self._ctx.params.n_batch
        self._n_swa = model.hparams.n_swa  # 0: no sliding-window layers
        self._held: list[np.ndarray] = [np.zeros(0, np.int32) for _ in range(n_seq_max)]
        self.stats = DraftStats()

    def __repr__(self) -> str:
        state = "closed" if self._ctx is None else f"n_ctx_seq={self.n_ctx_seq}"
        return f"DraftModel({self.model.path.name}, n_seq_max={self.n_seq_max}, {state}, p_min={self.p_min})"

    @property
    def ctx(self) -> Context:
        """The draft context.

        Raises:
            RuntimeError: the DraftModel is closed."""
        if self._ctx is None:
            raise RuntimeError("the DraftModel is closed")
        return self._ctx

    @property
    def closed(self) -> bool:
        return self._ctx is None

    # ---- the protocol --------------------------------------------------------------------------
    def held(self, key: int) -> list[int]:
        """The tokens the draft cache holds for key, in position order."""
        return self._held[checks.seq_id(key, self.n_seq_max, "key")].tolist()

    def draft(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """For each (key, tokens, n_max): up to n_max greedy tokens of the draft model to follow tokens.

        tokens is the target's sequence in position order (tokens[i] at position i); its last token is
        the one the target decodes next. A request whose tokens leave no room in the draft context, or
        whose decode finds no cell, gets [] or a shorter draft; nothing is raised for lack of room.

        Returns:
            One list of token ids per request, in order.

        Raises:
            RuntimeError: the DraftModel is closed.
            TypeError / ValueError: a malformed request (a key outside [0, n_seq_max) or repeated, empty
                tokens, a token outside the vocabulary, n_max < 0); nothing changed.
        """
        if self._ctx is None:
            raise RuntimeError("the DraftModel is closed")
        reqs = self._requests(seqs)
        t0 = time.perf_counter()
        for r in reqs:  # the draft's first token sits at position len(tokens): it must be in the context
            r.live = r.n_max > 0 and len(r.tokens) < self.n_ctx_seq
        active = [r for r in reqs if r.live]
        if active:
            self._sync(active)
            t1 = time.perf_counter()
            self._rounds([r for r in active if r.live])
            self.stats.rounds_s += time.perf_counter() - t1
        self.stats.n_calls += 1
        self.stats.n_drafted += sum(len(r.draft) for r in reqs)
        self.stats.draft_s += time.perf_counter() - t0
        return [r.draft for r in reqs]

    def release(self, key: int) -> None:
        """Forget what the draft cache holds for key (the target's sequence ended or was replaced)."""
        key = checks.seq_id(key, self.n_seq_max, "key")
        if self._ctx is not None:
            self._ctx.memory.seq_rm(key, -1, -1)
        self._held[key] = np.zeros(0, np.int32)

    def close(self) -> None:
        """Free the draft context (its cache); draft() raises afterwards, release() does nothing."""
        self._ctx = None
        self._held = [np.zeros(0, np.int32) for _ in range(self.n_seq_max)]

    # ---- the phases ----------------------------------------------------------------------------
    def _requests(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> list[_Request]:
        """The validated requests (nothing changes before every one passed)."""
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
            raise TypeError(f"seqs must be a sequence of (key, tokens, n_max), not {type(seqs).__name__}")
        reqs, keys = [], set()
        n_vocab = self.model.n_vocab
        for item in seqs:
            if not isinstance(item, tuple) or len(item) != 3:
                raise TypeError(f"each request is a tuple (key, tokens, n_max), not {item!r:.60}")
            key, tokens, n_max = item
            key = checks.seq_id(key, self.n_seq_max, "key")
            if key in keys:
                raise ValueError(f"key {key} appears twice in one draft() call")
            keys.add(key)
            n_max = checks.integer(n_max, "n_max")
            if n_max < 0:
                raise ValueError(f"n_max = {n_max} must be >= 0")
            if isinstance(tokens, (str, bytes)):
                raise TypeError("tokens must be token ids, not text")
            t = np.asarray(tokens)
            if t.ndim != 1 or t.size == 0 or not np.issubdtype(t.dtype, np.integer):
                raise ValueError(f"key {key}: tokens must be a non-empty 1-D sequence of token ids "
                                 f"(got shape {t.shape}, dtype {t.dtype})")
            if t.min() < 0 or t.max() >= n_vocab:
                raise ValueError(f"key {key}: a token outside the draft vocabulary [0, {n_vocab}): "
                                 f"{int(t.min())} .. {int(t.max())}")
            reqs.append(_Request(key, t.astype(np.int32), n_max))
        return reqs

    def _sync(self, reqs: list[_Request]) -> None:
        """Phase 1: keep each request's common prefix, decode the rest of its tokens (logits on the
        last). Without room for all at once, one request at a time; one that still does not fit stops
        with nothing drafted, cut back to its common prefix (so it holds no cell another could use)."""
        for r in reqs:
            held = self._held[r.key]
            m = min(len(held), len(r.tokens) - 1)
            diff = np.flatnonzero(held[:m] != r.tokens[:m])
            self._trim(r, int(diff[0]) if diff.size else m)
        try:
            self._decode_rest(reqs)
        except NoKVSlotError:
            for r in reqs:  # the chunks before the failure stay: take them out again
                self._trim(r, r.base)
            if len(reqs) == 1:
                reqs[0].live = False
                return
            for r in reqs:
                self._sync([r])

    def _trim(self, r: _Request, n: int) -> None:
        """Cut the request's sequence back to its first n tokens; r.base is what is left. All of them go
        when the memory cannot drop only the tail (a recurrent state outside its rollback window:
        seq_rm returns False) or when a sliding-window cache no longer holds the window of position n
        (its oldest position above n - n_swa, as llama-server's check before reusing a prompt)."""
        mem, held = self.ctx.memory, self._held[r.key]
        n = min(n, len(held))
        if n < len(held) and not mem.seq_rm(r.key, n, -1):
            n = 0
        if 0 < n and self._n_swa and mem.seq_pos_min(r.key) > max(0, n - self._n_swa):
            n = 0
        if n == 0:
            mem.seq_rm(r.key, -1, -1)
        self._held[r.key] = held[:n]
        r.base = n

    def _decode_rest(self, reqs: list[_Request]) -> None:
        """Decode tokens[len(held):] of every request, in chunks of n_batch tokens (one decode when
        they fit); held grows chunk by chunk, so it is exact even when a chunk fails.

        Raises:
            NoKVSlotError: a chunk found no cell (that chunk not decoded).
        """
        starts = [len(self._held[r.key]) for r in reqs]
        counts = np.array([len(r.tokens) - s for r, s in zip(reqs, starts)])
        toks = np.concatenate([r.tokens[s:] for r, s in zip(reqs, starts)])
        pos = np.concatenate([np.arange(s, len(r.tokens), dtype=np.int32) for r, s in zip(reqs, starts)])
        owner = np.repeat(np.arange(len(reqs)), counts)
        ends = np.cumsum(counts)
        want = np.zeros(len(toks), bool)
        want[ends - 1] = True
        seq = np.array([r.key for r in reqs], np.int32)[owner]
        nb = self._n_batch
        for s in range(0, len(toks), nb):
            e = min(s + nb, len(toks))
            self.ctx.decode(Batch(toks[s:e], pos=pos[s:e], seq_ids=seq[s:e], logits=want[s:e]))
            self.stats.n_decode += 1
            self.stats.n_synced += e - s
            logits = self.ctx.get_logits()
            for j, i in enumerate(np.flatnonzero(want[s:e]).tolist()):
                reqs[owner[s + i]].row = logits[j]
            for k in np.unique(owner[s:e]).tolist():  # its tokens in [ends - counts, ends) of toks
                r = reqs[k]
                done = min(e, int(ends[k])) - int(ends[k] - counts[k])
                self._held[r.key] = r.tokens[:starts[k] + done]

    def _rounds(self, live: list[_Request]) -> None:
        """Phase 2: greedy tokens, one decode per round for the requests that go on."""
        n_threads = self.ctx.n_threads
        while live:
            rows = np.stack([r.row for r in live])
            best = np.argmax(rows, axis=1)  # the first maximum: ties go to the lowest id
            lp, _, _ = rows_logprobs(rows, best, 0, n_threads=n_threads)
            keep = np.exp(lp.astype(np.float64)) >= self.p_min
            for r, tok, ok in zip(live, best.tolist(), keep.tolist()):
                if ok:
                    r.draft.append(tok)
                # the next draft would sit at position len(tokens) + len(draft)
                r.live = ok and len(r.draft) < r.n_max and len(r.tokens) + len(r.draft) < self.n_ctx_seq
            live = self._step([r for r in live if r.live])

    def _step(self, reqs: list[_Request]) -> list[_Request]:
        """Decode each request's last draft token (its logits become the request's row); the requests
        that found no cell stop. Returns the requests decoded."""
        if not reqs:
            return []
        batch = Batch([r.draft[-1] for r in reqs], pos=[len(r.tokens) + len(r.draft) - 1 for r in reqs],
                      seq_ids=[r.key for r in reqs], logits=[True] * len(reqs))
        try:
            self.ctx.decode(batch)
        except NoKVSlotError:
            if len(reqs) == 1:
                reqs[0].live = False
                return []
            return [r for r in reqs if self._step([r])]
        self.stats.n_decode += 1
        logits = self.ctx.get_logits()
        for j, r in enumerate(reqs):
            r.row = logits[j]
            self._held[r.key] = np.append(self._held[r.key], np.int32(r.draft[-1]))
        return reqs
