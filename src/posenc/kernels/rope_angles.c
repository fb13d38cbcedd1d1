/* The cos/sin rows of a few positions, bit-identical to torch's: `cos(float(p) * freq) * factor` and the same
 * with sin, for a call without a held table (posenc/kernels/angles.py; rope/fast.py calls it at decode).
 *
 * torch's CPU float32 cos and sin on contiguous memory are MKL's vector math (`vmsCos` / `vmsSin`, high
 * accuracy, denormals kept, errors ignored) where torch is built with MKL: the same function for every
 * element, wherever it sits. This file takes those very functions as pointers (angles.py finds them in the
 * torch library it runs with) and feeds them the same float32 angles: `float(p)` rounded once (as torch
 * converts int64 to float32), one product with the frequency; then the attention factor's product when it is
 * not 1 (rounded to float32 first, as torch multiplies a float32 tensor by a Python float). No fused
 * multiply-add (-ffp-contract=off). angles.py checks the result against torch on a probe before it uses
 * this path at all. On one thread each angle is made once, then one vector call each for sin and cos; on
 * more, the sines and the cosines run on different threads of the kernel's pool (rope_pool.c), tokens cut
 * into ranges when there are many, MKL's own threading off inside (MKL_Set_Num_Threads_Local, where found).
 */
#include <stdint.h>

#include "rope_angles.h"
#include "rope_pool.h"

/* MKL's vector functions: vmsCos(n, a, r, mode) with 32-bit n (LP64, as torch calls them). */
typedef void (*vector_fn)(int32_t n, const float *a, float *r, int64_t mode);

typedef int (*local_threads_fn)(int); /* MKL_Set_Num_Threads_Local: the old value back */

#define MIN_ANGLES_PER_PART 1024 /* below this a part's start-up costs more than its angles */

/* The angles of tokens [i0, i1) into rows i0 .. i1 - 1 of `out` (rows of a->half): float(p) * freq. */
static void thetas(const AnglesArgs *a, int64_t i0, int64_t i1, float *out) {
    for (int64_t i = i0; i < i1; ++i) {
        const float p = (float)a->positions[i];
        float *theta = out + i * a->half;
        for (int64_t j = 0; j < a->half; ++j)
            theta[j] = p * a->freq[j];
    }
}

/* `count` values at r times the attention factor, when it is not 1. */
static void scale(const AnglesArgs *a, float *r, int64_t count) {
    if (a->scale)
        for (int64_t j = 0; j < count; ++j)
            r[j] *= a->factor;
}

/* The angles of tokens [i0, i1) into `out`, then `fn` over them in place, then the factor. */
static void angles_rows(const AnglesArgs *a, int64_t i0, int64_t i1, float *out, vector_fn fn) {
    const int64_t count = (i1 - i0) * a->half;
    float *r = out + i0 * a->half;
    thetas(a, i0, i1, out);
    fn((int32_t)count, r, r, a->mode);
    scale(a, r, count);
}

/* One thread: each angle once, torch's vector sin then cos over all of them (two vector calls, each with a
 * fixed cost: the fewer the better). */
static void angles_one(const AnglesArgs *a) {
    const int64_t count = a->n * a->half;
    thetas(a, 0, a->n, a->cos);
    ((vector_fn)a->vsin)((int32_t)count, a->cos, a->sin, a->mode);
    ((vector_fn)a->vcos)((int32_t)count, a->cos, a->cos, a->mode); /* in place: the angles are read first */
    scale(a, a->cos, count);
    scale(a, a->sin, count);
}

/* Part `part` of `parts`: the sines (even parts) or the cosines (odd) of a range of tokens, each part's
 * angles made in its own output and its function run there on this thread alone (MKL's own threading off
 * for the call: inside a parallel region it only costs); parts < 2 (one thread, or the pool was busy with
 * another Python thread's call): this thread makes them all. */
void angles_part(void *ctx, int64_t part, int64_t parts) {
    const AnglesArgs *a = (const AnglesArgs *)ctx;
    if (parts < 2) {
        angles_one(a);
        return;
    }
    const int64_t ranges = parts / 2, r = part / 2;
    const int64_t i0 = a->n * r / ranges, i1 = a->n * (r + 1) / ranges;
    if (part >= 2 * ranges || i1 == i0)
        return;
    const int old = a->local_threads ? ((local_threads_fn)a->local_threads)(1) : 0;
    if (part % 2 == 0)
        angles_rows(a, i0, i1, a->sin, (vector_fn)a->vsin);
    else
        angles_rows(a, i0, i1, a->cos, (vector_fn)a->vcos);
    if (a->local_threads)
        ((local_threads_fn)a->local_threads)(old);
}

int64_t angles_check(const AnglesArgs *a) {
    if (a->n < 0 || a->half <= 0 || a->n * a->half > INT32_MAX)
        return ANGLES_BAD_SIZES;
    for (int64_t i = 0; i < a->n; ++i)
        if (a->positions[i] < a->low || a->positions[i] > a->high)
            return ANGLES_OUT_OF_RANGE;
    return 0;
}

int64_t angles_threads(const AnglesArgs *a) {
    const int64_t total = a->n * a->half, threads = a->threads > MAX_THREADS ? MAX_THREADS : a->threads;
    if (threads < 2 || total < MIN_ANGLES_PER_PART)
        return 1;
    /* sines and cosines on different threads, tokens cut into ranges of MIN_ANGLES_PER_PART angles at least */
    int64_t ranges = threads / 2;
    if (ranges > total / MIN_ANGLES_PER_PART)
        ranges = total / MIN_ANGLES_PER_PART;
    if (ranges > a->n)
        ranges = a->n;
    return 2 * (ranges < 1 ? 1 : ranges);
}

static int64_t angles_fill(const AnglesArgs *a) {
    const int64_t ret = angles_check(a);
    if (ret != 0 || a->n == 0)
        return ret;
    const int64_t threads = angles_threads(a);
    pool_run(threads, threads, angles_part, (void *)a);
    return 0;
}

/* The cos/sin rows into the caller's buffers (`Rope.cos_sin`): 0, or nothing written and ANGLES_*. */
int64_t posenc_angles(const char *packed) { return angles_fill((const AnglesArgs *)packed); }

int64_t posenc_angles_args_size(void) { return (int64_t)sizeof(AnglesArgs); }
