"""csrc/ssm.h: a Mamba layer's causal convolution and selective scan against a numpy reference of
ggml's ssm_conv / ssm_scan, state updates, thread counts and chunked sequences."""
import numpy as np
import pytest

from llamax._native import ssm


def _silu(v):
    return v / (1.0 + np.exp(-v))


def conv_ref(state, cells, x, w, b, n_t):
    """ggml_ssm_conv + bias + silu in float64, and the states after."""
    n_seqs, d, d_conv = len(cells), w.shape[0], w.shape[1]
    out = np.empty((n_seqs * n_t, d))
    new = state.astype(np.float64).copy()
    for s, c in enumerate(cells):
        win = np.concatenate([state[c].astype(np.float64), x[s * n_t:(s + 1) * n_t].T.astype(np.float64)], axis=1)
        for t in range(n_t):
            out[s * n_t + t] = _silu((win[:, t:t + d_conv] * w).sum(axis=1) + (b if b is not None else 0))
        new[c] = win[:, n_t:]
    return out, new


def scan_ref(state, cells, x, dt, A, B, C, D, z, n_t):
    """ggml_ssm_scan (Mamba-1) + x * D, gated by silu(z), in float64, and the states after."""
    new = state.astype(np.float64).copy()
    y = np.empty(x.shape)
    for s, c in enumerate(cells):
        h = new[c]
        for t in range(n_t):
            r = s * n_t + t
            v = dt[r].astype(np.float64)
            sp = np.where(v <= 20, np.log1p(np.exp(v)), v)
            h = h * np.exp(sp[:, None] * A) + B[r][None, :] * (x[r] * sp)[:, None]
            y[r] = ((h * C[r][None, :]).sum(axis=1) + x[r] * D) * _silu(z[r].astype(np.float64))
        new[c] = h
    return y, new


def _case(rng, n_cells=5, cells=(3, 0, 4), n_t=6, d=24, d_conv=4, d_state=16):
    f = np.float32
    n = len(cells) * n_t
    return dict(
        conv_state=rng.standard_normal((n_cells, d, d_conv - 1)).astype(f),
        ssm_state=rng.standard_normal((n_cells, d, d_state)).astype(f) * f(0.5),
        cells=np.array(cells, np.int32),
        xz=rng.standard_normal((n, 2 * d)).astype(f),
        w=rng.standard_normal((d, d_conv)).astype(f) * f(0.5), b=rng.standard_normal(d).astype(f),
        dt=(rng.standard_normal((n, d)) * 3).astype(f), A=-np.exp(rng.standard_normal((d, d_state))).astype(f),
        BC=rng.standard_normal((n, 2 * d_state)).astype(f), D=rng.standard_normal(d).astype(f), n_t=n_t, d=d,
        d_state=d_state)


def test_conv_matches_ggml_reference_and_updates_only_its_cells():
    c = _case(np.random.default_rng(0))
    st = c["conv_state"].copy()
    x = c["xz"][:, :24]                                     # a column slice, as the in-projection's x
    out = ssm.conv(st, c["cells"], x, c["w"], c["b"], c["n_t"], n_threads=2)
    ref, new = conv_ref(c["conv_state"], c["cells"], x, c["w"], c["b"], c["n_t"])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st[c["cells"]], new[c["cells"]], rtol=0, atol=0)
    untouched = [i for i in range(5) if i not in c["cells"]]
    assert np.array_equal(st[untouched], c["conv_state"][untouched])


def test_scan_matches_ggml_reference():
    c = _case(np.random.default_rng(1))
    st = c["ssm_state"].copy()
    x = np.ascontiguousarray(c["xz"][:, :24])
    B, C = c["BC"][:, :16], c["BC"][:, 16:]
    y = ssm.scan(st, c["cells"], x, c["dt"], c["A"], B, C, c["D"], c["xz"][:, 24:], c["n_t"], n_threads=2)
    ref, new = scan_ref(c["ssm_state"], c["cells"], x, c["dt"], c["A"], B, C, c["D"], c["xz"][:, 24:], c["n_t"])
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(st[c["cells"]], new[c["cells"]], rtol=1e-4, atol=1e-4)
    untouched = [i for i in range(5) if i not in c["cells"]]
    assert np.array_equal(st[untouched], c["ssm_state"][untouched])


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_same_bits_for_any_thread_count_and_any_chunking(n_threads):
    """One sequence of 12 tokens: whole, or as 5 + 7 tokens, on any thread count, gives the same bits."""
    c = _case(np.random.default_rng(2), cells=(1,), n_t=12)
    x = np.ascontiguousarray(c["xz"][:, :24])
    z = c["xz"][:, 24:]
    B, C = c["BC"][:, :16], c["BC"][:, 16:]

    def run(parts, nt):
        cs, ss, outs, ys = c["conv_state"].copy(), c["ssm_state"].copy(), [], []
        r0 = 0
        for n in parts:
            sl = slice(r0, r0 + n)
            o = ssm.conv(cs, c["cells"], x[sl], c["w"], c["b"], n, n_threads=nt)
            ys.append(ssm.scan(ss, c["cells"], o, c["dt"][sl], c["A"], B[sl], C[sl], c["D"], z[sl], n,
                               n_threads=nt))
            outs.append(o)
            r0 += n
        return np.concatenate(outs), np.concatenate(ys), cs, ss

    want = run([12], 1)
    got = run([5, 7], n_threads)
    for a, b in zip(want, got):
        assert np.array_equal(a, b)


