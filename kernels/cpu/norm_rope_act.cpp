// Row-wise glue around the projections: residual + RMSNorm, rotary embedding in place, SiLU x up. Templated on the
// storage type; bf16 rounds where torch's bf16 ops round (each op's result), so the fused pass gives the numbers of
// transformers' sequence of bf16 ops (up to the order of the RMSNorm's sum of squares).
//
// The kernels split rows over the threads from ~8k elements (a decode step of 8-16 sequences): measured on Zen3,
// 2 threads, silu_mul + two add_rmsnorm of 32 rows take 96 us per layer split, 171 us not.
#include "flowrt_cpu.h"
#include "common.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GLUE_AVX512 1
// Sixteen lanes of the storage type as floats, n < 16 lanes through a mask (the rest read as zero, nothing past p
// touched), and back. bf16 is rounded to nearest even in integer arithmetic, exactly as f32_to_bf16 (subnormals and
// NaN included; vcvtneps2bf16 would flush subnormals), so these paths give the scalar code's bits.
static inline __mmask16 tail16(int n) { return (__mmask16)((1u << n) - 1u); }
static inline __m512 ld16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
static inline __m512 ld16(const bf16_t* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }
// the bf16 bits of each lane, in the low half of 32-bit lanes
static inline __m512i rne16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
// the sixteen bf16 values, packed. With AVX512-BF16 one vcvtneps2bf16 (the same rounding, NaN made quiet the same
// way) unless a lane is subnormal (vfpclassps' denormal class), which it would flush to zero: then the integer
// rounding.
static inline __m256i bf16x16(__m512 v) {
#ifdef __AVX512BF16__
    if (!_mm512_fpclass_ps_mask(v, 0x20)) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    return _mm512_cvtepi32_epi16(rne16(v));
}
static inline void st16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void st16(bf16_t* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, bf16x16(v)); }
// v rounded through the storage type (identity for float32), as round_as
template <typename T> static inline __m512 round16(__m512 v) {
    if constexpr (sizeof(T) == 4) return v;
    else return widen16(bf16x16(v));
}

// One row of add_rmsnorm, sixteen lanes at a time (the sum of squares in sixteen partial sums). bf16: the row's sums
// are kept as floats in xs (E floats, L1) for the second pass and the weights come widened (wf), so each element is
// converted once each way; float32 reads h and the weights again (xs and wf are h's row and w).
template <typename T>
void add_rmsnorm_row16(T* hr, const T* dr, const float* wf, T* orow, int E, float eps, float* xs) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < E; i += 16) {
        const __mmask16 m = E - i >= 16 ? (__mmask16)0xffff : tail16(E - i);
        __m512 x = ld16(hr + i, m);
        if constexpr (sizeof(T) == 2) {
            if (dr) {
                const __m256i b = bf16x16(_mm512_add_ps(x, ld16(dr + i, m)));
                _mm256_mask_storeu_epi16(hr + i, m, b);
                x = widen16(b);
            }
            _mm512_mask_storeu_ps(xs + i, m, x);
        } else if (dr) {
            x = _mm512_add_ps(x, ld16(dr + i, m));
            st16(hr + i, x, m);
        }
        acc = _mm512_add_ps(acc, _mm512_mul_ps(x, x));
    }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)E + eps);
    const __m512 vr = _mm512_set1_ps(r);
    for (int i = 0; i < E; i += 16) {
        const __mmask16 m = E - i >= 16 ? (__mmask16)0xffff : tail16(E - i);
        const __m512 x = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xs + i), vr));
        st16(orow + i, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wf + i), x), m);
    }
}

