"""csrc/buffers: gather_xor / copy_rows / xor64 equal their scalar oracles and numpy for any rows,
strides, offsets (every byte lane) and thread count; the checksum is the state format's (the XOR
of the little-endian uint64 words, zero-padded)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax._native import buffers


def xor_words(buf) -> int:
    """The checksum by numpy: zero-pad to a multiple of 8, XOR the little-endian uint64 words."""
    b = np.frombuffer(bytes(buf), np.uint8)
    b = np.concatenate([b, np.zeros(-b.size % 8, np.uint8)])
    return int(np.bitwise_xor.reduce(b.view("<u8"))) if b.size else 0


def strided_rows(rng, rows: int, n: int, pad: int) -> np.ndarray:
    """[rows, n] uint8 rows `pad` bytes apart (a column range of a wider array), or contiguous."""
    wide = rng.integers(0, 256, (rows, n + pad), dtype=np.uint8)
    lo = int(rng.integers(0, pad + 1))
    return wide[:, lo:lo + n]


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 7), st.integers(1, 4))
def test_xor64_is_the_word_xor(data, skip, n_threads):
    mv = memoryview(data)[min(skip, len(data)):]  # any start address
    assert buffers.xor64(mv, n_threads) == buffers.xor64_ref(mv) == xor_words(mv)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("n", [(1 << 21) + 3, 3 << 20])
def test_xor64_of_large_buffers_splits_words_across_threads(n, n_threads):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert buffers.xor64(data[1:], n_threads) == buffers.xor64_ref(data[1:]) == xor_words(data[1:])


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_gather_xor_writes_the_parts_and_checksums_them(data, n_threads):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shapes = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(0, 9)), max_size=8))
    parts = [strided_rows(rng, *s) for s in shapes]
    # back to back with gaps of 0..9 bytes: every byte lane
    offsets, at = [], data.draw(st.integers(0, 9))
    for p in parts:
        offsets.append(at)
        at += p.size + data.draw(st.integers(0, 9))
    want = np.zeros(at, np.uint8)
    for o, p in zip(offsets, parts):
        want[o:o + p.size] = p.reshape(-1)
    out, ref = np.zeros(at, np.uint8), np.zeros(at, np.uint8)
    x = buffers.gather_xor(out, offsets, parts, n_threads)
    assert x == buffers.gather_xor_ref(ref, offsets, parts) == xor_words(want)
    assert np.array_equal(out, want) and np.array_equal(ref, want)
    # the same into a new bytes object
    b = buffers.BytesBuilder(at)
    assert buffers.gather_xor(b, offsets, parts, n_threads) == x
    for o0, o1 in zip([0] + [o + p.size for o, p in zip(offsets, parts)], offsets + [at]):
        b.write(o0, bytes(o1 - o0))  # the gaps
    assert b.take() == want.tobytes()


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_gather_xor_of_large_parts_splits_rows_across_threads(n_threads):
    rng = np.random.default_rng(1)
    parts = [strided_rows(rng, 2048, 384, 0), strided_rows(rng, 192, 4096, 12000), strided_rows(rng, 3, 5, 1)]
    offsets = [0, 2048 * 384, 2048 * 384 + 192 * 4096 + 3]  # the last at an odd lane
    n = offsets[-1] + 15
    out, ref = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    x = buffers.gather_xor(out, offsets, parts, n_threads)
    assert x == buffers.gather_xor_ref(ref, offsets, parts) == xor_words(out)
    assert np.array_equal(out, ref)
    assert np.array_equal(out[offsets[1]:offsets[2] - 3].reshape(192, 4096), parts[1])


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_copy_rows_is_copyto(data, n_threads):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shapes = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), max_size=6))
    srcs = [strided_rows(rng, r, n, data.draw(st.integers(0, 9))) for r, n in shapes]
    big = [np.zeros((r, n + 7), np.uint8) for r, n in shapes]
    dsts = [b[:, 3:3 + n] for b, (r, n) in zip(big, shapes)]
    refs = [np.zeros((r, n), np.uint8) for r, n in shapes]
    buffers.copy_rows(dsts, srcs, n_threads)
    buffers.copy_rows_ref(refs, srcs)
    for b, d, r, s in zip(big, dsts, refs, srcs):
        assert np.array_equal(d, s) and np.array_equal(r, s)
        assert not b[:, :3].any() and not b[:, 3 + s.shape[1]:].any()  # nothing outside


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_copy_rows_of_large_runs(n_threads):
    rng = np.random.default_rng(2)
    cache = np.zeros((3, 64, 4096), np.uint8)            # a transposed V: [channels, cells]
    src = rng.integers(0, 256, (3 * 64, 1000), dtype=np.uint8)
    k, ksrc = np.zeros((2048, 384), np.uint8), rng.integers(0, 256, (1, 2048 * 384), dtype=np.uint8)
    buffers.copy_rows([cache.reshape(-1, 4096)[:, 17:1017], k.reshape(1, -1)], [src, ksrc], n_threads)
    assert np.array_equal(cache.reshape(-1, 4096)[:, 17:1017], src) and not cache[..., :17].any()
    assert np.array_equal(k.reshape(1, -1), ksrc)


def test_refusals():
    a = np.arange(40, dtype=np.uint8).reshape(4, 10)
    with pytest.raises(ValueError, match="contiguous"):
        buffers.gather_xor(np.zeros(40, np.uint8), [0], [a[:, ::2]])
    with pytest.raises(ValueError, match="do not fit"):
        buffers.gather_xor(np.zeros(39, np.uint8), [0], [a])
    with pytest.raises(ValueError, match="do not fit"):
        buffers.gather_xor(np.zeros(40, np.uint8), [-1], [a])
    with pytest.raises(ValueError, match="offsets"):
        buffers.gather_xor(np.zeros(40, np.uint8), [], [a])
    with pytest.raises((ValueError, BufferError)):
        buffers.gather_xor(bytes(40), [0], [a])           # read-only
    with pytest.raises(ValueError, match="into"):
        buffers.copy_rows([np.zeros((4, 9), np.uint8)], [a])
    with pytest.raises((ValueError, BufferError)):
        buffers.copy_rows([np.zeros((4, 10), np.uint8)[::-1]], [a])
    b = buffers.BytesBuilder(4)
    with pytest.raises(ValueError, match="do not fit"):
        b.write(2, b"abc")
    b.write(0, b"abcd")
    assert b.take() == b"abcd"
    with pytest.raises(ValueError, match="taken"):
        b.take()
    with pytest.raises(ValueError, match="taken"):
        buffers.gather_xor(b, [0], [a[:1, :4]])
    with pytest.raises(ValueError):
        buffers.BytesBuilder(-1)
