/* sampling.h: the sampler chain over one logits row (llama.cpp's common sampler:
 * [grammar mask] -> logit bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist,
 * or greedy), and the logprobs of a raw row (llama-server's n_probs).
 *
 * The row's edits (lx_logit_edits) go to a private copy, in llama.cpp's order:
 *   mask       token t is allowed iff bit (t & 31) of allowed[t >> 5] is set; others -> -inf
 *              (llguidance's bitmask layout)
 *   bias       l_t += b for each (t, b) entry (-inf bans t)
 *   penalties  (llama_sampler_penalties) for each token t with c > 0 occurrences among the
 *              penalty tokens: l_t = l_t > 0 ? l_t / repeat : l_t * repeat, then
 *              l_t -= c * frequency + presence (float arithmetic, as llama.cpp)
 * Greedy with edits stays one pass over the row: the copy is made only at the edited tokens and
 * the untouched ones are scanned through the mask. A call with a mask or a bias is *constrained*:
 * it returns -1 when no token is left above -inf (never a banned token); an unconstrained call
 * keeps the first-token rule below.
 *
 * The chain never sorts the vocabulary. Candidates are packed as 64-bit keys that order them
 * exactly as the chain does (logit descending, then token id ascending; NaN counts as -inf and
 * -0 as +0):
 *
 *     key = ordered_bits(logit) << 32 | (0xffffffff - token)      larger key = better candidate
 *
 * and only the candidates that can matter are gathered and sorted:
 *
 *   0 < top_k < n   a bounded min-heap of k keys over the row: O(n + m log k) with m the heap
 *                   replacements (about k ln(n/k) for a row in random order; n log k at worst);
 *                   the scan skips 64-logit blocks with nothing above the heap's minimum, so it
 *                   runs at memory speed. Then the k keys are heap-sorted: O(k log k).
 *   top_k = 0 / >= n
 *     min_p > 0     one threshold pass: every token with logit >= max + log(min_p) (minus a
 *                   slack) is gathered; nothing below can survive min-p. Sort those only.
 *     top_p < 1     threshold stages max - 8, 32, 128, 512, then all: a stage is accepted when
 *                   its tokens (a prefix of the sorted order) hold more than top_p of the mass,
 *                   so the top-p cut lies inside it. Like llama.cpp, a flat row sorts everything.
 *     neither       the same stages, accepted when they hold more than u of the tempered mass
 *                   (the draw's point lies inside).
 *                   top_p < 1 and the last case cost one exp per token (the normalisation).
 *
 * The rule over the sorted candidates c[0..m) (llamax.Sampler._sample_reference in numpy):
 *   e_i = exp(l_i - l_0), p_i = e_i / sum(e over the top-k set)
 *   top_p:  keep the first i + 1 with cumsum(p)_i >= top_p (all if never)
 *   min_p:  keep the first max(1, #{i < keep: e_i >= min_p}), i.e. p_i >= min_p * p_0
 *   draw:   w_i = exp((l_i - l_0) / temperature) over the kept ones; the first i with
 *           cumsum(w)_i > u * sum(w) (numpy's choice(p=w / sum(w)) for the same u)
 * The oracle follows the same formulas; sums run in another order (the normalisation of a whole
 * row in token order here), so the two can differ only when u or top_p falls within rounding
 * (~1e-16 relative) of a boundary of the cumulative sums.
 *   l_0 = +-inf (all -inf, or some +inf): c[0].
 */
#ifndef LX_SAMPLING_H
#define LX_SAMPLING_H

#include <stdint.h>

#include "common.h"

/* the chain's settings (checked by the caller) */
typedef struct {
    float   repeat_penalty;     /* > 0; 1: off. Divides positive, multiplies other logits of the penalty tokens */
    float   frequency_penalty;  /* finite; 0: off. Subtracted once per occurrence among the penalty tokens */
    float   presence_penalty;   /* finite; 0: off. Subtracted once from each penalty token */
    int64_t top_k;           /* >= 0; 0 or >= n_vocab: every token */
    double  top_p;           /* (0, 1]; 1: off */
    double  min_p;           /* [0, 1]; 0: off */
    double  temperature;     /* <= 0: greedy (the draw is not used) */
} lx_sampling_params;

/* what the chain changes in its copy of the row before the cuts (sampling.h's top comment);
 * ids outside [0, n_vocab) are ignored everywhere */
typedef struct {
    const uint32_t *allowed;         /* [(n_vocab + 31) / 32] allowed-token bits; NULL: every token */
    const lx_token *bias_ids;        /* [n_bias] each entry adds its value (an id twice adds twice) */
    const float    *bias_values;     /* [n_bias] finite or -inf */
    int64_t         n_bias;
    const lx_token *penalty_tokens;  /* [n_penalty] the recent tokens, repeats counted */
    int64_t         n_penalty;
} lx_logit_edits;

/* scratch of the chain for rows of up to cap tokens (an edited copy, keys, probabilities, counts, a mask) */
typedef struct lx_sampler_scratch lx_sampler_scratch;

/* a scratch for rows of up to cap >= 1 tokens (about 20 bytes per token); NULL if an allocation fails */
lx_sampler_scratch *lx_sampler_scratch_new(int64_t cap);
void                lx_sampler_scratch_free(lx_sampler_scratch *s);
int64_t             lx_sampler_scratch_cap(const lx_sampler_scratch *s);

/* The first index of the largest of x [n] (llama.cpp's greedy); NaN is never chosen; 0 if no
 * element is above -inf. O(n), no allocation. note: n >= 1. */
int64_t lx_argmax(const float *x, int64_t n);

/* The token the chain chooses from logits [n_vocab] with the uniform draw u in [0, 1), after the
 * edits (NULL: none) applied to a copy in s; the logits are not modified. -1 when the call is
 * constrained (a mask or a bias) and no token is left above -inf. Uses only s's memory; s must not
 * be shared by two calls at once. Greedy without edits is lx_argmax; greedy with edits is one
 * O(n_vocab) pass plus O(n_bias + n_penalty).
 * note: 1 <= n_vocab <= lx_sampler_scratch_cap(s), n_vocab < 2^32 - 1. */
lx_token lx_sampler_sample(lx_sampler_scratch *s, const float *logits, int64_t n_vocab,
                           const lx_logit_edits *edits, const lx_sampling_params *params, double u);

/* ---- logprobs of the raw row (the model's distribution before any sampler stage) ------------- */

#define LX_LOGPROBS_MAX_K 20  /* the most alternatives a logprobs call returns (OpenAI's top_logprobs) */

/* log_softmax(row)[token] (NaN counts as -inf), and the k most likely tokens into top_ids [k] and
 * top_lp [k] (descending, ties by id ascending). One max pass, one sum-of-exp pass in double, a
 * k-heap over the row. A row with a +inf or nothing above -inf gives NaN logprobs.
 * note: n >= 1, 0 <= token < n, 0 <= k <= min(n, LX_LOGPROBS_MAX_K). No allocation. */
float lx_logprobs(const float *row, int64_t n, lx_token token, int k, lx_token *top_ids, float *top_lp);

/* lx_logprobs over rows [m, n]: lp [m] of tokens [m], top_ids / top_lp [m, k]. Rows are shared out
 * over n_threads (OpenMP, static); the result does not depend on n_threads.
 * note: as lx_logprobs for every row; n_threads >= 1. */
void lx_logprobs_rows(const float *rows, int64_t m, int64_t n, const lx_token *tokens, int k,
                      float *lp, lx_token *top_ids, float *top_lp, int n_threads);

#endif /* LX_SAMPLING_H */
