// Quantized projections y[M, N] = x[M, K] @ W^T (+ bias), W in a GGUF block format read in place (uint8 rows of
// whole blocks, as the file stores them; formats in quant_blocks.h). x is quantized first (quant_act.cpp: int16 blocks
// of 32 with a scale d and the halves' scaled sums sx); then for every (row, column) pair and block of 32 the integer
// dot product of q_x and the weight's q (widened to int16: madd over pairs), as eight int32 lanes of four products
// each (lanes 0, 1, 4, 5 the block's first 16 elements, 2, 3, 6, 7 its second), is scaled by d_x * D (each half by
// its own D) and accumulated in eight float lanes; formats with minimums add M * sx. Why int16 activations: int8
// ones (llama.cpp's q8) perturb the logits enough (~0.1 nats) to flip greedy choices against the dequantized float32
// path; int16 is ~1e-5 relative, and on AVX2 the int16 madd costs what the int8 sign/maddubs pair did. The
// eight lanes are summed once at the end, always in the same tree. So a pair's result does not depend on the tile it
// was computed in or on the thread count: a row gives the same bits alone (decode) or in a batch.
//
// Tiles of 4 rows x 2 columns: a column's block is unpacked once and used by four rows (prefill), and decode
// (1 row) streams each weight byte once. Work items are chunks of 16 columns handed to
// the threads dynamically.
//
// ISA: the AVX2 code (madd on 256-bit vectors) also serves the avx512 and avx512bf16 variants (their builds
// define __AVX2__): no AVX-512 or VNNI path here, as none could be tested on the AVX2-only machines these were
// written on. The generic variant runs the same arithmetic in scalar C++.
#include "flowrt_cpu.h"
#include "common.h"
#include "quant_blocks.h"
#ifdef FLOWRT_AVX2
#include "gemm.h"
#endif

#include <type_traits>

