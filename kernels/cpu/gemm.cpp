// Projections y = x @ W^T (+ bias) over weights prepacked in panels of 16 output features (see gemm.h).
#include "flowrt_cpu.h"
#include "gemm.h"
#include "panels.h"

int flowrt_threads = 1;

extern "C" {

// 1 when the packed projections are compiled in (AVX2 + FMA), else 0 (callers keep their other path).
int gemm_packed_available() { return FLOWRT_ON(FLOWRT_AVX2); }

// W [N, K] row-major (row stride w_st) -> panels (see above); wp holds ceil(N/16) * K * 16 floats, 32-byte aligned.
void gemm_pack_f32(const float* w, int64_t w_st, int64_t N, int64_t K, float* wp) {
    pack_panels<16, 1>(w, w_st, N, K, wp);
}

// y[M, N] (row stride y_st) = x[M, K] (row stride x_st) @ W^T + bias (nullable, N floats, read as padded: the
// caller passes it padded to whole panels). Threads split the panels and each runs every row tile over its panels.
// From 768 rows (long prefill chunks) x no longer stays in cache while a panel walks all of it, so work items are
// (block of rows, panel) instead, the row block sized to ~256 KB of x (Zen3's L2 is 512 KB). Zen3 fp32, 2 threads,
// one layer's projections (in-process A/B over four runs): 2,048 rows +7-10% (up to 188 GFLOP/s of a 196 FMA peak),
// 1,024 rows +4-6%; at 128-512 rows it was no better, so those keep the panel split.
int gemm_packed_f32(const float* x, int64_t x_st, int64_t M, int64_t K, const float* wp, int64_t N,
                    const float* bias, float* y, int64_t y_st) {
#ifdef FLOWRT_AVX2
    const int64_t P = (N + 15) / 16;
    const int T = (int)((M + 5) / 6);  // row tiles per panel
    // the row tiles r0 .. r1-1 (in rows) against panel p; with 2-16 tiles they also prefetch panel `next`
    auto run = [&](int64_t p, int64_t r0, int64_t r1, const float* next) {
        const float* w = wp + p * K * 16;
        const float* b = bias ? bias + p * 16 : nullptr;
        const int nvalid = (int)std::min<int64_t>(16, N - p * 16);
        const int tiles = (int)((r1 - r0 + 5) / 6);
        for (int t = 0; t < tiles; ++t) {
            const int64_t r = r0 + 6 * (int64_t)t;
            const float* xr = x + r * x_st;
            float* yr = y + r * y_st + p * 16;
            const int rows = (int)std::min<int64_t>(6, r1 - r);
            if (next)  // this tile's share of the next panel: lines [t*K/T, (t+1)*K/T), one every T k steps
                gemm_rows<true>(rows, xr, x_st, (int)K, w, b, yr, y_st, nvalid, next + (int64_t)t * K / tiles * 16,
                                tiles);
            else
                gemm_rows<false>(rows, xr, x_st, (int)K, w, b, yr, y_st, nvalid, nullptr, 0);
        }
    };
    if (M >= 768) {
        const int64_t MC = std::max<int64_t>(6, 65536 / K / 6 * 6);  // rows per block: ~256 KB of x
        const int64_t RB = (M + MC - 1) / MC;
        #pragma omp parallel for schedule(dynamic, 1) num_threads(flowrt_threads)
        for (int64_t it = 0; it < RB * P; ++it) {  // block-major: both threads share a row block's x in turn
            const int64_t r0 = it / P * MC;
            run(it % P, r0, std::min(M, r0 + MC), nullptr);
        }
        return 0;
    }
    const bool prefetch = T >= 2 && T <= 16;
    // guided: a thread slowed by the host (these VMs' vCPUs vary) takes fewer panels instead of holding the step
    #pragma omp parallel for schedule(guided) if (M * N * K >= 262144) num_threads(flowrt_threads)
    for (int64_t p = 0; p < P; ++p) run(p, 0, M, prefetch && p + 1 < P ? wp + (p + 1) * K * 16 : nullptr);
    return 0;
#else
    return -1;
#endif
}

void flowrt_set_num_threads(int n) { flowrt_threads = n > 0 ? n : 1; }

int flowrt_get_num_threads() { return flowrt_threads; }

// The instruction set this library was compiled for (the Python side checks it against the variant it asked for).
const char* flowrt_cpu_isa() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return "amx";
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
    return "avx512bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    return "avx512";
#elif defined(FLOWRT_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"
