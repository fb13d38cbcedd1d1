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
 * this path at all.
 */
#include <stdint.h>

/* MKL's vector functions: vmsCos(n, a, r, mode) with 32-bit n (LP64, as torch calls them). */
typedef void (*vector_fn)(int32_t n, const float *a, float *r, int64_t mode);

/* The arguments, one struct (mirrored by `pack` in angles.py). */
typedef struct {
    const int64_t *positions;      /* [n] */
    const float *freq;             /* [half], the signed ladder */
    float *cos, *sin;              /* [n, half] each, contiguous, apart */
    void *vcos, *vsin;             /* vector_fn */
    int64_t n, half, mode;
    int64_t low, high;             /* the positions allowed: low <= p <= high */
    float factor;
    int32_t scale;                 /* multiply by factor (factor != 1) */
} AnglesArgs;

/* 0 when done; nothing written and -1 for sizes it does not take, -2 for a position outside [low, high]. */
int64_t posenc_angles(const char *packed) {
    const AnglesArgs *a = (const AnglesArgs *)packed;
    const int64_t total = a->n * a->half;
    if (a->n < 0 || a->half <= 0 || total > INT32_MAX)
        return -1;
    for (int64_t i = 0; i < a->n; ++i)
        if (a->positions[i] < a->low || a->positions[i] > a->high)
            return -2;
    for (int64_t i = 0; i < a->n; ++i) {
        const float p = (float)a->positions[i];
        float *theta = a->cos + i * a->half;
        for (int64_t j = 0; j < a->half; ++j)
            theta[j] = p * a->freq[j];
    }
    ((vector_fn)a->vsin)((int32_t)total, a->cos, a->sin, a->mode);
    ((vector_fn)a->vcos)((int32_t)total, a->cos, a->cos, a->mode); /* in place: the angles are read first */
    if (a->scale) {
        for (int64_t j = 0; j < total; ++j) {
            a->cos[j] *= a->factor;
            a->sin[j] *= a->factor;
        }
    }
    return 0;
}

int64_t posenc_angles_args_size(void) { return (int64_t)sizeof(AnglesArgs); }