namespace {

struct Act {
    const int16_t* q;  // [M, K]
    const float* d;    // [M, nb]
    const float* sx;   // [M, nb, 8]
    int64_t K, nb;
};

template <typename T>
static inline void put(T* y, float v) { *y = from_f32<T>(v); }

#ifdef FLOWRT_AVX2
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the one summation order of a pair's lanes.
static inline float lanes_sum(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

// A 32-block's per-half values in the products' lane order: {v0, v0, v1, v1, v0, v0, v1, v1} (one value: all lanes).
static inline __m256 halves(const float* v, bool two) {
    return two ? _mm256_setr_ps(v[0], v[0], v[1], v[1], v[0], v[0], v[1], v[1]) : _mm256_set1_ps(v[0]);
}

template <typename F, typename = void> struct has_qv16 : std::false_type {};
template <typename F> struct has_qv16<F, std::void_t<decltype(&F::qv16)>> : std::true_type {};

// The 32-block b of a row as two int16 vectors (elements 0-15, 16-31): the format's own unpacking where it has one
// (straight to int16), else its 32 int8 values widened.
template <typename F>
static inline void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) {
    if constexpr (has_qv16<F>::value) {
        F::qv16(r, b, q0, q1);
    } else {
        const __m256i q = F::qv(r, b);
        q0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        q1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    }
}

template <typename F, int R, int C, typename T>
static inline void tile(const Act& a, int64_t r0, const uint8_t* w, int64_t rb, int64_t c0, const float* bias, T* y,
                        int64_t ys) {
    __m256 acc[R][C];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const int16_t* xq = a.q + r0 * a.K;
    const float* xd = a.d + r0 * a.nb;
    const float* xs = a.sx + r0 * a.nb * 8;
    // the next C rows of W (contiguous after these) stream into L1 while this tile runs, a share per block: rows are
    // short runs (K = 2048 at 4.5 bits is 18 lines) that the hardware prefetcher alone does not cover in time
    constexpr int PF = C * F::BYTES * 32 / F::QK;  // bytes of the next tile per block of 32
    constexpr int G = F::QK / 32;                  // blocks of 32 per format block: the loop over them is unrolled
    const uint8_t* next = w + (c0 + C) * rb;
    for (int64_t sb = 0; sb < a.nb / G; ++sb) {
        float Ds[C][2 * G], Ms[C][2 * G];  // D, M of the block's halves, decoded once per column
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            if constexpr (G == 8) F::scales8(w + (c0 + c) * rb + sb * F::BYTES, Ds[c], Ms[c]);
            else F::scales(w + (c0 + c) * rb, (int)sb, Ds[c], Ms[c]);
        }
        #pragma GCC unroll 8
        for (int j = 0; j < G; ++j) {
            const int64_t b = sb * G + j;
            #pragma GCC unroll 4
            for (int o = 0; o < PF; o += 64) _mm_prefetch((const char*)(next + b * PF + o), _MM_HINT_T0);
            #pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                constexpr int H = F::HALVES ? 2 : 1;
                const __m256 Dv = halves(Ds[c] + H * j, F::HALVES);
                __m256i q0, q1;
                qv16<F>(w + (c0 + c) * rb, (int)b, q0, q1);
                #pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const int16_t* xb = xq + r * a.K + 32 * b;
                    const __m256i p0 = _mm256_madd_epi16(q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
                    const __m256i p1 =
                        _mm256_madd_epi16(q1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
                    const __m256 s = _mm256_cvtepi32_ps(F::HALVES ? _mm256_hadd_epi32(p0, p1) : _mm256_add_epi32(p0, p1));
                    const __m256 scale = _mm256_mul_ps(Dv, _mm256_broadcast_ss(xd + r * a.nb + b));
                    acc[r][c] = _mm256_fmadd_ps(s, scale, acc[r][c]);
                    if constexpr (F::MIN)
                        acc[r][c] = _mm256_fmadd_ps(halves(Ms[c] + H * j, F::HALVES),
                                                    _mm256_loadu_ps(xs + (r * a.nb + b) * 8), acc[r][c]);
                }
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            float v = lanes_sum(acc[r][c]);
            if (bias) v += bias[c0 + c];
            put(y + (r0 + r) * ys + c0 + c, v);
        }
}

template <typename F, int C, typename T>
static inline void rows_tile(int R, const Act& a, int64_t r0, const uint8_t* w, int64_t rb, int64_t c0,
                             const float* bias, T* y, int64_t ys) {
    switch (R) {
        case 4: tile<F, 4, C>(a, r0, w, rb, c0, bias, y, ys); break;
        case 3: tile<F, 3, C>(a, r0, w, rb, c0, bias, y, ys); break;
        case 2: tile<F, 2, C>(a, r0, w, rb, c0, bias, y, ys); break;
        default: tile<F, 1, C>(a, r0, w, rb, c0, bias, y, ys); break;
    }
}
#else
// The scalar twin: per (row, column) pair and block, the two halves' integer sums scaled by d_x * D (+ M * sx).
template <typename F, typename T>
static inline void scalar_tile(int R, const Act& a, int64_t r0, const uint8_t* w, int64_t rb, int64_t c0,
                               const float* bias, T* y, int64_t ys) {
    const uint8_t* row = w + c0 * rb;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    int8_t q[32];
    for (int64_t b = 0; b < a.nb; ++b) {
        float D[2], Mn[2];
        F::q(row, (int)b, q);
        F::scales(row, (int)b, D, Mn);
        for (int r = 0; r < R; ++r) {
            const int16_t* x = a.q + (r0 + r) * a.K + 32 * b;
            int s[2] = {0, 0};
            for (int i = 0; i < 32; ++i) s[i >> 4] += (int)q[i] * (int)x[i];
            const float dx = a.d[(r0 + r) * a.nb + b];
            acc[r] += (float)s[0] * (D[0] * dx) + (float)s[1] * (D[1] * dx);
            if constexpr (F::MIN) {
                const float* sx = a.sx + ((r0 + r) * a.nb + b) * 8;
                acc[r] += Mn[0] * (4.0f * sx[0]) + Mn[1] * (4.0f * sx[2]);
            }
        }
    }
    for (int r = 0; r < R; ++r) put(y + (r0 + r) * ys + c0, acc[r] + (bias ? bias[c0] : 0.f));
}
#endif

// The rows [r0, r1) against the columns [c0, c1).
template <typename F, typename T>
static void block(const Act& a, int64_t r0, int64_t r1, const uint8_t* w, int64_t rb, int64_t c0, int64_t c1,
                  const float* bias, T* y, int64_t ys) {
    for (int64_t r = r0; r < r1; r += 4) {
        const int R = (int)std::min<int64_t>(4, r1 - r);
        int64_t c = c0;
#ifdef FLOWRT_AVX2
        if (R == 1)  // one row: four columns' chains in flight
            for (; c + 4 <= c1; c += 4) tile<F, 1, 4>(a, r, w, rb, c, bias, y, ys);
        for (; c + 2 <= c1; c += 2) rows_tile<F, 2>(R, a, r, w, rb, c, bias, y, ys);
        for (; c < c1; ++c) rows_tile<F, 1>(R, a, r, w, rb, c, bias, y, ys);
#else
        for (; c < c1; ++c) scalar_tile<F>(R, a, r, w, rb, c, bias, y, ys);
#endif
    }
}

constexpr int64_t COLS = 16;  // columns per work item

// A buffer per thread, grown as needed, 32-byte aligned; slots: 0 the activations, 1 x' (packed), 2 rows of W.
static uint8_t* scratch(size_t bytes, int slot = 0) {
    static thread_local std::vector<uint8_t> buf[3];
    if (buf[slot].size() < bytes + 32) buf[slot].resize(bytes + 32);
    return buf[slot].data() + (-(uintptr_t)buf[slot].data() & 31);
}

#ifdef FLOWRT_AVX2
// From FLOAT_ROWS rows (batched decode, prefill) the integer pairs above cost more than float32 FMAs on AVX2 (a pair's
// block takes ~7 operations for 32 products against 4 FMAs; the crossover measured at 10 rows, Zen3, 1 thread, cold
// weights, SmolLM2 and 1B shapes, Q8_0 / Q4_K / Q4_1: 0.8-1.1x at 8 rows, 0.95-1.55x at 10, 1.4-2.2x at 16), so the products run in float32 on the same numbers
// (reference.linear's operands: the exact weight values and x' = q_x * d_x), summed in another order, with gemm.h's
// 6 x 16 tile in swapped roles: the tile's six broadcast rows are six rows of W, dequantized row-major into L1/L2
// (no transpose: a block's 32 values are contiguous in both), and its 16-wide panel is 16 rows of x' packed
// k-major once per call. y^T's 6 x 16 tile is then stored transposed. Each regime is batch invariant on its own; a
// row's bits differ between them only by float32 summation order.
constexpr int64_t FLOAT_ROWS = 10;

// Row n of W (nb blocks of 32) as float32: the K-quants decode a super-block's scales once for its eight blocks.
template <typename F>
static inline void row_values(const uint8_t* row, int64_t nb, float* out) {
    constexpr int G = F::QK / 32;
    for (int64_t sb = 0; sb < nb / G; ++sb) {
        float Ds[2 * G], Ms[2 * G] = {};
        if constexpr (G == 8) F::scales8(row + sb * F::BYTES, Ds, Ms);
        for (int j = 0; j < G; ++j) {
            const int b = (int)(sb * G + j);
            float D[2], Mn[2] = {0.f, 0.f};
            if constexpr (G == 8) {
                constexpr int H = F::HALVES ? 2 : 1;
                D[0] = Ds[H * j], D[1] = Ds[H * j + H - 1], Mn[0] = Ms[H * j], Mn[1] = Ms[H * j + H - 1];
            } else {
                F::scales(row, b, D, Mn);
            }
            const __m256i q = F::qv(row, b);
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            #pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                __m256 v = _mm256_mul_ps(_mm256_set1_ps(D[i >> 1]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])));
                if constexpr (F::MIN) v = _mm256_add_ps(v, _mm256_set1_ps(Mn[i >> 1]));
                _mm256_store_ps(out + 32 * b + 8 * i, v);
            }
        }
    }
}

template <typename F, typename T>
static void gemm_float(const Act& a, int64_t M, const uint8_t* w, int64_t N, const float* bias, T* y, int64_t ys) {
    const int64_t K = a.K, rb = K / F::QK * F::BYTES, XP = (M + 15) / 16, S = (N + 5) / 6;
    // x' in panels of 16 rows, k-major: xp[(p * K + k) * 16 + i] = x'[16p + i, k] (zeros past M)
    float* xp = reinterpret_cast<float*>(scratch((size_t)(XP * K * 16 * 4), 1));
    #pragma omp parallel num_threads(flowrt_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < XP * a.nb; ++it) {
            const int64_t p = it / a.nb, b = it % a.nb;
            for (int h = 0; h < 2; ++h) {
                __m256 r[4][8];
                for (int i = 0; i < 8; ++i) {
                    const int64_t m = 16 * p + 8 * h + i;
                    for (int g = 0; g < 4; ++g) {
                        if (m >= M) { r[g][i] = _mm256_setzero_ps(); continue; }
                        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.q + m * K + 32 * b + 8 * g));
                        r[g][i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(v)),
                                                _mm256_set1_ps(a.d[m * a.nb + b]));
                    }
                }
                for (int g = 0; g < 4; ++g) {
                    transpose8(r[g]);
                    for (int i = 0; i < 8; ++i) _mm256_store_ps(xp + (p * K + 32 * b + 8 * g + i) * 16 + 8 * h, r[g][i]);
                }
            }
        }
        float* wr = reinterpret_cast<float*>(scratch((size_t)(6 * K * 4), 2));
        // Work items are chunks of 8 strips: a thread writes 48 adjacent columns (3 cache lines of each row of y) while
        // they stay in L1, instead of every line of y being fetched again by the strips of other threads (12% of a call
        // at 64 rows). Past G panels (prefill) the panels go in groups (256 KiB of x', at least 8 panels) and each group
        // runs every strip of the chunk, the strip dequantized again per group (at most M / 128 times: a few % of the
        // FMAs), so x' is read from L2 rather than all of it streamed from L3 for every 6 rows of W (1.2 MB at 512 rows,
        // K = 576). The gain is within this machine's noise (Zen3, 1 thread: 0.8-1.05x float32 at 512 rows either way).
        const int64_t G = std::max<int64_t>(8, (256 << 10) / (K * 64)), CH = 8, NC = (S + CH - 1) / CH;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < NC; ++c)
            for (int64_t p0 = 0; p0 < XP; p0 += G)
                for (int64_t s = c * CH; s < std::min(S, (c + 1) * CH); ++s) {
                    const int64_t n0 = 6 * s;
                    const int nr = (int)std::min<int64_t>(6, N - n0);
                    for (int j = 0; j < nr; ++j) row_values<F>(w + (n0 + j) * rb, a.nb, wr + j * K);
                    float bj[6] = {};
                    if (bias) std::copy(bias + n0, bias + n0 + nr, bj);
                    for (int64_t p = p0; p < std::min(XP, p0 + G); ++p) {
                        const int mv = (int)std::min<int64_t>(16, M - 16 * p);
                        alignas(32) float t[6 * 16];
                        gemm_rows<false>(nr, wr, K, (int)K, xp + p * K * 16, nullptr, t, 16, 16, nullptr, 0);
                        for (int i = 0; i < mv; ++i) {  // y^T's tile, each row of y's six columns in turn
                            T* yr = y + (16 * p + i) * ys + n0;
                            for (int j = 0; j < nr; ++j) put(yr + j, t[j * 16 + i] + bj[j]);
                        }
                    }
                }
    }
}
#endif

