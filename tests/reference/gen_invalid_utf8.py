"""Dev script (NOT run by the tests): regenerate tests/reference/tokenize_invalid_utf8.json.

llama.cpp's llama_tokenize on byte strings that are not valid UTF-8, for the two registry models:
SmolLM2 (BPE, pre-tokenizer "smollm": unicode_cpts_from_utf8 decodes leniently, overlong forms
and surrogates included) and Gemma 3 (SPM: the raw bytes are split by the length their lead byte
announces, without validation, and what is no token falls back to <0xXX> byte tokens). The set is
systematic (lone continuation bytes, truncated 2/3/4-byte sequences at the end and in the middle,
overlong encodings, surrogates, values above U+10FFFF, F5..FF and C0/C1 lead bytes), each
sequence alone and between ASCII letters, spaces, newlines, digits, CJK and emoji, plus seeded
random byte soup, a few special tokens beside invalid bytes, and valid strings as a control;
every string with add_special False and True.

The oracle is llama-cpp-python (0.3.16 here) in its own venv, run in a child process that this
script restarts when llama.cpp aborts: a BPE text whose lenient decoding holds a code point above
U+10FFFF makes unicode_cpt_to_utf8 throw out of llama_tokenize (std::terminate). Such entries are
recorded with ids = null ("llama.cpp aborts"); llamax raises ValueError for them.

Usage (from the repository root, with the project venv):

    .venv/bin/python tests/reference/gen_invalid_utf8.py [--oracle-python PY]

Output: {"generator": ..., "oracle": ..., "models": {registry name: {"gguf": file name,
"cases": [[hex, add_special, parse_special, ids or null], ...]}}}.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).with_name("tokenize_invalid_utf8.json")
MODELS = ("smollm2-135m", "gemma3-270m")
SPECIALS = {"smollm2-135m": "<|im_start|>", "gemma3-270m": "<start_of_turn>"}

# ---- the byte strings ---------------------------------------------------------------------------

LONE_CONTINUATION = ["80", "8a", "8f", "90", "9f", "a0", "bf", "8080", "80bf80", "bfbfbfbf"]
TRUNCATED = [
    "c2", "c3", "df",                        # 2-byte lead alone
    "e0", "e2", "e282", "ed", "ef", "efbf",  # 3-byte lead alone / one continuation short
    "e4b8",                                  # CJK U+4E2D without its last byte
    "f0", "f09f", "f09f98", "f0908d", "f4", "f48f", "f48fbf",  # 4-byte, 1..3 bytes of it
]
OVERLONG = [
    "c080", "c08a", "c0a0", "c0af", "c0b1", "c0bc", "c0a7", "c181", "c1bf",  # 2-byte forms of ASCII
    "e08080", "e0808a", "e080af", "e081a0", "e09fbf",                        # 3-byte forms < U+0800
    "f0808080", "f080808a", "f08081a0", "f08fbfbf",                          # 4-byte forms < U+10000
]
SURROGATES = ["eda080", "edadbf", "edae80", "edafbf", "edb080", "edbfbf", "eda0bdedb880"]
ABOVE_MAX = ["f4908080", "f4bfbfbf", "f5808080", "f6808080", "f7bfbfbf"]
HIGH_LEADS = ["c0", "c1", "f5", "f6", "f7", "f8", "f9", "fa", "fb", "fc", "fd", "fe", "ff",
              "f888808080", "fc8480808080", "feff", "fffe"]
MISC = ["c3c3a9", "e2c3a9", "f09fc3a9", "c3e282ac", "e282f09f9880", "8041", "c341", "e241",
        "f04142", "e28220", "f09f0a", "c30a", "ed9fbf", "ee8080", "efbfbd80", "c2a0c2"]
INVALID = LONE_CONTINUATION + TRUNCATED + OVERLONG + SURROGATES + ABOVE_MAX + HIGH_LEADS + MISC

# contexts: (prefix, suffix) as UTF-8 text around an invalid sequence
CONTEXTS = [("a", "b"), (" ", " "), ("\n", "\n"), ("12", "34"), ("中", "文"), ("😀", "😀"),
            ("Hello ", "world"), ("x  ", "  y"), ("", "'s"), ("é", "")]

VALID = ["", "a", " ", "\n", "Hello world", "  leading spaces", "trailing  ", "tabs\tand\nnewlines\r\n",
         "1234567890", "3.14159 and 2,718", "café naïve", "中文字符", "日本語のテキスト", "한국어",
         "😀😃🙂", "👍🏽 family 👨‍👩‍👧", "Ωμέγα", "Привет мир", "عربي", "\u00a0nbsp\u2009thin",
         "e\u0301 combining", "\ufffd", "a\ufffdb", "\uffff\ufffe", "\U0010ffff", "\U00010000",
         "\u0800\u07ff", "don't you've we'll", "<html>&amp;</html>", "x" * 40, " " * 7 + "z",
         "mixed 12中文😀 ok"]


def _seq(h: str) -> bytes:
    return bytes.fromhex(h)


def byte_strings() -> list[bytes]:
    """Every test string, deterministic and without duplicates (order kept)."""
    out: list[bytes] = []
    for h in INVALID:
        out.append(_seq(h))
    for i, h in enumerate(INVALID):
        # each sequence in three of the contexts, rotating so that all contexts are used evenly
        for k in range(3):
            pre, suf = CONTEXTS[(3 * i + k) % len(CONTEXTS)]
            out.append(pre.encode() + _seq(h) + suf.encode())
    for pre, suf in CONTEXTS:
        out.append(pre.encode() + b"\xc0\x8a" + b"\xed\xa0\x80" + suf.encode())
    rng = random.Random(20240901)
    pieces = [_seq(h) for h in INVALID] + [s.encode() for s in ("a", " ", "\n", "7", "中", "😀", "ab", "  ")]
    for _ in range(60):
        out.append(b"".join(rng.choice(pieces) for _ in range(rng.randint(2, 7))))
    for s in VALID:
        out.append(s.encode())
    seen: set[bytes] = set()
    return [b for b in out if not (b in seen or seen.add(b))]


def special_strings(special: str) -> list[bytes]:
    """Invalid bytes around (and inside) a special token's text, for parse_special=True."""
    sp = special.encode()
    half = len(sp) // 2
    return [b"\xc3" + sp, sp + b"\x80", b"\xe2\x82" + sp + b"\xe2\x82", b"\xc0\x8a" + sp + b"\xc0\x8a",
            sp[:half] + b"\xff" + sp[half:], b"\xed\xa0\x80 " + sp + b" \xf0\x9f", b"\xc0\xbc" + sp[1:],
            b"x" + sp + b"\xc1\xbf y"]


