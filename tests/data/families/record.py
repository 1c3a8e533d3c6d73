"""Record llama.cpp's outputs on the synthetic model families (tests/synthetic_families.py, seed 0).

Run by hand with llama-cpp-python's interpreter (it needs gguf and numpy), never by the tests:

    python tests/data/families/record.py [VOCAB_GGUF] [NAME ...]

VOCAB_GGUF (default: the SmolLM2-135M registry GGUF) lends its tokenizer to the models. Writes <name>.npz and
<name>.json next to this file for every name of synthetic_families.FAMILIES (or those given), with the
prompts, settings and spread measurement of tests/data/recurrent/record.py.
"""
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import synthetic_families  # noqa: E402

_spec = importlib.util.spec_from_file_location("recurrent_record", HERE.parent / "recurrent" / "record.py")
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)
rec.HERE = HERE   # write here


def main() -> None:
    args = sys.argv[1:]
    vocab = Path(args.pop(0)) if args and args[0].endswith(".gguf") else rec.VOCAB
    names = args or list(synthetic_families.FAMILIES)
    about = {
        "vocab": {"vocab_gguf": vocab.name, "vocab_gguf_sha256": rec._sha256(vocab)},
        "versions": {"llama_cpp_python": llama_cpp.__version__,
                     "llama_cpp_commit": rec.LLAMA_CPP_COMMITS.get(llama_cpp.__version__, "unknown"),
                     "system_info": llama_cpp.llama_print_system_info().decode(), "numpy": np.__version__},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = synthetic_families.write_family(Path(tmp) / f"{name}.gguf", vocab, name)
            rec.record(name, path, about)
            meta = json.loads((HERE / f"{name}.json").read_text())
            meta["model"]["arch"] = synthetic_families.FAMILIES[name][0]
            meta["model"]["writer"] = f"tests/synthetic_families.py write_family(path, vocab_gguf, {name!r}, seed=0)"
            (HERE / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
            print(f"recorded {name}", flush=True)


if __name__ == "__main__":
    main()
