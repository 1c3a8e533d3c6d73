"""csrc/buffers: join() equals b"".join and its scalar oracle for any parts and thread count."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax._native import buffers


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=12), st.integers(1, 4))
def test_join_is_bytes_join(parts, n_threads):
    assert buffers.join(parts, n_threads) == b"".join(parts) == buffers.join_ref(parts)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_join_of_large_arrays_splits_parts_across_threads(n_threads):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1 << 20, 5, 3 << 19, 0, 777)]
    parts.append(np.arange(1000, dtype=np.float32))  # any C-contiguous buffer, taken as bytes
    out = buffers.join(parts, n_threads)
    assert isinstance(out, bytes)
    assert out == b"".join(p.tobytes() for p in parts) == buffers.join_ref(parts)


def test_join_refuses_strided_buffers():
    with pytest.raises(ValueError, match="contiguous"):
        buffers.join([np.arange(10, dtype=np.uint8)[::2]])
