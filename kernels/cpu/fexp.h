// The exps of the kernels, for x <= ~0 (softmax numerators, SiLU): Cephes' single-precision range reduction and
// polynomial (~1e-7 relative error), written once. fexp_lanes runs it on any lane type (float, AVX2's __m256,
// AVX-512's __m512) with plain operators, so fexp, fexp8 and fexp16 run the same operations in the same order (the
// build keeps multiplies and adds unfused) and agree bit for bit; each lane type brings its clamp, floor and
// times-two-to-the-n below. Two AVX-512 callers that need no bit match with fexp take the fused form
// (exp16_fused_poly).
// Included by common.h.
#pragma once

// the polynomial's coefficients, highest order first
static constexpr float FEXP_POLY[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                       4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

static inline float clamp_lanes(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }
static inline float floor_lanes(float x) { return std::floor(x); }
static inline float times_pow2(float p, float n) {
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

#ifdef FLOWRT_AVX2
static inline __m256 clamp_lanes(__m256 x, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
static inline __m256 floor_lanes(__m256 x) { return _mm256_floor_ps(x); }
static inline __m256 times_pow2(__m256 p, __m256 n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#ifdef __AVX512F__
static inline __m512 clamp_lanes(__m512 x, float lo, float hi) {
    return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}
static inline __m512 floor_lanes(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
// vscalefps multiplies by the same power of two (n is in [-126, 127] after the clamp, a normal float) with the same
// rounding as the multiply by its bits, in one instruction instead of four
static inline __m512 times_pow2(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
#endif

template <typename V>
static inline V fexp_lanes(V x) {
    x = clamp_lanes(x, -87.3f, 88.3f);
    const V n = floor_lanes(x * 1.44269504088896341f + 0.5f);
    V r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    V p = r * FEXP_POLY[0] + FEXP_POLY[1];
    #pragma GCC unroll 4
    for (int i = 2; i < 6; ++i) p = p * r + FEXP_POLY[i];
    p = p * r * r + r + 1.0f;
    return times_pow2(p, n);
}

// (the scalar form vectorizes in loops calling it)
static inline float fexp(float x) { return fexp_lanes(x); }

#ifdef FLOWRT_AVX2
// written out because GCC's vectorized fexp ran at ~10 cycles an element
static inline __m256 fexp8(__m256 x) { return fexp_lanes(x); }
#endif

#ifdef __AVX512F__
static inline __m512 fexp16(__m512 x) { return fexp_lanes(x); }

// exp(x) on sixteen lanes with fused multiply-adds, given the power of two n: fexp's reduction x - n ln2 and its
// polynomial from coefficient FIRST on (FIRST = 0: all of it).
template <int FIRST>
__attribute__((always_inline)) static inline __m512 exp16_fused_poly(__m512 x, __m512 n) {
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(FEXP_POLY[FIRST]), r, _mm512_set1_ps(FEXP_POLY[FIRST + 1]));
    #pragma GCC unroll 4
    for (int i = FIRST + 2; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(FEXP_POLY[i]));
    return _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
}

// The softmax numerators of the AVX-512 flash and decode kernels (attention.cpp): the whole polynomial, n rounded to
// nearest, the power of two applied by scalef (~1e-7 relative error, as fexp; not bit-identical to it). Lanes outside
// `keep` are 0 (whatever x holds there: no upper clamp is needed for the lanes kept).
__attribute__((always_inline)) static inline __m512 exp16(__m512 x, __mmask16 keep = 0xffff) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(keep, exp16_fused_poly<0>(x, n), n);
}

// exp for the SiLU of a bf16 gate (norm_rope_act.cpp): fexp16's clamp and floor with fused multiply-adds and without
// the polynomial's two highest-order terms (relative error ~3e-6 instead of ~1e-7), 1.4x faster silu_mul. The SiLU
// is rounded to bf16, and for every one of the 65,536 bf16 gate values it rounds exactly as with fexp16 (the same
// bits: tests/engine/test_cpu_ops.py checks them all against the scalar path's operations; one more term dropped and
// three gates round differently).
static inline __m512 fexp16_bf16_silu(__m512 x) {
    x = clamp_lanes(x, -87.3f, 88.3f);
    const __m512 n = floor_lanes(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
    return times_pow2(exp16_fused_poly<2>(x, n), n);
}
#endif
