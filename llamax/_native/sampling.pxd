# Mirrors csrc/sampling.h (declarations only).
from libc.stdint cimport int32_t, int64_t

cdef extern from "common.h" nogil:
    ctypedef int32_t lx_token

cdef extern from "sampling.h" nogil:
    ctypedef struct lx_sampling_params:
        float repeat_penalty
        int64_t top_k
        double top_p
        double min_p
        double temperature

    ctypedef struct lx_sampler_scratch:
        pass

    lx_sampler_scratch *lx_sampler_scratch_new(int64_t cap)
    void lx_sampler_scratch_free(lx_sampler_scratch *s)
    int64_t lx_sampler_scratch_cap(const lx_sampler_scratch *s)

    int64_t lx_argmax(const float *x, int64_t n)                     # x [n]
    lx_token lx_sampler_sample(lx_sampler_scratch *s,
                               const float *logits, int64_t n_vocab,  # [n_vocab]
                               const lx_token *penalty_tokens, int64_t n_penalty,  # [n_penalty]
                               const lx_sampling_params *params, double u)
