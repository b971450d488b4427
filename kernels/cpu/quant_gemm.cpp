// Quantized projections y[M, N] = x[M, K] @ W^T (+ bias), W in a GGUF block format read in place (uint8 rows of
// whole blocks, as the file stores them; formats in quant_blocks.h). x is quantized first (quant_act.cpp: int16 blocks
// of 32 with a scale d and the halves' scaled sums sx); then for every (row, column) pair and block of 32 the integer
// dot product of q_x and the weight's q (widened to int16: madd over pairs), scaled by d_x * D (each half by its own D
// where the format has two) and accumulated in float; formats with minimums add M * sx. Why int16 activations: int8
// ones (llama.cpp's q8) perturb the logits enough (~0.1 nats) to flip greedy choices against the dequantized float32
// path; int16 is ~1e-5 relative, and on AVX2 the int16 madd costs what the int8 sign/maddubs pair did.
//
// Up to 9 rows (decode) in small tiles (block() below), which stream each weight byte once per tile; from FLOAT_ROWS
// rows (batched decode, prefill) float32 FMAs on the dequantized weights (gemm_float below). Work items are chunks of
// 16 columns, handed to the threads in guided runs (gemm() below).
//
// ISA: the AVX2 code (madd on 256-bit vectors) also serves the avx512 and avx512bf16 variants (their builds
// define __AVX2__); where the build has AVX512-VNNI (the avx512bf16 variant), madd_add's multiply and add are one
// vpdpwssd, the same exact int32 sums. Wider (512-bit) vectors are not used: on Zen4 they split into two 256-bit
// halves, and a 32-block's products fill one 256-bit pair. The generic variant runs the same arithmetic in scalar C++.
#include "flowrt_cpu.h"
#include "common.h"
#include "quant_blocks.h"
#ifdef FLOWRT_AVX2
#include "gemm.h"
#include "gemm_amx.h"
#endif

#include <type_traits>

namespace {

struct Act {
    const int16_t* q;  // [M, K]
    const float* d;    // [M, nb]
    const float* sx;   // [M, 2, nb]
    int64_t K, nb;
    // q's bytes as two planes [M, K] (VNNI builds, decode rows; else null): lo the low bytes (unsigned), hi the high
    // ones (signed), q = 256 hi + lo
    const uint8_t* lo = nullptr;
    const int8_t* hi = nullptr;
};

#if defined(FLOWRT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FLOWRT_VNNI 1
#endif

template <typename T>
static inline void put(T* y, float v) { *y = from_f32<T>(v); }

// A row's blocks of 32 go in groups of eight (a K-quant's super-block; the 32-block formats' blocks 8g..8g+7, the
// last group of a row short when K is not a multiple of 256): per group, the integer products of each block (or
// half-block, for the formats whose halves have their own scale) are summed exactly in int32, one lane per block, and
// scaled in one vector operation: acc += float(s) * (D * d_x) (+ M * sx), lane j for block j. Against one float
// conversion and scale per block this halves the operations per weight of the 4-bit and 6-bit formats, whose one-row
// products are compute-bound on AVX2 (the weights stream slower than memory). The eight lanes are summed once at the
// end, always in the same tree; so a pair's result does not depend on the tile it was computed in or on the thread
// count: a row gives the same bits alone (decode) or in a batch.
constexpr int GROUP = 8;

#ifdef FLOWRT_AVX2
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the one summation order of a pair's lanes.
static inline float lanes_sum(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

// acc + madd(a, b), exact in int32: one vpdpwssd where AVX512-VNNI reaches 256-bit vectors.
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

#ifdef FLOWRT_VNNI
// Q4_K and Q5_K (q unsigned and below 128, one scale per 32-block) multiply their bytes as they unpack them: a
// block's product with q_x = 256 hi + lo is 256 (q . hi) + (lo . q), two vpdpbusd (unsigned x signed bytes; q fits
// both), the same exact int32 sum as the int16 madd path without widening q to int16. It pays where q comes in runs
// of 32 bytes (Q4_K's unpacking is one shift and one mask a block): Q4_K 0.92x the int16 path's time at one row (Zen4,
// one thread, 512 x 2048 in L2 and cold). Q4_1 / Q5_1 pack a block in 16 bytes, whose byte unpacking costs more than
// the widening it saves (1.1x the time, measured the same way), so they keep the int16 path.
template <typename F>
constexpr bool BYTE_PRODUCTS = F::MIN && !F::HALVES && F::QK == 32 * GROUP;

// block b of row r's activations against the block's 32 weight bytes w: eight int32 lanes that sum to the product
static inline __m256i byte_product(const Act& a, int64_t r, int64_t b, __m256i w) {
    const int64_t at = r * a.K + 32 * b;
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.hi + at));
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.lo + at));
    const __m256i ph = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, hi);
    return _mm256_dpbusd_epi32(_mm256_slli_epi32(ph, 8), lo, w);
}

