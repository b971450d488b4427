// A whole decode step's layers in one call: the C++ loop over each layer's kernels (residual + RMSNorm, the packed
// projections, rotary + KV write, paged decode attention, SiLU x up) that the model otherwise drives from Python,
// ~10 calls a layer. The same kernels in the same order as LlamaModel._forward_glued, so the same bits; it only
// removes the Python and ctypes overhead between them (at batch 1 about a tenth of a step).
#include "flowrt_cpu.h"
#include "common.h"

namespace {

template <typename T> struct K;
template <> struct K<float> {
    static constexpr auto norm = add_rmsnorm_f32;
    static constexpr auto gemm = gemm_packed_f32;
    static constexpr auto rope_kv = rope_kv_write_f32;
    static constexpr auto attend = paged_decode_f32;
    static constexpr auto silu = silu_mul_f32;
};
template <> struct K<bf16_t> {
    static constexpr auto norm = add_rmsnorm_bf16;
    static constexpr auto gemm = gemm_packed_bf16;
    static constexpr auto rope_kv = rope_kv_write_bf16;
    static constexpr auto attend = paged_decode_bf16;
    static constexpr auto silu = silu_mul_bf16;
};

// The buffers of `work`, in order: x [T, E], qkv [T, (H + 2 Hkv) D], attn [T, H D], d [T, E], gu [T, 2 I], act [T, I].
// layer_ptrs [L, 9]: each layer's input norm, post norm, qkv (packed), qkv bias (float32 padded, or 0), o, gate_up,
// down (packed), k pool, v pool.
template <typename T>
int decode_layers(int L, int64_t Tn, int E, int I, int H, int Hkv, int D, float eps, float scale, T* h, T* work,
                  const int64_t* lp, const T* cos_t, const T* sin_t, const int64_t* pos, const int64_t* slots,
                  int64_t n_slots, const int32_t* tables, int64_t tab_st, const int32_t* seq_lens, int bs) {
    using P = const T*;
    const int64_t Nqkv = (int64_t)(H + 2 * Hkv) * D, HD = (int64_t)H * D;
    T* x = work;
    T* qkv = x + Tn * E;
    T* attn = qkv + Tn * Nqkv;
    T* d = attn + Tn * HD;
    T* gu = d + Tn * E;
    T* act = gu + Tn * 2 * (int64_t)I;
    for (int l = 0; l < L; ++l) {
        const int64_t* p = lp + 9 * (int64_t)l;
        T *kc = (T*)p[7], *vc = (T*)p[8];
        int rc;
        K<T>::norm(h, l ? d : nullptr, (P)p[0], x, Tn, E, eps);
        if ((rc = K<T>::gemm(x, E, Tn, E, (P)p[2], Nqkv, (const float*)p[3], qkv, Nqkv))) return rc;
        if (K<T>::rope_kv(qkv, Nqkv, Tn, H, Hkv, D, cos_t, sin_t, pos, kc, vc, slots, n_slots)) return -2;
        if (K<T>::attend(qkv, Nqkv, kc, vc, tables, tab_st, seq_lens, nullptr, 0, attn, HD, nullptr, (int)Tn, H, Hkv,
                         D, bs, scale, 0))
            return -3;
        if ((rc = K<T>::gemm(attn, HD, Tn, HD, (P)p[4], E, nullptr, d, E))) return rc;
        K<T>::norm(h, d, (P)p[1], x, Tn, E, eps);
        if ((rc = K<T>::gemm(x, E, Tn, E, (P)p[5], 2 * (int64_t)I, nullptr, gu, 2 * (int64_t)I))) return rc;
        K<T>::silu(gu, 2 * (int64_t)I, act, Tn, I);
        if ((rc = K<T>::gemm(act, I, Tn, I, (P)p[6], E, nullptr, d, E))) return rc;
    }
    if (L)  // the last layer's output joins the stream (rounded as torch's add)
        for (int64_t i = 0; i < Tn * E; ++i) h[i] = from_f32<T>(to_f32(h[i]) + to_f32(d[i]));
    return 0;
}

}  // namespace

extern "C" {

int decode_layers_f32(int L, int64_t T, int E, int I, int H, int Hkv, int D, float eps, float scale, float* h,
                      float* work, const int64_t* layer_ptrs, const float* cos_t, const float* sin_t,
                      const int64_t* pos, const int64_t* slots, int64_t n_slots, const int32_t* tables, int64_t tab_st,
                      const int32_t* seq_lens, int bs) {
    return decode_layers<float>(L, T, E, I, H, Hkv, D, eps, scale, h, work, layer_ptrs, cos_t, sin_t, pos, slots,
                                n_slots, tables, tab_st, seq_lens, bs);
}

int decode_layers_bf16(int L, int64_t T, int E, int I, int H, int Hkv, int D, float eps, float scale, bf16_t* h,
                       bf16_t* work, const int64_t* layer_ptrs, const bf16_t* cos_t, const bf16_t* sin_t,
                       const int64_t* pos, const int64_t* slots, int64_t n_slots, const int32_t* tables,
                       int64_t tab_st, const int32_t* seq_lens, int bs) {
    return decode_layers<bf16_t>(L, T, E, I, H, Hkv, D, eps, scale, h, work, layer_ptrs, cos_t, sin_t, pos, slots,
                                 n_slots, tables, tab_st, seq_lens, bs);
}

}  // extern "C"
