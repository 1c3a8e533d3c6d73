# Mirrors csrc/sampling.h (declarations only).
from libc.stdint cimport int32_t, int64_t, uint32_t

cdef extern from "common.h" nogil:
    ctypedef int32_t lx_token

cdef extern from "sampling.h" nogil:
    ctypedef struct lx_sampling_params:
        float repeat_penalty
        float frequency_penalty
        float presence_penalty
        int64_t top_k
        double top_p
        double min_p
        double temperature

    ctypedef struct lx_logit_edits:
        const uint32_t *allowed          # [(n_vocab + 31) / 32] or NULL
        const lx_token *bias_ids         # [n_bias]
        const float *bias_values         # [n_bias]
        int64_t n_bias
        const lx_token *penalty_tokens   # [n_penalty]
        int64_t n_penalty

    ctypedef struct lx_sampler_scratch:
        pass

    lx_sampler_scratch *lx_sampler_scratch_new(int64_t cap)
    void lx_sampler_scratch_free(lx_sampler_scratch *s)
    int64_t lx_sampler_scratch_cap(const lx_sampler_scratch *s)

    int64_t lx_argmax(const float *x, int64_t n)                     # x [n]
    lx_token lx_sampler_sample(lx_sampler_scratch *s,
                               const float *logits, int64_t n_vocab,  # [n_vocab]
                               const lx_logit_edits *edits,
                               const lx_sampling_params *params, double u)

    enum: LX_LOGPROBS_MAX_K
    float lx_logprobs(const float *row, int64_t n, lx_token token, int k,   # row [n]
                      lx_token *top_ids, float *top_lp)                     # [k], [k]
    void lx_logprobs_rows(const float *rows, int64_t m, int64_t n,          # rows [m, n]
                          const lx_token *tokens, int k,                    # tokens [m]
                          float *lp, lx_token *top_ids, float *top_lp,      # [m], [m, k], [m, k]
                          int n_threads)
