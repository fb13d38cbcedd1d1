/* rope_heads.h: the heads of one token with head_dim 128 (64 split-half pairs), for rope_tile.c (its only
 * includer, after rope_simd.h): a decode step's rows, walked with the token's cos/sin row held in registers.
 *
 * - heads_f32_64: float32 rows.
 * - heads_bf16_64 (AVX-512 BF16): bfloat16 rows. Each output needs the reference's two float32 multiplies
 *   and one add or subtract (unfused), then one rounding to bfloat16. `vcvtne2ps2bf16` rounds 32 lanes in one
 *   instruction, but flushes denormal results to zero and keeps a NaN's payload, where the reference
 *   (c10::BFloat16) rounds denormals and makes every NaN 0x7fc0: a step may use it only when no result is NaN
 *   or denormal. Two ways to know that, both exact:
 *   - by the results (any AVX-512 BF16 core): `vfpclassps` on the four result vectors of each step;
 *   - by the inputs (with AVX-512 BITALG, when the token's table row allows it): every input of the head has
 *     exponent field in [64, 192), i.e. magnitude in [2^-63, 2^65), finite and not zero, and every cos and
 *     sin of the row has magnitude in [2^-31, 2) (bf16_row_in_range; position 0's zero sines do not). Then
 *     each product has magnitude in [2^-94, 2^66): a multiple of 2^-117 (its ulp is at least 2^(-94-23)), so
 *     their sum or difference is 0 or at least 2^-117, a normal float, and below 2^67: finite. No NaN, no
 *     denormal: the one-instruction rounding equals the reference's. The test costs one `vpshufbitqmb` per 32
 *     inputs (the two top exponent bits of each gathered into a mask) and a few scalar operations, off the
 *     vector pipes the multiplies need: out of place ~7-9% faster than the test by the results (in place on
 *     par; docs/performance.md, "Allocating decode against the clone floor").
 *   A head that fails the input test is rounded by bit arithmetic (bf16_pack_exact), so every input is exact;
 *   zeros, tiny or huge inputs and NaN only cost their head its speed.
 */
#ifndef POSENC_ROPE_HEADS_H
#define POSENC_ROPE_HEADS_H

#include <stdint.h>

#include "rope_simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
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

#ifdef __AVX512BITALG__
/* Whether the 8 registers holding a token's cos and sin (64 each, in any order) are all of magnitude in
 * [2^-31, 2): float32 exponent field in [96, 128), i.e. bits 30-28 of each are 011 (zero, NaN, inf: no). */
static inline int bf16_row_in_range(__m512 r0, __m512 r1, __m512 r2, __m512 r3, __m512 r4, __m512 r5, __m512 r6,
                                    __m512 r7) {
    const __m512i v0 = _mm512_castps_si512(r0), v1 = _mm512_castps_si512(r1), v2 = _mm512_castps_si512(r2),
                  v3 = _mm512_castps_si512(r3), v4 = _mm512_castps_si512(r4), v5 = _mm512_castps_si512(r5),
                  v6 = _mm512_castps_si512(r6), v7 = _mm512_castps_si512(r7);
    /* all: the bits set in every value; any: the bits set in some value (0x80: a & b & c, 0xfe: a | b | c) */
    const __m512i all = _mm512_and_si512(_mm512_ternarylogic_epi32(v0, v1, v2, 0x80),
                                         _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(v3, v4, v5, 0x80), v6, v7, 0x80));
    const __m512i any = _mm512_or_si512(_mm512_ternarylogic_epi32(v0, v1, v2, 0xfe),
                                        _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(v3, v4, v5, 0xfe), v6, v7, 0xfe));
    const __m512i bit30 = _mm512_set1_epi32(0x40000000), bits29_28 = _mm512_set1_epi32(0x30000000);
    return !_mm512_test_epi32_mask(any, bit30) && !_mm512_test_epi32_mask(_mm512_andnot_si512(all, bits29_28), bits29_28);
}
/* Whether every bfloat16 of a head (128 channels at x) has exponent field in [64, 192): its two top bits
 * differ. `top2` (POSENC_TOP2 in every 64-bit lane) picks, for each 64-bit group of 4 words, bit 14 of each word
 * into the low nibble of a mask byte and bit 13 into its high nibble. */
