// A whole decode step's layers in one call: the C++ loop over each layer's kernels (residual + RMSNorm, the packed
// or quantized projections, rotary + KV write, paged decode attention, SiLU x up) that the model otherwise drives from Python,
// ~10 calls a layer. The same kernels in the same order as LlamaModel._forward_glued, so the same bits; it only
// removes the Python and ctypes overhead between them (at batch 1 about a tenth of a step). The attention is the
// backend's decode program (engine/model/attention.py DecodeProgram): one paged decode over every row for a step of
// independent sequences; for rows that share prefixes (forks, prefix-cache hits: the cascade), each group's own keys
// with their log-sum-exp, then every shared prefix once for all its members (paged flash, merged), in the backend's
// order. Its arguments are the structs of flowrt_cpu.h (FrDecodeStep: the layers' FrLayer, the FrDecodeProgram).
#include "flowrt_cpu.h"
#include "common.h"

namespace {

template <typename T> struct K;
// The step's kernels for one dtype, named by the exported functions' suffix.
#define FR_DTYPE_KERNELS(T, S)                          \
    template <> struct K<T> {                          \
        static constexpr auto norm = add_rmsnorm_##S;     \
        static constexpr auto gemm = gemm_packed_##S;     \
        static constexpr auto qgemm = quant_gemm_##S;     \
        static constexpr auto qproj = quant_gemm_proj_##S; \
        static constexpr auto rope_kv = rope_kv_write_##S; \
        static constexpr auto attend = paged_decode_##S;  \
        static constexpr auto flash = paged_flash_##S;    \
        static constexpr auto silu = silu_mul_##S;        \
    };
FR_DTYPE_KERNELS(float, f32)
FR_DTYPE_KERNELS(bf16_t, bf16)
#undef FR_DTYPE_KERNELS

// One projection y[T, N] = x[T, cols] @ W^T (+ bias), N = the parts' rows: each part writes its columns of y, from
// weights packed for the float kernel (ggml_type 0) or GGUF block rows for quant_gemm (quant_gemm.cpp). 0, -4 the
// projection does not map cols -> N, -5 a kernel failed.
template <typename T>
static inline int project(const T* x, int64_t Tn, const FrProjection& p, int64_t cols, int64_t N, T* y) {
    if (p.cols != cols || p.n_parts < 1 || p.n_parts > FR_MAX_PARTS) return -4;
    int64_t off = 0;
    for (int i = 0; i < p.n_parts; ++i) off += p.parts[i].rows;
    if (off != N) return -4;
    bool quantized = true;
    for (int i = 0; i < p.n_parts; ++i) quantized = quantized && p.parts[i].ggml_type;
    if (quantized) return K<T>::qproj(x, cols, Tn, &p, y, N) ? -5 : 0;  // x quantized once for all the parts
    off = 0;
    for (int i = 0; i < p.n_parts; ++i) {
        const FrWeightPart& w = p.parts[i];
        const int rc = w.ggml_type
            ? K<T>::qgemm(x, cols, Tn, cols, (const uint8_t*)w.w, w.ggml_type, w.rows, w.bias, y + off, N)
            : K<T>::gemm(x, cols, Tn, cols, (const T*)w.w, w.rows, w.bias, y + off, N);
        if (rc) return -5;
        off += w.rows;
    }
    return 0;
}

// The buffers of s.work, in order: x [T, E], qkv [T, (H + 2 Hkv) D], attn [T, H D], d [T, E], gu [T, 2 I], act [T, I].
// The attention of each layer is s.program's decode calls, then its flash call (if it has groups).
template <typename T>
int decode_layers(const FrDecodeStep& s) {
    const int64_t Tn = s.rows, E = s.hidden, I = s.inter;
    const int H = s.heads, Hkv = s.kv_heads, D = s.head_dim, bs = s.block_size;
    const int64_t Nqkv = (int64_t)(H + 2 * Hkv) * D, HD = (int64_t)H * D;
    const T *cos_t = (const T*)s.cos_t, *sin_t = (const T*)s.sin_t;
    const FrDecodeProgram& prog = *s.program;
    const FrFlashCall& f = prog.flash;
    T* h = (T*)s.h;
    T* x = (T*)s.work;
    T* qkv = x + Tn * E;
    T* attn = qkv + Tn * Nqkv;
    T* d = attn + Tn * HD;
    T* gu = d + Tn * E;
    T* act = gu + Tn * 2 * I;
    for (int l = 0; l < s.n_layers; ++l) {
        const FrLayer& p = s.layers[l];
        T *kc = (T*)p.k_cache, *vc = (T*)p.v_cache;
        int rc;
        K<T>::norm(h, l ? d : nullptr, (const T*)p.input_norm, x, Tn, E, s.eps);
        if ((rc = project(x, Tn, p.qkv, E, Nqkv, qkv))) return rc;
        if (K<T>::rope_kv(qkv, Nqkv, Tn, H, Hkv, D, cos_t, sin_t, s.positions, kc, vc, s.slots, s.n_slots)) return -2;
        for (int c = 0; c < prog.n_calls; ++c) {
            const FrDecodeCall& a = prog.calls[c];
            if (K<T>::attend(qkv, Nqkv, kc, vc, a.tables, a.table_stride, a.seq_lens, a.rows, a.first_key, attn, HD,
                             a.lse, a.n_rows, H, Hkv, D, bs, s.scale, a.heads_outer))
                return -3;
        }
        if (f.n_groups > 0 && K<T>::flash(qkv, Nqkv, f.rows, f.ends, f.group_start, f.n_groups, f.tables,
                                          f.table_stride, f.key_start, kc, vc, attn, HD, f.lse_in, nullptr, H, Hkv,
                                          D, bs, s.scale))
            return -3;
        if ((rc = project(attn, Tn, p.o, HD, E, d))) return rc;
        K<T>::norm(h, d, (const T*)p.post_norm, x, Tn, E, s.eps);
        if ((rc = project(x, Tn, p.gate_up, E, 2 * I, gu))) return rc;
        K<T>::silu(gu, 2 * I, act, Tn, I);
        if ((rc = project(act, Tn, p.down, I, E, d))) return rc;
    }
    if (s.n_layers)  // the last layer's output joins the stream (rounded as torch's add)
        for (int64_t i = 0; i < Tn * E; ++i) h[i] = from_f32<T>(to_f32(h[i]) + to_f32(d[i]));
    return 0;
}

}  // namespace

extern "C" {

int decode_layers_f32(const FrDecodeStep* step) { return decode_layers<float>(*step); }

int decode_layers_bf16(const FrDecodeStep* step) { return decode_layers<bf16_t>(*step); }

}  // extern "C"
