// Quantized rows -> float32 / bfloat16 (quant_blocks.h's block_values: float32 equal to gguf.quants.dequantize bit
// for bit; bf16 those values rounded to nearest even, as torch's .to(torch.bfloat16)). Used for the rows of a
// quantized token embedding (a step's token ids) and for whole tensors of the formats the engine dequantizes at load.
#include "flowrt_cpu.h"
#include "common.h"
#include "quant_blocks.h"

namespace {

template <typename F, typename T>
static void dequant_row(const uint8_t* row, int64_t nb, T* out) {
    for (int64_t b = 0; b < nb; ++b) qfmt::block_values<F>(row, (int)b, out + 32 * b);
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
