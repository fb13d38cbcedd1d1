/* RoPE on CPU: q and k rotated in one call, in place or into output buffers, one pass over memory.
 *
 * Built at install (setup.py) or on first use (posenc/kernels/build.py) with the system C compiler (-O3,
 * -ffp-contract=off) and called through ctypes (posenc/kernels/cpu.py). The arithmetic is the reference's (posenc/rope/apply.py), operation for operation:
 * fp32 products, no fused multiply-add, one rounding to the storage dtype (round to nearest even), so
 * the results are bit-identical to the reference.
 *
 * A tensor is described as [B, H, T, D] with element strides (any layout: bhtd, bthd, packed thd with
 * B = 1). Each token (b, t) reads the table row `rows[b * rows_b + t]` (positions indexing a cached
 * table) of the per-pair tables cos/sin [n_rows, half] (float32).
 *
 * Loop structure (measured on Zen 4, one thread): at decode a row is 128 elements, so per-row overhead
 * matters as much as the arithmetic: rows are walked with plain pointer steps and split-half rows go
 * straight to a vector routine (no pairing switch, no scalar tail); the whole-row rework took the bf16
 * decode kernel from 15.6 to 11.3 us (copy_ of q and k: 8.6 us). Large tensors are memory-bound: each
 * row's stream is prefetched PREFETCH_BYTES ahead, and with tokens inner (bhtd) HEAD_GROUP bf16 heads walk
 * side by side so that each table row is read once per group.
 */
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

enum { SPLIT_HALF = 0, INTERLEAVED = 1, INTERLEAVED_TO_SPLIT_HALF = 2 };
enum { F32 = 0, BF16 = 1, F16 = 2, F64 = 3 };
#define MAX_HALF 1024
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
/* fresh outputs from this size on are advised huge pages and written with streaming stores */
#define LARGE_OUTPUT_BYTES ((int64_t)4 << 20)
#ifndef HEAD_GROUP
/* heads walked side by side when tokens are inner, for 2-byte types (a bf16 data row is half a table row, so
 * sharing table rows pays; a float32 row is as large as a table row and one stream per head was faster).
 * Measured on Zen 4, in place prefill, x copy, interleaved runs: bf16 1: 0.77-0.82, 2: 0.74-0.78; fp32 1:
 * 0.67-0.77, 2: 0.79-0.83 (an earlier, quieter hour: fp32 1: 0.64-0.73, 2: 0.63-0.69; 3 and 4: 0.84-0.88) */
#define HEAD_GROUP 2
#endif

typedef struct {
    void *x, *out;             /* input and output (equal when in place) */
    int64_t B, H, T, D;        /* logical shape */
    int64_t xs[4], os[4];      /* element strides of x and out over (B, H, T, D) */
} Tensor4;

