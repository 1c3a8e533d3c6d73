"""Context parameters: llama_context_params and the derivations of llama_context's constructor.

`ContextParams` holds what the user asks for; `ContextParams.derive(n_ctx_train)` returns the
values the context really uses, derived the way llama.cpp's `llama_context` constructor does:

    n_ctx     = n_ctx or n_ctx_train
    n_batch   = min(n_ctx, n_batch)          (causal attention only; uses n_ctx before padding)
    n_ubatch  = min(n_batch, n_ubatch or n_batch)
    n_ctx     = pad256(n_ctx)
    unified:      n_ctx_seq = n_ctx                              n_stream = 1
    not unified:  n_ctx_seq = pad256(n_ctx // n_seq_max)         n_stream = n_seq_max
                  n_ctx     = n_ctx_seq * n_seq_max   (warned when it changes)

Log lines go to the ``llamax`` logger with llama.cpp's wording and levels.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from llamax import checks
from llamax.dtypes import LLAMA_MAX_SEQ, N_CTX_PAD, POS_MAX, QUANTIZED_CACHE_TYPES, check_cache_type, pad
from llamax.threads import resolve_n_threads

__all__ = ["ContextParams", "resolve_n_threads"]

logger = logging.getLogger("llamax")



#: the largest n_ctx / n_batch / n_ubatch: positions are int32 below POS_MAX, so no context needs more
#: cells than that (rounded down to the n_ctx padding)
SIZE_MAX = POS_MAX // N_CTX_PAD * N_CTX_PAD


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    """value as an int in [lo, hi] (numpy integers welcome); TypeError / ValueError otherwise."""
    v = checks.integer(value, name)
    if not lo <= v <= hi:
        raise ValueError(f"{name} = {v} is outside [{lo}, {hi}]")
    return v


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class ContextParams:
    """The parameters of a context (llama_context_params), validated on creation.

    Fields are what the user asked for until `derive()` is called; the derived instance holds
    what the context uses (`ctx.params`), with `n_ctx_seq` set (0 means "not derived yet").

    Attributes:
        n_ctx: total KV cells (0: the model's n_ctx_train). Padded to 256 by `derive()`.
        n_batch: most tokens one decode() call accepts (logical batch), >= 1.
        n_ubatch: most tokens per compute step (physical micro-batch); 0 means n_batch.
        n_seq_max: number of sequences, in [1, 256].
        kv_unified: one cache shared by every sequence (one stream), else one stream per sequence.
        type_k, type_v: cache element types, one of llamax.dtypes.CACHE_TYPES.
        flash_attn: flash attention (V stored untransposed); a quantized V cache requires it.
        swa_full: give the SWA cache of an iSWA model the full size.
        n_threads: None / -1 for all cores, else a positive count (see resolve_n_threads).
        embeddings: every decode outputs each token's final hidden state after the output norm
            (Context.get_embeddings) instead of logits (llama_context_params.embeddings).
        n_ctx_seq: cells per sequence (stream), set by derive(); 0 before.

    Raises (on creation):
        ValueError: a value out of range, an unknown cache type, or a quantized type_v without
            flash_attn (llama.cpp refuses: "quantized V cache requires flash_attn to be enabled").
        TypeError: a value of the wrong type.
    """

    n_ctx: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    swa_full: bool = False
    n_threads: int | None = None
    embeddings: bool = False
    n_ctx_seq: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for name, lo, hi in (("n_ctx", 0, SIZE_MAX), ("n_batch", 1, SIZE_MAX), ("n_ubatch", 0, SIZE_MAX),
                             ("n_seq_max", 1, LLAMA_MAX_SEQ)):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), lo, hi))
        _check_bool("kv_unified", self.kv_unified)
        _check_bool("flash_attn", self.flash_attn)
        _check_bool("swa_full", self.swa_full)
        _check_bool("embeddings", self.embeddings)
        for name in ("type_k", "type_v"):
            check_cache_type(getattr(self, name), name)
        if self.type_v in QUANTIZED_CACHE_TYPES and not self.flash_attn:
            raise ValueError(
                f"quantized V cache requires flash_attn to be enabled (type_v = {self.type_v!r}, "
                "flash_attn = False)"
            )
        resolve_n_threads(self.n_threads)  # raises on 0 / < -1 / wrong type

    # ---- derived read-only values -------------------------------------------------------

    @property
    def n_stream(self) -> int:
        """Number of KV streams: 1 when unified, else one per sequence (n_seq_max)."""
        return 1 if self.kv_unified else self.n_seq_max

    @property
    def is_derived(self) -> bool:
        """True for an instance returned by derive() (n_ctx_seq is set)."""
        return self.n_ctx_seq > 0

    @property
    def n_threads_resolved(self) -> int:
        """n_threads resolved to a count (see resolve_n_threads)."""
        return resolve_n_threads(self.n_threads)

    # ---- llama_context's derivations ------------------------------------------------------

    def derive(self, n_ctx_train: int, causal_attn: bool = True) -> ContextParams:
        """Return the parameters the context uses, derived as llama_context's constructor does.

        Args:
            n_ctx_train: the model's training context (GGUF `context_length`), >= 0.
            causal_attn: the model uses causal attention (then n_batch is clamped to n_ctx).

        Returns:
            A new ContextParams with n_ctx, n_batch, n_ubatch and n_ctx_seq derived. Idempotent:
            deriving a derived instance again gives the same values.

        Raises:
            ValueError: n_ctx and n_ctx_train are both 0, or n_ctx_train < 0.

        Logs (logger "llamax"): the derived values at INFO; WARNING "n_ctx is not divisible by
        n_seq_max - rounding down to N" when a non-unified n_ctx changes; INFO "... the full
        capacity of the model will not be utilized" when n_ctx_seq < n_ctx_train and WARNING
        "... possible training context overflow" when n_ctx_seq > n_ctx_train (llama.cpp's levels).
        """
        n_ctx_train = _check_int("n_ctx_train", n_ctx_train, 0, 2**32 - 1)
        _check_bool("causal_attn", causal_attn)

        n_ctx = self.n_ctx if self.n_ctx != 0 else n_ctx_train
        if n_ctx == 0:
            raise ValueError("n_ctx and n_ctx_train cannot both be zero")

        # with causal attention, the batch size is limited by the context size
        # (llama.cpp clamps before n_ctx is padded)
        n_batch = min(n_ctx, self.n_batch) if causal_attn else self.n_batch
        n_ubatch = min(n_batch, self.n_ubatch if self.n_ubatch != 0 else self.n_batch)

        n_ctx = pad(n_ctx, N_CTX_PAD)
        if self.kv_unified:
            n_ctx_seq = n_ctx
        else:
            n_ctx_seq = pad(n_ctx // self.n_seq_max, N_CTX_PAD)
            if n_ctx_seq == 0:  # cannot happen with n_seq_max <= 256, kept as llama.cpp has it
                raise ValueError("n_ctx_seq == 0")
            if n_ctx != n_ctx_seq * self.n_seq_max:
                n_ctx = n_ctx_seq * self.n_seq_max
                logger.warning(
                    "llama_context: n_ctx is not divisible by n_seq_max - rounding down to %d", n_ctx
                )

        out = dataclasses.replace(self, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch)
        object.__setattr__(out, "n_ctx_seq", n_ctx_seq)

        if logger.isEnabledFor(logging.INFO):
            for name, value in (
                ("n_seq_max", out.n_seq_max),
                ("n_ctx", out.n_ctx),
                ("n_ctx_seq", out.n_ctx_seq),
                ("n_batch", out.n_batch),
                ("n_ubatch", out.n_ubatch),
                ("causal_attn", int(causal_attn)),
                ("flash_attn", "enabled" if out.flash_attn else "disabled"),
                ("kv_unified", "true" if out.kv_unified else "false"),
            ):
                logger.info("llama_context: %-13s = %s", name, value)

        if n_ctx_seq < n_ctx_train:
            logger.info(
                "llama_context: n_ctx_seq (%d) < n_ctx_train (%d) -- the full capacity of the model "
                "will not be utilized",
                n_ctx_seq,
                n_ctx_train,
            )
        if n_ctx_seq > n_ctx_train:
            logger.warning(
                "llama_context: n_ctx_seq (%d) > n_ctx_train (%d) -- possible training context overflow",
                n_ctx_seq,
                n_ctx_train,
            )
        return out
