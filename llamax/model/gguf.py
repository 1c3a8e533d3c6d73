"""Reading a GGUF file: metadata, hyperparameters and tensors.

The file is memory-mapped once (llamax.model.gguf_reader.GGUFReader, our own parser of the container;
the `gguf` package's reader takes 14 s on Gemma's 262144-token vocabulary); tensors are read as views
of the mapping and dequantized to float32 on request. Every failure to read or to find something is a
ModelError.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llamax._native import quants
from llamax.errors import ModelError
from llamax.model.gguf_reader import GGUFReader

ARCHS = ("llama", "gemma3")  # architectures with a forward pass, each a Model subclass in llamax/model/<arch>.py


@dataclass(frozen=True)
class HParams:
    """The hyperparameters llama.cpp reads from a GGUF (llama_hparams), for one architecture."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ff: int
    n_ctx_train: int
    n_vocab: int
    rms_eps: float
    n_rot: int
    rope_kind: str                      # "norm" or "neox" (llama.cpp's rope type of the arch)
    rope_freq_base: float
    rope_freq_scale: float = 1.0
    n_swa: int = 0
    swa_type: str = "none"
    swa_layers: tuple[int, ...] = ()
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    tied_output: bool = True
    # llama.cpp's f_attention_scale: the factor Q is multiplied by before attention (0: 1/sqrt(n_embd_head_k)).
    # Derived from the fields above, so it is left out of comparisons (and of the model fingerprint).
    attn_scale: float = field(default=0.0, compare=False)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv


class GGUFFile:
    """An opened GGUF file: metadata fields and tensors by name.

    Raises:
        ModelError: the file is missing, is not a GGUF, or cannot be parsed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"no model file at {self.path}")
        self.reader = GGUFReader(self.path)  # raises ModelError for anything malformed
        self.tensors = {t.name: t for t in self.reader.tensors}

    # ---- metadata ------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = ModelError) -> Any:
        """The value of a metadata key (strings decoded, arrays as lists)."""
        if key not in self.reader.fields:
            if default is ModelError:
                raise ModelError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        v = self.reader.fields[key]
        return v.tolist() if isinstance(v, np.ndarray) else list(v) if isinstance(v, list) else v

    def array(self, key: str, dtype=None) -> np.ndarray | None:
        """A numeric array field as numpy (no per-element Python objects), None if absent."""
        v = self.reader.fields.get(key)
        if v is None:
            return None
        if not isinstance(v, np.ndarray):
            raise ModelError(f"{self.path.name}: metadata {key!r} is not a numeric array")
        return v.astype(dtype) if dtype is not None else v

    @property
    def arch(self) -> str:
        return str(self.get("general.architecture"))

    # ---- tensors -------------------------------------------------------------------------------
    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path.name}: tensor {name!r} is missing")
        return t

    def ggml_type(self, name: str) -> int:
        return self.tensor(name).ggml_type

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order (ggml's ne reversed)."""
        return tuple(self.tensor(name).np_shape)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, row_bytes] (a view of the mapping)."""
        t = self.tensor(name)
        rows = int(np.prod(t.np_shape[:-1])) if len(t.shape) > 1 else 1
        return self.reader.tensor_data(name).reshape(rows, -1)

    def f32(self, name: str, n_threads: int | None = None) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order (native, bit-exact with ggml).

        Raises:
            ModelError: a tensor type that cannot be dequantized.
        """
        t = self.ggml_type(name)
        if not quants.can_dequantize(t):
            raise ModelError(f"{self.path.name}: tensor {name!r} has type {t}, which cannot be dequantized")
        return quants.dequantize(t, np.ascontiguousarray(self.raw(name)), self.shape(name), n_threads)


def _arch_key(g: GGUFFile, arch: str, key: str, default: Any = ModelError) -> Any:
    return g.get(f"{arch}.{key}", default)


def read_hparams(g: GGUFFile) -> HParams:
    """llama_model::load_hparams for the supported architectures.

    Raises:
        ModelError: unknown architecture or a missing required key.
    """
    arch = g.arch
    if arch not in ARCHS:
        raise ModelError(f"{g.path.name}: architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    n_embd = int(_arch_key(g, arch, "embedding_length"))
    n_head = int(_arch_key(g, arch, "attention.head_count"))
    n_head_kv = int(_arch_key(g, arch, "attention.head_count_kv", n_head))
    head_k = int(_arch_key(g, arch, "attention.key_length", n_embd // n_head))
    head_v = int(_arch_key(g, arch, "attention.value_length", n_embd // n_head))
    n_vocab = _arch_key(g, arch, "vocab_size", None)
    if n_vocab is None:
        toks = g.reader.fields.get("tokenizer.ggml.tokens")
        if toks is None:
            raise ModelError(f"{g.path.name}: no vocabulary (tokenizer.ggml.tokens)")
        n_vocab = len(toks)
    common = dict(
        arch=arch,
        n_layer=int(_arch_key(g, arch, "block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd_head_k=head_k,
        n_embd_head_v=head_v,
        n_ff=int(_arch_key(g, arch, "feed_forward_length")),
        n_ctx_train=int(_arch_key(g, arch, "context_length")),
        n_vocab=int(n_vocab),
        rms_eps=float(_arch_key(g, arch, "attention.layer_norm_rms_epsilon")),
        n_rot=int(_arch_key(g, arch, "rope.dimension_count", head_k)),
        rope_freq_base=float(_arch_key(g, arch, "rope.freq_base", 10000.0)),
        rope_freq_scale=1.0 / float(_arch_key(g, arch, "rope.scaling.factor", 1.0) or 1.0),
        tied_output="output.weight" not in g.tensors,
    )
    if arch == "llama":
        return HParams(rope_kind="norm", **common)
    # gemma3 (llama.cpp's LLM_ARCH_GEMMA3): with a sliding window, every sixth layer is global and the
    # others slide over n_swa tokens (set_swa_pattern(6): layer il slides iff il % 6 < 5), with their own
    # RoPE (base 10000, scale 1); the global layers take gemma3.rope.freq_base and the GGUF's rope scaling.
    # Without one, every layer is global and the final logits are soft-capped (llm_build_gemma3<false>).
    # Q is scaled by 1/sqrt(n_embd_head_k), by 1/sqrt(n_embd / n_head) for the 27B (62 layers).
    n_layer = common["n_layer"]
    attn_scale = 1.0 / math.sqrt(n_embd // n_head if n_layer == 62 else head_k)
    n_swa = int(_arch_key(g, arch, "attention.sliding_window", 0) or 0)
    if n_swa <= 0:
        softcap = float(_arch_key(g, arch, "final_logit_softcapping", 0.0) or 0.0)
        return HParams(rope_kind="neox", final_logit_softcap=softcap, attn_scale=attn_scale, **common)
    swa_layers = tuple(il for il in range(n_layer) if il % 6 < 5)
    return HParams(rope_kind="neox", n_swa=n_swa, swa_type="standard", swa_layers=swa_layers,
                   rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0, attn_scale=attn_scale, **common)
