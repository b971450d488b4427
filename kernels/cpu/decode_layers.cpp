// A whole decode step's layers in one call: the C++ loop over each layer's kernels (residual + RMSNorm, the packed
// or quantized projections, rotary + KV write, paged decode attention, SiLU x up) that the model otherwise drives from Python,
// ~10 calls a layer. The same kernels in the same order as LlamaModel._forward_glued, so the same bits; it only
// removes the Python and ctypes overhead between them (at batch 1 about a tenth of a step). The attention is the
// backend's decode program (engine/attention.py DecodeProgram): one paged decode over every row for a step of
// independent sequences; for rows that share prefixes (forks, prefix-cache hits: the cascade), each group's own keys
// with their log-sum-exp, then every shared prefix once for all its members (paged flash, merged), in the backend's
// order.
#include "flowrt_cpu.h"
#include "common.h"

namespace {

template <typename T> struct K;
template <> struct K<float> {
    static constexpr auto norm = add_rmsnorm_f32;
    static constexpr auto gemm = gemm_packed_f32;
    static constexpr auto qgemm = quant_gemm_f32;
    static constexpr auto rope_kv = rope_kv_write_f32;
    static constexpr auto attend = paged_decode_f32;
    static constexpr auto flash = paged_flash_f32;
    static constexpr auto silu = silu_mul_f32;
};
template <> struct K<bf16_t> {
    static constexpr auto norm = add_rmsnorm_bf16;
    static constexpr auto gemm = gemm_packed_bf16;
    static constexpr auto qgemm = quant_gemm_bf16;
    static constexpr auto rope_kv = rope_kv_write_bf16;
    static constexpr auto attend = paged_decode_bf16;
    static constexpr auto flash = paged_flash_bf16;
    static constexpr auto silu = silu_mul_bf16;
};

// One projection y[T, N] = x[T, K] @ W^T (+ bias): W packed for the float kernel (qtype 0) or GGUF block rows of
// ggml type qtype for quant_gemm (quant_gemm.cpp).
template <typename T>
static inline int project(const T* x, int64_t Tn, int64_t Kd, int64_t w, int64_t qtype, int64_t N, const float* bias,
                          T* y) {
    if (qtype) return K<T>::qgemm(x, Kd, Tn, Kd, (const uint8_t*)w, (int)qtype, N, bias, y, N);
    return K<T>::gemm(x, Kd, Tn, Kd, (const T*)w, N, bias, y, N);
}

// The buffers of `work`, in order: x [T, E], qkv [T, (H + 2 Hkv) D], attn [T, H D], d [T, E], gu [T, 2 I], act [T, I].
// layer_ptrs [L, 13]: each layer's input norm, post norm, qkv, qkv bias (float32, padded to whole panels for the
// float kernel; or 0), o, gate_up, down, k pool, v pool, then the qtype of qkv, o, gate_up, down (0: packed float). calls [n_calls, 8]: the paged decode calls of the attention, each rows (0: rows
// 0..B-1), block tables, their row stride, seq_lens, B, the first key, lse (0: none), heads_outer; flash [8]: then one
// paged flash call over shared prefixes, merged into those rows (rows, ends, group_start, NG (0: no call), tables,
// their row stride, key_start, lse_in).
template <typename T>
int decode_layers(int L, int64_t Tn, int E, int I, int H, int Hkv, int D, float eps, float scale, T* h, T* work,
                  const int64_t* lp, const T* cos_t, const T* sin_t, const int64_t* pos, const int64_t* slots,
                  int64_t n_slots, int n_calls, const int64_t* calls, const int64_t* flash, int bs) {
    const int64_t Nqkv = (int64_t)(H + 2 * Hkv) * D, HD = (int64_t)H * D;
    T* x = work;
    T* qkv = x + Tn * E;
    T* attn = qkv + Tn * Nqkv;
    T* d = attn + Tn * HD;
    T* gu = d + Tn * E;
    T* act = gu + Tn * 2 * (int64_t)I;
    for (int l = 0; l < L; ++l) {
        const int64_t* p = lp + 13 * (int64_t)l;
        T *kc = (T*)p[7], *vc = (T*)p[8];
        int rc;
        K<T>::norm(h, l ? d : nullptr, (const T*)p[0], x, Tn, E, eps);
        if ((rc = project(x, Tn, E, p[2], p[9], Nqkv, (const float*)p[3], qkv))) return rc;
        if (K<T>::rope_kv(qkv, Nqkv, Tn, H, Hkv, D, cos_t, sin_t, pos, kc, vc, slots, n_slots)) return -2;
        for (int c = 0; c < n_calls; ++c) {
            const int64_t* a = calls + 8 * (int64_t)c;
            if (K<T>::attend(qkv, Nqkv, kc, vc, (const int32_t*)a[1], a[2], (const int32_t*)a[3], (const int64_t*)a[0],
                             (int32_t)a[5], attn, HD, (float*)a[6], (int)a[4], H, Hkv, D, bs, scale, (int)a[7]))
                return -3;
        }
        if (flash[3] > 0 && K<T>::flash(qkv, Nqkv, (const int64_t*)flash[0], (const int32_t*)flash[1],
                                        (const int32_t*)flash[2], (int)flash[3], (const int32_t*)flash[4], flash[5],
                                        (int)flash[6], kc, vc, attn, HD, (const float*)flash[7], nullptr, H, Hkv, D,
                                        bs, scale))
            return -3;
        if ((rc = project(attn, Tn, HD, p[4], p[10], E, nullptr, d))) return rc;
        K<T>::norm(h, d, (const T*)p[1], x, Tn, E, eps);
        if ((rc = project(x, Tn, E, p[5], p[11], 2 * (int64_t)I, nullptr, gu))) return rc;
        K<T>::silu(gu, 2 * (int64_t)I, act, Tn, I);
        if ((rc = project(act, Tn, I, p[6], p[12], E, nullptr, d))) return rc;
    }
    if (L)  // the last layer's output joins the stream (rounded as torch's add)
        for (int64_t i = 0; i < Tn * E; ++i) h[i] = from_f32<T>(to_f32(h[i]) + to_f32(d[i]));
    return 0;
}

}  // namespace

extern "C" {

int decode_layers_f32(int L, int64_t T, int E, int I, int H, int Hkv, int D, float eps, float scale, float* h,
                      float* work, const int64_t* layer_ptrs, const float* cos_t, const float* sin_t,
                      const int64_t* pos, const int64_t* slots, int64_t n_slots, int n_calls, const int64_t* calls,
                      const int64_t* flash, int bs) {
    return decode_layers<float>(L, T, E, I, H, Hkv, D, eps, scale, h, work, layer_ptrs, cos_t, sin_t, pos, slots,
                                n_slots, n_calls, calls, flash, bs);
}

int decode_layers_bf16(int L, int64_t T, int E, int I, int H, int Hkv, int D, float eps, float scale, bf16_t* h,
                       bf16_t* work, const int64_t* layer_ptrs, const bf16_t* cos_t, const bf16_t* sin_t,
                       const int64_t* pos, const int64_t* slots, int64_t n_slots, int n_calls, const int64_t* calls,
                       const int64_t* flash, int bs) {
    return decode_layers<bf16_t>(L, T, E, I, H, Hkv, D, eps, scale, h, work, layer_ptrs, cos_t, sin_t, pos, slots,
                                 n_slots, n_calls, calls, flash, bs);
}

}  // extern "C"
