"""Models: GGUF loading, tokenizer, one module per architecture."""
from llamax.model.family import read_hparams
from llamax.model.gguf import GGUFFile, HParams
from llamax.model.model import Model, ModelInfo

__all__ = ["GGUFFile", "HParams", "Model", "ModelInfo", "read_hparams"]