// One head of rope, sixteen lanes of each half at a time: the scalar loop's operations and roundings. The position's
// cos and sin rows come widened (cf, sf: the same for every head of the row).
template <typename T>
void rope_head16(T* v, const float* cf, const float* sf, int h) {
    for (int i = 0; i < h; i += 16) {
        const __mmask16 m = h - i >= 16 ? (__mmask16)0xffff : tail16(h - i);
        const __m512 a = ld16(v + i, m), b = ld16(v + i + h, m);
        const __m512 c0 = _mm512_maskz_loadu_ps(m, cf + i), s0 = _mm512_maskz_loadu_ps(m, sf + i);
        const __m512 c1 = _mm512_maskz_loadu_ps(m, cf + i + h), s1 = _mm512_maskz_loadu_ps(m, sf + i + h);
        if constexpr (sizeof(T) == 4) {
            st16(v + i, _mm512_sub_ps(_mm512_mul_ps(a, c0), _mm512_mul_ps(b, s0)), m);
            st16(v + i + h, _mm512_add_ps(_mm512_mul_ps(b, c1), _mm512_mul_ps(a, s1)), m);
        } else {
            const __m512 nb = _mm512_castsi512_ps(  // -b: the sign flipped, as the scalar negation
                _mm512_xor_si512(_mm512_castps_si512(b), _mm512_set1_epi32((int)0x80000000u)));
            st16(v + i, _mm512_add_ps(round16<T>(_mm512_mul_ps(a, c0)), round16<T>(_mm512_mul_ps(nb, s0))), m);
            st16(v + i + h, _mm512_add_ps(round16<T>(_mm512_mul_ps(b, c1)), round16<T>(_mm512_mul_ps(a, s1))), m);
        }
    }
}

// n elements of p widened to floats in out (n a multiple of 16 or not).
template <typename T>
void widen_row(const T* p, float* out, int n) {
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : tail16(n - i);
        _mm512_mask_storeu_ps(out + i, m, ld16(p + i, m));
    }
}

// Per-thread float scratch of at least n elements (slot 0 or 1: separate buffers; common.h's scratch), kept between calls.
static inline float* floats(int slot, size_t n) { return reinterpret_cast<float*>(scratch(n * 4, slot)); }

// silu(g) rounded as the storage type, sixteen lanes: silu8's operations (bit-identical to the scalar path; bf16
// through fexp16_bf16_silu, the same bits).
template <typename T>
static inline __m512 silu16(__m512 gv) {
    const __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), gv);
    const __m512 e = sizeof(T) == 2 ? fexp16_bf16_silu(x) : fexp16(x);
    return round16<T>(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
}

// One row of silu_mul, sixteen lanes at a time.
template <typename T>
void silu_mul_row16(const T* g, const T* u, T* o, int I) {
    int i = 0;
    for (; i + 64 <= I; i += 64) {  // four vectors a step: their exp chains overlap (latency-bound otherwise)
        __m512 gv[4], sv[4];
        for (int j = 0; j < 4; ++j) gv[j] = ld16(g + i + 16 * j, 0xffff);
        for (int j = 0; j < 4; ++j) sv[j] = silu16<T>(gv[j]);
        for (int j = 0; j < 4; ++j) st16(o + i + 16 * j, _mm512_mul_ps(sv[j], ld16(u + i + 16 * j, 0xffff)), 0xffff);
    }
    for (; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? (__mmask16)0xffff : tail16(I - i);
        st16(o + i, _mm512_mul_ps(silu16<T>(ld16(g + i, m)), ld16(u + i, m)), m);
    }
}
#endif

// h += delta (when delta is not null), then out = w * (h * rsqrt(mean(h^2) + eps)). Rows of E elements.
// bf16 as transformers: the sum is rounded to bf16 (the residual stream), the normalized row is rounded to bf16
// before the weight multiplies it, and the product is rounded again.
template <typename T>
void add_rmsnorm(T* h, const T* delta, const T* w, T* out, int64_t Tn, int E, float eps) {
#ifdef GLUE_AVX512
    const float* wf;
    if constexpr (sizeof(T) == 2) {
        float* buf = floats(0, E);
        widen_row(w, buf, E);
        wf = buf;
    } else {
        wf = w;
    }
    #pragma omp parallel if (Tn * E >= 8192) num_threads(flowrt_threads)
    {
        float* xs = sizeof(T) == 2 ? floats(1, E) : nullptr;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < Tn; ++t)
            add_rmsnorm_row16<T>(h + t * E, delta ? delta + t * E : nullptr, wf, out + t * E, E, eps,
                                 sizeof(T) == 2 ? xs : (float*)(h + t * E));
    }
    return;
