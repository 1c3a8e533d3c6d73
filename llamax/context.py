"""llamax.Context: a model's decode loop over its memory (llama_context).

decode(batch):
    memory.plan(batch)      validate (BatchError), fill positions, split into ubatches, reserve cells
                            for all of them without changing anything (prepare + rollback);
                            NoKVSlotError -> one memory update (optimize) and one retry
    for ubatch in plan:     apply the ubatch to the cells, run the model: K/V written into the cache,
                            mask + attention over the cache, logits for the tokens that asked
    logits                  put back in batch order
Nothing mutates the cache but the plan's application and the seq_* operations. If the forward pass
itself fails, the tokens of the batch are removed from the memory again, as llama.cpp does.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable

import numpy as np

from llamax import state as _state
from llamax.batch import Batch
from llamax.errors import NoKVSlotError
from llamax.memory import KVCache, KVCacheISWA, Memory
from llamax.params import ContextParams
from llamax.rope import RoPE

log = logging.getLogger("llamax")


def make_memory(hp, params: ContextParams) -> Memory:
    """The memory a model gets for these (derived) parameters (llama_model::create_memory)."""
    common = dict(head_dim_v=hp.n_embd_head_v, n_seq_max=params.n_seq_max, unified=params.kv_unified,
                  type_k=params.type_k, type_v=params.type_v, v_trans=not params.flash_attn,
                  n_threads=params.n_threads)
    rope = RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_kind)
    if hp.n_swa > 0 and hp.swa_layers:
        rope_swa = RoPE(hp.n_rot, hp.rope_freq_base_swa, hp.rope_freq_scale_swa, hp.rope_kind)
        return KVCacheISWA(hp.n_layer, hp.n_head_kv, hp.n_embd_head_k, params.n_ctx_seq, swa_layers=hp.swa_layers,
                           n_swa=hp.n_swa, swa_type=hp.swa_type, swa_full=params.swa_full, n_ubatch=params.n_ubatch,
                           rope=rope, rope_swa=rope_swa, **common)
    return KVCache(hp.n_layer, hp.n_head_kv, hp.n_embd_head_k, params.n_ctx_seq, rope=rope, **common)


class Context:
    """A context over a model: its memory and the decode loop.

    Args:
        model: a loaded llamax.Model.
        params: ContextParams (defaults when None); keyword overrides replace its fields.
    """

    def __init__(self, model, params: ContextParams | None = None, **overrides) -> None:
        p = params if params is not None else ContextParams()
        if overrides:
            p = dataclasses.replace(p, **overrides)
        self.model = model
        self.params = p.derive(model.hparams.n_ctx_train)
        self.memory = make_memory(model.hparams, self.params)
        self._logits = np.zeros((0, model.n_vocab), np.float32)
        self._row_of = np.zeros(0, np.int32)  # batch index -> row of _logits, -1 without logits
        self.n_threads = self.params.n_threads_resolved

    def __repr__(self) -> str:
        p = self.params
        return (f"Context(n_ctx={p.n_ctx}, n_seq_max={p.n_seq_max}, unified={p.kv_unified}, "
                f"type_k={p.type_k}, type_v={p.type_v}, flash_attn={p.flash_attn})")

    def _plan(self, batch: Batch):
        kw = dict(n_ubatch=self.params.n_ubatch, n_vocab=self.model.n_vocab, n_batch=self.params.n_batch)
        try:
            return self.memory.plan(batch, **kw)
        except NoKVSlotError:
            # llama_decode's one optimize retry: apply pending memory updates, then try again
            self.memory.update()
            return self.memory.plan(batch, **kw)

    def decode(self, batch: Batch) -> None:
        """Run the model on a batch (llama_decode).

        Raises:
            BatchError: invalid batch (memory unchanged).
            NoKVSlotError: the batch does not fit, even after one retry (memory unchanged).
        """
        if not isinstance(batch, Batch):
            raise TypeError(f"decode takes a llamax.Batch, not {type(batch).__name__}")
        plan = self._plan(batch)
        rows = []
        try:
            for ub in plan:
                rows.append(self.model.impl.forward(self.memory, ub))
        except BaseException:
            self._forget(plan)
            raise
        if len(rows) == 1:
            logits = rows[0]
        else:
            logits = np.concatenate(rows) if rows else np.zeros((0, self.model.n_vocab), np.float32)
        perm = plan.balloc.output_reorder()
        if perm.size and np.any(perm != np.arange(perm.size)):  # outputs left batch order (split_equal)
            logits = logits[perm]
        self._logits = logits
        self._row_of = plan.balloc.output_ids()

    def _forget(self, plan) -> None:
        """Remove the batch's tokens from the memory after a failed forward pass."""
        b = plan.balloc
        for s in b.seq_id_unq:
            lo = b.seq_pos_min(int(s))
            if lo >= 0:
                self.memory.seq_rm(int(s), lo, -1)

    def get_logits(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab]: the logits of the last decode's outputs, in batch order."""
        return self._logits

    def get_logits_ith(self, i: int) -> np.ndarray:
        """float32 [n_vocab]: the logits of batch token i (negative counts from the end).

        Raises:
            IndexError: i is outside the batch or its token did not ask for logits.
        """
        n = self._row_of.shape[0]
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"token {i} outside the last batch of {n} tokens")
        r = int(self._row_of[j])
        if r < 0:
            raise IndexError(f"token {i} of the last batch did not ask for logits")
        return self._logits[r]

    # ---- state (llama_state_*; the format is in llamax/state.py) --------------------------------
    def state_get_data(self) -> bytes:
        """The whole state (llama_state_get_data): the memory and the last decode's outputs, so that
        get_logits() works again after state_set_data. Pending K-shifts are applied first.

        Complexity: one copy of every saved K/V byte (cells the sliding window hides are skipped)."""
        return _state.context_get_data(self)

    def state_set_data(self, data) -> int:
        """Restore a state_get_data blob (llama_state_set_data); returns the bytes read (bytes after
        the blob are not read). Every cell goes back to its own index, so the next decode gives the
        same logits bit for bit.

        Raises:
            StateError: truncated, corrupt, another model's or another cache configuration's state;
                the memory is then cleared and there are no logits (never half-written).
        """
        return _state.context_set_data(self, data)

    def state_save_file(self, path: str | os.PathLike, tokens: Iterable[int]) -> None:
        """Write the whole state and the tokens it holds to a file (llama_state_save_file)."""
        _state.context_save_file(self, path, tokens)

    def state_load_file(self, path: str | os.PathLike) -> list[int]:
        """Restore the whole state from a state_save_file file; returns its tokens.

        Raises:
            StateError: as state_set_data, or a file that is not exactly one valid state.
        """
        return _state.context_load_file(self, path)

    def state_seq_get_data(self, seq_id: int) -> bytes:
        """The cells of one sequence (llama_state_seq_get_data), written as that sequence alone."""
        return _state.context_get_data(self, seq_id)

    def state_seq_set_data(self, data, dest_seq_id: int) -> int:
        """Restore a state_seq_get_data blob as sequence dest_seq_id (llama_state_seq_set_data): the
        sequence is removed, then its saved cells are placed as a ubatch would be (contiguous cells
        when there are, else any free ones). Returns the bytes read.

        Raises:
            ValueError: dest_seq_id outside [0, n_seq_max) (nothing changes).
            StateError: a bad blob, or no room for its cells; dest_seq_id is left empty and nothing
                else changes.
        """
        return _state.context_set_data(self, data, dest_seq_id)

    def state_seq_save_file(self, path: str | os.PathLike, seq_id: int, tokens: Iterable[int]) -> None:
        """Write one sequence's state and its tokens to a file (llama_state_seq_save_file)."""
        _state.context_save_file(self, path, tokens, seq_id)

    def state_seq_load_file(self, path: str | os.PathLike, dest_seq_id: int) -> list[int]:
        """Restore a state_seq_save_file file into dest_seq_id; returns its tokens."""
        return _state.context_load_file(self, path, dest_seq_id)