static inline float bf16_load(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_store(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;          /* NaN, as c10::BFloat16 */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  /* round to nearest even */
}


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
/* Split-half bf16 rows with AVX-512: the same operations as the scalar code (mul, mul, sub / add, no FMA;
 * round to nearest even by bit arithmetic, NaN -> 0x7fc0), 32 pairs per step, then 16, the last step
 * masked (no scalar tail). gcc's own vectorisation of the scalar loop spends most of its time on 16-bit
 * shuffles. */
#define POSENC_SIMD_BF16 1
static inline __m512 bf16x16_load(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline __m512 bf16x16_load_mask(const uint16_t *p, __mmask16 m) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline void bf16x16_store_mask(uint16_t *p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    /* one instruction rounds to nearest even, but flushes denormals and makes its own NaN: use it
     * only when no lane is NaN or denormal (then it equals the bit arithmetic below) */
    if (!_mm512_fpclass_ps_mask(v, 0xA1)) {
        _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#endif
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm512_mask_cvtepi32_storeu_epi16(p, m, r);
}
static inline void bf16x16_store(uint16_t *p, __m512 v) { bf16x16_store_mask(p, v, (__mmask16)0xffff); }
static inline int64_t split_half_bf16_simd(const uint16_t *x, uint16_t *o, const float *c, const float *s,
                                           int64_t half, int nt) {
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    for (; i + 32 <= half; i += 32) { /* 32 pairs: every load before any store (in place) */
        __m512 a0 = bf16x16_load(x + i), a1 = bf16x16_load(x + i + 16);
        __m512 b0 = bf16x16_load(x + i + half), b1 = bf16x16_load(x + i + half + 16);
        __m512 c0 = _mm512_loadu_ps(c + i), c1 = _mm512_loadu_ps(c + i + 16);
        __m512 s0 = _mm512_loadu_ps(s + i), s1 = _mm512_loadu_ps(s + i + 16);
        __m512 lo0 = _mm512_sub_ps(_mm512_mul_ps(a0, c0), _mm512_mul_ps(b0, s0));
        __m512 lo1 = _mm512_sub_ps(_mm512_mul_ps(a1, c1), _mm512_mul_ps(b1, s1));
        __m512 hi0 = _mm512_add_ps(_mm512_mul_ps(b0, c0), _mm512_mul_ps(a0, s0));
        __m512 hi1 = _mm512_add_ps(_mm512_mul_ps(b1, c1), _mm512_mul_ps(a1, s1));
        if (!(_mm512_fpclass_ps_mask(lo0, 0xA1) | _mm512_fpclass_ps_mask(lo1, 0xA1) |
              _mm512_fpclass_ps_mask(hi0, 0xA1) | _mm512_fpclass_ps_mask(hi1, 0xA1))) {
            /* no lane NaN or denormal: one instruction per 32 lanes rounds as the bit arithmetic below */
            __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(lo1, lo0), hi = (__m512i)_mm512_cvtne2ps_pbh(hi1, hi0);
            if (nt) { /* aligned, see stream_ok */
                _mm512_stream_si512((void *)(o + i), lo); _mm512_stream_si512((void *)(o + i + half), hi);
            } else {
                _mm512_storeu_si512((void *)(o + i), lo); _mm512_storeu_si512((void *)(o + i + half), hi);
            }
            continue;
        }
        bf16x16_store(o + i, lo0); bf16x16_store(o + i + 16, lo1); /* exact bit arithmetic, lane by lane */
        bf16x16_store(o + i + half, hi0); bf16x16_store(o + i + half + 16, hi1);
    }
#endif
    for (; i < half; i += 16) { /* 16 pairs, the last step masked (zero lanes are neither NaN nor denormal) */
        __mmask16 m = half - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - i)) - 1);
        __m512 a = bf16x16_load_mask(x + i, m), b = bf16x16_load_mask(x + i + half, m);
        __m512 ci = _mm512_maskz_loadu_ps(m, c + i), si = _mm512_maskz_loadu_ps(m, s + i);
        __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
        bf16x16_store_mask(o + i, lo, m);
        bf16x16_store_mask(o + i + half, hi, m);
    }
    return i;
}

/* Split-half float32 rows: 16 pairs per step, plain loads and stores, the last step masked (masked stores on
 * every step cost 10% at decode on Zen 4). */
#define POSENC_SIMD_F32 1
static inline int64_t split_half_f32_simd(const float *x, float *o, const float *c, const float *s, int64_t half,
                                          int nt) {
    int64_t i = 0;
    if (!nt)
        for (; i + 16 <= half; i += 16) { /* both halves loaded before either is stored (in place) */
            __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + half);
            __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
            _mm512_storeu_ps(o + i, _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si)));
            _mm512_storeu_ps(o + i + half, _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si)));
        }
    for (; i < half; i += 16) {
        __mmask16 m = half - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - i)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(m, x + i), b = _mm512_maskz_loadu_ps(m, x + i + half);
        __m512 ci = _mm512_maskz_loadu_ps(m, c + i), si = _mm512_maskz_loadu_ps(m, s + i);
        __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
        if (nt && m == (__mmask16)0xffff) { /* aligned, see stream_ok */
            _mm512_stream_ps(o + i, lo); _mm512_stream_ps(o + i + half, hi);
        } else {
            _mm512_mask_storeu_ps(o + i, m, lo); _mm512_mask_storeu_ps(o + i + half, m, hi);
        }
    }
    return half;
}

/* The heads of one token, split-half float32 rows of 64 pairs (head_dim 128, the common case): the token's
 * cos/sin row sits in 8 registers for all its heads. */