def test_bad_arguments_are_refused():
    c = _case(np.random.default_rng(3))
    x = c["xz"][:, :24]
    with pytest.raises(ValueError, match="distinct"):
        ssm.conv(c["conv_state"], np.array([1, 1, 2], np.int32), x, c["w"], c["b"], c["n_t"])
    with pytest.raises(ValueError, match="cells must lie"):
        ssm.conv(c["conv_state"], np.array([1, 5, 2], np.int32), x, c["w"], c["b"], c["n_t"])
    with pytest.raises(ValueError, match="shape"):
        ssm.conv(c["conv_state"], c["cells"], x[:-1], c["w"], c["b"], c["n_t"])
    with pytest.raises(ValueError, match="float32"):
        ssm.conv(c["conv_state"].astype(np.float64), c["cells"], x, c["w"], c["b"], c["n_t"])
    with pytest.raises(ValueError, match="writeable"):
        ro = c["ssm_state"].copy()
        ro.flags.writeable = False
        ssm.scan(ro, c["cells"], np.ascontiguousarray(x), c["dt"], c["A"], c["BC"][:, :16], c["BC"][:, 16:],
                 c["D"], c["xz"][:, 24:], c["n_t"])
    with pytest.raises(ValueError, match="d_conv"):
        w = np.zeros((24, ssm.MAX_CONV + 1), np.float32)
        ssm.conv(np.zeros((5, 24, ssm.MAX_CONV), np.float32), c["cells"], x, w, None, c["n_t"])


@pytest.mark.parametrize("d_conv", [4, 3])
def test_the_conv_gives_the_same_bits_at_every_simd_level_and_thread_count(d_conv):
    """The conv's SiLU in AVX2 lanes and by its scalar twin (vexp.h) agree bit for bit, with d a multiple of 8
    and not (the lanes' tail), for the unrolled d_conv 4 and another, on one thread and two."""
    from llamax._native import cpu

    for d in (24, 21):
        c = _case(np.random.default_rng(5), d=d, d_conv=d_conv)
        x = c["xz"][:, :d]
        outs = []
        try:
            for level in cpu.levels():
                cpu.set_simd_level(level)
                for nt in (1, 2):
                    st = c["conv_state"].copy()
                    hist = np.zeros((5, 4, d, d_conv - 1), np.float32)   # rollback rows: 4 of the 6 tokens
                    out = ssm.conv(st, c["cells"], x, c["w"], c["b"], c["n_t"], n_threads=nt, hist=hist,
                                   hist_row=np.array([1, 0, 3], np.int32))
                    outs.append((out, st, hist))
        finally:
            cpu.set_simd_level(-1)
        for out, st, hist in outs[1:]:
            assert np.array_equal(out, outs[0][0]) and np.array_equal(st, outs[0][1])
            assert np.array_equal(hist, outs[0][2])
        assert np.array_equal(outs[0][2][3, 0], outs[0][1][3])   # cell 3 (hist_row 1): its last token in row (1 + 3) % 4
        ref, _ = conv_ref(c["conv_state"], c["cells"], x, c["w"], c["b"], c["n_t"])
        np.testing.assert_allclose(outs[0][0], ref, rtol=1e-5, atol=1e-5)


def test_the_scan_gives_the_same_bits_at_every_simd_level():
    """The AVX2 step and its scalar twin (vexp.h's exp, the same fused steps and lane sums) agree bit for bit,
    with d_state a multiple of 8 and not."""
    from llamax._native import cpu

    for d_state in (16, 13):
        c = _case(np.random.default_rng(4), d_state=d_state)
        x = np.ascontiguousarray(c["xz"][:, :24])
        B, C = c["BC"][:, :d_state], c["BC"][:, d_state:]
        outs = []
        try:
            for level in cpu.levels():
                cpu.set_simd_level(level)
                st = c["ssm_state"].copy()
                y = ssm.scan(st, c["cells"], x, c["dt"], c["A"], B, C, c["D"], c["xz"][:, 24:], c["n_t"])
                outs.append((y, st))
        finally:
            cpu.set_simd_level(-1)
        for y, st in outs[1:]:
            assert np.array_equal(y, outs[0][0]) and np.array_equal(st, outs[0][1])


