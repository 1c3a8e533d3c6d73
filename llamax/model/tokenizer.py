"""llama.cpp's tokenizer (src/llama-vocab.cpp, src/unicode.cpp) rebuilt from a GGUF's own vocabulary.

One `Tokenizer` per model, built by `Tokenizer.from_gguf` from the ``tokenizer.*`` metadata. It
reproduces what `llama_tokenize`, `llama_token_to_piece` and `llama_detokenize` return, id for id:

    tokenize(text)                       llama_vocab::impl::tokenize
      1. partition   special tokens are cut out of the text first and never split
                     (tokenizer_st_partition: longest special text first; CONTROL and UNKNOWN
                     tokens only when parse_special, USER_DEFINED ones always)
      2. per raw fragment, by vocab type:
         BPE ("gpt2")   pre-split with the regexes of the pre-tokenizer (tokenizer.ggml.pre),
                        each word byte-encoded (GPT-2's bytes->unicode) and merged by the ranks
                        of tokenizer.ggml.merges: lowest rank first, leftmost on ties
         SPM ("llama")  spaces escaped to U+2581, symbols merged by token score: highest first,
                        leftmost on ties; what is not a token falls back to <0xXX> byte tokens
      3. BOS / EOS around it when add_special and the vocab says add_bos / add_eos

Pre-splitting follows unicode_regex_split: every regex splits the pieces the previous one left,
on a "collapsed" copy of the text where each code point outside ASCII stands as one character for
its class (\\p{N} \\p{L} \\p{P} \\p{M} \\p{S}, whitespace, other), with the classes of llama.cpp's
unicode-data.cpp (Unicode 15.1, embedded below, so the result does not depend on the Python
version). llama.cpp's hand-written splitters for the GPT-2, Llama-3, Qwen2, Qwen3.5 and newline
regexes match the regexes they implement on those classes, so one regex engine (Python's ``re``)
serves every pre-tokenizer listed in `_PRE_TOKENIZERS` (the names of llama.cpp's table but those
with splitters of their own that are no regex: "tiny_aya", "afmoe", "kimi-k2"; those that do not
byte-encode: "gemma4", "sarvam-moe", "whitespace"; and "jina-v1-en"-style add_sep, "chatglm-bpe"/"glm4").
Checked against llama.cpp's own outputs on a name of every group of the table
(tests/data/families_tok: SmolLM2's vocabulary under each name), SPM with and without the space
prefix (Gemma 3), and the real SmolLM2 and Gemma 3 vocabularies.
Like llama.cpp, a BPE symbol that is no token falls back to the one-byte tokens of its UTF-8 bytes
and silently drops the bytes that have none.

Bytes that are not valid UTF-8 are tokenized as llama.cpp does, byte for byte: special tokens are
cut out of the raw bytes; BPE then decodes each fragment leniently (unicode_cpts_from_utf8: overlong
forms decode, C0 8A is "\n"; surrogates ED A0 80.. stay code points; any other invalid byte is one
U+FFFD), and SPM splits the raw bytes by the length each lead byte announces, unvalidated, so what
is no token falls back to <0xXX> byte tokens. A BPE code point above U+10FFFF (F4 90 80 80, F5..F7
leads) makes llama.cpp abort; here it is a `CodePointError` (ValueError). Checked against
llama.cpp on ~460 strings per model (tests/reference/tokenize_invalid_utf8.json).

Token ids passed in are checked: a non-integer (float, bool, str) is a TypeError, numpy integers
are welcome, an id outside [0, n_vocab) is a ValueError (llama.cpp aborts there); `detokenize`
checks a whole list in one C-level pass.

Speed: BPE results are cached per pre-token word; SmolLM2's 1350-token reference prompt takes
about 1.5 ms cold and 0.7 ms warm. SPM merges the whole fragment at once (no word cache): Gemma 3's
1339-token prompt takes about 10 ms. (benchmarks/bench_tokenizer.py)

Token attributes, the EOG set and the special-token cache are derived at load time exactly as
llama_vocab::impl::load does (including its detection of EOT/EOG/FIM tokens by their text). Where
llama.cpp's result depends on the iteration order of a std::unordered_map (which of several
EOT-looking tokens becomes `eot`), the lowest id wins here.
"""
from __future__ import annotations

import bisect
import codecs
import heapq
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from llamax.checks import integer
from llamax.errors import ModelError
from llamax.model.gguf_reader import GGUFReader, GGUFValueType

__all__ = [
    "ATTR_BYTE",
    "ATTR_CONTROL",
    "ATTR_LSTRIP",
    "ATTR_NORMAL",
    "ATTR_NORMALIZED",
    "ATTR_RSTRIP",
    "ATTR_SINGLE_WORD",
    "ATTR_UNDEFINED",
    "ATTR_UNKNOWN",
    "ATTR_UNUSED",
    "ATTR_USER_DEFINED",
    "CodePointError",
    "TOKEN_NULL",
    "TextStream",
    "Tokenizer",
    "read_gguf_metadata",
    "unicode_class",
]

#: llama.cpp's LLAMA_TOKEN_NULL: the id of an absent special token.
TOKEN_NULL: int = -1

# llama_token_attr (bit flags)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

# GGUF tokenizer.ggml.token_type (llama_token_type) -> attribute
_TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
                 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

_ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL     # rendered by token_to_piece only when special
_C_SPACE = b" \t\n\v\f\r"                        # C isspace() in the "C" locale
_C_SPACE_STR = " \t\n\v\f\r"
_SPM_SPACE = "\u2581"                            # SentencePiece's escaped space

# ---------------------------------------------------------------------------------------------
# Unicode classes (llama.cpp unicode-data.cpp, generated from UnicodeData.txt 15.1.0)
# ---------------------------------------------------------------------------------------------

