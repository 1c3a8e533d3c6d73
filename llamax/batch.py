"""Batches: llama_batch, llama_batch_allocr and llama_ubatch.

A `Batch` is what the user hands to decode(): tokens, optional positions, the sequences of each
token and which tokens want an output. The `BatchAllocator` (llama_batch_allocr) validates it
against the vocabulary, n_seq_max, n_batch and the memory, fills the missing positions and
outputs, then splits it into `UBatch`es (llama_ubatch), the units the memory places and the
model computes:

    split_simple(n)        consecutive tokens in batch order, up to n       (one KV stream)
    split_equal(n, seq)    equal-length runs of non-overlapping sequence sets (one stream per
                           sequence: sequential=True; iSWA fallback: False)
    split_seq(n)           one chain of nested sequence sets per ubatch      (embeddings / all
                           outputs with several streams)

Everything is stored as numpy arrays; a token's sequences are a 256-bit set (4 x uint64 words,
bit s of word s // 64), the layout of csrc/common.h's lx_seq_bits. Validation and splitting are
vectorized; the only per-token Python loops are in the rare cases that need them (a ragged
seq_ids list, filling positions of tokens that belong to several sequences).

Differences from llama.cpp, on purpose:
  * errors raise `BatchError` naming the token, the value and the rule, instead of returning false;
  * "positions of a sequence decreasing inside the batch" is enforced (llama.cpp documents the
    rule but its check never fires: its running position is never updated), and negative
    positions are refused (a cell with position -1 reads as empty);
  * llama.cpp's "incompatible sequence sets" check cannot fail as written (the running
    intersection always keeps the sequence itself) and is not reproduced;
  * no embedding input, no M-RoPE (n_pos_per_embd == 1), no backend-sampling checks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from llamax.dtypes import LLAMA_MAX_SEQ, POS_MAX, SEQ_WORDS, seq_mask
from llamax.errors import BatchError

__all__ = ["Batch", "BatchAllocator", "UBatch", "MemoryPositions", "LLAMA_MAX_SEQ", "SEQ_WORDS"]

logger = logging.getLogger("llamax")


_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1
_ONE_U64 = np.uint64(1)


class MemoryPositions(Protocol):
    """What the allocator asks of the memory: the position range each sequence holds."""

    def seq_pos_min(self, seq_id: int) -> int:  # -1 when the sequence is empty
        ...

    def seq_pos_max(self, seq_id: int) -> int:  # -1 when the sequence is empty
        ...


# ----------------------------------------------------------------------------------------------
# bitset helpers


def _bits_from_pairs(n: int, tok: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """uint64[n, 4] bitsets with bit seq[k] set in row tok[k]. Rows may repeat in tok."""
    bits = np.zeros((n, SEQ_WORDS), dtype=np.uint64)
    word = seq >> 6
    bit = np.left_shift(_ONE_U64, (seq & 63).astype(np.uint64))
    if tok.size == n and (n == 0 or np.array_equal(tok, np.arange(n))):
        bits[tok, word] = bit
    else:
        np.bitwise_or.at(bits, (tok, word), bit)
    return bits


def _bits_to_ids(words: np.ndarray) -> np.ndarray:
    """The ascending sequence ids set in one bitset (uint64[4]) -> int32[k]."""
    b = np.unpackbits(np.ascontiguousarray(words, dtype="<u8").view(np.uint8), bitorder="little")
    return np.flatnonzero(b).astype(np.int32)


def _bits_to_pairs(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token index, seq id) of every set bit of uint64[n, 4], token-major, seq ascending."""
    n = bits.shape[0]
    b = np.unpackbits(
        np.ascontiguousarray(bits, dtype="<u8").view(np.uint8).reshape(n, SEQ_WORDS * 8),
        axis=1,
        bitorder="little",
    )
    tok, seq = np.nonzero(b)
    return tok.astype(np.int64), seq.astype(np.int32)


def _row_to_int(row: np.ndarray) -> int:
    """A uint64[4] bitset as a Python int (bit s = sequence s), for fast set algebra."""
    v = 0
    for w in range(SEQ_WORDS - 1, -1, -1):
        v = (v << 64) | int(row[w])
    return v


# ----------------------------------------------------------------------------------------------
# input conversion


def _as_int32(x: Any, name: str) -> np.ndarray:
    """A 1-D int32 copy of x. Raises BatchError for ragged, non-integer or out-of-int32 input."""
    try:
        a = np.asarray(x)
    except ValueError as e:  # ragged nested lists
        raise BatchError(f"{name} must be a flat sequence of ints: {e}") from None
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise BatchError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int32)
    if a.dtype.kind not in "iu":
        raise BatchError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.dtype.itemsize > 4 or a.dtype == np.uint32:
        if isinstance(x, list) and len(x) <= 32:
            lo, hi = min(x), max(x)
        else:
            lo, hi = int(a.min()), int(a.max())
        if lo < _I32_MIN or hi > _I32_MAX:
            i = int(np.argmax((a < _I32_MIN) | (a > _I32_MAX)))
            raise BatchError(f"{name}[{i}] = {int(a[i])} does not fit in int32")
    return a.astype(np.int32)  # always a copy


def _check_pos_room(seq_id: int, p0: int, n: int) -> None:
    """n filled positions from p0 on must stay below POS_MAX."""
    if p0 + n - 1 >= POS_MAX:
        raise BatchError(f"sequence {seq_id} continues at position {p0}: its {n} tokens would reach position "
                         f"{p0 + n - 1}, beyond the largest position {POS_MAX - 1}")


