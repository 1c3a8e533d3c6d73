"""llamax: llama.cpp's runtime memory system (KV cache, slot finder, batch allocator,
attention mask, attention) and the decode loop around it, as a Python library with a C core."""
import os
import sys

# Threads that spin-wait long after their parallel region steal the cores the next kernel needs:
# OpenMP's (ours) those of OpenBLAS during prefill, OpenBLAS's those of our attention right after a
# BLAS call (pp512 377 -> 620 t/s here together). A short spin keeps decode's back-to-back regions
# fast. Each library reads its variable once when it loads (OpenBLAS with numpy), so this helps only
# when llamax is imported first; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from llamax import models  # noqa: E402
from llamax.batch import Batch
from llamax.context import Context
from llamax.errors import BatchError, EngineFullError, LlamaxError, ModelError, NoKVSlotError, StalePlanError, StateError
from llamax.generate import context_shift, generate, generate_parallel
from llamax.memory import KVCache, KVCacheISWA, Memory
from llamax.model import Model
from llamax.params import ContextParams
from llamax.rope import RoPE
from llamax.sampling import Sampler
from llamax.serving import Engine, Request, Result

__version__ = "0.1.0"

__all__ = ["Engine", "Request", "Result", "EngineFullError", "LlamaxError", "ModelError", "BatchError", "NoKVSlotError", "StalePlanError", "StateError", "Batch",
           "ContextParams", "RoPE", "KVCache", "KVCacheISWA", "Memory", "Model", "Context", "Sampler", "generate",
           "generate_parallel", "context_shift", "models"]
