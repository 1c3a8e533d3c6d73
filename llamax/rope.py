"""RoPE configuration (the rope parameters llama.cpp keeps in its hparams/cparams).

A KV cache given a RoPE can shift: seq_add / seq_div mark cells, and the next memory update
rotates their cached K by the change of position (llama.cpp's K-shift), with the layer's own
frequency factors and YaRN parameters as llama.cpp's build_rope_shift does.

The scaling kinds (csrc/rope.h has the formula, ggml_rope_ext's):
  * linear: freq_scale < 1 scales every angle;
  * frequency factors: freq_factors divide pair i's angle (Llama 3's rope_freqs.weight, Phi-3.5 /
    Phi-4-mini LongRoPE's rope_factors_long / short, with an attn_factor);
  * YaRN (ext_factor != 0, Qwen2.5 with rope.scaling.type yarn): per pair, a blend of the scaled and the
    unscaled angle along a ramp over corr_dims (from n_ctx_orig, beta_fast, beta_slow), and cos / sin
    times attn_factor * (1 + 0.1 ln(1 / freq_scale));
  * attn_factor alone: cos / sin times it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from llamax._native import rope as _rope

ROPE_KINDS = {"norm": 0, "neox": 2}  # ggml's GGML_ROPE_TYPE_NORM / _NEOX


def _finite(name: str, v: float) -> None:
    if not math.isfinite(v):
        raise ValueError(f"RoPE {name} must be finite, got {v}")


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding applied to the first n_rot dims of each head. Frozen and hashable;
    the defaults of the scaling fields give plain RoPE (the kernels' bits unchanged).

    Args:
        n_rot: rotated dims per head (even, > 0).
        freq_base: theta base (10000 for llama 1/2, 1e6 for Gemma 3 full layers...).
        freq_scale: linear position scale (1 / context-extension factor).
        kind: "norm" rotates pairs (2i, 2i+1); "neox" rotates pairs (i, i + n_rot/2).
        freq_factors: n_rot/2 divisors of each pair's angle (finite, > 0), or None; any sequence of
            numbers, stored as a tuple of floats (the kernels read them as float32: `factors`).
        ext_factor: YaRN mix, 0 = off (finite, >= 0); != 0 needs n_ctx_orig > 0.
        attn_factor: the magnitude of cos and sin (ggml's mscale before YaRN's own), finite, > 0.
        beta_fast, beta_slow: YaRN's correction range, in turns over n_ctx_orig (finite, > 0).
        n_ctx_orig: the training context YaRN extends (llama.cpp's n_ctx_orig_yarn); 0 = none.

    Raises:
        ValueError: a field out of range (the offending value in the message).
    """

    n_rot: int
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    kind: str = "norm"
    freq_factors: tuple[float, ...] | None = None
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0

    def __post_init__(self) -> None:
        if self.n_rot <= 0 or self.n_rot % 2:
            raise ValueError(f"n_rot must be even and > 0, got {self.n_rot}")
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RoPE kind {self.kind!r} not in {sorted(ROPE_KINDS)}")
        if not self.freq_base > 0 or not self.freq_scale > 0:
            raise ValueError(f"freq_base {self.freq_base} and freq_scale {self.freq_scale} must be > 0")
        if self.freq_factors is not None:
            arr = np.asarray(self.freq_factors, dtype=np.float64)
            if arr.ndim != 1:
                raise ValueError(f"freq_factors must be a flat sequence of n_rot/2 numbers, got shape {arr.shape}")
            ff = tuple(float(v) for v in arr)
            if len(ff) != self.n_rot // 2:
                raise ValueError(f"freq_factors: {len(ff)} values, n_rot/2 = {self.n_rot // 2} expected")
            bad = [v for v in ff if not (math.isfinite(v) and v > 0)]
            if bad:
                raise ValueError(f"freq_factors must be finite and > 0, got {bad[0]}")
            object.__setattr__(self, "freq_factors", ff)
        for name in ("ext_factor", "attn_factor", "beta_fast", "beta_slow"):
            _finite(name, getattr(self, name))
        if self.ext_factor < 0:
            raise ValueError(f"ext_factor must be >= 0 (0 = no YaRN), got {self.ext_factor}")
        if not self.attn_factor > 0 or not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(f"attn_factor {self.attn_factor}, beta_fast {self.beta_fast} and beta_slow "
                             f"{self.beta_slow} must be > 0")
        if int(self.n_ctx_orig) != self.n_ctx_orig or self.n_ctx_orig < 0:
            raise ValueError(f"n_ctx_orig must be an integer >= 0, got {self.n_ctx_orig}")
        if self.ext_factor != 0 and self.n_ctx_orig <= 0:
            raise ValueError(f"YaRN (ext_factor {self.ext_factor}) needs n_ctx_orig > 0, got {self.n_ctx_orig}")

    @property
    def mode(self) -> int:
        """ggml's rope mode number."""
        return ROPE_KINDS[self.kind]

    @cached_property
    def corr_dims(self) -> tuple[float, float]:
        """YaRN's ramp bounds over the pairs (ggml_rope_yarn_corr_dims of n_rot, n_ctx_orig, freq_base,
        beta_fast, beta_slow); (0.0, 0.0) when n_ctx_orig is 0 (no YaRN: the kernels do not read them)."""
        if self.n_ctx_orig == 0:
            return (0.0, 0.0)
        return _rope.yarn_corr_dims(self.n_rot, int(self.n_ctx_orig), self.freq_base, self.beta_fast, self.beta_slow)

    @cached_property
    def factors(self) -> np.ndarray | None:
        """freq_factors as the kernels read them: a read-only float32 [n_rot/2] array, or None."""
        if self.freq_factors is None:
            return None
        a = np.array(self.freq_factors, dtype=np.float32)
        a.flags.writeable = False
        return a

    @property
    def scaling_kwargs(self) -> dict[str, Any]:
        """The scaling keywords of llamax._native.rope's functions (freq_factors, ext_factor,
        attn_factor, corr_dims) for this RoPE: rope_f32(x, pos, r.n_rot, r.freq_base, r.freq_scale,
        r.mode, n_threads, **r.scaling_kwargs)."""
        return {"freq_factors": self.factors, "ext_factor": self.ext_factor, "attn_factor": self.attn_factor,
                "corr_dims": self.corr_dims}


