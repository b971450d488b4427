// Every function the CPU kernel library exports, and the structs they take: the one list the Python side
// (engine/cpu/build.py) reads to declare the ctypes signatures and to generate the ctypes mirrors of the structs, and
// that each .cpp includes so a definition that drifts from it fails to compile. Kept to the plain C types the loader
// maps: void, int, int32_t, int64_t, float, pointers (and const char*), the structs declared here (by value or
// pointer) and fixed arrays of these (a literal or #define'd length), one field a line. The loader compares each
// mirror's size and field offsets with the compiler's (flowrt_struct_layout) and refuses a library that differs.
// Storage types: float32 kernels end in _f32, bfloat16 ones in _bf16 (bf16_t: the bits, uint16_t); bf16 kernels
// compute in float32 and round their results as torch does.
#pragma once

#include <cstdint>

typedef uint16_t bf16_t;

// ---- the one-call decode step's arguments (decode_layers.cpp), by name. T below: the step's storage type (float
// for the _f32 kernel, bf16_t for _bf16).

#define FR_MAX_PARTS 4

// Output rows of a projection's weight in one storage format, over the projection's whole input.
struct FrWeightPart {
    const void* w;      // ggml_type 0: T panels packed for gemm_packed_* (gemm.cpp); else GGUF block rows
    const float* bias;  // float32 [rows] (packed: padded to whole panels), or null
    int32_t ggml_type;  // 0: packed float, else the ggml type id for quant_gemm_*
    int32_t rows;       // its output features
};

// y[T, sum of the parts' rows] = x[T, cols] @ W^T (+ bias), W the parts stacked by rows (each writes its slice of y).
struct FrProjection {
    FrWeightPart parts[FR_MAX_PARTS];
    int32_t n_parts;  // 1 .. FR_MAX_PARTS
    int32_t cols;     // input features
};

// One layer's weights and KV pools.
struct FrLayer {
    const void* input_norm;  // T [E]
    const void* post_norm;   // T [E]
    FrProjection qkv;        // E -> (H + 2 Hkv) D, rows q | k | v
    FrProjection o;          // H D -> E
    FrProjection gate_up;    // E -> 2 I, rows gate | up
    FrProjection down;       // I -> E
    void* k_cache;           // T [N, bs, Hkv, D]
    void* v_cache;           // T [N, bs, Hkv, D]
};

// One paged decode call (paged_decode_*) over rows of the step.
struct FrDecodeCall {
    const int64_t* rows;      // [n_rows] flat rows; null: rows 0 .. n_rows-1
    const int32_t* tables;    // [n_rows, W] block tables
    int64_t table_stride;     // their row stride
    const int32_t* seq_lens;  // [n_rows] keys each row attends
    float* lse;               // float32 [n_rows, H]: each row's log-sum-exp out, or null
    int32_t n_rows;
    int32_t first_key;        // keys before it are not attended (a shared prefix, attended by the flash call)
    int32_t heads_outer;      // the rows share their first blocks (the work is ordered to keep them in L2)
};

// The paged flash call (paged_flash_*) over shared prefixes, merged into its rows by log-sum-exp.
struct FrFlashCall {
    const int64_t* rows;         // [R] flat rows
    const int32_t* ends;         // [R] each row attends keys key_start .. ends[i]-1
    const int32_t* group_start;  // [n_groups + 1]: group g is rows[group_start[g] .. group_start[g+1])
    const int32_t* tables;       // [n_groups, W] the block table each group reads
    int64_t table_stride;
    const float* lse_in;         // float32 [R, H]: the log-sum-exp of what the rows' output already holds
    int32_t n_groups;            // 0: no call
    int32_t key_start;
};

// A step's attention, in the backend's order (engine/model/attention.py DecodeProgram): the decode calls, then the flash
// call.
struct FrDecodeProgram {
    const FrDecodeCall* calls;  // [n_calls]
    int32_t n_calls;
    FrFlashCall flash;
};

// A decode step: the residual stream, the rows' positions and KV slots, the layers and the attention program.
struct FrDecodeStep {
    const FrLayer* layers;            // [n_layers]
    const FrDecodeProgram* program;
    void* h;                          // T [rows, E]: the residual stream in, the last layer's output out
    void* work;                       // T scratch (decode_layers.cpp)
    const void* cos_t;                // T [P, D] rotary tables
    const void* sin_t;                // T [P, D]
    const int64_t* positions;         // [rows]
    const int64_t* slots;             // [rows] KV pool token slots
    int64_t rows;                     // T
    int64_t n_slots;                  // token slots of a pool
    int32_t n_layers;
    int32_t hidden;                   // E
    int32_t inter;                    // I
    int32_t heads;                    // H
    int32_t kv_heads;                 // Hkv
    int32_t head_dim;                 // D
    int32_t block_size;
    float eps;
    float scale;
};

extern "C" {

// ---- library
void flowrt_set_num_threads(int n);
int flowrt_get_num_threads();
const char* flowrt_cpu_isa();
// The layout of the struct `name` of this header as compiled: index -1 its size, index i >= 0 the offset of its i-th
// field (in declaration order) with *field set to the field's name; -1 past its last field or for an unknown name.
// Generated from this header by engine/cpu/build.py at build time.
int64_t flowrt_struct_layout(const char* name, int index, const char** field);

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
// 0, -2 a slot outside the pool, -3 attention head size not supported, -4 a projection that does not fit the step,
// -5 a projection kernel failed (not in this variant, or its ggml type unsupported)
int decode_layers_f32(const FrDecodeStep* step);
int decode_layers_bf16(const FrDecodeStep* step);

// ---- quantized weights: GGUF block rows read in place (quant_blocks.h; qtype = the ggml type id)
// x -> int16 blocks of 32 with scales d [M, K/32] and the halves' scaled sums sx [M, 2, K/32] (nullable) (quant_act.cpp)
int quant_act_f32(const float* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx);
int quant_act_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, int16_t* q, float* d, float* sx);
// y = x @ W^T (+ bias), W uint8 [N, row bytes]; 0, -1 unsupported qtype, -2 K not whole blocks (quant_gemm.cpp)
int quant_gemm_supported(int qtype);
int quant_gemm_f32(const float* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int qtype, int64_t N, const float* bias, float* y, int64_t y_st);
int quant_gemm_bf16(const bf16_t* x, int64_t x_st, int64_t M, int64_t K, const uint8_t* w, int qtype, int64_t N, const float* bias, bf16_t* y, int64_t y_st);
// y = x @ W^T (+ biases) for a projection of quantized parts (every ggml_type a block format; -1 else), x quantized once
int quant_gemm_proj_f32(const float* x, int64_t x_st, int64_t M, const FrProjection* p, float* y, int64_t y_st);
int quant_gemm_proj_bf16(const bf16_t* x, int64_t x_st, int64_t M, const FrProjection* p, bf16_t* y, int64_t y_st);
// from this many rows the products run in float32 on the dequantized operands (below: int16 madd)
int quant_gemm_float_rows();
// 1 where bfloat16 activations from that row count multiply bfloat16 weights (x itself, not its int16 blocks).
int quant_gemm_bf16_rows();
// rows ids[0..n) (null: rows 0..n-1) of W (n_rows rows) -> out; 0, -1, -2 as above, -3 an id out of range (quant_dequant.cpp)
int quant_dequant_f32(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows, float* out, int64_t out_st);
int quant_dequant_bf16(const uint8_t* w, int qtype, int64_t K, const int64_t* ids, int64_t n, int64_t n_rows, bf16_t* out, int64_t out_st);

}  // extern "C"
