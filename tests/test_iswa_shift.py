"""Context shift on an interleaved SWA cache whose SWA cache is smaller than the context (llama.cpp
refuses it): after the same shift, the SWA layers must see exactly the cells a swa_full cache shows,
as long as the discard stays within KVCacheISWA.exact_shift_limit; beyond it the kept prefix comes
back into the window and the small cache lacks some of it (asserted too, so the limit is tight)."""
import numpy as np
import pytest

from llamax import Batch, KVCacheISWA, RoPE
from llamax.generate import context_shift

N_SWA, N_UB, N_CTX = 64, 32, 512


def iswa(swa_full, n_swa=N_SWA, n_seq_max=2):
    return KVCacheISWA(2, 1, 8, N_CTX, swa_layers=[1], n_swa=n_swa, swa_full=swa_full, n_ubatch=N_UB,
                       rope=RoPE(8), n_seq_max=n_seq_max)


def fill(mem, n, seq=0):
    """n tokens of seq, N_UB at a time (only the cells matter here)."""
    done = 0
    while done < n:
        k = min(N_UB, n - done)
        for _ in mem.plan(Batch(list(range(k)), seq_ids=[seq] * k), n_ubatch=N_UB):
            pass
        done += k


def visible(mem, seq=0):
    """Positions of seq's SWA-cache cells that the next token's window shows."""
    p_next = mem.seq_pos_max(seq) + 1
    return sorted(p for p, s in mem.swa.cells() if seq in s and p > p_next - mem.swa.n_swa)


def shift(mem, keep_end, n, seq=0):
    n_past = mem.seq_pos_max(seq) + 1
    mem.seq_rm(seq, keep_end, keep_end + n)
    mem.seq_add(seq, keep_end + n, n_past, -n)


def test_small_swa_cache_can_shift_and_is_small():
    small = iswa(False)
    assert small.swa.kv_size == 256 < small.base.kv_size and small.can_shift
    assert iswa(True).exact_shift_limit(0, 4) is None


@pytest.mark.parametrize("n_past", [300, 400, 511])
@pytest.mark.parametrize("keep_end", [0, 1, 8, 40])
def test_shift_within_the_limit_shows_what_swa_full_shows(n_past, keep_end):
    small, full = iswa(False), iswa(True)
    fill(small, n_past)
    fill(full, n_past)
    limit = small.exact_shift_limit(0, keep_end)
    assert small.swa.seq_pos_min(0) > 0  # the ring wrapped: the small cache lost the oldest cells
    n_left = n_past - keep_end
    exact = limit is None or limit >= n_left
    for n in range(1, n_left + 1, 7 if n_left > 100 else 1):
        a, b = iswa(False), iswa(True)
        fill(a, n_past)
        fill(b, n_past)
        shift(a, keep_end, n)
        shift(b, keep_end, n)
        same = visible(a) == visible(b)
        if exact or n <= limit:
            assert same, (n, limit)
        else:
            assert not same, (n, limit)  # the limit is tight: one more and a lost cell is in the window
    assert limit is None or limit >= 0


def test_context_shift_clamps_to_the_limit_and_keeps_the_window_exact():
    """A window of 200 in a 256-cell SWA cache: llama.cpp's default discard (half of the rest) would
    bring lost prefix cells back into the window; context_shift discards only up to the limit.
    (With n_ubatch >= n_swa, as Gemma's defaults, the SWA cache holds 2 windows and the default
    discard is always within the limit.)"""
    small, full = iswa(False, 200, 1), iswa(True, 200, 1)
    assert small.swa.kv_size == 256
    fill(small, 350)
    fill(full, 350)
    limit = small.exact_shift_limit(0, 8)
    assert limit == 350 + 1 - 200 - 8 < (350 - 8) // 2
    n, n_left = context_shift(small, 0, 8)          # default: half of the rest, clamped
    assert (n, n_left) == (limit, 342)
    shift(full, 8, n)
    assert visible(small) == visible(full)
    assert small.seq_pos_max(0) == full.seq_pos_max(0) == 349 - n
    # decoding goes on in both: the small cache reuses the cells its window hides
    fill(small, 100)
    fill(full, 100)
    assert visible(small) == visible(full)


def test_prefix_still_held_needs_no_limit():
    small = iswa(False)
    fill(small, 100)  # 100 cells: the SWA cache (256) has not wrapped
    assert small.swa.seq_pos_min(0) == 0 and small.exact_shift_limit(0, 8) is None
    assert np.all([p >= 0 for p, _ in small.swa.cells()[:100]])
