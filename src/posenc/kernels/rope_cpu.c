/* RoPE on CPU: q and k rotated in one call, in place or into output buffers, one pass over memory.
 *
 * Built at install (setup.py) or on first use (posenc/kernels/build.py) with the system C compiler (-O3,
 * -ffp-contract=off), from this file, rope_tile.c and rope_pool.c, and called through ctypes
 * (posenc/kernels/cpu.py). The arithmetic is the reference's (posenc/rope/apply.py), operation for operation:
 * fp32 products, no fused multiply-add, one rounding to the storage dtype (round to nearest even), so the
 * results are bit-identical to the reference.
 *
 * This file: the one entry point `posenc_rope`, its argument struct `RopeArgs`, its checks (rows inside the
 * table, rows the buffers hold, q and k apart) and how it cuts the work for the worker pool; the small exports
 * cpu.py reads (args size, float16 support, huge pages, the build key). The rotation loops are rope_tile.c
 * (rope_tile.h; their vector row routines rope_simd.h), the worker pool rope_pool.c (rope_pool.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "rope_angles.h"
#include "rope_pool.h"
#include "rope_tile.h"

/* The one entry point's arguments (mirrored field for field by `RopeArgs` in cpu.py). Strides are in
 * elements over (B, H, T, D); `k == 0` rotates q only; outputs may be the inputs (in place). */
typedef struct {
    void *q, *q_out, *k, *k_out;
    const float *cos, *sin;        /* per-pair tables [table_rows, half], float32, contiguous */
    const int64_t *rows;           /* the table row of each token: [B, T] (rows_batch_stride = T) or [T] (0) */
    int64_t batch, q_heads, k_heads, tokens, head_dim;
    int64_t q_strides[4], q_out_strides[4], k_strides[4], k_out_strides[4];
    int64_t table_rows, half, rows_batch_stride;
    int32_t dtype, pairing;
    int32_t threads;               /* at most this many threads (the caller passes torch.get_num_threads()) */
    int32_t flags;                 /* FLAG_HUGE_PAGES | FLAG_CHECK_OVERLAP */
} RopeArgs;

enum {
    FLAG_HUGE_PAGES = 1,    /* advise huge pages on fresh outputs of >= LARGE_OUTPUT_BYTES */
    FLAG_CHECK_OVERLAP = 2, /* refuse (OVERLAP, nothing written) q and k whose inputs' memory ranges meet or that
                             * have a broadcast dimension: the caller then decides exactly (rope/aliasing.py) */
};
#define BAD_ARGUMENTS (-((int64_t)1 << 62))
#define OVERLAP (BAD_ARGUMENTS + 1)
#define ANGLES_REFUSED (BAD_ARGUMENTS + 2) /* posenc_rope_fresh: a position out of range (nothing written) */

int64_t posenc_args_size(void) { return (int64_t)sizeof(RopeArgs); }

/* An output of >= 4 MiB that is not the input (a fresh tensor of `Rope.apply`): ask Linux for transparent
 * huge pages on its 2 MiB-aligned interior before the first write, so that it faults once per 2 MiB instead
 * of once per 4 KiB (a 64 MiB output: 32 faults instead of 16,384; the faults, not the arithmetic, set the
 * cost of an allocating rotation). A hint: without THP (or with it set to "never") nothing changes. */
