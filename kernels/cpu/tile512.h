// AVX-512 micro-kernels of the bf16 flash attention kernel (attention.cpp): the score product S^T = K Q^T and the
// value product O = P V of one work item, 16 query vectors to a register. Two forms, chosen at compile time by the
// library variant (engine/cpu/build.py): with AVX512-BF16, bf16 operands packed in (d, d+1) or (t, t+1) pairs and
// one _mm512_dpbf16_ps per 32 products (float32 accumulation, P rounded to bf16 for the value product as
// FlashAttention does); with plain AVX-512, bf16 widened to float32 and 16-lane FMAs (P stays float32).
//
// Layouts (ss: query lanes of the item, a multiple of 16; "word": 32 bits):
//   scores s [t][ss]  float32, one row per key token, query vectors across (the softmax reduces down columns, in
//                     vectors);
//   bf16 form:  queries qp [D/2][ss] words (query i's (d, d+1) pair at [d/2][i]); keys read in place from the pool,
//               one token row broadcast a word at a time; probabilities pp [n/2][ss] words ((P[i][t], P[i][t+1])
//               at [t/2][i]); values vp [n/2][D] words ((V[t][d], V[t+1][d]) at [t/2][d]);
//   float form: queries qf [D][ss]; keys kf [t][D] and values vf [t][D] widened; probabilities are s itself.
#pragma once

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define FLOWRT_AVX512 1
#if defined(__AVX512BF16__)
#define FLOWRT_AVX512BF16 1
#endif

// Sixteen bf16, each in the low half of a 32-bit lane.
static inline __m512i zext16(const bf16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Sixteen bf16 as sixteen floats (exact: a shift).
static inline __m512 load16_bf16(const bf16_t* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(zext16(p), 16)); }

// Two consecutive bf16 as one 32-bit word (the first in the low half).
static inline int32_t load_pair(const bf16_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return w;
}

// The form's operands of a product: TileOps::Vec holds 16 lanes of the streamed operand (loaded from 16 Elems), and
// madd adds a broadcast Elem times it to 16 float32 accumulators. bf16 form: an Elem is a word of two bf16, and one
// dpbf16 adds both products; float form: an Elem is a float, and one FMA.
#ifdef FLOWRT_AVX512BF16
struct TileOps {
    using Elem = int32_t;
    using Vec = __m512bh;
    static inline Vec load(const int32_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static inline Vec bcast(int32_t w) { return (__m512bh)_mm512_set1_epi32(w); }
    static inline __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
};
#else
struct TileOps {
    using Elem = float;
    using Vec = __m512;
    static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
    static inline Vec bcast(float x) { return _mm512_set1_ps(x); }
    static inline __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
};
#endif

// The loop both products share: acc[r][c] += a(r, k) * b[k][16c .. 16c+15] for k < steps (b's rows bst Elems apart),
// MR x NC accumulators (at most 24) in registers while b streams and a(r, k) is broadcast.
template <int MR, int NC, typename A>
__attribute__((always_inline)) static inline void mac_tile(__m512 (&acc)[MR][NC], int steps, const TileOps::Elem* b,
                                                           int64_t bst, A a) {
    for (int k = 0; k < steps; ++k, b += bst) {
        TileOps::Vec bv[NC];
        #pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) bv[c] = TileOps::load(b + 16 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const TileOps::Vec av = TileOps::bcast(a(r, k));
            #pragma GCC unroll 4
            for (int c = 0; c < NC; ++c) acc[r][c] = TileOps::madd(acc[r][c], av, bv[c]);
        }
    }
}

// acc[r][c] to dst[r * rst + 16c ..]
template <int MR, int NC>
__attribute__((always_inline)) static inline void store_tile(const __m512 (&acc)[MR][NC], float* dst, int64_t rst) {
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + r * rst + 16 * c, acc[r][c]);
}

