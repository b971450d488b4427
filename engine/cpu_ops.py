"""CPU kernels for the float32 path: the projections (weights prepacked in panels, PackedLinear), paged decode
attention that reads the KV pool in place (no gather), the KV cache write, residual-add + RMSNorm, SiLU x up and
rotary embedding in place.

The C++ source below is compiled lazily at first use with the system's C++ compiler (`$CXX` or g++), for this
CPU (-march=native), and the shared library is cached under ~/.cache/flowrt/cpu_ops/ keyed by the source, the
flags and the CPU's feature flags, so later starts only load it (milliseconds). It is plain C ABI called through
ctypes (no torch headers: compiling takes about a second) and parallelizes with OpenMP, which resolves to the
libgomp torch has already loaded (one thread pool). When no compiler is present, compiling fails, or
FLOWRT_CPU_OPS=0, `lib()` returns None and every caller uses its plain-torch path instead; the tests run both.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <omp.h>

// exp for x <= ~0 (softmax, silu): Cephes' single-precision polynomial, ~1e-7 relative error; written so
// that the compiler vectorizes loops calling it.
static inline float fexp(float x) {
    x = std::min(std::max(x, -87.3f), 88.3f);
    float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLOWRT_AVX2 1
// [sum(a0), ..., sum(a7)]: eight horizontal sums in one vector (a transpose-and-add tree instead of eight
// separate reductions).
// fexp on eight lanes, the same operations in the same order (the build keeps multiplies and adds unfused), so the
// vector and scalar paths agree bit for bit. Written out because GCC's vectorized fexp ran at ~10 cycles an element.
static inline __m256 fexp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                   _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 hsum8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// r[i][j] <- r[j][i] for eight vectors of eight.
static inline void transpose8(__m256* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// max(x[0..n)), eight lanes at a time.
static inline float row_max(const float* x, int n) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int t = 0;
    for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vm);
    float m = lanes[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
    for (; t < n; ++t) m = std::max(m, x[t]);
    return m;
}
#endif

// x[t] <- exp(x[t] - m) for t < n, returning their sum: the softmax numerators (eight lanes at a time with AVX2).
static inline float exp_sum(float* x, int n, float m) {
    float sum = 0.f;
    int t = 0;
#ifdef FLOWRT_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = fexp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), vm));
        _mm256_storeu_ps(x + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vs);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
    for (; t < n; ++t) { const float e = fexp(x[t] - m); x[t] = e; sum += e; }
    return sum;
}

// Decode attention for one (sequence, KV head) without AVX2 (or for a head size not a multiple of 8): its G query
// heads against tokens start .. end-1, read in place from the paged pool [N, bs, Hkv, D].
static void decode_scalar(const float* qp, const float* kc, const float* vc, const int32_t* tab, int start, int end,
                          int Hkv, int kh, int G, int D, int bs, float scale, float* op, float* lse_out,
                          std::vector<float>& s) {
    const int L = end - start;
    s.resize((size_t)G * L);
    const int64_t tok_st = (int64_t)Hkv * D;
    auto row = [&](const float* cache, int pos) {
        return cache + ((int64_t)tab[pos / bs] * bs + pos % bs) * tok_st + (int64_t)kh * D;
    };
    for (int pos = start; pos < end; ++pos) {
        const float* kp = row(kc, pos);
        for (int g = 0; g < G; ++g) {
            const float* qg = qp + g * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int d = 0; d < D; ++d) acc += qg[d] * kp[d];
            s[(size_t)g * L + (pos - start)] = acc * scale;
        }
    }
    for (int g = 0; g < G; ++g) {
        float* sg = s.data() + (size_t)g * L;
        float m = -INFINITY;
        for (int t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        const float sum = exp_sum(sg, L, m);
        const float inv = 1.f / sum;
        if (lse_out) lse_out[g] = m + std::log(sum);
        float acc[256];
        for (int d = 0; d < D; ++d) acc[d] = 0.f;
        for (int pos = start; pos < end; ++pos) {
            const float* vp = row(vc, pos);
            const float pr = sg[pos - start];
            #pragma omp simd
            for (int d = 0; d < D; ++d) acc[d] += pr * vp[d];
        }
        for (int d = 0; d < D; ++d) op[g * D + d] = acc[d] * inv;
    }
}

#ifdef FLOWRT_AVX2
// Decode attention for the KV heads kh0 .. kh0+nkh-1 of one sequence, each with its G query heads (qp, op and lse_out
// point at query head kh0 * G), against tokens start .. end-1 read in place from the paged pool [N, bs, Hkv, D].
// DD > 0 fixes the head size (a multiple of 8) at compile time. Scores are computed for eight tokens at a time (one
// vector of eight dot products, no reduction per token); the weighted sum of values walks the tokens block by
// block, each head's accumulator row held in registers across a block's tokens. With every head of the sequence
// (nkh = Hkv, independent sequences) a token's row is read whole, contiguous and once, instead of one head's slice
// per item: Zen3, 2 threads, 32 sequences x 300 tokens x 30 layers 33 -> 30 ms, and 41 against 25 GB/s from L3.
template <int DD>
static void decode_heads(const float* qp, const float* kc, const float* vc, const int32_t* tab, int start, int end,
                         int Hkv, int kh0, int nkh, int G, int Drt, int bs, float scale, float* op, float* lse_out,
                         std::vector<float>& s) {
    const int D = DD > 0 ? DD : Drt;
    const int C = D / 8;
    const int NH = nkh * G;  // query heads served
    const int L = end - start;
    const int Ls = (L + 7) & ~7;  // each head's score row, padded to whole vectors
    s.resize((size_t)NH * Ls + (size_t)NH * D + 8 * (size_t)NH);
    float* scores = s.data();
    float* acc_rows = scores + (size_t)NH * Ls;  // each head's weighted sum of values so far
    float* run_max = acc_rows + (size_t)NH * D;  // each head's eight lanes of running maxima
    const int64_t tok_st = (int64_t)Hkv * D;
    const float* k0 = kc + (int64_t)kh0 * D;
    const float* v0 = vc + (int64_t)kh0 * D;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(run_max + 8 * h, _mm256_set1_ps(-INFINITY));
    // a cursor over (block, offset) instead of a division and a modulo for every token's row
    int bi = start / bs, off = start % bs;
    const float* blk = k0 + (int64_t)tab[bi] * bs * tok_st;
    for (int pos = start; pos < end; pos += 8) {
        const int n = std::min(8, end - pos);
        const float* kp[8];
        for (int j = 0; j < n; ++j) {
            kp[j] = blk + (int64_t)off * tok_st;
            if (++off == bs && pos + j + 1 < end) {
                off = 0;
                blk = k0 + (int64_t)tab[++bi] * bs * tok_st;
            }
        }
        for (int j = n; j < 8; ++j) kp[j] = kp[0];
        for (int h = 0; h < NH; ++h) {
            const float* qh = qp + (int64_t)h * D;
            const int ko = (h / G) * D;
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
            for (int c = 0; c < C; ++c) {
                const __m256 qv = _mm256_loadu_ps(qh + 8 * c);
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[j] + ko + 8 * c), acc[j]);
            }
            // a partial last group's extra lanes land in the row's padding (they repeat the group's first token's
            // score, so the running maximum stays exact)
            const __m256 sc = _mm256_mul_ps(hsum8(acc), vscale);
            _mm256_storeu_ps(scores + (size_t)h * Ls + (pos - start), sc);
            _mm256_storeu_ps(run_max + 8 * h, _mm256_max_ps(_mm256_loadu_ps(run_max + 8 * h), sc));
        }
    }
    for (int h = 0; h < NH; ++h) {
        const float m = row_max(run_max + 8 * h, 8);
        const float sum = exp_sum(scores + (size_t)h * Ls, L, m);
        run_max[8 * h] = 1.f / sum;  // the lanes are free now: keep the normalizer
        if (lse_out) lse_out[h] = m + std::log(sum);
    }
    for (int i = 0; i < NH * D; ++i) acc_rows[i] = 0.f;
    for (int pos = start; pos < end;) {
        const int n = std::min(bs - pos % bs, end - pos);
        const float* vrow = v0 + ((int64_t)tab[pos / bs] * bs + pos % bs) * tok_st;
        for (int h = 0; h < NH; ++h) {
            const float* ph = scores + (size_t)h * Ls + (pos - start);
            for (int c0 = 0; c0 < C; c0 += 8) {  // eight vectors of the row at a time (all of it for D <= 64)
                const int cn = std::min(8, C - c0);
                float* ah = acc_rows + (int64_t)h * D + 8 * c0;
                __m256 acc[8];
                for (int c = 0; c < cn; ++c) acc[c] = _mm256_loadu_ps(ah + 8 * c);
                const float* vp = vrow + (h / G) * D + 8 * c0;
                for (int i = 0; i < n; ++i, vp += tok_st) {
                    const __m256 pr = _mm256_set1_ps(ph[i]);
                    for (int c = 0; c < cn; ++c) acc[c] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vp + 8 * c), acc[c]);
                }
                for (int c = 0; c < cn; ++c) _mm256_storeu_ps(ah + 8 * c, acc[c]);
            }
        }
        pos += n;
    }
    for (int h = 0; h < NH; ++h) {
        const __m256 vinv = _mm256_set1_ps(run_max[8 * h]);
        for (int c = 0; c < C; ++c)
            _mm256_storeu_ps(op + (int64_t)h * D + 8 * c,
                             _mm256_mul_ps(_mm256_loadu_ps(acc_rows + (int64_t)h * D + 8 * c), vinv));
    }
}
#endif

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
static void gemm_small(const float* x, int64_t xs, int M, int K, const float* wp, int panels, int last, float* y,
                       int64_t ys) {
    for (int p = 0; p < panels; ++p)
        for (int r = 0; r < M; r += 6)
            gemm_rows<false>(std::min(6, M - r), x + r * xs, xs, K, wp + (int64_t)p * K * 16, nullptr,
                             y + r * ys + p * 16, ys, p == panels - 1 ? last : 16, nullptr, 0);
}
#endif

extern "C" {

// 1 when the packed projections are compiled in (AVX2 + FMA), else 0 (callers keep their other path).
int gemm_packed_available() {
#ifdef FLOWRT_AVX2
    return 1;
#else
    return 0;
#endif
}

// W [N, K] row-major (row stride w_st) -> panels (see above); wp holds ceil(N/16) * K * 16 floats, 32-byte aligned.
void gemm_pack_f32(const float* w, int64_t w_st, int64_t N, int64_t K, float* wp) {
    const int64_t P = (N + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; ++p) {
        float* dst = wp + p * K * 16;
        for (int j = 0; j < 16; ++j) {
            const int64_t n = p * 16 + j;
            if (n < N) for (int64_t k = 0; k < K; ++k) dst[k * 16 + j] = w[n * w_st + k];
            else for (int64_t k = 0; k < K; ++k) dst[k * 16 + j] = 0.f;
        }
    }
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
        #pragma omp parallel for schedule(dynamic, 1)
        for (int64_t it = 0; it < RB * P; ++it) {  // block-major: both threads share a row block's x in turn
            const int64_t r0 = it / P * MC;
            run(it % P, r0, std::min(M, r0 + MC), nullptr);
        }
        return 0;
    }
    const bool prefetch = T >= 2 && T <= 16;
    // guided: a thread slowed by the host (these VMs' vCPUs vary) takes fewer panels instead of holding the step
    #pragma omp parallel for schedule(guided) if (M * N * K >= 262144)
    for (int64_t p = 0; p < P; ++p) run(p, 0, M, prefetch && p + 1 < P ? wp + (p + 1) * K * 16 : nullptr);
    return 0;
#else
    return -1;
#endif
}

// Decode attention (one query token per sequence) over a paged pool [N, bs, Hkv, D] float32, in place.
// Sequence b's query row is rows[b] (or b when rows is null); it attends tokens start .. seq_lens[b]-1 of its
// block table. out rows follow q rows. lse (nullable) gets [B, H] log-sum-exp of the scaled scores.
// Returns -1 (doing nothing) for a head size it does not handle.
int paged_decode_f32(const float* q, int64_t q_st, const float* kc, const float* vc, const int32_t* tables,
                     int64_t tab_st, const int32_t* seq_lens, const int64_t* rows, int32_t start, float* out,
                     int64_t o_st, float* lse, int B, int H, int Hkv, int D, int bs, float scale, int heads_outer) {
    if (D > 256) return -1;
    const int G = H / Hkv;
    // Items: whole sequences (all their heads) for independent sequences, as long as there are enough to keep
    // every thread busy; else (sequence, KV head) pairs, in one of two orders. heads_outer (sequences sharing a
    // prefix: forks, prefix-cache hits): consecutive items (one thread's, and the two threads' neighbouring ones)
    // read the same head's keys and values, so the shared prefix stays in the core's L2 for all of them instead of
    // cycling every head's copy through L3. Otherwise a sequence's heads run back to back.
    const bool whole = !heads_outer && B >= omp_get_max_threads();
    const int per_item = whole ? Hkv : 1;
    const int items = whole ? B : Hkv * B;
    #pragma omp parallel
    {
        std::vector<float> s;
        #pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int kh0 = whole ? 0 : heads_outer ? item / B : item % Hkv;
            const int b = whole ? item : heads_outer ? item % B : item / Hkv;
            const int64_t row = rows ? rows[b] : b;
            const float* qp = q + row * q_st + (int64_t)kh0 * G * D;
            float* op = out + row * o_st + (int64_t)kh0 * G * D;
            float* lp = lse ? lse + (int64_t)b * H + kh0 * G : nullptr;
            const int end = seq_lens[b];
            if (end <= start) {
                for (int i = 0; i < per_item * G * D; ++i) op[i] = 0.f;
                if (lp) for (int g = 0; g < per_item * G; ++g) lp[g] = -INFINITY;
                continue;
            }
            const int32_t* tab = tables + (int64_t)b * tab_st;
#ifdef FLOWRT_AVX2
            if (D % 8 == 0) {
                auto run = D == 64 ? decode_heads<64> : D == 128 ? decode_heads<128> : decode_heads<0>;
                run(qp, kc, vc, tab, start, end, Hkv, kh0, per_item, G, D, bs, scale, op, lp, s);
                continue;
            }
#endif
            for (int k = 0; k < per_item; ++k)
                decode_scalar(qp + k * G * D, kc, vc, tab, start, end, Hkv, kh0 + k, G, D, bs, scale, op + k * G * D,
                              lp ? lp + k * G : nullptr, s);
        }
    }
    return 0;
}

// Attention of many query rows that read the same block table (a sequence's prefill chunk; every member of a group
// that shares a prefix, against that prefix), as small matrix products instead of one row at a time. Rows are
// grouped: group g is rows group_start[g] .. group_start[g+1]-1 (indices into rows/ends), reading block table g;
// row i attends the keys key_start .. ends[i]-1 of it. Work items are (group, KV head, tile of rows); a tile's query
// vectors are its rows x the query heads of the KV head. An item walks its keys in chunks of FLASH_CHUNK tokens: it
// packs the chunk's keys (transposed) and values into projection panels in its own buffers, computes the tile's
// scores and weighted values with gemm_tile (FMA-bound from L1/L2) and keeps an online softmax per query vector.
// Outputs: without lse_in, out is written, with lse_out (nullable, [R, H] in the order of rows) the log-sum-exp of
// each row's scores (-inf, and a zero output, for a row without keys); with lse_in, out already holds each row's
// attention over other keys with that log-sum-exp, and the two parts are merged.
// Returns -1 (doing nothing) without AVX2 + FMA or for a head size not a multiple of 16 (up to 256).
constexpr int FLASH_CHUNK = 256;
// query vectors a tile at most: each packed chunk serves them all (Zen3, 2 threads: 72 was a few % ahead of 24-48)
constexpr int FLASH_TILE_Q = 72;

#ifdef FLOWRT_AVX2
namespace {
struct FlashArgs {
    const float* q; int64_t q_st; const int64_t* rows; const int32_t* ends; const float* kc; const float* vc;
    float* out; int64_t o_st; const float* lse_in; float* lse_out; int H, Hkv, D, bs; float scale;
};

// The keys key_start + c0 .. + n of block table `tab`, KV head kh: keys as n/16 panels [D][16] (transposed eight by
// eight; a partial last panel padded with zero keys), values as D/16 panels [n][16].
static void flash_pack(const FlashArgs& a, const int32_t* tab, int kh, int pos0, int n, float* kp, float* vp) {
    const int D = a.D, bs = a.bs;
    const int64_t tok_st = (int64_t)a.Hkv * D;
    alignas(32) static const float zeros[256] = {};
    for (int p0 = 0; p0 < n; p0 += 16) {
        const float* krow[16];
        for (int j = 0; j < 16; ++j) {
            if (p0 + j >= n) {
                krow[j] = zeros;
                continue;
            }
            const int pos = pos0 + p0 + j;
            const int64_t off = ((int64_t)tab[pos / bs] * bs + pos % bs) * tok_st + (int64_t)kh * D;
            krow[j] = a.kc + off;
            const float* vs = a.vc + off;
            for (int dp = 0; dp < D / 16; ++dp) std::memcpy(vp + ((size_t)dp * n + p0 + j) * 16, vs + dp * 16, 64);
        }
        float* kdst = kp + (size_t)p0 * D;
        for (int j0 = 0; j0 < 16; j0 += 8)
            for (int d0 = 0; d0 < D; d0 += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(krow[j0 + j] + d0);
                transpose8(r);
                for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kdst + (d0 + d) * 16 + j0, r[d]);
            }
    }
}

struct FlashScratch {
    std::vector<float> buf;
    float *kp, *vp, *qt, *sc, *oc, *ob, *m, *l;
    void size(int Mq, int D) {
        const size_t pk = (size_t)FLASH_CHUNK * D;
        const size_t need = 2 * pk + (size_t)Mq * (3 * D + FLASH_CHUNK + 2) + 8;
        if (buf.size() < need) buf.resize(need);
        kp = buf.data() + ((-(reinterpret_cast<uintptr_t>(buf.data()) / 4)) & 7);  // 32-byte aligned panels
        vp = kp + pk;
        qt = vp + pk;
        sc = qt + (size_t)Mq * D;
        oc = sc + (size_t)Mq * FLASH_CHUNK;
        ob = oc + (size_t)Mq * D;
        m = ob + (size_t)Mq * D;
        l = m + Mq;
    }
};

// One work item: rows idx[0..nr) (indices into rows/ends) of one group, KV head kh, keys key_start .. ends-1.
static void flash_tile(const FlashArgs& a, const int32_t* tab, int key_start, int kh, int i0, int nr,
                       FlashScratch& w) {
    const int D = a.D, G = a.H / a.Hkv, Mq = nr * G;
    int E = key_start;
    for (int r = 0; r < nr; ++r) E = std::max(E, a.ends[i0 + r]);
    for (int i = 0; i < Mq; ++i) {
        const float* src = a.q + a.rows[i0 + i / G] * a.q_st + ((int64_t)kh * G + i % G) * D;
        for (int d = 0; d < D; ++d) w.qt[(size_t)i * D + d] = src[d] * a.scale;
        w.m[i] = -INFINITY;
        w.l[i] = 0.f;
    }
    std::memset(w.ob, 0, sizeof(float) * (size_t)Mq * D);
    for (int c0 = key_start; c0 < E; c0 += FLASH_CHUNK) {
        const int n = std::min(FLASH_CHUNK, E - c0), np = (n + 15) / 16;
        flash_pack(a, tab, kh, c0, n, w.kp, w.vp);
        gemm_small(w.qt, D, Mq, D, w.kp, np, n - (np - 1) * 16, w.sc, FLASH_CHUNK);
        for (int i = 0; i < Mq; ++i) {
            float* si = w.sc + (size_t)i * FLASH_CHUNK;
            const int ni = std::min(n, a.ends[i0 + i / G] - c0);  // this row's keys in the chunk (causal limit)
            if (ni <= 0) {
                std::memset(si, 0, sizeof(float) * n);
                continue;
            }
            const float mn = std::max(w.m[i], row_max(si, ni));
            const float alpha = w.m[i] == -INFINITY ? 0.f : fexp(w.m[i] - mn);
            const float sum = exp_sum(si, ni, mn);
            for (int t = ni; t < n; ++t) si[t] = 0.f;
            w.l[i] = w.l[i] * alpha + sum;
            w.m[i] = mn;
            if (alpha != 1.f)
                for (int d = 0; d < D; ++d) w.ob[(size_t)i * D + d] *= alpha;
        }
        gemm_small(w.sc, FLASH_CHUNK, Mq, n, w.vp, D / 16, 16, w.oc, D);  // value panel dp starts at dp * n * 16
        for (size_t x = 0; x < (size_t)Mq * D; ++x) w.ob[x] += w.oc[x];
    }
    for (int i = 0; i < Mq; ++i) {
        const int64_t row = a.rows[i0 + i / G], h = (int64_t)kh * G + i % G, st = (int64_t)(i0 + i / G) * a.H + h;
        float* dst = a.out + row * a.o_st + h * D;
        const float* o = w.ob + (size_t)i * D;
        const float lp = w.l[i] > 0.f ? w.m[i] + std::log(w.l[i]) : -INFINITY;
        if (a.lse_in) {  // merge with the part already in dst (normalized, log-sum-exp lse_in) by their weights
            const float lo = a.lse_in[st], mm = std::max(lp, lo);
            if (mm == -INFINITY) continue;
            const float pa = lp == -INFINITY ? 0.f : std::exp(lp - mm), pb = lo == -INFINITY ? 0.f : std::exp(lo - mm);
            const float wp = pa / (pa + pb) / (w.l[i] > 0.f ? w.l[i] : 1.f), wo = pb / (pa + pb);
            for (int d = 0; d < D; ++d) dst[d] = o[d] * wp + (wo != 0.f ? dst[d] * wo : 0.f);
            continue;
        }
        const float inv = w.l[i] > 0.f ? 1.f / w.l[i] : 0.f;
        for (int d = 0; d < D; ++d) dst[d] = o[d] * inv;
        if (a.lse_out) a.lse_out[st] = lp;
    }
}
}  // namespace
#endif

int paged_flash_f32(const float* q, int64_t q_st, const int64_t* rows, const int32_t* ends,
                    const int32_t* group_start, int NG, const int32_t* tables, int64_t tab_st, int key_start,
                    const float* kc, const float* vc, float* out, int64_t o_st, const float* lse_in, float* lse_out,
                    int H, int Hkv, int D, int bs, float scale) {
#ifdef FLOWRT_AVX2
    if (D % 16 != 0 || D > 256) return -1;
    const int G = H / Hkv;
    const int rt = std::max(1, FLASH_TILE_Q / G);  // rows per tile at most: ~FLASH_TILE_Q query vectors a tile
    // items: (group, KV head, tile), numbered through a prefix sum of each group's tiles
    std::vector<int64_t> first(NG + 1, 0);
    for (int g = 0; g < NG; ++g) {
        const int nr = group_start[g + 1] - group_start[g];
        first[g + 1] = first[g] + (int64_t)Hkv * ((nr + rt - 1) / rt);
    }
    const FlashArgs a{q, q_st, rows, ends, kc, vc, out, o_st, lse_in, lse_out, H, Hkv, D, bs, scale};
    #pragma omp parallel if (first[NG] > 1)
    {
        static thread_local FlashScratch w;
        w.size(rt * G, D);
        int g = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < first[NG]; ++item) {
            while (first[g + 1] <= item) ++g;
            while (first[g] > item) --g;
            const int nr = group_start[g + 1] - group_start[g], tiles = (nr + rt - 1) / rt;
            const int rows_t = (nr + tiles - 1) / tiles;  // the group's rows spread evenly over its tiles
            const int64_t local = item - first[g];
            const int kh = (int)(local / tiles), t = (int)(local % tiles);
            const int i0 = group_start[g] + t * rows_t;
            flash_tile(a, tables + (int64_t)g * tab_st, key_start, kh, i0, std::min(rows_t, group_start[g + 1] - i0),
                       w);
        }
    }
    return 0;
#else
    return -1;
#endif
}

// The step's new keys and values into their cache slots: row t of k/v (W floats, row strides k_st/v_st) to row
// slots[t] of the pools (n_slots rows of W floats). One call for both, instead of two indexed copies through torch.
// Returns -1, writing nothing, when a slot is out of range.
int kv_write_f32(const float* k, int64_t k_st, const float* v, int64_t v_st, float* kc, float* vc,
                 const int64_t* slots, int64_t T, int W, int64_t n_slots) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= n_slots) return -1;
    #pragma omp parallel for schedule(static) if (T * W >= 262144)
    for (int64_t t = 0; t < T; ++t) {
        std::memcpy(kc + slots[t] * W, k + t * k_st, sizeof(float) * W);
        std::memcpy(vc + slots[t] * W, v + t * v_st, sizeof(float) * W);
    }
    return 0;
}

// The row-wise kernels below split rows over the threads from ~8k elements (a decode step of 8-16 sequences):
// measured on Zen3, 2 threads, silu_mul + two add_rmsnorm of 32 rows take 96 us per layer split, 171 us not.

// h += delta (when delta is not null), then out = w * (h * rsqrt(mean(h^2) + eps)). Rows of E floats.
void add_rmsnorm_f32(float* h, const float* delta, const float* w, float* out, int64_t T, int E, float eps) {
    #pragma omp parallel for schedule(static) if (T * E >= 8192)
    for (int64_t t = 0; t < T; ++t) {
        float* hr = h + t * E;
        if (delta) {
            const float* dr = delta + t * E;
            #pragma omp simd
            for (int i = 0; i < E; ++i) hr[i] = hr[i] + dr[i];
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < E; ++i) ss += hr[i] * hr[i];
        const float r = 1.f / std::sqrt(ss / (float)E + eps);
        float* orow = out + t * E;
        #pragma omp simd
        for (int i = 0; i < E; ++i) orow[i] = w[i] * (hr[i] * r);
    }
}

// Rotary embedding (rotate-half convention) in place on nh heads of D at the start of each row of x.
void rope_f32(float* x, int64_t row_st, int64_t T, int nh, int D, const float* cos_t, const float* sin_t,
              const int64_t* pos) {
    const int h = D / 2;
    #pragma omp parallel for schedule(static) if (T * nh * D >= 8192)
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos_t + pos[t] * D;
        const float* s = sin_t + pos[t] * D;
        for (int j = 0; j < nh; ++j) {
            float* v = x + t * row_st + (int64_t)j * D;
            #pragma omp simd
            for (int i = 0; i < h; ++i) {
                const float a = v[i], b = v[i + h];
                v[i] = a * c[i] - b * s[i];
                v[i + h] = b * c[i + h] + a * s[i + h];
            }
        }
    }
}

// out[t] = silu(gu[t, :I]) * gu[t, I:] for rows of the fused gate+up projection [T, 2I] (row stride gu_st):
// one pass instead of silu, then a multiply (each a full read and write of the activations).
void silu_mul_f32(const float* gu, int64_t gu_st, float* out, int64_t T, int I) {
    #pragma omp parallel for schedule(static) if (T * I >= 8192)
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gu + t * gu_st;
        const float* u = g + I;
        float* o = out + t * (int64_t)I;
        int i = 0;
#ifdef FLOWRT_AVX2
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 den = _mm256_add_ps(one, fexp8(_mm256_sub_ps(zero, gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; ++i) o[i] = g[i] / (1.f + fexp(-g[i])) * u[i];
    }
}

}  // extern "C"
"""

FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_disabled = False


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def cache_dir() -> Path:
    base = os.environ.get("FLOWRT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flowrt")
    return Path(base) / "cpu_ops"


def build(force: bool = False) -> Path:
    """Compiles the library (or finds it cached) and returns its path. Raises RuntimeError on failure."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found)")
    key = hashlib.sha256("\0".join([SOURCE, cxx, *FLAGS, _cpu_key(), torch.__version__]).encode()).hexdigest()[:16]
    out = cache_dir() / f"flowrt_cpu_ops_{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "cpu_ops.cpp"
        src.write_text(SOURCE)
        so = Path(tmp) / out.name
        proc = subprocess.run([cxx, *FLAGS, str(src), "-o", str(so)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr[-2000:]}")
        os.replace(so, out)  # atomic: concurrent builders race harmlessly
    return out


def _declare(lib: ctypes.CDLL) -> None:
    P, I64, I32, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.paged_decode_f32.restype = ctypes.c_int
    lib.paged_decode_f32.argtypes = [P, I64, P, P, P, I64, P, P, I32, P, I64, P, I32, I32, I32, I32, I32, F, I32]
    lib.add_rmsnorm_f32.argtypes = [P, P, P, P, I64, I32, F]
    lib.paged_flash_f32.argtypes = [P, I64, P, P, P, I32, P, I64, I32, P, P, P, I64, P, P, I32, I32, I32, I32, F]
    lib.paged_flash_f32.restype = ctypes.c_int
    lib.kv_write_f32.argtypes = [P, I64, P, I64, P, P, P, I64, I32, I64]
    lib.kv_write_f32.restype = ctypes.c_int
    lib.rope_f32.argtypes = [P, I64, I64, I32, I32, P, P, P]
    lib.silu_mul_f32.argtypes = [P, I64, P, I64, I32]
    lib.gemm_pack_f32.argtypes = [P, I64, I64, I64, P]
    lib.gemm_packed_f32.argtypes = [P, I64, I64, I64, P, I64, P, P, I64]
    lib.gemm_packed_f32.restype = ctypes.c_int
    lib.gemm_packed_available.restype = ctypes.c_int
    for f in (lib.add_rmsnorm_f32, lib.rope_f32, lib.silu_mul_f32, lib.gemm_pack_f32):
        f.restype = None


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they are unavailable (then callers use plain torch)."""
    global _lib, _tried, _error
    if _tried:
        return None if _disabled else _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("FLOWRT_CPU_OPS", "1") == "0":
            _error = "disabled by FLOWRT_CPU_OPS=0"
        else:
            try:
                path = build()
                cdll = ctypes.CDLL(str(path))
                _declare(cdll)
                _lib = cdll
            except Exception as exc:  # noqa: BLE001 - no compiler, failed build, unloadable library: use torch
                _error = str(exc)
                logger.warning("flowrt CPU kernels unavailable, using plain torch: %s", exc)
        _tried = True
    return None if _disabled else _lib


