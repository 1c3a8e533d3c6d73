"""Benchmark of llamax's tokenizer on the long prompt of llama.cpp's logits reference (~1.3k tokens).

For each registry model (SmolLM2: byte-level BPE; Gemma 3: SPM), the median over --runs runs of
  * tokenize, cold: the per-word BPE cache emptied before each run (a prompt never seen before);
  * tokenize, warm: the same prompt again (its words cached; SPM has no cache);
  * detokenize of the ids, and a TextStream over them (token by token);
and, as the baseline measured in the same run, numpy turning the text's UTF-8 bytes into an int32
array (one "token" per byte: the floor of any tokenizer), with each time's ratio to it.

    PYTHONPATH=. python benchmarks/bench_tokenizer.py [--runs 9] [--models smollm2-135m,gemma3-270m]
"""
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from timing import median_time

from llamax import models
from llamax.model.tokenizer import TextStream, Tokenizer

REF = {"smollm2-135m": "smollm2-135m-instruct-q4_1", "gemma3-270m": "gemma-3-270m-q4_k_m"}


def long_prompt(name: str) -> tuple[str, list[int] | None]:
    root = Path(os.environ.get("LLAMAX_REFERENCE_DIR", Path(__file__).resolve().parents[2] / "shared" / "reference"))
    path = root / REF[name] / "ref_logits.json"
    if path.exists():
        for p in json.loads(path.read_text())["prompts"]:
            if p["name"] == "long_1k3":
                return p["text"], p["tokens"]
    text = " ".join(f"({i}) The history of computing is a story of abstractions layered upon abstractions."
                    for i in range(80))
    return text, None


def bench_model(name: str, runs: int) -> None:
    """Time one registry model's tokenizer on its long reference prompt and print the table."""
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(models.path(name))
    load_s = time.perf_counter() - t0
    text, ref = long_prompt(name)
    ids = tok.tokenize(text)
    exact = "n/a" if ref is None else ("yes" if ids == ref else "NO")
    base = 1e3 * median_time(lambda: np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32), runs,
                             warmup=0)

    def stream() -> str:
        s = TextStream(tok)
        return "".join(s.push(i) for i in ids) + s.flush()

    rows = [
        ("tokenize (cold)", 1e3 * median_time(lambda: tok.tokenize(text), runs, warmup=0, setup=tok._bpe_cache.clear)),
        ("tokenize (warm)", 1e3 * median_time(lambda: tok.tokenize(text), runs, warmup=0)),
        ("detokenize", 1e3 * median_time(lambda: tok.detokenize(ids), runs, warmup=0)),
        ("TextStream", 1e3 * median_time(stream, runs, warmup=0)),
    ]
    print(f"{name}: {tok.vocab_type.upper()} n_vocab={tok.n_vocab}, vocabulary loaded in {load_s:.2f} s; "
          f"prompt {len(text)} chars -> {len(ids)} tokens (equal to llama.cpp's: {exact})")
    print(f"  {'numpy bytes->ids (baseline)':<30} {base:8.3f} ms")
    for label, ms in rows:
        print(f"  {label:<30} {ms:8.3f} ms   {ms / base:8.1f}x baseline   {len(ids) / ms * 1e3:12,.0f} tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    args = ap.parse_args()
    for name in args.models.split(","):
        bench_model(name, max(5, args.runs))


if __name__ == "__main__":
    main()
