"""Embeddings: one pooled vector per input from a model's final hidden states (llama.cpp's embeddings).

As llama.cpp computes them for a decoder model (llama_context with embeddings on, build_pooling):
every token of an input is an output, its row the final hidden state after the output norm (the
input of the output head, never the logits); attention stays causal. One vector per input:

    mean    the mean of the input's rows        (LLAMA_POOLING_TYPE_MEAN)
    last    the last token's row                (LLAMA_POOLING_TYPE_LAST)
    cls     the first token's row               (LLAMA_POOLING_TYPE_CLS)

then, with normalize, divided by its L2 norm (llama-server's embd_normalize = 2; a zero vector stays
zero). Strings are tokenized as llama.cpp's embedding path does (llama_tokenize with add_special:
BOS / EOS as the vocabulary's flags ask, parse_special off); token lists are used as given.

The inputs of one call are decoded together: each input its own sequence of a fresh Context sized to
them (never anyone's KV cache), at most MAX_BATCH_TOKENS tokens and LLAMA_MAX_SEQ inputs per decode
(a longer single input gets a decode of its own). Every kernel of the decode path computes a row one
fixed way (tests/test_batch_invariance.py), and the pooling reads only the input's own rows, so an
input's vector has the same bits alone or among others.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from llamax.batch import Batch
from llamax.context import Context
from llamax.dtypes import LLAMA_MAX_SEQ
from llamax.errors import BatchError, ModelError

if TYPE_CHECKING:
    from llamax.model import Model

__all__ = ["embed", "POOLINGS", "MAX_BATCH_TOKENS", "prepare", "pooling_of", "tokens_of", "groups", "embed_tokens"]

#: the poolings, by their names in llama.cpp's `--pooling` and the GGUF's `{arch}.pooling_type` values
POOLINGS = {"mean": 1, "cls": 2, "last": 3}
#: most tokens decoded at once (llama-server's default n_batch); one longer input is decoded alone
MAX_BATCH_TOKENS = 2048
#: tokens per ubatch of the embeddings context
N_UBATCH = 512


def pooling_of(model: Model, pooling: str | None = None) -> str:
    """The pooling an embedding of model uses: `pooling` when given (llama.cpp's context parameter
    overrides the model's), else the GGUF's `{arch}.pooling_type` when it names one of POOLINGS, else
    "mean".

    Raises:
        ValueError: pooling is not one of POOLINGS.
        ModelError: pooling is None and the GGUF asks for a pooling this library does not compute
            (rank).
    """
    if pooling is not None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling = {pooling!r}: one of {', '.join(POOLINGS)}")
        return pooling
    own = model.gguf.get(f"{model.arch}.pooling_type", None)
    if own is None or own in (-1, 0):  # unspecified / none: no pooled vector of its own
        return "mean"
    for name, value in POOLINGS.items():
        if own == value:
            return name
    raise ModelError(f"{model.path.name}: {model.arch}.pooling_type = {own} (rank or unknown) is not computed "
                     f"here; pass pooling= one of {', '.join(POOLINGS)}")


def _token_list(model: Model, toks: Sequence[Any] | np.ndarray, i: int) -> list[int]:
    """One input given as token ids, checked: non-empty integers in [0, n_vocab)."""
    if len(toks) == 0:
        raise BatchError(f"input {i} is empty")
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in toks):
        bad = next(t for t in toks if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
        raise TypeError(f"input {i}: token ids are integers, not {type(bad).__name__} ({bad!r})")
    a = np.asarray(toks, dtype=np.int64)
    out = (a < 0) | (a >= model.n_vocab)
    if out.any():
        j = int(np.flatnonzero(out)[0])
        raise BatchError(f"input {i}: token {int(a[j])} at index {j} is outside the vocabulary [0, {model.n_vocab})")
    return a.tolist()


def tokens_of(model: Model, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """The token ids of each input: a str, a list of str, a list of token ids (one input) or a list
    of such lists (strings and token lists may mix). Strings are tokenized with add_special=True,
    parse_special=False, as llama.cpp's embeddings are.

    Raises:
        BatchError (a ValueError): no input, an empty input (string or token list), a token outside
            the vocabulary, an input longer than the model's training context (n_ctx_train).
        TypeError: an input that is neither a string nor a list of integers.
    """
    items: Sequence[Any]
    if isinstance(inputs, (str, bytes)):
        items = [inputs]
    elif isinstance(inputs, (Sequence, np.ndarray)):
        items = inputs
    else:
        raise TypeError(f"inputs: a str, a list of str or lists of token ids, not {type(inputs).__name__}")
    if len(items) == 0:
        raise BatchError("no input to embed (an empty list)")
    if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
        items = [items]  # one list of token ids: one input
    out = []
    for i, x in enumerate(items):
        if isinstance(x, (str, bytes)):
            if len(x) == 0:
                raise BatchError(f"input {i} is an empty string")
            toks = model.tokenize(x, add_special=True, parse_special=False)
            if not toks:
                raise BatchError(f"input {i} has no tokens")
        elif isinstance(x, (Sequence, np.ndarray)):
            toks = _token_list(model, x, i)
        else:
            raise TypeError(f"input {i}: a str or a list of token ids, not {type(x).__name__}")
        n_max = model.hparams.n_ctx_train
        if n_max > 0 and len(toks) > n_max:
            raise BatchError(f"input {i} has {len(toks)} tokens, more than the model's training context ({n_max})")
        out.append(toks)
    return out


def groups(lengths: Sequence[int], max_tokens: int = MAX_BATCH_TOKENS) -> list[range]:
    """Consecutive inputs decoded together: at most max_tokens tokens (unless one input alone has
    more) and LLAMA_MAX_SEQ inputs per group."""
    out, start, n = [], 0, 0
    for i, L in enumerate(lengths):
        if i > start and (n + L > max_tokens or i - start >= LLAMA_MAX_SEQ):
            out.append(range(start, i))
            start, n = i, 0
        n += L
    out.append(range(start, len(lengths)))
    return out


def _pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One input's vector from its rows [n_tokens, n_embd] (float32)."""
    if pooling == "mean":
        return (rows.sum(axis=0, dtype=np.float64) / rows.shape[0]).astype(np.float32)
    return rows[-1 if pooling == "last" else 0].copy()


def embed_tokens(model: Model, tokens: Sequence[Sequence[int]], pooling: str, normalize: bool = True, *,
                 max_batch_tokens: int = MAX_BATCH_TOKENS) -> np.ndarray:
    """The embeddings [len(tokens), n_embd] float32 of inputs already checked by tokens_of, with a
    pooling of POOLINGS (pooling_of). Decodes each of groups(lengths, max_batch_tokens) in a Context
    of its own.

    Complexity: one forward pass over every token (no output head), a KV cache of the group's tokens."""
    assert pooling in POOLINGS
    out = np.empty((len(tokens), model.hparams.n_embd), np.float32)
    for g in groups([len(t) for t in tokens], max_batch_tokens):
        n = sum(len(tokens[i]) for i in g)
        ctx = Context(model, n_ctx=n, n_batch=n, n_ubatch=min(n, N_UBATCH), n_seq_max=len(g),
                      n_threads=model.n_threads, embeddings=True)
        flat = [t for i in g for t in tokens[i]]
        seqs = np.repeat(np.arange(len(g)), [len(tokens[i]) for i in g]).tolist()
        ctx.decode(Batch(flat, seq_ids=seqs, logits=[True] * n))
        rows = ctx.get_embeddings()
        at = 0
        for i in g:
            L = len(tokens[i])
            out[i] = _pool(rows[at:at + L], pooling)
            at += L
    if normalize:
        norm = np.linalg.norm(out.astype(np.float64), axis=1, keepdims=True)
        np.divide(out, norm, out=out, where=norm > 0)
    return out


def embed(model: Model, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
          pooling: str | None = None, normalize: bool = True) -> np.ndarray:
    """Embeddings of inputs (llama.cpp's embeddings of a decoder model, see the module docstring).

    Args:
        model: a loaded llamax.Model.
        inputs: a str, a list of str, a list of token ids (one input) or a list of lists of token ids.
        pooling: "mean", "last" or "cls"; None: the GGUF's own pooling_type, else "mean" (pooling_of).
        normalize: divide each vector by its L2 norm (llama-server's default); False: the raw pooled vector.

    Returns:
        float32 [n_inputs, n_embd], one row per input in input order (a single input: one row).

    Raises:
        BatchError / ValueError / TypeError: bad inputs (tokens_of) or pooling; nothing is decoded.
        ModelError: the GGUF's own pooling is not computed here (rank) and none was given.
    """
    tokens, how = prepare(model, inputs, pooling=pooling, normalize=normalize)
    return embed_tokens(model, tokens, how, normalize)


def prepare(model: Model, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
            pooling: str | None = None, normalize: bool = True) -> tuple[list[list[int]], str]:
    """Everything embed checks before it decodes: (the inputs' token ids, the pooling).

    Raises:
        As embed.
    """
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    how = pooling_of(model, pooling)
    return tokens_of(model, inputs), how
