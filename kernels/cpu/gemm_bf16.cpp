// bfloat16 projections y = x @ W^T (+ bias) over weights prepacked in pairs of k (see gemm_bf16.h), compiled in
// only where the compiler targets AVX512-BF16 (the avx512bf16 variant); elsewhere the entry points report so and
// the callers keep oneDNN.
#include "flowrt_cpu.h"
#include "gemm_amx.h"
#include "gemm_bf16.h"
#include "panels.h"

#include <array>
#include <utility>

#ifdef FLOWRT_GEMM_BF16
namespace {

using TileFn = void (*)(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, const float*, bf16_t*, int64_t, int);

// MR_MAX[np - 1]: the most rows a tile of np panels takes (at most 24 accumulators of the 32 vector registers)
constexpr int MR_MAX[4] = {12, 6, 4, 2};

template <int NP, int... R>
constexpr std::array<TileFn, 12> row_table(std::integer_sequence<int, R...>) {
    return {{(R + 1 <= MR_MAX[NP - 1] ? &gemm_bf16_tile<(R + 1 <= MR_MAX[NP - 1] ? R + 1 : 1), NP> : nullptr)...}};
}

// TILES[np - 1][rows - 1]
const std::array<TileFn, 12> TILES[4] = {
    row_table<1>(std::make_integer_sequence<int, 12>{}), row_table<2>(std::make_integer_sequence<int, 12>{}),
    row_table<3>(std::make_integer_sequence<int, 12>{}), row_table<4>(std::make_integer_sequence<int, 12>{})};

// Panels per tile for M rows: as many as keep the row tiles' accumulators in registers.
int panels_for(int64_t M) { return M >= 7 ? 1 : M >= 5 ? 2 : M >= 3 ? 3 : 4; }

}  // namespace
#endif

extern "C" {

// 1 when the bfloat16 projections are compiled in (the avx512bf16 variant), else 0 (callers keep oneDNN).
int gemm_bf16_available() { return FLOWRT_ON(FLOWRT_GEMM_BF16); }

// W [N, K] bf16 row-major (row stride w_st) -> wp: ceil(N/32) panels of ceil(K/2) k pairs x 32 features x 2
// (zero past N and K), 64-byte aligned. Returns -1 where the kernels are not compiled in.
int gemm_pack_bf16(const bf16_t* w, int64_t w_st, int64_t N, int64_t K, bf16_t* wp) {
#ifdef FLOWRT_GEMM_BF16
    pack_panels<32, 2>(w, w_st, N, K, wp);
    return 0;
#else
    return -1;
#endif
}

// y[M, N] bf16 (row stride y_st) = x[M, K] bf16 (row stride x_st) @ W^T + bias (nullable: float32, padded with
// zeros to whole panels of 32). Each thread takes a contiguous share of the panels and runs every row tile over
// groups of them (a group's weights stay in L2 while its row tiles reuse them). Software prefetch of the next group
// during a group's row tiles (as gemm_packed_f32 does) measured 3-11% slower here at 13-64 rows (one thread, A/B),
// and even-sized row tiles (13 rows: 7 + 6) no different: the hardware prefetcher keeps up with these streams.
// Returns -1 where not compiled in.
int gemm_packed_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, const bf16_t* wp, int64_t N,
                     const float* bias, bf16_t* y, int64_t y_st) {
#ifdef FLOWRT_GEMM_BF16
    if (M <= 0 || N <= 0) return 0;
    const int64_t P = (N + 31) / 32, pst = (K + 1) / 2 * 64;
#ifdef FLOWRT_AMX
    if (M >= AMX_ROWS && K % 32 == 0 && amx_permitted()) {
        // from 128 rows groups of panels of at most 512 KiB (in L2), every 32-row block of x (in L1) running over a
        // group's panels: x read from L2 once per group rather than the panel from L2 for every block (one thread,
        // Xeon with AMX, SmolLM2 gate_up at 256 rows: 1.48 -> 1.17 ms); fewer rows stream one panel at a time
        const int64_t G = M >= 128 ? std::max<int64_t>(1, ((int64_t)512 << 10) / (K * 64)) : 1;
        amx_gemm<true>(x, x_st, M, K, N, bias, y, y_st, G, M, [&](int64_t g, int64_t) { return wp + g * pst; });
        return 0;
    }
#endif
    const int np = panels_for(M), mr = MR_MAX[np - 1];
    const int nt = (int)std::min<int64_t>(flowrt_threads, P);
    #pragma omp parallel num_threads(nt) if (nt > 1 && M * N * K >= 262144)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = P * t / T, p1 = P * (t + 1) / T;
        for (int64_t g = p0; g < p1; g += np) {
            const int gnp = (int)std::min<int64_t>(np, p1 - g);
            const int ncols = (int)std::min<int64_t>(32 * gnp, N - 32 * g);
            for (int64_t r = 0; r < M; r += mr) {
                const int rows = (int)std::min<int64_t>(mr, M - r);
                TILES[gnp - 1][rows - 1](x + r * x_st, x_st, K, wp + g * pst, pst, bias ? bias + 32 * g : nullptr,
                                         y + r * y_st + 32 * g, y_st, ncols);
            }
        }
    }
    return 0;
#else
    return -1;
#endif
}

}  // extern "C"
