"""Record llama.cpp's outputs on the synthetic qwen35 model (tests/synthetic_qwen35.py, seed 0).

Run by hand with llama-cpp-python's interpreter, never by the tests (README.md beside this file):

    <llama-cpp-python's python> tests/data/qwen35/record.py [VOCAB_GGUF]

VOCAB_GGUF (default: the SmolLM2-135M registry GGUF) lends its tokenizer to the model. Writes qwen35.npz and
qwen35.json next to this file, in the layout of tests/data/recurrent/ (the prompts, settings, spread variants
and helpers of tests/data/recurrent/record.py).
"""
import json
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))             # tests/
sys.path.insert(0, str(HERE.parent / "recurrent"))   # the recurrent models' recorder
import synthetic  # noqa: E402
import synthetic_qwen35  # noqa: E402
from record import (LLAMA_CPP_COMMITS, N_BATCH, N_CTX, N_GREEDY, N_THREADS, PROMPTS, TOP_K, VARIANTS,  # noqa: E402
                    VOCAB, _sha256, greedy, load, prompt_logits, spread, top_k)


def record(path: Path, about: dict) -> None:
    """Every prompt through the model: qwen35.npz and qwen35.json (about: the vocabulary's and versions' entries)."""
    llm = load(path)
    tokens = {p: llm.tokenize(text.encode(), add_bos=True, special=False) for p, text in PROMPTS.items()}
    logits = {p: prompt_logits(llm, t) for p, t in tokens.items()}
    tops = {p: top_k(x) for p, x in logits.items()}
    spreads: dict[str, dict] = {p: {} for p in PROMPTS}
    for k, kw in VARIANTS.items():
        other = load(path, **kw)
        for p, t in tokens.items():
            spreads[p][k] = spread(prompt_logits(other, t), logits[p], *tops[p])
        other.close()
    arrays, prompts = {}, {}
    for p, text in PROMPTS.items():
        ids, vals = tops[p]
        g_tokens, g_ids, g_vals = greedy(llm, tokens[p])
        gaps, g_gaps = vals[:, 0] - vals[:, 1], g_vals[:, 0] - g_vals[:, 1]
        arrays.update({f"{p}__tokens": np.array(tokens[p], np.int32), f"{p}__last_logits": logits[p][-1],
                       f"{p}__top5_ids": ids, f"{p}__top5_vals": vals,
                       f"{p}__greedy_tokens": np.array(g_tokens, np.int32),
                       f"{p}__greedy_top5_ids": g_ids, f"{p}__greedy_top5_vals": g_vals})
        prompts[p] = {
            "text": text, "n_tokens": len(tokens[p]), "tokens": tokens[p],
            "greedy_tokens": g_tokens, "greedy_text": llm.detokenize(g_tokens).decode(errors="replace"),
            "greedy_gaps": [round(float(x), 4) for x in g_gaps],
            "prompt_gaps": {"min": float(gaps.min()), "median": float(np.median(gaps)),
                            "rows_below_0.1": int((gaps < 0.1).sum())},
            "logits": {"min": float(logits[p].min()), "max": float(logits[p].max()),
                       "std_last_row": float(logits[p][-1].std())},
            "spread": spreads[p],
            "spread_max": {k: max(s[f"{k}_max_abs_diff"] for s in spreads[p].values())
                           for k in ("last_row", "top5", "all_rows")},
        }
    np.savez_compressed(HERE / "qwen35.npz", **arrays)
    meta = {
        "model": {"arch": "qwen35", "writer": "tests/synthetic_qwen35.py write_qwen35(path, vocab_gguf, seed=0)",
                  "content_hash": synthetic.content_hash(path), **about["vocab"], "n_vocab": llm.n_vocab(),
                  "add_bos": llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))},
        "settings": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_ubatch": N_BATCH, "n_threads": N_THREADS,
                     "logits_all": True, "flash_attn": False, "type_k": "f16", "type_v": "f16",
                     "tokenize": "llama_tokenize(add_special=True, parse_special=False)",
                     "variants": VARIANTS, "top_k": TOP_K, "n_greedy": N_GREEDY},
        "versions": about["versions"],
        "prompts": prompts,
    }
    (HERE / "qwen35.json").write_text(json.dumps(meta, indent=1) + "\n")
    llm.close()


def main() -> None:
    vocab = Path(sys.argv[1]) if len(sys.argv) > 1 else VOCAB
    about = {
        "vocab": {"vocab_gguf": vocab.name, "vocab_gguf_sha256": _sha256(vocab)},
        "versions": {"llama_cpp_python": llama_cpp.__version__,
                     "llama_cpp_commit": LLAMA_CPP_COMMITS.get(llama_cpp.__version__, "unknown"),
                     "system_info": llama_cpp.llama_print_system_info().decode(), "numpy": np.__version__,
                     "gguf": metadata.version("gguf")},
    }
    with tempfile.TemporaryDirectory() as tmp:
        record(synthetic_qwen35.write_qwen35(Path(tmp) / "qwen35.gguf", vocab), about)
    print("recorded qwen35", flush=True)


if __name__ == "__main__":
    main()
