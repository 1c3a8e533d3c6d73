"""Record llama.cpp's outputs on the synthetic recurrent models (tests/synthetic.py, seed 0): Mamba, Jamba,
Mamba-2, Granite hybrid (dense and with experts) and Nemotron-H.

Run by hand with llama-cpp-python's interpreter, never by the tests (README.md beside this file):

    /tmp/llcpp/bin/python tests/data/recurrent/record.py [VOCAB_GGUF] [MODEL ...]

VOCAB_GGUF (default: the SmolLM2-135M registry GGUF) lends its tokenizer to the models. Writes
<model>.npz and <model>.json next to this file for each MODEL of WRITERS (default: every one).
"""
import hashlib
import json
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import synthetic  # noqa: E402

VOCAB = Path.home() / ".cache/llamax/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = {
    "short": "Once upon a time, there was a",
    "medium": ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He checked the lamp, "
               "wiped the salt from the windows and wrote a short note in his logbook about the wind and the rain."),
    "long": ("Bread is one of the oldest prepared foods. To make a simple loaf, mix flour, water, salt and a little "
             "yeast in a large bowl until a rough dough forms. Cover it and let it rest for half an hour, then knead "
             "it on a floured table for ten minutes, until it feels smooth and springs back when you press it. Put "
             "the dough back in the bowl and leave it somewhere warm until it has doubled in size. Shape it into a "
             "round loaf, let it rise again while the oven heats, cut a shallow cross in the top and bake it until "
             "the crust is deep brown and the bottom sounds hollow when tapped."),
}
WRITERS = {"mamba": synthetic.write_mamba, "jamba": synthetic.write_jamba, "mamba2": synthetic.write_mamba2,
           "granitehybrid": synthetic.write_granitehybrid, "granitehybrid_moe": synthetic.write_granitehybrid_moe,
           "nemotron_h": synthetic.write_nemotron_h}
LLAMA_CPP_COMMITS = {"0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"}
N_CTX, N_BATCH, N_THREADS, N_GREEDY, TOP_K = 2048, 512, 2, 32, 5
# llama.cpp's own spread: the reference run (one batch of N_BATCH, N_THREADS) against these
VARIANTS = {"one_token_at_a_time": dict(n_batch=1), "chunks_of_7": dict(n_batch=7), "one_thread": dict(n_threads=1)}


def load(path: Path, n_batch: int = N_BATCH, n_threads: int = N_THREADS) -> llama_cpp.Llama:
    """A fresh context on the model: every row's logits kept, flash attention off, f16 KV cache."""
    return llama_cpp.Llama(str(path), n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                           n_threads_batch=n_threads, logits_all=True, flash_attn=False, verbose=False)


def prompt_logits(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    """[n_tokens, n_vocab] float32 logits of the prompt decoded from an empty memory, in n_batch chunks."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)], dtype=np.float32)


def top_k(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the TOP_K largest logits' ids (descending; ties by lower id) and values."""
    ids = np.argsort(-logits, axis=-1, kind="stable")[..., :TOP_K].astype(np.int32)
    return ids, np.take_along_axis(logits, ids, axis=-1)


def greedy(llm: llama_cpp.Llama, tokens: list[int]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """N_GREEDY tokens after the prompt, each the argmax of llama.cpp's logits and fed back one at a time;
    the top-k ids and values each was chosen from."""
    llm.reset()
    llm.eval(tokens)
    out, ids, vals = [], [], []
    for _ in range(N_GREEDY):
        i, v = top_k(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        out.append(int(i[0]))
        ids.append(i)
        vals.append(v)
        llm.eval([out[-1]])
    return out, np.array(ids), np.array(vals)


def spread(other: np.ndarray, logits: np.ndarray, ids: np.ndarray, vals: np.ndarray) -> dict:
    """How far another run's prompt logits are from the reference run's (ids, vals: its top-k)."""
    diff = np.abs(other - logits).max(axis=1)
    return {
        "last_row_max_abs_diff": float(diff[-1]),
        "top5_max_abs_diff": float(np.abs(np.take_along_axis(other, ids, axis=1) - vals).max()),
        "all_rows_max_abs_diff": float(diff.max()),
        "rows_differing": np.flatnonzero(diff).tolist(),
        "argmax_rows_differing": np.flatnonzero(other.argmax(axis=1) != ids[:, 0]).tolist(),
    }


def record(name: str, path: Path, about: dict) -> None:
    """Run every prompt through the model and write name.npz and name.json (about: the vocabulary's and
    the versions' entries of the json)."""
    llm = load(path)
    tokens = {p: llm.tokenize(text.encode(), add_bos=True, special=False) for p, text in PROMPTS.items()}
    logits = {p: prompt_logits(llm, t) for p, t in tokens.items()}
    tops = {p: top_k(x) for p, x in logits.items()}
    spreads: dict[str, dict] = {p: {} for p in PROMPTS}
    for k, kw in VARIANTS.items():  # one at a time: each context holds n_ctx rows of logits (400 MB)
        other = load(path, **kw)
        for p, t in tokens.items():
            spreads[p][k] = spread(prompt_logits(other, t), logits[p], *tops[p])
        other.close()
    arrays, prompts = {}, {}
    for p, text in PROMPTS.items():
        ids, vals = tops[p]
        g_tokens, g_ids, g_vals = greedy(llm, tokens[p])
        gaps = vals[:, 0] - vals[:, 1]
        g_gaps = g_vals[:, 0] - g_vals[:, 1]
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
    np.savez_compressed(HERE / f"{name}.npz", **arrays)
    meta = {
        "model": {"arch": name, "writer": f"tests/synthetic.py write_{name}(path, vocab_gguf, seed=0)",
                  "content_hash": synthetic.content_hash(path), **about["vocab"],
                  "n_vocab": llm.n_vocab(),
                  "add_bos": llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))},
        "settings": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_ubatch": N_BATCH, "n_threads": N_THREADS,
                     "logits_all": True, "flash_attn": False, "type_k": "f16", "type_v": "f16",
                     "tokenize": "llama_tokenize(add_special=True, parse_special=False)",
                     "variants": VARIANTS, "top_k": TOP_K, "n_greedy": N_GREEDY},
        "versions": about["versions"],
        "prompts": prompts,
    }
    (HERE / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    llm.close()


def _sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    args = sys.argv[1:]
    vocab = next((Path(a) for a in args if a.endswith(".gguf")), VOCAB)
    only = [a for a in args if not a.endswith(".gguf")]   # model names to record (default: all)
    unknown = set(only) - set(WRITERS)
    if unknown:
        sys.exit(f"unknown model {sorted(unknown)}: expected some of {', '.join(WRITERS)}")
    about = {
        "vocab": {"vocab_gguf": vocab.name, "vocab_gguf_sha256": _sha256(vocab)},
        "versions": {"llama_cpp_python": llama_cpp.__version__,
                     # the package has no call that names it; 0.3.36's CHANGELOG and sdist submodule do
                     "llama_cpp_commit": LLAMA_CPP_COMMITS.get(llama_cpp.__version__, "unknown"),
                     "system_info": llama_cpp.llama_print_system_info().decode(), "numpy": np.__version__,
                     "gguf": metadata.version("gguf")},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for arch, write in WRITERS.items():
            if only and arch not in only:
                continue
            record(arch, write(Path(tmp) / f"{arch}.gguf", vocab), about)
            print(f"recorded {arch}", flush=True)


if __name__ == "__main__":
    main()
