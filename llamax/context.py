"""llamax.Context: a model's decode loop over its memory (llama_context).

One decode runs one way, context -> batch -> memory -> model -> native:

    memory.update()                 pending stream copies and K-shifts
    balloc.init(batch, memory)      the context's batch allocator validates the batch (BatchError)
                                    and fills positions and outputs from the memory's positions
    memory.init_batch(balloc)       split into ubatches, reserve cells for all of them, roll back
                                    (NoKVSlotError, nothing changed)
    for i: mctx.apply(i)            ubatch i's cells are written, then model.forward(memory, ubatch):
                                    K/V stored in those cells, mask + attention over the cache in
                                    the native kernels, logits for the tokens that asked
                                    (params.embeddings: every token outputs its final hidden
                                    state after the output norm instead, get_embeddings)
    logits                          put back in batch order
Nothing mutates the cache but apply and the seq_* operations. If the forward pass itself fails,
the memory forgets the batch (Memory.forget_batch: its tokens removed again, as llama.cpp does; a
recurrent memory's states put back as they were).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from llamax import checks
from llamax import state as _state
from llamax.batch import Batch, BatchAllocator
from llamax.memory import Memory
from llamax.params import ContextParams

if TYPE_CHECKING:
    from llamax.model import Model

log = logging.getLogger("llamax")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[Context, _P], _R]) -> Callable[Concatenate[Context, _P], _R]:
    """Run a context's public method under the context's lock and its memory's (in that order), so a
    decode or a restore never interleaves with another thread's use of the context or the memory."""
    @functools.wraps(method)
    def run(self: Context, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.lock, self.memory.lock:
            return method(self, *args, **kwargs)
    run.locked = True  # type: ignore[attr-defined]  # read by tests/test_contracts.py; mypy has no function attributes
    return run


class Context:
    """A context over a model: its memory, its batch allocator and the decode loop.

    Every public method runs under the context's own lock (an RLock, `ctx.lock`) and its memory's:
    calls from several threads wait for each other.

    Args:
        model: a loaded llamax.Model.
        params: ContextParams (defaults when None); keyword overrides replace its fields.
    """

    def __init__(self, model: Model, params: ContextParams | None = None, **overrides: Any) -> None:
        p = params if params is not None else ContextParams()
        if overrides:
            p = dataclasses.replace(p, **overrides)
        self.lock = threading.RLock()
        self.model = model
        self._fingerprint = _state.fingerprint_bytes(model.fingerprint)
        self.params = p.derive(model.hparams.n_ctx_train)
        self.memory: Memory = model.create_memory(self.params)
        self.balloc = BatchAllocator(n_seq_max=self.memory.n_seq_max, n_vocab=model.n_vocab,
                                     n_batch=self.params.n_batch)
        self._clear_outputs()
        self.n_threads = self.params.n_threads_resolved

    def __repr__(self) -> str:
        p = self.params
        return (f"Context(n_ctx={p.n_ctx}, n_seq_max={p.n_seq_max}, unified={p.kv_unified}, "
                f"type_k={p.type_k}, type_v={p.type_v}, flash_attn={p.flash_attn})")

    @_locked
    def decode(self, batch: Batch) -> None:
        """Run the model on a batch (llama_decode).

        Raises:
            BatchError: invalid batch (memory unchanged).
            NoKVSlotError: the batch does not fit, after pending memory updates (memory unchanged).
        """
        if not isinstance(batch, Batch):
            raise TypeError(f"decode takes a llamax.Batch, not {type(batch).__name__}")
        embd = self.params.embeddings
        self.memory.update()  # llama_decode's optimize step: the retry after it would find the same cells
        self.balloc.init(batch, self.memory, output_all=embd)
        mctx = self.memory.init_batch(self.balloc, self.params.n_ubatch)
        rows = []
        try:
            for i in range(len(mctx)):
                ub = mctx.apply(i)
                rows.append(self.model.forward(self.memory, ub, embd=True) if embd
                            else self.model.forward(self.memory, ub))
        except BaseException:
            self._forget()
            raise
        finally:
            mctx.close()
        if len(rows) == 1:
            out = rows[0]
        else:
            width = self.model.hparams.n_embd if embd else self.model.n_vocab
            out = np.concatenate(rows) if rows else np.zeros((0, width), np.float32)
        if self.balloc.n_outputs > 1:   # (one row is in batch order: a decode step's common case)
            perm = self.balloc.output_reorder()
            if np.any(perm != np.arange(perm.size)):  # outputs left batch order (split_equal)
                out = out[perm]
        if embd:
            self._clear_outputs()
            self._embd = out
        else:
            self._logits = out
            self._row_of = self.balloc.output_ids()

    def _forget(self) -> None:
        """Undo the batch in the memory after a failed forward pass (Memory.forget_batch)."""
        self.memory.forget_batch(self.balloc)
        self._clear_outputs()

    def _clear_outputs(self) -> None:
        self._logits = np.zeros((0, self.model.n_vocab), np.float32)
        self._row_of = np.zeros(0, np.int32)  # batch index -> row of _logits, -1 without logits
        self._embd = np.zeros((0, self.model.hparams.n_embd), np.float32)  # embeddings: one row per batch token

    @_locked
    def get_logits(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab]: the logits of the last decode's outputs, in batch order."""
        return self._logits

    @_locked
    def get_embeddings(self) -> np.ndarray:
        """float32 [n_tokens, n_embd]: with params.embeddings, every token of the last decode's final
        hidden state after the output norm, in batch order (llama_get_embeddings, pooling none); empty
        otherwise. An embeddings context outputs no logits."""
        return self._embd

    @_locked
    def get_logits_ith(self, i: int) -> np.ndarray:
        """float32 [n_vocab]: the logits of batch token i (negative counts from the end).

        Raises:
            TypeError: i is not an integer.
            IndexError: i is outside the batch or its token did not ask for logits.
        """
        i = checks.integer(i, "i")
        n = self._row_of.shape[0]
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"token {i} outside the last batch of {n} tokens")
        r = int(self._row_of[j])
        if r < 0:
            raise IndexError(f"token {i} of the last batch did not ask for logits")
        return self._logits[r]

    # ---- state (llama_state_*; the framing is in llamax/state.py) -------------------------------
    def _writer(self, seq_id: int) -> tuple[_state.StateWriter, int]:
        """(writer, kind): the whole state (outputs + memory) or one sequence's."""
        if seq_id == -1:
            return _state.writer(self.memory, -1, (self._logits, self._row_of)), _state.KIND_CONTEXT
        seq_id = checks.seq_id(seq_id, self.memory.n_seq_max, "seq_id")
        return _state.writer(self.memory, seq_id), _state.KIND_SEQ

    def _restore(self, data: bytes | bytearray | memoryview | _state.StateFile, seq_id: int, *,
                 exact: bool = False) -> int:
        kind = _state.KIND_CONTEXT if seq_id < 0 else _state.KIND_SEQ
        try:
            n, outputs = _state.restore(self.memory, data, seq_id, kind=kind, exact=exact,
                                        fingerprint=self.fingerprint, n_vocab=self.model.n_vocab)
        except BaseException:
            if seq_id < 0:
                self._clear_outputs()
            raise
        if outputs is not None:
            self._logits, self._row_of = outputs
        return n

    def _load(self, path: str | os.PathLike[str], seq_id: int) -> list[int]:
        """Restore a state file: its headers are checked against its length first, then the blob is
        read from the file as the memory asks for it. A file that cannot be opened (OSError) changes
        nothing, as in llama.cpp; on any other failure the destination is left empty."""
        try:
            f = _state.open_file(path)
        except OSError:
            raise
        except BaseException:
            _state.empty(self.memory, seq_id)
            if seq_id < 0:
                self._clear_outputs()
            raise
        with f:
            self._restore(f, seq_id)
        return f.tokens

    @property
    def fingerprint(self) -> bytes:
        """The 16 bytes naming the model in every state this context writes, which state_set_data /
        state_seq_set_data and the load_file methods check (blake2b-128 of model.fingerprint).
        A constant of the context."""
        return self._fingerprint


    @_locked
    def state_get_data(self) -> bytes:
        """The whole state (llama_state_get_data): the memory and the last decode's outputs, so that
        get_logits() works again after state_set_data. Pending K-shifts are applied first.

        Complexity: one copy of every saved K/V byte (cells the sliding window hides are skipped)."""
        w, kind = self._writer(-1)
        return w.getvalue(kind, self.fingerprint)

    @_locked
    def state_get_size(self) -> int:
        """Bytes state_get_data would return now (llama_state_get_size). O(cells), nothing copied."""
        w, _ = self._writer(-1)
        return w.size

    @_locked
    def state_get_data_into(self, out: bytearray | memoryview | np.ndarray) -> int:
        """Write the whole state at the start of a writable buffer (llama_state_get_data into the
        caller's dst): the same bytes as state_get_data, without a new object's fresh pages (a
        buffer kept across saves is filled at memcpy speed). Returns the bytes written.

        Raises:
            ValueError: out is read-only or shorter than the state (state_get_size); nothing is written.
        """
        w, kind = self._writer(-1)
        return w.write_into(out, kind, self.fingerprint)

    @_locked
    def state_set_data(self, data: bytes | bytearray | memoryview) -> int:
        """Restore a state_get_data blob (llama_state_set_data); returns the bytes read (bytes after
        the blob are not read). Every cell goes back to its own index, so the next decode gives the
        same logits bit for bit.

        Raises:
            StateError: truncated, corrupt, another model's or another cache configuration's state;
                the memory is then cleared and there are no logits (never half-written).
        """
        return self._restore(data, -1)

    @_locked
    def state_save_file(self, path: str | os.PathLike, tokens: Iterable[int]) -> None:
        """Write the whole state and the tokens it holds to a file (llama_state_save_file): a new file
        next to path, renamed over it.

        Raises:
            StateError: path exists and is not a regular file (a directory, a symbolic link, a FIFO,
                a device); nothing is written.
        """
        w, kind = self._writer(-1)
        _state.save_file(path, tokens, w.parts(kind, self.fingerprint))

    @_locked
    def state_load_file(self, path: str | os.PathLike) -> list[int]:
        """Restore the whole state from a state_save_file file; returns its tokens.

        Raises:
            StateError: as state_set_data, or a file that is not exactly one valid state (sizes are
                checked against the file's length before its body is read), or not a regular file.
            OSError: the file cannot be opened (nothing changes, as in llama.cpp) or read.
            On any other failure the memory is cleared and there are no logits.
        """
        return self._load(path, -1)

    @_locked
    def state_seq_get_data(self, seq_id: int) -> bytes:
        """The cells of one sequence (llama_state_seq_get_data), written as that sequence alone."""
        w, kind = self._writer(seq_id)
        return w.getvalue(kind, self.fingerprint)

    @_locked
    def state_seq_get_size(self, seq_id: int) -> int:
        """Bytes state_seq_get_data(seq_id) would return now (llama_state_seq_get_size)."""
        w, _ = self._writer(seq_id)
        return w.size

    @_locked
    def state_seq_get_data_into(self, out: bytearray | memoryview | np.ndarray, seq_id: int) -> int:
        """Write one sequence's state at the start of a writable buffer (llama_state_seq_get_data
        into the caller's dst); returns the bytes written. As state_get_data_into."""
        w, kind = self._writer(seq_id)
        return w.write_into(out, kind, self.fingerprint)

    @_locked
    def state_seq_set_data(self, data: bytes | bytearray | memoryview, dest_seq_id: int) -> int:
        """Restore a state_seq_get_data blob as sequence dest_seq_id (llama_state_seq_set_data): the
        sequence is removed, then its saved cells are placed as a ubatch would be (contiguous cells
        when there are, else any free ones). Returns the bytes read.

        Raises:
            ValueError: dest_seq_id outside [0, n_seq_max) (nothing changes).
            StateError: a bad blob, or no room for its cells; dest_seq_id is left empty and nothing
                else changes.
        """
        return self._restore(data, checks.seq_id(dest_seq_id, self.memory.n_seq_max, "dest_seq_id"))

    @_locked
    def state_seq_save_file(self, path: str | os.PathLike, seq_id: int, tokens: Iterable[int]) -> None:
        """Write one sequence's state and its tokens to a file (llama_state_seq_save_file); refuses
        a path as state_save_file does."""
        w, kind = self._writer(seq_id)
        _state.save_file(path, tokens, w.parts(kind, self.fingerprint))

    @_locked
    def state_seq_load_file(self, path: str | os.PathLike, dest_seq_id: int) -> list[int]:
        """Restore a state_seq_save_file file into dest_seq_id; returns its tokens.

        Raises:
            StateError, OSError: as state_load_file; dest_seq_id is then left empty (unless the file
                could not be opened: then nothing changes).
        """
        return self._load(path, checks.seq_id(dest_seq_id, self.memory.n_seq_max, "dest_seq_id"))