// q [M, K] into its byte planes lo, hi
static void byte_planes(const int16_t* q, int64_t n, uint8_t* lo, int8_t* hi) {
    const __m256i low = _mm256_set1_epi16(0xFF);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i + 16));
        const __m256i l = _mm256_packus_epi16(_mm256_and_si256(a, low), _mm256_and_si256(b, low));
        const __m256i h = _mm256_packs_epi16(_mm256_srai_epi16(a, 8), _mm256_srai_epi16(b, 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm256_permute4x64_epi64(l, 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm256_permute4x64_epi64(h, 0xD8));
    }
    for (; i < n; ++i) {
        lo[i] = (uint8_t)(q[i] & 0xFF);
        hi[i] = (int8_t)(q[i] >> 8);
    }
}
#endif

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

// The scales of super-block g's eight blocks, lane j for block j: D[0] (each half's own in D[0], D[1] for HALVES
// formats) and the minimums M[0] (M[1]).
template <typename F, typename = void> struct has_scales8v : std::false_type {};
template <typename F> struct has_scales8v<F, std::void_t<decltype(&F::scales8v)>> : std::true_type {};

template <typename F>
__attribute__((always_inline)) static inline void group_scales(const uint8_t* r, int64_t g, __m256* D, __m256* M) {
    static_assert(F::QK == 32 * GROUP);
    if constexpr (has_scales8v<F>::value) {  // decoded in registers
        F::scales8v(r + g * F::BYTES, D, M);
        return;
    }
    alignas(32) float Ds[16], Ms[16] = {};
    F::scales8(r + g * F::BYTES, Ds, Ms);
    const auto even_odd = [](const float* v, __m256& e, __m256& o) {  // v[2j], v[2j + 1] -> lane j of e, o
        const __m256 a = _mm256_load_ps(v), b = _mm256_load_ps(v + 8);
        e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
    };
    if constexpr (F::HALVES) {
        even_odd(Ds, D[0], D[1]);
        if constexpr (F::MIN) even_odd(Ms, M[0], M[1]);
    } else {
        D[0] = _mm256_load_ps(Ds);
        if constexpr (F::MIN) M[0] = _mm256_load_ps(Ms);
    }
}

// Super-block g of rows [r0, r0 + R) against one row of W into acc[R].
template <typename F, int R>
__attribute__((always_inline)) static inline void group(const Act& a, int64_t r0, const uint8_t* row, int64_t g,
                                                        __m256* acc) {
    constexpr int H = F::HALVES ? 2 : 1;
    // the block products' lanes, reduced as they come (pairs of blocks by hadd, then pairs of pairs), so few
    // registers stay live: h[r][half][k] holds blocks 2k, 2k + 1
    __m256i h[R][H][4];
    const uint8_t* rg = row + g * F::BYTES;  // the super-block: blocks j = 0..7 from it
    #pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
        __m256i v[2][R][H];
        #pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {
            const int j = 2 * k + e;
            const int64_t b = GROUP * g + j;
#ifdef FLOWRT_VNNI
            if constexpr (BYTE_PRODUCTS<F>) {
                const __m256i w = F::qv(rg, j);  // j a constant: the block's offsets fold
                #pragma GCC unroll 4
                for (int r = 0; r < R; ++r) v[e][r][0] = byte_product(a, r0 + r, b, w);
                continue;
            }
#endif
            __m256i q0, q1;
            qv16<F>(rg, j, q0, q1);  // j a constant: the block's offsets fold
            #pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const int16_t* xb = a.q + (r0 + r) * a.K + 32 * b;
                const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
                const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
                const __m256i m0 = _mm256_madd_epi16(q0, x0);
                if constexpr (F::HALVES) v[e][r][0] = m0, v[e][r][1] = _mm256_madd_epi16(q1, x1);
                else v[e][r][0] = madd_add(m0, q1, x1);
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
            for (int hh = 0; hh < H; ++hh) h[r][hh][k] = _mm256_hadd_epi32(v[0][r][hh], v[1][r][hh]);
    }
    __m256 D[2], Mn[2];
    group_scales<F>(row, g, D, Mn);
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * a.nb + GROUP * g;
        const __m256 dx = _mm256_loadu_ps(a.d + at);
        #pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {  // lane j = block j's sum
            const __m256i x = _mm256_hadd_epi32(h[r][hh][0], h[r][hh][1]), y = _mm256_hadd_epi32(h[r][hh][2], h[r][hh][3]);
            const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20), _mm256_permute2x128_si256(x, y, 0x31));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(D[hh], dx), acc[r]);
        }
        if constexpr (F::MIN) {
            const float* sp = a.sx + (r0 + r) * 2 * a.nb + GROUP * g;
            const __m256 s0 = _mm256_loadu_ps(sp), s1 = _mm256_loadu_ps(sp + a.nb);
            if constexpr (F::HALVES) {
                acc[r] = _mm256_fmadd_ps(Mn[0], s0, acc[r]);
                acc[r] = _mm256_fmadd_ps(Mn[1], s1, acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(Mn[0], _mm256_add_ps(s0, s1), acc[r]);
            }
        }
    }
}

