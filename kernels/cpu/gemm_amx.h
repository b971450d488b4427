// bfloat16 products on AMX tiles (the amx variant: Sapphire Rapids and later Xeons): y[M, N] = x[M, K] @ W^T (+ bias)
// over W in gemm_bf16.h's packed panels of 32 output features (k pairs side by side), which is already the layout
// tdpbf16ps reads its B tile in: 16 k pairs x 16 features x 2, a panel's two halves 64 bytes apart in rows of 128.
// So one copy of the packed weights serves both kernels: vdpbf16ps tiles for few rows, AMX from AMX_ROWS. A block is
// 32 rows x 32 features: C in tiles 0-3 (row half i, feature half j = tile 2i + j), A (x's rows, read in place) in
// tiles 4-5, B in 6-7; each k step of 32 loads four tiles for four tdpbf16ps (16 x 16 x 32 products each). Float32
// accumulation inside the tile unit, rounded to bf16 (nearest even) once at the end, as the vdpbf16ps kernel does;
// the summation order differs, so the two agree to float32 rounding, not bit for bit.
// Linux hands out the tile registers per process on request (arch_prctl ARCH_REQ_XCOMP_PERM); where it refuses
// (an old kernel, a sandbox), amx_permitted() is false and the callers keep the vdpbf16ps kernels.
#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FLOWRT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

// From this many rows the products run on AMX: measured (python bench/gemm_bf16.py, Xeon with AMX, one thread, cold
// weights) against the vdpbf16ps tiles, SmolLM2-135M shapes.
constexpr int64_t AMX_ROWS = 8;

static inline bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// Palette 1, the eight tiles each 16 rows of 64 bytes.
static inline void amx_configure() {
    struct alignas(64) {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

// c[16 RB][32] (float32, rows of 32) = x[16 RB rows, row stride xs] @ the panel at w (K % 32 == 0). pf (nullable):
// bytes to prefetch into L2 meanwhile, pn cache lines per k step (tile loads from memory stall otherwise).
template <int RB>
static inline void amx_block(const bf16_t* x, int64_t xs, int64_t K, const bf16_t* w, float* c, const char* pf,
                             int pn) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (RB == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k = 0; k < K; k += 32) {
        if (pf)
            for (int l = 0; l < pn; ++l) _mm_prefetch(pf + (k / 32 * pn + l) * 64, _MM_HINT_T1);
        _tile_loadd(6, w + k * 32, 128);
        _tile_loadd(7, w + k * 32 + 32, 128);
        _tile_loadd(4, x + k, xs * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (RB == 2) {
            _tile_loadd(5, x + 16 * xs + k, xs * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if constexpr (RB == 2) {
        _tile_stored(2, c + 512, 128);
        _tile_stored(3, c + 528, 128);
    }
}

// y's rows [0, rows) x columns [0, ncols <= 32) = c (+ bias: ncols floats), rounded to bf16.
static inline void amx_store(const float* c, int rows, const float* bias, bf16_t* y, int64_t ys, int ncols) {
    for (int v = 0; v < 2; ++v) {
        const int n = std::min(16, ncols - 16 * v);
        if (n <= 0) break;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < rows; ++r) {
            const __m512 o = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16 * v), bv);
            _mm256_mask_storeu_epi16(y + r * ys + 16 * v, m, (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}

// y[M, N] (row stride ys) = x[M, K] @ W^T + bias (nullable, N floats), K % 32 == 0, on AMX. Each thread takes a
// contiguous share of the panels, G at a time: panels(g, n) returns panels g..g+n-1 (K * 32 elements apart), either
// the prepacked weights themselves or a thread's scratch that the quantized products dequantize them into; every row
// runs over a group before the next (its weights stay in L1/L2 while x's rows stream past); with `stream` (weights
// read from memory, not made in scratch) a panel's blocks prefetch the next panel, a share each. Rows come in chunks of
// MB (a multiple of 32) with the groups inside, so x's chunk stays in L2 (MB = M: every row per group, for panels that
// cost work to produce). The last M % 16 rows go through a zero-padded copy: a tile load reads 16 whole rows.
template <bool stream, typename Panels>
static void amx_gemm(const bf16_t* x, int64_t xs, int64_t M, int64_t K, int64_t N, const float* bias, bf16_t* y,
                     int64_t ys, int64_t G, int64_t MB, Panels&& panels) {
    const int64_t P = (N + 31) / 32, full = M / 16 * 16, tail = M - full;
    const int nt = (int)std::min<int64_t>(flowrt_threads, P);
    #pragma omp parallel num_threads(nt) if (nt > 1 && M * N * K >= 262144)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = P * t / T, p1 = P * (t + 1) / T;
        bf16_t* xt = nullptr;
        if (tail) {
            xt = reinterpret_cast<bf16_t*>(scratch((size_t)(16 * K * 2), 3));
            for (int64_t r = 0; r < 16; ++r)
                if (r < tail) std::memcpy(xt + r * K, x + (full + r) * xs, (size_t)K * 2);
                else std::memset(xt + r * K, 0, (size_t)K * 2);
        }
        alignas(64) float c[32 * 32];
        amx_configure();
        for (int64_t r0 = 0; r0 < M; r0 += MB) {
            const int64_t r1 = std::min(M, r0 + MB);
            // a group's panels are K cache lines each: every block's share of the next group's, in lines per k step
            const int64_t nblk = (r1 - r0 + 31) / 32, share = (K + nblk - 1) / nblk;
            const int pn = (int)((share + K / 32 - 1) / (K / 32));
            for (int64_t g = p0; g < p1; g += G) {
                const int64_t gn = std::min(G, p1 - g);
                const bf16_t* wg = panels(g, gn);
                // stream: the next group's panels (contiguous) prefetched over this group's blocks, a share each
                const char* next = stream && g + gn < p1 ? reinterpret_cast<const char*>(panels(g + gn, 1)) : nullptr;
                for (int64_t r = r0; r < r1; r += 32)
                    for (int64_t q = 0; q < gn; ++q) {
                        const int64_t n0 = 32 * (g + q);
                        const int ncols = (int)std::min<int64_t>(32, N - n0);
                        const bf16_t* w = wg + q * K * 32;
                        const float* b = bias ? bias + n0 : nullptr;
                        const char* pf = next ? next + ((r - r0) / 32 * gn + q) * share * 64 : nullptr;
                        if (r + 32 <= full) {
                            amx_block<2>(x + r * xs, xs, K, w, c, pf, pn);
                            amx_store(c, 32, b, y + r * ys + n0, ys, ncols);
                            continue;
                        }
                        if (r + 16 <= full) {
                            amx_block<1>(x + r * xs, xs, K, w, c, pf, pn);
                            amx_store(c, 16, b, y + r * ys + n0, ys, ncols);
                        }
                        if (tail && r + 32 >= M) {  // this chunk's last block holds the tail
                            amx_block<1>(xt, K, K, w, c, r + 16 <= full ? nullptr : pf, pn);
                            amx_store(c, (int)tail, b, y + full * ys + n0, ys, ncols);
                        }
                    }
            }
        }
        _tile_release();
    }
}
#endif
