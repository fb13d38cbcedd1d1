/* rope_pool.h: the CPU RoPE kernel's worker pool (rope_pool.c), as its entry (rope_cpu.c) uses it.
 *
 * A job is `units` units of work cut into parts; pool_run calls job(ctx, i, parts) once for each part i, on
 * the calling thread and up to `threads - 1` pool workers, and returns when every part is done. The job says
 * which units part i of `parts` covers; the pool knows nothing of tensors.
 */
#ifndef POSENC_ROPE_POOL_H
#define POSENC_ROPE_POOL_H

#include <stdint.h>

#ifndef POSENC_INTERNAL
#define POSENC_INTERNAL __attribute__((visibility("hidden"))) /* shared by the kernel's files, not exported */
#endif

#define MAX_THREADS 256 /* threads one call may use: the caller's own and at most MAX_THREADS - 1 workers */

/* Run job(ctx, i, parts) for every part i in [0, parts), parts = min(threads * PARTS_PER_THREAD, units), on the
 * calling thread and up to threads - 1 workers (1 <= threads <= MAX_THREADS, units >= 1). With threads == 1,
 * or while another call uses the pool, the calling thread runs the whole job as one part: job(ctx, 0, 1). */
POSENC_INTERNAL void pool_run(int64_t threads, int64_t units, void (*job)(void *ctx, int64_t part, int64_t parts),
                              void *ctx);

/* job1 in `threads1` parts (part i of threads1, one a thread), then, once every one is done (its writes seen),
 * job2 as pool_run(threads2, units2, job2, ctx2) would run it. On OpenMP one team runs both, a barrier between
 * them (a second parallel region costs a start and a join); elsewhere two pool_run calls. */
POSENC_INTERNAL void pool_run2(int64_t threads1, void (*job1)(void *ctx, int64_t part, int64_t parts), void *ctx1,
                               int64_t threads2, int64_t units2, void (*job2)(void *ctx, int64_t part, int64_t parts),
                               void *ctx2);

/* Worker threads started so far (exported: tests and docs read it through ctypes). */
int64_t posenc_pool_workers(void);

/* 1 when calls with threads > 1 run on the OpenMP runtime (built with -fopenmp, not in a forked child). */
int64_t posenc_pool_openmp(void);

#endif /* POSENC_ROPE_POOL_H */
