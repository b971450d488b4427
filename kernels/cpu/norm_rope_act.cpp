// Row-wise glue around the projections: residual + RMSNorm, rotary embedding in place, SiLU x up. Templated on the
// storage type; bf16 rounds where torch's bf16 ops round (each op's result), so the fused pass gives the numbers of
// transformers' sequence of bf16 ops (up to the order of the RMSNorm's sum of squares).
//
// The kernels split rows over the threads from ~8k elements (a decode step of 8-16 sequences): measured on Zen3,
// 2 threads, silu_mul + two add_rmsnorm of 32 rows take 96 us per layer split, 171 us not.
#include "flowrt_cpu.h"
#include "common.h"

namespace {

// h += delta (when delta is not null), then out = w * (h * rsqrt(mean(h^2) + eps)). Rows of E elements.
// bf16 as transformers: the sum is rounded to bf16 (the residual stream), the normalized row is rounded to bf16
// before the weight multiplies it, and the product is rounded again.
template <typename T>
void add_rmsnorm(T* h, const T* delta, const T* w, T* out, int64_t Tn, int E, float eps) {
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

// Rotary embedding (rotate-half convention) in place on nh heads of D at the start of each row of x. bf16 as
// transformers' q * cos + rotate_half(q) * sin: each product rounded, then their sum.
template <typename T>
void rope(T* x, int64_t row_st, int64_t Tn, int nh, int D, const T* cos_t, const T* sin_t, const int64_t* pos) {
    const int h = D / 2;
    #pragma omp parallel for schedule(static) if (Tn * nh * D >= 8192) num_threads(flowrt_threads)
    for (int64_t t = 0; t < Tn; ++t) {
        const T* c = cos_t + pos[t] * D;
        const T* s = sin_t + pos[t] * D;
        for (int j = 0; j < nh; ++j) {
            T* v = x + t * row_st + (int64_t)j * D;
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

// out[t] = silu(gu[t, :I]) * gu[t, I:] for rows of the fused gate+up projection [T, 2I] (row stride gu_st):
// one pass instead of silu, then a multiply (each a full read and write of the activations).
void silu_mul_f32(const float* gu, int64_t gu_st, float* out, int64_t T, int I) {
    #pragma omp parallel for schedule(static) if (T * I >= 8192) num_threads(flowrt_threads)
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

// bf16 as transformers' F.silu(gate) * up: silu rounded to bf16, then the product rounded.
void silu_mul_bf16(const bf16_t* gu, int64_t gu_st, bf16_t* out, int64_t T, int I) {
    #pragma omp parallel for schedule(static) if (T * I >= 8192) num_threads(flowrt_threads)
    for (int64_t t = 0; t < T; ++t) {
        const bf16_t* g = gu + t * gu_st;
        const bf16_t* u = g + I;
        bf16_t* o = out + t * (int64_t)I;
        int i = 0;
#ifdef FLOWRT_AVX2
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        alignas(32) bf16_t tmp[8];
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = load8(g + i);
            store8(tmp, _mm256_div_ps(gv, _mm256_add_ps(one, fexp8(_mm256_sub_ps(zero, gv)))));
            store8(o + i, _mm256_mul_ps(load8(tmp), load8(u + i)));
        }
#endif
        for (; i < I; ++i) {
            const float gv = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_as<bf16_t>(gv / (1.f + fexp(-gv))) * bf16_to_f32(u[i]));
        }
    }
}

}  // extern "C"