static void heads_f32_64(const float *x, float *o, int64_t xv, int64_t ov, int64_t nv, const float *c,
                         const float *s) {
    const __m512 c0 = _mm512_loadu_ps(c), c1 = _mm512_loadu_ps(c + 16), c2 = _mm512_loadu_ps(c + 32),
                 c3 = _mm512_loadu_ps(c + 48);
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16), s2 = _mm512_loadu_ps(s + 32),
                 s3 = _mm512_loadu_ps(s + 48);
#define POSENC_ROT16(i, ci, si)                                                                    \
    {                                                                                              \
        __m512 a = _mm512_loadu_ps(x + (i)), b = _mm512_loadu_ps(x + (i) + 64);                    \
        _mm512_storeu_ps(o + (i), _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si)));      \
        _mm512_storeu_ps(o + (i) + 64, _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si))); \
    }
    for (int64_t v = 0; v < nv; v++, x += xv, o += ov) {
        POSENC_ROT16(0, c0, s0) POSENC_ROT16(16, c1, s1) POSENC_ROT16(32, c2, s2) POSENC_ROT16(48, c3, s3)
    }
#undef POSENC_ROT16
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
/* 16 even and 16 odd float32 values rounded to bfloat16 (nearest even, NaN -> 0x7fc0, as bf16_store) and
 * interleaved: dword j = even[j] | odd[j] << 16. */
static inline __m512i bf16_pack_exact(__m512 even, __m512 odd) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), nan = _mm512_set1_epi32(0x7fc0);
    __m512i ue = _mm512_castps_si512(even), uo = _mm512_castps_si512(odd);
    __m512i re = _mm512_srli_epi32(_mm512_add_epi32(ue, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(ue, 16), one))), 16);
    __m512i ro = _mm512_srli_epi32(_mm512_add_epi32(uo, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(uo, 16), one))), 16);
    re = _mm512_mask_mov_epi32(re, _mm512_cmp_ps_mask(even, even, _CMP_UNORD_Q), nan);
    ro = _mm512_mask_mov_epi32(ro, _mm512_cmp_ps_mask(odd, odd, _CMP_UNORD_Q), nan);
    return _mm512_or_si512(re, _mm512_slli_epi32(ro, 16));
}

/* The heads of one token, split-half bfloat16 rows of 64 pairs. 32 bf16 channels load as 16 words, each word
 * the pair (2j, 2j+1) of neighbours: `word << 16` and `word & 0xffff0000` are their float32 values, so the
 * even and odd channels are rotated apart (no widening shuffles), with the token's cos/sin row split the same
 * way once, in 8 registers. The same operations, check and rounding as split_half_bf16_simd; one shuffle per
 * 32 outputs restores their order (kernel alone, decode, x copy: 1.60 -> 1.44). */
