// The step's new keys and values into their cache slots.
#include "flowrt_cpu.h"
#include "common.h"

namespace {
// Row t of k/v (W elements, row strides k_st/v_st) to row slots[t] of the pools (n_slots rows of W elements). One
// call for both, instead of two indexed copies through torch. Returns -1, writing nothing, when a slot is out of range.
template <typename T>
int kv_write(const T* k, int64_t k_st, const T* v, int64_t v_st, T* kc, T* vc, const int64_t* slots, int64_t T_,
             int W, int64_t n_slots) {
    for (int64_t t = 0; t < T_; ++t)
        if (slots[t] < 0 || slots[t] >= n_slots) return -1;
    #pragma omp parallel for schedule(static) if (T_ * W >= 262144) num_threads(flowrt_threads)
    for (int64_t t = 0; t < T_; ++t) {
        std::memcpy(kc + slots[t] * W, k + t * k_st, sizeof(T) * W);
        std::memcpy(vc + slots[t] * W, v + t * v_st, sizeof(T) * W);
    }
    return 0;
}
}  // namespace

extern "C" {

int kv_write_f32(const float* k, int64_t k_st, const float* v, int64_t v_st, float* kc, float* vc,
                 const int64_t* slots, int64_t T, int W, int64_t n_slots) {
    return kv_write<float>(k, k_st, v, v_st, kc, vc, slots, T, W, n_slots);
}

int kv_write_bf16(const bf16_t* k, int64_t k_st, const bf16_t* v, int64_t v_st, bf16_t* kc, bf16_t* vc,
                  const int64_t* slots, int64_t T, int W, int64_t n_slots) {
    return kv_write<bf16_t>(k, k_st, v, v_st, kc, vc, slots, T, W, n_slots);
}

}  // extern "C"
