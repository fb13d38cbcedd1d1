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
 * this path at all. Tokens are cut into parts on the kernel's worker pool (rope_pool.c), each part's
 * angles one vector call each for sin and cos.
 */
#include <stdint.h>

#include "rope_angles.h"
#include "rope_pool.h"

/* MKL's vector functions: vmsCos(n, a, r, mode) with 32-bit n (LP64, as torch calls them). */
typedef void (*vector_fn)(int32_t n, const float *a, float *r, int64_t mode);

#define MIN_ANGLES_PER_PART 2048 /* below this a part's start-up costs more than its angles */

/* Part `part` of `parts`: the rows of its tokens, each angle once, then torch's vector sin and cos over them. */
static void angles_part(void *ctx, int64_t part, int64_t parts) {
    const AnglesArgs *a = (const AnglesArgs *)ctx;
    const int64_t i0 = a->n * part / parts, i1 = a->n * (part + 1) / parts, count = (i1 - i0) * a->half;
    if (count == 0)
        return;
    for (int64_t i = i0; i < i1; ++i) {
        const float p = (float)a->positions[i];
        float *theta = a->cos + i * a->half;
        for (int64_t j = 0; j < a->half; ++j)
            theta[j] = p * a->freq[j];
    }
    float *c = a->cos + i0 * a->half, *s = a->sin + i0 * a->half;
    ((vector_fn)a->vsin)((int32_t)count, c, s, a->mode);
    ((vector_fn)a->vcos)((int32_t)count, c, c, a->mode); /* in place: the angles are read first */
    if (a->scale) {
        for (int64_t j = 0; j < count; ++j) {
            c[j] *= a->factor;
            s[j] *= a->factor;
        }
    }
}

int64_t angles_fill(const AnglesArgs *a) {
    const int64_t total = a->n * a->half;
    if (a->n < 0 || a->half <= 0 || total > INT32_MAX)
        return ANGLES_BAD_SIZES;
    for (int64_t i = 0; i < a->n; ++i)
        if (a->positions[i] < a->low || a->positions[i] > a->high)
            return ANGLES_OUT_OF_RANGE;
    int64_t threads = a->threads < 1 ? 1 : a->threads > MAX_THREADS ? MAX_THREADS : a->threads;
    if (threads > total / MIN_ANGLES_PER_PART)
        threads = total / MIN_ANGLES_PER_PART > 1 ? total / MIN_ANGLES_PER_PART : 1;
    if (threads > a->n)
        threads = a->n > 0 ? a->n : 1;
    if (a->n > 0)
        pool_run(threads, a->n, angles_part, (void *)a);
    return 0;
}

/* The cos/sin rows into the caller's buffers (`Rope.cos_sin`): 0, or nothing written and ANGLES_*. */
int64_t posenc_angles(const char *packed) { return angles_fill((const AnglesArgs *)packed); }

int64_t posenc_angles_args_size(void) { return (int64_t)sizeof(AnglesArgs); }
