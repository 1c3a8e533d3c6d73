"""Record llama.cpp's embeddings of the two registry models for tests/test_embed.py.

Run by hand with llama-cpp-python's interpreter (0.3.36), never by the tests:

    python tests/data/embeddings/record.py SMOLLM2_GGUF GEMMA3_GGUF

(the GGUFs of `llamax.models.path("smollm2-135m")` and `llamax.models.path("gemma3-270m")`). Writes
<model>.npz next to this file, for model in smollm2-135m, gemma3-270m: for each pooling (mean, last,
cls) the L2-normalized embeddings [n_inputs, n_embd] float32 of INPUTS (key <pooling>: flash attention
off, the reference; key <pooling>_fa: on, llama.cpp's own spread that the tests' tolerance is derived
from) and the token ids llama.cpp embedded (inputs tokenized by llama_tokenize with add_special=True, parse_special=False, as
Llama.embed does), and <model>.json with the settings.

Settings: Llama(model_path, embedding=True, pooling_type=..., n_ctx=N_CTX, n_batch=N_BATCH,
n_ubatch=N_BATCH, n_threads=2, flash_attn=False / True), one input per decode from an empty memory, embed(inputs,
normalize=True).
"""
import json
import sys
from importlib import metadata
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
N_CTX, N_BATCH, N_THREADS = 1024, 512, 2
POOLINGS = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
            "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS}
INPUTS = [
    "Hello",
    "The capital of France is Paris.",
    "Zürich, São Paulo, Kraków and 東京: naïve café owners say “déjà vu” — 🎉 emoji too.",
    ("Bread is one of the oldest prepared foods. To make a simple loaf, mix flour, water, salt and a little "
     "yeast in a large bowl until a rough dough forms. Cover it and let it rest for half an hour, then knead "
     "it on a floured table for ten minutes, until it feels smooth and springs back when you press it. Put "
     "the dough back in the bowl and leave it somewhere warm until it has doubled in size. Shape it into a "
     "round loaf, let it rise again while the oven heats, cut a shallow cross in the top and bake it until "
     "the crust is deep brown and the bottom sounds hollow when tapped. Let it cool on a rack for an hour "
     "before you slice it, or the crumb will be gummy. A good loaf keeps for three days wrapped in a cloth, "
     "and stale bread makes fine toast, crumbs for frying fish, or a pudding with milk, eggs and raisins."),
]


def record(name: str, path: str) -> None:
    out: dict[str, np.ndarray] = {}
    for pname, ptype in POOLINGS.items():
        for fa, key in ((False, pname), (True, f"{pname}_fa")):
            llm = llama_cpp.Llama(path, embedding=True, pooling_type=ptype, n_ctx=N_CTX, n_batch=N_BATCH,
                                  n_ubatch=N_BATCH, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                                  flash_attn=fa, verbose=False)
            out[key] = np.array([llm.embed(s, normalize=True) for s in INPUTS], dtype=np.float32)
            if key == "mean":
                toks = [llm.tokenize(s.encode("utf-8")) for s in INPUTS]
                out["lengths"] = np.array([len(t) for t in toks], dtype=np.int32)
                out["tokens"] = np.concatenate([np.array(t, dtype=np.int32) for t in toks])
            del llm
    np.savez_compressed(HERE / f"{name}.npz", **out)
    meta = {"model": Path(path).name, "llama_cpp_python": metadata.version("llama_cpp_python"),
            "n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS, "normalize": True,
            "flash_attn": {"<pooling>": False, "<pooling>_fa": True},
            "poolings": list(POOLINGS), "inputs": INPUTS}
    (HERE / f"{name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(name, {k: v.shape for k, v in out.items()})


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    record("smollm2-135m", sys.argv[1])
    record("gemma3-270m", sys.argv[2])