def yarn_attn_factor(freq_scale: float, *, log_mul: float = 0.0, mscale: float = 1.0,
                     rope_attn_factor: float = 1.0) -> float:
    """The attn_factor llama.cpp gives a YaRN context (llama_context's constructor, yarn_ext_factor != 0).

    With factor = 1 / freq_scale and get_mscale(s, m) = 1 if s <= 1 else 1 + 0.1 m ln s:
        a = get_mscale(factor, mscale) / get_mscale(factor, log_mul)   if log_mul != 0
            (rope.scaling.yarn_log_multiplier; mscale 1, or log_mul for DeepSeek-V2)
        a = get_mscale(factor, 1)                                      otherwise
        a *= 1 / (1 + 0.1 ln factor)     (cancels the magnitude the kernel's YaRN branch adds)
        a *= rope_attn_factor            (the GGUF's rope.attn_factor, 1 when absent)
    Computed in float32 steps as llama.cpp does; the logarithm is float64's rounded to float32, so the
    result may differ from llama.cpp's logf by an ulp.

    Raises:
        ValueError: freq_scale not finite and > 0.
    """
    if not (math.isfinite(freq_scale) and freq_scale > 0):
        raise ValueError(f"freq_scale must be finite and > 0, got {freq_scale}")
    f32 = np.float32

    def logf(v: np.float32) -> np.float32:
        return f32(math.log(float(v)))

    def get_mscale(s: np.float32, m: float) -> np.float32:
        return f32(1.0) if s <= 1 else f32(0.1) * f32(m) * logf(s) + f32(1.0)

    factor = f32(1.0) / f32(freq_scale)
    if log_mul != 0:
        a = get_mscale(factor, mscale) / get_mscale(factor, log_mul)
    else:
        a = get_mscale(factor, 1.0)
    a = a * (f32(1.0) / (f32(1.0) + f32(0.1) * logf(factor)))
    return float(a * f32(rope_attn_factor))


def llama3_freq_factors(n_rot: int, freq_base: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 8192) -> tuple[float, ...]:
    """The frequency factors of Llama 3.1's RoPE scaling (rope_type "llama3"), as convert_hf_to_gguf writes
    them to rope_freqs.weight: one per pair of the n_rot rotated dims, 1 where the wavelength is below
    original_context / high_freq_factor, factor above original_context / low_freq_factor, a smooth blend
    between. For RoPE(freq_factors=...) in model code of one's own; a GGUF carries its own.

    Raises:
        ValueError: n_rot not even and > 0, or freq_base not > 0.
    """
    if n_rot <= 0 or n_rot % 2 or not freq_base > 0:
        raise ValueError(f"n_rot must be even and > 0 and freq_base > 0, got {n_rot}, {freq_base}")
    low_wl, high_wl = original_context / low_freq_factor, original_context / high_freq_factor
    n = n_rot // 2
    out = []
    for i in range(n):
        wl = 2 * math.pi / (1.0 / freq_base ** (2 * i / (2 * n)))
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (original_context / wl - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(float(np.float32(x)) for x in out)
