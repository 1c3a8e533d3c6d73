"""Benchmark of the KQ mask fill (csrc/kq_mask.c) against a numpy-vectorised construction.

Scenario (a prompt-processing ubatch late in a long context): one stream, n_kv = 32768 cells of
which the first half hold sequence 0 at positions 0..16383, a ubatch of 512 tokens (the last 512
of those positions, already applied to the cells as llama.cpp does before building the mask),
causal attention, SWA off and standard SWA on (n_swa = 1024), plus ALiBi (every row computed)
and the same ubatch split over 8 sequences for reference.

Prints the median over --runs runs (>= 5) of each variant, the GB/s of mask written
(mask bytes / median time), and the ratio to numpy measured in the same run.

    PYTHONPATH=. python benchmarks/bench_kq_mask.py [--runs 9] [--n-kv 32768] [--n-tokens 512]
"""
import argparse
import os

import numpy as np
from timing import median_time

from llamax._native import kq_mask as km


def make_case(n_kv: int, n_tokens: int, n_seq: int = 1):
    """Cells [0, n_kv/2) used; tokens of the ubatch at the end of the used range."""
    n_used = n_kv // 2
    pos = np.full(n_kv, -1, dtype=np.int32)
    seq = np.zeros((n_kv, 4), dtype=np.uint64)
    # n_seq sequences, each a contiguous range of positions in its own block of cells
    per = n_used // n_seq
    tok_pos = np.empty(n_tokens, dtype=np.int32)
    tok_seq = np.empty(n_tokens, dtype=np.int32)
    tps = n_tokens // n_seq
    for q in range(n_seq):
        pos[q * per:(q + 1) * per] = np.arange(per, dtype=np.int32)
        seq[q * per:(q + 1) * per, q // 64] |= np.uint64(1) << np.uint64(q % 64)
        tok_pos[q * tps:(q + 1) * tps] = np.arange(per - tps, per, dtype=np.int32)
        tok_seq[q * tps:(q + 1) * tps] = q
    return [pos], [seq], tok_pos, tok_seq


def numpy_mask(cell_pos, cell_seq, tok_pos, tok_seq, causal, n_swa, swa_type, alibi, out):
    """The same mask with numpy broadcasting (one stream; swa_type none or standard)."""
    pos, seq = cell_pos[0], cell_seq[0]
    p0 = pos[None, :]
    p1 = tok_pos[:, None]
    vis = np.empty(out.shape[1:], dtype=bool)
    for q in np.unique(tok_seq):
        rows = tok_seq == q
        has = ((seq[:, q // 64] >> np.uint64(q % 64)) & np.uint64(1)).astype(bool) & (pos >= 0)
        v = np.broadcast_to(has[None, :], (int(rows.sum()), pos.shape[0])).copy()
        if causal:
            v &= p0 <= p1[rows]
        if swa_type == 1:
            v &= (p1[rows] - p0) < n_swa
        vis[rows] = v
    if alibi:
        val = -np.abs(p0 - p1).astype(np.float32)
        np.copyto(out[0], np.where(vis, val, np.float32(-np.inf)))
    else:
        np.copyto(out[0], np.where(vis, np.float32(0.0), np.float32(-np.inf)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--n-kv", type=int, default=32768)
    ap.add_argument("--n-tokens", type=int, default=512)
    args = ap.parse_args()
    runs = max(5, args.runs)

    n_tps_pad = km.kq_mask_n_tps_pad(args.n_tokens)
    out = np.empty((1, n_tps_pad, args.n_kv), dtype=np.float32)
    gb = out.nbytes / 1e9
    print(f"kq_mask: n_kv={args.n_kv} n_tokens={args.n_tokens} (pad {km.KQ_MASK_PAD}) "
          f"mask {out.nbytes / 2**20:.0f} MiB, median of {runs} runs, {km.resolve_n_threads(None)} cores, "
          f"load average {os.getloadavg()[0]:.2f} (2-thread figures need an idle machine)")
    print(f"{'case':<34}{'variant':<22}{'ms':>9}{'GB/s':>8}{'x numpy':>9}")

    cases = [
        ("causal, 1 seq, swa off", 1, dict(causal=True, n_swa=0, swa_type=0, alibi=False)),
        ("causal, 1 seq, swa 1024", 1, dict(causal=True, n_swa=1024, swa_type=1, alibi=False)),
        ("causal, 1 seq, alibi", 1, dict(causal=True, n_swa=0, swa_type=0, alibi=True)),
        ("causal, 8 seqs, swa off", 8, dict(causal=True, n_swa=0, swa_type=0, alibi=False)),
    ]
    for name, n_seq, kw in cases:
        cp, cs, tp, ts = make_case(args.n_kv, args.n_tokens, n_seq)
        ref = km.kq_mask_fill_ref(cp, cs, tp, ts, **kw)
        np_out = np.empty_like(out)
        numpy_mask(cp, cs, tp, ts, kw["causal"], kw["n_swa"], kw["swa_type"], kw["alibi"], np_out)
        assert np.array_equal(np_out, ref), "numpy baseline disagrees with the reference"

        t_np = median_time(lambda: numpy_mask(cp, cs, tp, ts, kw["causal"], kw["n_swa"],
                                              kw["swa_type"], kw["alibi"], np_out), runs)
        rows = [("numpy", t_np), ("ref (scalar, 1 thr)", median_time(
            lambda: km.kq_mask_fill_ref(cp, cs, tp, ts, out=out, **kw), runs))]
        for nt in (1, 2):
            rows.append((f"fill, {nt} thread{'s' if nt > 1 else ''}", median_time(
                lambda: km.kq_mask_fill(cp, cs, tp, ts, n_threads=nt, out=out, **kw), runs)))
            assert out.tobytes() == ref.tobytes()
        rows.append(("fill, 2 thr, no scratch", median_time(
            lambda: km.kq_mask_fill(cp, cs, tp, ts, n_threads=2, out=out, scratch=False, **kw), runs)))
        for label, t in rows:
            print(f"{name:<34}{label:<22}{t * 1e3:9.2f}{gb / t:8.2f}{t_np / t:9.1f}")
            name = ""


if __name__ == "__main__":
    main()