#define POSENC_HEADS_BF16 1
static void heads_bf16_64(const uint16_t *x, uint16_t *o, int64_t xv, int64_t ov, int64_t nv, const float *c,
                          const float *s) {
    static const int32_t EVEN_LANES[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const int16_t MERGE_WORDS[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i ev = _mm512_loadu_si512(EVEN_LANES), od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    const __m512i merge = _mm512_loadu_si512(MERGE_WORDS), high = _mm512_set1_epi32((int)0xffff0000u);
    /* pairs 0-31 (block 0) and 32-63 (block 1): the even and the odd pairs' cos and sin */
    const __m512 ce0 = _mm512_permutex2var_ps(_mm512_loadu_ps(c), ev, _mm512_loadu_ps(c + 16));
    const __m512 co0 = _mm512_permutex2var_ps(_mm512_loadu_ps(c), od, _mm512_loadu_ps(c + 16));
    const __m512 ce1 = _mm512_permutex2var_ps(_mm512_loadu_ps(c + 32), ev, _mm512_loadu_ps(c + 48));
    const __m512 co1 = _mm512_permutex2var_ps(_mm512_loadu_ps(c + 32), od, _mm512_loadu_ps(c + 48));
    const __m512 se0 = _mm512_permutex2var_ps(_mm512_loadu_ps(s), ev, _mm512_loadu_ps(s + 16));
    const __m512 so0 = _mm512_permutex2var_ps(_mm512_loadu_ps(s), od, _mm512_loadu_ps(s + 16));
    const __m512 se1 = _mm512_permutex2var_ps(_mm512_loadu_ps(s + 32), ev, _mm512_loadu_ps(s + 48));
    const __m512 so1 = _mm512_permutex2var_ps(_mm512_loadu_ps(s + 32), od, _mm512_loadu_ps(s + 48));
#define POSENC_EO32(i, ce, co, se, so)                                                                           \
    {                                                                                                            \
        const __m512i wa = _mm512_loadu_si512((const void *)(x + (i)));                                          \
        const __m512i wb = _mm512_loadu_si512((const void *)(x + (i) + 64));                                     \
        const __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(wa, 16));                                        \
        const __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(wa, high));                                       \
        const __m512 be = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));                                        \
        const __m512 bo = _mm512_castsi512_ps(_mm512_and_si512(wb, high));                                       \
        const __m512 loe = _mm512_sub_ps(_mm512_mul_ps(ae, ce), _mm512_mul_ps(be, se));                          \
        const __m512 loo = _mm512_sub_ps(_mm512_mul_ps(ao, co), _mm512_mul_ps(bo, so));                          \
        const __m512 hie = _mm512_add_ps(_mm512_mul_ps(be, ce), _mm512_mul_ps(ae, se));                          \
        const __m512 hio = _mm512_add_ps(_mm512_mul_ps(bo, co), _mm512_mul_ps(ao, so));                          \
        if (!(_mm512_fpclass_ps_mask(loe, 0xA1) | _mm512_fpclass_ps_mask(loo, 0xA1) |                          \
              _mm512_fpclass_ps_mask(hie, 0xA1) | _mm512_fpclass_ps_mask(hio, 0xA1))) {                        \
            /* no lane NaN or denormal: the one-instruction rounding equals the bit arithmetic */               \
            _mm512_storeu_si512((void *)(o + (i)), _mm512_permutexvar_epi16(merge, (__m512i)_mm512_cvtne2ps_pbh(loo, loe))); \
            _mm512_storeu_si512((void *)(o + (i) + 64), _mm512_permutexvar_epi16(merge, (__m512i)_mm512_cvtne2ps_pbh(hio, hie))); \
        } else {                                                                                                 \
            _mm512_storeu_si512((void *)(o + (i)), bf16_pack_exact(loe, loo));                                   \
            _mm512_storeu_si512((void *)(o + (i) + 64), bf16_pack_exact(hie, hio));                              \
        }                                                                                                        \
    }
    for (int64_t v = 0; v < nv; v++, x += xv, o += ov) { /* each head: both halves loaded before any store */
        POSENC_EO32(0, ce0, co0, se0, so0) POSENC_EO32(32, ce1, co1, se1, so1)
    }
#undef POSENC_EO32
}
#endif

/* Interleaved float32 rows: 16 pairs per step, split into a (even lanes) and b (odd lanes) by two shuffles,
 * rotated with the same operations, merged back by two more; the rest of the row is left to the scalar loop. */
