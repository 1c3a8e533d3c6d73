# cython: language_level=3
"""Thin wrappers over csrc/sampling.h: the sampler chain over one logits row, greedy, and the
logprobs of raw rows.

`Chain` owns one lx_sampler_scratch (the vocab-sized buffers of one Sampler, reused by every
call). Arguments are checked here with the GIL held; the C calls run without it.
"""
from libc.stdint cimport int32_t, int64_t, uint32_t

import numpy as np

from llamax.threads import resolve_n_threads

# the declarations of csrc/sampling.h come from sampling.pxd (same module name)

MAX_VOCAB = 4294967294  # token ids live in the low 32 bits of a key (sampling.h)
LOGPROBS_MAX_K = LX_LOGPROBS_MAX_K  # the most alternatives a logprobs call returns


def argmax(const float[::1] x) -> int:  # IN
    """The first index of the largest logit (llama.cpp's greedy); NaN is never chosen; 0 if none is above -inf."""
    cdef int64_t n = x.shape[0]
    cdef int64_t r
    if n < 1:
        raise ValueError("argmax of an empty row")
    with nogil:
        r = lx_argmax(&x[0], n)
    return r


cdef class Chain:
    """Scratch of the sampler chain for rows of up to `cap` tokens. Owns one lx_sampler_scratch.

    One call at a time: a second thread entering while a call runs gets a RuntimeError.
    """
    cdef lx_sampler_scratch *s
    cdef int32_t[::1] pen      # the penalty tokens of the current call
    cdef bint busy

    def __cinit__(self, int64_t cap):
        if not 1 <= cap <= MAX_VOCAB:
            raise ValueError(f"cap = {cap} is outside [1, {MAX_VOCAB}]")
        self.s = lx_sampler_scratch_new(cap)
        if self.s == NULL:
            raise MemoryError(f"cannot allocate the sampler scratch of {cap} tokens")
        self.pen = np.empty(64, dtype=np.int32)
        self.busy = False

    def __dealloc__(self):
        if self.s != NULL:
            lx_sampler_scratch_free(self.s)
            self.s = NULL

    @property
    def cap(self) -> int:
        return lx_sampler_scratch_cap(self.s)

    def sample(self, const float[::1] logits, history, float repeat_penalty, int64_t top_k, double top_p,
               double min_p, double temperature, double u, *, float frequency_penalty=0.0,
               float presence_penalty=0.0, const uint32_t[::1] allowed=None, const int32_t[::1] bias_ids=None,
               const float[::1] bias_values=None) -> int:
        """The token the chain chooses from logits [n_vocab] (IN) with the uniform draw u, or -1 when
        the mask or the bias leaves no token above -inf (sampling.h).

        history: the recent tokens (any sized iterable of ints) the penalties see, repeats counted;
        ids outside [0, n_vocab) are ignored. allowed (IN): uint32 [>= (n_vocab + 31) / 32] allowed-token
        bits, None: every token. bias_ids / bias_values (IN): int32 / float32 [n_bias], None: no bias.
        Settings are Sampler's, already checked.
        """
        cdef int64_t n = logits.shape[0]
        cdef lx_sampling_params p
        cdef lx_logit_edits e
        cdef lx_token r
        cdef int32_t[::1] pen
        if not 1 <= n <= self.cap:
            raise ValueError(f"a row of {n} logits: the chain holds 1 to {self.cap}")
        if allowed is not None and allowed.shape[0] < (n + 31) // 32:
            raise ValueError(f"a mask of {allowed.shape[0]} words for {n} tokens: {(n + 31) // 32} needed")
        if (bias_ids is None) != (bias_values is None) or (
                bias_ids is not None and bias_ids.shape[0] != bias_values.shape[0]):
            raise ValueError("bias_ids and bias_values go together, with one value per id")
        if self.busy:
            raise RuntimeError("a Chain (Sampler) is used by two threads at once")
        p.repeat_penalty = repeat_penalty
        p.frequency_penalty = frequency_penalty
        p.presence_penalty = presence_penalty
        p.top_k = top_k
        p.top_p = top_p
        p.min_p = min_p
        p.temperature = temperature
        e.allowed = &allowed[0] if allowed is not None else NULL
        e.n_bias = bias_ids.shape[0] if bias_ids is not None else 0
        e.bias_ids = &bias_ids[0] if e.n_bias > 0 else NULL
        e.bias_values = &bias_values[0] if e.n_bias > 0 else NULL
        e.n_penalty = len(history)
        e.penalty_tokens = NULL
        if e.n_penalty > 0:
            pen = np.fromiter(history, dtype=np.int32, count=e.n_penalty)
            e.penalty_tokens = &pen[0]
        self.busy = True
        try:
            with nogil:
                r = lx_sampler_sample(self.s, &logits[0], n, &e, &p, u)
        finally:
            self.busy = False
        return r


