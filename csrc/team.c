/* team.c: a team's barrier and shares (see team.h). */
#include "team.h"

#include <sched.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LX_PAUSE() _mm_pause()
#else
#define LX_PAUSE() ((void) 0)
#endif

/* spins before a waiting member starts yielding its core: ~0.1-0.2 ms of pauses (65-140 cycles
 * each), beyond the longest step one member runs alone in a decode step (a few us), short enough
 * that a member whose partner lost its core (another process's threads) gives its own back soon */
enum { SPINS_BEFORE_YIELD = 1 << 12 };

int lx_team_fits(int n) {
#ifdef _OPENMP
    return n > 1 && n <= omp_get_num_procs();
#else
    (void) n;
    return 0;
#endif
}

void lx_team_init(lx_team *t, int n) {
    t->arrived = 0;
    t->phase = 0;
    t->n = n;
}

lx_crew lx_crew_join(lx_team *t, int tid) {
    const lx_crew c = {t, tid, t->n, __atomic_load_n(&t->phase, __ATOMIC_ACQUIRE)};
    return c;
}

lx_crew lx_crew_solo(void) {
    const lx_crew c = {0, 0, 1, 0};
    return c;
}

void lx_crew_sync(lx_crew *c) {
    lx_team *t = c->team;
    if (!t) return;
    const int next = c->phase ^ 1;
    if (__atomic_add_fetch(&t->arrived, 1, __ATOMIC_ACQ_REL) == t->n) {
        __atomic_store_n(&t->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&t->phase, next, __ATOMIC_RELEASE);
    } else {
        for (unsigned spins = 0; __atomic_load_n(&t->phase, __ATOMIC_ACQUIRE) != next; ++spins) {
            if (spins < SPINS_BEFORE_YIELD) LX_PAUSE();
            else sched_yield();
        }
    }
    c->phase = next;
}

void lx_share(int64_t n, int t, int n_parts, int64_t *i0, int64_t *i1) {
    const int64_t q = n / n_parts, r = n % n_parts;
    *i0 = t * q + (t < r ? t : r);
    *i1 = *i0 + q + (t < r ? 1 : 0);
}

void lx_crew_share(const lx_crew *c, int64_t n, int64_t *i0, int64_t *i1) { lx_share(n, c->tid, c->n, i0, i1); }