#: Ranges of general-category classes as "<hex delta from previous start><class>" runs, from
#: code point 0 up to 0x10FFFF. Classes: L letter, N number, P punctuation, M mark, S symbol,
#: Z separator, C control/format/private/surrogate, U unassigned. Generated with
#: unicodedata2 15.1.0 (category of every code point, Cn -> U, C* -> C, else its first letter),
#: which is what llama.cpp's scripts/gen-unicode-data.py derives from UnicodeData.txt.
_UNICODE_15_1_CLASSES = (
    "0C20Z1P3S1P6S1P4NaP2S3P2L1aP3S1P1S1L1aP1S1P1S1C21Z1P1S5P1S2L1P1S1C1S4N2S1L1P2S1N1L1P1N3P1L17S1L1"
    "fS1L1caS4LcSeL5S7L1S1L1S11M70L5S1L2U2L4P1L1U4S2L1P1L3U1L1U1L14U1L53S1L8bS1M7La6U1L26U2L1P6L29P2U"
    "2S3U1M2dP1M1P1M2P1M2P1M1U8L1bU4L4P2UbC6S3P2S1P2S2MbP1C1P3L2bM15NaP4L2M1L63P1L1M7C1S1M6L2M2S1M4L2"
    "NaL3S2L1PeU1C1L1M1L1eM1bU2L59MbL1UeNaL21M9L2S1P3L1U2M1S2L16M4L1M9L1M3L1M5U2PfU1L19M3U2P1U1LbU5L1"
    "8S1L6U1C2U6M8L2aM18C1M21L36M3L1M12L1M7LaM2P2NaP1L10M3U1L8U2L2U2L16U1L7U1L1U3L4U2M1L1M7U2M2U2M3L1"
    "U8M1U4L2U1L3M2U2NaL2S2N6S2L1P1M1U2M3U1L6U4L2U2L16U1L7U1L2U1L2U1L2U2M1U1M5U4M2U2M3U3M1U7L4U1L1U7N"
    "aM2L3M1P1UaM3U1L9U1L3U1L16U1L7U1L2U1L5U2M1L1M8U1M3U1M3U2L1UfL2M2U2NaP1S1U7L1M6U1M3U1L8U2L2U2L16U"
    "1L7U1L2U1L5U2M1L1M7U2M2U2M3U7M3U4L2U1L3M2U2NaS1L1N6UaM1L1U1L6U3L3U1L4U3L2U1L1U1L2U3L2U3L3U3LcU4M"
    "5U3M3U1M4U2L1U6M1UeNdS8U5M5L8U1L3U1L17U1L10U2M1L1M7U1M3U1M4U7M2U1L3U2L1U2L2M2U2NaU7P1N7S1L1M3P1L"
    "8U1L3U1L17U1LaU1L5U2M1L1M7U1M3U1M4U7M2U6L2U1L2M2U2NaU1L2M1UcM4L9U1L3U1L29M2L1M7U1M3U1M4L1S1U4L3M"
    "1N7L3M2U2N13S1L6U1M3U1L12U3L18U1L9U1L1U2L7U3M1U4M6U1M1U1M8U6NaU2M2P1UcL30M1L2M7U4S1L7M8P1NaP2U25"
    "L2U1L1U1L5U1L18U1L1U1LaM1L2M9L1U2L5U1L1U1M7U1NaU2L4U20L1S3PfS1P1S3M2S6N14S1M1S1M1S1M1P4M2L8U1L24"
    "U4M14P1M2L5MbU1M24U1S8M1S6U1S2P5S4P2U25L2bM14L1NaP6L6M4L4M3L1M3L2M7L3M4LdMcL1M1NaM4S2L26U1L1U5L1"
    "U2L2bP1L14dU1L4U2L7U1L1U1L4U2L29U1L4U2L21U1L4U2L7U1L1U1L4U2LfU1L39U1L4U2L43U2M3P9N14U3L10SaU6L56"
    "U2L6U2P1L26cS1P1L11Z1L1aP2U3L4bP3N3L8U7L12M4U9L13M3P2U9L12M2UcLdU1L3U1M2UcL34M20P3L1P3S1L1M1U2Na"
    "U6NaU6PbM3C1M1NaU6L59U7L5M2L22M1L1U5L46UaL1fU1McU4McU4S1U3P2NaL1eU2L5UbL2cU4L1aU6NbU3S22L17M5U2P"
    "2L35MaU1M1dU2M1NaU6NaU6P7L1P6U2M1fU31M5L2fM11L8U3NaP7SaM9S9P2U1M3L1eMdL2NaL2cMeU8P4L24M14U3P5NaU"
    "3L3NaL24P2L9U7L2bU2L3P8U8M3P1M15L4M1L6M1L2M3L1U5Lc0M40L116U2L6U2L26U2L6U2L8U1L1U1L1U1L1U1L1fU2L3"
    "5U1L7S1L1S3L3U1L7S3L4U2L6U1S3LdS3U2L3U1L7S2U1ZbC5P18Z2C5Z1P14S1PdS1PcZ1C5U1CaN1L1U2N6S3P2L1NaS3P"
    "2U1LdU3S21UfM21UfS2L1S4L1S2LaS1L1S3L5S6L1S1L1S1L1S1L4S1LbS2L4S5L5S4L1S1N33L2N5S2U4S178P4S1dP2Sfc"
    "U19SbU15N3cS4eN16S268PeN1eS31P2S1fPaS193P16S3fP4S20P2S176U2S20U1S69Le5S6L4M3L2U5P4N1P2L26U1L1U5L"
    "1U2L38U7L1P1UeM1L17U9L7U1L7U1L7U1L7U1L7U1L7U1L7U1L7U1M20P2fL1P20S2PcU22S1aU1S59UcSd6U1aS10Z1P3S1"
    "L2N1PaS2PcS1N9M6P1L5S2N3L2P1S2U1L56U2M2S2L3P1L5aP1L4U5L2bU1L5eU1S2N4SaL20S24UbS1L10S1fU1NaS1eN8S"
    "1NfS20NaS27NfS140L19c0S40L568dU3S37U9L2eP2L10dP3L10NaL2U14L2fM4P1MaP1L1fM2L46NaM2P6U8S17L9S2L67S"
    "2L40U5L2U1L1U1L5U18L10M1L3M1L4M1L17M5S4M1U3N6S4U6L34P4U8M2L32M12U8P2NaU6M12L6P3L1P1L2M1NaL1cM8P2"
    "L17MdUbP1L1dU3M4L2fMePdU1L1NaU4P2L5M1LaNaL5U1L29MeU9L3M1L8M2U2NaU2P4L17S3L1M3L32M1L1M3L2M2L5M2L1"
    "M1L1U18L3P2LbM5P2L3M2UaL6U2L6U2L6U9L7U1L7U1L2bS1LeS2U4L73M8P1M2U2NaU6L2ba4UcL17U4L31U4C2100L16eU"
    "2L6aU26L7UcL5U5L1M1LaS1LdU1L5U1L1U1L2U1L2U1L6cS11U10L16bP2S10L40U2L36U7S1U20LcS4M10PaU6M10P23U1P"
    "eS1P1S3U1P1S1P2U4L5U1L87U2C1U1P3S1P6S1P4NaP2S3P2L1aP3S1P1S1L1aP1S1P1S1P7L59U3L6U2L6U2L6U2L3U3S7U"
    "1S7UaC3S2U2LcU1L1aU1L13U1L2U1LfU2LeU22L7bU5P3U4N2dU3S9N39S11N2S3U1SdU3S1U2fS2dM1U82L1dU3L31UfM1N"
    "1bU4L20N4U9L14N1L8N1U5L26M5U5L1eU1P1L24U4L8P1N5U2aL9eU2NaU6L24U4L24U4L28U8L34UbP1LbU1LfU1L7U1L2U"
    "1LbU1LfU1L7U1L2U43L137U9L16UaL8U18L6U1L2aU1L9U45L6U2L1U1L2cU1L2U3L1U2L17U1P1N8L17S2N7L1fU8N9U30L"
    "13U1L2U5N5L16N6U3P1L1aU5P1U40L38U4N2L2N10U2N2eL1M3U1M2U5M4L4U1L3U1L1dU2M3U4M1N9U7P9U7L1dN2P1L1dN"
    "3U20L8S1L1cM2U4N5P7U9L36U3P7L16U2N8L13U5N8L12U7P4UcN7U50L49U37L33UdL33U7N6L24M4U8NaU126N1fU1L2aU"
    "1M2P1U2L2U4bM3L1dNaL1U8L16MbN4P5U16L12M4P4U26L15N7U14L17U9M3L35MfP7U4N1eM1L2M2L1U9M4L2dMbP2C1P4M"
    "1UaC1U2L19U7NaU6M3L24MeU1NaP4L1M2L1U8L23M1P2L1U9M3L30MeL4P4M4P1M2NaL1P1L1P3U1N14UbL12U1L19McP6M1"
    "L2M1U3eL7U1L1U1L4U1LfU1LaP1U6L2fMcU5NaU6M4U1L8U2L2U2L16U1L7U1L2U1L5U1M2L1M7U2M2U2M3U2L1U6M1U5L5M"
    "2U2M7U3M5U8bL35M12L4P5NaP2U1P1M1L3U1eL30M14L2P1L1U8NaUa6L2fM7U2M9P17L4M2U22L30M11P3L1UbNaU6PdU13"
    "L2bMdL1P1U6NaU36L1bU2MfU4NcP3S1L7Ub9L2cMfP1U64L40N13UcL8U2L1U2L8U1L2U1L18M6U1M2U2M4L1M1L1M2P3U9N"
    "aU46L8U2L27M7U2M7L1P1L1M1U1bL1MaL28M7L1M4P8M1U8L1MbL2eM10P3L1P5UdL49U7PaUf6L9U1L25M8U1M8L1P5UaN1"
    "dU3P2L1eU2M16U1MeU49L7U1L2U1L26M6U3M1U1M2U1M7L1M1U8NaU6L6U1L2U1L20M5U1M2U1M5L1U7NaU136L13M4P2U7M"
    "2L1M1LdU1L22M7U3M5PdNaU56L1UfN15S1dUdP1L39aU66N6fU1P5UbLc4Ua4cL61P2UdL430C10M1L6MfUfaaL247U21b9L"
    "239U7L1fU1NaU4P2L4fU1NaU6L1eU2M5P1UaL30M7P5S4L4P1S1UaNaU1N7U1L15U5L13U2b0L40N17P4U65L4bU4M1L1M37"
    "U7M4LdU40L2P1L1M1UbM2UeL17f8U8L4d6U2aL9U22e7L4U1L7U1L2U1L123UfL1U1dL3U2L1UeL4U8L18cU904L6bU5LdU3"
    "L9U7LaU2S1M2P1C4U125cM2eU2M17U9S74U3cSf6UaS27U2S3cM5S3M6C8M8S2M7S1eM4S3dU15S42M3S1U7aN14UcN14UcS"
    "57U9N19U87L55U1L47U1L2U2L1U2L2U2L4U1LcU1L1U1L7U1L41U1L4U2L8U1L7U1L1cU1L4U1L5U1L1U3L7U1L154U2L19S"
    "1L19S1L1fS1L19S1L1fS1L19S1L1fS1L19S1L1fS1L19S1L8U2N32S200M37S4M32S8M1SeM1S2P5UfM5U1MfU450L1fU6L6"
    "Ud5M7U1M11U2M7U1M2U1M5U5L3eU21M1U70L2dU3M7L7U2NaU4L1S1U140L1eM1U11L2cM4NaU5S1U1d0L1cM4NaU2e6L7U1"
    "L4U1L2U1LfU1Lc5U2N9M7U29L44M7L1U4NaU4P2U311N3bS1N3S1N4U4cN2dS1NfUc2L4U1L1bU1L2U1L1U2L1U1LaU1L4U1"
    "L1U1L1U6L1U4L1U1L1U1L1U1L3U1L2U1L1U2L1U1L1U1L1U1L1U1L1U1L2U1L1U2L4U1L7U1L4U1L4U1L1U1LaU1L11U5L3U"
    "1L5U1L11U34S2U10eS2cU4S64UcSfU2SfU1SfU1S25UaNdSa1U38S1dUdS2cU4S9U7S2UeS6U9aS3d8U4S11U3SdU3S77U4S"
    "5fU6ScU4S1UfScU4S38U8SaU6S28U8S1eU2S2U4eS154UcSeU2SdU3S9U7S2eU1S7U8SeU4S9U7S9U7S93U1S37U25NaU406"
    "La6e0U20L103aU6LdeU2L1682UeL1d31UfL26eU9a2L21eU5e2L134bU5L1060Uadc51C1U1eC60U80Mf0Ufe10CfffeU2Cf"
    "ffeU"
)

