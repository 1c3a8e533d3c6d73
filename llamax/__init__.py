"""llamax: llama.cpp's runtime memory system (KV cache, slot finder, batch allocator,
attention mask, attention) as a Python library with a C core."""
from llamax.batch import Batch
from llamax.errors import BatchError, LlamaxError, ModelError, NoKVSlotError, StateError
from llamax.memory import KVCache, KVCacheISWA, Memory
from llamax.params import ContextParams
from llamax.rope import RoPE

__version__ = "0.1.0"

__all__ = ["LlamaxError", "ModelError", "BatchError", "NoKVSlotError", "StateError", "Batch", "ContextParams", "RoPE",
           "KVCache", "KVCacheISWA", "Memory"]
