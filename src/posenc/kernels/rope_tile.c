/* rope_tile.c: the rotation loops of the CPU RoPE kernel, per dtype: rows, then tiles of rows (rope_tile.h).
 *
 * A row of `half` pairs is loaded, rotated in the compute precision and stored (DEFINE_ROW); the rows of a
 * tensor's units are walked in its own memory order (DEFINE_TILE). At decode a row is 128 elements, so per-row
 * overhead matters as much as the arithmetic: rows are walked with plain pointer steps and contiguous
 * split-half rows go straight to a vector routine (rope_simd.h: no pairing switch, no scalar tail). Large
 * tensors are memory-bound: each row's stream is prefetched PREFETCH_BYTES ahead, and with tokens inner (bhtd)
 * HEAD_GROUP 2-byte heads walk side by side so that each table row is read once per group. The arithmetic is
 * the reference's (posenc/rope/apply.py), operation for operation, so the results are bit-identical to it.
 * The measurements behind these choices: docs/performance.md, "The CPU kernel".
 */
#include <stdint.h>

#include "rope_heads.h"
#include "rope_simd.h"
#include "rope_tile.h"

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far ahead in a row's stream (see DEFINE_TILE) */
#endif
#ifndef PREFETCH_MIN_BYTES
#define PREFETCH_MIN_BYTES ((int64_t)1 << 20) /* smaller tensors are not prefetched (see DEFINE_TILE) */
#endif
/* software prefetch of a row (the hardware prefetcher restarts at every stream and lags even on one) */
#define PREFETCH_ROW(px, bytes)                                                                       \
    if (px)                                                                                           \
        for (int64_t line = 0; line < (bytes); line += 64) __builtin_prefetch((const char *)(px) + line, 1, 3)
#ifndef HEAD_GROUP
/* heads walked side by side when tokens are inner: they share each token's table row (for float32 too: on a
 * quiet machine two streams beat one, docs/performance.md) */
#define HEAD_GROUP 2
#endif

/* One row of `half` pairs: load -> rotate in compute precision -> store. ROW(T, C, LOAD, STORE). */
#define DEFINE_ROW(NAME, ST, CT, LOAD, STORE, SIMD_START, SIMD_IL)                                              \
/* read pairs (2i, 2i+1), write [first | second]: through a buffer (the row may be rotated in place); \
 * its own function, so the common pairings carry no large stack frame */                          \
__attribute__((noinline)) static void NAME##_i2sh(const ST *x, ST *o, const float *c, const float *s, \
                                                  int64_t half) {                                   \
    CT buf[2 * MAX_HALF];                                                                           \
    for (int64_t i = 0; i < half; i++) {                                                            \
        CT a = LOAD(x[2 * i]), b = LOAD(x[2 * i + 1]), ci = (CT)c[i], si = (CT)s[i];                \
        buf[i] = a * ci - b * si; buf[i + half] = b * ci + a * si;                                  \
    }                                                                                               \
    for (int64_t i = 0; i < 2 * half; i++) o[i] = STORE(buf[i]);                                    \
}                                                                                                   \
static inline void NAME(const ST *x, ST *o, const float *c, const float *s, int64_t half, int64_t d, \
                        int pairing) {                                                              \
    int64_t i;                                                                                      \
    if (pairing == SPLIT_HALF) {                                                                    \
        i = SIMD_START(x, o, c, s, half);                                                           \
        _Pragma("GCC ivdep") /* in place: each pair is read before it is written */               \
        for (; i < half; i++) {                                                                     \
            CT a = LOAD(x[i]), b = LOAD(x[i + half]), ci = (CT)c[i], si = (CT)s[i];                 \
            CT lo = a * ci - b * si, hi = b * ci + a * si;                                          \
            o[i] = STORE(lo); o[i + half] = STORE(hi);                                              \
        }                                                                                           \
    } else if (pairing == INTERLEAVED) {                                                            \
        i = SIMD_IL(x, o, c, s, half);                                                              \
        _Pragma("GCC ivdep")                                                                        \
        for (; i < half; i++) {                                                                     \
            CT a = LOAD(x[2 * i]), b = LOAD(x[2 * i + 1]), ci = (CT)c[i], si = (CT)s[i];            \
            CT lo = a * ci - b * si, hi = b * ci + a * si;                                          \
            o[2 * i] = STORE(lo); o[2 * i + 1] = STORE(hi);                                         \
        }                                                                                           \
    } else {                                                                                        \
        NAME##_i2sh(x, o, c, s, half);                                                              \
    }                                                                                               \
    if (o != x)                                                                                     \
        for (i = 2 * half; i < d; i++) o[i] = x[i]; /* pass-through channels, bit-identical */     \
}