def _is_int_scalar(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_seq_range(seq: np.ndarray, tok: np.ndarray) -> None:
    bad = (seq < 0) | (seq >= LLAMA_MAX_SEQ)
    if bad.any():
        k = int(np.argmax(bad))
        raise BatchError(
            f"token {int(tok[k])}: seq_id {int(seq[k])} is outside [0, {LLAMA_MAX_SEQ})"
        )


def _parse_seq_ids(seq_ids: Any, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """-> (primary seq int32[n], n_seq_id int32[n], bits uint64[n, 4], some token in several seqs)."""
    if seq_ids is None:
        seq_ids = 0
    elif isinstance(seq_ids, np.ndarray) and seq_ids.ndim == 0 and seq_ids.dtype.kind in "iu":
        seq_ids = int(seq_ids)
    if _is_int_scalar(seq_ids):
        s = int(seq_ids)
        if not 0 <= s < LLAMA_MAX_SEQ:
            raise BatchError(f"seq_ids = {s}: seq ids must be in [0, {LLAMA_MAX_SEQ})")
        primary = np.full(n, s, dtype=np.int32)
        bits = np.empty((n, SEQ_WORDS), dtype=np.uint64)
        bits[:] = seq_mask(s)
        return primary, np.ones(n, dtype=np.int32), bits, False

    a: np.ndarray | None
    try:
        a = np.asarray(seq_ids)
    except ValueError:  # ragged nested lists
        a = None
    if a is not None:
        if a.dtype == object:
            a = None
        elif a.size == 0 and a.ndim == 1:
            a = a.astype(np.int64)
        elif a.dtype.kind not in "iu":
            raise BatchError(f"seq_ids must hold integers, got dtype {a.dtype}")
        elif a.ndim not in (1, 2):
            raise BatchError(f"seq_ids must be 1-D or 2-D, got shape {a.shape}")

    if a is not None:  # a 1-D or 2-D integer array
        if a.shape[0] != n:
            raise BatchError(f"seq_ids has {a.shape[0]} entries for {n} tokens")
        if a.ndim == 1:
            seq = a.astype(np.int64)
            tok = np.arange(n)
            _check_seq_range(seq, tok)
            seq = seq.astype(np.int32)
            return seq, np.ones(n, dtype=np.int32), _bits_from_pairs(n, tok, seq), False
        k = a.shape[1]
        if k == 0:
            raise BatchError("token 0 has no sequence (seq_ids rows are empty)")
        seq2 = a.astype(np.int64)
        tok2 = np.repeat(np.arange(n), k)
        _check_seq_range(seq2.ravel(), tok2)
        if k > 1:
            srt = np.sort(seq2, axis=1)
            dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
            if dup.any():
                i = int(np.argmax(dup))
                raise BatchError(f"token {i}: seq_ids {seq2[i].tolist()} lists a sequence twice")
        primary = seq2[:, 0].astype(np.int32)
        bits = _bits_from_pairs(n, tok2, seq2.ravel().astype(np.int32))
        return primary, np.full(n, k, dtype=np.int32), bits, k > 1

    # ragged: per token an int or an iterable of ints
    try:
        items = list(seq_ids)
    except TypeError:
        raise BatchError(f"seq_ids must be an int or a sequence, got {type(seq_ids).__name__}") from None
    if len(items) != n:
        raise BatchError(f"seq_ids has {len(items)} entries for {n} tokens")
    toks: list[int] = []
    seqs: list[int] = []
    primary = np.empty(n, dtype=np.int32)
    counts = np.empty(n, dtype=np.int32)
    for i, e in enumerate(items):
        if _is_int_scalar(e):
            lst = [int(e)]
        else:
            try:
                lst = list(e)
            except TypeError:
                raise BatchError(f"token {i}: seq_ids entry {e!r} is not an int or a list of ints") from None
            if not lst:
                raise BatchError(f"token {i} has no sequence (empty seq_ids entry)")
            if not all(_is_int_scalar(v) for v in lst):
                raise BatchError(f"token {i}: seq_ids entry {e!r} holds a non-integer")
            lst = [int(v) for v in lst]
            if len(set(lst)) != len(lst):
                raise BatchError(f"token {i}: seq_ids {lst} lists a sequence twice")
        for s in lst:
            if not 0 <= s < LLAMA_MAX_SEQ:
                raise BatchError(f"token {i}: seq_id {s} is outside [0, {LLAMA_MAX_SEQ})")
        primary[i] = lst[0]
        counts[i] = len(lst)
        toks.extend([i] * len(lst))
        seqs.extend(lst)
    bits = _bits_from_pairs(n, np.asarray(toks, dtype=np.int64), np.asarray(seqs, dtype=np.int32))
    return primary, counts, bits, bool(n and int(counts.max()) > 1)


# ----------------------------------------------------------------------------------------------
# Batch


class Batch:
    """A batch of tokens for decode() (llama_batch).

    Args:
        tokens: token ids (a list, a 1-D integer array, or one int for a 1-token batch).
        pos: the position of each token, or None to continue every sequence where the memory
            ends (seq_pos_max + 1, then +1 per token of that sequence).
        seq_ids: per token an int or a list of ints (the token belongs to each listed sequence;
            the first one is its primary sequence); one int for every token; a 1-D int array
            (one sequence per token) or a 2-D int array [n_tokens, k]. Default: sequence 0.
        logits: per token a bool, True when the token wants an output (logits). None: only the
            last token (every token for embeddings).

    Attributes (numpy arrays, read-only):
        token: int32[n]; pos: int32[n] or None; seq_id: int32[n] (primary sequence);
        n_seq_id: int32[n]; seq_bits: uint64[n, 4] (every sequence of each token, as a bitset);
        logits: bool[n] or None.

    Raises:
        BatchError: ragged input, lengths that disagree, non-integer values, a seq id outside
            [0, 256), a token with no sequence or listing one twice.
    """

    __slots__ = ("token", "pos", "seq_id", "n_seq_id", "seq_bits", "logits", "multi_seq")

    def __init__(
        self,
        tokens: Any,
        pos: Any = None,
        seq_ids: Any = None,
        logits: Any = None,
    ) -> None:
        token = _as_int32(tokens, "tokens")
        n = token.shape[0]
        if pos is not None:
            p = _as_int32(pos, "pos")
            if p.shape[0] != n:
                raise BatchError(f"pos has {p.shape[0]} entries for {n} tokens")
        else:
            p = None
        primary, n_seq_id, bits, multi = _parse_seq_ids(seq_ids, n)
        if logits is not None:
            try:
                lg = np.asarray(logits)
            except ValueError as e:
                raise BatchError(f"logits must be a flat sequence of bools: {e}") from None
            if lg.ndim != 1 or lg.shape[0] != n:
                raise BatchError(f"logits has shape {lg.shape} for {n} tokens")
            if lg.dtype == np.bool_:
                lg = lg.copy()
            elif lg.dtype.kind in "iu" or (lg.size == 0):
                lg = lg != 0
            else:
                raise BatchError(f"logits must hold bools, got dtype {lg.dtype}")
        else:
            lg = None
        # read-only: an allocator keeps references to these arrays after init()
        for arr in (token, p, primary, n_seq_id, bits, lg):
            if arr is not None:
                arr.flags.writeable = False
        self.token: np.ndarray = token
        self.pos: np.ndarray | None = p
        self.seq_id: np.ndarray = primary
        self.n_seq_id: np.ndarray = n_seq_id
        self.seq_bits: np.ndarray = bits
        self.logits: np.ndarray | None = lg
        self.multi_seq: bool = multi

    @classmethod
    def one(cls, tokens: Any, seq_id: int = 0) -> Batch:
        """All tokens for one sequence, positions from the memory, logits on the last token."""
        return cls(tokens, seq_ids=seq_id)

    @property
    def n_tokens(self) -> int:
        return int(self.token.shape[0])

    def __len__(self) -> int:
        return int(self.token.shape[0])

    def seq_ids_of(self, i: int) -> list[int]:
        """The sequences of token i, ascending."""
        return _bits_to_ids(self.seq_bits[i]).tolist()

    def __repr__(self) -> str:
        n = self.n_tokens
        head = self.token[:8].tolist()
        more = ", ..." if n > 8 else ""
        return (
            f"Batch(n_tokens={n}, tokens={head}{more}, pos={'memory' if self.pos is None else 'given'}, "
            f"seqs={_bits_to_ids(np.bitwise_or.reduce(self.seq_bits, axis=0)).tolist() if n else []}, "
            f"logits={'last' if self.logits is None else int(self.logits.sum())})"
        )


# ----------------------------------------------------------------------------------------------
# UBatch


@dataclass(eq=False)
class UBatch:
    """One micro-batch (llama_ubatch): the tokens the memory places and the model computes together.

    n_tokens == n_seq_tokens * n_seqs. For split_simple, n_seqs == n_tokens (one "virtual
    sequence" per token) and equal_seqs is False. For split_equal, the tokens are grouped by
    sequence set: tokens [s*n_seq_tokens, (s+1)*n_seq_tokens) belong to the s-th set; with
    sequential=True every set is one sequence and the s-th is seq_id_unq[s]. For split_seq,
    n_seqs == 1.

    Arrays (numpy, C-contiguous, owned by this ubatch):
        token: int32[n_tokens]; pos: int32[n_tokens]; n_seq_id: int32[n_tokens]
        seq_id: int32[n_tokens]       primary sequence of each token (llama.cpp's seq_id[i][0])
        seq_bits: uint64[n_tokens, 4] every sequence of each token (bit s of word s // 64)
        seq_id_unq: int32[n_seqs_unq] the distinct sequence ids in the ubatch, ascending
        seq_idx: int32[256]           seq id -> index in seq_id_unq, -1 if absent
        output: bool[n_tokens]        the token wants an output row
        idx: int32[n_tokens]          index of each token in the original Batch
    """

    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    n_seqs_unq: int
    equal_seqs: bool
    token: np.ndarray
    pos: np.ndarray
    n_seq_id: np.ndarray
    seq_id: np.ndarray
    seq_bits: np.ndarray
    seq_id_unq: np.ndarray
    seq_idx: np.ndarray
    output: np.ndarray
    idx: np.ndarray

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.output))

    @classmethod
    def reserve(cls, n_seq_tokens: int, n_seqs: int) -> UBatch:
        """A well-formed ubatch of n_seq_tokens * n_seqs tokens to fill in (llama.cpp's ubatch_reserve).

        token and pos are 0, every token is in sequence 0 only (n_seq_id 1, seq_bits bit 0),
        seq_id_unq = [0, n_seqs), seq_idx[s] = s for s < n_seqs, no outputs, idx = -1. Used to
        build a placement record that is not from a user batch (e.g. state restore).
        """
        if n_seq_tokens < 0 or n_seqs < 1 or n_seqs > LLAMA_MAX_SEQ:
            raise ValueError(f"ubatch_reserve({n_seq_tokens}, {n_seqs}): bad sizes")
        n = n_seq_tokens * n_seqs
        bits = np.empty((n, SEQ_WORDS), dtype=np.uint64)
        bits[:] = seq_mask(0)
        seq_idx = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int32)
        seq_idx[:n_seqs] = np.arange(n_seqs, dtype=np.int32)
        return cls(
            n_tokens=n,
            n_seq_tokens=n_seq_tokens,
            n_seqs=n_seqs,
            n_seqs_unq=n_seqs,
            equal_seqs=True,
            token=np.zeros(n, dtype=np.int32),
            pos=np.zeros(n, dtype=np.int32),
            n_seq_id=np.ones(n, dtype=np.int32),
            seq_id=np.zeros(n, dtype=np.int32),
            seq_bits=bits,
            seq_id_unq=np.arange(n_seqs, dtype=np.int32),
            seq_idx=seq_idx,
            output=np.zeros(n, dtype=np.bool_),
            idx=np.full(n, -1, dtype=np.int32),
        )

    @classmethod
    def of_sequence(cls, seq_id: int, pos: np.ndarray, token: np.ndarray) -> UBatch:
        """The tokens of one sequence at the given positions as a one-sequence ubatch, no outputs:
        the placement record for cells that come from elsewhere than a user batch (a state restore),
        so they are placed by the same find_slot / apply_ubatch a decode uses."""
        if not 0 <= seq_id < LLAMA_MAX_SEQ:
            raise ValueError(f"seq_id {seq_id} outside [0, {LLAMA_MAX_SEQ})")
        ub = cls.reserve(len(pos), 1)
        ub.pos[:] = pos
        ub.token[:] = token
        ub.seq_id[:] = seq_id
        ub.seq_bits[:] = seq_mask(seq_id)
        ub.seq_id_unq[:] = seq_id
        ub.seq_idx[:] = -1
        ub.seq_idx[seq_id] = 0
        return ub

    def __repr__(self) -> str:
        return (
            f"UBatch(n_tokens={self.n_tokens}, n_seq_tokens={self.n_seq_tokens}, n_seqs={self.n_seqs}, "
            f"equal_seqs={self.equal_seqs}, seq_id_unq={self.seq_id_unq.tolist()}, "
            f"n_outputs={self.n_outputs})"
        )


