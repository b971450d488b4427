// Every function the CPU kernel library exports: the one list the Python side (engine/cpu_ops.py) reads to
// declare the ctypes signatures, and that each .cpp includes so a definition that drifts from it fails to compile.
// Kept to the plain C types the loader maps: void, int, int32_t, int64_t, float, pointers (and const char*).
// Storage types: float32 kernels end in _f32, bfloat16 ones in _bf16 (bf16_t: the bits, uint16_t); bf16 kernels
// compute in float32 and round their results as torch does.
#pragma once

#include <cstdint>

typedef uint16_t bf16_t;

extern "C" {

// ---- library
void flowrt_set_num_threads(int n);
int flowrt_get_num_threads();
const char* flowrt_cpu_isa();

// ---- projections (gemm.cpp)
int gemm_packed_available();
void gemm_pack_f32(const float* w, int64_t w_st, int64_t N, int64_t K, float* wp);
int gemm_packed_f32(const float* x, int64_t x_st, int64_t M, int64_t K, const float* wp, int64_t N, const float* bias, float* y, int64_t y_st);

// ---- bfloat16 projections, AVX512-BF16 only (gemm_bf16.cpp)
int gemm_bf16_available();
int gemm_pack_bf16(const bf16_t* w, int64_t w_st, int64_t N, int64_t K, bf16_t* wp);
int gemm_packed_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, const bf16_t* wp, int64_t N, const float* bias, bf16_t* y, int64_t y_st);

// ---- attention over the paged KV pool, read in place (attention.cpp)
int paged_decode_f32(const float* q, int64_t q_st, const float* kc, const float* vc, const int32_t* tables, int64_t tab_st, const int32_t* seq_lens, const int64_t* rows, int32_t start, float* out, int64_t o_st, float* lse, int B, int H, int Hkv, int D, int bs, float scale, int heads_outer);
int paged_decode_bf16(const bf16_t* q, int64_t q_st, const bf16_t* kc, const bf16_t* vc, const int32_t* tables, int64_t tab_st, const int32_t* seq_lens, const int64_t* rows, int32_t start, bf16_t* out, int64_t o_st, float* lse, int B, int H, int Hkv, int D, int bs, float scale, int heads_outer);
int paged_flash_f32(const float* q, int64_t q_st, const int64_t* rows, const int32_t* ends, const int32_t* group_start, int NG, const int32_t* tables, int64_t tab_st, int key_start, const float* kc, const float* vc, float* out, int64_t o_st, const float* lse_in, float* lse_out, int H, int Hkv, int D, int bs, float scale);
int paged_flash_bf16(const bf16_t* q, int64_t q_st, const int64_t* rows, const int32_t* ends, const int32_t* group_start, int NG, const int32_t* tables, int64_t tab_st, int key_start, const bf16_t* kc, const bf16_t* vc, bf16_t* out, int64_t o_st, const float* lse_in, float* lse_out, int H, int Hkv, int D, int bs, float scale);

// ---- the step's new keys and values into the pool (kv_write.cpp)
int kv_write_f32(const float* k, int64_t k_st, const float* v, int64_t v_st, float* kc, float* vc, const int64_t* slots, int64_t T, int W, int64_t n_slots);
int kv_write_bf16(const bf16_t* k, int64_t k_st, const bf16_t* v, int64_t v_st, bf16_t* kc, bf16_t* vc, const int64_t* slots, int64_t T, int W, int64_t n_slots);

// ---- residual + RMSNorm, rotary, SiLU x up (norm_rope_act.cpp)
void add_rmsnorm_f32(float* h, const float* delta, const float* w, float* out, int64_t T, int E, float eps);
void add_rmsnorm_bf16(bf16_t* h, const bf16_t* delta, const bf16_t* w, bf16_t* out, int64_t T, int E, float eps);
void rope_f32(float* x, int64_t row_st, int64_t T, int nh, int D, const float* cos_t, const float* sin_t, const int64_t* pos);
void rope_bf16(bf16_t* x, int64_t row_st, int64_t T, int nh, int D, const bf16_t* cos_t, const bf16_t* sin_t, const int64_t* pos);
void silu_mul_f32(const float* gu, int64_t gu_st, float* out, int64_t T, int I);
void silu_mul_bf16(const bf16_t* gu, int64_t gu_st, bf16_t* out, int64_t T, int I);
int rope_kv_write_f32(float* x, int64_t row_st, int64_t T, int nq, int nk, int D, const float* cos_t, const float* sin_t, const int64_t* pos, float* kc, float* vc, const int64_t* slots, int64_t n_slots);
int rope_kv_write_bf16(bf16_t* x, int64_t row_st, int64_t T, int nq, int nk, int D, const bf16_t* cos_t, const bf16_t* sin_t, const int64_t* pos, bf16_t* kc, bf16_t* vc, const int64_t* slots, int64_t n_slots);

// ---- a decode step's layers in one call (decode_layers.cpp): the kernels above in LlamaModel._forward_glued's order;
// the attention as the backend's decode program (calls [n_calls, 8], flash [8]: see there)
int decode_layers_f32(int L, int64_t T, int E, int I, int H, int Hkv, int D, float eps, float scale, float* h, float* work, const int64_t* layer_ptrs, const float* cos_t, const float* sin_t, const int64_t* pos, const int64_t* slots, int64_t n_slots, int n_calls, const int64_t* calls, const int64_t* flash, int bs);
int decode_layers_bf16(int L, int64_t T, int E, int I, int H, int Hkv, int D, float eps, float scale, bf16_t* h, bf16_t* work, const int64_t* layer_ptrs, const bf16_t* cos_t, const bf16_t* sin_t, const int64_t* pos, const int64_t* slots, int64_t n_slots, int n_calls, const int64_t* calls, const int64_t* flash, int bs);

// ---- quantized weights: GGUF block rows read in place (quant_blocks.h; qtype = the ggml type id)
// x -> int16 blocks of 32 with scales d [M, K/32] and the halves' scaled sums sx [M, K/32, 8] (nullable) (quant_act.cpp)
int quant_act_f32(const float* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx);
int quant_act_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx);
// y = x @ W^T (+ bias), W uint8 [N, row bytes]; 0, -1 unsupported qtype, -2 K not whole blocks (quant_gemm.cpp)
int quant_gemm_supported(int qtype);
int quant_gemm_f32(const float* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int qtype, int64_t N, const float* bias, float* y, int64_t y_st);
int quant_gemm_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int qtype, int64_t N, const float* bias, bf16_t* y, int64_t y_st);
// the same over nparts row-stacked parts (formats qtypes, ns rows each, W w[p]) into y's columns, x quantized once
int quant_gemm_parts_f32(const float* x, int64_t x_st, int64_t M, int64_t K, int nparts, const uint8_t* const* w, const int32_t* qtypes, const int64_t* ns, const float* bias, float* y, int64_t y_st);
int quant_gemm_parts_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, int nparts, const uint8_t* const* w, const int32_t* qtypes, const int64_t* ns, const float* bias, bf16_t* y, int64_t y_st);
// from this many rows the products run in float32 on the dequantized operands (below: int16 madd)
int quant_gemm_float_rows();
// rows ids[0..n) (null: rows 0..n-1) of W (n_rows rows) -> out; 0, -1, -2 as above, -3 an id out of range (quant_dequant.cpp)
int quant_dequant_f32(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows, float* out, int64_t out_st);
int quant_dequant_bf16(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows, bf16_t* out, int64_t out_st);

}  // extern "C"
