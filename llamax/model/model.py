"""llamax.Model: a GGUF model loaded once: hyperparameters, tokenizer, weights, forward pass."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llamax.batch import UBatch
from llamax.errors import ModelError
from llamax.memory import HybridMemory, KVCache, KVCacheISWA, KVMemory, Memory, RecurrentMemory, swa_cache_size
from llamax.model.family import read_hparams
from llamax.model.gguf import ARCHS, DENSE_ARCHS, GGUFFile, HParams, TensorTable, check_tensors
from llamax.model.linear import Embedding, Linear, rms_norm
from llamax.params import ContextParams, resolve_n_threads
from llamax.rope import RoPE

if TYPE_CHECKING:
    from llamax._native.layer import Stack

log = logging.getLogger("llamax")


def _model_path(name_or_path: str | os.PathLike) -> Path:
    """A GGUF path as given, or a registry name's file (fetched on first use)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    from llamax import models

    if str(name_or_path) in models.available():
        return models.path(str(name_or_path))
    if p.suffix == ".gguf" or os.sep in str(name_or_path):
        raise ModelError(f"no model file at {p}")
    raise ModelError(f"{name_or_path!r} is neither a file nor a registry name ({', '.join(models.available())})")


class ModelInfo:
    """What a GGUF says without its weights: the hyperparameters, the tokenizer, the chat template
    and the fingerprint a saved state must match. Reading one maps the file and reads no tensor data
    (a front end that tokenizes for engines elsewhere needs nothing more); Model adds the weights
    and the forward pass."""

    def __init__(self, g: GGUFFile, hparams: HParams) -> None:
        from llamax.model.chat import apply_chat_template
        from llamax.model.tokenizer import Tokenizer

        self.path = g.path
        self.gguf = g
        self.hparams = hparams
        self.tokenizer = Tokenizer.from_gguf(g.reader)
        self.chat_template = g.get("tokenizer.chat_template", None)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ModelError(f"{g.path.name}: tokenizer.chat_template is a {type(self.chat_template).__name__}, "
                             "not a string")
        self._apply_chat_template = apply_chat_template

    @classmethod
    def read(cls, name_or_path: str | os.PathLike) -> ModelInfo:
        """A GGUF path, or a name from the model registry (fetched on first use).

        Raises:
            ModelError: as Model.load, for everything but the tensors.
        """
        g = GGUFFile(_model_path(name_or_path))
        return ModelInfo(g, read_hparams(g))

    # ---- identity ------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.hparams.arch

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hex digest (blake2b-128) of the architecture, the hyperparameters and every tensor's name,
        type and shape: what a saved state must match. Reads no tensor data. A hyperparameter added
        after the first release (metadata "omit_default") counts only when it is not at its default, so
        the states saved by older versions of a model still load."""
        h = hashlib.blake2b(digest_size=16)
        hp = self.hparams
        h.update(repr([(f.name, getattr(hp, f.name)) for f in dataclasses.fields(hp) if f.compare and not
                       (f.metadata.get("omit_default") and getattr(hp, f.name) == f.default)]).encode())
        for name in sorted(self.gguf.tensors):
            t = self.gguf.tensors[name]
            h.update(repr((name, t.ggml_type, [int(x) for x in t.shape])).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        kind = "ModelInfo" if type(self) is ModelInfo else "Model"
        return f"{kind}({self.path.name}, arch={self.arch}, n_layer={self.hparams.n_layer})"

    # ---- tokenizer -----------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        return self.tokenizer.detokenize(tokens, remove_special=remove_special, unparse_special=unparse_special)

    def token_to_piece(self, token: int) -> bytes:
        return self.tokenizer.token_to_piece(token)

    @property
    def bos(self) -> int:
        return self.tokenizer.bos

    @property
    def eos(self) -> int:
        return self.tokenizer.eos

    def is_eog(self, token: int) -> bool:
        return self.tokenizer.is_eog(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The GGUF's own chat template (llama.cpp's built-in one by name when the GGUF has none)."""
        return self._apply_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.tokenizer.token_text(self.bos) if self.bos is not None
                                         and self.bos >= 0 else "",
                                         eos_token=self.tokenizer.token_text(self.eos) if self.eos is not None
                                         and self.eos >= 0 else "",
                                         arch=self.arch)