#: llama.cpp's whitespace set (unicode_set_whitespace: the White_Space property).
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


def _parse_classes(packed: str) -> tuple[list[int], str]:
    """(range starts, class letter per range) from the packed table; starts are increasing."""
    starts: list[int] = []
    classes: list[str] = []
    pos = 0
    for m in re.finditer(r"([0-9a-f]+)([A-Z])", packed):
        pos += int(m.group(1), 16)
        starts.append(pos)
        classes.append(m.group(2))
    assert starts[0] == 0 and pos <= 0x10FFFF
    return starts, "".join(classes)


_CLASS_STARTS, _CLASS_LETTERS = _parse_classes("".join(_UNICODE_15_1_CLASSES))

# the character standing for each class in the collapsed text (unicode_regex_split's k_ucat_cpt)
_COLLAPSED_OF_CLASS = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}


def unicode_class(cpt: int) -> str:
    """The class letter (L N P M S Z C U) of a code point, as llama.cpp's flag table has it."""
    if not 0 <= cpt <= 0x10FFFF:
        return "U"
    return _CLASS_LETTERS[bisect.bisect_right(_CLASS_STARTS, cpt) - 1]


class _CollapseTable(dict):
    """str.translate table: a code point -> its stand-in in the collapsed text (memoised).

    ASCII stays as it is; other whitespace becomes \\x0b; a number, letter, punctuation, mark or
    symbol becomes \\xd1..\\xd5; anything else \\xd0 (unicode_regex_split's text_collapsed).
    """

    def __missing__(self, cpt: int) -> int:
        if cpt < 128:
            out = cpt
        elif cpt in _WHITESPACE:
            out = 0x0B
        else:
            out = ord(_COLLAPSED_OF_CLASS.get(unicode_class(cpt), "\xd0"))
        self[cpt] = out
        return out


class _WideTable(dict):
    """str.translate table for regexes without \\p{..}: non-ASCII whitespace -> \\x0b (std::wregex)."""

    def __missing__(self, cpt: int) -> int:
        out = 0x0B if cpt > 0x7F and cpt in _WHITESPACE else cpt
        self[cpt] = out
        return out


_COLLAPSE = _CollapseTable()
_WIDE = _WideTable()

# what each \p{..} becomes inside a character class of the collapsed regex (k_ucat_cpt + k_ucat_map)
_UCAT_CLASS = {
    r"\p{N}": r"\xd10-9",
    r"\p{L}": r"\xd2A-Za-z",
    r"\p{Lu}": r"\xd2A-Za-z",
    r"\p{Ll}": r"\xd2A-Za-z",
    r"\p{Lt}": r"\xd2A-Za-z",
    r"\p{Lm}": r"\xd2A-Za-z",
    r"\p{Lo}": r"\xd2A-Za-z",
    r"\p{P}": r"\xd3!-#%-*,-/:;?@\[-\]_{}",
    r"\p{M}": r"\xd4",
    r"\p{S}": r"\xd5$+<=>^`|~",
}
_WS_CLASS = r"\t\n\x0b\x0c\r\x20"      # std::regex \s in the "C" locale


def _translate_regex(expr: str) -> tuple[re.Pattern, bool]:
    """A llama.cpp pre-tokenizer regex as a Python pattern, and whether it runs on collapsed text.

    \\p{..} classes become their collapsed stand-ins plus their ASCII members; \\s, \\S and \\d
    become the "C" locale classes std::regex uses (Python's would also match other whitespace).
    """
    use_collapsed = any(k in expr for k in _UCAT_CLASS)
    if use_collapsed and any(ord(c) >= 128 for c in expr):
        raise ModelError(f"pre-tokenizer regex mixes unicode categories and non-ASCII characters: {expr!r}")
    out: list[str] = []
    inside = False
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c == "\\" and i + 1 < n:
            nxt = expr[i + 1]
            if nxt == "p" and expr.startswith("{", i + 2):
                j = expr.find("}", i + 3)
                pat = expr[i:j + 1] if j >= 0 else ""
                if pat in _UCAT_CLASS:
                    out.append(_UCAT_CLASS[pat] if inside else "[" + _UCAT_CLASS[pat] + "]")
                    i = j + 1
                    continue
                raise ModelError(f"unsupported unicode category {pat or expr[i:]!r} in pre-tokenizer regex")
            if nxt == "s":
                out.append(_WS_CLASS if inside else "[" + _WS_CLASS + "]")
            elif nxt == "S":
                if inside:
                    raise ModelError(f"\\S inside a character class is not supported: {expr!r}")
                out.append("[^" + _WS_CLASS + "]")
            elif nxt == "d":
                out.append("0-9" if inside else "[0-9]")
            else:
                out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            out.append(r"\Z")             # ECMAScript $ (no multiline): the very end only
            i += 1
            continue
        out.append(c)
        i += 1
    return re.compile("".join(out)), use_collapsed


# ---------------------------------------------------------------------------------------------
# pre-tokenizers (llm_tokenizer_bpe's regex_exprs per LLAMA_VOCAB_PRE_TYPE, and the flags that
# llama_vocab::impl::load sets per tokenizer.ggml.pre)
# ---------------------------------------------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# GPT-4o / Llama 4 (tokenizer.json's [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+ as llama.cpp
# adapts it to the collapsed text: a letter that is not a-z, then letters that are not A-Z)
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
             r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
              r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GRANITE_EMB_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
              r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+"
                  r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+"
                  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_RE_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_MINICPM5 = (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+"
                r"|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
                  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_RE_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
             r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# the non-ASCII characters of these regexes as escapes (a letter such as U+1F7D must not be normalised)
_RE_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_RE_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_RE_DEEPSEEK3 = (r"\p{N}{1,3}", _RE_CJK_KANA,
                 r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _RE_CJK_HANGUL, r"\p{N}")
_RE_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _RE_CJK_HANGUL,
    r"\p{N}+",
)
_RE_SPARK2_5 = (r"\p{N}{1,3}", _RE_CJK_KANA,
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")
_RE_YOUTU = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
    "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_RE_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_RE_CHAMELEON = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\t\n]|    |  )", r"\p{N}",
                 r"[\p{P}!-/:-@\[-`{-~]", _RE_GPT2)