// The 32-block formats (one scale per block, read straight from the block): tiles of R rows x C columns, each
// block's eight int32 lanes scaled by d_x * D and accumulated in eight float lanes (a column's block unpacked once for
// R rows; C columns' chains in flight); the minimums' M * sx in one more float per pair. For these, the groups above
// cost more than they save where a row is short (K = 576: two groups and a short one).
template <typename F, int R, int C, typename T>
static inline void tile_blocks(const Act& a, int64_t r0, const uint8_t* w, int64_t rb, int64_t c0, const float* bias,
                               T* y, int64_t ys) {
    static_assert(F::QK == 32 && !F::HALVES);
    __m256 acc[R][C];
    float mins[R][C] = {};
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const int16_t* xq = a.q + r0 * a.K;
    const float* xd = a.d + r0 * a.nb;
    const float* xs = a.sx + r0 * 2 * a.nb;
    constexpr int PF = C * F::BYTES;  // the next tile's bytes per block, prefetched a share per block
    const uint8_t* next = w + (c0 + C) * rb;
    for (int64_t b = 0; b < a.nb; ++b) {
        #pragma GCC unroll 4
        for (int o = 0; o < PF; o += 64) _mm_prefetch((const char*)(next + b * PF + o), _MM_HINT_T0);
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            const uint8_t* row = w + (c0 + c) * rb;
            float D[2], Mn[2];
            F::scales(row, (int)b, D, Mn);
            const __m256 Dv = _mm256_set1_ps(D[0]);
            __m256i q0, q1;
            qv16<F>(row, (int)b, q0, q1);
            #pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const int16_t* xb = xq + r * a.K + 32 * b;
                const __m256i p = madd_add(
                    _mm256_madd_epi16(q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))), q1,
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
                const __m256 scale = _mm256_mul_ps(Dv, _mm256_broadcast_ss(xd + r * a.nb + b));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][c]);
                if constexpr (F::MIN) {
                    const float* sx = xs + r * 2 * a.nb + b;
                    mins[r][c] = std::fma(Mn[0], sx[0] + sx[a.nb], mins[r][c]);
                }
            }
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < C; ++c)
            put(y + (r0 + r) * ys + c0 + c, lanes_sum(acc[r][c]) + mins[r][c] + (bias ? bias[c0 + c] : 0.f));
}

