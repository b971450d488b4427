// The projection micro-kernels, shared by the projections (gemm.cpp) and the flash attention kernel
// (attention.cpp, which runs its score and value products through them).
#pragma once

#include "common.h"

// ---- projections: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W prepacked into panels of 16 output features,
// k-major inside a panel: wp[(p * K + k) * 16 + j] = W[16p + j, k] (zero rows past N). A 6 x 16 tile of y lives in
// 12 vector registers while the panel streams through once per tile (from memory for the first row tile, from L2
// after), so each weight read from memory serves every row of the step: decode steps (a few to a few dozen rows)
// are bound by streaming the weights, where general GEMM libraries spend their time packing and blocking. It
// also stays ahead of MKL on 2,048-row prefill chunks (x re-read from L3 per panel costs less than MKL's packing).
// With 2-16 row tiles, the tiles of a panel also prefetch the next panel, one line every `every` k steps (spread so
// the whole next panel arrives over the current panel's tiles): the weight stream then overlaps the compute instead
// of stalling each panel's first tile (measured on Zen3, 2 threads, all layers + LM head: 16 rows 36.9 -> 27.8 ms,
// 32 rows 58.3 -> 50.0 ms; a single tile gains nothing from it, and from ~100 rows the stream is amortized anyway).
#ifdef FLOWRT_AVX2
template <int MR, bool PF>
static inline void gemm_tile(const float* x, int64_t xs, int K, const float* w, const float* bias, float* y,
                             int64_t ys, int nvalid, const float* pf, int every) {
    __m256 c0[MR], c1[MR];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) { c0[r] = b0; c1[r] = b1; }
    int cnt = 0;
    for (int k = 0; k < K; ++k, w += 16) {
        if constexpr (PF) {
            if (++cnt == every) {
                cnt = 0;
                _mm_prefetch((const char*)pf, _MM_HINT_T0);
                pf += 16;
            }
        }
        const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * xs + k);
            c0[r] = _mm256_fmadd_ps(a, w0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, w1, c1[r]);
        }
    }
    // stores through a row buffer so the accumulators never have their address taken (they stay in registers)
    alignas(32) float t[MR][16];
    float* dst = nvalid == 16 ? nullptr : &t[0][0];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        float* yr = dst ? dst + r * 16 : y + r * ys;
        _mm256_storeu_ps(yr, c0[r]);
        _mm256_storeu_ps(yr + 8, c1[r]);
    }
    if (dst)
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < nvalid; ++j) y[r * ys + j] = t[r][j];
}

// gemm_tile for a run-time row count (1-6).
template <bool PF>
static inline void gemm_rows(int rows, const float* x, int64_t xs, int K, const float* w, const float* bias, float* y,
                             int64_t ys, int nvalid, const float* pf, int every) {
    switch (rows) {
        case 6: gemm_tile<6, PF>(x, xs, K, w, bias, y, ys, nvalid, pf, every); break;
        case 5: gemm_tile<5, PF>(x, xs, K, w, bias, y, ys, nvalid, pf, every); break;
        case 4: gemm_tile<4, PF>(x, xs, K, w, bias, y, ys, nvalid, pf, every); break;
        case 3: gemm_tile<3, PF>(x, xs, K, w, bias, y, ys, nvalid, pf, every); break;
        case 2: gemm_tile<2, PF>(x, xs, K, w, bias, y, ys, nvalid, pf, every); break;
        default: gemm_tile<1, PF>(x, xs, K, w, bias, y, ys, nvalid, pf, every); break;
    }
}
#endif

#ifdef FLOWRT_AVX2
// y[M, 16 * panels] (row stride ys; the last panel writes its first `last` columns) = x[M, K] (row stride xs) @ the
// packed panels wp (K * 16 floats each), panel by panel so each panel stays in L1 while every row tile uses it.
static inline void gemm_small(const float* x, int64_t xs, int M, int K, const float* wp, int panels, int last, float* y,
                       int64_t ys) {
    for (int p = 0; p < panels; ++p)
        for (int r = 0; r < M; r += 6)
            gemm_rows<false>(std::min(6, M - r), x + r * xs, xs, K, wp + (int64_t)p * K * 16, nullptr,
                             y + r * ys + p * 16, ys, p == panels - 1 ? last : 16, nullptr, 0);
}
#endif