#endif
    #pragma omp parallel for schedule(static) if (Tn * E >= 8192) num_threads(flowrt_threads)
    for (int64_t t = 0; t < Tn; ++t) {
        T* hr = h + t * E;
        if (delta) {
            const T* dr = delta + t * E;
            #pragma omp simd
            for (int i = 0; i < E; ++i) hr[i] = from_f32<T>(to_f32(hr[i]) + to_f32(dr[i]));
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < E; ++i) ss += to_f32(hr[i]) * to_f32(hr[i]);
        const float r = 1.f / std::sqrt(ss / (float)E + eps);
        T* orow = out + t * E;
        #pragma omp simd
        for (int i = 0; i < E; ++i) orow[i] = from_f32<T>(to_f32(w[i]) * round_as<T>(to_f32(hr[i]) * r));
    }
}

// Rotary embedding (rotate-half convention) in place on nh heads of D at the start of row v, with the position's
// table rows c and s. bf16 as transformers' q * cos + rotate_half(q) * sin: each product rounded, then their sum.
template <typename T>
inline void rope_row(T* row, int nh, int D, const T* c, const T* s) {
    const int h = D / 2;
#ifdef GLUE_AVX512
    if constexpr (sizeof(T) == 2) {  // the position's table rows widened once for all the row's heads
        float* cf = floats(1, 2 * (size_t)D);
        widen_row(c, cf, D);
        widen_row(s, cf + D, D);
        for (int j = 0; j < nh; ++j) rope_head16<T>(row + (int64_t)j * D, cf, cf + D, h);
    } else {
        for (int j = 0; j < nh; ++j) rope_head16<T>(row + (int64_t)j * D, (const float*)c, (const float*)s, h);
    }
    return;
#endif
    for (int j = 0; j < nh; ++j) {
        T* v = row + (int64_t)j * D;
        #pragma omp simd
        for (int i = 0; i < h; ++i) {
            const float a = to_f32(v[i]), b = to_f32(v[i + h]);
            if constexpr (sizeof(T) == 4) {
                v[i] = from_f32<T>(a * to_f32(c[i]) - b * to_f32(s[i]));
                v[i + h] = from_f32<T>(b * to_f32(c[i + h]) + a * to_f32(s[i + h]));
            } else {
                v[i] = from_f32<T>(round_as<T>(a * to_f32(c[i])) + round_as<T>(-b * to_f32(s[i])));
                v[i + h] = from_f32<T>(round_as<T>(b * to_f32(c[i + h])) + round_as<T>(a * to_f32(s[i + h])));
            }
        }
    }
}

// rope_row on the rows of x (row stride row_st) at positions pos.
template <typename T>
void rope(T* x, int64_t row_st, int64_t Tn, int nh, int D, const T* cos_t, const T* sin_t, const int64_t* pos) {
    #pragma omp parallel for schedule(static) if (Tn * nh * D >= 8192) num_threads(flowrt_threads)
    for (int64_t t = 0; t < Tn; ++t) rope_row(x + t * row_st, nh, D, cos_t + pos[t] * D, sin_t + pos[t] * D);
}

// A qkv projection's rows [q (nq heads) | k (nk heads) | v (nk heads)] of D: q and k rotated in place, then k and v
// copied to token slot slots[t] of the pools (n_slots slots of nk * D): rotary and the KV write in one pass while
// the row is in cache, one call instead of two. Returns -1, changing nothing, when a slot is out of range.
template <typename T>
int rope_kv_write(T* x, int64_t row_st, int64_t Tn, int nq, int nk, int D, const T* cos_t, const T* sin_t,
                  const int64_t* pos, T* kc, T* vc, const int64_t* slots, int64_t n_slots) {
    for (int64_t t = 0; t < Tn; ++t)
        if (slots[t] < 0 || slots[t] >= n_slots) return -1;
    const int64_t W = (int64_t)nk * D;
    #pragma omp parallel for schedule(static) if (Tn * (nq + nk) * D >= 8192) num_threads(flowrt_threads)
    for (int64_t t = 0; t < Tn; ++t) {
        T* row = x + t * row_st;
        rope_row(row, nq + nk, D, cos_t + pos[t] * D, sin_t + pos[t] * D);
        std::memcpy(kc + slots[t] * W, row + (int64_t)nq * D, sizeof(T) * W);
        std::memcpy(vc + slots[t] * W, row + (int64_t)nq * D + W, sizeof(T) * W);
    }
    return 0;
}