// The K-quants (and every format in the scalar build): rows [r0, r0 + R) against column c, a super-block at a time.
template <typename F, int R, typename T>
static inline void tile(const Act& a, int64_t r0, const uint8_t* w, int64_t rb, int64_t c, const float* bias, T* y,
                        int64_t ys) {
    const uint8_t* row = w + c * rb;
    // the next row of W (contiguous after this one) streams into L1 while this one runs, a share per group: rows are
    // short runs (K = 2048 at 4.5 bits is 18 lines) that the hardware prefetcher alone does not cover in time
    constexpr int PF = GROUP * 32 / F::QK * F::BYTES;  // bytes per group
    const uint8_t* next = row + rb;
    __m256 acc[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.nb / GROUP; ++g) {  // K is a multiple of 256 for these formats
        #pragma GCC unroll 4
        for (int o = 0; o < PF; o += 64) _mm_prefetch((const char*)(next + g * PF + o), _MM_HINT_T0);
        group<F, R>(a, r0, row, g, acc);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) put(y + (r0 + r) * ys + c, lanes_sum(acc[r]) + (bias ? bias[c] : 0.f));
}
#else
// The scalar twin, in the same order: per group, each block's (half's) exact integer sum in lane j, lane j +=
// float(s) * (D * d_x) (+ M * sx) by fused multiply-adds, the lanes summed in lanes_sum's tree.
template <typename F, int R, typename T>
static inline void tile(const Act& a, int64_t r0, const uint8_t* w, int64_t rb, int64_t c, const float* bias, T* y,
                        int64_t ys) {
    static_assert(R == 1, "the scalar build runs one row per tile");
    const uint8_t* row = w + c * rb;
    float acc[GROUP] = {};
    int8_t q[32];
    for (int64_t b = 0; b < a.nb; ++b) {
        float D[2], Mn[2] = {0.f, 0.f};
        F::q(row, (int)b, q);
        F::scales(row, (int)b, D, Mn);
        const int64_t r = r0;
        const int16_t* x = a.q + r * a.K + 32 * b;
        int s[2] = {0, 0};
        for (int i = 0; i < 32; ++i) s[i >> 4] += (int)q[i] * (int)x[i];
        const float dx = a.d[r * a.nb + b];
        const float* sx = a.sx + r * 2 * a.nb + b;
        float& l = acc[b % GROUP];
        if constexpr (F::HALVES) {
            l = std::fma((float)s[0], D[0] * dx, l);
            l = std::fma((float)s[1], D[1] * dx, l);
        } else {
            l = std::fma((float)(s[0] + s[1]), D[0] * dx, l);
        }
        if constexpr (F::MIN) {
            if constexpr (F::HALVES) {
                l = std::fma(Mn[0], sx[0], l);
                l = std::fma(Mn[1], sx[a.nb], l);
            } else {
                l = std::fma(Mn[0], sx[0] + sx[a.nb], l);
            }
        }
    }
    const float v = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    put(y + r0 * ys + c, v + (bias ? bias[c] : 0.f));
}
#endif

// Rows [r0, r1) against the columns [c0, c1) in tiles of up to RT rows by one column (a column's blocks unpacked once
// per tile).
template <typename F, int RT, typename T>
static void rows_by_groups(const Act& a, int64_t r0, int64_t r1, const uint8_t* w, int64_t rb, int64_t c0, int64_t c1,
                           const float* bias, T* y, int64_t ys) {
    for (int64_t r = r0; r < r1;) {
        const int R = (int)std::min<int64_t>(RT, r1 - r);
        for (int64_t c = c0; c < c1; ++c) {
            if constexpr (RT == 2) {
                if (R == 2) {
                    tile<F, 2>(a, r, w, rb, c, bias, y, ys);
                    continue;
                }
            }
            tile<F, 1>(a, r, w, rb, c, bias, y, ys);
        }
        r += R;
    }
}

// The rows [r0, r1) against the columns [c0, c1). The K-quants: tiles of up to two rows by one column, a column's
// blocks unpacked once per tile. The 32-block formats: tiles of up to 4 rows by 4 columns (one row: four columns'
// chains in flight).
template <typename F, typename T>
static void block(const Act& a, int64_t r0, int64_t r1, const uint8_t* w, int64_t rb, int64_t c0, int64_t c1,
                  const float* bias, T* y, int64_t ys) {
#ifdef FLOWRT_AVX2
    if constexpr (F::QK == 32) {
        for (int64_t r = r0; r < r1; r += 4) {
            const int R = (int)std::min<int64_t>(4, r1 - r);
            const auto rows = [&](auto cols, int64_t c) {
                constexpr int C = decltype(cols)::value;
                switch (R) {
                    case 4: tile_blocks<F, 4, C>(a, r, w, rb, c, bias, y, ys); break;
                    case 3: tile_blocks<F, 3, C>(a, r, w, rb, c, bias, y, ys); break;
                    case 2: tile_blocks<F, 2, C>(a, r, w, rb, c, bias, y, ys); break;
                    default: tile_blocks<F, 1, C>(a, r, w, rb, c, bias, y, ys); break;
                }
            };
            int64_t c = c0;
            if (R == 1)
                for (; c + 4 <= c1; c += 4) tile_blocks<F, 1, 4>(a, r, w, rb, c, bias, y, ys);
            for (; c + 2 <= c1; c += 2) rows(std::integral_constant<int, 2>{}, c);
            for (; c < c1; ++c) rows(std::integral_constant<int, 1>{}, c);
        }
    } else {
        rows_by_groups<F, 2>(a, r0, r1, w, rb, c0, c1, bias, y, ys);
    }
#else
    rows_by_groups<F, 1>(a, r0, r1, w, rb, c0, c1, bias, y, ys);
#endif
}

