// Weight prepacking shared by the float32 (gemm.cpp) and bf16 (gemm_bf16.cpp) projections: W [N, K] row-major (row
// stride w_st) -> ceil(N / NW) panels of NW output features, k-major inside a panel with KP consecutive k side by
// side (the bf16 kernel's pairs): wp[((p * Kp / KP + k / KP) * NW + j) * KP + k % KP] = W[NW p + j, k], Kp = K
// rounded up to a multiple of KP, zero past N and past K. Once per weight at load: not a hot path.
#pragma once

#include "common.h"

template <int NW, int KP, typename T>
static inline void pack_panels(const T* w, int64_t w_st, int64_t N, int64_t K, T* wp) {
    const int64_t P = (N + NW - 1) / NW, Kp = (K + KP - 1) / KP * KP;
    #pragma omp parallel for schedule(static) num_threads(flowrt_threads)
    for (int64_t p = 0; p < P; ++p) {
        T* dst = wp + p * Kp * NW;
        for (int j = 0; j < NW; ++j) {
            const int64_t n = p * NW + j, kn = n < N ? K : 0;  // the row's k, then zeros
            for (int64_t k = 0; k < kn; ++k) dst[(k / KP * NW + j) * KP + k % KP] = w[n * w_st + k];
            for (int64_t k = kn; k < Kp; ++k) dst[(k / KP * NW + j) * KP + k % KP] = (T)0;
        }
    }
}
