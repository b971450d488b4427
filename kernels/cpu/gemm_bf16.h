// The bfloat16 projection micro-kernel (AVX512-BF16 only): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in and
// out, float32 accumulation, rounded to nearest even once at the end (as oneDNN and torch round).
// vdpbf16ps multiplies pairs of bf16 and adds both products into one float32 lane, so W is prepacked as pairs of k
// in panels of 32 output features: wp[((p * K2 + kk) * 32 + j) * 2 + e] = W[32p + j, 2kk + e] (K2 = ceil(K/2);
// zero past N and past K), 128 bytes (two vectors) per k pair and panel. A tile of MR rows x NP panels keeps its
// MR x 2NP float32 accumulators in registers; each k pair loads the 2NP weight vectors once and broadcasts each row's
// (x[2kk], x[2kk+1]) as one 32-bit lane. Few rows take several panels at once (1 row x 4 panels: 8 independent
// accumulator chains, enough to cover vdpbf16ps' latency while the weights stream), more rows take fewer.
#pragma once

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLOWRT_GEMM_BF16 1

// One k pair of a tile: the 2NP weight vectors at w + kw (panels pst apart) against each row's pair a(r) (two bf16
// as one 32-bit word).
template <int MR, int NP, typename A>
__attribute__((always_inline)) static inline void gemm_bf16_kpair(__m512 (&c)[MR][2 * NP], const bf16_t* w, int64_t pst,
                                                                  int64_t kw, A a) {
    __m512bh b[2 * NP];
    #pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
        b[2 * p] = (__m512bh)_mm512_load_si512(w + p * pst + kw);
        b[2 * p + 1] = (__m512bh)_mm512_load_si512(w + p * pst + kw + 32);
    }
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(a(r));
        #pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], x, b[v]);
    }
}

template <int MR, int NP>
static void gemm_bf16_tile(const bf16_t* x, int64_t xs, int64_t K, const bf16_t* w, int64_t pst, const float* bias,
                           bf16_t* y, int64_t ys, int ncols) {
    __m512 c[MR][2 * NP];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; ++v) c[r][v] = _mm512_setzero_ps();
    const int64_t K2 = K / 2;
    for (int64_t kk = 0; kk < K2; ++kk)
        gemm_bf16_kpair<MR, NP>(c, w, pst, kk * 64, [&](int r) {
            int32_t pair;
            std::memcpy(&pair, x + r * xs + 2 * kk, 4);
            return pair;
        });
    // the last k alone: its pair's second half is zero in x too (never read past the row)
    if (K & 1) gemm_bf16_kpair<MR, NP>(c, w, pst, K2 * 64, [&](int r) { return (int32_t)x[r * xs + K - 1]; });
    #pragma GCC unroll 8
    for (int v = 0; v < 2 * NP; ++v) {
        const int n = std::min(16, ncols - 16 * v);
        if (n <= 0) break;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * v) : _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const __m256bh o = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(c[r][v], bv) : c[r][v]);
            _mm256_mask_storeu_epi16(y + r * ys + 16 * v, m, (__m256i)o);
        }
    }
}
#endif
