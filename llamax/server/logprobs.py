"""Token logprobs in the shapes OpenAI's API gives them (llamax.TokenLogprob -> JSON).

    chat         choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
                 [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": None}
    completions  choices[i].logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs":
                 [{token: logprob, ...}, ...], "text_offset": [...]}; with echo the prompt's tokens
                 come first, the first of them with null logprob and top_logprobs, as OpenAI gives them

A token's text is its piece decoded leniently (a piece that splits a UTF-8 character shows U+FFFD);
`bytes` carries its raw bytes, as OpenAI's does for that reason.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from llamax.sequence import TokenLogprob

Piece = Callable[[int], bytes]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def chat_content(items: Sequence[TokenLogprob], piece: Piece) -> list[dict]:
    """The `content` list of chat logprobs for these tokens."""
    out = []
    for t in items:
        raw = piece(t.token)
        out.append({"token": _text(raw), "logprob": t.logprob, "bytes": list(raw),
                    "top_logprobs": [{"token": _text(piece(i)), "logprob": lp, "bytes": list(piece(i))}
                                     for i, lp in t.top]})
    return out


def chat(items: Sequence[TokenLogprob], piece: Piece) -> dict:
    return {"content": chat_content(items, piece), "refusal": None}


def completion(tokens: Sequence[int], items: Sequence[TokenLogprob | None], piece: Piece,
               offset: int = 0) -> dict:
    """Legacy completions logprobs of tokens (items[i] is tokens[i]'s; None, the first prompt token's
    with echo, gives null logprobs). offset: the text offset of the first token."""
    texts: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = offset
    for tok, t in zip(tokens, items):
        s = _text(piece(tok))
        texts.append(s)
        offsets.append(pos)
        pos += len(s)
        if t is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(t.logprob)
        top: dict[str, float] = {}
        for i, lp in t.top:  # two ids with one text (rare): the more likely one stays
            top.setdefault(_text(piece(i)), lp)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
