/* rope_tile.h: the rotation loops of the CPU RoPE kernel (rope_tile.c), as its entry (rope_cpu.c) calls them.
 *
 * A tensor is described as [B, H, T, D] with element strides (any layout: bhtd, bthd, packed thd with
 * B = 1): Tensor4. Each token (b, t) reads the table row `rows[b * rows_b + t]` (positions indexing a cached
 * table) of the per-pair tables cos/sin [n_rows, half] (float32). A tensor's work is cut into units, which
 * threads split: a token with all its heads (heads inner) or a group of heads with all their tokens (tokens
 * inner), as rope_tile.c walks memory. tile_units counts a tensor's units; tile_<dtype> rotates units [j0, j1).
 */
#ifndef POSENC_ROPE_TILE_H
#define POSENC_ROPE_TILE_H

#include <stdint.h>

#ifndef POSENC_INTERNAL
#define POSENC_INTERNAL __attribute__((visibility("hidden"))) /* shared by the kernel's files, not exported */
#endif

enum { SPLIT_HALF = 0, INTERLEAVED = 1, INTERLEAVED_TO_SPLIT_HALF = 2 };
enum { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };
#define MAX_HALF 1024 /* the widest rotation (pairs) the row buffers hold; rows up to 2 * MAX_HALF + 2048 wide */
/* fresh outputs from this size on are advised huge pages and written with streaming stores */
#define LARGE_OUTPUT_BYTES ((int64_t)4 << 20)

typedef struct {
    void *x, *out;             /* input and output (equal when in place) */
    int64_t B, H, T, D;        /* logical shape */
    int64_t xs[4], os[4];      /* element strides of x and out over (B, H, T, D) */
} Tensor4;

/* Units of work of one tensor: a token with its heads, or a group of HEAD_GROUP heads with their tokens. */
POSENC_INTERNAL int64_t tile_units(const Tensor4 *t);

/* Rotate units [j0, j1) of t (tile_units) with the tables cos/sin [n_rows, half]; `rows` is the batch row
 * b's table rows at rows + b * rows_b; `pairing` one of SPLIT_HALF, INTERLEAVED, INTERLEAVED_TO_SPLIT_HALF. */
#define TILE_PARAMS const Tensor4 *t, const float *cos, const float *sin, const int64_t *rows, int64_t rows_b, \
                    int64_t half, int pairing, int64_t j0, int64_t j1
POSENC_INTERNAL void tile_f32(TILE_PARAMS);
POSENC_INTERNAL void tile_bf16(TILE_PARAMS);
POSENC_INTERNAL void tile_f64(TILE_PARAMS);
#ifdef __FLT16_MAX__ /* the compiler has _Float16: float16 runs here (posenc_has_f16) */
POSENC_INTERNAL void tile_f16(TILE_PARAMS);
#endif
#undef TILE_PARAMS

/* Order this thread's streaming stores (rope_tile.c writes large fresh outputs with them) before another
 * thread reads the outputs: each thread calls it after its last tile of a call. */
POSENC_INTERNAL void tile_fence(void);

#endif /* POSENC_ROPE_TILE_H */