def _steps(c, n_t, hist_rows=None, nt=1, r0=None):
    """Conv then scan of the case's first n_t tokens per sequence (from its states), with histories of
    hist_rows rows (None: none) starting at rows r0; returns (out, y, conv state, ssm state, conv hist,
    ssm hist)."""
    cells, d, ds = c["cells"], c["d"], c["d_state"]
    rows = np.concatenate([np.arange(s * c["n_t"], s * c["n_t"] + n_t) for s in range(len(cells))])
    x, z = np.ascontiguousarray(c["xz"][rows, :d]), np.ascontiguousarray(c["xz"][rows, d:])
    B, C = np.ascontiguousarray(c["BC"][rows, :ds]), np.ascontiguousarray(c["BC"][rows, ds:])
    cs, ss = c["conv_state"].copy(), c["ssm_state"].copy()
    ch = sh = None
    if hist_rows is not None:
        ch = np.full((cs.shape[0], hist_rows) + cs.shape[1:], np.nan, np.float32)
        sh = np.full((ss.shape[0], hist_rows) + ss.shape[1:], np.nan, np.float32)
    o = ssm.conv(cs, cells, x, c["w"], c["b"], n_t, n_threads=nt, hist=ch, hist_row=r0)
    y = ssm.scan(ss, cells, o, c["dt"][rows], c["A"], B, C, c["D"], z, n_t, n_threads=nt, hist=sh, hist_row=r0)
    return o, y, cs, ss, ch, sh


@pytest.mark.parametrize("n_threads, d, d_state", [(1, 24, 16), (2, 24, 13), (2, 512, 16)])
def test_history_rows_are_the_states_after_each_of_the_last_tokens_at_every_simd_level(n_threads, d, d_state):
    """Row (r0 + j) % n_hist of a cell's history is, bit for bit, the state a ubatch of its first
    n_t - m + j + 1 tokens leaves (m = min(n_t, n_hist); r0 the sequence's start row, 0 without
    hist_row); the other rows and cells outside the ubatch are left; the outputs and states are those of
    the run without history, on every SIMD level and thread count (d = 512: both kernels above their
    OpenMP threshold)."""
    from llamax._native import cpu

    c = _case(np.random.default_rng(5), n_t=7, d=d, d_state=d_state)
    try:
        for level in cpu.levels():
            cpu.set_simd_level(level)
            plain = _steps(c, 7, nt=n_threads)
            for n_hist, r0 in ((3, None), (7, None), (9, None), (4, [2, 0, 3]), (9, [8, 5, 0])):
                got = _steps(c, 7, n_hist, nt=n_threads, r0=None if r0 is None else np.array(r0, np.int32))
                for a, b in zip(plain[:4], got[:4]):
                    assert np.array_equal(a, b)
                m = min(7, n_hist)
                ch, sh = got[4], got[5]
                written = np.zeros(ch.shape[:2], bool)
                for j in range(m):
                    _, _, cs, ss, _, _ = _steps(c, 7 - m + j + 1, nt=n_threads)
                    for k, cell in enumerate(c["cells"]):
                        row = ((r0[k] if r0 else 0) + j) % n_hist
                        written[cell, row] = True
                        assert np.array_equal(ch[cell, row], cs[cell]), (level, n_hist, j)
                        assert np.array_equal(sh[cell, row], ss[cell]), (level, n_hist, j)
                assert np.isnan(ch[~written]).all() and np.isnan(sh[~written]).all()
    finally:
        cpu.set_simd_level(-1)


def test_a_bad_history_is_refused():
    c = _case(np.random.default_rng(6))
    x = c["xz"][:, :24]
    for bad, match in ((np.zeros((5, 2, 24, 3), np.float64), "float32"), (np.zeros((4, 2, 24, 3), np.float32), "shape"),
                       (np.zeros((5, 2, 24, 3), np.float32)[:, ::-1], "C-contiguous"),
                       (np.zeros((5, 2, 24), np.float32), "4-D")):
        st = c["conv_state"].copy()
        with pytest.raises(ValueError, match=match):
            ssm.conv(st, c["cells"], x, c["w"], c["b"], c["n_t"], hist=bad)
        assert np.array_equal(st, c["conv_state"])
    hist = np.zeros((5, 2, 24, 3), np.float32)
    for row, match in ((np.array([0, 2, 1], np.int32), "hist_row must lie"), (np.array([0, -1, 1], np.int32), "hist_row must lie"),
                       (np.array([0, 1], np.int32), "n_seqs"), (np.array([0, 1, 1], np.int64), "int32")):
        with pytest.raises(ValueError, match=match):
            ssm.conv(c["conv_state"].copy(), c["cells"], x, c["w"], c["b"], c["n_t"], hist=hist, hist_row=row)
    with pytest.raises(ValueError, match="without hist"):
        ssm.conv(c["conv_state"].copy(), c["cells"], x, c["w"], c["b"], c["n_t"], hist_row=np.zeros(3, np.int32))
    ro = np.zeros((5, 2, 24, 16), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        ssm.scan(c["ssm_state"].copy(), c["cells"], np.ascontiguousarray(x), c["dt"], c["A"], c["BC"][:, :16],
                 c["BC"][:, 16:], c["D"], c["xz"][:, 24:], c["n_t"], hist=ro)
