"""The memory family (llama_memory_i): the KV cache and the interleaved SWA cache."""
from llamax.memory.base import LayerView, Memory, MemoryContext, Plan
from llamax.memory.iswa import KVCacheISWA, swa_cache_size
from llamax.memory.kv_cache import KVCache

__all__ = ["LayerView", "Memory", "MemoryContext", "KVCache", "KVCacheISWA", "Plan", "swa_cache_size"]
