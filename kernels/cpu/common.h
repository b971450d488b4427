// Helpers shared by every kernel file: the exps (fexp.h), horizontal sums, a transpose, bf16 <-> fp32, and the
// OpenMP team size. Everything here is static inline (each .cpp gets its own copy; nothing to link).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLOWRT_AVX2 1
#endif

// FLOWRT_ON(FLAG): 1 where FLAG is #defined as 1 (FLOWRT_AVX2, FLOWRT_GEMM_BF16), else 0, as an expression (Linux's
// IS_ENABLED): the *_available() probes, which tell the callers whether this variant compiled an entry point in,
// return it instead of each spelling out its own #ifdef.
#define FLOWRT_ON(flag) FLOWRT_ON_(flag)
#define FLOWRT_ON_(value) FLOWRT_ON_PICK(FLOWRT_ON_IF_##value)
#define FLOWRT_ON_IF_1 0,
#define FLOWRT_ON_PICK(one_or_junk) FLOWRT_ON_SECOND(one_or_junk 1, 0, 0)
#define FLOWRT_ON_SECOND(ignored, value, ...) value

// f(std::integral_constant<int, c>{}) with c = n clamped to 1..N: a tile's runtime row or column count as the
// template argument its kernel is instantiated for (instead of a switch over each count).
template <int N, typename Fn>
static inline void with_count(int n, Fn&& f) {
    if constexpr (N > 1) {
        if (n < N) return with_count<N - 1>(n, f);
    }
    f(std::integral_constant<int, N>{});
}

// bfloat16 as its bits (the upper half of a float32).
#include "flowrt_cpu.h"  // bf16_t

// The OpenMP team size of every parallel region, set from torch.get_num_threads() by the Python side
// (flowrt_set_num_threads) so the kernels never depend on which thread set OpenMP's own per-thread value.
extern int flowrt_threads;

// A buffer per thread, grown as needed, 64-byte aligned; slots: 0 the activations, 1 x' (packed), 2 rows of W,
// 3 the AMX tiles' padded rows (gemm_amx.h), 4 rows of W as bf16 (the AMX quantized path).
static inline uint8_t* scratch(size_t bytes, int slot = 0) {
    static thread_local std::vector<uint8_t> buf[5];
    if (buf[slot].size() < bytes + 64) buf[slot].resize(bytes + 64);
    return buf[slot].data() + (-(uintptr_t)buf[slot].data() & 63);
}

static inline float bf16_to_f32(bf16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch's .to(torch.bfloat16) does (NaN stays a NaN).
static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element access for the kernels templated on the storage type (float or bf16_t): arithmetic is always float32.
static inline float to_f32(float x) { return x; }
static inline float to_f32(bf16_t x) { return bf16_to_f32(x); }
template <typename T> static inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16_t from_f32<bf16_t>(float x) { return f32_to_bf16(x); }
// x rounded through the storage type (identity for float32): where torch rounds an intermediate to bf16.
template <typename T> static inline float round_as(float x) { return to_f32(from_f32<T>(x)); }

#include "fexp.h"  // fexp, fexp8 (and the AVX-512 exps)

#ifdef FLOWRT_AVX2
// [sum(a0), ..., sum(a7)]: eight horizontal sums in one vector (a transpose-and-add tree instead of eight
// separate reductions).
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

// Eight consecutive elements of the storage type as eight floats (bf16: widened exactly, a shift).
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight floats stored as the storage type (bf16: rounded to nearest even).
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(bf16_t* p, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    // one instruction (inputs here are never subnormal or NaN in practice; it flushes subnormals to zero)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(v));
#else
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    // NaN lanes keep a quiet NaN
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(nan));
    // pack the eight 32-bit lanes' low halves into eight 16-bit values
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
#endif
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