def logprobs(const float[::1] row, int64_t token, int k):  # IN
    """(log_softmax(row)[token], top ids int32 [k], their logprobs float32 [k]) of one raw row
    (csrc/sampling.h lx_logprobs: descending, ties by id ascending; NaN counts as -inf)."""
    cdef int64_t n = row.shape[0]
    cdef float lp
    if n < 1:
        raise ValueError("logprobs of an empty row")
    if not 0 <= token < n:
        raise ValueError(f"token = {token} is outside [0, {n})")
    if not 0 <= k <= min(n, LX_LOGPROBS_MAX_K):
        raise ValueError(f"k = {k} is outside [0, {min(n, LX_LOGPROBS_MAX_K)}] for a row of {n}")
    ids = np.empty(k, dtype=np.int32)
    lps = np.empty(k, dtype=np.float32)
    cdef int32_t[::1] ids_v = ids  # OUT
    cdef float[::1] lps_v = lps    # OUT
    cdef int32_t *ip = &ids_v[0] if k > 0 else NULL
    cdef float *lpp = &lps_v[0] if k > 0 else NULL
    with nogil:
        lp = lx_logprobs(&row[0], n, <lx_token>token, k, ip, lpp)
    return lp, ids, lps


def logprobs_rows(const float[:, ::1] rows, const int32_t[::1] tokens, int k, n_threads=None):  # IN
    """lx_logprobs_rows: (lp float32 [m], top ids int32 [m, k], top logprobs float32 [m, k]) of rows
    [m, n] and tokens [m]; OpenMP over rows (n_threads: None / -1 = all cores)."""
    cdef int64_t m = rows.shape[0], n = rows.shape[1]
    cdef int nt = resolve_n_threads(n_threads)
    if tokens.shape[0] != m:
        raise ValueError(f"{tokens.shape[0]} tokens for {m} rows")
    if m > 0 and n < 1:
        raise ValueError("logprobs of empty rows")
    if not 0 <= k <= min(n, LX_LOGPROBS_MAX_K):
        raise ValueError(f"k = {k} is outside [0, {min(n, LX_LOGPROBS_MAX_K)}] for rows of {n}")
    tok = np.asarray(tokens)
    if m > 0 and (tok.min() < 0 or tok.max() >= n):
        raise ValueError(f"a token outside [0, {n}): {int(tok.min())} .. {int(tok.max())}")
    lp = np.empty(m, dtype=np.float32)
    ids = np.empty((m, k), dtype=np.int32)
    lps = np.empty((m, k), dtype=np.float32)
    if m == 0:
        return lp, ids, lps
    cdef float[::1] lp_v = lp          # OUT
    cdef int32_t[:, ::1] ids_v = ids   # OUT
    cdef float[:, ::1] lps_v = lps     # OUT
    cdef int32_t *ip = &ids_v[0, 0] if k > 0 else NULL
    cdef float *lpp = &lps_v[0, 0] if k > 0 else NULL
    with nogil:
        lx_logprobs_rows(&rows[0, 0], m, n, &tokens[0], k, &lp_v[0], ip, lpp, nt)
    return lp, ids, lps
