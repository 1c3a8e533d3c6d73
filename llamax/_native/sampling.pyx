# cython: language_level=3
"""Thin wrappers over csrc/sampling.h: the sampler chain over one logits row, and greedy.

`Chain` owns one lx_sampler_scratch (the vocab-sized buffers of one Sampler, reused by every
call). Arguments are checked here with the GIL held; the C calls run without it.
"""
from libc.stdint cimport int32_t, int64_t

import numpy as np

# the declarations of csrc/sampling.h come from sampling.pxd (same module name)

MAX_VOCAB = 4294967294  # token ids live in the low 32 bits of a key (sampling.h)


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
               double min_p, double temperature, double u) -> int:
        """The token the chain chooses from logits [n_vocab] (IN) with the uniform draw u.

        history: the recent tokens (any iterable of ints) the repeat penalty sees; ids outside
        [0, n_vocab) are ignored. Settings are Sampler's, already checked.
        """
        cdef int64_t n = logits.shape[0]
        cdef int64_t n_pen = 0
        cdef lx_sampling_params p
        cdef lx_token r
        if not 1 <= n <= self.cap:
            raise ValueError(f"a row of {n} logits: the chain holds 1 to {self.cap}")
        if self.busy:
            raise RuntimeError("a Chain (Sampler) is used by two threads at once")
        p.repeat_penalty = repeat_penalty
        p.top_k = top_k
        p.top_p = top_p
        p.min_p = min_p
        p.temperature = temperature
        if repeat_penalty != 1.0:
            toks = list(history)
            if len(toks) > self.pen.shape[0]:
                self.pen = np.empty(len(toks), dtype=np.int32)
            for t in toks:
                self.pen[n_pen] = t if 0 <= t < n else -1
                n_pen += 1
        self.busy = True
        try:
            with nogil:
                r = lx_sampler_sample(self.s, &logits[0], n, &self.pen[0], n_pen, &p, u)
        finally:
            self.busy = False
        return r