_PRE_GROUPS: list[tuple[tuple[str, ...], tuple[str, ...], dict[str, bool]]] = [
    # (tokenizer.ggml.pre names, regexes, flags that differ from the BPE defaults), as
    # llama_vocab::impl::load maps the names and llm_tokenizer_bpe lists the regexes
    (("", "default"), _RE_DEFAULT, {}),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]"), {}),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), (_RE_LLAMA3,), {"ignore_merges": True, "add_bos": True}),
    (("dbrx", "smaug-bpe"), (_RE_LLAMA3,), {}),
    (("jais-2",), (_RE_JAIS2,), {}),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"), (_RE_QWEN2,),
     {"clean_spaces": False}),
    (("stablelm2", "megrez"), (_RE_QWEN2,), {}),
    (("qwen35",), (_RE_QWEN35,), {"clean_spaces": False}),
    (("laguna",), (r"[^\n]+|[\n]+", _RE_QWEN2), {"clean_spaces": False}),
    (("ufakzeka",), (_RE_UFAKZEKA,), {"clean_spaces": False}),
    (("seed-coder",), (_RE_SEED_CODER,), {"clean_spaces": False}),
    (("bailingmoe", "bailingmoe2", "llada-moe"), (_RE_BAILINGMOE,), {"clean_spaces": False}),
    (("minicpm5",), _RE_MINICPM5, {"ignore_merges": True}),
    (("exaone-moe",), (_RE_EXAONE_MOE,), {}),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"), (_RE_GPT2,), {}),
    (("trillion", "granite-docling"), (_RE_GPT2,), {"clean_spaces": False}),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), (r"\p{N}", _RE_GPT2), {}),
    (("smollm", "command-r"), (r"\p{N}", _RE_GPT2), {"clean_spaces": False}),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_RE_GPT4O,), {"clean_spaces": False}),
    (("granite-embed-multi-97m",), (_RE_GRANITE_EMB_MULTI,), {"clean_spaces": False, "ignore_merges": True}),
    (("tekken",), (_RE_TEKKEN,), {"clean_spaces": False, "ignore_merges": True, "add_bos": True}),
    # superbpe's second regex matches only empty strings: it cuts digit runs into threes from the right
    (("superbpe",), (r"\p{N}+", r"(?=(\d{3})+(?!\d))"), {"clean_spaces": False}),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _RE_DEEPSEEK3, {"clean_spaces": False}),
    (("spark2_5",), _RE_SPARK2_5, {"clean_spaces": False}),
    (("youtu",), _RE_YOUTU, {"clean_spaces": False, "ignore_merges": True}),
    (("deepseek-coder",), _RE_DEEPSEEK_CODER, {"clean_spaces": False}),
    (("deepseek-llm",), _RE_DEEPSEEK_LLM, {"clean_spaces": False}),
    (("poro-chat",), (_RE_BLOOM,), {"clean_spaces": False}),
    (("bloom", "gpt3-finnish"), (_RE_BLOOM,), {}),
    (("viking",), (_RE_BLOOM, r"\p{N}"), {"clean_spaces": False}),
    (("chameleon",), _RE_CHAMELEON, {"clean_spaces": False, "add_bos": True}),
]
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], dict[str, bool]]] = {
    name: (regexes, flags) for names, regexes, flags in _PRE_GROUPS for name in names}

# GPT-2's bytes_to_unicode (unicode_byte_to_utf8_map): printable bytes stand for themselves, the
# others for 256 + n in byte order
_BYTE_TO_CHAR: list[str] = [""] * 256
_n = 0
for _b in range(256):
    if 0x21 <= _b <= 0x7E or 0xA1 <= _b <= 0xAC or 0xAE <= _b <= 0xFF:
        _BYTE_TO_CHAR[_b] = chr(_b)
    else:
        _BYTE_TO_CHAR[_b] = chr(256 + _n)
        _n += 1
_CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
del _b, _n

# texts llama_vocab::impl::load recognises (auto-detection of special tokens by their text)
_EOT_TEXTS = frozenset(["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
                        "<end_of_utterance>"])