static const int32_t EVEN[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
static const int32_t MERGE[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static inline int64_t interleaved_f32_simd(const float *x, float *o, const float *c, const float *s, int64_t half) {
    const __m512i even = _mm512_loadu_si512(EVEN), odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i merge0 = _mm512_loadu_si512(MERGE), merge1 = _mm512_loadu_si512(MERGE + 16);
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
        __m512 x0 = _mm512_loadu_ps(x + 2 * i), x1 = _mm512_loadu_ps(x + 2 * i + 16);
        __m512 a = _mm512_permutex2var_ps(x0, even, x1), b = _mm512_permutex2var_ps(x0, odd, x1);
        __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
        __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
        _mm512_storeu_ps(o + 2 * i, _mm512_permutex2var_ps(lo, merge0, hi));
        _mm512_storeu_ps(o + 2 * i + 16, _mm512_permutex2var_ps(lo, merge1, hi));
    }
    return i;
}

/* Interleaved bf16 rows: a pair is one 32-bit word, so a = word << 16 and b = word & 0xffff0000 are already
 * float32; 16 pairs per step, rounded by one cvtne2ps (then one shuffle re-interleaves) when no lane is NaN
 * or denormal; otherwise the scalar loop takes over from that step (exact bit arithmetic). */
static inline int64_t interleaved_bf16_simd(const uint16_t *x, uint16_t *o, const float *c, const float *s,
                                            int64_t half) {
    int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    static const int16_t MERGE16[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u), merge = _mm512_loadu_si512(MERGE16);
    for (; i + 16 <= half; i += 16) {
        __m512i w = _mm512_loadu_si512(x + 2 * i);
        __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), b = _mm512_castsi512_ps(_mm512_and_si512(w, high));
        __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
        __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
        if (_mm512_fpclass_ps_mask(lo, 0xA1) | _mm512_fpclass_ps_mask(hi, 0xA1)) break;
        __m512i r = (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* 16-bit lanes 0-15: lo, 16-31: hi */
        _mm512_storeu_si512((void *)(o + 2 * i), _mm512_permutexvar_epi16(merge, r));
    }
#else
    (void)x; (void)o; (void)c; (void)s; (void)half;
#endif
    return i;
}

#ifdef __FLT16_MAX__
/* float16 rows: the hardware conversions (vcvtph2ps is exact; vcvtps2ph with round to nearest even is the
 * conversion torch's vectorised float -> half uses), the same operations in float32 between them. Without
 * them the scalar `(_Float16)` conversions cost ~10x the copy floor at decode. */
#define POSENC_SIMD_F16 1
static inline __m512 f16x16_load_mask(const _Float16 *p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
static inline __m256i f16x16_round(__m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline int64_t split_half_f16_simd(const _Float16 *x, _Float16 *o, const float *c, const float *s,
                                          int64_t half, int nt) {
    (void)nt;
    for (int64_t i = 0; i < half; i += 16) { /* 16 pairs, the last step masked */
        __mmask16 m = half - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - i)) - 1);
        __m512 a = f16x16_load_mask(x + i, m), b = f16x16_load_mask(x + i + half, m);
        __m512 ci = _mm512_maskz_loadu_ps(m, c + i), si = _mm512_maskz_loadu_ps(m, s + i);
        __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
        _mm256_mask_storeu_epi16(o + i, m, f16x16_round(lo));
        _mm256_mask_storeu_epi16(o + i + half, m, f16x16_round(hi));
    }
    return half;
}
/* Interleaved float16 rows: a pair is one 32-bit word (a: its low half, b: its high half). */
static inline int64_t interleaved_f16_simd(const _Float16 *x, _Float16 *o, const float *c, const float *s,
                                           int64_t half) {
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
        __m512i w = _mm512_loadu_si512(x + 2 * i);
        __m512 a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)), b = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
        __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
        __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si));
        __m512i r = _mm512_or_si512(_mm512_cvtepu16_epi32(f16x16_round(lo)),
                                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(f16x16_round(hi)), 16));
        _mm512_storeu_si512((void *)(o + 2 * i), r);
    }
    return i;
}
#endif
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
 * to HEADS64, which keeps the token's table row in registers (kernel alone, one thread, Zen 4, x the copy floor:
 * float32 decode 0.79 -> 0.52, bfloat16 1.72 -> 1.48). */
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
static void NAME(const Tensor4 *t, const float *cos, const float *sin, const int64_t *rows, int64_t rows_b, \
                 int64_t half, int pairing, int64_t j0, int64_t j1) {                               \
    const int contiguous = t->xs[3] == 1 && t->os[3] == 1;                                          \
    const int fast = contiguous && pairing == SPLIT_HALF && HAS_FAST;                              \
    const int nt = fast && stream_ok(t, (int64_t)sizeof(ST), half);                                 \
    const int64_t pass = t->x != t->out ? t->D - 2 * half : 0; /* pass-through channels to copy */   \
    const int heads_inner = t->T == 1 || t->xs[1] < t->xs[2]; /* bthd-like: heads adjacent in memory */ \
    const int64_t nu = heads_inner ? t->T : t->H, nv = heads_inner ? t->H : t->T;                   \
    const int64_t xu = heads_inner ? t->xs[2] : t->xs[1], xv = heads_inner ? t->xs[1] : t->xs[2];   \
    const int64_t ou = heads_inner ? t->os[2] : t->os[1], ov = heads_inner ? t->os[1] : t->os[2];   \
    const int64_t row_bytes = t->D * (int64_t)sizeof(ST), pf = PREFETCH_BYTES / row_bytes + 1;       \
    /* a tensor that fits in L2 (a decode step's q or k, just written) is not prefetched: fp32 decode 0.98 -> 0.90x copy */ \
    const int prefetch = t->B * t->H * t->T * row_bytes >= PREFETCH_MIN_BYTES;                      \
    /* tokens inner (bhtd): 2-byte types walk HEAD_GROUP heads' token streams side by side (one table row each) */ \
    const int64_t group = sizeof(ST) == 2 ? HEAD_GROUP : 1;                                         \
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
int posenc_has_f16(void) { return 1; }
#else
int posenc_has_f16(void) { return 0; }
#endif

int posenc_has_f16(void);


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

/* Units of work of one tensor (see DEFINE_TILE): a token with all its heads (heads inner) or a group of
 * heads with all their tokens (tokens inner); units are what threads split. */
static int64_t tile_units(const Tensor4 *t, int64_t elem) {
    const int heads_inner = t->T == 1 || t->xs[1] < t->xs[2];
    const int64_t group = elem == 2 ? HEAD_GROUP : 1;
    if (t->H == 0 || t->T == 0) return 0;
    return t->B * (heads_inner ? t->T : (t->H + group - 1) / group);
}

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
#ifdef POSENC_SIMD_F32
    _mm_sfence(); /* order this thread's streaming stores before the caller reads the outputs */
#endif
    return 0;
}