# ----------------------------------------------------------------------------------------------
# the stages of BatchAllocator.init (each only reads; the allocator commits at the end)


class _SeqRanges(NamedTuple):
    """Each sequence's position range in the batch (the ends of llama.cpp's seq_pos sets)."""

    seqs: np.ndarray     # int32[k]: the batch's sequences, ascending
    pos_min: np.ndarray  # int32[k]
    pos_max: np.ndarray  # int32[k]


class _MemoryEnds:
    """The last position of each sequence in the memory (-1: empty, or no memory), asked once per
    sequence."""

    __slots__ = ("memory", "_last")

    def __init__(self, memory: MemoryPositions | None) -> None:
        self.memory = memory
        self._last: dict[int, int] = {}

    def last(self, s: int) -> int:
        x = self._last.get(s)
        if x is None:
            x = int(self.memory.seq_pos_max(s)) if self.memory is not None else -1
            self._last[s] = x
        return x


def _check_size(n: int, n_batch: int | None) -> None:
    """Stage: at least one token, at most n_batch."""
    if n == 0:
        raise BatchError("empty batch: a batch needs at least one token (n_tokens == 0)")
    if n_batch is not None and n > n_batch:
        raise BatchError(f"the batch has {n} tokens, more than n_batch = {n_batch}: split it or raise n_batch")


