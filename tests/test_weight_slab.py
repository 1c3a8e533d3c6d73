"""WeightSlab: the repacked weights of a GGUF file carved from 2 MB-aligned blocks (huge-page
candidates), each piece 64-byte aligned and disjoint from the others and from the file's mapping."""
from __future__ import annotations

import numpy as np

from llamax.model.linear import WeightSlab


def test_pieces_are_aligned_disjoint_views_of_aligned_blocks():
    slab = WeightSlab()
    shapes = [(8, 100), (16, 36), (1, 1), (24, 1000), (8, 18)]
    pieces = [slab.take(s) for s in shapes]
    for p, s in zip(pieces, shapes):
        assert p.shape == s and p.dtype == np.uint8 and p.flags.c_contiguous and p.flags.writeable
        assert p.ctypes.data % 64 == 0
        assert p.base is pieces[0].base and p.base.size >= WeightSlab.BLOCK   # views of one block
    assert pieces[0].ctypes.data % WeightSlab.ALIGN == 0                         # the block's start
    for i, p in enumerate(pieces):
        p[...] = i + 1
    for i, p in enumerate(pieces):
        assert (p == i + 1).all()             # no piece overlaps another


def test_a_full_block_starts_another_and_a_large_piece_gets_its_own():
    slab = WeightSlab()
    a = slab.take((1, WeightSlab.BLOCK - 64))
    b = slab.take((1, 128))                   # does not fit the rest of a's block
    assert not np.shares_memory(a, b) and b.ctypes.data % WeightSlab.ALIGN == 0
    big = slab.take((2, WeightSlab.BLOCK))    # larger than a block: a block of its own size
    assert big.size == 2 * WeightSlab.BLOCK and big.ctypes.data % WeightSlab.ALIGN == 0


def test_model_weights_live_in_slabs_not_in_the_mapping(model):
    """Every weight Part of the loaded model is a slab piece (its pages released from the mapping)."""
    parts = [model.tok_embd.part]
    for layer in model.layers:
        for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
            parts.extend(lin.parts)
    mapping = model.gguf.raw("token_embd.weight")
    for p in parts:
        assert p.raw.ctypes.data % 64 == 0
        assert not np.shares_memory(p.raw, mapping)
        assert p.raw.base is not None and p.raw.base.size >= WeightSlab.BLOCK   # carved from a block
