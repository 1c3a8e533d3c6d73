/* buffers.c: see buffers.h. */
#include "buffers.h"

#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define LX_BUFFERS_STREAM 1  /* non-temporal 16-byte stores: SSE2, every x86-64 */
#else
#define LX_BUFFERS_STREAM 0
#endif

/* below this many bytes one thread does it all: waking threads costs more */
#define LX_BUFFERS_MT_MIN ((size_t)1 << 20)
/* from this many bytes on, moves store around the caches (as glibc's memcpy does for copies
 * larger than a share of the L3): a state this large does not stay in cache anyway, and a store
 * that does not first read its line moves 2 bytes per byte copied instead of 3 */
#define LX_BUFFERS_STREAM_MIN ((size_t)4 << 20)
/* otherwise a row is copied in blocks of this many bytes, each checksummed while still in L1 */
#define LX_BUFFERS_BLOCK ((size_t)8192)
_Static_assert(LX_BUFFERS_BLOCK % 8 == 0, "a block keeps the checksum's byte lanes");

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* The checksum of p[0, n) placed at stream offsets at, at + 1, ...: the byte at offset o lands in
 * lane o % 8 of a word. */
static uint64_t xor_span(const uint8_t *p, size_t n, size_t at) {
    uint64_t x = 0;
    size_t i = 0;
    for (unsigned lane = (unsigned)(at & 7); lane != 0 && i < n; i++, lane = (lane + 1) & 7) {
        x ^= (uint64_t)p[i] << (8 * lane);
    }
    /* now at a word boundary of the stream: four independent chains of whole words */
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (; i + 32 <= n; i += 32) {
        a0 ^= load_le64(p + i);
        a1 ^= load_le64(p + i + 8);
        a2 ^= load_le64(p + i + 16);
        a3 ^= load_le64(p + i + 24);
    }
    for (; i + 8 <= n; i += 8) {
        a0 ^= load_le64(p + i);
    }
    for (unsigned k = 0; i < n; i++, k++) {
        x ^= (uint64_t)p[i] << (8 * k);
    }
    return x ^ a0 ^ a1 ^ a2 ^ a3;
}

static inline uint64_t rotl64(uint64_t x, unsigned r) {
    r &= 63;
    return r ? (x << r) | (x >> (64 - r)) : x;
}

/* Copy n bytes from s to d and return their checksum at stream offset at (as xor_span). */
static uint64_t copy_xor(uint8_t *d, const uint8_t *s, size_t n, size_t at) {
    uint64_t x = 0;
    for (size_t b = 0; b < n; b += LX_BUFFERS_BLOCK) {
        size_t k = n - b < LX_BUFFERS_BLOCK ? n - b : LX_BUFFERS_BLOCK;
        memcpy(d + b, s + b, k);
        x ^= xor_span(s + b, k, at + b);
    }
    return x;
}

#if LX_BUFFERS_STREAM
/* copy_xor with non-temporal stores: bytes up to d's next 16-byte boundary and the tail are
 * copied as copy_xor does; the body in 16-byte vectors, streamed to d and XORed into one
 * accumulator. Every body vector starts at the same lane of the stream (16 = 0 mod 8), so its two
 * 64-bit halves fold into one word rotated once by that lane. note: sfence before d is read. */
static uint64_t copy_xor_stream(uint8_t *d, const uint8_t *s, size_t n, size_t at) {
    size_t head = (size_t)(-(uintptr_t)d & 15);
    if (head > n) {
        head = n;
    }
    uint64_t x = copy_xor(d, s, head, at);
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        const __m128i v0 = _mm_loadu_si128((const __m128i *) (s + i));
        const __m128i v1 = _mm_loadu_si128((const __m128i *) (s + i + 16));
        const __m128i v2 = _mm_loadu_si128((const __m128i *) (s + i + 32));
        const __m128i v3 = _mm_loadu_si128((const __m128i *) (s + i + 48));
        _mm_stream_si128((__m128i *) (d + i), v0);
        _mm_stream_si128((__m128i *) (d + i + 16), v1);
        _mm_stream_si128((__m128i *) (d + i + 32), v2);
        _mm_stream_si128((__m128i *) (d + i + 48), v3);
        a0 = _mm_xor_si128(a0, v0);
        a1 = _mm_xor_si128(a1, v1);
        a2 = _mm_xor_si128(a2, v2);
        a3 = _mm_xor_si128(a3, v3);
    }
    for (; i + 16 <= n; i += 16) {
        const __m128i v = _mm_loadu_si128((const __m128i *) (s + i));
        _mm_stream_si128((__m128i *) (d + i), v);
        a0 = _mm_xor_si128(a0, v);
    }
    uint64_t w[2];
    _mm_storeu_si128((__m128i *) w, _mm_xor_si128(_mm_xor_si128(a0, a1), _mm_xor_si128(a2, a3)));
    x ^= rotl64(w[0] ^ w[1], 8 * (unsigned) ((at + head) & 7));  /* x86: the halves are little-endian */
    return x ^ copy_xor(d + i, s + i, n - i, at + i);
}
#endif