#define POSENC_TOP2 0x3d2d1d0d3e2e1e0eLL
static inline int bf16_head_in_range(const uint16_t *x, __m512i top2) {
    const uint64_t m0 = (uint64_t)_mm512_bitshuffle_epi64_mask(_mm512_loadu_si512((const void *)x), top2);
    const uint64_t m1 = (uint64_t)_mm512_bitshuffle_epi64_mask(_mm512_loadu_si512((const void *)(x + 32)), top2);
    const uint64_t m2 = (uint64_t)_mm512_bitshuffle_epi64_mask(_mm512_loadu_si512((const void *)(x + 64)), top2);
    const uint64_t m3 = (uint64_t)_mm512_bitshuffle_epi64_mask(_mm512_loadu_si512((const void *)(x + 96)), top2);
    const uint64_t nibbles = 0x0f0f0f0f0f0f0f0fULL;
    return ((m0 ^ (m0 >> 4)) & (m1 ^ (m1 >> 4)) & (m2 ^ (m2 >> 4)) & (m3 ^ (m3 >> 4)) & nibbles) == nibbles;
}
#define POSENC_BF16_BY_INPUT 1
#endif

/* The heads of one token, split-half bfloat16 rows of 64 pairs. 32 bf16 channels load as 16 words, each word
 * the pair (2j, 2j+1) of neighbours: `word << 16` and `word & 0xffff0000` are their float32 values, so the
 * even and odd channels are rotated apart (no widening shuffles), with the token's cos/sin row split the same
 * way once, in 8 registers. One shuffle per 32 outputs restores their order. Each step rounds in one instruction
 * when FAST: the head's inputs are in range (its row passed bf16_row_in_range), else when no result is NaN or
 * denormal (see the top of this file); otherwise by bit arithmetic. */
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
#define POSENC_EO32(i, ce, co, se, so, FAST)                                                                 \
    {                                                                                                            \
        const __m512i wa = _mm512_loadu_si512((const void *)(x + (i)));                                         \
        const __m512i wb = _mm512_loadu_si512((const void *)(x + (i) + 64));                                    \
        const __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(wa, 16));                                        \
        const __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(wa, high));                                       \
        const __m512 be = _mm512_castsi512_ps(_mm512_slli_epi32(wb, 16));                                        \
        const __m512 bo = _mm512_castsi512_ps(_mm512_and_si512(wb, high));                                       \
        const __m512 loe = _mm512_sub_ps(_mm512_mul_ps(ae, ce), _mm512_mul_ps(be, se));                          \
        const __m512 loo = _mm512_sub_ps(_mm512_mul_ps(ao, co), _mm512_mul_ps(bo, so));                          \
        const __m512 hie = _mm512_add_ps(_mm512_mul_ps(be, ce), _mm512_mul_ps(ae, se));                          \
        const __m512 hio = _mm512_add_ps(_mm512_mul_ps(bo, co), _mm512_mul_ps(ao, so));                          \
        if (FAST) {                                                                                              \
            /* no lane NaN or denormal: the one-instruction rounding equals the bit arithmetic */               \
            _mm512_storeu_si512((void *)(o + (i)), _mm512_permutexvar_epi16(merge, (__m512i)_mm512_cvtne2ps_pbh(loo, loe))); \
            _mm512_storeu_si512((void *)(o + (i) + 64), _mm512_permutexvar_epi16(merge, (__m512i)_mm512_cvtne2ps_pbh(hio, hie))); \
        } else {                                                                                                 \
            _mm512_storeu_si512((void *)(o + (i)), bf16_pack_exact(loe, loo));                                   \
            _mm512_storeu_si512((void *)(o + (i) + 64), bf16_pack_exact(hie, hio));                              \
        }                                                                                                        \
    }
/* by the results: no lane of the step's four result vectors NaN or denormal */
#define POSENC_BY_RESULTS                                                                                        \
    !(_mm512_fpclass_ps_mask(loe, 0xA1) | _mm512_fpclass_ps_mask(loo, 0xA1) | _mm512_fpclass_ps_mask(hie, 0xA1) | \
      _mm512_fpclass_ps_mask(hio, 0xA1))
#ifdef POSENC_BF16_BY_INPUT
    if (bf16_row_in_range(ce0, co0, ce1, co1, se0, so0, se1, so1)) {
        const __m512i top2 = _mm512_set1_epi64(POSENC_TOP2);
        for (int64_t v = 0; v < nv; v++, x += xv, o += ov) { /* each head: every input tested before any store */
            const int in_range = bf16_head_in_range(x, top2);
            POSENC_EO32(0, ce0, co0, se0, so0, in_range) POSENC_EO32(32, ce1, co1, se1, so1, in_range)
        }
        return;
    }
#endif
    for (int64_t v = 0; v < nv; v++, x += xv, o += ov) {
        POSENC_EO32(0, ce0, co0, se0, so0, POSENC_BY_RESULTS) POSENC_EO32(32, ce1, co1, se1, so1, POSENC_BY_RESULTS)
    }
#undef POSENC_BY_RESULTS
#undef POSENC_EO32
}
#endif
#endif

#endif /* POSENC_ROPE_HEADS_H */
