"""Record llama.cpp's tokenization under many pre-tokenizers, and the chat prompts of the families' templates.

Run by hand with llama-cpp-python's interpreter, never by the tests:

    <llama-cpp-python venv>/bin/python tests/data/families_tok/record.py

1. tokenize.json: for every pre-tokenizer name in PRE_TYPES, the SmolLM2-135M registry GGUF (GPT-2-style
   byte-level BPE vocabulary and merges) cut to one block by tests/synthetic.write_truncated, with
   tokenizer.ggml.pre set to that name and tokenizer.ggml.add_bos_token dropped (so the name's own add_bos
   default applies). The vocabulary gains the tokens and merges of EXTRA_MERGES (multi-digit numbers, a letter
   with a combining mark, punctuation with a newline): SmolLM2's own has none that cross the boundaries where
   the pre-tokenizers differ, so without them most would give the same ids; and EXTRA_TOKENS, words no merge
   leads to (ignore_merges). For SPM_TYPES, the Gemma 3 270M GGUF likewise with SPM settings changed. For each
   text of TEXTS: llama_tokenize(text, add_special=True) with parse_special false ("plain") and true
   ("special", kept where it differs), and llama_detokenize of the plain ids (remove_special=false,
   unparse_special=false). A name llama.cpp does not know is recorded with its load error.
2. chat.json: every template in templates/ (copied from llama.cpp's models/templates) rendered by
   llama-cpp-python's Jinja2ChatFormatter (the jinja2 environment llama-cpp-python and Transformers use) on
   the conversations of CONVERSATIONS, the clock fixed at FIXED_DATE (strftime_now); a template that raises
   is recorded with its message.
"""
import ctypes
import json
import re
import sys
import tempfile
from datetime import datetime
from importlib import metadata
from pathlib import Path

import gguf
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/
import synthetic  # noqa: E402

VOCAB_BPE = Path.home() / ".cache/llamax/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SPM = Path.home() / ".cache/llamax/gemma3-270m/gemma-3-270m-q4_k_m.gguf"
LLAMA_CPP_COMMITS = {"0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"}

# the pre-tokenizer names of the model families, one name of each group of llama.cpp's table, and more
PRE_TYPES = [
    "default", "llama-bpe", "llama3", "dbrx", "smaug-bpe", "qwen2", "deepseek-r1-qwen", "stablelm2", "megrez",
    "gpt-2", "olmo", "mpt", "trillion", "granite-docling", "starcoder", "refact", "smollm", "command-r",
    "gpt-4o", "llama4", "superbpe", "falcon", "jina-v1-en", "seed-coder", "bailingmoe", "grok-2", "ufakzeka",
    "minicpm5", "qwen35", "tekken", "chameleon", "deepseek-coder", "deepseek-v3", "deepseek-llm", "poro-chat",
    "viking", "bloom", "spark2_5", "youtu", "exaone-moe", "tiny_aya", "granite-embed-multi-97m", "mellum2",
    "jais-2", "laguna",
    "not-a-pre-tokenizer",
]
# SPM variants of the Gemma 3 vocabulary: key -> metadata changes (None drops the key)
SPM_TYPES = {
    "spm-gemma": {},
    "spm-space-prefix": {"tokenizer.ggml.add_space_prefix": None},   # the SPM default, as Llama 2 / Phi-3.5
}

TEXTS = {
    "digits": "1234567 and 3.14, 12 345 678.90 and 0x1F; 2024-01-15 or 1,000,000 = 10^6",
    "contractions": "I'm sure you'LL see it's HER'S, they'RE, we've, I'd, DON'T, o'clock 'quoted' 'sup 'tis",
    "cjk": "日本語のテキストです。中文测试，你好世界！한국어 문장입니다.",
    "emoji": "Hello 👋🏽 world 🌍! 🇫🇷 ✨👨‍👩‍👧",
    "code": ("def f(x):\n\tif x > 0:\n\t\treturn x * 2  # double\n    else:\n        return {'a': [1, 2]}\n\n"
             "class Foo(Bar):\n    pass\n"),
    "spaces": "a  b   c    d     e\t\tf \t g   \n  h    ",
    "accents": "naïve café résumé Ångström Straße Ελληνικά кириллица",
    "crlf": "line one\r\nline two\r\n\r\nline three\rend\n",
    "camel": "camelCase PascalCase HTTPServer iPhone XMLHttpRequest getHTTPResponseCode ABCdef",
    "marks": "ज़िन्दगी নমস্কার สวัสดีครับ e\u0301 a\u0308o\u0308",
    "marks_at_start": "e\u0301\na\u0308 e\u0301",
    "unicode_spaces": "non\u00a0breaking\u3000ideographic\u2003em space\u200bzero width",
    "symbols": "a+b=c; x<y>z ~tilde~ $100 ^caret `tick` |pipe| 50% @home #tag &amp; *star*",
    "specials": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "urls_paths": "see https://example.com/a/b?q=1&r=2 or C:\\dir\\f.txt // note /* c */ a/b//c ./x ../y",
    "upper_contractions": "JOHN'S I'M We'Ll you'RE THEY'VE SHE'D it'S 'S 'll",
    "other_numbers": "\u0663\u0664\u0665 x\u00b3 \u00bd \u216b \u2460\u2461 \uff11\uff12\uff13 1\u00b2345",
    "kana_ligatures": "\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a \ufb01le \u3000\u3001\u3002",
    "whole_word_tokens": "zzqxv zzqxv,zzqxv",
    "leading_space": " leading and trailing ",
    "newlines_only": "\n\n\n",
    "empty": "",
}


