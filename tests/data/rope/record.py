"""Record the bits of plain RoPE (no frequency factors, ext_factor 0, attn_factor 1) as llamax computed
them before the RoPE scaling kinds existed, so that tests/test_rope.py can hold every later build to
exactly those bits (the scaling fields, left at their defaults, must not move a single one).

Run by hand from the repository root, never by the tests:

    python tests/data/rope/record.py

Writes plain.npz next to this file: for each case its inputs (x or the K rows, the positions or the
shifts, the parameters) and the outputs of rope_cache, rope_f32 and k_shift (f32, f16, q8_0 and a
Hadamard-rotated q8_0). The file committed was recorded with the kernels of the commit that
introduced it, whose rope.c had no scaling fields; rerunning the script with a later build must
reproduce it bit for bit (that is what the test checks).
"""
from pathlib import Path

import numpy as np

from llamax._native import quants as Q
from llamax._native import rope as R

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = np.random.default_rng(20261203)
    out: dict[str, np.ndarray] = {}
    # rope_cache: (p, n_rot, base, scale)
    for i, (p, n_rot, base, scale) in enumerate([(1, 64, 10000.0, 1.0), (30000, 128, 500000.0, 1.0),
                                                  (4095, 32, 1e6, 0.25), (77, 2, 10000.0, 1.0)]):
        out[f"cache{i}_args"] = np.array([p, n_rot, base, scale], np.float64)
        out[f"cache{i}_out"] = R.rope_cache(p, n_rot, base, scale)
    # rope_f32: (kind, n_rot, head_dim, base, scale)
    for i, (kind, n_rot, head_dim, base, scale) in enumerate([(0, 64, 64, 10000.0, 1.0), (2, 64, 64, 1e6, 1.0),
                                                               (0, 32, 48, 10000.0, 0.5), (2, 16, 80, 500000.0, 0.25)]):
        x = rng.standard_normal((8, 2, head_dim)).astype(np.float32)
        pos = rng.integers(0, 40000, 8).astype(np.int32)
        out[f"rope{i}_args"] = np.array([kind, n_rot, head_dim, base, scale], np.float64)
        out[f"rope{i}_x"], out[f"rope{i}_pos"] = x, pos
        out[f"rope{i}_out"] = R.rope_f32(x.copy(), pos, n_rot, base, scale, kind, n_threads=1)
    # k_shift: (type, kind, n_rot, head_dim, rot_block), 2 heads
    for i, (t, kind, n_rot, head_dim, rot) in enumerate([("f32", 0, 64, 64, 0), ("f16", 2, 32, 64, 0),
                                                          ("q8_0", 2, 64, 64, 0), ("q8_0", 0, 64, 64, 64)]):
        x = (rng.standard_normal((8, 2 * head_dim)) * 3).astype(np.float32)
        k = {"f32": x, "f16": x.astype(np.float16)}.get(t)
        if k is None:
            k = Q.quantize(t, x)
        shift = rng.integers(-3000, 3000, 8).astype(np.int32)
        shift[2] = 0
        out[f"shift{i}_args"] = np.array([kind, n_rot, head_dim, rot], np.int64)
        out[f"shift{i}_type"] = np.array(t)
        out[f"shift{i}_k"], out[f"shift{i}_shift"] = k, shift
        out[f"shift{i}_out"] = R.k_shift_ref(k.copy(), shift, 2, head_dim, n_rot, 10000.0, 1.0, kind,
                                             type=t, rot_block=rot)
    np.savez_compressed(HERE / "plain.npz", **out)


if __name__ == "__main__":
    main()
