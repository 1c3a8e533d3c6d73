"""The exceptions of llamax's public API (see API.md).

Every failure that the user can cause raises one of these, with the offending
values in the message, and leaves the memory as it was.
"""


class LlamaxError(Exception):
    """Base of every llamax error."""


class ModelError(LlamaxError):
    """An unreadable or unsupported GGUF, an unknown architecture or a missing tensor."""


class BatchError(LlamaxError, ValueError):
    """An invalid batch; the message names the token and the rule. Memory unchanged."""


class NoKVSlotError(LlamaxError):
    """The batch does not fit in the KV cache after the pending memory updates (llamax has no defrag). Memory unchanged."""


class StalePlanError(LlamaxError, RuntimeError):
    """A plan (or its ubatch) used after the memory changed since it was made: another plan applied,
    a seq_* operation, a clear or a restore. Memory unchanged."""


class StateError(LlamaxError, ValueError):
    """A truncated, corrupt, foreign or incompatible state blob. The destination is left empty."""


class RequestError(LlamaxError, RuntimeError):
    """One Engine request failed (its forward pass raised; the cause is chained): its cells were
    taken back out of the cache and the other requests went on."""


class EngineFullError(LlamaxError):
    """The Engine's queue is full (max_queue requests wait for a slot); nothing was queued."""


__all__ = ["EngineFullError", "RequestError", "LlamaxError", "ModelError", "BatchError", "NoKVSlotError", "StalePlanError", "StateError"]