// ---- score tile: MR key tokens x 16*NQ query lanes of s, the reduction over the head streaming the queries (from
// L1) and broadcasting the keys.
#ifdef FLOWRT_AVX512BF16
template <int MR, int NQ>
static inline void score_tile(const bf16_t* const* krow, const int32_t* qp, int64_t ss, int D, float* s) {
    __m512 acc[MR][NQ] = {};
    mac_tile<MR, NQ>(acc, D / 2, qp, ss, [&](int r, int k) { return load_pair(krow[r] + 2 * k); });
    store_tile<MR, NQ>(acc, s, ss);
}
#else
template <int MR, int NQ>
static inline void score_tile(const float* kf, const float* qf, int64_t ss, int D, float* s) {
    __m512 acc[MR][NQ] = {};
    mac_tile<MR, NQ>(acc, D, qf, ss, [&](int r, int k) { return kf[r * D + k]; });
    store_tile<MR, NQ>(acc, s, ss);
}
#endif

// ---- value tile: MR query vectors x 16*ND columns of o (rows of D floats): o <- o * alpha + P V over the chunk's
// n key tokens (bf16 form: (n + 1) / 2 token pairs), the values streaming (from L1/L2) and P broadcast.
template <int MR, int ND>
static inline void value_tile(const TileOps::Elem* p, int64_t ss, const TileOps::Elem* v, int D, int n, float* o,
                              const float* alpha) {
    __m512 acc[MR][ND];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), a);
    }
#ifdef FLOWRT_AVX512BF16
    const int steps = (n + 1) / 2;
#else
    const int steps = n;
#endif
    mac_tile<MR, ND>(acc, steps, v, D, [&](int r, int k) { return p[k * ss + r]; });
    store_tile<MR, ND>(acc, o, D);
}

// The tiles for a run-time size: rows 1-6, vectors 1-4 (the register budget: 6 x 4 accumulators).
template <int NQ, typename K, typename Q>
static inline void score_rows(int mr, K k, Q q, int64_t ss, int D, float* s) {
    switch (mr) {
        case 6: score_tile<6, NQ>(k, q, ss, D, s); break;
        case 5: score_tile<5, NQ>(k, q, ss, D, s); break;
        case 4: score_tile<4, NQ>(k, q, ss, D, s); break;
        case 3: score_tile<3, NQ>(k, q, ss, D, s); break;
        case 2: score_tile<2, NQ>(k, q, ss, D, s); break;
        default: score_tile<1, NQ>(k, q, ss, D, s); break;
    }
}
template <typename K, typename Q>
static inline void score_block(int mr, int nq, K k, Q q, int64_t ss, int D, float* s) {
    switch (nq) {
        case 4: score_rows<4>(mr, k, q, ss, D, s); break;
        case 3: score_rows<3>(mr, k, q, ss, D, s); break;
        case 2: score_rows<2>(mr, k, q, ss, D, s); break;
        default: score_rows<1>(mr, k, q, ss, D, s); break;
    }
}
template <int ND, typename P, typename V>
static inline void value_rows(int mr, P p, int64_t ss, V v, int D, int n, float* o, const float* alpha) {
    switch (mr) {
        case 6: value_tile<6, ND>(p, ss, v, D, n, o, alpha); break;
        case 5: value_tile<5, ND>(p, ss, v, D, n, o, alpha); break;
        case 4: value_tile<4, ND>(p, ss, v, D, n, o, alpha); break;
        case 3: value_tile<3, ND>(p, ss, v, D, n, o, alpha); break;
        case 2: value_tile<2, ND>(p, ss, v, D, n, o, alpha); break;
        default: value_tile<1, ND>(p, ss, v, D, n, o, alpha); break;
    }
}
template <typename P, typename V>
static inline void value_block(int mr, int nd, P p, int64_t ss, V v, int D, int n, float* o, const float* alpha) {
    switch (nd) {
        case 4: value_rows<4>(mr, p, ss, v, D, n, o, alpha); break;
        case 3: value_rows<3>(mr, p, ss, v, D, n, o, alpha); break;
        case 2: value_rows<2>(mr, p, ss, v, D, n, o, alpha); break;
        default: value_rows<1>(mr, p, ss, v, D, n, o, alpha); break;
    }
}
#endif