def _check_tokens(token: np.ndarray, n_vocab: int | None) -> None:
    """Stage: every token id in [0, n_vocab) (n_vocab None: >= 0)."""
    if token.shape[0] == 1:  # the generation step, without array temporaries
        t = int(token[0])
        i = 0 if t < 0 or (n_vocab is not None and t >= n_vocab) else -1
    else:
        bad = token < 0 if n_vocab is None else (token < 0) | (token >= n_vocab)
        i = int(np.argmax(bad)) if bad.any() else -1
    if i >= 0:
        hi = n_vocab if n_vocab is not None else "inf"
        raise BatchError(f"invalid token[{i}] = {int(token[i])}: token ids must be in [0, {hi})")


def _check_seq_ids(batch: Batch, n_seq_max: int) -> None:
    """Stage: every sequence of every token in [0, n_seq_max) (Batch already keeps them below 256)."""
    if n_seq_max >= LLAMA_MAX_SEQ:
        return
    if batch.multi_seq:
        over = (batch.seq_bits & seq_mask(range(n_seq_max, LLAMA_MAX_SEQ))).any(axis=1)
        i = int(np.argmax(over)) if over.any() else -1
    elif batch.n_tokens == 1:
        i = 0 if int(batch.seq_id[0]) >= n_seq_max else -1
    else:
        over = batch.seq_id >= n_seq_max
        i = int(np.argmax(over)) if over.any() else -1
    if i >= 0:
        ids = _bits_to_ids(batch.seq_bits[i])
        raise BatchError(f"invalid seq_id[{i}] = {int(ids[ids >= n_seq_max][0])}: seq ids must be in "
                         f"[0, n_seq_max = {n_seq_max})")


def _fill_positions(batch: Batch, ends: _MemoryEnds) -> tuple[np.ndarray, _SeqRanges | None]:
    """Stage: the batch's positions, those it has or, missing, each sequence's continuing the memory's
    last (llama.cpp's auto-generated positions); with the sequences' ranges when the filling
    guarantees every position rule (tokens of one sequence each), else None: check them."""
    if batch.pos is not None:
        return batch.pos, None
    n, seq = batch.n_tokens, batch.seq_id
    if _one_seq(batch):
        s0 = int(seq[0])
        p0 = ends.last(s0) + 1
        _check_pos_room(s0, p0, n)
        return (np.arange(p0, p0 + n, dtype=np.int32),
                _SeqRanges(seq[:1], np.array([p0], dtype=np.int32), np.array([p0 + n - 1], dtype=np.int32)))
    if not batch.multi_seq:
        runs = _seq_runs(seq)
        p0s = np.array([ends.last(s) + 1 for s in runs.seqs.tolist()], dtype=np.int64)
        for s, p, c in zip(runs.seqs.tolist(), p0s.tolist(), runs.counts.tolist()):
            _check_pos_room(s, p, c)
        rank = np.arange(n) - np.repeat(runs.starts, runs.counts)
        pos = np.empty(n, dtype=np.int32)
        pos[runs.order] = np.repeat(p0s, runs.counts) + rank
        return pos, _SeqRanges(runs.seqs, p0s.astype(np.int32), (p0s + runs.counts - 1).astype(np.int32))
    # llama.cpp: pos[i] = p0[primary]; then every sequence of the token continues at pos[i] + 1
    pair_tok, pair_seq = _token_seq_pairs(batch)
    p0d = {s: ends.last(s) + 1 for s in np.unique(pair_seq).tolist()}
    members = np.split(pair_seq, np.flatnonzero(np.diff(pair_tok)) + 1)
    seq_l = seq.tolist()
    pos_l = [0] * n
    for i in range(n):
        p = p0d[seq_l[i]]
        if p >= POS_MAX:
            raise BatchError(f"token {i}: its position {p} (after the memory's and the batch's "
                             f"earlier tokens) is beyond the largest position {POS_MAX - 1}")
        pos_l[i] = p
        for s in members[i].tolist():
            p0d[s] = p + 1
    return np.asarray(pos_l, dtype=np.int32), None


def _fill_outputs(batch: Batch, output_all: bool) -> np.ndarray:
    """Stage: which tokens want an output: the batch's logits, by default the last token only;
    every token for output_all (a batch that said otherwise is overridden, with llama.cpp's warning)."""
    n = batch.n_tokens
    if batch.logits is None:
        if output_all:
            return np.ones(n, dtype=np.bool_)
        output = np.zeros(n, dtype=np.bool_)
        output[-1] = True
        return output
    if output_all and not batch.logits.all():
        logger.warning("init: embeddings required but some input tokens were not marked as outputs -> overriding")
        return np.ones(n, dtype=np.bool_)
    return batch.logits


def _check_positions(batch: Batch, pos: np.ndarray, ends: _MemoryEnds, memory: MemoryPositions | None) -> _SeqRanges:
    """Stage: positions that the batch gave (or that were filled for tokens of several sequences)
    obey every rule, in llama.cpp's order: in [0, POS_MAX); per sequence, the first one continues the
    memory (Y = X + 1) and none is missing up to the last; sequences coupled by a token hold the same
    range in the memory; no sequence's positions decrease in batch order. Returns the ranges."""
    _check_pos_range(pos)
    pair_tok, pair_seq = _token_seq_pairs(batch)
    runs = _seq_runs(pair_seq, one_seq=_one_seq(batch))  # each sequence's pairs in batch order
    tok = pair_tok[runs.order]
    sp = pos[tok]
    back = (sp[1:] < sp[:-1]) & ~runs.first[1:]  # a sequence's position below its previous one
    if back.any():  # an error, raised last: the ranges from a sort by position meanwhile
        by_pos = _seq_runs(pair_seq, pos[pair_tok])
        ranges, n_distinct = _ranges_of(by_pos, pos[pair_tok[by_pos.order]])
    else:
        ranges, n_distinct = _ranges_of(runs, sp)
    _check_continuing(ranges, n_distinct, ends, pos, pair_tok, pair_seq)
    if batch.multi_seq and memory is not None:
        _check_coupled(pair_tok, pair_seq, batch.seq_id, memory)
    if back.any():
        j = int(np.flatnonzero(back)[np.argmin(tok[1:][back])])  # the earliest token that goes back
        raise BatchError(
            f"token {int(tok[j + 1])}: sequence {int(pair_seq[runs.order[j + 1]])} positions are decreasing "
            f"inside the batch ({int(sp[j])} then {int(sp[j + 1])}; not allowed)"
        )
    return ranges


def _check_pos_range(pos: np.ndarray) -> None:
    """Every position in [0, POS_MAX) (a negative one would read as an empty cell)."""
    lo, hi = (int(pos[0]),) * 2 if pos.shape[0] == 1 else (int(pos.min()), int(pos.max()))
    if lo < 0:
        i = int(np.argmax(pos < 0))
        raise BatchError(f"token {i}: position {int(pos[i])} is negative (positions must be >= 0)")
    if hi >= POS_MAX:
        i = int(np.argmax(pos >= POS_MAX))
        raise BatchError(f"token {i}: position {int(pos[i])} is beyond the largest position "
                         f"{POS_MAX - 1} (positions lie in [0, {POS_MAX}))")


