"""The memory family (llama_memory_i): the KV cache, the interleaved SWA cache, the recurrent and hybrid memories."""
from llamax.memory.base import KVMemory, LayerView, Memory, MemoryContext, Plan
from llamax.memory.iswa import KVCacheISWA, swa_cache_size
from llamax.memory.kv_cache import KVCache
from llamax.memory.recurrent import RecurrentMemory, RecurrentView
from llamax.memory.hybrid import HybridMemory

__all__ = ["HybridMemory", "LayerView", "Memory", "MemoryContext", "KVCache", "KVCacheISWA", "KVMemory", "Plan", "RecurrentMemory",
           "RecurrentView", "swa_cache_size"]
