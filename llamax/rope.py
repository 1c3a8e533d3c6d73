"""RoPE configuration (the rope parameters llama.cpp keeps in its hparams/cparams).

A KV cache given a RoPE can shift: seq_add / seq_div mark cells, and the next memory update
rotates their cached K by the change of position (llama.cpp's K-shift).
"""
from __future__ import annotations

from dataclasses import dataclass

ROPE_KINDS = {"norm": 0, "neox": 2}  # ggml's GGML_ROPE_TYPE_NORM / _NEOX


@dataclass(frozen=True)
class RoPE:
    """Rotary position embedding applied to the first n_rot dims of each head.

    Args:
        n_rot: rotated dims per head (even, > 0).
        freq_base: theta base (10000 for llama 1/2, 1e6 for Gemma 3 full layers...).
        freq_scale: linear position scale (1 / context-extension factor).
        kind: "norm" rotates pairs (2i, 2i+1); "neox" rotates pairs (i, i + n_rot/2).
    """

    n_rot: int
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    kind: str = "norm"

    def __post_init__(self) -> None:
        if self.n_rot <= 0 or self.n_rot % 2:
            raise ValueError(f"n_rot must be even and > 0, got {self.n_rot}")
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RoPE kind {self.kind!r} not in {sorted(ROPE_KINDS)}")
        if not self.freq_base > 0 or not self.freq_scale > 0:
            raise ValueError(f"freq_base {self.freq_base} and freq_scale {self.freq_scale} must be > 0")

    @property
    def mode(self) -> int:
        """ggml's rope mode number."""
        return ROPE_KINDS[self.kind]