def _check_continuing(ranges: _SeqRanges, n_distinct: np.ndarray, ends: _MemoryEnds, pos: np.ndarray,
                      pair_tok: np.ndarray, pair_seq: np.ndarray) -> None:
    """Each sequence of the batch starts right after its last position in the memory (Y = X + 1, when
    the memory holds it) and has every position from its first to its last. O(k) plus the error's search."""
    for k, s in enumerate(ranges.seqs.tolist()):
        y, last = int(ranges.pos_min[k]), int(ranges.pos_max[k])
        x = ends.last(s)
        if x >= 0 and y != x + 1:
            i = int(pair_tok[np.argmax((pair_seq == s) & (pos[pair_tok] == y))])
            raise BatchError(
                f"token {i}: the tokens of sequence {s} start at position Y = {y}, but the "
                f"last position stored in the memory for sequence {s} is X = {x}; the "
                "positions must stay consecutive: Y = X + 1"
            )
        if last - y + 1 > int(n_distinct[k]):
            i, missing = _first_gap(pair_tok, pair_seq, pos, s)
            raise BatchError(
                f"token {i}: sequence {s} positions are not continuous inside the batch "
                f"(position {missing} is missing before position {int(pos[i])})"
            )


def _check_coupled(pair_tok: np.ndarray, pair_seq: np.ndarray, seq: np.ndarray, memory: MemoryPositions) -> None:
    """Sequences coupled by a token (a non-primary sequence s1 of a token whose primary is s0) must
    hold the same range in the memory."""
    prim = seq[pair_tok]
    sel = pair_seq != prim
    s1 = pair_seq[sel].astype(np.int64)
    s0 = prim[sel].astype(np.int64)
    t = pair_tok[sel]
    if s1.size == 0:
        return
    key = s1 * LLAMA_MAX_SEQ + s0
    ukey, first = np.unique(key, return_index=True)
    cache: dict[int, tuple[int, int]] = {}

    def rng(s: int) -> tuple[int, int]:
        r = cache.get(s)
        if r is None:
            r = (int(memory.seq_pos_min(s)), int(memory.seq_pos_max(s)))
            cache[s] = r
        return r

    for kk, f in zip(ukey.tolist(), first.tolist()):
        a, b = divmod(kk, LLAMA_MAX_SEQ)
        ra, rb = rng(a), rng(b)
        if ra != rb:
            raise BatchError(
                f"token {int(t[f])}: sequence {a} is coupled to {b} in the input batch, but they "
                f"have diverged in the memory (positions [{ra[0]}, {ra[1]}] vs [{rb[0]}, {rb[1]}])"
            )


class _SeqRuns(NamedTuple):
    """(token, sequence) pairs grouped by sequence: `order` lists the pairs run after run, one run
    per sequence, sequences ascending; inside a run, pairs in batch order (or by position)."""

    order: np.ndarray    # int64[m]: pair indices, run after run
    seqs: np.ndarray     # int32[k]: the sequence of each run, ascending
    starts: np.ndarray   # int64[k]: where each run starts in order
    counts: np.ndarray   # int64[k]: pairs in each run
    first: np.ndarray    # bool[m]: order[j] is the first pair of its run


def _seq_runs(pair_seq: np.ndarray, pair_pos: np.ndarray | None = None, *, one_seq: bool = False) -> _SeqRuns:
    """The runs of the pairs' sequences: a stable sort by sequence, or by (sequence, position) when
    pair_pos is given; one_seq says every pair has the same sequence (no sort). O(m log m)."""
    m = pair_seq.shape[0]
    if one_seq:
        first = np.zeros(m, dtype=np.bool_)
        first[0] = True
        return _SeqRuns(np.arange(m), pair_seq[:1], np.zeros(1, dtype=np.int64), np.array([m]), first)
    if pair_pos is None:
        order = np.argsort(pair_seq, kind="stable")
    else:
        order = np.lexsort((pair_pos, pair_seq))
    ss = pair_seq[order]
    edge = np.empty(m + 1, dtype=np.bool_)  # a run starts at j (j < m); m closes the last one
    edge[0] = edge[m] = True
    np.not_equal(ss[1:], ss[:-1], out=edge[1:m])
    bounds = np.flatnonzero(edge)
    starts = bounds[:-1]
    return _SeqRuns(order, ss[starts], starts, bounds[1:] - starts, edge[:m])


def _ranges_of(runs: _SeqRuns, sp: np.ndarray) -> tuple[_SeqRanges, np.ndarray]:
    """Each run's (first, last) position and its count of distinct positions (int64[k]), for runs whose
    positions sp (in run order) do not decrease."""
    distinct = runs.first.copy()
    distinct[1:] |= sp[1:] != sp[:-1]
    return (_SeqRanges(runs.seqs, sp[runs.starts], sp[runs.starts + runs.counts - 1]),
            np.add.reduceat(distinct.astype(np.int64), runs.starts))


def _first_gap(pair_tok: np.ndarray, pair_seq: np.ndarray, pos: np.ndarray, s: int) -> tuple[int, int]:
    """(first token after the first hole of sequence s's positions, the missing position)."""
    toks = pair_tok[pair_seq == s]
    u = np.unique(pos[toks])
    j = int(np.flatnonzero(np.diff(u) > 1)[0])
    missing = int(u[j]) + 1
    after = int(u[j + 1])
    i = int(toks[np.argmax(pos[toks] == after)])
    return i, missing


