"""llamax: llama.cpp's runtime memory system (KV cache, slot finder, batch allocator,
attention mask, attention) and the decode loop around it, as a Python library with a C core."""
import os

# OpenMP threads that spin-wait long after a parallel region steal the cores BLAS needs for prefill
# (2.5x slower prompts here); a short spin keeps decode's back-to-back regions fast. Read once, when
# libgomp loads with the first native module; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from llamax import models  # noqa: E402
from llamax.batch import Batch
from llamax.context import Context
from llamax.errors import BatchError, LlamaxError, ModelError, NoKVSlotError, StateError
from llamax.generate import generate
from llamax.memory import KVCache, KVCacheISWA, Memory
from llamax.model import Model
from llamax.params import ContextParams
from llamax.rope import RoPE
from llamax.sampling import Sampler

__version__ = "0.1.0"

__all__ = ["LlamaxError", "ModelError", "BatchError", "NoKVSlotError", "StateError", "Batch", "ContextParams",
           "RoPE", "KVCache", "KVCacheISWA", "Memory", "Model", "Context", "Sampler", "generate", "models"]
