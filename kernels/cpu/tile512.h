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

// ---- score tile: MR key tokens x 16*NQ query lanes of s. MR * NQ accumulators (at most 24) stay in registers while
// the reduction over the head streams the queries (from L1) and broadcasts the keys.
#ifdef FLOWRT_AVX512BF16
template <int MR, int NQ>
static inline void score_tile(const bf16_t* const* krow, const int32_t* qp, int64_t ss, int D, float* s) {
    __m512 acc[MR][NQ];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int k = 0; k < D / 2; ++k, qp += ss) {
        __m512bh qv[NQ];
        #pragma GCC unroll 4
        for (int c = 0; c < NQ; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qp + 16 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(load_pair(krow[r] + 2 * k));
            #pragma GCC unroll 4
            for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kb, qv[c]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < NQ; ++c) _mm512_storeu_ps(s + r * ss + 16 * c, acc[r][c]);
}
#else
template <int MR, int NQ>
static inline void score_tile(const float* kf, const float* qf, int64_t ss, int D, float* s) {
    __m512 acc[MR][NQ];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int k = 0; k < D; ++k, qf += ss) {
        __m512 qv[NQ];
        #pragma GCC unroll 4
        for (int c = 0; c < NQ; ++c) qv[c] = _mm512_loadu_ps(qf + 16 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512 kb = _mm512_set1_ps(kf[r * D + k]);
            #pragma GCC unroll 4
            for (int c = 0; c < NQ; ++c) acc[r][c] = _mm512_fmadd_ps(kb, qv[c], acc[r][c]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < NQ; ++c) _mm512_storeu_ps(s + r * ss + 16 * c, acc[r][c]);
}
#endif

// ---- value tile: MR query vectors x 16*ND columns of o (rows of D floats): o <- o * alpha + P V over the chunk's
// n key tokens, MR * ND accumulators in registers while the values stream (from L1/L2) and P is broadcast.
#ifdef FLOWRT_AVX512BF16
template <int MR, int ND>
static inline void value_tile(const int32_t* pp, int64_t ss, const int32_t* vp, int D, int n, float* o,
                              const float* alpha) {
    __m512 acc[MR][ND];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), a);
    }
    for (int k = 0; k < (n + 1) / 2; ++k, pp += ss, vp += D) {
        __m512bh vv[ND];
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + 16 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[r]);
            #pragma GCC unroll 4
            for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}
#else
template <int MR, int ND>
static inline void value_tile(const float* pt, int64_t ss, const float* vf, int D, int n, float* o,
                              const float* alpha) {
    __m512 acc[MR][ND];
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), a);
    }
    for (int t = 0; t < n; ++t, pt += ss, vf += D) {
        __m512 vv[ND];
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(vf + 16 * c);
        #pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512 pb = _mm512_set1_ps(pt[r]);
            #pragma GCC unroll 4
            for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        #pragma GCC unroll 4
        for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}
#endif

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