template <typename F, typename T>
static void gemm(const Act& a, int64_t M, const uint8_t* w, int64_t N, const float* bias, T* y, int64_t ys) {
    const int64_t rb = a.K / F::QK * F::BYTES;
    const int64_t NC = (N + COLS - 1) / COLS;
    // from 64 rows, blocks of rows whose activations (~1.1 bytes an element) stay in L2 while a chunk's columns run
    const int64_t MB = M < 64 ? M : std::max<int64_t>(4, (98304 / a.K) & ~(int64_t)3);
    const int64_t RB = (M + MB - 1) / MB;
    #pragma omp parallel for schedule(dynamic, 1) if (M * N * a.K >= (1 << 18)) num_threads(flowrt_threads)
    for (int64_t it = 0; it < RB * NC; ++it) {
        const int64_t r0 = it / NC * MB, c0 = it % NC * COLS;
        block<F>(a, r0, std::min(M, r0 + MB), w, rb, c0, std::min(N, c0 + COLS), bias, y, ys);
    }
}

// y[:, part p's columns] = x @ W_p^T (+ its bias) for the parts (GGUF block rows, each its own format) stacked by rows:
// a projection fused from tensors the file stores in different formats (Q4_K_M's q/k and v); x quantized once.
template <typename T>
int quant_gemm(const T* x, int64_t x_st, int64_t M, int64_t K, const FrWeightPart* parts, int nparts, T* y,
               int64_t y_st) {
    for (int p = 0; p < nparts; ++p) {
        int qk = 0;
        if (qfmt::dispatch(parts[p].ggml_type, [&](auto tag) { qk = decltype(tag)::type::QK; }) != 0) return -1;
        if (K % qk) return -2;
    }
    const int64_t nb = K / 32;
    uint8_t* buf = scratch((size_t)(2 * M * K + M * nb * 36 + 64));
    float* d = reinterpret_cast<float*>(buf + ((2 * M * K + 31) & ~(int64_t)31));
    float* sx = d + M * nb;
    if constexpr (std::is_same_v<T, float>) quant_act_f32(x, x_st, M, K, (int16_t*)buf, d, sx);
    else quant_act_bf16(x, x_st, M, K, (int16_t*)buf, d, sx);
    const Act a{(const int16_t*)buf, d, sx, K, nb};
    int64_t off = 0;
    for (int p = 0; p < nparts; off += parts[p++].rows)
        qfmt::dispatch(parts[p].ggml_type, [&](auto tag) {
            using F = typename decltype(tag)::type;
            const FrWeightPart& q = parts[p];
            const uint8_t* w = static_cast<const uint8_t*>(q.w);
#ifdef FLOWRT_AVX2
            if (M >= FLOAT_ROWS) return gemm_float<F>(a, M, w, q.rows, q.bias, y + off, y_st);
#endif
            gemm<F>(a, M, w, q.rows, q.bias, y + off, y_st);
        });
    return 0;
}

}  // namespace