class Model(ModelInfo):
    """A loaded model (llama_model): hyperparameters, tokenizer, weights and the forward pass.

    Model.load(name_or_path) returns an instance of the architecture's own subclass (Decoder for every
    transformer family of llamax/model/family.py, Mamba, Jamba), which loads its weights and implements
    forward(); create_memory() is shared (llama_model's create_memory: a KV cache, the interleaved SWA
    cache when the model has sliding-window layers, a recurrent memory for a Mamba, a hybrid memory for
    a Jamba).
    A subclass names its architectures in its class statement: `class Mamba(Model, arch="mamba")`,
    and lists its tensors in TENSORS or tensor_table() (their shapes from the hyperparameters, as
    llama.cpp's load_arch_tensors), which __init__ checks against the file before any weight is read.
    """

    _by_arch: dict[str, type["Model"]] = {}
    TENSORS: TensorTable

    def __init_subclass__(cls, arch: str | tuple[str, ...], **kw) -> None:
        super().__init_subclass__(**kw)
        for a in (arch,) if isinstance(arch, str) else arch:
            Model._by_arch[a] = cls

    @classmethod
    def _architecture(cls, arch: str, g: GGUFFile) -> type["Model"]:
        """The Model subclass of an architecture of gguf.ARCHS: llamax/model/decoder.py for the
        transformer families, llamax/model/<arch>.py for the others (imported on first use)."""
        if arch not in ARCHS:
            raise ModelError(f"{g.path.name}: no forward pass for architecture {arch!r}")
        importlib.import_module("llamax.model.decoder" if arch in DENSE_ARCHS else f"llamax.model.{arch}")
        return cls._by_arch[arch]

    def tensor_table(self, g: GGUFFile, hp: HParams) -> TensorTable:
        """The tensors this architecture's file must hold (check_tensors): TENSORS by default."""
        return type(self).TENSORS

    def __init__(self, g: GGUFFile, hparams: HParams, n_threads: int) -> None:
        check_tensors(g, hparams, self.tensor_table(g, hparams))   # ModelError naming the tensor and both shapes
        super().__init__(g, hparams)
        self.n_threads = n_threads

    # ---- llama_model's two jobs for a context ----------------------------------------------------
    def create_memory(self, params: ContextParams, ropes: list[RoPE | None] | None = None) -> Memory:
        """The memory a context of these (derived) parameters gets (llama_model::create_memory): a
        recurrent memory when every layer keeps a state (Mamba), a hybrid memory when some do (Jamba; its KV
        cache holds the attention layers only, not nemotron_h's FFN-only ones), else a KV cache (the interleaved SWA cache when the model has sliding-window layers). ropes:
        each layer's RoPE for the cache's K-shift (None in a list: a layer without RoPE); None: the
        hyperparameters' one RoPE for every layer (its sliding layers' for those)."""
        hp = self.hparams
        common: dict[str, Any] = dict(
            head_dim_v=hp.n_embd_head_v, n_seq_max=params.n_seq_max, unified=params.kv_unified,
            type_k=params.type_k, type_v=params.type_v, v_trans=not params.flash_attn, n_threads=params.n_threads)
        if hp.recurrent_layers:
            recr = RecurrentMemory(hp.n_layer, hp.r_shape, hp.s_shape, n_seq_max=params.n_seq_max,
                                   layer_ids=hp.recurrent_layers, n_threads=params.n_threads,
                                   kernel_undo=True)   # every recurrent forward passes the views' undo rows
            if len(hp.recurrent_layers) == hp.n_layer:
                return recr
            attn_layers = [il for il in range(hp.n_layer) if il not in hp.recurrent_layers and il not in hp.ffn_layers]
            if not attn_layers:   # recurrent and FFN-only layers (llama.cpp's layer filters)
                return recr
            attn_ropes = [ropes[il] for il in attn_layers] if ropes is not None else [None] * len(attn_layers)
            attn = KVCache(len(attn_layers), hp.n_head_kv, hp.n_embd_head_k, params.n_ctx_seq, layer_ids=attn_layers,
                           rope=attn_ropes, **common)   # without ropes (Jamba): NoPE, positions only mask
            return HybridMemory(attn, recr)
        rope: Any = RoPE(hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, hp.rope_kind)
        rope_swa: Any = RoPE(hp.n_rot, hp.rope_freq_base_swa, hp.rope_freq_scale_swa, hp.rope_kind)
        if ropes is not None:   # per layer: the base cache's layers, then the sliding ones'
            swa = set(hp.swa_layers) if hp.n_swa > 0 else set()
            rope = [ropes[il] for il in range(hp.n_layer) if il not in swa] if len(swa) < hp.n_layer else ropes
            rope_swa = [ropes[il] for il in range(hp.n_layer) if il in swa]
        if hp.n_swa > 0 and hp.swa_layers:
            if len(hp.swa_layers) == hp.n_layer:  # every layer slides: llama.cpp's iSWA cache minus its empty base
                size = swa_cache_size(params.n_ctx_seq, hp.n_swa, params.n_seq_max, params.kv_unified,
                                      params.n_ubatch, params.swa_full)
                return KVCache(hp.n_layer, hp.n_head_kv, hp.n_embd_head_k, size, n_swa=hp.n_swa,
                               swa_type=hp.swa_type, rope=rope_swa, **common)
            return KVCacheISWA(hp.n_layer, hp.n_head_kv, hp.n_embd_head_k, params.n_ctx_seq,
                               swa_layers=hp.swa_layers, n_swa=hp.n_swa, swa_type=hp.swa_type,
                               swa_full=params.swa_full, n_ubatch=params.n_ubatch, rope=rope, rope_swa=rope_swa,
                               **common)
        return KVCache(hp.n_layer, hp.n_head_kv, hp.n_embd_head_k, params.n_ctx_seq, rope=rope, **common)

    def _load_head(self, g: GGUFFile) -> None:
        """token_embd, output_norm and the output layer: token_embd itself when the GGUF has no output.weight
        (llama.cpp's tied output)."""
        self.tok_embd = Embedding(g, "token_embd.weight", self.n_threads)          # raw rows [n_vocab, n_embd]
        self.output_norm = g.f32("output_norm.weight")
        self.output: Embedding | Linear = (self.tok_embd if self.hparams.tied_output
                                           else Linear.load(g, "output.weight", self.n_threads))

    def _head(self, x: np.ndarray, ubatch: UBatch, embd: bool = False) -> np.ndarray:
        """The logits [n outputs, n_vocab] of the ubatch rows of x that asked for them (ubatch order): the
        final RMSNorm, then the output layer (embd: the normed rows themselves, see _out)."""
        return self._out(x[ubatch.output], embd)

    def _out(self, h: np.ndarray, embd: bool) -> np.ndarray:
        """What forward returns for the final hidden states h [n outputs, n_embd] (before the output
        norm): the final RMSNorm, then the output layer's logits [n, n_vocab]; with embd the normed
        states [n, n_embd] themselves (llama.cpp's t_embd, what an embeddings context reads)."""
        hp = self.hparams
        if h.shape[0] == 0:
            return np.zeros((0, hp.n_embd if embd else hp.n_vocab), np.float32)
        xo = rms_norm(h, self.output_norm, hp.rms_eps)
        if embd:
            return xo
        return self._logits(xo)

    def _logits(self, xo: np.ndarray) -> np.ndarray:
        """The output layer over normed hidden states xo [n, n_embd]: logits [n, n_vocab]."""
        return self.output.logits(xo) if isinstance(self.output, Embedding) else self.output(xo)

    def forward(self, memory: Memory, ubatch: UBatch, embd: bool = False) -> np.ndarray:
        """Run the model on one ubatch whose cells were just applied: K/V written into the memory,
        attention over it; returns float32 logits [ubatch.n_outputs, n_vocab] in ubatch order, or with
        embd the final hidden states after the output norm [ubatch.n_outputs, n_embd] (_out)."""
        raise NotImplementedError(f"{type(self).__name__} has no forward pass")

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, *, n_threads: int | None = None) -> "Model":
        """A GGUF path, or a name from the model registry (fetched on first use).

        Raises:
            ModelError: unreadable / unsupported file, unknown architecture, a hyperparameter that
                fails read_hparams' checks, a tensor missing, unexpected or of another shape than
                the hyperparameters give (check_tensors), or a registry name that cannot be fetched.
        """
        p = _model_path(name_or_path)
        g = GGUFFile(p)
        hp = read_hparams(g)
        t0 = time.perf_counter()
        model = Model._architecture(hp.arch, g)(g, hp, resolve_n_threads(n_threads))
        log.info("model: %s (%s, %d layers, %d vocab) loaded in %.2f s", g.path.name, hp.arch,
                 hp.n_layer, hp.n_vocab, time.perf_counter() - t0)
        return model