/* Whether a split-half rotation may write its output with non-temporal stores: a fresh output (not the
 * input) of >= 4 MiB whose rows and half-rows all start on 64-byte lines. Streaming stores skip reading
 * each output line before writing it (the write-allocate of a plain store): out of place then moves the
 * bytes of an in-place rotation. */
static int stream_ok(const Tensor4 *t, int64_t elem, int64_t half) {
    if (t->x == t->out || ((uintptr_t)t->out & 63) || (half * elem) & 63) return 0;
    for (int i = 0; i < 3; i++)
        if ((t->os[i] * elem) & 63) return 0;
    return t->B * t->H * t->T * t->D * elem >= LARGE_OUTPUT_BYTES;
}

/* Rotate every row of one tensor, walking memory in its own order (heads inner for bthd-like strides and
 * single tokens, tokens inner for bhtd). FAST(x, o, c, s, half) rotates a contiguous split-half row when HAS_FAST.
 * A channel stride != 1 gathers the row into a buffer, rotates it contiguously and scatters it back. When HOIST,
 * a token's heads of 64 split-half pairs (head_dim 128) in a tensor under PREFETCH_MIN_BYTES (a decode step) go
 * to HEADS64 (rope_heads.h), which keeps the token's table row in registers. */
#define DEFINE_TILE(NAME, ROW, ST, FAST, HAS_FAST, HOIST, HEADS64)                                                          \
__attribute__((noinline)) static void NAME##_strided(const Tensor4 *t, const ST *x, ST *o, const float *c, \
                                                     const float *s, int64_t half, int pairing) {   \
    ST xin[2 * MAX_HALF + 2048], xout[2 * MAX_HALF + 2048];                                         \
    for (int64_t i = 0; i < t->D; i++) xin[i] = x[i * t->xs[3]];                                    \
    ROW(xin, xout, c, s, half, t->D, pairing);                                                      \
    for (int64_t i = 0; i < t->D; i++) o[i * t->os[3]] = xout[i];                                   \
}                                                                                                   \
static inline __attribute__((always_inline)) void NAME##_row(const Tensor4 *t, const ST *x, ST *o, const float *c, \
        const float *s, int64_t half, int pairing, int fast, int nt, int contiguous, int64_t pass) {\
    if (fast) {                                                                                     \
        FAST(x, o, c, s, half, nt);                                                                 \
        for (int64_t i = 0; i < pass; i++) o[2 * half + i] = x[2 * half + i];                       \
    } else if (contiguous) {                                                                        \
        ROW(x, o, c, s, half, t->D, pairing);                                                       \
    } else {                                                                                        \
        NAME##_strided(t, x, o, c, s, half, pairing);                                               \
    }                                                                                               \
}                                                                                                   \
void NAME(const Tensor4 *t, const float *cos, const float *sin, const int64_t *rows, int64_t rows_b, \
          int64_t half, int pairing, int64_t j0, int64_t j1) {                                      \
    const int contiguous = t->xs[3] == 1 && t->os[3] == 1;                                          \
    const int fast = contiguous && pairing == SPLIT_HALF && HAS_FAST;                              \
    const int nt = fast && stream_ok(t, (int64_t)sizeof(ST), half);                                 \
    const int64_t pass = t->x != t->out ? t->D - 2 * half : 0; /* pass-through channels to copy */   \
    const int heads_inner = t->T == 1 || t->xs[1] < t->xs[2]; /* bthd-like: heads adjacent in memory */ \
    const int64_t nu = heads_inner ? t->T : t->H, nv = heads_inner ? t->H : t->T;                   \
    const int64_t xu = heads_inner ? t->xs[2] : t->xs[1], xv = heads_inner ? t->xs[1] : t->xs[2];   \
    const int64_t ou = heads_inner ? t->os[2] : t->os[1], ov = heads_inner ? t->os[1] : t->os[2];   \
    const int64_t row_bytes = t->D * (int64_t)sizeof(ST), pf = PREFETCH_BYTES / row_bytes + 1;       \
    /* a tensor that fits in L2 (a decode step's q or k, just written) is not prefetched, nor one walked as a \
     * single stream (heads inner, each token's heads right after the last's: the hardware prefetcher's own) */ \
    const int prefetch = t->B * t->H * t->T * row_bytes >= PREFETCH_MIN_BYTES                       \
                         && !(heads_inner && xv * nv == xu && ov * nv == ou);                       \
    /* tokens inner (bhtd): HEAD_GROUP heads' token streams walked side by side (one table row each) */ \
    const int64_t group = HEAD_GROUP;                                                               \
    const int64_t per_b = heads_inner ? nu : (nu + group - 1) / group; /* units of one batch row */ \
    if (nv == 0) return;                                                                            \
    for (int64_t j = j0; j < j1; j++) { /* unit j: one token (heads inner) or one head group */    \
        const int64_t b = j / per_b, w = j % per_b;                                                 \
        const ST *xb = (const ST *)t->x + b * t->xs[0];                                             \
        ST *ob = (ST *)t->out + b * t->os[0];                                                       \
        const int64_t *r = rows + b * rows_b;                                                       \
        if (heads_inner) { /* one table row per token, its heads in one stream (the hardware prefetcher's) */ \
            const int64_t u = w;                                                                    \
            const ST *x = xb + u * xu;                                                              \
            ST *o = ob + u * ou;                                                                    \
            const float *c = cos + r[u] * half, *s = sin + r[u] * half;                             \
            if (!prefetch && HOIST && fast && !nt && half == 64 && pass == 0) {                     \
                HEADS64((const void *)x, (void *)o, xv, ov, nv, c, s);                              \
                continue;                                                                           \
            }                                                                                       \
            if (!prefetch) {                                                                        \
                for (int64_t v = 0; v < nv; v++, x += xv, o += ov)                                  \
                    NAME##_row(t, x, o, c, s, half, pairing, fast, nt, contiguous, pass);           \
                continue;                                                                           \
            }                                                                                       \
            for (int64_t v = 0; v < nv; v++, x += xv, o += ov) {                                    \
                const ST *px = v + pf < nv ? x + pf * xv                                            \
                             : u + 1 < nu && v + pf - nv < nv ? xb + (u + 1) * xu + (v + pf - nv) * xv : 0; \
                PREFETCH_ROW(px, row_bytes);                                                        \
                NAME##_row(t, x, o, c, s, half, pairing, fast, nt, contiguous, pass);               \
            }                                                                                       \
            continue;                                                                               \
        }                                                                                           \
        const int64_t u0 = w * group, g = nu - u0 < group ? nu - u0 : group;                        \
        for (int64_t v = 0; v < nv; v++) {                                                          \
            const float *c = cos + r[v] * half, *s = sin + r[v] * half;                             \
            for (int64_t u = u0; u < u0 + g; u++) {                                                 \
                const ST *x = xb + u * xu + v * xv;                                                 \
                /* prefetch pf rows ahead in this head's stream, else in the next group's */         \
                const ST *px = !prefetch ? 0 : v + pf < nv ? x + pf * xv                            \
                             : u + g < nu && v + pf - nv < nv ? xb + (u + g) * xu + (v + pf - nv) * xv : 0; \
                PREFETCH_ROW(px, row_bytes);                                                        \
                NAME##_row(t, x, ob + u * ou + v * ov, c, s, half, pairing, fast, nt, contiguous, pass); \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}

#define ID(v) (v)
#define NO_SIMD(x, o, c, s, half) 0
#define NO_FAST(x, o, c, s, half, nt) ((void)0)
#define NO_HEADS(x, o, xv, ov, nv, c, s) ((void)0)
#ifdef POSENC_SIMD_F32
#define F32_FAST split_half_f32_simd
#define F32_IL interleaved_f32_simd
#define F32_HAS_FAST 1
#define F32_HEADS heads_f32_64
#else
#define F32_FAST NO_FAST
#define F32_IL NO_SIMD
#define F32_HAS_FAST 0
#define F32_HEADS NO_HEADS
#endif
DEFINE_ROW(row_f32, float, float, ID, ID, NO_SIMD, F32_IL)
DEFINE_ROW(row_f64, double, double, ID, ID, NO_SIMD, NO_SIMD)
#define BF16_IN(v) bf16_load(v)
#define BF16_OUT(v) bf16_store(v)
#ifdef POSENC_SIMD_BF16
#define BF16_SIMD(x, o, c, s, half) split_half_bf16_simd(x, o, c, s, half, 0)
#define BF16_FAST split_half_bf16_simd
#define BF16_IL interleaved_bf16_simd
#define BF16_HAS_FAST 1
#else
#define BF16_SIMD NO_SIMD
#define BF16_FAST NO_FAST
#define BF16_IL NO_SIMD
#define BF16_HAS_FAST 0
#endif
DEFINE_ROW(row_bf16, uint16_t, float, BF16_IN, BF16_OUT, BF16_SIMD, BF16_IL)
DEFINE_TILE(tile_f32, row_f32, float, F32_FAST, F32_HAS_FAST, F32_HAS_FAST, F32_HEADS)
DEFINE_TILE(tile_f64, row_f64, double, NO_FAST, 0, 0, NO_HEADS)
#ifdef POSENC_HEADS_BF16
DEFINE_TILE(tile_bf16, row_bf16, uint16_t, BF16_FAST, BF16_HAS_FAST, 1, heads_bf16_64)
#else
DEFINE_TILE(tile_bf16, row_bf16, uint16_t, BF16_FAST, BF16_HAS_FAST, 0, NO_HEADS)
#endif
#ifdef __FLT16_MAX__
#define F16_IN(v) ((float)(v))
#define F16_OUT(v) ((_Float16)(v))
#ifdef POSENC_SIMD_F16
#define F16_SIMD(x, o, c, s, half) split_half_f16_simd(x, o, c, s, half, 0)
#define F16_FAST split_half_f16_simd
#define F16_IL interleaved_f16_simd
#define F16_HAS_FAST 1
#else
#define F16_SIMD NO_SIMD
#define F16_FAST NO_FAST
#define F16_IL NO_SIMD
#define F16_HAS_FAST 0
#endif
DEFINE_ROW(row_f16, _Float16, float, F16_IN, F16_OUT, F16_SIMD, F16_IL)
DEFINE_TILE(tile_f16, row_f16, _Float16, F16_FAST, F16_HAS_FAST, 0, NO_HEADS)
#endif

int64_t tile_units(const Tensor4 *t) {
    const int heads_inner = t->T == 1 || t->xs[1] < t->xs[2];
    const int64_t group = HEAD_GROUP; /* every dtype walks heads in groups */
    if (t->H == 0 || t->T == 0) return 0;
    return t->B * (heads_inner ? t->T : (t->H + group - 1) / group);
}

void tile_fence(void) {
#ifdef POSENC_SIMD_F32
    _mm_sfence(); /* order this thread's streaming stores before the caller reads the outputs */
#endif
}
