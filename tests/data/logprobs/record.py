"""Record llama.cpp's token logprobs on the two registry models, for tests/test_logprobs.py.

Run by hand with llama-cpp-python's interpreter, never by the tests:

    python tests/data/logprobs/record.py SMOLLM2_GGUF GEMMA_GGUF

(the paths of the registry GGUFs smollm2-135m and gemma3-270m: `llamax.models.path(name)`).

For each model and prompt: the prompt is tokenized by llama.cpp (add_special, parse_special) and
continued by 16 greedy tokens (flash attention off, one token at a time). The whole sequence is then
decoded again in one batch with logits for every position (logits_all=True), once with flash attention
off and once on, and the logprobs are log_softmax of llama.cpp's own scores (the raw logits row,
before any sampler stage: llama-server's n_probs), computed here in float64:

    lp[i]          the logprob of tokens[i + 1] in row i          [n_tokens - 1]
    top_ids[i]     the 5 most likely ids of row i (ties: lower id) [n_tokens, 5]
    top_lp[i]      their logprobs                                  [n_tokens, 5]

Writes <model>.npz (keys <prompt>__tokens, <prompt>__{fa_off,fa_on}__{lp,top_ids,top_lp}) and
<model>.json (settings, n_prompt per prompt, and llama.cpp's own flash-attention on/off spread:
the largest |lp_on - lp_off| over the chosen tokens and over the top-5 ids).
"""
import json
import sys
from importlib import metadata
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
PROMPTS = {
    "capital": "The capital of France is",
    "chat": {
        "smollm2-135m": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                         "Write a haiku about llamas.<|im_end|>\n<|im_start|>assistant\n"),
        "gemma3-270m": ("<start_of_turn>user\nYou are a helpful assistant.\n\nWrite a haiku about llamas."
                        "<end_of_turn>\n<start_of_turn>model\n"),
    },
    "prose": "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were",
}
N_CTX, N_BATCH, N_THREADS, N_GREEDY, TOP_K = 512, 512, 2, 16, 5


def load(path: str, flash_attn: bool) -> llama_cpp.Llama:
    return llama_cpp.Llama(path, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=N_THREADS,
                           n_threads_batch=N_THREADS, logits_all=True, flash_attn=flash_attn, verbose=False)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    mx = x.max(axis=-1, keepdims=True)
    return x - mx - np.log(np.exp(x - mx).sum(axis=-1, keepdims=True))


def greedy(llm: llama_cpp.Llama, prompt: list[int]) -> list[int]:
    """prompt + N_GREEDY greedy tokens, decoded one token at a time after the prompt."""
    llm.reset()
    llm.eval(prompt)
    toks = list(prompt)
    for _ in range(N_GREEDY):
        t = int(np.argmax(np.asarray(llm.scores[len(toks) - 1], dtype=np.float32)))
        toks.append(t)
        llm.eval([t])
    return toks


def logprobs(llm: llama_cpp.Llama, tokens: list[int]) -> dict[str, np.ndarray]:
    """The whole sequence decoded in one batch: the logprobs of the next tokens and each row's top 5."""
    llm.reset()
    llm.eval(tokens)
    lsm = log_softmax(np.array(llm.scores[:len(tokens)], dtype=np.float32))
    top_ids = np.argsort(-lsm, axis=-1, kind="stable")[:, :TOP_K].astype(np.int32)
    return {"lp": lsm[np.arange(len(tokens) - 1), tokens[1:]],
            "top_ids": top_ids, "top_lp": np.take_along_axis(lsm, top_ids, axis=-1),
            "lsm": lsm}


def record(name: str, path: str) -> None:
    off, on = load(path, False), load(path, True)
    arrays, meta = {}, {"n_prompt": {}}
    spread_chosen = spread_top = 0.0
    for pname, text in PROMPTS.items():
        text = text[name] if isinstance(text, dict) else text
        prompt = off.tokenize(text.encode(), add_bos=True, special=True)
        tokens = greedy(off, prompt)
        r_off, r_on = logprobs(off, tokens), logprobs(on, tokens)
        spread_chosen = max(spread_chosen, float(np.abs(r_off["lp"] - r_on["lp"]).max()))
        ids = r_off["top_ids"]
        spread_top = max(spread_top, float(np.abs(np.take_along_axis(r_off["lsm"], ids, -1)
                                                  - np.take_along_axis(r_on["lsm"], ids, -1)).max()))
        arrays[f"{pname}__tokens"] = np.array(tokens, dtype=np.int32)
        for fa, r in (("fa_off", r_off), ("fa_on", r_on)):
            for key in ("lp", "top_ids", "top_lp"):
                arrays[f"{pname}__{fa}__{key}"] = r[key].astype(np.int32 if key == "top_ids" else np.float64)
        meta["n_prompt"][pname] = len(prompt)
    meta.update(model=name, gguf=Path(path).name, llama_cpp_python=metadata.version("llama_cpp_python"),
                n_ctx=N_CTX, n_batch=N_BATCH, n_threads=N_THREADS, n_greedy=N_GREEDY, top_k=TOP_K,
                logprobs="log_softmax (float64) of llama.cpp's scores with logits_all=True",
                fa_spread={"chosen": spread_chosen, "top5": spread_top})
    np.savez_compressed(HERE / f"{name}.npz", **arrays)
    (HERE / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(name, meta["fa_spread"])


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    record("smollm2-135m", sys.argv[1])
    record("gemma3-270m", sys.argv[2])


if __name__ == "__main__":
    main()