// out[t] = silu(gu[t, :I]) * gu[t, I:] for rows of the fused gate+up projection [T, 2I] (row stride gu_st):
// one pass instead of silu, then a multiply (each a full read and write of the activations). bf16 as transformers'
// F.silu(gate) * up: silu rounded to bf16, then the product rounded.
template <typename T>
void silu_mul(const T* gu, int64_t gu_st, T* out, int64_t Tn, int I) {
    #pragma omp parallel for schedule(static) if (Tn * I >= 8192) num_threads(flowrt_threads)
    for (int64_t t = 0; t < Tn; ++t) {
        const T* g = gu + t * gu_st;
        const T* u = g + I;
        T* o = out + t * (int64_t)I;
        int i = 0;
#ifdef GLUE_AVX512
        silu_mul_row16<T>(g, u, o, I);
        continue;
#endif
#ifdef FLOWRT_AVX2
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = load8(g + i);
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, fexp8(_mm256_sub_ps(zero, gv))));
            if constexpr (sizeof(T) == 2) {  // rounded to bf16 through memory, as the scalar round_as
                alignas(32) bf16_t tmp[8];
                store8(tmp, sv);
                sv = load8(tmp);
            }
            store8(o + i, _mm256_mul_ps(sv, load8(u + i)));
        }
#endif
        for (; i < I; ++i) {
            const float gv = to_f32(g[i]);
            o[i] = from_f32<T>(round_as<T>(gv / (1.f + fexp(-gv))) * to_f32(u[i]));
        }
    }
}

}  // namespace

extern "C" {

void add_rmsnorm_f32(float* h, const float* delta, const float* w, float* out, int64_t T, int E, float eps) {
    add_rmsnorm<float>(h, delta, w, out, T, E, eps);
}

void add_rmsnorm_bf16(bf16_t* h, const bf16_t* delta, const bf16_t* w, bf16_t* out, int64_t T, int E, float eps) {
    add_rmsnorm<bf16_t>(h, delta, w, out, T, E, eps);
}

void rope_f32(float* x, int64_t row_st, int64_t T, int nh, int D, const float* cos_t, const float* sin_t,
              const int64_t* pos) {
    rope<float>(x, row_st, T, nh, D, cos_t, sin_t, pos);
}

void rope_bf16(bf16_t* x, int64_t row_st, int64_t T, int nh, int D, const bf16_t* cos_t, const bf16_t* sin_t,
               const int64_t* pos) {
    rope<bf16_t>(x, row_st, T, nh, D, cos_t, sin_t, pos);
}

int rope_kv_write_f32(float* x, int64_t row_st, int64_t T, int nq, int nk, int D, const float* cos_t,
                      const float* sin_t, const int64_t* pos, float* kc, float* vc, const int64_t* slots,
                      int64_t n_slots) {
    return rope_kv_write<float>(x, row_st, T, nq, nk, D, cos_t, sin_t, pos, kc, vc, slots, n_slots);
}

int rope_kv_write_bf16(bf16_t* x, int64_t row_st, int64_t T, int nq, int nk, int D, const bf16_t* cos_t,
                       const bf16_t* sin_t, const int64_t* pos, bf16_t* kc, bf16_t* vc, const int64_t* slots,
                       int64_t n_slots) {
    return rope_kv_write<bf16_t>(x, row_st, T, nq, nk, D, cos_t, sin_t, pos, kc, vc, slots, n_slots);
}

void silu_mul_f32(const float* gu, int64_t gu_st, float* out, int64_t T, int I) {
    silu_mul<float>(gu, gu_st, out, T, I);
}

void silu_mul_bf16(const bf16_t* gu, int64_t gu_st, bf16_t* out, int64_t T, int I) {
    silu_mul<bf16_t>(gu, gu_st, out, T, I);
}

}  // extern "C"
