/* rope_simd.h: the row routines of the CPU RoPE kernel, for rope_tile.c (its only includer).
 *
 * - bf16_load / bf16_store: the scalar bfloat16 conversions (exact widening; round to nearest even, NaN ->
 *   0x7fc0, as c10::BFloat16), the rounding every vector routine below must reproduce bit for bit.
 * - With AVX-512 (F, BW, VL): split-half and interleaved rows of float32, bfloat16 and float16, each defining
 *   POSENC_SIMD_* so that rope_tile.c picks it (the heads of one token, a decode step's rows: rope_heads.h).
 *   Without AVX-512 none is defined and rope_tile.c's scalar loops run alone.
 *
 * Every routine uses the scalar loop's operations (fp32 mul, mul, sub / add, no FMA: -ffp-contract=off) and
 * rounds once to the storage dtype, so results are bit-identical to the reference (posenc/rope/apply.py).
 * Why each routine is shaped as it is, with the measurements: docs/performance.md, "The CPU kernel".
 */
#ifndef POSENC_ROPE_SIMD_H
#define POSENC_ROPE_SIMD_H

#include <stdint.h>
#include <string.h>

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
 * every step were slower at decode). */
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
 * conversion torch's vectorised float -> half uses), the same operations in float32 between them, in place
 * of the much slower scalar `(_Float16)` conversions. */
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

#endif /* POSENC_ROPE_SIMD_H */