def set_enabled(enabled: bool) -> None:
    """Tests and benchmarks: force the plain-torch paths (False) or use the kernels again (True)."""
    global _disabled
    _disabled = not enabled


def enabled() -> bool:
    """False while set_enabled(False) is in force (loaded or not)."""
    return not _disabled


def available() -> bool:
    return lib() is not None


def _p(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


# ---- wrappers (float32 CPU tensors; callers check `lib()` and dtypes first) ------------------------------

def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out, scale: float, rows=None, start: int = 0,
                 lse=None, shared_prefix: bool = False) -> None:
    """q/out [*, H, D] (rows contiguous in the last two dims), caches [N, bs, Hkv, D] contiguous float32,
    block_tables int32 [B, W] (row-contiguous), seq_lens int32 [B], rows int64 [B] or None, lse float32 [B, H].
    shared_prefix: the sequences share their first blocks (the work is ordered to keep that prefix in L2)."""
    N, bs, Hkv, D = k_cache.shape
    H = q.shape[1]
    B = seq_lens.shape[0]
    rc = _lib.paged_decode_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                               block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), _p(rows), start,
                               out.data_ptr(), out.stride(0), _p(lse), B, H, Hkv, D, bs, scale, int(shared_prefix))
    if rc != 0:
        raise ValueError(f"paged_decode: head size {D} not supported")