# ---- the oracle ---------------------------------------------------------------------------------

_CHILD = r"""
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
for line in sys.stdin:
    h, add_special, parse_special = json.loads(line)
    ids = llm.tokenize(bytes.fromhex(h), add_bos=add_special, special=parse_special)
    sys.stdout.write(json.dumps(ids) + "\n")
    sys.stdout.flush()
"""


class Oracle:
    """llama-cpp-python in a child process; restarted after llama.cpp aborts."""

    def __init__(self, python: str, gguf: Path) -> None:
        self.python, self.gguf, self.proc = python, gguf, None

    def _start(self) -> None:
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        self.proc = subprocess.Popen([self.python, "-c", _CHILD, str(self.gguf)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def tokenize(self, data: bytes, add_special: bool, parse_special: bool) -> list[int] | None:
        """llama.cpp's ids, or None when llama_tokenize aborted the process."""
        if self.proc is None:
            self._start()
        self.proc.stdin.write(json.dumps([data.hex(), add_special, parse_special]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.proc = None
            return None
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None


def version(python: str) -> str:
    return subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oracle-python", default=os.environ.get("LLAMAX_LCPP_PYTHON"),
                    required="LLAMAX_LCPP_PYTHON" not in os.environ,
                    help="a Python with llama-cpp-python installed (default: $LLAMAX_LCPP_PYTHON)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from llamax import models

    strings = byte_strings()
    result = {"generator": "tests/reference/gen_invalid_utf8.py",
              "oracle": f"llama-cpp-python {version(args.oracle_python)} llama_tokenize",
              "models": {}}
    for name in MODELS:
        gguf = models.path(name)
        oracle = Oracle(args.oracle_python, gguf)
        cases = []
        jobs = [(b, a, False) for b in strings for a in (False, True)]
        jobs += [(b, a, True) for b in special_strings(SPECIALS[name]) for a in (False, True)]
        for data, add_special, parse_special in jobs:
            ids = oracle.tokenize(data, add_special, parse_special)
            cases.append([data.hex(), add_special, parse_special, ids])
        oracle.close()
        n_abort = sum(c[3] is None for c in cases)
        print(f"{name}: {len(cases)} cases ({len(strings)} strings), {n_abort} where llama.cpp aborts",
              file=sys.stderr)
        result["models"][name] = {"gguf": gguf.name, "cases": cases}
    text = json.dumps(result, separators=(",", ":"))
    # one case per line keeps the file diffable
    text = text.replace("],[", "],\n[")
    args.out.write_text(text + "\n")
    print(f"wrote {args.out} ({len(text) // 1024} KB)", file=sys.stderr)


if __name__ == "__main__":
    main()