constexpr int64_t COLS = 16;  // columns per work item

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

// The scales of a row's SPAN blocks from b0 on: a K-quant's super-block decoded at once (scales8), a 32-block format's
// own block (scales). D(j, h), M(j, h): block b0 + j's scale and minimum for its half h (elements 16h .. 16h + 15).
template <typename F>
struct RowScales {
    static constexpr int SPAN = F::QK / 32, H = F::HALVES ? 2 : 1;
    float Ds[2 * SPAN], Ms[2 * SPAN];

    void load(const uint8_t* row, int64_t b0) {
        std::fill(Ms, Ms + 2 * SPAN, 0.f);
        if constexpr (SPAN == GROUP) F::scales8(row + b0 / GROUP * F::BYTES, Ds, Ms);
        else F::scales(row, (int)b0, Ds, Ms);
    }
    float D(int j, int h) const { return Ds[H * j + (H - 1) * h]; }
    float M(int j, int h) const { return Ms[H * j + (H - 1) * h]; }
};

// fn(s, b0, j) for each block b0 + j of a row of nb blocks, with s (a RowScales or BlockScales) loaded for its span.
template <typename Scales, typename Fn>
static inline void each_block(const uint8_t* row, int64_t nb, Fn&& fn) {
    for (int64_t b0 = 0; b0 < nb; b0 += Scales::SPAN) {
        Scales s;
        s.load(row, b0);
        #pragma GCC unroll 8
        for (int j = 0; j < Scales::SPAN; ++j) fn(s, b0, j);
    }
}

// Row n of W (nb blocks of 32) as float32.
template <typename F>
static inline void row_values(const uint8_t* row, int64_t nb, float* out) {
    each_block<RowScales<F>>(row, nb, [&](const RowScales<F>& s, int64_t b0, int j) {
        const int b = (int)(b0 + j);
        const __m256i q = F::qv(row, b);
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        #pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            __m256 v = _mm256_mul_ps(_mm256_set1_ps(s.D(j, i >> 1)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])));
            if constexpr (F::MIN) v = _mm256_add_ps(v, _mm256_set1_ps(s.M(j, i >> 1)));
            _mm256_store_ps(out + 32 * b + 8 * i, v);
        }
    });
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

#if defined(FLOWRT_AVX2) && defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define FLOWRT_QUANT_BF16 1
// A row's block scales as broadcasts for its blocks' 32 values (d0, m0 for elements 0-15, d1, m1 for 16-31): the
// K-quants with scales8v decode a super-block's at once as vectors (lane j for block j) and take block j's by one
// permute, not extracted and broadcast one by one from scalars; the other formats broadcast RowScales' floats.
template <typename F>
struct BlockScales {
    static constexpr bool VEC = F::QK == 32 * GROUP && has_scales8v<F>::value;
    static constexpr int SPAN = RowScales<F>::SPAN;
    __m256 D[2], M[2];
    RowScales<F> sc;