extern "C" {

int quant_gemm_supported(int qtype) { return qfmt::dispatch(qtype, [](auto) {}) == 0; }

int quant_gemm_f32(const float* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int qtype, int64_t N,
                   const float* bias, float* y, int64_t y_st) {
    const FrWeightPart part{w, bias, qtype, (int32_t)N};
    return quant_gemm(x, x_st, M, K, &part, 1, y, y_st);
}

int quant_gemm_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int qtype, int64_t N,
                    const float* bias, bf16_t* y, int64_t y_st) {
    const FrWeightPart part{w, bias, qtype, (int32_t)N};
    return quant_gemm(x, x_st, M, K, &part, 1, y, y_st);
}

int quant_gemm_proj_f32(const float* x, int64_t x_st, int64_t M, const FrProjection* p, float* y, int64_t y_st) {
    for (int i = 0; i < p->n_parts; ++i)
        if (!p->parts[i].ggml_type) return -1;
    return quant_gemm(x, x_st, M, p->cols, p->parts, p->n_parts, y, y_st);
}

int quant_gemm_proj_bf16(const bf16_t* x, int64_t x_st, int64_t M, const FrProjection* p, bf16_t* y, int64_t y_st) {
    for (int i = 0; i < p->n_parts; ++i)
        if (!p->parts[i].ggml_type) return -1;
    return quant_gemm(x, x_st, M, p->cols, p->parts, p->n_parts, y, y_st);
}

// The row count from which the products run in float32 (gemm_float), for the tests of both regimes.
int quant_gemm_float_rows() {
#ifdef FLOWRT_AVX2
    return (int)FLOAT_ROWS;
#else
    return 1 << 30;
#endif
}

}  // extern "C"