#define MAX_THREADS 256
#ifndef MIN_BYTES_PER_THREAD
/* below this much data per thread, waking a worker costs more than it saves (a spinning worker answers in
 * well under a microsecond, a sleeping one in 5-50 us) */
#define MIN_BYTES_PER_THREAD ((int64_t)128 << 10)
#endif
#ifndef POOL_SPIN_NS
/* how long a worker (and a caller waiting for its workers) spins before sleeping: back-to-back calls (a
 * decode step's layers) find it awake; an idle process has no thread spinning after this long */
#define POOL_SPIN_NS 100000
#endif

/* ---- the worker pool ----------------------------------------------------------------------------------------
 * A process-wide resource of the library, as OpenMP's pool is for torch: workers are started on the first
 * call that wants them (never more than the largest thread count asked for, minus the calling thread), then
 * wait for work, spinning POOL_SPIN_NS after each job and sleeping on a condition variable after that. A call
 * cuts its work into PARTS_PER_THREAD parts per thread, publishes them, and claims parts itself like any
 * worker: a worker that wakes late finds fewer parts (or none) left, so a call never waits for a sleeping
 * thread, only for parts already being rotated. Each call uses at most its own `threads` (the caller passes
 * torch.get_num_threads()). One call uses the pool at a time: a call that finds it busy (another Python thread,
 * as ctypes releases the GIL) runs on its own thread, with the same results (each element is computed the same
 * way whichever thread computes it). A forked child starts with no workers (pthread_atfork resets the pool). */
#define PARTS_PER_THREAD 4
#define MAX_PARTS (MAX_THREADS * PARTS_PER_THREAD)
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
    int started, forks_handled;
    Work part[MAX_PARTS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, {{0}}};

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

