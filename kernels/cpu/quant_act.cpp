// Activations of the quantized projections: each row quantized in blocks of 32 to int16 with one float32 scale,
// d = amax / 32767, q = round-half-away(x * (1 / d)) (engine/quant/reference.py's numbers, bit for bit), and per block
// the scaled sums of its two halves s0 = d * sum(q[0..15]), s1 = d * sum(q[16..31]), row r's as sx[r][h][block] (the
// products, quant_gemm.cpp, multiply eight blocks' sums by their minimums in one vector operation).
#include "flowrt_cpu.h"
#include "common.h"

namespace {

// One block of 32: q, *d, the halves' sums at sx[0] and sx[nb] (sx nullable).
template <typename T>
void quant_block(const T* x, int16_t* q, float* d, float* sx, int64_t nb) {
#ifdef FLOWRT_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = load8(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float dd = _mm_cvtss_f32(m4) / 32767.0f;
    const __m256 id = _mm256_set1_ps(dd > 0 ? 1.0f / dd : 0.0f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
        const __m256 s = _mm256_mul_ps(v[i], id);
        const __m256 r = _mm256_floor_ps(_mm256_add_ps(_mm256_andnot_ps(sign, s), _mm256_set1_ps(0.5f)));
        qi[i] = _mm256_cvtps_epi32(_mm256_or_ps(r, _mm256_and_ps(s, sign)));
    }
    // int32 x 32 -> int16 x 32 (the packs work per 128-bit lane; the permutes restore the order)
    const __m256i w0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8);
    const __m256i w1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), w0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), w1);
    *d = dd;
    if (sx) {
        const __m256i h0 = _mm256_add_epi32(qi[0], qi[1]), h1 = _mm256_add_epi32(qi[2], qi[3]);
        alignas(32) int32_t t0[8], t1[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t0), h0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(t1), h1);
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 8; ++i) { s0 += t0[i]; s1 += t1[i]; }
        sx[0] = dd * (float)s0;
        sx[nb] = dd * (float)s1;
    }
#else
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(to_f32(x[i])));
    const float dd = amax / 32767.0f;
    const float id = dd > 0 ? 1.0f / dd : 0.0f;
    int s[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
        const float v = to_f32(x[i]) * id;
        const float r = std::floor(std::fabs(v) + 0.5f);
        q[i] = (int16_t)(v < 0 ? -r : r);
        s[i >> 4] += q[i];
    }
    *d = dd;
    if (sx) {
        sx[0] = dd * (float)s[0];
        sx[nb] = dd * (float)s[1];
    }
#endif
}

template <typename T>
void quant_rows(const T* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx) {
    const int64_t nb = K / 32;
    #pragma omp parallel for schedule(static) if (M * K >= (1 << 16)) num_threads(flowrt_threads)
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < nb; ++b)
            quant_block(x + r * x_st + 32 * b, q + r * K + 32 * b, d + r * nb + b, sx ? sx + r * 2 * nb + b : nullptr,
                        nb);
}

}  // namespace

extern "C" {

int quant_act_f32(const float* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx) {
    if (K % 32) return -2;
    quant_rows(x, x_st, M, K, q, d, sx);
    return 0;
}

int quant_act_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx) {
    if (K % 32) return -2;
    quant_rows(x, x_st, M, K, q, d, sx);
    return 0;
}

}  // extern "C"