    void load(const uint8_t* row, int64_t b0) {
        if constexpr (VEC) {
            F::scales8v(row + b0 / GROUP * F::BYTES, D, M);
        } else {
            sc.load(row, b0);
        }
    }
    // block b0 + j's 32 values as bfloat16, from row_values' float32 (the same multiply and add) rounded to nearest
    // even, in one 512-bit vector
    __m512i bf16(const uint8_t* row, int64_t b0, int j) const {
        __m512 d0, d1, m0, m1;
        if constexpr (VEC) {
            const auto lane = [j](__m256 v) { return _mm512_permutexvar_ps(_mm512_set1_epi32(j), _mm512_castps256_ps512(v)); };
            d0 = lane(D[0]);  // one permute per distinct scale: the formats without halves share theirs
            d1 = F::HALVES ? lane(D[1]) : d0;
            m0 = F::MIN ? lane(M[0]) : _mm512_setzero_ps();
            m1 = F::MIN && F::HALVES ? lane(M[1]) : m0;
        } else {
            d0 = _mm512_set1_ps(sc.D(j, 0)), d1 = _mm512_set1_ps(sc.D(j, 1));
            m0 = _mm512_set1_ps(sc.M(j, 0)), m1 = _mm512_set1_ps(sc.M(j, 1));
        }
        const __m256i q = F::qv(row, (int)(b0 + j));
        __m512 v0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        __m512 v1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
        if constexpr (F::MIN) {
            v0 = _mm512_add_ps(v0, m0);
            v1 = _mm512_add_ps(v1, m1);
        }
        return (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
    }
};

// Row n of W (nb blocks of 32) as bfloat16, 32 a block in one vector, without the float32 row in memory.
template <typename F>
static inline void row_bf16(const uint8_t* row, int64_t nb, bf16_t* out) {
    each_block<BlockScales<F>>(row, nb, [&](const BlockScales<F>& s, int64_t b0, int j) {
        _mm512_storeu_si512(out + 32 * (b0 + j), s.bf16(row, b0, j));
    });
}

// bfloat16 activations from FLOAT_ROWS rows (the avx512bf16 variant): the weights dequantized 16 rows at a time to
// bfloat16 (their exact float32 values rounded to nearest even, as loading the file with quantization=None stores
// them) and multiplied with x itself by vdpbf16ps, 32 products an instruction: what the dequantized bfloat16 path
// computes (PackedLinearBF16), in another summation order, at twice the float32 FMAs' rate. Each output is one
// accumulator chain over k and one horizontal sum, whatever the tile: batch and thread invariant.
template <int MR, int NJ>
static inline void dot_tile(const bf16_t* x, int64_t xs, const bf16_t* w, int64_t K, const float* bias, bf16_t* y,
                            int64_t ys) {
    __m512 c[MR][NJ];
    #pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int j = 0; j < NJ; ++j) c[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh b[NJ];
        #pragma GCC unroll 4
        for (int j = 0; j < NJ; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
        #pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(x + r * xs + k);
            #pragma GCC unroll 4
            for (int j = 0; j < NJ; ++j) c[r][j] = _mm512_dpbf16_ps(c[r][j], v, b[j]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int j = 0; j < NJ; ++j)
            y[r * ys + j] = f32_to_bf16(_mm512_reduce_add_ps(c[r][j]) + (bias ? bias[j] : 0.f));
}

#ifdef FLOWRT_AMX
// r[i] lane c -> r[c] lane i, 16 x 16 32-bit elements: pairs of 32-bit, pairs of 64-bit, then 128-bit lanes.
static inline void transpose16(__m512i (&r)[16]) {
    __m512i t[16], u[16];
    for (int p = 0; p < 8; ++p) {
        t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
    }
    for (int p = 0; p < 4; ++p) {  // u[4p + m], lane L: column 4L + m of rows 4p .. 4p + 3
        u[4 * p] = _mm512_unpacklo_epi64(t[4 * p], t[4 * p + 2]);
        u[4 * p + 1] = _mm512_unpackhi_epi64(t[4 * p], t[4 * p + 2]);
        u[4 * p + 2] = _mm512_unpacklo_epi64(t[4 * p + 1], t[4 * p + 3]);
        u[4 * p + 3] = _mm512_unpackhi_epi64(t[4 * p + 1], t[4 * p + 3]);
    }
    for (int m = 0; m < 4; ++m) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i y0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xee), y1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xee);
        r[m] = _mm512_shuffle_i32x4(x0, x1, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(x0, x1, 0xdd);
        r[8 + m] = _mm512_shuffle_i32x4(y0, y1, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(y0, y1, 0xdd);
    }
}

// Panels g .. g + gn - 1 of W (32 rows each, zeros past N) dequantized into dst in gemm_bf16.h's packed layout (k pairs
// side by side), each value rounded to bf16 as above: the AMX tiles' B operand. Sixteen rows at a time, a block of
// each as one vector of 16 k pairs, and a 16 x 16 transpose of those vectors gives 16 whole cache lines of dst (a k
// pair's 16 columns). Most formats go straight from registers; Q4_K / Q5_K, whose two blocks of a 32-byte run unpack
// from the same bytes, go a super-block of 32 rows at a time through a row-major L1 staging buffer wb (measured, 1B
// gate_up at 16-64 rows, 2 threads, Xeon with AMX: from registers Q8_0 4.2 -> 2.8-3.7 ms, Q6_K 4.8 -> 4.6, Q4_K
// 4.3 -> 4.5-4.8; staged, the other way round). Scattered into dst element by element, the stores had taken two
// thirds of a 1B Q4_K projection's time.
template <typename F>
constexpr bool STAGED = F::MIN && BlockScales<F>::VEC;

static inline void store_transposed(__m512i (&r)[16], int32_t* dk) {
    transpose16(r);
    for (int t = 0; t < 16; ++t) _mm512_store_si512(reinterpret_cast<__m512i*>(dk + t * 32), r[t]);
}

template <typename F>
static void dequant_panels(const uint8_t* w, int64_t rb, int64_t N, int64_t K, int64_t g, int64_t gn, bf16_t* dst,
                           bf16_t* wb) {
    constexpr int SPAN = BlockScales<F>::SPAN;
    const int64_t nb = K / 32;
    for (int64_t q = 0; q < gn; ++q) {
        const uint8_t* rows[32];
        for (int i = 0; i < 32; ++i) {
            const int64_t n = 32 * (g + q) + i;
            rows[i] = n < N ? w + n * rb : nullptr;
        }
        int32_t* d = reinterpret_cast<int32_t*>(dst + q * K * 32);  // k pair kk's 32 columns at d[32 kk]
        if constexpr (STAGED<F>) {
            for (int64_t b0 = 0; b0 < nb; b0 += SPAN) {  // wb: 32 rows of the super-block's F::QK values
                for (int i = 0; i < 32; ++i) {
                    if (!rows[i]) {
                        std::memset(wb + i * F::QK, 0, F::QK * 2);
                        continue;
                    }
                    BlockScales<F> s;
                    s.load(rows[i], b0);
                    #pragma GCC unroll 8
                    for (int j = 0; j < SPAN; ++j) _mm512_store_si512(wb + i * F::QK + 32 * j, s.bf16(rows[i], b0, j));
                }
                for (int j = 0; j < SPAN; ++j)
                    for (int h = 0; h < 2; ++h) {
                        __m512i r[16];
                        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(wb + (16 * h + i) * F::QK + 32 * j);
                        store_transposed(r, d + 16 * (b0 + j) * 32 + 16 * h);
                    }
            }
        } else {
            for (int h = 0; h < 2; ++h)  // sixteen rows streamed along k at a time
                for (int64_t b0 = 0; b0 < nb; b0 += SPAN) {
                    BlockScales<F> s[16];
                    for (int i = 0; i < 16; ++i)
                        if (rows[16 * h + i]) s[i].load(rows[16 * h + i], b0);
                    for (int j = 0; j < SPAN; ++j) {
                        __m512i r[16];
                        for (int i = 0; i < 16; ++i) {
                            const uint8_t* row = rows[16 * h + i];
                            r[i] = row ? s[i].bf16(row, b0, j) : _mm512_setzero_si512();
                        }
                        store_transposed(r, d + 16 * (b0 + j) * 32 + 16 * h);
                    }
                }
        }
    }
}
#endif

template <typename F>
static void gemm_bf16_rows(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                           const float* bias, bf16_t* y, int64_t ys) {
    constexpr int NW = 16;  // rows of W per work item: 64 KiB of bf16 at K = 2048, in L2 while every row tile runs
    const int64_t rb = K / F::QK * F::BYTES, nb = K / 32, S = (N + NW - 1) / NW;
#ifdef FLOWRT_AMX
    if (amx_permitted()) {
        // on the AMX tiles, panels dequantized a group at a time (in L2) and every row run over each group: the
        // weights dequantized once per call. x streams past once per group, so from 256 rows (prefill) the groups
        // take 1 MiB (of these cores' 2 MiB of L2), not 256 KiB: at K = 2048 two panels a group had x read 128 times
        // per thread for a gate_up projection, and the tiles waited on it (1B shapes at 2048 rows, 2 threads, Xeon
        // with AMX: gate_up 78.9 -> 56.1 ms, qkv 13.6 -> 9.7 ms); at 64 rows the larger groups measured slower.
        const int64_t budget = M >= 256 ? (int64_t)1 << 20 : (int64_t)256 << 10;
        const int64_t G = std::max<int64_t>(1, budget / (K * 64));
        amx_gemm<false>(x, x_st, M, K, N, bias, y, ys, G, M, [&](int64_t g, int64_t gn) {
            bf16_t* dst = reinterpret_cast<bf16_t*>(scratch((size_t)(gn * K * 64), 1));
            dequant_panels<F>(w, rb, N, K, g, gn, dst, reinterpret_cast<bf16_t*>(scratch(32 * F::QK * 2, 4)));
            return static_cast<const bf16_t*>(dst);
        });
        return;
    }
#endif
    #pragma omp parallel num_threads(flowrt_threads)
    {
        bf16_t* wb = reinterpret_cast<bf16_t*>(scratch((size_t)(NW * K * 2), 1));
        #pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < S; ++s) {
            const int64_t n0 = NW * s;
            const int nr = (int)std::min<int64_t>(NW, N - n0);
            for (int j = 0; j < nr; ++j) {
                row_bf16<F>(w + (n0 + j) * rb, nb, wb + j * K);
            }
            for (int64_t r = 0; r < M; r += 4) {
                const int mr = (int)std::min<int64_t>(4, M - r);
                for (int j = 0; j < nr; j += 4) {
                    const int nj = std::min(4, nr - j);
                    const bf16_t* xr = x + r * x_st;
                    const bf16_t* wj = wb + j * K;
                    const float* bj = bias ? bias + n0 + j : nullptr;
                    bf16_t* yr = y + r * ys + n0 + j;
                    with_count<4>(mr, [&](auto R) {
                        with_count<4>(nj, [&](auto C) {
                            dot_tile<decltype(R)::value, decltype(C)::value>(xr, x_st, wj, K, bj, yr, ys);
                        });
                    });
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
    // guided: a thread's first items are long runs of adjacent columns (half of them, then half of the rest, ...),
    // which the hardware prefetchers stream well, and the last ones still balance a thread that fell behind. Against
    // one chunk of 16 columns at a time: one row, cold weights, 2 threads, Zen4 (a 16384 x 2048 projection,
    // 113 MB of copies cycled): 1B gate_up Q8_0 1.61 -> 1.26 ms, Q4_K 1.09 -> 0.86 ms; the 1B Q4_K_M decode step 1.36x.
    #pragma omp parallel for schedule(guided) if (M * N * a.K >= (1 << 18)) num_threads(flowrt_threads)
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
#ifdef FLOWRT_QUANT_BF16
    if constexpr (std::is_same_v<T, bf16_t>) {
        if (M >= FLOAT_ROWS) {  // every part in bfloat16 from x itself: no activation quantization
            int64_t at = 0;
            for (int p = 0; p < nparts; at += parts[p++].rows)
                qfmt::dispatch(parts[p].ggml_type, [&](auto tag) {
                    gemm_bf16_rows<typename decltype(tag)::type>(x, x_st, M, K, static_cast<const uint8_t*>(parts[p].w),
                                                                 parts[p].rows, parts[p].bias, y + at, y_st);
                });
            return 0;
        }
    }
#endif
    const int64_t nb = K / 32;
    uint8_t* buf = scratch((size_t)(4 * M * K + M * nb * 12 + 64));
    float* d = reinterpret_cast<float*>(buf + ((2 * M * K + 31) & ~(int64_t)31));
    float* sx = d + M * nb;
    if constexpr (std::is_same_v<T, float>) quant_act_f32(x, x_st, M, K, (int16_t*)buf, d, sx);
    else quant_act_bf16(x, x_st, M, K, (int16_t*)buf, d, sx);
    Act a{(const int16_t*)buf, d, sx, K, nb};
#ifdef FLOWRT_VNNI
    bool planes = false;  // only the byte-product formats read them: a Q8_0 or Q6_K projection skips the split
    for (int p = 0; p < nparts; ++p)
        qfmt::dispatch(parts[p].ggml_type, [&](auto tag) { planes |= BYTE_PRODUCTS<typename decltype(tag)::type>; });
    if (M < FLOAT_ROWS && planes) {
        uint8_t* lo = reinterpret_cast<uint8_t*>(sx + 2 * M * nb);
        byte_planes(a.q, M * K, lo, reinterpret_cast<int8_t*>(lo + M * K));
        a.lo = lo;
        a.hi = reinterpret_cast<const int8_t*>(lo + M * K);
    }
#endif
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

// 1 where bfloat16 inputs of FLOAT_ROWS rows and more run gemm_bf16_rows (x times the weights rounded to bfloat16).
int quant_gemm_bf16_rows() { return FLOWRT_ON(FLOWRT_QUANT_BF16); }

// The row count from which the products run in float32 (gemm_float), for the tests of both regimes.
int quant_gemm_float_rows() {
#ifdef FLOWRT_AVX2
    return (int)FLOAT_ROWS;
#else
    return 1 << 30;
#endif
}

}  // extern "C"
