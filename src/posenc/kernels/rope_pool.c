/* rope_pool.c: the CPU RoPE kernel's worker pool (rope_pool.h).
 *
 * A process-wide resource of the library, as OpenMP's pool is for torch: workers are started on the first
 * call that wants them (never more than the largest thread count asked for, minus the calling thread), then
 * wait for work, spinning POOL_SPIN_NS after each job and sleeping on a condition variable after that. A call
 * cuts its work into PARTS_PER_THREAD parts per thread, publishes them, and claims parts itself like any
 * worker: a worker that wakes late finds fewer parts (or none) left, so a call never waits for a sleeping
 * thread, only for parts already being rotated. Each call uses at most its own `threads` (the caller passes
 * torch.get_num_threads()). One call uses the pool at a time: a call that finds it busy (another Python thread,
 * as ctypes releases the GIL) runs on its own thread, with the same results (each element is computed the same
 * way whichever thread computes it). A forked child starts with no workers (pthread_atfork resets the pool).
 *
 * Built with OpenMP (-fopenmp, the default), a call with threads > 1 runs its parts on the OpenMP runtime
 * instead: the library's libgomp.so.1 is, by that name, the one torch already loaded, so posenc's parts and
 * torch's own ops share one team of threads. Two pools on the same cores fought: torch's OpenMP workers spin
 * after each op, and a worker of this pool then shared its core with one (docs/performance.md, "vLLM").
 * GNU OpenMP is not fork-safe, so a forked child (and a call inside someone's OpenMP parallel region) uses
 * the pthread pool above.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "rope_pool.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef POOL_SPIN_NS
/* how long a worker (and a caller waiting for its workers) spins before sleeping: back-to-back calls (a
 * decode step's layers) find it awake; an idle process has no thread spinning after this long */
#define POOL_SPIN_NS 100000
#endif
#define PARTS_PER_THREAD 4