void posenc_advise_huge_pages(void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const int64_t huge = (int64_t)2 << 20;
    if (bytes < LARGE_OUTPUT_BYTES) return;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(uintptr_t)(huge - 1);
    uintptr_t hi = ((uintptr_t)p + bytes) & ~(uintptr_t)(huge - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p; (void)bytes;
#endif
}

static void advise_output(const Tensor4 *t, int64_t elem) {
    const int64_t n[4] = {t->B, t->H, t->T, t->D};
    int64_t span = 1; /* elements from the first to one past the last */
    if (t->x == t->out) return;
    for (int i = 0; i < 4; i++) {
        if (n[i] == 0 || t->os[i] < 0) return;
        span += (n[i] - 1) * t->os[i];
    }
    posenc_advise_huge_pages(t->out, span * elem);
}

int posenc_has_f16(void) { /* whether float16 runs here (tile_f16 exists: the compiler has _Float16) */
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

#ifndef MIN_BYTES_PER_THREAD
/* below this much data per thread, waking a worker costs more than it saves (a spinning worker answers much
 * sooner than a sleeping one) */
#define MIN_BYTES_PER_THREAD ((int64_t)128 << 10)
#endif

typedef struct {
    const RopeArgs *a;
    const Tensor4 *t[2];           /* q, then k (or 0) */
    int64_t units[2], begin, end;  /* this worker's units [begin, end) of q's units followed by k's */
} Work;

static void tile(const Tensor4 *t, const RopeArgs *a, int64_t j0, int64_t j1) {
    switch (a->dtype) {
        case F32: tile_f32(t, a->cos, a->sin, a->rows, a->rows_batch_stride, a->half, a->pairing, j0, j1); break;
        case BF16: tile_bf16(t, a->cos, a->sin, a->rows, a->rows_batch_stride, a->half, a->pairing, j0, j1); break;
        case F64: tile_f64(t, a->cos, a->sin, a->rows, a->rows_batch_stride, a->half, a->pairing, j0, j1); break;
#ifdef __FLT16_MAX__
        case F16: tile_f16(t, a->cos, a->sin, a->rows, a->rows_batch_stride, a->half, a->pairing, j0, j1); break;
#endif
    }
}

static void *work(void *arg) {
    const Work *w = (const Work *)arg;
    int64_t offset = 0;
    for (int i = 0; i < 2; i++) {
        const int64_t lo = w->begin > offset ? w->begin : offset;
        const int64_t hi = w->end < offset + w->units[i] ? w->end : offset + w->units[i];
        if (w->t[i] && hi > lo) tile(w->t[i], w->a, lo - offset, hi - offset);
        offset += w->units[i];
    }
    tile_fence();
    return 0;
}

/* A call's work for the pool: all of it, and the bytes of one unit of q and of k. */
typedef struct {
    const Work *all;
    const int64_t *bytes_per_unit;
} Job;

/* Where part i of `parts` ends: units [0, all.units[0] + all.units[1]) cut into parts of about equal bytes
 * (under GQA a unit of q is larger than one of k). Part i runs from where part i - 1 ends (0 for part 0). */
static int64_t part_end(const Job *job, int64_t i, int64_t parts) {
    const Work *all = job->all;
    const int64_t *bytes_per_unit = job->bytes_per_unit;
    const int64_t q_bytes = all->units[0] * bytes_per_unit[0], total = q_bytes + all->units[1] * bytes_per_unit[1];
    if (i + 1 == parts) return all->units[0] + all->units[1];
    const int64_t cut = total / parts * (i + 1);
    return cut < q_bytes ? cut / bytes_per_unit[0]
                         : all->units[0] + (bytes_per_unit[1] ? (cut - q_bytes) / bytes_per_unit[1] : 0);
}

static void run_part(void *ctx, int64_t i, int64_t parts) { /* pool_run's job */
    const Job *job = (const Job *)ctx;
    Work part = *job->all;
    part.begin = i == 0 ? 0 : part_end(job, i - 1, parts);
    part.end = part_end(job, i, parts);
    work(&part);
}

/* Whether q's and k's input memory ranges meet, or either has a broadcast (stride 0) dimension. */
static int may_overlap(const Tensor4 *q, const Tensor4 *k, int64_t elem) {
    const Tensor4 *t[2] = {q, k};
    int64_t lo[2], hi[2];
    for (int j = 0; j < 2; j++) {
        const int64_t n[4] = {t[j]->B, t[j]->H, t[j]->T, t[j]->D};
        int64_t span = 1;
        for (int i = 0; i < 4; i++) {
            if (n[i] == 0) return 0; /* no elements */
            if (n[i] > 1 && t[j]->xs[i] <= 0) return 1;
            span += (n[i] - 1) * t[j]->xs[i];
        }
        lo[j] = (int64_t)(uintptr_t)t[j]->x;
        hi[j] = lo[j] + span * elem;
    }
    return lo[0] < hi[1] && lo[1] < hi[0];
}

/* A call's work, made by `plan` and run on the pool: Work and Job point into the same Plan. */
typedef struct {
    Tensor4 q, k;
    Work all;
    int64_t bytes_per_unit[2], units, threads; /* threads 0: nothing to do */
    Job job;
} Plan;

/* Check a call and cut its work (`p` filled in place: its pointers are into itself). Returns 0 (then
 * p->threads says how many threads the work wants, 0 for none) or, with nothing written, the refusal:
 * < 0: the most negative row found (a negative position); > 0: the table length the rows need;
 * BAD_ARGUMENTS (-2**62): arguments the kernel cannot take (a row wider than its buffers, an unknown dtype);
 * OVERLAP (-2**62 + 1): with FLAG_CHECK_OVERLAP, q and k may share memory. */
static int64_t plan(const RopeArgs *a, Plan *p) {
    p->threads = 0;
    if (a->batch <= 0 || a->tokens <= 0) return 0; /* no element, and `rows` may hold none to read */
    int64_t lo = 0, hi = -1, nb = a->rows_batch_stride ? a->batch : 1;
    for (int64_t i = 0; i < nb * a->tokens; i++) {
        int64_t r = a->rows[i];
        if (r < lo) lo = r;
        if (r > hi) hi = r;
    }
    if (lo < 0) return lo;
    if (hi >= a->table_rows) return hi + 1;
    if (a->half > MAX_HALF || a->head_dim > 2 * MAX_HALF + 2048) return BAD_ARGUMENTS;
    if (a->dtype < F32 || a->dtype > F64 || (a->dtype == F16 && !posenc_has_f16())) return BAD_ARGUMENTS;
    const int64_t elem = a->dtype == F64 ? 8 : a->dtype == F32 ? 4 : 2;
    p->q = (Tensor4){a->q, a->q_out, a->batch, a->q_heads, a->tokens, a->head_dim, {0}, {0}};
    p->k = (Tensor4){a->k, a->k_out, a->batch, a->k_heads, a->tokens, a->head_dim, {0}, {0}};
    memcpy(p->q.xs, a->q_strides, sizeof p->q.xs); memcpy(p->q.os, a->q_out_strides, sizeof p->q.os);
    memcpy(p->k.xs, a->k_strides, sizeof p->k.xs); memcpy(p->k.os, a->k_out_strides, sizeof p->k.os);
    if ((a->flags & FLAG_CHECK_OVERLAP) && a->k && may_overlap(&p->q, &p->k, elem)) return OVERLAP;
    p->all = (Work){a, {&p->q, a->k ? &p->k : 0}, {tile_units(&p->q), a->k ? tile_units(&p->k) : 0}, 0, 0};
    p->units = p->all.units[0] + p->all.units[1];
    if (p->units == 0) return 0;
    p->bytes_per_unit[0] = p->all.units[0] ? a->batch * a->q_heads * a->tokens * a->head_dim * elem / p->all.units[0] : 0;
    p->bytes_per_unit[1] = p->all.units[1] ? a->batch * a->k_heads * a->tokens * a->head_dim * elem / p->all.units[1] : 0;
    const int64_t total = p->all.units[0] * p->bytes_per_unit[0] + p->all.units[1] * p->bytes_per_unit[1];
    int64_t n = a->threads < 1 ? 1 : a->threads > MAX_THREADS ? MAX_THREADS : a->threads;
    if (n > total / MIN_BYTES_PER_THREAD) n = total / MIN_BYTES_PER_THREAD > 1 ? total / MIN_BYTES_PER_THREAD : 1;
    p->threads = n > p->units ? p->units : n;
    if (a->flags & FLAG_HUGE_PAGES) {
        advise_output(&p->q, elem);
        if (a->k) advise_output(&p->k, elem);
    }
    p->job = (Job){&p->all, p->bytes_per_unit};
    return 0;
}

/* Rotate q and (if a->k) k. Returns 0 when done; nothing is written otherwise (`plan`'s refusals). */
int64_t posenc_rope(const RopeArgs *a) {
    Plan p;
    const int64_t ret = plan(a, &p);
    if (ret == 0 && p.threads > 0) pool_run(p.threads, p.units, run_part, (void *)&p.job);
    return ret;
}

/* A call without a held table (rope/fast.py): the cos/sin rows of the call's tokens (rope_angles.c) in a buffer
 * of this call, token i reading row i (args->rows is not read), then the rotation over them, both on one team
 * of threads (pool_run2). The arguments are one buffer, a RopeArgs then an AnglesArgs (one pack on the Python
 * side). Returns posenc_rope's answer, or ANGLES_REFUSED (a position outside the range allowed); nothing is
 * written unless it returns 0. */
int64_t posenc_rope_fresh(const char *packed) {
    RopeArgs r;
    AnglesArgs a;
    memcpy(&r, packed, sizeof r);
    memcpy(&a, packed + sizeof r, sizeof a);
    if (a.n <= 0 || a.n != r.table_rows || a.half != r.half)
        return BAD_ARGUMENTS;
    const int64_t checked = angles_check(&a); /* also the sizes (half >= 1, n * half <= INT32_MAX) */
    if (checked != 0)
        return checked == ANGLES_OUT_OF_RANGE ? ANGLES_REFUSED : BAD_ARGUMENTS;
    /* one buffer: the rows 0 .. n-1 (8-byte aligned first), then the cos rows, then the sin rows */
    int64_t *buf = (int64_t *)malloc((size_t)a.n * sizeof(int64_t) + (size_t)(2 * a.n * a.half) * sizeof(float));
    if (!buf) return BAD_ARGUMENTS;
    for (int64_t i = 0; i < a.n; ++i) buf[i] = i;
    r.rows = buf;
    r.cos = a.cos = (float *)(buf + a.n);
    r.sin = a.sin = a.cos + a.n * a.half;
    Plan p;
    const int64_t ret = plan(&r, &p); /* reads the rows, not the cos/sin rows */
    if (ret == 0 && p.threads > 0)
        pool_run2(angles_threads(&a), angles_part, (void *)&a, p.threads, p.units, run_part, (void *)&p.job);
    free(buf);
    return ret;
}

/* ---- build key (posenc.kernels.build) ---------------------------------------------------------------------
 * Which source, flags and CPU this library was built for, baked in with -DPOSENC_BUILD_KEY="..."; build.py
 * loads an install-time build only when this matches its own key (-march=native makes the code CPU-specific). */
#ifndef POSENC_BUILD_KEY
#define POSENC_BUILD_KEY ""
#endif
const char *posenc_build_key(void) { return POSENC_BUILD_KEY; }