_EOM_TEXTS = frozenset(["<|eom_id|>"])
_FIM_TEXTS = {
    "fim_pre": frozenset(["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                          "▁<PRE>", "<|code_prefix|>", "<|prefix|>"]),
    "fim_suf": frozenset(["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                          "▁<SUF>", "<|code_suffix|>", "<|suffix|>"]),
    "fim_mid": frozenset(["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                          "▁<MID>", "<|code_middle|>", "<|middle|>"]),
    "fim_pad": frozenset(["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    "fim_rep": frozenset(["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
    "fim_sep": frozenset(["<|file_sep|>"]),
}
_EOG_TEXTS = frozenset(["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
                        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
                        "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["])
_ALWAYS_USER_DEFINED = frozenset(["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"])

# special-token id keys: (GGUF key suffix, attribute name); later keys win (deprecated FIM names)
_SPECIAL_ID_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"),
    ("eom_token_id", "eom"), ("unknown_token_id", "unk"), ("seperator_token_id", "sep"),
    ("padding_token_id", "pad"), ("mask_token_id", "mask"),
    ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"), ("fim_mid_token_id", "fim_mid"),
    ("fim_pad_token_id", "fim_pad"), ("fim_rep_token_id", "fim_rep"), ("fim_sep_token_id", "fim_sep"),
    ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"), ("middle_token_id", "fim_mid"),
)


# unicode_len_utf8: the sequence length a lead byte announces, by its high nibble
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


class CodePointError(ValueError):
    """A byte sequence decodes (leniently, as llama.cpp does) to a code point above U+10FFFF."""


def _lenient_replace(err: UnicodeError) -> tuple[str, int]:
    """Decode error handler: unicode_cpt_from_utf8 at the failing offset (llama.cpp's lenient UTF-8).

    Python's strict decoder and llama.cpp's agree on valid UTF-8, so only where Python fails does
    llama.cpp's rule need applying: a C0..DF / E0..EF / F0..F7 lead with enough continuation bytes
    decodes whatever value the bits give (overlong forms such as C0 8A -> "\n", and surrogates
    ED A0 80 -> U+D800, a lone surrogate in the str); anything else (a continuation byte, F8..FF,
    a lead without its continuations) is one U+FFFD for one byte, and decoding goes on after it.

    Raises:
        CodePointError: the value is above U+10FFFF (llama.cpp's unicode_cpt_to_utf8 throws out of
            llama_tokenize there, which aborts the process).
    """
    if not isinstance(err, UnicodeDecodeError):  # the handler is registered for decoding only
        raise err
    data, i = err.object, err.start
    b = data[i]
    k = _UTF8_LEN[b >> 4] if b < 0xF8 else 0
    if k < 2 or i + k > len(data):
        return "\ufffd", i + 1
    cpt = b & (0x7F >> k)
    for j in range(i + 1, i + k):
        c = data[j]
        if c & 0xC0 != 0x80:
            return "\ufffd", i + 1
        cpt = cpt << 6 | c & 0x3F
    if cpt > 0x10FFFF:
        raise CodePointError(f"bytes {bytes(data[i:i + k]).hex(' ').upper()} at offset {i} decode to "
                             f"U+{cpt:X}, beyond U+10FFFF: llama.cpp aborts on this text "
                             "(unicode_cpt_to_utf8 throws); it cannot be tokenized")
    return chr(cpt), i + k


codecs.register_error("llamax.lenient", _lenient_replace)


# ---------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------

def read_gguf_metadata(path: str | os.PathLike, prefix: str = "") -> dict[str, Any]:
    """The metadata key/values of a GGUF file whose key starts with `prefix`.

    Strings are returned as `bytes` inside arrays (token texts may not be valid UTF-8) and as
    `str` when scalar (invalid UTF-8 replaced by U+FFFD); numeric arrays as lists. The file is
    read (and its tensor infos checked) by `llamax.model.gguf_reader.GGUFReader`, whose own
    decoded ``fields`` `Tokenizer.from_gguf` takes faster (no bytes objects, no lists).

    Raises:
        ModelError: not a GGUF file, an unsupported version or a truncated/corrupt header.
    """
    reader = GGUFReader(path)
    out: dict[str, Any] = {}
    for key, value in reader.fields.items():
        if not key.startswith(prefix):
            continue
        vtype, etype = reader.field_type(key)
        if etype == GGUFValueType.STRING:
            out[key] = reader.string_array_bytes(key)
        elif isinstance(value, np.ndarray):
            out[key] = value.tolist()
        elif isinstance(value, str):
            out[key] = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        else:
            out[key] = value
    return out


def _fields_of_reader(reader: Any) -> dict[str, Any]:
    """The tokenizer.* and general.* metadata of a gguf.GGUFReader, in read_gguf_metadata's form.

    For the `gguf` package's reader (slow on large vocabularies); llamax's own GGUFReader gives its
    ``fields`` directly."""
    import gguf

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith(("tokenizer.", "general.")):
            continue
        types = list(field.types)
        if not types:
            continue
        if types[0] == gguf.GGUFValueType.ARRAY:
            if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(field.parts[i]) for i in field.data]
            else:
                out[key] = [field.parts[i][0].item() for i in field.data]
        elif types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        else:
            out[key] = field.parts[field.data[0]][0].item()
    return out


def _as_texts(items: Sequence[Any]) -> list[str]:
    """A new list of the items as str: bytes decoded as UTF-8 (surrogateescape), str kept as is."""
    if set(map(type, items)) <= {str}:
        return list(items)
    return [t.decode("utf-8", "surrogateescape") if isinstance(t, (bytes, bytearray)) else str(t)
            for t in items]


class _Meta:
    """Typed reads of the tokenizer's metadata, as llama.cpp's get_key / get_arr: a key of another
    type than the one expected (an int where a string is, a string array where numbers are, ...)
    is a ModelError naming the key, never a TypeError or ValueError from deep inside. Takes both
    forms of the metadata (GGUFReader.fields: str and numpy arrays; read_gguf_metadata: bytes and
    lists)."""

    def __init__(self, meta: Mapping[str, Any]) -> None:
        self.meta = meta

    def _bad(self, key: str, v: Any, want: str) -> ModelError:
        shown = f"an array of {len(v)}" if isinstance(v, (list, tuple, np.ndarray)) else repr(v)[:60]
        return ModelError(f"{key} is {shown} ({type(v).__name__}), expected {want}")

    def string(self, key: str, default: str = "") -> str:
        v = self.meta.get(key)
        if v is None:
            return default
        if isinstance(v, (bytes, bytearray)):
            return bytes(v).decode("utf-8", "surrogateescape")
        if not isinstance(v, str):
            raise self._bad(key, v, "a string")
        return v

    def strings(self, key: str) -> list | None:
        """An array of strings (str or bytes items), or None when absent."""
        v = self.meta.get(key)
        if v is None:
            return None
        if not isinstance(v, (list, tuple)) or not set(map(type, v)) <= {str, bytes, bytearray}:
            raise self._bad(key, v, "an array of strings")
        return list(v)

    def numbers(self, key: str, kinds: str) -> np.ndarray | None:
        """A numeric array (numpy dtype kinds `kinds`, e.g. "iu" or "iuf"), or None when absent."""
        v = self.meta.get(key)
        if v is None:
            return None
        if isinstance(v, (list, tuple)) and set(map(type, v)) <= {int, float}:
            try:
                a = np.asarray(v)
            except (OverflowError, ValueError):
                raise self._bad(key, v, "an array of numbers") from None
        elif isinstance(v, np.ndarray) and v.ndim == 1:
            a = v
        else:
            raise self._bad(key, v, "an array of numbers")
        if a.size and a.dtype.kind not in kinds:
            raise self._bad(key, v, "an array of " + ("integers" if "f" not in kinds else "numbers"))
        return a

    def integer(self, key: str) -> int | None:
        v = self.meta.get(key)
        if v is None:
            return None
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise self._bad(key, v, "an integer")
        return int(v)

    def boolean(self, key: str) -> bool | None:
        v = self.meta.get(key)
        if v is None:
            return None
        if not isinstance(v, (bool, np.bool_, int, np.integer)):
            raise self._bad(key, v, "a bool")
        return bool(v)


# tokenizer.ggml.token_type (llama_token_type, 0..6) -> attribute, as a lookup table
_TYPE_TO_ATTR_LUT = np.array([_TYPE_TO_ATTR[t] for t in range(len(_TYPE_TO_ATTR))], dtype=np.int64)


def _attrs_of_types(types: Any) -> np.ndarray:
    """The attribute (int64) of every token type; an unknown type is ATTR_UNDEFINED."""
    try:
        t = np.asarray(types, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return np.array([_TYPE_TO_ATTR.get(int(x), ATTR_UNDEFINED) for x in types], dtype=np.int64)
    known = (t >= 0) & (t < len(_TYPE_TO_ATTR_LUT))
    return np.where(known, _TYPE_TO_ATTR_LUT[np.where(known, t, 0)], ATTR_UNDEFINED).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """A model's vocabulary and llama.cpp's tokenizer over it (llama_vocab).

    Build with `Tokenizer.from_gguf`. Token ids are ints in [0, n_vocab); an absent special token
    is `TOKEN_NULL` (-1). Thread-safe for reads once built (the caches only grow).
    """

    #: largest number of words kept in the per-word BPE cache before it is cleared
    BPE_CACHE_SIZE = 1 << 17

    def __init__(self, meta: Mapping[str, Any]) -> None:
        """Build from GGUF metadata: key -> value, as `GGUFReader.fields` or `read_gguf_metadata` has it.

        Raises:
            ModelError: no vocabulary, an unsupported tokenizer model or pre-tokenizer, a
                duplicate token, add_bos/add_eos set without the token id, or a key of another
                type than llama.cpp reads (a number for a string, strings for numbers, ...).
        """
        m = _Meta(meta)
        g = "tokenizer.ggml."

        self.model: str = m.string(g + "model")
        self.pre: str = m.string(g + "pre")
        if self.model == "llama":
            self.vocab_type = "spm"
        elif self.model == "gpt2":
            self.vocab_type = "bpe"
        else:
            raise ModelError(f"tokenizer model {self.model!r} is not supported "
                             "(supported: 'llama' (SPM), 'gpt2' (BPE))")

        raw_tokens = m.strings(g + "tokens")
        if raw_tokens is None or len(raw_tokens) == 0:
            raise ModelError("cannot find tokenizer vocab in model file (tokenizer.ggml.tokens)")
        n = len(raw_tokens)
        texts = _as_texts(raw_tokens)
        if "" in texts:
            i = texts.index("")
            while True:
                texts[i] = f"[EMPTY_{i}]"
                try:
                    i = texts.index("", i + 1)
                except ValueError:
                    break
        self._texts = texts
        self._t2i: dict[str, int] = dict(zip(texts, range(n)))
        if len(self._t2i) != n:
            first: dict[str, int] = {}
            for i, s in enumerate(texts):
                if first.setdefault(s, i) != i:
                    raise ModelError(f"duplicate token in vocabulary: {s!r} has ids {first[s]} and {i}")

        scores = m.numbers(g + "scores", "iuf")
        if scores is not None and len(scores) < n:
            raise ModelError(f"Index out of array bounds for scores ({len(scores)} < {n})")
        self._scores: list[float] = (np.asarray(scores[:n], dtype=np.float64).tolist()
                                     if scores is not None else [0.0] * n)
        types = m.numbers(g + "token_type", "iu")
        if types is not None and len(types) < n:
            raise ModelError(f"Index out of array bounds for toktypes ({len(types)} < {n})")
        # per-token attributes as one array while they are derived below (self._attrs at the end)
        attrs = _attrs_of_types(types[:n]) if types is not None else np.full(n, ATTR_NORMAL, dtype=np.int64)

        # vocab-type defaults (llama_vocab::impl::load)
        ids = dict.fromkeys(("bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask", "fim_pre", "fim_suf",
                             "fim_mid", "fim_pad", "fim_rep", "fim_sep"), TOKEN_NULL)
        self._ranks: dict[tuple[str, str], int] = {}
        self.ignore_merges = False
        self.add_sep = False
        if self.vocab_type == "spm":
            ids.update(bos=1, eos=2, unk=0)
            self.add_space_prefix, self.clean_spaces, self.escape_whitespaces = True, False, True
            self.add_bos, self.add_eos = True, False
            self._regexes: list[tuple[re.Pattern, bool]] = []
        else:
            ids.update(bos=11, eos=11)
            self.add_space_prefix, self.clean_spaces, self.escape_whitespaces = False, True, False
            self.add_bos, self.add_eos = False, False
            if self.pre not in _PRE_TOKENIZERS:
                raise ModelError(f"pre-tokenizer {self.pre!r} is not supported (supported: "
                                 f"{', '.join(sorted(k for k in _PRE_TOKENIZERS if k))})")
            regexes, flags = _PRE_TOKENIZERS[self.pre]
            for k, v in flags.items():
                setattr(self, k, v)
            self._regexes = [_translate_regex(r) for r in regexes]
            merges = m.strings(g + "merges")
            if merges is None:
                raise ModelError("cannot find tokenizer merges in model file (tokenizer.ggml.merges)")
            for rank, s in enumerate(_as_texts(merges)):
                sp = s.find(" ", 1)
                pair = (s[:sp], s[sp + 1:]) if sp >= 0 else ("", "")
                self._ranks.setdefault(pair, rank)
        self._need_collapse = any(c for _, c in self._regexes)
        add_prefix = m.boolean(g + "add_space_prefix")
        if add_prefix is not None:
            self.add_space_prefix = bool(add_prefix)

        self._bpe_cache: dict[str, tuple[int, ...]] = {}

        # newline token (computed before the special ids are read, as llama.cpp does)
        if self.vocab_type == "spm":
            self.nl = self._byte_to_token(0x0A, strict=False)
            if self.nl == TOKEN_NULL:
                self.nl = ids["pad"]
        else:
            nl = self._tokenize_bpe_text("\n")
            self.nl = nl[0] if nl else ids["pad"]

        # special token ids from the metadata
        for suffix, name in _SPECIAL_ID_KEYS:
            if ids[name] >= n:
                ids[name] = TOKEN_NULL
            tid = m.integer(g + suffix)
            if tid is None:
                continue
            if 0 <= tid < n:
                ids[name] = tid
        for key, name in (("add_bos_token", "add_bos"), ("add_eos_token", "add_eos"), ("add_sep_token", "add_sep")):
            on = m.boolean(g + key)
            if on is not None:
                setattr(self, name, on)
        for flag, name in (("add_bos", "bos"), ("add_eos", "eos"), ("add_sep", "sep")):
            if getattr(self, flag) and ids[name] == TOKEN_NULL:
                raise ModelError(f"tokenizer.ggml.{flag}_token is true, but tokenizer.ggml.{name}_token_id is not set")

        # auto-detect special tokens by their text (llama.cpp scans every token; the texts are
        # unique, so looking the candidates up is the same); the lowest id wins where llama.cpp's
        # choice depends on the hash order of its token map
        t2i = self._t2i

        def ids_of(cands: Iterable[str]) -> list[int]:
            return sorted(t2i[s] for s in cands if s in t2i)

        for name, cands in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            found = ids_of(cands)
            if ids[name] == TOKEN_NULL and found:
                ids[name] = found[0]
                attrs[found[0]] |= ATTR_CONTROL
        self.n_unused = 0
        for i in np.flatnonzero(attrs & ATTR_CONTROL).tolist():
            if not attrs[i] & ATTR_UNUSED and "unused" in texts[i]:
                attrs[i] |= ATTR_UNUSED
            if attrs[i] & ATTR_UNUSED:
                self.n_unused += 1
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] != TOKEN_NULL}
        for i in ids_of(_EOG_TEXTS):
            eog.add(i)
            attrs[i] |= ATTR_CONTROL
        for i in ids_of(_ALWAYS_USER_DEFINED):
            attrs[i] = ATTR_USER_DEFINED
        eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] != TOKEN_NULL)
        eog_texts = {texts[i]: i for i in eog if 0 <= i < n}
        has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
        if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
            end_id = eog_texts["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = ATTR_USER_DEFINED
        if "<|tool_response>" in eog_texts and "</s>" in eog_texts:
            eog.discard(eog_texts["</s>"])
            attrs[eog_texts["</s>"]] = ATTR_NORMAL
        self._eog = frozenset(eog)
        self._ids = ids

        # the special-token cache: longest text first (ties by id)
        def nbytes(i: int) -> int:
            return len(texts[i].encode("utf-8", "surrogateescape"))

        specials = np.flatnonzero(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)).tolist()
        specials.sort(key=lambda i: (-nbytes(i), i))
        attrs = self._attrs = attrs.tolist()
        self._specials_all = specials
        self._specials_plain = [i for i in specials if not attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)]
        self._special_matchers: dict[bool, _SpecialMatcher] = {}
        self._pieces: dict[int, bytes] = {}

        # per-token attributes set by model name (llama.cpp's _set_token_attr)
        name = m.string("general.name").lower()
        arch = m.string("general.architecture")

        def set_attr(text: str, attr: int, value: bool) -> None:
            i = self._t2i.get(text)
            if i is not None:
                attrs[i] = attrs[i] | attr if value else attrs[i] & ~attr

        if any(p in self.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
            set_attr("<mask>", ATTR_LSTRIP, True)
        elif "phi-3" in name or "phi3" in name:
            for i in specials:
                attrs[i] |= ATTR_RSTRIP
            set_attr("</s>", ATTR_RSTRIP, True)
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(t, ATTR_RSTRIP, False)
        elif "modern-bert" in name:
            set_attr("[MASK]", ATTR_LSTRIP, True)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """The tokenizer of a GGUF: a path, a `GGUFReader`, a metadata mapping, or a gguf.GGUFReader.

        A path is opened with llamax's `GGUFReader`; its ``fields`` (and a mapping, key -> value
        as either `GGUFReader.fields` or `read_gguf_metadata` has them) are taken as they are.
        The `gguf` package's reader is still accepted (its fields are converted, slowly).

        Raises:
            ModelError: unreadable metadata or an unsupported vocabulary (see __init__).
        """
        if isinstance(source, (str, os.PathLike)):
            meta: Mapping[str, Any] = GGUFReader(source).fields
        elif isinstance(source, GGUFReader):
            meta = source.fields
        elif isinstance(source, Mapping):
            meta = source
        elif hasattr(source, "fields"):
            meta = _fields_of_reader(source)
        else:
            raise TypeError("Tokenizer.from_gguf needs a path, a GGUFReader or a mapping, "
                            f"not {type(source).__name__}")
        return cls(meta)

    # ---- vocabulary ------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._texts)

    @property
    def bos(self) -> int:
        """Beginning-of-sequence token id, or TOKEN_NULL (-1)."""
        return self._ids["bos"]

    @property
    def eos(self) -> int:
        """End-of-sequence token id, or TOKEN_NULL (-1)."""
        return self._ids["eos"]

    @property
    def eot(self) -> int:
        """End-of-turn token id, or TOKEN_NULL (-1)."""
        return self._ids["eot"]

    @property
    def eom(self) -> int:
        return self._ids["eom"]

    @property
    def unk(self) -> int:
        return self._ids["unk"]

    @property
    def sep(self) -> int:
        return self._ids["sep"]

    @property
    def pad(self) -> int:
        return self._ids["pad"]

    def special_id(self, name: str) -> int:
        """Any special id by llama.cpp's name: bos eos eot eom unk sep pad mask fim_pre fim_suf
        fim_mid fim_pad fim_rep fim_sep (TOKEN_NULL when absent)."""
        return self._ids[name]

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every end-of-generation token (special_eog_ids)."""
        return self._eog

    @property
    def special_tokens(self) -> list[int]:
        """CONTROL, USER_DEFINED and UNKNOWN tokens, longest text first (cache_special_tokens)."""
        return list(self._specials_all)

    def _check(self, token: Any) -> int:
        """A token id as a Python int in [0, n_vocab).

        Raises:
            TypeError: not an integer (a float, a bool, a str, ...; numpy integers are welcome).
            ValueError: outside the vocabulary (llama.cpp aborts there).
        """
        t = token if type(token) is int else integer(token, "token id")
        if not 0 <= t < len(self._texts):
            raise ValueError(f"token id {t} is outside the vocabulary [0, n_vocab = {len(self._texts)})")
        return t

    def _check_many(self, tokens: Any) -> list[int]:
        """Every id of `tokens` (an iterable of integers, or a 1-D integer numpy array) as a list of
        Python ints in [0, n_vocab), checked as `_check` does but without a Python call per id:
        the element types are collected with set(map(type, ...)) and the range is min/max (numpy's
        for an array). O(n) in C.

        Raises:
            TypeError: an element is not an integer, or an array is not 1-D integer.
            ValueError: an id outside the vocabulary (the first one is named, with its index).
        """
        n_vocab = len(self._texts)
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                if tokens.ndim == 1 and tokens.dtype.kind == "O":
                    return self._check_many(tokens.tolist())
                raise TypeError(f"token ids must be a 1-D integer array, got a {tokens.ndim}-D "
                                f"array of {tokens.dtype}")
            if tokens.size and (tokens.min() < 0 or tokens.max() >= n_vocab):
                i = int(np.flatnonzero((tokens < 0) | (tokens >= n_vocab))[0])
                raise ValueError(f"token id {int(tokens[i])} (at index {i}) is outside the vocabulary "
                                 f"[0, n_vocab = {n_vocab})")
            return tokens.tolist()
        if isinstance(tokens, (str, bytes, bytearray)):
            raise TypeError(f"token ids must be integers, not a {type(tokens).__name__}")
        toks = tokens if isinstance(tokens, list) else list(tokens)
        if not toks:
            return toks
        types = set(map(type, toks))
        if types != {int}:
            if any(not issubclass(t, (int, np.integer)) or issubclass(t, (bool, np.bool_)) for t in types):
                for i, t in enumerate(toks):       # the first non-integer, for the message
                    integer(t, f"token id (at index {i})")
            toks = [int(t) for t in toks]          # numpy integers and int subclasses -> int
        if min(toks) < 0 or max(toks) >= n_vocab:
            i, t = next((i, t) for i, t in enumerate(toks) if not 0 <= t < n_vocab)
            raise ValueError(f"token id {t} (at index {i}) is outside the vocabulary [0, n_vocab = {n_vocab})")
        return toks

    def is_eog(self, token: int) -> bool:
        """True if generating `token` ends the generation (eos, eot, <|im_end|>, ...).

        Any integer is accepted, as llama_vocab_is_eog does: one outside the vocabulary (TOKEN_NULL
        included) is simply not an end-of-generation token.

        Raises:
            TypeError: `token` is not an integer.
        """
        return integer(token, "token id") in self._eog

    def is_control(self, token: int) -> bool:
        """True for a CONTROL token. Raises TypeError (not an integer) or ValueError (outside the vocabulary)."""
        return bool(self._attrs[self._check(token)] & ATTR_CONTROL)

    def token_attr(self, token: int) -> int:
        """The llama_token_attr bit set of a token (ATTR_*). Raises as `is_control`."""
        return self._attrs[self._check(token)]

    def token_text(self, token: int) -> str:
        """The token's text as stored in the vocabulary (byte-encoded for BPE, U+2581 for SPM).
        Raises as `is_control`."""
        return self._texts[self._check(token)]

    def token_score(self, token: int) -> float:
        """The token's score (SPM merge priority). Raises as `is_control`."""
        return self._scores[self._check(token)]

    def text_to_token(self, text: str) -> int:
        """The id of the token whose vocabulary text is exactly `text`, or TOKEN_NULL."""
        return self._t2i.get(text, TOKEN_NULL)

    def _byte_to_token(self, b: int, strict: bool = True) -> int:
        """byte_to_token: the <0xXX> token (SPM), else the byte's own text."""
        if self.vocab_type == "spm":
            t = self._t2i.get(f"<0x{b:02X}>")
            if t is None:
                t = self._t2i.get(bytes([b]).decode("utf-8", "surrogateescape"))
        else:
            t = self._t2i.get(_BYTE_TO_CHAR[b])
        if t is None:
            if strict:
                raise ModelError(f"the vocabulary has no token for byte 0x{b:02X}")
            return TOKEN_NULL
        return t

    # ---- tokenize --------------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize: the token ids of `text`.

        Args:
            text: a str, or bytes. Bytes that are not valid UTF-8 are tokenized as llama.cpp
                does: BPE decodes them leniently (unicode_cpts_from_utf8: overlong forms and
                surrogates decode, any other invalid byte is one U+FFFD); SPM splits the raw bytes
                by the length each lead byte announces and falls back to <0xXX> byte tokens.
            add_special: add BOS/EOS where the vocabulary asks for them (add_bos/add_eos).
            parse_special: match CONTROL tokens (e.g. "<|im_start|>") in the text; USER_DEFINED
                tokens are matched either way.
        Returns:
            The ids. Cost: linear in the text plus the BPE of each unseen word.
        Raises:
            TypeError: `text` is neither str nor bytes.
            ValueError: a str `text` holds a lone surrogate (not encodable as UTF-8);
                `CodePointError` (a ValueError): BPE bytes that decode to a code point above
                U+10FFFF, where llama.cpp aborts.
        """
        raw = False          # text is bytes that are not UTF-8, held losslessly (surrogateescape)
        if isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raw = True
                text = data.decode("utf-8", "surrogateescape")
                if self.vocab_type == "bpe":
                    data.decode("utf-8", "llamax.lenient")     # CodePointError where llama.cpp aborts
        elif not isinstance(text, str):
            raise TypeError(f"tokenize needs str or bytes, not {type(text).__name__}")
        else:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"text is not valid Unicode: lone surrogate {text[e.start]!r} "
                                 f"at index {e.start}") from None
        # special tokens are cut out of the raw bytes (the surrogateescape str finds a valid
        # UTF-8 token text exactly where a byte search finds it)
        frags = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos)
        if self.vocab_type == "spm":
            prev_special = True
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    f = f.replace(" ", _SPM_SPACE)
                    if raw:
                        out.extend(self._tokenize_spm_bytes(f.encode("utf-8", "surrogateescape")))
                    else:
                        out.extend(self._tokenize_spm(f))
                    prev_special = False
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    if raw:     # unicode_cpts_from_utf8 of the fragment's bytes
                        f = f.encode("utf-8", "surrogateescape").decode("utf-8", "llamax.lenient")
                    out.extend(self._tokenize_bpe_text(f))
        if add_special and self.add_eos:
            out.append(self.eos)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[int | str]:
        """tokenizer_st_partition: the text cut into raw strings and special token ids.

        Special tokens are taken longest text first; each one splits every raw fragment at each
        of its occurrences, left to right. LSTRIP/RSTRIP tokens swallow the spaces beside them.
        """
        matcher = self._special_matchers.get(parse_special)
        if matcher is None:
            ids = self._specials_all if parse_special else self._specials_plain
            matcher = self._special_matchers[parse_special] = _SpecialMatcher(ids, self._texts)
        frags: list[int | str] = [text]
        for sid in matcher.occurring(text):
            tok = self._texts[sid]
            attr = self._attrs[sid]
            new: list[int | str] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    new.append(f)
                    continue
                start, end = 0, len(f)
                while True:
                    m = f.find(tok, start)
                    if m < 0:
                        new.append(f[start:])
                        break
                    left_end = m
                    if attr & ATTR_LSTRIP:
                        while left_end > start and f[left_end - 1] in _C_SPACE_STR:
                            left_end -= 1
                    if left_end > start:
                        new.append(f[start:left_end])
                    new.append(sid)
                    start = m + len(tok)
                    if attr & ATTR_RSTRIP:
                        while start < end and f[start] in _C_SPACE_STR:
                            start += 1
                    if start >= end:
                        break
            frags = new
        return frags

    # ---- BPE -------------------------------------------------------------------------------------
    def pre_tokenize(self, text: str) -> list[str]:
        """unicode_regex_split: the words BPE sees (before byte encoding), for a raw fragment."""
        if not text:
            return []
        segments = [(0, len(text))]
        collapsed = text.translate(_COLLAPSE) if self._need_collapse else text
        wide = None
        for pattern, use_collapsed in self._regexes:
            if use_collapsed:
                subject = collapsed
            else:
                if wide is None:
                    wide = text.translate(_WIDE)
                subject = wide
            finditer = pattern.finditer
            new: list[tuple[int, int]] = []
            append = new.append
            for s, e in segments:
                pos = s
                for m in finditer(subject, s, e):
                    ms, me = m.span()
                    if ms > pos:
                        append((pos, ms))
                    if me > ms:
                        append((ms, me))
                    pos = me
                if pos < e:
                    append((pos, e))
            segments = new
        return [text[s:e] for s, e in segments]

    def _tokenize_bpe_text(self, text: str) -> list[int]:
        """llm_tokenizer_bpe_session::tokenize on one raw fragment."""
        out: list[int] = []
        cache = self._bpe_cache
        for word in self.pre_tokenize(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) >= self.BPE_CACHE_SIZE:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """The ids of one pre-token word: byte-encode, then merge pairs by rank.

        Lowest rank first, leftmost on ties (llm_bigram_bpe's order); a symbol that is not a token
        falls back to its single-byte tokens.
        """
        t2i = self._t2i
        enc = "".join([_BYTE_TO_CHAR[b] for b in word.encode("utf-8", "surrogatepass")])
        if self.ignore_merges:
            t = t2i.get(enc)
            if t is not None:
                return (t,)
        syms = list(enc)
        n = len(syms)
        if n > 1:
            ranks = self._ranks
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prv = list(range(-1, n - 1))
            heap = []
            for i in range(n - 1):
                r = ranks.get((syms[i], syms[i + 1]))
                if r is not None:
                    heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
            heapq.heapify(heap)
            pop, push = heapq.heappop, heapq.heappush
            while heap:
                _, left, right, merged = pop(heap)
                ls, rs = syms[left], syms[right]
                if not ls or not rs or ls + rs != merged:
                    continue                      # outdated bigram
                syms[left] = merged
                syms[right] = ""
                nx = nxt[right]
                nxt[left] = nx
                if nx >= 0:
                    prv[nx] = left
                p = prv[left]
                if p >= 0:
                    r = ranks.get((syms[p], merged))
                    if r is not None:
                        push(heap, (r, p, left, syms[p] + merged))
                if nx >= 0:
                    r = ranks.get((merged, syms[nx]))
                    if r is not None:
                        push(heap, (r, left, nx, merged + syms[nx]))
        out: list[int] = []
        for s in syms:
            if not s:
                continue
            t = t2i.get(s)
            if t is not None:
                out.append(t)
                continue
            for b in s.encode("utf-8", "surrogateescape"):
                t = t2i.get(bytes([b]).decode("utf-8", "surrogateescape"))
                if t is not None:
                    out.append(t)
        return tuple(out)

    # ---- SPM -------------------------------------------------------------------------------------
    def _tokenize_spm(self, text: str) -> list[int]:
        """llm_tokenizer_spm_session::tokenize on one (space-escaped) valid fragment: one symbol
        per character."""
        return self._spm_merge(list(text), self._t2i.get)

    def _tokenize_spm_bytes(self, data: bytes) -> list[int]:
        """llm_tokenizer_spm_session::tokenize on raw (space-escaped) bytes that are not UTF-8.

        As llama.cpp: one symbol per lead byte and as many bytes as it announces
        (unicode_len_utf8, cut at the end), without validation, so C3 41 is one symbol; symbols
        are compared with the vocabulary byte for byte.
        """
        syms: list[bytes] = []
        i, n = 0, len(data)
        while i < n:
            k = _UTF8_LEN[data[i] >> 4]
            syms.append(data[i:i + k])
            i += k
        t2i = self._t2i
        return self._spm_merge(syms, lambda b: t2i.get(b.decode("utf-8", "surrogateescape")))

    def _spm_merge(self, syms: list, lookup: Any) -> list[int]:
        """The SPM merge over initial symbols (str, or bytes with a byte-exact lookup).

        Bigrams that form a token are merged by that token's score, highest first, leftmost on
        ties; a final symbol that is no token is emitted as its <0xXX> byte tokens.
        """
        t2i, scores = lookup, self._scores
        n = len(syms)
        if n == 0:
            return []
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            t = t2i(syms[i] + syms[i + 1])
            if t is not None:
                heap.append((-scores[t], i, i + 1, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        lens = [1] * n
        while heap:
            _, left, right, size = pop(heap)
            ln, rn = lens[left], lens[right]
            if ln == 0 or rn == 0 or ln + rn != size:
                continue
            syms[left] += syms[right]
            lens[left] = size
            lens[right] = 0
            nx = nxt[right]
            nxt[left] = nx
            if nx >= 0:
                prv[nx] = left
            p = prv[left]
            if p >= 0:
                t = t2i(syms[p] + syms[left])
                if t is not None:
                    push(heap, (-scores[t], p, left, lens[p] + size))
            if nx >= 0:
                t = t2i(syms[left] + syms[nx])
                if t is not None:
                    push(heap, (-scores[t], left, nx, size + lens[nx]))
        out: list[int] = []
        i = 0
        while i != -1:
            s = syms[i]
            t = t2i(s)
            if t is not None:
                out.append(t)
            else:
                for b in (s if isinstance(s, bytes) else s.encode("utf-8", "surrogateescape")):
                    out.append(self._byte_to_token(b))
            i = nxt[i]
        return out

    # ---- pieces and detokenize -------------------------------------------------------------------
    def _piece(self, token: int) -> bytes:
        """token_to_piece(token, special=True) without lstrip: the cached rendering."""
        piece = self._pieces.get(token)
        if piece is not None:
            return piece
        text, attr = self._texts[token], self._attrs[token]
        if attr & (_ATTR_SPECIAL | ATTR_USER_DEFINED):
            piece = text.encode("utf-8", "surrogateescape")
        elif attr & ATTR_NORMAL:
            if self.vocab_type == "spm" or self.escape_whitespaces:
                piece = text.replace(_SPM_SPACE, " ").encode("utf-8", "surrogateescape")
            else:
                piece = _decode_byte_level(text)
        elif attr & ATTR_BYTE:
            piece = bytes([int(text[3:5], 16)])
        else:
            piece = b""
        self._pieces[token] = piece
        return piece

    def token_to_piece(self, token: int, special: bool = True, lstrip: int = 0) -> bytes:
        """llama_token_to_piece: the bytes a token stands for.

        Args:
            token: an int or numpy integer in [0, n_vocab).
            special: render CONTROL/UNKNOWN tokens by their text (else they give b"").
            lstrip: drop up to this many leading spaces.
        Raises:
            TypeError: `token` or `lstrip` is not an integer (a float, a bool, a str, ...).
            ValueError: the id is outside the vocabulary (where llama.cpp aborts).
        """
        token = self._check(token)
        if lstrip:
            lstrip = integer(lstrip, "lstrip")
        if not special and self._attrs[token] & _ATTR_SPECIAL:
            return b""
        piece = self._piece(token)
        if lstrip:
            k = 0
            while k < lstrip and k < len(piece) and piece[k] == 0x20:
                k += 1
            piece = piece[k:]
        return piece

    def detokenize_bytes(self, tokens: Iterable[int], remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        """llama_detokenize as raw bytes (may end inside a multi-byte character).

        Raises:
            TypeError: an id is not an integer. ValueError: an id outside the vocabulary.
        """
        toks = self._check_many(tokens)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and toks and toks[0] == self.bos:
            remove_space = False
            toks = toks[1:]
        if remove_special and self.add_eos and toks and toks[-1] == self.eos:
            toks = toks[:-1]
        # token_to_piece of each (already checked) id; lstrip=1 applies to the first one only
        pieces, piece, attrs = self._pieces, self._piece, self._attrs
        skip = 0 if unparse_special else _ATTR_SPECIAL
        parts = [b"" if attrs[t] & skip else (pieces.get(t) or piece(t)) for t in toks]
        if remove_space and parts and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        if self.clean_spaces and data:
            data = _clean_spaces(data)
        return data

    def detokenize(self, tokens: Iterable[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """llama_detokenize: the text of `tokens` (invalid UTF-8 shown as U+FFFD).

        Args:
            tokens: ints or numpy integers in [0, n_vocab) (a list, any iterable, or a 1-D
                integer numpy array); checked in one pass (TypeError / ValueError as
                `detokenize_bytes`).
            remove_special: drop a leading BOS / trailing EOS the vocabulary would have added.
            unparse_special: render CONTROL tokens by their text (else they vanish).
        """
        return self.detokenize_bytes(tokens, remove_special, unparse_special).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return (f"Tokenizer({self.vocab_type.upper()}, model={self.model!r}, pre={self.pre!r}, "
                f"n_vocab={self.n_vocab}, bos={self.bos}, eos={self.eos}, add_bos={self.add_bos})")


def _decode_byte_level(text: str) -> bytes:
    """llama_decode_text: GGUF byte-level text back to bytes; unknown characters as llama.cpp marks them."""
    out = bytearray()
    for ch in text:
        b = _CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8", "surrogateescape").hex().encode() \
                + text.encode("utf-8", "surrogateescape") + b"]"
    return bytes(out)


def _clean_spaces(data: bytes) -> bytes:
    """The three clean_up_tokenization_spaces passes of llama_vocab::impl::detokenize, in place."""
    t = bytearray(data)
    # 1: " ?", " !", " .", " ," lose the space
    n = len(t)
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    # 2: a single apostrophe between spaces loses both spaces
    n = total
    total = 1 if n else 0
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    # 3: " 's", " 'm", " 're", " 've" lose the space
    n = total
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"td":
                pass
            elif x1 in b"sm":
                total -= 1
            elif i + 2 < n:
                x2 = t[i + 2]
                if (x1 == 0x72 and x2 == 0x65) or (x1 == 0x76 and x2 == 0x65):  # 're 've
                    total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


class _SpecialMatcher:
    """Which special tokens occur in a text, in cache order (a trie scan for large sets)."""

    _SMALL = 64

    def __init__(self, ids: Sequence[int], texts: Sequence[str]) -> None:
        self.ids = list(ids)
        self.texts = texts
        self.trie: dict | None = None
        if len(self.ids) > self._SMALL:
            root: dict = {}
            for i in self.ids:
                node = root
                for ch in texts[i]:
                    node = node.setdefault(ch, {})
                node[None] = i
            self.trie = root
            self.first = re.compile("[" + "".join(re.escape(c) for c in root) + "]")

    def occurring(self, text: str) -> list[int]:
        if self.trie is None:
            texts = self.texts
            return [i for i in self.ids if texts[i] in text]
        found: set[int] = set()
        root, n = self.trie, len(text)
        for m in self.first.finditer(text):
            node = root
            j = m.start()
            while j < n:
                child = node.get(text[j])
                if child is None:
                    break
                node = child
                t = node.get(None)
                if t is not None:
                    found.add(t)
                j += 1
        return [i for i in self.ids if i in found] if found else []


class TextStream:
    """Streaming detokenizer for generation: push tokens, get complete UTF-8 text.

    Bytes of a character split across tokens are held back until the character is complete;
    an invalid sequence becomes U+FFFD. `flush()` returns what is left (at the end).

    Args:
        tokenizer: the model's Tokenizer.
        special: render CONTROL tokens (e.g. "<|im_end|>") by their text; off by default, as
            llama.cpp's examples print generated text.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        """The text completed by `token` ("" while a character is still incomplete)."""
        return self._decoder.decode(self.tokenizer.token_to_piece(token, special=self.special))

    def flush(self) -> str:
        """What is still held back (incomplete bytes become U+FFFD); the stream restarts empty."""
        out = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return out