def flash_supported(head_dim: int) -> bool:
    """Whether paged_flash runs here for this head size (the kernels are loaded, with AVX2 + FMA)."""
    return head_dim % 16 == 0 and head_dim <= 256 and lib() is not None and bool(_lib.gemm_packed_available())


def paged_flash(q, k_cache, v_cache, rows, ends, group_start, tables, out, scale: float, key_start: int = 0,
                lse_in=None, lse_out=None) -> None:
    """Rows of q [*, H, D] (rows contiguous in the last two dims) attend keys of the pools [N, bs, Hkv, D] float32 in
    place. Group g is the rows rows[group_start[g]:group_start[g+1]] (int64 flat rows; group_start int32 [NG+1]),
    reading block table tables[g] (int32 [NG, W], row-contiguous); row i attends keys key_start .. ends[i]-1 (ends
    int32 [R]). lse_out (float32 [R, H]) receives each row's log-sum-exp; with lse_in instead, out already holds each
    row's attention over other keys with that log-sum-exp and the two are merged."""
    N, bs, Hkv, D = k_cache.shape
    rc = _lib.paged_flash_f32(q.data_ptr(), q.stride(0), rows.data_ptr(), ends.data_ptr(), group_start.data_ptr(),
                              group_start.shape[0] - 1, tables.data_ptr(), tables.stride(0), key_start,
                              k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), out.stride(0), _p(lse_in),
                              _p(lse_out), q.shape[1], Hkv, D, bs, scale)
    if rc != 0:
        raise ValueError(f"paged_flash: head size {D} not supported (needs AVX2 + FMA and a multiple of 16)")


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v [T, Hkv, D] float32 (any row stride; rows are copied contiguous first if they are not) into the
    contiguous pools [N, bs, Hkv, D] at the flat token slots (int64 [T])."""
    T, Hkv, D = k.shape
    k, v = (t if t.stride(2) == 1 and t.stride(1) == D else t.contiguous() for t in (k, v))
    slots = slots.to(torch.int64).contiguous()
    n_slots = k_cache.numel() // (Hkv * D)
    rc = _lib.kv_write_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                           v_cache.data_ptr(), slots.data_ptr(), T, Hkv * D, n_slots)
    if rc != 0:
        raise IndexError(f"kv_write: a slot is outside the KV pool of {n_slots} token slots")


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (when given); returns rms_norm(h) * weight. h/delta [T, E] contiguous float32."""
    T, E = h.shape
    out = torch.empty_like(h)
    _lib.add_rmsnorm_f32(h.data_ptr(), _p(delta), weight.data_ptr(), out.data_ptr(), T, E, eps)
    return out


