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
    void *local_threads;           /* MKL_Set_Num_Threads_Local, or 0 */
    int64_t n, half, mode;         /* mode: the MKL mode torch passes */
    int64_t low, high;             /* the positions allowed: low <= p <= high */
    float factor;
    int32_t scale;                 /* multiply by factor (factor != 1) */
    int64_t threads;               /* at most this many threads (the caller passes torch.get_num_threads()) */
} AnglesArgs;

#define ANGLES_BAD_SIZES (-1)
#define ANGLES_OUT_OF_RANGE (-2) /* a position outside [low, high]: nothing written */

/* 0 when the sizes and every position are fine, else ANGLES_BAD_SIZES / ANGLES_OUT_OF_RANGE (read nothing else). */
POSENC_INTERNAL int64_t angles_check(const AnglesArgs *a);
/* How many parts (threads) make the rows of a checked call (a->n >= 1): 1, or an even number. */
POSENC_INTERNAL int64_t angles_threads(const AnglesArgs *a);
/* A pool job: part `part` of `parts = angles_threads(a)` fills its share of a->cos and a->sin. */
POSENC_INTERNAL void angles_part(void *a, int64_t part, int64_t parts);

#endif /* POSENC_ROPE_ANGLES_H */