def _random_text(seed: int, n: int) -> str:
    """n characters drawn (a fixed LCG, so the text is the same everywhere) from a pool of every class the
    pre-tokenizers tell apart: ASCII letters of both cases, digits, punctuation, symbols, spaces, tabs, CR, LF,
    apostrophes, non-ASCII letters, marks, numbers, symbols and spaces, CJK, kana, Hangul, emoji."""
    pool = ("aZbYcX0123456789 12 34 '' \t\r\n\n  .,;:!?-_/\\()[]{}<>=+*&^%$#@~`|\"'sStTlLmM"
            "\u00e9\u00c9\u00df\u0301\u0308\u093c\u0663\u00bd\u00b3\u20ac\u00a9\u00a0\u3000\u2003"
            "\u4e2d\u6587\u3042\u30ab\ud55c\u0416\u03a9\u05d0\u0639\U0001F600\U0001F30D\u200d\ufe0f")
    state, out = seed, []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(pool[(state >> 33) % len(pool)])
    return "".join(out)


TEXTS.update({f"random_{seed}": _random_text(seed, 400) for seed in (1, 2, 3)})



def _byte_level(text: str) -> str:
    """GPT-2's bytes_to_unicode text of a string (how a byte-level BPE vocabulary spells it)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in table)})
    return "".join(table[b] for b in text.encode())


DIGITS = "0123456789"
EXTRA_MERGES = (
    [(a, b) for a in DIGITS for b in DIGITS]
    + [(a + b, c) for a in DIGITS for b in DIGITS for c in DIGITS]
    + [(_byte_level("\u0301")[0], _byte_level("\u0301")[1]), ("e", _byte_level("\u0301")),
       (_byte_level("\u0308")[0], _byte_level("\u0308")[1]), ("a", _byte_level("\u0308")),
       (":", _byte_level("\n")), ("):", _byte_level("\n"))]
)

# whole words that are tokens no merge leads to: found as one token only where the pre-tokenizer sets
# ignore_merges (llama-bpe, tekken, ...)
EXTRA_TOKENS = ["zzqxv", _byte_level(" zzqxv")]


def bpe_vocab_changes(source: Path) -> dict:
    """tokenizer.ggml.tokens / token_type / merges of `source` with EXTRA_MERGES appended (a merge's token
    is added, as a normal token, when the vocabulary lacks it), then the EXTRA_TOKENS."""
    reader = gguf.GGUFReader(source)

    def strings(key: str) -> list[str]:
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode() for i in f.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    f = reader.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    known = set(tokens)
    for left, right in EXTRA_MERGES:
        merges.append(f"{left} {right}")
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)
            types.append(1)
    tokens += EXTRA_TOKENS
    types += [1] * len(EXTRA_TOKENS)
    arr, string, i32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32
    return {"tokenizer.ggml.tokens": (arr, string, tokens), "tokenizer.ggml.token_type": (arr, i32, types),
            "tokenizer.ggml.merges": (arr, string, merges)}


FIXED_DATE = datetime(2026, 1, 15, 9, 30)

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "celsius"}}}
CONVERSATIONS = {
    "system_user_assistant_user": dict(messages=[
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Répondez en français 🙂"}]),
    "user_assistant_user": dict(messages=[
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke."}]),
    "tools": dict(tools=_TOOLS, messages=[
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
        {"role": "user", "content": "Thanks!"}]),
    "tools_no_system": dict(tools=_TOOLS, messages=[
        {"role": "user", "content": "Weather in Oslo?"}]),
    "thinking": dict(enable_thinking=False, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!",
         "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"}]),
}
# per template: the model's BOS / EOS texts
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("", "<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("", "<|im_end|>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "HuggingFaceTB-SmolLM3-3B": ("", "<|im_end|>"),
    "ibm-granite-granite-3.3-2B-Instruct": ("", "<|end_of_text|>"),
}


def _tokenize(llm: llama_cpp.Llama, text: str) -> dict:
    plain = llm.tokenize(text.encode(), add_bos=True, special=False)
    special = llm.tokenize(text.encode(), add_bos=True, special=True)
    arr = (llama_cpp.llama_token * len(plain))(*plain)
    buf = ctypes.create_string_buffer(8 * len(text.encode()) + 64)
    n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(plain), buf, len(buf), False, False)
    assert n >= 0, n
    out = {"plain": plain, "detok": buf.raw[:n].decode("utf-8", "replace")}
    if special != plain:
        out["special"] = special
    return out


def _record_vocab(source: Path, changes: dict, tmp: Path) -> dict:
    path = synthetic.write_truncated(tmp / "vocab.gguf", source, 1, metadata=changes)
    try:
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    except Exception as e:  # noqa: BLE001 - the load error is the record
        return {"error": str(e)}
    out = {"add_bos": bool(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab)),
           "texts": {name: _tokenize(llm, text) for name, text in TEXTS.items()}}
    llm.close()
    return out


def record_tokenize(tmp: Path) -> dict:
    pre = {}
    vocab = bpe_vocab_changes(VOCAB_BPE)
    for name in PRE_TYPES:
        changes = {**vocab, "tokenizer.ggml.pre": (gguf.GGUFValueType.STRING, None, name),
                   "tokenizer.ggml.add_bos_token": None}
        pre[name] = _record_vocab(VOCAB_BPE, changes, tmp)
        print(name, "error" if "error" in pre[name] else "ok", file=sys.stderr)
    spm = {name: _record_vocab(VOCAB_SPM, changes, tmp) for name, changes in SPM_TYPES.items()}
    return {"texts": TEXTS, "bpe_vocab": VOCAB_BPE.name, "extra_merges": EXTRA_MERGES,
            "extra_tokens": EXTRA_TOKENS, "spm_vocab": VOCAB_SPM.name,
            "spm_changes": SPM_TYPES, "pre": pre, "spm": spm}


def record_chat() -> dict:
    Jinja2ChatFormatter.strftime_now = staticmethod(lambda fmt: FIXED_DATE.strftime(fmt))
    out = {}
    for name, (bos, eos) in TEMPLATES.items():
        source = (HERE / "templates" / f"{name}.jinja").read_text()
        rendered = {}
        for conv, kwargs in CONVERSATIONS.items():
            for add in (True, False):
                fmt = Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos, add_generation_prompt=add)
                key = f"{conv}/{'gen' if add else 'nogen'}"
                try:
                    rendered[key] = {"prompt": fmt(**kwargs).prompt}
                except Exception as e:  # noqa: BLE001 - raise_exception in the template
                    rendered[key] = {"error": str(e)}
        out[name] = {"bos_token": bos, "eos_token": eos, "rendered": rendered}
    return {"date": FIXED_DATE.isoformat(), "conversations": CONVERSATIONS, "templates": out}


def _compact_json(obj: dict) -> str:
    """Indented JSON with every list of token ids on one line."""
    lines: list[str] = []

    def mark(x):
        if isinstance(x, dict):
            return {k: mark(v) for k, v in x.items()}
        if isinstance(x, list) and x and all(type(v) is int for v in x):
            lines.append(json.dumps(x))
            return f"@@ids{len(lines) - 1}@@"
        return x

    text = json.dumps(mark(obj), ensure_ascii=False, indent=1)
    return re.sub(r'"@@ids(\d+)@@"', lambda m: lines[int(m.group(1))], text)


def main() -> None:
    version = metadata.version("llama_cpp_python")
    about = {"llama_cpp_python": version, "llama_cpp_commit": LLAMA_CPP_COMMITS.get(version, "unknown")}
    with tempfile.TemporaryDirectory() as tmp:
        tok = record_tokenize(Path(tmp))
    (HERE / "tokenize.json").write_text(_compact_json({**about, **tok}) + "\n")
    chat = record_chat()
    (HERE / "chat.json").write_text(json.dumps({**about, **chat}, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