def _token_seq_pairs(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(token index int64[m], seq id int32[m]): every sequence of every token, token-major."""
    if batch.multi_seq:
        return _bits_to_pairs(batch.seq_bits)
    return np.arange(batch.n_tokens), batch.seq_id


def _one_seq(batch: Batch) -> bool:
    """Every token belongs to the same one sequence."""
    seq = batch.seq_id
    return not batch.multi_seq and (seq.shape[0] == 1 or bool((seq == seq[0]).all()))


# ----------------------------------------------------------------------------------------------
# BatchAllocator

_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_ROW_0 = np.zeros(1, dtype=np.int32)
_ROW_0.flags.writeable = False


class BatchAllocator:
    """Validates a Batch and splits it into UBatches (llama_batch_allocr).

    One allocator lives in a context and is reused for every decode: `init()` replaces the
    current batch (or raises and keeps the previous state), `split_reset()` starts a new
    splitting pass, `split_*` return the next ubatch or None when every token is used.

    Args:
        n_seq_max: sequence ids must be in [0, n_seq_max) (a context passes 256 when its cache
            is unified, as llama.cpp does, else its n_seq_max).
        n_vocab: token ids must be in [0, n_vocab); None only refuses negative ids.
        n_batch: the most tokens a batch may hold; None for no limit.
        n_embd: kept for llama.cpp parity (embedding input is not supported).
    """

    def __init__(
        self,
        n_seq_max: int = 1,
        n_vocab: int | None = None,
        n_batch: int | None = None,
        n_embd: int = 0,
    ) -> None:
        if not 1 <= int(n_seq_max) <= LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max = {n_seq_max} is outside [1, {LLAMA_MAX_SEQ}]")
        if n_vocab is not None and int(n_vocab) < 1:
            raise ValueError(f"n_vocab = {n_vocab} must be >= 1")
        if n_batch is not None and int(n_batch) < 1:
            raise ValueError(f"n_batch = {n_batch} must be >= 1")
        self.n_seq_max = int(n_seq_max)
        self.n_vocab = None if n_vocab is None else int(n_vocab)
        self.n_batch = None if n_batch is None else int(n_batch)
        self.n_embd = int(n_embd)
        self._set_empty()

    # ---- state ---------------------------------------------------------------------------

    def _set_empty(self) -> None:
        self._batch: Batch | None = None
        self._n = 0
        self._token = _EMPTY_I32
        self._pos = _EMPTY_I32
        self._seq_id = _EMPTY_I32
        self._n_seq_id = _EMPTY_I32
        self._seq_bits = np.zeros((0, SEQ_WORDS), dtype=np.uint64)
        self._output = np.zeros(0, dtype=np.bool_)
        self._n_outputs = 0
        self._multi = False
        self._seq_pos_min = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int32)
        self._seq_pos_max = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int32)
        self._seq_id_unq = _EMPTY_I32
        self._groups: _Groups | None = None
        self._used = np.zeros(0, dtype=np.bool_)
        self._n_used = 0
        self._out_ids: list[np.ndarray] = []

    @property
    def batch(self) -> Batch | None:
        """The batch of the last successful init()."""
        return self._batch

    @property
    def n_tokens(self) -> int:
        return self._n

    @property
    def n_used(self) -> int:
        """Tokens already put in a ubatch since the last split_reset()."""
        return self._n_used

    @property
    def n_outputs(self) -> int:
        """Tokens of the batch that want an output."""
        return self._n_outputs

    @property
    def has_cpl(self) -> bool:
        """Some token belongs to several sequences (llama.cpp: the batch has coupled sequences)."""
        return self._multi

    @property
    def token(self) -> np.ndarray:
        """int32[n_tokens] of the validated batch."""
        return self._token

    @property
    def pos(self) -> np.ndarray:
        """int32[n_tokens]: the positions, filled from the memory when the batch had none."""
        return self._pos

    @property
    def output(self) -> np.ndarray:
        """bool[n_tokens]: the tokens that want an output (defaults applied)."""
        return self._output

    @property
    def seq_id_unq(self) -> np.ndarray:
        """int32: the distinct sequence ids of the batch, ascending."""
        return self._seq_id_unq

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of seq_id in the batch, -1 if the batch does not hold it."""
        return int(self._seq_pos_min[seq_id])

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id in the batch, -1 if the batch does not hold it."""
        return int(self._seq_pos_max[seq_id])

    # ---- outputs back in batch order ----------------------------------------------------------

    @property
    def out_ids(self) -> np.ndarray:
        """int32[n]: the batch index of each output row, in the order the ubatches produced them
        since split_reset() (llama.cpp's out_ids). Row r of the ubatch-ordered output buffer is
        the output of token out_ids[r]."""
        if not self._out_ids:
            return _EMPTY_I32
        if len(self._out_ids) > 1:
            self._out_ids = [np.concatenate(self._out_ids)]
        return self._out_ids[0]

    def output_reorder(self) -> np.ndarray:
        """int64[n_outputs] permutation putting the ubatch-ordered output rows in batch order:
        ``rows_in_batch_order = rows[perm]`` (llama.cpp applies the same order with swaps)."""
        return np.argsort(self.out_ids, kind="stable")

    def output_ids(self) -> np.ndarray:
        """int32[n_tokens]: the row of each token in the batch-ordered outputs, -1 when the token
        has no output (llama.cpp's output_ids after reordering; what get_logits_ith(i) reads). Read-only
        for a batch of one token with an output (one shared array)."""
        if self._n == 1 and self._n_outputs == 1:   # a decode step: a shared read-only [0]
            return _ROW_0
        res = np.full(self._n, -1, dtype=np.int32)
        res[self._output] = np.arange(self._n_outputs, dtype=np.int32)
        return res

    # ---- init ----------------------------------------------------------------------------

    def init(
        self,
        batch: Batch,
        memory: MemoryPositions | None = None,
        *,
        output_all: bool = False,
        n_seq_max: int | None = None,
    ) -> None:
        """Validate `batch`, fill its positions and outputs, and make it the current batch.

        The stages, in llama_batch_allocr::init's order; each raises before anything changes and only
        the last one writes the allocator:

            _check_size         not empty, at most n_batch tokens
            _check_tokens       token ids in [0, n_vocab)
            _check_seq_ids      sequence ids in [0, n_seq_max)
            _fill_positions     missing positions continue each sequence of the memory
            _fill_outputs       the tokens that want an output
            _check_positions    positions not filled one sequence at a time: in range; per sequence
                                continuing the memory (Y = X + 1), without holes, never decreasing;
                                coupled sequences alike in the memory
            _commit             the batch becomes the current one

        Args:
            batch: the input batch.
            memory: the memory the batch continues (duck-typed: seq_pos_min(s), seq_pos_max(s),
                -1 for an empty sequence); None when there is none (positions then start at 0).
            output_all: every token is an output (embeddings); a batch that set logits with some
                False is overridden with a warning, as llama.cpp does.
            n_seq_max: overrides the allocator's n_seq_max for this batch.

        Raises:
            BatchError: with the offending token index, value and rule: an empty batch, more
                than n_batch tokens, a token id outside [0, n_vocab), a seq id outside
                [0, n_seq_max), a position outside [0, POS_MAX) (given, or filled from the memory),
                the first position Y of a sequence that the
                memory holds (last position X) not equal to X + 1, positions of a sequence that
                are not continuous or decrease inside the batch, sequences coupled by a shared
                token whose ranges in the memory differ. On failure the allocator keeps its
                previous state; the memory is only read.

        Complexity: O(n log n) numpy work, plus one memory query per sequence in the batch; a
        Python loop over tokens only to fill positions of tokens in several sequences.
        """
        if not isinstance(batch, Batch):
            raise TypeError(f"expected a llamax.Batch, got {type(batch).__name__}")
        nsm = self.n_seq_max if n_seq_max is None else int(n_seq_max)
        if not 1 <= nsm <= LLAMA_MAX_SEQ:
            raise BatchError(f"n_seq_max = {nsm} is outside [1, {LLAMA_MAX_SEQ}]")
        _check_size(batch.n_tokens, self.n_batch)
        _check_tokens(batch.token, self.n_vocab)
        _check_seq_ids(batch, nsm)
        ends = _MemoryEnds(memory)
        pos, ranges = _fill_positions(batch, ends)
        output = _fill_outputs(batch, output_all)
        if ranges is None:  # positions given, or filled for tokens of several sequences
            ranges = _check_positions(batch, pos, ends, memory)
        self._commit(batch, pos, output, ranges)

    def _commit(self, batch: Batch, pos: np.ndarray, output: np.ndarray, ranges: _SeqRanges) -> None:
        """init()'s last stage, the only one that writes: the checked batch becomes the current one,
        every token unused."""
        self._batch = batch
        self._n = batch.n_tokens
        self._token = batch.token
        self._pos = pos
        self._seq_id = batch.seq_id
        self._n_seq_id = batch.n_seq_id
        self._seq_bits = batch.seq_bits
        self._output = output
        self._n_outputs = int(np.count_nonzero(output))
        self._multi = batch.multi_seq
        old, new = self._seq_id_unq, ranges.seqs  # the old batch's sequences out, the new one's in
        if old.size == 1 and new.size == 1:  # the generation step: scalar stores
            self._seq_pos_min[int(old[0])] = self._seq_pos_max[int(old[0])] = -1
            self._seq_pos_min[int(new[0])], self._seq_pos_max[int(new[0])] = ranges.pos_min[0], ranges.pos_max[0]
        else:
            self._seq_pos_min[old] = self._seq_pos_max[old] = -1
            self._seq_pos_min[new], self._seq_pos_max[new] = ranges.pos_min, ranges.pos_max
        self._seq_id_unq = new
        self._groups = None
        self.split_reset()

    # ---- splitting -----------------------------------------------------------------------

    def split_reset(self) -> None:
        """Start a new splitting pass: every token unused, out_ids cleared."""
        self._used = np.zeros(self._n, dtype=np.bool_)
        self._n_used = 0
        self._out_ids = []

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        """The next up to n_ubatch tokens in batch order, from the first unused one.

        Returns a ubatch with n_seqs == n_tokens, n_seq_tokens == 1, equal_seqs False, or None
        when every token is used. O(n).
        """
        n_ubatch = _check_n_ubatch(n_ubatch)
        return self._take_run(n_ubatch, one_sequence=False)

    def _take_run(self, n_ubatch: int, *, one_sequence: bool) -> UBatch | None:
        """The next up to n_ubatch tokens in batch order, from the first unused one: split_simple's
        ubatch, or (one_sequence) the same tokens as one sequence of n_tokens, split_equal's."""
        n = self._n
        if self._n_used == 0:
            cur = 0
        else:
            if self._used.all():
                return None
            cur = int(np.argmin(self._used))
        if cur >= n:
            return None
        end = min(n, cur + n_ubatch)
        self._used[cur:end] = True
        self._n_used += end - cur
        return self._ubatch_add(slice(cur, end), 1 if one_sequence else end - cur, one_sequence)

    def split_equal(self, n_ubatch: int, sequential: bool = False) -> UBatch | None:
        """The next ubatch of equal-length runs of non-overlapping sequence sets.

        Sets are picked in the order of their first unused token, skipping a set that shares a
        sequence with one already picked (with sequential=True, only the sequence right after
        the last picked one is accepted: seq ids s, s+1, s+2, ...); picking stops after
        n_ubatch + 1 sets (llama.cpp's bound, so a ubatch can hold n_ubatch + 1 single tokens).
        Each set then gives its next k unused tokens, k = min(max(1, n_ubatch // n_seqs),
        fewest tokens left in a picked set); the ubatch is the concatenation of the runs, set
        by set.

        A batch of one sequence takes its next min(n_ubatch, left) tokens in order directly (the same
        ubatch, without grouping the batch: the generation step of a recurrent memory).

        Returns None when every token is used, or (logged as an error, as llama.cpp does) when
        sequential=True and some token belongs to several sequences.
        """
        n_ubatch = _check_n_ubatch(n_ubatch)
        if sequential and self._multi:
            logger.error(
                "split_equal: sequential split is not supported when there are coupled sequences "
                "in the input batch (you may need to use a unified KV cache)"
            )
            return None
        if self._n_used >= self._n:
            return None
        if not self._multi and self._seq_id_unq.size == 1:
            # one sequence: its next k = min(n_ubatch, left) tokens in order, without grouping the batch
            return self._take_run(n_ubatch, one_sequence=True)
        g = self._ensure_groups()
        unused = np.flatnonzero(~self._used)
        if unused.size == 0:
            return None

        gid_u = g.gid[unused]
        # first unused token of every group that still has one
        grp, first_pos = np.unique(gid_u, return_index=True)
        first_tok = unused[first_pos]

        # a set's tokens are always taken from its first unused one (the used ones of a set are
        # a prefix of its tokens: every split takes them in batch order)
        first_of = dict(zip(grp.tolist(), first_tok.tolist()))
        chosen: list[int] = []
        chosen_first: list[int] = []
        if sequential:
            # every token is in exactly one sequence: group <-> sequence. The scan accepts the
            # sequence right after the last accepted one at its first unused token that comes
            # after the token where the last one was accepted.
            i0 = int(unused[0])
            gcur = int(g.gid[i0])
            chosen.append(gcur)
            scan = i0
            while len(chosen) <= n_ubatch:
                nxt = int(g.seq[gcur]) + 1
                if nxt >= LLAMA_MAX_SEQ:
                    break
                gn = int(g.seq_to_group[nxt])
                if gn < 0 or gn not in first_of:
                    break
                toks = g.tokens[gn]
                j = max(
                    int(np.searchsorted(toks, scan, side="right")),
                    int(np.searchsorted(toks, first_of[gn])),
                )
                if j >= toks.size:
                    break
                scan = int(toks[j])
                gcur = gn
                chosen.append(gn)
            chosen_first = [first_of[gi] for gi in chosen]
        else:
            o = np.argsort(first_tok, kind="stable")
            union = 0
            masks = g.masks
            for gi, ft in zip(grp[o].tolist(), first_tok[o].tolist()):
                m = masks[gi]
                if m & union:
                    continue
                union |= m
                chosen.append(gi)
                chosen_first.append(ft)
                if len(chosen) > n_ubatch:
                    break

        n_seqs = len(chosen)
        cursors = [int(np.searchsorted(g.tokens[gi], ft)) for gi, ft in zip(chosen, chosen_first)]
        left = min(g.tokens[gi].size - c for gi, c in zip(chosen, cursors))
        k = min(max(1, n_ubatch // n_seqs), left)
        idx = np.concatenate([g.tokens[gi][c : c + k] for gi, c in zip(chosen, cursors)])
        self._used[idx] = True
        self._n_used += idx.size
        return self._ubatch_add(idx, n_seqs, True)

    def split_seq(self, n_ubatch: int) -> UBatch | None:
        """The next ubatch of one chain of nested sequence sets.

        Starts at the first unused token with its set S; then takes, in batch order, every
        unused token whose set is a subset of S, S becoming the set of each token taken (so it
        can only shrink), up to n_ubatch tokens. n_seqs == 1. None when every token is used.
        """
        n_ubatch = _check_n_ubatch(n_ubatch)
        if self._n_used >= self._n:
            return None
        used = self._used
        cur = int(np.argmin(used))
        if used[cur]:
            return None
        g = self._ensure_groups()
        gid = g.gid
        n = self._n
        picks = [np.array([cur], dtype=np.int64)]
        taken = 1
        used[cur] = True
        G = int(gid[cur])
        while taken < n_ubatch and cur + 1 < n:
            rest = np.arange(cur + 1, n)
            ok = ~used[cur + 1 :] & g.subset_of(G)[gid[cur + 1 :]]
            cand = rest[ok]
            if cand.size == 0:
                break
            g0 = int(gid[cand[0]])
            if g0 != G:
                G = g0
            diff = np.flatnonzero(gid[cand] != G)
            run = int(diff[0]) if diff.size else cand.size
            run = min(run, n_ubatch - taken)
            take = cand[:run]
            used[take] = True
            picks.append(take)
            taken += run
            cur = int(take[-1])
        idx = np.concatenate(picks) if len(picks) > 1 else picks[0]
        self._n_used += idx.size
        return self._ubatch_add(idx, 1, True)

    # ---- internals -------------------------------------------------------------------------

    def _ensure_groups(self) -> _Groups:
        if self._groups is None:
            self._groups = _Groups.build(self._seq_id, self._seq_bits, self._multi)
        return self._groups

    def _ubatch_add(self, sel: slice | np.ndarray, n_seqs: int, equal_seqs: bool) -> UBatch:
        """Gather the tokens `sel` (a slice of the batch, or batch indices in ubatch order) into a
        UBatch (llama.cpp's ubatch_add); records their outputs in out_ids."""
        if isinstance(sel, slice):
            idx32 = np.arange(sel.start, sel.stop, dtype=np.int32)
            token = self._token[sel].copy()
            pos = self._pos[sel].copy()
            n_seq_id = self._n_seq_id[sel].copy()
            seq_id = self._seq_id[sel].copy()
            bits = self._seq_bits[sel].copy()
            output = self._output[sel].copy()
        else:
            idx32 = sel.astype(np.int32)
            token = self._token[sel]
            pos = self._pos[sel]
            n_seq_id = self._n_seq_id[sel]
            seq_id = self._seq_id[sel]
            bits = self._seq_bits[sel]
            output = self._output[sel]
        n_tokens = int(idx32.size)
        assert n_tokens % n_seqs == 0
        seq_idx = np.empty(LLAMA_MAX_SEQ, dtype=np.int32)
        seq_idx.fill(-1)
        if not self._multi:
            if n_tokens == 1 or (seq_id == seq_id[0]).all():
                seq_id_unq = seq_id[:1].copy()
            else:
                seq_id_unq = np.unique(seq_id)
        else:
            seq_id_unq = _bits_to_ids(np.bitwise_or.reduce(bits, axis=0))
        n_unq = int(seq_id_unq.size)
        if n_unq == 1:
            seq_idx[int(seq_id_unq[0])] = 0
        else:
            seq_idx[seq_id_unq] = np.arange(n_unq, dtype=np.int32)
        if n_tokens == 1:
            if output[0]:
                self._out_ids.append(idx32)
        else:
            self._out_ids.append(idx32[output])
        return UBatch(
            n_tokens=n_tokens,
            n_seq_tokens=n_tokens // n_seqs,
            n_seqs=n_seqs,
            n_seqs_unq=n_unq,
            equal_seqs=equal_seqs,
            token=token,
            pos=pos,
            n_seq_id=n_seq_id,
            seq_id=seq_id,
            seq_bits=bits,
            seq_id_unq=seq_id_unq,
            seq_idx=seq_idx,
            output=output,
            idx=idx32,
        )


def _check_n_ubatch(n_ubatch: int) -> int:
    n_ubatch = int(n_ubatch)
    if n_ubatch < 1:
        raise ValueError(f"n_ubatch = {n_ubatch} must be >= 1")
    return n_ubatch


class _Groups:
    """The distinct sequence sets of a batch (llama.cpp's seq_set_map), built on first use.

    gid: int32[n] group of each token; tokens[g]: ascending batch indices of group g;
    masks[g]: the set as a Python int; seq[g]: the primary sequence of group g's first token;
    seq_to_group: int32[256], for single-sequence batches, the group of each sequence (-1).
    """

    __slots__ = ("gid", "tokens", "masks", "seq", "seq_to_group", "_sub_cache")
    gid: np.ndarray
    tokens: list[np.ndarray]
    masks: list[int]
    seq: np.ndarray
    seq_to_group: np.ndarray

    def __init__(self) -> None:
        self._sub_cache: dict[int, np.ndarray] = {}

    @classmethod
    def build(cls, seq_id: np.ndarray, bits: np.ndarray, multi: bool) -> _Groups:
        self = cls()
        n = seq_id.shape[0]
        if not multi:
            keys, gid = np.unique(seq_id, return_inverse=True)
            self.seq = keys.astype(np.int32)
            self.masks = [1 << int(s) for s in keys.tolist()]
            self.seq_to_group = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int32)
            self.seq_to_group[keys] = np.arange(keys.size, dtype=np.int32)
        else:
            rows = np.ascontiguousarray(bits).view(np.dtype((np.void, 8 * SEQ_WORDS))).ravel()
            _, first, gid = np.unique(rows, return_index=True, return_inverse=True)
            self.seq = seq_id[first].astype(np.int32)
            self.masks = [_row_to_int(bits[f]) for f in first.tolist()]
            self.seq_to_group = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int32)
        gid = gid.reshape(n).astype(np.int32)
        self.gid = gid
        order = np.argsort(gid, kind="stable")
        counts = np.bincount(gid, minlength=len(self.masks))
        self.tokens = np.split(order, np.cumsum(counts)[:-1])
        return self

    def subset_of(self, g: int) -> np.ndarray:
        """bool[n_groups]: which groups' sets are subsets of group g's set."""
        r = self._sub_cache.get(g)
        if r is None:
            mg = self.masks[g]
            r = np.fromiter(((m & mg) == m for m in self.masks), dtype=np.bool_, count=len(self.masks))
            self._sub_cache[g] = r
        return r