static struct {
    pthread_mutex_t callers;   /* held by the one call using the pool */
    pthread_mutex_t mu;        /* with `wake`: sleeping workers wait for a new job */
    pthread_cond_t wake;
    pthread_mutex_t done_mu;   /* with `done_cv`: a caller waits for the last claimed parts */
    pthread_cond_t done_cv;
    atomic_ullong next;        /* job generation << 32 | next unclaimed part */
    atomic_llong done;         /* parts of the job finished */
    atomic_int workers_wanted; /* workers [0, workers_wanted) may take parts of the job */
    int64_t parts;             /* parts of the job */
    void (*job)(void *, int64_t, int64_t);
    void *ctx;                 /* the job's argument (the caller's, valid until all parts are done) */
    int started, forked;       /* workers started; set in a forked child (OpenMP's threads did not follow) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run parts of job `gen` until none is left; returns how many this thread ran. */
static int64_t take_parts(unsigned long long gen) {
    int64_t mine = 0;
    for (;;) {
        unsigned long long v = atomic_load(&pool.next);
        if (v >> 32 != gen || (int64_t)(v & 0xffffffffu) >= pool.parts) return mine;
        if (!atomic_compare_exchange_weak(&pool.next, &v, v + 1)) continue;
        pool.job(pool.ctx, (int64_t)(v & 0xffffffffu), pool.parts); /* the job cannot change before `done` counts it */
        mine++;
        if (atomic_fetch_add(&pool.done, 1) + 1 == pool.parts) {
            pthread_mutex_lock(&pool.done_mu);
            pthread_cond_signal(&pool.done_cv);
            pthread_mutex_unlock(&pool.done_mu);
        }
    }
}

static void *pool_worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned long long seen = atomic_load(&pool.next) >> 32;
    for (;;) {
        const int64_t end = now_ns() + POOL_SPIN_NS;
        unsigned long long gen;
        for (int i = 0; (gen = atomic_load(&pool.next) >> 32) == seen; i++) {
            relax();
            if ((i & 63) == 63 && now_ns() > end) {
                pthread_mutex_lock(&pool.mu);
                while ((gen = atomic_load(&pool.next) >> 32) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
        seen = gen;
        if (index < atomic_load(&pool.workers_wanted)) take_parts(gen);
    }
    return 0;
}

static void pool_after_fork(void) { /* in the child: the workers did not survive the fork */
    pthread_mutex_init(&pool.callers, 0);
    pthread_mutex_init(&pool.mu, 0);
    pthread_cond_init(&pool.wake, 0);
    pthread_mutex_init(&pool.done_mu, 0);
    pthread_cond_init(&pool.done_cv, 0);
    pool.started = 0;
    pool.forked = 1;
}

__attribute__((constructor)) static void pool_on_load(void) { /* before any fork the library lives through */
    pthread_atfork(0, 0, pool_after_fork);
}

/* Start workers until `want` run (fewer when a thread cannot start). Called with pool.callers held. */
static void pool_grow(int want) {
    while (pool.started < want) {
        pthread_attr_t attr;
        pthread_t id;
        if (pthread_attr_init(&attr)) return;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&id, &attr, pool_worker, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) return;
        pool.started++;
    }
}

/* The parts of `units` units on `threads` threads: PARTS_PER_THREAD a thread, at most one a unit; one alone. */
static int64_t parts_of(int64_t threads, int64_t units) {
    return threads == 1 ? 1 : threads * PARTS_PER_THREAD < units ? threads * PARTS_PER_THREAD : units;
}

void pool_run(int64_t threads, int64_t units, void (*job)(void *, int64_t, int64_t), void *ctx) {
    const int64_t parts = parts_of(threads, units);
#ifdef _OPENMP
    if (threads > 1 && !pool.forked && !omp_in_parallel()) {
#pragma omp parallel for schedule(static) num_threads((int)threads)
        for (int64_t i = 0; i < parts; i++) job(ctx, i, parts);
        return;
    }
#endif
    if (threads == 1 || pthread_mutex_trylock(&pool.callers)) {
        job(ctx, 0, 1);
        return;
    }
    pool_grow((int)threads - 1);
    pool.job = job;
    pool.ctx = ctx;
    pool.parts = parts;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.workers_wanted, (int)threads - 1);
    pthread_mutex_lock(&pool.mu);
    const unsigned long long gen = (atomic_load(&pool.next) >> 32) + 1;
    atomic_store(&pool.next, gen << 32); /* publishes the job: part 0 is next */
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    take_parts(gen);
    const int64_t end = now_ns() + POOL_SPIN_NS;
    for (int i = 0; atomic_load(&pool.done) < parts; i++) { /* only parts being run are left */
        relax();
        if ((i & 63) == 63 && now_ns() > end) {
            pthread_mutex_lock(&pool.done_mu);
            while (atomic_load(&pool.done) < parts) pthread_cond_wait(&pool.done_cv, &pool.done_mu);
            pthread_mutex_unlock(&pool.done_mu);
            break;
        }
    }
    pthread_mutex_unlock(&pool.callers);
}

void pool_run2(int64_t threads1, void (*job1)(void *, int64_t, int64_t), void *ctx1, int64_t threads2, int64_t units2,
               void (*job2)(void *, int64_t, int64_t), void *ctx2) {
#ifdef _OPENMP
    const int64_t team = threads1 > threads2 ? threads1 : threads2;
    if (team > 1 && !pool.forked && !omp_in_parallel()) { /* one team: a barrier between the jobs, not a restart */
        const int64_t parts2 = parts_of(threads2, units2);
#pragma omp parallel num_threads((int)team)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < threads1; i++) job1(ctx1, i, threads1);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < parts2; i++) job2(ctx2, i, parts2);
        }
        return;
    }
#endif
    pool_run(threads1, threads1, job1, ctx1);
    pool_run(threads2, units2, job2, ctx2);
}

int64_t posenc_pool_workers(void) { return pool.started; } /* workers started so far (tests, docs) */

int64_t posenc_pool_openmp(void) { /* 1: calls with threads > 1 run on OpenMP's team in this process */
#ifdef _OPENMP
    return !pool.forked;
#else
    return 0;
#endif
}
