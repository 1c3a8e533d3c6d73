"""POST /v1/embeddings (and /embeddings): OpenAI's embeddings route over Engine.embed.

Body (OpenAI's): `input` (a string, a list of strings, a list of token ids, or a list of lists of
token ids), `model`, `encoding_format` ("float" or "base64": the float32 little-endian bytes of each
vector, base64-encoded), `dimensions` (refused with 400 unless it is the model's n_embd: vectors are
never truncated), `user` (ignored). The pooling is the server's (`llamax serve --pooling`, the GGUF's
own when not given); vectors are L2-normalized, as llama-server's default. Answer:

    {"object": "list", "model": ...,
     "data": [{"object": "embedding", "index": i, "embedding": [...] or "base64..."}, ...],
     "usage": {"prompt_tokens": N, "total_tokens": N}}

Errors are the server's OpenAI error bodies (APIError): 400 for a bad body or bad input (empty, a
token outside the vocabulary, longer than the model's training context), 501 for an engine that
cannot embed (a replica set).
"""
from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llamax.embed import POOLINGS, prepare
from llamax.errors import LlamaxError, ModelError
from llamax.server.errors import APIError

MAX_INPUTS = 2048  # inputs per body (OpenAI's limit)


class EmbeddingRequest(BaseModel):
    """The body of POST /v1/embeddings (unknown keys ignored, strict types, as the other routes)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
            | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
            | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                        Field(min_length=1, max_length=MAX_INPUTS)])
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class BodyReader(Protocol):
    """What the handler needs of the app's Server: its engine, body reader and model name."""

    engine: Any
    model_name: str

    async def body(self, request: Request, model: type[BaseModel]) -> Any: ...


class Embeddings:
    """The route handler: `Route("/v1/embeddings", Embeddings(server, pooling).handle, methods=["POST"])`.

    Args:
        server: the app's Server (its engine, body reader and model name).
        pooling: the server's pooling ("mean", "last", "cls"), None for the GGUF's own (else mean).

    Raises:
        ValueError: an unknown pooling.
    """

    def __init__(self, server: BodyReader, pooling: str | None = None) -> None:
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling = {pooling!r}: one of {', '.join(POOLINGS)}")
        self.server = server
        self.pooling = pooling

    async def handle(self, request: Request) -> Response:
        srv = self.server
        body = await srv.body(request, EmbeddingRequest)
        engine = srv.engine
        if not hasattr(engine, "embed"):
            raise APIError(501, "embeddings are not served by this deployment")
        n_embd = engine.model.hparams.n_embd
        if body.dimensions is not None and body.dimensions != n_embd:
            raise APIError(400, f"dimensions = {body.dimensions}: this model's embeddings have {n_embd} "
                           "dimensions (vectors are not truncated)", "dimensions")
        try:
            tokens, how = await asyncio.to_thread(prepare, engine.model, body.input, pooling=self.pooling)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"input: {e}", "input") from None
        except ModelError as e:
            raise APIError(400, str(e)) from None
        try:
            vecs = await asyncio.to_thread(engine.embed, tokens, pooling=how)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), "input") from None
        except LlamaxError as e:
            raise APIError(500, str(e)) from None
        n = sum(len(t) for t in tokens)
        request.scope["state"]["llamax"] = f"embeddings={len(tokens)} prompt={n}"
        return JSONResponse({
            "object": "list", "model": srv.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vecs)],
            "usage": {"prompt_tokens": n, "total_tokens": n}})


def _encode(v: np.ndarray, fmt: str) -> list[float] | str:
    """A vector as OpenAI sends it: a list of floats, or base64 of its float32 little-endian bytes."""
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
