"""llamax.Model: a GGUF model loaded once: hyperparameters, tokenizer, weights, forward pass."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

from llamax.errors import ModelError
from llamax.model.gguf import GGUFFile, HParams, read_hparams
from llamax.params import resolve_n_threads

log = logging.getLogger("llamax")


class Model:
    """A loaded model (llama_model). Use Model.load(name_or_path)."""

    def __init__(self, g: GGUFFile, hparams: HParams, n_threads: int) -> None:
        from llamax.model.chat import apply_chat_template
        from llamax.model.tokenizer import Tokenizer

        self.path = g.path
        self.gguf = g
        self.hparams = hparams
        self.n_threads = n_threads
        self.tokenizer = Tokenizer.from_gguf(g.reader)
        self.chat_template = g.get("tokenizer.chat_template", None)
        self._apply_chat_template = apply_chat_template
        t0 = time.perf_counter()
        if hparams.arch == "llama":
            from llamax.model.llama import Llama

            self.impl = Llama(g, hparams, n_threads)
        elif hparams.arch == "gemma3":
            from llamax.model.gemma3 import Gemma3

            self.impl = Gemma3(g, hparams, n_threads)
        else:
            raise ModelError(f"{g.path.name}: no forward pass for architecture {hparams.arch!r} yet")
        log.info("model: %s (%s, %d layers, %d vocab) loaded in %.2f s", g.path.name, hparams.arch,
                 hparams.n_layer, hparams.n_vocab, time.perf_counter() - t0)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, *, n_threads: int | None = None) -> "Model":
        """A GGUF path, or a name from the model registry (fetched on first use).

        Raises:
            ModelError: unreadable / unsupported file, unknown architecture, missing tensor, or a
                registry name that cannot be fetched.
        """
        p = Path(name_or_path)
        if not p.is_file():
            from llamax import models

            if str(name_or_path) in models.available():
                p = models.path(str(name_or_path))
            elif p.suffix == ".gguf" or os.sep in str(name_or_path):
                raise ModelError(f"no model file at {p}")
            else:
                raise ModelError(f"{name_or_path!r} is neither a file nor a registry name "
                                 f"({', '.join(models.available())})")
        g = GGUFFile(p)
        return cls(g, read_hparams(g), resolve_n_threads(n_threads))

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
        type and shape: what a saved state must match. Reads no tensor data."""
        h = hashlib.blake2b(digest_size=16)
        hp = self.hparams
        h.update(repr([(f.name, getattr(hp, f.name)) for f in dataclasses.fields(hp) if f.compare]).encode())
        for name in sorted(self.gguf.tensors):
            t = self.gguf.tensors[name]
            h.update(repr((name, int(t.tensor_type), [int(x) for x in t.shape])).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"Model({self.path.name}, arch={self.arch}, n_layer={self.hparams.n_layer})"

    # ---- tokenizer -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens, remove_special: bool = False, unparse_special: bool = False) -> str:
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

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """The GGUF's own chat template (llama.cpp's built-in one by name when the GGUF has none)."""
        return self._apply_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.tokenizer.token_text(self.bos) if self.bos is not None
                                         and self.bos >= 0 else "",
                                         eos_token=self.tokenizer.token_text(self.eos) if self.eos is not None
                                         and self.eos >= 0 else "",
                                         arch=self.arch)
