"""The pre-tokenizers of the model families, held against llama.cpp (llamax.model.tokenizer).

llama.cpp's ids are in tests/data/families_tok/tokenize.json (made by record.py there): one real vocabulary,
SmolLM2's byte-level BPE (with the extra multi-digit, combining-mark and newline merges the file lists, so that
the pre-tokenizers' word boundaries show in the ids), loaded by llama.cpp under each tokenizer.ggml.pre name,
and Gemma 3's SPM vocabulary with and without a space prefix. Each text (digits, contractions, CJK, emoji,
code, runs of spaces, accents, CRLF, ...) is tokenized with and without parse_special (the file keeps the
second only where it differs), and the plain ids detokenized (which shows the name's clean_spaces flag).

Families (issue 29) and their pre-tokenizer: Qwen2/2.5, DeepSeek-R1-Distill-Qwen, Qwen3 "qwen2" (and
"deepseek-r1-qwen"); Llama 3.x and SmolLM3 "llama-bpe"; Phi-4-mini "gpt-4o" (Llama 4 "llama4"); Granite 3
"refact"; OLMo 2 "dbrx" (older OLMo "olmo", "superbpe"); SmolLM2 "smollm"; Phi-3.5 and Gemma 2 are SPM.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from synthetic import write_truncated

from llamax import models
from llamax.errors import ModelError
from llamax.model.tokenizer import Tokenizer, read_gguf_metadata

DATA = Path(__file__).parent / "data" / "families_tok"
REF = json.loads((DATA / "tokenize.json").read_text())

FAMILY_PRE = {
    "Qwen2/2.5, Qwen3": "qwen2", "DeepSeek-R1-Distill-Qwen": "deepseek-r1-qwen", "Llama 3.x, SmolLM3": "llama-bpe",
    "Phi-4-mini": "gpt-4o", "Llama 4": "llama4", "Granite 3": "refact", "OLMo 2": "dbrx", "OLMo": "olmo",
    "SuperBPE": "superbpe", "SmolLM2": "smollm",
}
# names llama.cpp knows that are not implemented here (custom splitters or options llamax lacks)
UNSUPPORTED = {"tiny_aya", "jina-v1-en"}
SUPPORTED = [name for name, rec in REF["pre"].items() if "error" not in rec and name not in UNSUPPORTED]

_META: dict[str, dict] = {}


def _bpe_meta() -> dict:
    """SmolLM2's tokenizer metadata with the recording's extra merges and tokens appended, add_bos_token
    dropped."""
    if "bpe" not in _META:
        meta = read_gguf_metadata(models.path("smollm2-135m"), "tokenizer.")
        tokens = [t.decode() for t in meta["tokenizer.ggml.tokens"]]
        types = list(meta["tokenizer.ggml.token_type"])
        merges = [m.decode() for m in meta["tokenizer.ggml.merges"]]
        known = set(tokens)
        for left, right in REF["extra_merges"]:
            merges.append(f"{left} {right}")
            if left + right not in known:
                known.add(left + right)
                tokens.append(left + right)
                types.append(1)
        tokens += REF["extra_tokens"]
        types += [1] * len(REF["extra_tokens"])
        meta.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                     "tokenizer.ggml.merges": merges})
        del meta["tokenizer.ggml.add_bos_token"]
        _META["bpe"] = meta
    return _META["bpe"]


def _check(tok: Tokenizer, rec: dict) -> None:
    assert tok.add_bos == rec["add_bos"]
    bad = []
    for name, want in rec["texts"].items():
        text = REF["texts"][name]
        got = (tok.tokenize(text, add_special=True, parse_special=False),
               tok.tokenize(text, add_special=True, parse_special=True),
               tok.detokenize(want["plain"]))
        expected = (want["plain"], want.get("special", want["plain"]), want["detok"])
        if got != expected:
            bad.append(f"{name}: {got} != {expected}")
    assert not bad, "\n".join(bad)


def test_the_recording_covers_every_family():
    for family, pre in FAMILY_PRE.items():
        assert pre in SUPPORTED, (family, pre)
    assert set(REF["texts"]) >= {"digits", "contractions", "cjk", "emoji", "code", "spaces", "accents", "crlf"}


@pytest.mark.parametrize("pre", SUPPORTED)
def test_pre_tokenizer_matches_llama_cpp(pre):
    _check(Tokenizer({**_bpe_meta(), "tokenizer.ggml.pre": pre}), REF["pre"][pre])


@pytest.mark.parametrize("pre", ["gpt-4o", "qwen2", "llama-bpe"])
def test_synthetic_gguf_of_a_family_matches_llama_cpp(tmp_path, pre):
    """The same vocabulary through a GGUF file, as llama.cpp read it (write_truncated, one block)."""
    meta = _bpe_meta()
    arr, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    path = write_truncated(tmp_path / "vocab.gguf", models.path("smollm2-135m"), 1, metadata={
        "tokenizer.ggml.pre": (gguf.GGUFValueType.STRING, None, pre),
        "tokenizer.ggml.add_bos_token": None,
        "tokenizer.ggml.tokens": (arr, string, meta["tokenizer.ggml.tokens"]),
        "tokenizer.ggml.token_type": (arr, gguf.GGUFValueType.INT32, meta["tokenizer.ggml.token_type"]),
        "tokenizer.ggml.merges": (arr, string, meta["tokenizer.ggml.merges"])})
    tok = Tokenizer.from_gguf(path)
    assert tok.pre == pre
    _check(tok, REF["pre"][pre])


def test_the_extra_merges_make_pre_tokenizers_differ():
    """The recording tells the families apart: digit grouping (llama-bpe / qwen2 / superbpe / gpt-2 /
    starcoder), case splits (gpt-4o), letters with marks (qwen35), ignore_merges (llama-bpe) give different
    ids."""
    def ids(pre):
        return [REF["pre"][pre]["texts"][t]["plain"] for t in REF["texts"]]

    for a, b in [("dbrx", "llama-bpe"), ("dbrx", "qwen2"), ("gpt-2", "starcoder"), ("superbpe", "smollm"),
                 ("gpt-4o", "dbrx"), ("qwen35", "qwen2"), ("dbrx", "deepseek-v3")]:
        assert ids(a) != ids(b), (a, b)


@pytest.mark.parametrize("pre", sorted(UNSUPPORTED | {"not-a-pre-tokenizer"}))
def test_unknown_or_unsupported_pre_tokenizer_is_a_model_error(pre):
    with pytest.raises(ModelError):
        Tokenizer({**_bpe_meta(), "tokenizer.ggml.pre": pre})
    if pre == "not-a-pre-tokenizer":
        assert "error" in REF["pre"][pre]   # llama.cpp refuses it too


@pytest.mark.parametrize("variant", sorted(REF["spm"]))
def test_spm_variant_matches_llama_cpp(variant):
    """Gemma 3's SPM vocabulary as is (Gemma 2 / 3: no space prefix) and with tokenizer.ggml.add_space_prefix
    dropped (the SPM default, as Phi-3.5 and Llama 2 load)."""
    meta = dict(read_gguf_metadata(models.path("gemma3-270m"), "tokenizer."))
    for key, value in REF["spm_changes"][variant].items():
        assert value is None
        del meta[key]
    _check(Tokenizer(meta), REF["spm"][variant])
