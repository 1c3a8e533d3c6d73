"""A short tour of the memory system with a tiny random model (no GGUF needed).

Four sequences share a prompt through seq_cp, decode together in one batch, then one of them
drops old tokens and shifts the rest (a context shift), all through the standalone KVCache API.
"""
from __future__ import annotations

import time

import numpy as np

from llamax._native import rope as _rope
from llamax.batch import Batch
from llamax.memory.kv_cache import KVCache
from llamax.rope import RoPE


class ToyModel:
    """A 2-layer attention-only model with random weights: enough to drive the cache for real."""

    def __init__(self, n_vocab=64, n_embd=64, n_head=4, n_head_kv=2, n_layer=2, seed=0):
        rng = np.random.default_rng(seed)
        self.n_vocab, self.n_head, self.n_head_kv, self.n_layer = n_vocab, n_head, n_head_kv, n_layer
        self.d = n_embd // n_head
        s = 1 / np.sqrt(n_embd)
        self.tok = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
        self.wq = [(rng.standard_normal((n_embd, n_embd)) * s).astype(np.float32) for _ in range(n_layer)]
        self.wk = [(rng.standard_normal((n_embd, n_head_kv * self.d)) * s).astype(np.float32) for _ in range(n_layer)]
        self.wv = [(rng.standard_normal((n_embd, n_head_kv * self.d)) * s).astype(np.float32) for _ in range(n_layer)]
        self.wo = [(rng.standard_normal((n_embd, n_embd)) * s).astype(np.float32) for _ in range(n_layer)]
        self.out = rng.standard_normal((n_embd, n_vocab)).astype(np.float32)
        self.rope = RoPE(self.d, kind="neox")

    def decode(self, kv: KVCache, batch: Batch) -> np.ndarray:
        """Logits [n_outputs, n_vocab] for the batch, in batch order."""
        plan = kv.plan(batch, n_ubatch=8)
        outs = []
        for ub in plan:
            x = self.tok[ub.token]
            for il in range(self.n_layer):
                q = (x @ self.wq[il]).reshape(ub.n_tokens, self.n_head, self.d)
                k = (x @ self.wk[il]).reshape(ub.n_tokens, self.n_head_kv, self.d)
                v = (x @ self.wv[il]).reshape(ub.n_tokens, self.n_head_kv, self.d)
                for t in (q, k):
                    _rope.rope_f32(t, ub.pos, self.d, 10000.0, 1.0, self.rope.mode, kv.n_threads)
                kv.store(il, ub, k, v)
                x = x + kv.attend(il, ub, q).reshape(ub.n_tokens, -1) @ self.wo[il]
            outs.append((ub.idx[ub.output], np.tanh(x[ub.output]) @ self.out))
        order = np.concatenate([i for i, _ in outs])
        logits = np.concatenate([l for _, l in outs])
        return logits[np.argsort(order, kind="stable")]


def run(out=print) -> None:
    model = ToyModel()
    kv = KVCache(model.n_layer, model.n_head_kv, model.d, 64, n_seq_max=4, rope=model.rope)
    out(f"KV cache: {kv.summary()}")
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32]
    t0 = time.perf_counter()
    logits = model.decode(kv, Batch.one(prompt, seq_id=0))
    for s in (1, 2, 3):
        kv.seq_cp(0, s)  # the prompt's cells are shared, not copied
    out(f"prompt of {len(prompt)} tokens decoded on seq 0 and shared with seqs 1-3: {kv.n_used} cells used")
    nxt = [int(np.argmax(logits[-1])) + s for s in range(4)]  # a different first token per sequence
    texts = [[t] for t in nxt]
    for step in range(10):
        logits = model.decode(kv, Batch(nxt, seq_ids=[0, 1, 2, 3], logits=[True] * 4))
        nxt = [int(np.argmax(row)) for row in logits]
        for s in range(4):
            texts[s].append(nxt[s])
    dt = time.perf_counter() - t0
    for s in range(4):
        out(f"  seq {s}: positions {kv.seq_pos_min(s)}..{kv.seq_pos_max(s)}, tokens {texts[s]}")
    out("cell map ('.' empty, digit = the one sequence, 'M' = shared):")
    out(kv.meta.dump())
    # context shift on seq 3: keep the shared prompt, drop the next 6 positions, slide the rest back
    n_keep, n_discard = len(prompt), 6
    p_max = kv.seq_pos_max(3)
    kv.seq_rm(3, n_keep, n_keep + n_discard)
    kv.seq_add(3, n_keep + n_discard, -1, -n_discard)
    model.decode(kv, Batch([nxt[3]], seq_ids=[3]))  # applies the K-shift, then decodes
    out(f"context shift on seq 3: max position {p_max} -> {kv.seq_pos_max(3)} "
        f"(its cached K rotated to the new positions; seq 0 still ends at {kv.seq_pos_max(0)})")
    out(kv.meta.dump())
    out(f"{len(prompt) + 40 + 1} tokens through the cache in {dt * 1e3:.1f} ms")