uint64_t lx_xor64_ref(const uint8_t *p, size_t n) {
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        x ^= (uint64_t)p[i] << (8 * (i % 8));
    }
    return x;
}

uint64_t lx_xor64(const uint8_t *p, size_t n, int n_threads) {
    int nt = n_threads < 1 ? 1 : n_threads;
    if (n < LX_BUFFERS_MT_MIN) {
        nt = 1;
    }
    size_t per = ((n + (size_t)nt - 1) / (size_t)nt + 7) & ~(size_t)7;  /* whole words per thread */
    uint64_t x = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(^ : x) if (nt > 1)
#endif
    for (int t = 0; t < nt; t++) {
        size_t b0 = per * (size_t)t, b1 = b0 + per < n ? b0 + per : n;
        if (b0 < b1) {
            x ^= xor_span(p + b0, b1 - b0, b0);
        }
    }
    return x;
}

uint64_t lx_move_xor_ref(const lx_move *moves, int64_t n_moves) {
    uint64_t x = 0;
    for (int64_t i = 0; i < n_moves; i++) {
        const lx_move *m = &moves[i];
        for (size_t r = 0; r < m->rows; r++) {
            const uint8_t *s = m->src + r * m->src_stride;
            memcpy(m->dst + r * m->dst_stride, s, m->n);
            for (size_t j = 0; j < m->n; j++) {
                x ^= (uint64_t)s[j] << (8 * ((m->at + r * m->n + j) % 8));
            }
        }
    }
    return x;
}

/* Bytes [lo, hi) of move m (row r holds its bytes [r * n, (r + 1) * n)): copied (streamed past
 * the caches if stream), and checksummed. */
static uint64_t move_span(const lx_move *m, size_t lo, size_t hi, int stream) {
    uint64_t x = 0;
    size_t r = lo / m->n, j = lo % m->n;
    while (lo < hi) {
        size_t take = m->n - j < hi - lo ? m->n - j : hi - lo;
        const uint8_t *s = m->src + r * m->src_stride + j;
        uint8_t *d = m->dst + r * m->dst_stride + j;
        size_t at = m->at + r * m->n + j;
#if LX_BUFFERS_STREAM
        x ^= stream ? copy_xor_stream(d, s, take, at) : copy_xor(d, s, take, at);
#else
        (void) stream;
        x ^= copy_xor(d, s, take, at);
#endif
        lo += take;
        r++;
        j = 0;
    }
    return x;
}

uint64_t lx_move_xor(const lx_move *moves, int64_t n_moves, int n_threads) {
    size_t total = 0;
    for (int64_t i = 0; i < n_moves; i++) {
        total += moves[i].n * moves[i].rows;
    }
    int nt = n_threads < 1 ? 1 : n_threads;
    if (total < LX_BUFFERS_MT_MIN) {
        nt = 1;
    }
    const int stream = total >= LX_BUFFERS_STREAM_MIN;
    size_t per = (total + (size_t)nt - 1) / (size_t)nt;
    uint64_t x = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(^ : x) if (nt > 1)
#endif
    for (int t = 0; t < nt; t++) {
        /* the bytes [b0, b1) of the moves taken one after the other */
        size_t b0 = per * (size_t)t, b1 = b0 + per < total ? b0 + per : total;
        size_t off = 0;
        for (int64_t i = 0; i < n_moves && off < b1; i++) {
            size_t s = off, e = off + moves[i].n * moves[i].rows;
            off = e;
            size_t lo = s > b0 ? s : b0, hi = e < b1 ? e : b1;
            if (lo < hi) {
                x ^= move_span(&moves[i], lo - s, hi - s, stream);
            }
        }
#if LX_BUFFERS_STREAM
        if (stream) {
            _mm_sfence();  /* this thread's streamed stores visible before the join */
        }
#endif
    }
    return x;
}

void lx_stream_copy(void *dst, const void *src, size_t n) {
#if LX_BUFFERS_STREAM
    if (n >= 4096) {   /* copy_xor_stream's stores (its checksum, a few XORs per 64 bytes, unused) */
        (void) copy_xor_stream((uint8_t *) dst, (const uint8_t *) src, n, 0);
        _mm_sfence();
        return;
    }
#endif
    memcpy(dst, src, n);
}
