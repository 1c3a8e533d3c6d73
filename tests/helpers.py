"""Small builders shared by the tests."""
from types import SimpleNamespace

import numpy as np


def seq_bits(seq_lists) -> np.ndarray:
    """uint64 [n, 4] bitsets of the given per-token sequence lists."""
    bits = np.zeros((len(seq_lists), 4), dtype=np.uint64)
    for i, seqs in enumerate(seq_lists):
        for s in seqs:
            bits[i, s // 64] |= np.uint64(1) << np.uint64(s % 64)
    return bits


def ubatch(positions, seq_lists, tokens=None):
    """A minimal ubatch for the slot finder: positions, every sequence of each token, the
    distinct sequences. Tokens default to the positions (so cells' ext.tok can be checked)."""
    positions = list(positions)
    seq_lists = [list(s) for s in seq_lists]
    unq = sorted({s for ss in seq_lists for s in ss})
    return SimpleNamespace(
        n_tokens=len(positions),
        pos=np.asarray(positions, dtype=np.int32),
        seq_bits=seq_bits(seq_lists),
        seq_id=np.asarray([ss[0] for ss in seq_lists], dtype=np.int32),
        seq_id_unq=np.asarray(unq, dtype=np.int32),
        token=np.asarray(positions if tokens is None else tokens, dtype=np.int32),
    )


def reference_dir(model: str):
    """The folder of llama.cpp's reference outputs for a model (shared/reference/<model>).

    It sits beside the checkout (../shared/reference) or in $LLAMAX_REFERENCE_DIR. Missing data fails the
    test, except where LLAMAX_NO_REFERENCE=1 says it cannot be there (wheel tests in cibuildwheel's
    containers), where the test is skipped.
    """
    import os
    from pathlib import Path

    import pytest

    root = Path(os.environ.get("LLAMAX_REFERENCE_DIR", Path(__file__).resolve().parents[2] / "shared" / "reference"))
    path = root / model
    if not path.is_dir():
        if os.environ.get("LLAMAX_NO_REFERENCE") == "1":
            pytest.skip(f"llama.cpp's reference data is not available here ({path})")
        pytest.fail(f"llama.cpp's reference data is missing: {path} (set LLAMAX_REFERENCE_DIR)")
    return path


def load_memory_ops(model: str) -> dict:
    """llama.cpp's recorded memory operations for a model (reference_dir(model)/memory_ops.json)."""
    import json

    return json.loads((reference_dir(model) / "memory_ops.json").read_text())


def check_top1_against(logits, top_ids, top_vals, gap):
    """llamax's top-1 per row against llama.cpp's top-k (ids, values) of the same rows: equal wherever
    llama.cpp's top-1/top-2 gap exceeds `gap`; elsewhere llama.cpp must rate llamax's choice within
    `gap` of its own best (among its top-k)."""
    import numpy as np

    top_ids, top_vals = np.asarray(top_ids), np.asarray(top_vals, np.float32)
    decided = top_vals[:, 0] - top_vals[:, 1] > gap
    ours = np.asarray(logits).argmax(axis=1)
    bad = np.flatnonzero(decided & (ours != top_ids[:, 0]))
    assert bad.size == 0, f"top-1 differs at rows {bad.tolist()}"
    for i in np.flatnonzero(~decided):
        hit = np.flatnonzero(top_ids[i] == ours[i])
        assert hit.size and top_vals[i, 0] - top_vals[i, hit[0]] <= gap, (i, ours[i], top_ids[i], top_vals[i])


def check_top5(logits, tops, where, logit_tol, gap):
    """A decode's logits against llama.cpp's recorded top-5 per output (memory_ops.json): values at its
    ids within logit_tol, top-1 by check_top1_against's rule. Returns the largest difference."""
    import numpy as np

    assert logits.shape[0] == len(tops), where
    ids = np.asarray([t["ids"] for t in tops])
    vals = np.asarray([t["vals"] for t in tops], np.float32)
    d = np.abs(np.take_along_axis(np.asarray(logits), ids, axis=1) - vals)
    assert d.max() <= logit_tol, (where, d.max(axis=1).tolist())
    check_top1_against(logits, ids, vals, gap)
    return float(d.max())


def without(cells, seq: int):
    """The cell list after seq_rm(seq) (unified cache: cells left with no sequence are empty)."""
    out = []
    for p, s in cells:
        s = s - {seq}
        out.append((p, s) if s else (-1, frozenset()))
    return out
