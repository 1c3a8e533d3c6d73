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
