// Quantized rows -> float32 / bfloat16: W[e] = D * q[e] (+ M) per 32-element block (quant_blocks.h), a multiply and
// an add, in the gguf package's order, so float32 results equal gguf.quants.dequantize bit for bit (bf16: those
// values rounded to nearest even, as torch's .to(torch.bfloat16)). Used for the rows of a quantized token embedding
// (a step's token ids) and for whole tensors of the formats the engine dequantizes at load.
#include "flowrt_cpu.h"
#include "common.h"
#include "quant_blocks.h"

namespace {

template <typename F, typename T>
static void dequant_row(const uint8_t* row, int64_t nb, T* out) {
    for (int64_t b = 0; b < nb; ++b) {
        float D[2], Mn[2] = {0.f, 0.f};
        F::scales(row, (int)b, D, Mn);
        T* o = out + 32 * b;
#ifdef FLOWRT_AVX2
        const __m256i q = F::qv(row, (int)b);
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i) {
            __m256 v = _mm256_mul_ps(_mm256_set1_ps(D[i >> 1]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])));
            if constexpr (F::MIN) v = _mm256_add_ps(v, _mm256_set1_ps(Mn[i >> 1]));
            store8(o + 8 * i, v);
        }
#else
        int8_t q[32];
        F::q(row, (int)b, q);
        for (int i = 0; i < 32; ++i) {
            float v = D[i >> 4] * (float)q[i];
            if constexpr (F::MIN) v = v + Mn[i >> 4];
            o[i] = from_f32<T>(v);
        }
#endif
    }
}

// Rows ids[i] (or i where ids is null), i < n, of W (rows of K elements) into out (row stride out_st).
template <typename T>
int dequant(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows, T* out,
            int64_t out_st) {
    int qk = 0, bytes = 0;
    if (qfmt::dispatch(qtype, [&](auto tag) { qk = decltype(tag)::type::QK; bytes = decltype(tag)::type::BYTES; }))
        return -1;
    if (K % qk) return -2;
    if (ids)
        for (int64_t i = 0; i < n; ++i)
            if (ids[i] < 0 || ids[i] >= n_rows) return -3;
    const int64_t rb = K / qk * bytes;
    qfmt::dispatch(qtype, [&](auto tag) {
        using F = typename decltype(tag)::type;
        #pragma omp parallel for schedule(static) if (n * K >= (1 << 16)) num_threads(flowrt_threads)
        for (int64_t i = 0; i < n; ++i) dequant_row<F>(w + (ids ? ids[i] : i) * rb, K / 32, out + i * out_st);
    });
    return 0;
}

}  // namespace

extern "C" {

int quant_dequant_f32(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows,
                      float* out, int64_t out_st) {
    return dequant(w, qtype, K, ids, n, n_rows, out, out_st);
}

int quant_dequant_bf16(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows,
                       bf16_t* out, int64_t out_st) {
    return dequant(w, qtype, K, ids, n, n_rows, out, out_st);
}

}  // extern "C"