def rope_(x: torch.Tensor, nheads: int, head_dim: int, cos_table, sin_table, positions) -> None:
    """Rotates the first nheads heads of every row of x [T, >= nheads*head_dim] (row stride x.stride(0)) in place."""
    _lib.rope_f32(x.data_ptr(), x.stride(0), x.shape[0], nheads, head_dim, cos_table.data_ptr(),
                  sin_table.data_ptr(), positions.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = cat(gate, up) (rows contiguous in the last dim): [T, I]."""
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    _lib.silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), T, I2 // 2)
    return out


class PackedLinear:
    """A float32 projection y = x @ W^T (+ bias) with W prepacked for gemm_packed_f32: what every float32 step
    runs on a CPU with AVX2 + FMA. Build with `PackedLinear.create`, which returns None where it is unavailable."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        N, K = weight.shape
        self.n, self.k = N, K
        P = -(-N // 16)
        # 32-byte aligned storage for the panels (the kernel uses aligned loads)
        raw = torch.empty(P * K * 16 + 8, dtype=torch.float32)
        off = (-(raw.data_ptr() // 4)) % 8
        self.wp = raw[off:off + P * K * 16]
        w = weight.detach().contiguous()
        _lib.gemm_pack_f32(w.data_ptr(), w.stride(0), N, K, self.wp.data_ptr())
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(P * 16, dtype=torch.float32)
            self.bias[:N] = bias.detach()

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
        if (lib() is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2
                or not _lib.gemm_packed_available()):
            return None
        return cls(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        M = x.shape[0]
        y = torch.empty(M, self.n, dtype=torch.float32)
        _lib.gemm_packed_f32(x.data_ptr(), x.stride(0), M, self.k, self.wp.data_ptr(), self.n, _p(self.bias),
                             y.data_ptr(), self.n)
        return y
