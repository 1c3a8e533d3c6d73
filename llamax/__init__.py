"""llamax: llama.cpp's runtime memory system (KV cache, slot finder, batch allocator,
attention mask, attention) and the decode loop around it, as a Python library with a C core.

The library never writes to stdout or stderr; it reports through `logging` (no handler of its
own: records show where the application configures logging; the `llamax` CLI does). Loggers:

    llamax                the core: the KV size summary at cache creation (INFO, llama.cpp's
                          format), derived-parameter notes and warnings (params, batch, context,
                          memory, generate, serving.engine)
    llamax.models         model registry fetches: "fetching ...", "verifying ...", "... ready",
                          the extraction's progress (see llamax.models' docstring)
    llamax.models.pip     pip's output during a fetch, line by line
    llamax.server         the HTTP server (requests, errors)
"""
import importlib
import os
import sys


def _load_runtimes() -> None:
    """Load OpenMP and OpenBLAS with short spin-waits, leaving the process environment as it was.

    Threads that spin-wait long after their parallel region steal the cores the next kernel needs:
    OpenMP's (ours) those of OpenBLAS during prefill, OpenBLAS's those of our attention right after a
    BLAS call (pp512 377 -> 620 t/s here together). Each runtime reads its variable once, as it
    loads: libgomp (GOMP_SPINCOUNT) with libllamax.so, OpenBLAS (OPENBLAS_THREAD_TIMEOUT) with
    numpy. Neither has a call to set it later, so the variables are set just around those two loads
    and removed again: the process and its children see no variable llamax set. A value the user set
    is kept (and wins); OpenBLAS keeps its own when numpy was imported before llamax.
    """
    want = {"GOMP_SPINCOUNT": "10000"}
    if "numpy" not in sys.modules:
        want["OPENBLAS_THREAD_TIMEOUT"] = "4"
    ours = [k for k in want if k not in os.environ]
    for k in ours:
        os.environ[k] = want[k]
    try:
        importlib.import_module("numpy")  # OpenBLAS reads its variable here
        importlib.import_module("llamax._native.cpu")  # libllamax.so loads libgomp, which reads its own
    finally:
        for k in ours:
            os.environ.pop(k, None)


_load_runtimes()

from llamax import models  # noqa: E402
from llamax.batch import Batch
from llamax.context import Context
from llamax.embed import embed
from llamax.errors import BatchError, EngineFullError, LlamaxError, RequestError, ModelError, NoKVSlotError, StalePlanError, StateError
from llamax.generate import context_shift, generate, generate_parallel
from llamax.grammar import Grammar
from llamax.memory import HybridMemory, KVCache, KVCacheISWA, Memory, RecurrentMemory
from llamax.model import Model
from llamax.params import ContextParams
from llamax.rope import RoPE
from llamax.sampling import Sampler
from llamax.sequence import TokenLogprob
from llamax.serving import Engine, Request, Result
from llamax.speculative import Speculative
from llamax.tools import ToolCall

__version__ = "0.1.0"

__all__ = ["Engine", "Request", "Result", "TokenLogprob", "ToolCall", "EngineFullError", "RequestError", "LlamaxError", "ModelError", "BatchError", "NoKVSlotError", "StalePlanError", "StateError", "Batch",
           "ContextParams", "RoPE", "KVCache", "KVCacheISWA", "Memory", "RecurrentMemory", "HybridMemory", "Model", "Context", "Sampler", "Grammar", "Speculative", "embed", "generate",
           "generate_parallel", "context_shift", "models"]
