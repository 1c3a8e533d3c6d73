"""The serving layer: llamax.Engine with its slots, continuous batching, the prefix cache over the
cells and per-request context shift (llama-server without HTTP)."""
from llamax.serving.engine import Engine
from llamax.serving.prefix_cache import PrefixCache
from llamax.serving.request import Request, Result
from llamax.serving.reuse import PrefixState

__all__ = ["Engine", "PrefixCache", "PrefixState", "Request", "Result"]
