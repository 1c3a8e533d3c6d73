"""Text generation over a context: prompt, then sample/decode until an end-of-generation token."""
from __future__ import annotations

import time
from dataclasses import dataclass

from llamax.batch import Batch
from llamax.sampling import Sampler


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    stop: str = ""  # "eog", "length" or "context"

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0

    def __str__(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens in {self.prompt_s:.3f} s ({self.prompt_tps:.1f} t/s), "
                f"generation: {self.gen_tokens} tokens in {self.gen_s:.3f} s ({self.gen_tps:.1f} t/s), "
                f"stop: {self.stop}")


def decode_prompt(ctx, tokens: list[int], seq_id: int = 0) -> None:
    """Feed a prompt in chunks of n_batch tokens; logits on its last token."""
    n_batch = ctx.params.n_batch
    for s in range(0, len(tokens), n_batch):
        chunk = tokens[s:s + n_batch]
        last = s + n_batch >= len(tokens)
        ctx.decode(Batch(chunk, seq_ids=[seq_id] * len(chunk),
                         logits=[False] * (len(chunk) - 1) + [last]))


class Generation:
    """An iterator of text pieces; `stats` holds the counts and speeds once it has run.

    Args:
        ctx: the context (its sequence seq_id continues from what it holds).
        prompt: text (tokenized with special tokens parsed, BOS as the model wants) or token ids.
        max_tokens: most tokens to generate.
        sampler: defaults to llamax.Sampler().
    """

    def __init__(self, ctx, prompt, max_tokens: int = 128, sampler: Sampler | None = None, seq_id: int = 0) -> None:
        self.ctx, self.model = ctx, ctx.model
        self.tokens = (self.model.tokenize(prompt, add_special=True, parse_special=True) if isinstance(prompt, str)
                       else [int(t) for t in prompt])
        if not self.tokens:
            raise ValueError("empty prompt")
        self.max_tokens, self.seq_id = int(max_tokens), seq_id
        self.sampler = sampler if sampler is not None else Sampler()
        self.generated: list[int] = []
        self.stats = GenerationStats()
        self._it = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._it)

    def _run(self):
        from llamax.model.tokenizer import TextStream

        ctx, st = self.ctx, self.stats
        t0 = time.perf_counter()
        decode_prompt(ctx, self.tokens, self.seq_id)
        st.prompt_tokens, st.prompt_s = len(self.tokens), time.perf_counter() - t0
        stream = TextStream(self.model.tokenizer)
        t0 = time.perf_counter()
        st.stop = "length"
        for _ in range(self.max_tokens):
            tok = self.sampler.sample(ctx, -1)
            if self.model.is_eog(tok):
                st.stop = "eog"
                break
            self.generated.append(tok)
            st.gen_tokens += 1
            piece = stream.push(tok)
            if piece:
                yield piece
            if ctx.memory.seq_pos_max(self.seq_id) + 1 >= ctx.params.n_ctx_seq:
                st.stop = "context"
                break
            ctx.decode(Batch([tok], seq_ids=[self.seq_id]))
            st.gen_s = time.perf_counter() - t0
        st.gen_s = time.perf_counter() - t0
        tail = stream.flush()
        if tail:
            yield tail


def generate(ctx, prompt, max_tokens: int = 128, sampler: Sampler | None = None, seq_id: int = 0) -> Generation:
    """Stream the text generated after `prompt` on sequence seq_id (see Generation)."""
    return Generation(ctx, prompt, max_tokens, sampler, seq_id)
