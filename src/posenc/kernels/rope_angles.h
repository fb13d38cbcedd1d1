/* rope_angles.h: the cos/sin rows of a call without a held table (rope_angles.c), as the kernel's entries
 * (rope_cpu.c's posenc_rope_fresh, rope_angles.c's posenc_angles) use them. */
#ifndef POSENC_ROPE_ANGLES_H
#define POSENC_ROPE_ANGLES_H

#include <stdint.h>

#ifndef POSENC_INTERNAL
#define POSENC_INTERNAL __attribute__((visibility("hidden"))) /* shared by the kernel's files, not exported */
#endif

/* The arguments, one struct (mirrored by `pack` in angles.py). */
typedef struct {
    const int64_t *positions;      /* [n] */
    const float *freq;             /* [half], the signed ladder */
    float *cos, *sin;              /* [n, half] each, contiguous, apart (posenc_rope_fresh: its own, 0 here) */
    void *vcos, *vsin;             /* torch's vector cos / sin (MKL's vmsCos / vmsSin) */
    int64_t n, half, mode;         /* mode: the MKL mode torch passes */
    int64_t low, high;             /* the positions allowed: low <= p <= high */
    float factor;
    int32_t scale;                 /* multiply by factor (factor != 1) */
    int64_t threads;               /* at most this many threads (the caller passes torch.get_num_threads()) */
} AnglesArgs;

#define ANGLES_BAD_SIZES (-1)
#define ANGLES_OUT_OF_RANGE (-2) /* a position outside [low, high]: nothing written */

/* Fill a->cos and a->sin: 0, or nothing written and ANGLES_BAD_SIZES / ANGLES_OUT_OF_RANGE. */
POSENC_INTERNAL int64_t angles_fill(const AnglesArgs *a);

#endif /* POSENC_ROPE_ANGLES_H */