/* Claim and rotate parts of job `gen` until none is left; returns how many this thread rotated. */
static int64_t take_parts(unsigned long long gen) {
    int64_t mine = 0;
    for (;;) {
        unsigned long long v = atomic_load(&pool.next);
        if (v >> 32 != gen || (int64_t)(v & 0xffffffffu) >= pool.parts) return mine;
        if (!atomic_compare_exchange_weak(&pool.next, &v, v + 1)) continue;
        work(&pool.part[v & 0xffffffffu]); /* the part cannot change before `done` counts it */
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
}

/* Start workers until `want` run (fewer when a thread cannot start). Called with pool.callers held. */
static void pool_grow(int want) {
    if (!pool.forks_handled) pool.forks_handled = pthread_atfork(0, 0, pool_after_fork) == 0;
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

/* Cut units [0, all.units[0] + all.units[1]) into `parts` parts of about equal bytes (under GQA a unit of q is
 * larger than one of k), into out[]. */
static void split(const Work *all, const int64_t bytes_per_unit[2], int64_t parts, Work *out) {
    const int64_t q_bytes = all->units[0] * bytes_per_unit[0], total = q_bytes + all->units[1] * bytes_per_unit[1];
    int64_t prev = 0;
    for (int64_t i = 0; i < parts; i++) {
        const int64_t cut = total / parts * (i + 1);
        int64_t end = cut < q_bytes ? cut / bytes_per_unit[0]
                                    : all->units[0] + (bytes_per_unit[1] ? (cut - q_bytes) / bytes_per_unit[1] : 0);
        if (i + 1 == parts) end = all->units[0] + all->units[1];
        out[i] = *all;
        out[i].begin = prev;
        out[i].end = end;
        prev = end;
    }
}

/* Rotate `all` on up to n threads: the calling thread and n - 1 pool workers. */
static void run(const Work *all, const int64_t bytes_per_unit[2], int64_t n) {
    const int64_t units = all->units[0] + all->units[1];
    if (n == 1 || pthread_mutex_trylock(&pool.callers)) {
        Work one = *all;
        one.begin = 0;
        one.end = units;
        work(&one);
        return;
    }
    pool_grow((int)n - 1);
    const int64_t parts = n * PARTS_PER_THREAD < units ? n * PARTS_PER_THREAD : units;
    split(all, bytes_per_unit, parts, pool.part);
    pool.parts = parts;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.workers_wanted, (int)n - 1);
    pthread_mutex_lock(&pool.mu);
    const unsigned long long gen = (atomic_load(&pool.next) >> 32) + 1;
    atomic_store(&pool.next, gen << 32); /* publishes the job: part 0 is next */
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    take_parts(gen);
    const int64_t end = now_ns() + POOL_SPIN_NS;
    for (int i = 0; atomic_load(&pool.done) < parts; i++) { /* only parts being rotated are left */
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

int64_t posenc_pool_workers(void) { return pool.started; } /* workers started so far (tests, docs) */

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

/* Rotate q and (if a->k) k. Returns 0 when done; nothing is written otherwise:
 * < 0: the most negative row found (a negative position); > 0: the table length the rows need;
 * BAD_ARGUMENTS (-2**62): arguments the kernel cannot take (a row wider than its buffers, an unknown dtype);
 * OVERLAP (-2**62 + 1): with FLAG_CHECK_OVERLAP, q and k may share memory. */
int64_t posenc_rope(const RopeArgs *a) {
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
    Tensor4 q = {a->q, a->q_out, a->batch, a->q_heads, a->tokens, a->head_dim, {0}, {0}};
    Tensor4 k = {a->k, a->k_out, a->batch, a->k_heads, a->tokens, a->head_dim, {0}, {0}};
    memcpy(q.xs, a->q_strides, sizeof q.xs); memcpy(q.os, a->q_out_strides, sizeof q.os);
    memcpy(k.xs, a->k_strides, sizeof k.xs); memcpy(k.os, a->k_out_strides, sizeof k.os);
    if ((a->flags & FLAG_CHECK_OVERLAP) && a->k && may_overlap(&q, &k, elem)) return OVERLAP;
    Work all = {a, {&q, a->k ? &k : 0}, {tile_units(&q, elem), a->k ? tile_units(&k, elem) : 0}, 0, 0};
    if (all.units[0] + all.units[1] == 0) return 0;
    const int64_t bytes_per_unit[2] = {all.units[0] ? a->batch * a->q_heads * a->tokens * a->head_dim * elem / all.units[0] : 0,
                                       all.units[1] ? a->batch * a->k_heads * a->tokens * a->head_dim * elem / all.units[1] : 0};
    const int64_t total = all.units[0] * bytes_per_unit[0] + all.units[1] * bytes_per_unit[1];
    int64_t n = a->threads < 1 ? 1 : a->threads > MAX_THREADS ? MAX_THREADS : a->threads;
    if (n > total / MIN_BYTES_PER_THREAD) n = total / MIN_BYTES_PER_THREAD > 1 ? total / MIN_BYTES_PER_THREAD : 1;
    if (n > all.units[0] + all.units[1]) n = all.units[0] + all.units[1];
    if (a->flags & FLAG_HUGE_PAGES) {
        advise_output(&q, elem);
        if (a->k) advise_output(&k, elem);
    }
    run(&all, bytes_per_unit, n);
    return 0;
}

/* ---- build key (posenc.kernels.build) ---------------------------------------------------------------------
 * Which source, flags and CPU this library was built for, baked in with -DPOSENC_BUILD_KEY="..."; build.py
 * loads an install-time build only when this matches its own key (-march=native makes the code CPU-specific). */
#ifndef POSENC_BUILD_KEY
#define POSENC_BUILD_KEY ""
#endif
const char *posenc_build_key(void) { return POSENC_BUILD_KEY; }
