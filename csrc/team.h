/* team.h: the threads of one OpenMP region working through a sequence of steps together (a decode
 * step's layers: layer.c), with a barrier of their own between steps.
 *
 * A region per step of work costs a fork and a join (libgomp: ~1.5 us for two threads here, a
 * decode step of SmolLM2 opening ~150 of them); the team opens one region for the whole sequence,
 * and its barrier is a counter and a flag the members spin on (~0.1 us for two threads, against
 * libgomp's ~0.7). Spinning is right only while every member has a core: lx_team_fits says when a
 * team may be formed, and a member that has waited long yields its core.
 *
 * Each member holds an lx_crew: the shared lx_team, its own number and its barrier phase. A crew of
 * one (lx_crew_solo) is the calling thread alone: lx_crew_sync does nothing and every step runs
 * whole, so one body of code serves both. */
#ifndef LX_TEAM_H
#define LX_TEAM_H

#include <stdint.h>

typedef struct {
    _Alignas(64) int arrived;     /* members at the barrier in this phase */
    _Alignas(64) int phase;       /* flips when the last member arrives */
    int n;                        /* members */
} lx_team;

typedef struct {
    lx_team *team;   /* NULL: a crew of one */
    int tid;         /* this member, 0 .. n - 1 */
    int n;           /* members */
    int phase;       /* the phase this member waits to see flip */
} lx_crew;

/* 1 if a team of n threads may spin (n > 1 and no more threads than the process's cores) */
int lx_team_fits(int n);

/* the team of n members (n >= 1), ready for its first barrier */
void lx_team_init(lx_team *t, int n);

/* member tid's handle on team t (called by that member) */
lx_crew lx_crew_join(lx_team *t, int tid);

/* the calling thread alone */
lx_crew lx_crew_solo(void);

/* wait until every member has called it (memory written before is visible to all after);
 * nothing for a crew of one */
void lx_crew_sync(lx_crew *c);

/* part t's contiguous share [*i0, *i1) of n items cut into n_parts (OpenMP's static schedule: the
 * first n % n_parts take one more) */
void lx_share(int64_t n, int t, int n_parts, int64_t *i0, int64_t *i1);

/* member c's lx_share of n items */
void lx_crew_share(const lx_crew *c, int64_t n, int64_t *i0, int64_t *i1);

/* for (int64_t i = 0; i < n; ++i) body: over an OpenMP team of nt threads (static schedule) when nt > 1
 * and the caller's condition big holds, else on the calling thread alone; an OpenMP if clause would still
 * open a team of one (~0.65 us, many times a decode step). Without OpenMP the pragma is ignored. */
#define LX_FOR_THREADS(i, n, nt, big, body)                                    \
    do {                                                                      \
        const int nt_ = (nt);                                                 \
        const int64_t n_ = (n);                                               \
        if (nt_ > 1 && (big)) {                                               \
            _Pragma("omp parallel for num_threads(nt_) schedule(static)")     \
            for (int64_t i = 0; i < n_; ++i) body;                            \
        } else {                                                              \
            for (int64_t i = 0; i < n_; ++i) body;                            \
        }                                                                     \
    } while (0)

#endif /* LX_TEAM_H */
