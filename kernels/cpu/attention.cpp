// Attention over the paged KV pool [N, bs, Hkv, D], read in place: decode (one query row per sequence) and flash
// (many rows against one block table: prefill chunks, shared prefixes). Templated on the storage type T (float
// or bf16_t): keys, values, queries and outputs are T, every product and the softmax are float32.
#include "flowrt_cpu.h"
#include "gemm.h"
#include "tile512.h"

#include <type_traits>

// Decode attention for one (sequence, KV head) without AVX2 (or for a head size not a multiple of 8): its G query
// heads against tokens start .. end-1, read in place from the paged pool [N, bs, Hkv, D].
template <typename T>
__attribute__((noinline))
static void decode_scalar(const T* qp, const T* kc, const T* vc, const int32_t* tab, int start, int end,
                          int Hkv, int kh, int G, int D, int bs, float scale, T* op, float* lse_out,
                          std::vector<float>& s) {
    const int L = end - start;
    s.resize((size_t)G * L);
    const int64_t tok_st = (int64_t)Hkv * D;
    auto row = [&](const T* cache, int pos) {
        return cache + ((int64_t)tab[pos / bs] * bs + pos % bs) * tok_st + (int64_t)kh * D;
    };
    for (int pos = start; pos < end; ++pos) {
        const T* kp = row(kc, pos);
        for (int g = 0; g < G; ++g) {
            const T* qg = qp + g * D;
            float acc = 0.f;
            #pragma omp simd reduction(+:acc)
            for (int d = 0; d < D; ++d) acc += to_f32(qg[d]) * to_f32(kp[d]);
            s[(size_t)g * L + (pos - start)] = acc * scale;
        }
    }
    for (int g = 0; g < G; ++g) {
        float* sg = s.data() + (size_t)g * L;
        float m = -INFINITY;
        for (int t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        const float sum = exp_sum(sg, L, m);
        const float inv = 1.f / sum;
        if (lse_out) lse_out[g] = m + std::log(sum);
        float acc[256];
        for (int d = 0; d < D; ++d) acc[d] = 0.f;
        for (int pos = start; pos < end; ++pos) {
            const T* vp = row(vc, pos);
            const float pr = sg[pos - start];
            #pragma omp simd
            for (int d = 0; d < D; ++d) acc[d] += pr * to_f32(vp[d]);
        }
        for (int d = 0; d < D; ++d) op[g * D + d] = from_f32<T>(acc[d] * inv);
    }
}

// The work items of a decode call over U units (sequences, or parts of long ones): whole units (all their KV heads)
// for independent units, as long as there are enough to keep every thread busy; else (unit, KV head) pairs, in one of
// two orders. heads_outer (units sharing a prefix: forks, prefix-cache hits): consecutive items (one thread's, and the
// two threads' neighbouring ones) read the same head's keys and values, so the shared prefix stays in the core's L2
// for all of them instead of cycling every head's copy through L3. Otherwise a unit's heads run back to back.
struct DecodeItems {
    int U, Hkv;
    bool heads_outer, whole;
    DecodeItems(int U_, int Hkv_, int heads_outer_)
        : U(U_), Hkv(Hkv_), heads_outer(heads_outer_ != 0), whole(!heads_outer_ && U_ >= flowrt_threads) {}
    int count() const { return whole ? U : Hkv * U; }
    int heads() const { return whole ? Hkv : 1; }  // KV heads an item covers
    int kv_head(int item) const { return whole ? 0 : heads_outer ? item / U : item % Hkv; }
    int unit(int item) const { return whole ? item : heads_outer ? item % U : item / Hkv; }
};

// Runs item(first KV head, unit, s) for every work item of `it` over the threads (dynamic: items differ in length; s
// is the thread's scratch), then after() in the same parallel region (its own worksharing loops, or nothing).
template <typename Item, typename After>
static inline void run_decode_items(const DecodeItems& it, Item item, After after) {
    const int items = it.count();
    #pragma omp parallel num_threads(flowrt_threads)
    {
        std::vector<float> s;
        #pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < items; ++i) item(it.kv_head(i), it.unit(i), s);
        after();
    }
}

// The outputs of `heads` query heads of a sequence without keys (none past start): zeros, log-sum-exp -inf.
template <typename O>
static inline void no_keys(O* op, float* lp, int heads, int D) {
    for (int i = 0; i < heads * D; ++i) op[i] = from_f32<O>(0.f);
    if (lp) for (int g = 0; g < heads; ++g) lp[g] = -INFINITY;
}

// fn(std::integral_constant<int, DD>) for a run-time head size: DD = 64 or 128 (the head loops unrolled at compile
// time), else 0 (any head size). The decode_heads* it selects are noinline: one body per head size, called from the
// item loop (not inlined into it three times over).
template <typename Fn>
static inline void with_head_size(int D, Fn fn) {
    if (D == 64) fn(std::integral_constant<int, 64>{});
    else if (D == 128) fn(std::integral_constant<int, 128>{});
    else fn(std::integral_constant<int, 0>{});
}

#ifdef FLOWRT_AVX2
// The pieces of decode_heads that do not depend on the vector width, shared by its AVX2 and AVX-512 forms.

// Walks a sequence's tokens through its block table as a (block, offset) cursor, instead of a division and a
// modulo for every token's row.
template <typename T>
struct PagedRows {
    const T* base;
    const int32_t* tab;
    int bs;
    int64_t tok_st;
    int bi, off;
    const T* blk;
    PagedRows(const T* base_, const int32_t* tab_, int bs_, int64_t tok_st_, int start)
        : base(base_), tab(tab_), bs(bs_), tok_st(tok_st_), bi(start / bs_), off(start % bs_),
          blk(base_ + (int64_t)tab_[start / bs_] * bs_ * tok_st_) {}
    // The rows of tokens pos .. pos+7 (those past end repeat token pos's row), the cursor left at pos + 8.
    inline void next8(int pos, int end, const T* (&kp)[8]) {
        const int n = std::min(8, end - pos);
        for (int j = 0; j < n; ++j) {
            kp[j] = blk + (int64_t)off * tok_st;
            if (++off == bs && pos + j + 1 < end) {
                off = 0;
                blk = base + (int64_t)tab[++bi] * bs * tok_st;
            }
        }
        for (int j = n; j < 8; ++j) kp[j] = kp[0];
    }
};

// Stores eight tokens' scaled scores in a head's score row and folds them into its eight lanes of running maxima.
// A partial last group's extra lanes land in the row's padding (they repeat the group's first token's score, so the
// running maximum stays exact).
static inline void keep_scores8(__m256 sc, float* score_at, float* head_max) {
    _mm256_storeu_ps(score_at, sc);
    _mm256_storeu_ps(head_max, _mm256_max_ps(_mm256_loadu_ps(head_max), sc));
}

// Each head's softmax over its score row (exponentiated in place); its normalizer replaces the head's first lane of
// running maxima (the lanes are free now) and its log-sum-exp goes to lse_out (nullable).
static inline void softmax_rows(float* scores, int Ls, int L, float* run_max, int NH, float* lse_out) {
    for (int h = 0; h < NH; ++h) {
        const float m = row_max(run_max + 8 * h, 8);
        const float sum = exp_sum(scores + (size_t)h * Ls, L, m);
        run_max[8 * h] = 1.f / sum;
        if (lse_out) lse_out[h] = m + std::log(sum);
    }
}

// Each head's weighted sum of values times its normalizer (kept by softmax_rows), stored as T.
template <typename T>
static inline void store_heads(T* op, const float* acc_rows, const float* run_max, int NH, int D) {
    for (int h = 0; h < NH; ++h) {
        const __m256 vinv = _mm256_set1_ps(run_max[8 * h]);
        for (int c = 0; c < D / 8; ++c)
            store8(op + (int64_t)h * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc_rows + (int64_t)h * D + 8 * c), vinv));
    }
}

// decode_heads' scratch in s: each head's score row (Ls floats), weighted sum of values (D floats) and eight lanes of
// running maxima (set to -inf), then `extra` floats.
struct DecodeScratch {
    float *scores, *acc_rows, *run_max, *extra;
    DecodeScratch(std::vector<float>& s, int NH, int Ls, int D, size_t extra_n) {
        s.resize((size_t)NH * Ls + (size_t)NH * D + 8 * (size_t)NH + extra_n);
        scores = s.data();
        acc_rows = scores + (size_t)NH * Ls;
        run_max = acc_rows + (size_t)NH * D;
        extra = run_max + 8 * (size_t)NH;
        for (int h = 0; h < NH; ++h) _mm256_storeu_ps(run_max + 8 * h, _mm256_set1_ps(-INFINITY));
    }
};

// The vector width of decode_heads' weighted sum of values: AVX2's eight lanes (values of either storage type) or
// AVX-512's sixteen (bf16 values, widened).
struct Lanes8 {
    static constexpr int W = 8;
    using V = __m256;
    static inline V load(const float* p) { return _mm256_loadu_ps(p); }
    template <typename T> static inline V widen(const T* p) { return load8(p); }
    static inline V set1(float x) { return _mm256_set1_ps(x); }
    static inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
#if defined(FLOWRT_AVX512) && !defined(FLOWRT_AVX512BF16)
struct Lanes16 {
    static constexpr int W = 16;
    using V = __m512;
    static inline V load(const float* p) { return _mm512_loadu_ps(p); }
    static inline V widen(const bf16_t* p) { return load16_bf16(p); }
    static inline V set1(float x) { return _mm512_set1_ps(x); }
    static inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

// Each head's weighted sum of values (its probabilities: its score row, from token start on) over tokens
// start .. end-1, into acc_rows: the tokens block by block, up to eight vectors of a head's row (all of it for
// D <= 8 * L::W) held in registers across a block's tokens. v0 points at the first served KV head's values.
template <typename L, typename T>
__attribute__((always_inline)) static inline void weigh_values(const T* v0, const int32_t* tab, int start, int end,
                                                               int bs, int64_t tok_st, const DecodeScratch& w, int Ls,
                                                               int NH, int G, int D) {
    const int C = D / L::W;
    for (int i = 0; i < NH * D; ++i) w.acc_rows[i] = 0.f;
    for (int pos = start; pos < end;) {
        const int n = std::min(bs - pos % bs, end - pos);
        const T* vrow = v0 + ((int64_t)tab[pos / bs] * bs + pos % bs) * tok_st;
        for (int h = 0; h < NH; ++h) {
            const float* ph = w.scores + (size_t)h * Ls + (pos - start);
            for (int c0 = 0; c0 < C; c0 += 8) {
                const int cn = std::min(8, C - c0);
                float* ah = w.acc_rows + (int64_t)h * D + L::W * c0;
                typename L::V acc[8];
                for (int c = 0; c < cn; ++c) acc[c] = L::load(ah + L::W * c);
                const T* vp = vrow + (h / G) * D + L::W * c0;
                for (int i = 0; i < n; ++i, vp += tok_st) {
                    const typename L::V pr = L::set1(ph[i]);
                    for (int c = 0; c < cn; ++c) acc[c] = L::fmadd(pr, L::widen(vp + L::W * c), acc[c]);
                }
                for (int c = 0; c < cn; ++c) L::store(ah + L::W * c, acc[c]);
            }
        }
        pos += n;
    }
}

// Decode attention for the KV heads kh0 .. kh0+nkh-1 of one sequence, each with its G query heads (qp, op and lse_out
// point at query head kh0 * G), against tokens start .. end-1 read in place from the paged pool [N, bs, Hkv, D].
// DD > 0 fixes the head size (a multiple of 8) at compile time. Scores are computed for eight tokens at a time (one
// vector of eight dot products, no reduction per token); the weighted sum of values walks the tokens block by
// block, each head's accumulator row held in registers across a block's tokens. With every head of the sequence
// (nkh = Hkv, independent sequences) a token's row is read whole, contiguous and once, instead of one head's slice
// per item: Zen3, 2 threads, 32 sequences x 300 tokens x 30 layers 33 -> 30 ms, and 41 against 25 GB/s from L3.
template <int DD, typename T>
__attribute__((noinline))
static void decode_heads(const T* qp, const T* kc, const T* vc, const int32_t* tab, int start, int end,
                         int Hkv, int kh0, int nkh, int G, int Drt, int bs, float scale, T* op, float* lse_out,
                         std::vector<float>& s) {
    const int D = DD > 0 ? DD : Drt;
    const int C = D / 8;
    const int NH = nkh * G;  // query heads served
    const int L = end - start;
    const int Ls = (L + 7) & ~7;  // each head's score row, padded to whole vectors
    const DecodeScratch w(s, NH, Ls, D, 0);
    const int64_t tok_st = (int64_t)Hkv * D;
    const T* k0 = kc + (int64_t)kh0 * D;
    const __m256 vscale = _mm256_set1_ps(scale);
    PagedRows<T> keys(k0, tab, bs, tok_st, start);
    for (int pos = start; pos < end; pos += 8) {
        const T* kp[8];
        keys.next8(pos, end, kp);
        for (int h = 0; h < NH; ++h) {
            const T* qh = qp + (int64_t)h * D;
            const int ko = (h / G) * D;
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
            for (int c = 0; c < C; ++c) {
                const __m256 qv = load8(qh + 8 * c);
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(kp[j] + ko + 8 * c), acc[j]);
            }
            keep_scores8(_mm256_mul_ps(hsum8(acc), vscale), w.scores + (size_t)h * Ls + (pos - start),
                         w.run_max + 8 * h);
        }
    }
    softmax_rows(w.scores, Ls, L, w.run_max, NH, lse_out);
    weigh_values<Lanes8>(vc + (int64_t)kh0 * D, tab, start, end, bs, tok_st, w, Ls, NH, G, D);
    store_heads(op, w.acc_rows, w.run_max, NH, D);
}
#endif

#if defined(FLOWRT_AVX512) && !defined(FLOWRT_AVX512BF16)
// decode_heads for bf16 pools on AVX-512 without AVX512-BF16 (decode_heads_dpbf16 below has it), head size a
// multiple of 32: the same work order, with 16-lane vectors. The scores of a token are one 16-lane accumulator over
// the head (the keys widened to float32), folded to 8 lanes, and eight tokens' sums come out of one hsum8; the
// weighted sum of values widens sixteen values per FMA.
template <int DD>
__attribute__((noinline))
static void decode_heads_bf16_512(const bf16_t* qp, const bf16_t* kc, const bf16_t* vc, const int32_t* tab, int start,
                                  int end, int Hkv, int kh0, int nkh, int G, int Drt, int bs, float scale, bf16_t* op,
                                  float* lse_out, std::vector<float>& s) {
    const int D = DD > 0 ? DD : Drt;
    const int C = D / 16;  // 16-lane vectors per head
    const int NH = nkh * G;
    const int L = end - start;
    const int Ls = (L + 7) & ~7;
    const DecodeScratch w(s, NH, Ls, D, (size_t)NH * D);
    float* qf = w.extra;  // the queries widened once
    for (int i = 0; i < NH * D; ++i) qf[i] = bf16_to_f32(qp[i]);
    const int64_t tok_st = (int64_t)Hkv * D;
    const bf16_t* k0 = kc + (int64_t)kh0 * D;
    const bf16_t* v0 = vc + (int64_t)kh0 * D;
    const __m256 vscale = _mm256_set1_ps(scale);
    PagedRows<bf16_t> keys(k0, tab, bs, tok_st, start);
    // Prefetches the keys (to L1) and values (to L2, for the weighted sum) of the tokens PF_AHEAD on, the item's
    // heads' span of each row: the rows of a new block are a jump the hardware prefetcher does not follow (one
    // thread, 32 sequences x 200 tokens x 30 layers, pools past L3, in-process A/B: 30.4 -> 23.8 ms CPU; 8 ahead
    // 24.5, 32 ahead 25.4).
    constexpr int PF_AHEAD = 16;
    const int span = nkh * D * (int)sizeof(bf16_t);
    PagedRows<bf16_t> ahead(k0, tab, bs, tok_st, std::min(start + PF_AHEAD, end - 1));
    for (int pos = start; pos < end; pos += 8) {
        const bf16_t* kp[8];
        keys.next8(pos, end, kp);
        if (pos + PF_AHEAD < end) {
            const bf16_t* kf[8];
            ahead.next8(pos + PF_AHEAD, end, kf);
            for (int j = 0; j < 8 && pos + PF_AHEAD + j < end; ++j) {
                const char* kr = reinterpret_cast<const char*>(kf[j]);
                const char* vr = reinterpret_cast<const char*>(kf[j] - k0 + v0);
                for (int o = 0; o < span; o += 64) {
                    _mm_prefetch(kr + o, _MM_HINT_T0);
                    _mm_prefetch(vr + o, _MM_HINT_T1);
                }
            }
        }
        for (int h = 0; h < NH; ++h) {
            const int ko = (h / G) * D;
            __m512 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
            const float* qh = qf + (int64_t)h * D;
            for (int c = 0; c < C; ++c) {
                const __m512 qv = _mm512_loadu_ps(qh + 16 * c);
                for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(qv, load16_bf16(kp[j] + ko + 16 * c), acc[j]);
            }
            __m256 half[8];
            for (int j = 0; j < 8; ++j)
                half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
            keep_scores8(_mm256_mul_ps(hsum8(half), vscale), w.scores + (size_t)h * Ls + (pos - start),
                         w.run_max + 8 * h);
        }
    }
    softmax_rows(w.scores, Ls, L, w.run_max, NH, lse_out);
    weigh_values<Lanes16>(v0, tab, start, end, bs, tok_st, w, Ls, NH, G, D);
    store_heads(op, w.acc_rows, w.run_max, NH, D);
}
#endif

#ifdef FLOWRT_AVX512BF16
// [sum(a[0]), ..., sum(a[15])]: sixteen horizontal sums in one vector, a transpose-and-add tree (45 operations for
// sixteen tokens' scores, against 4.6 a token for folding to eight lanes and hsum8).
static inline __m512 hsum16x16(const __m512* a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i, a2i+1, a2i, a2i+1] partial sums
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a4i .. a4i+3] partial sums
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// GN heads' weighted sums of values over 64 (NV = 4) or 32 (NV = 2) columns of one KV head, two tokens per step:
// their value rows interleaved into (t, t+1) bf16 pairs once for all GN heads, and one dpbf16 per 16 columns per
// head with the pair of probabilities (P rounded to bf16, as the flash kernel's value product). Accumulator lanes
// come out in the interleaved order ([0..3, 8..11, ..] and [4..7, 12..15, ..] of each 32 columns); they are put
// back in order, scaled by the heads' normalizers and stored at op (head stride D) as O: bf16, or float32 (a part of
// a split sequence, merged later).
template <int NV, int GN, typename O>
static inline void decode_values_dpbf16(const bf16_t* v0, const int64_t* off, int L, const bf16_t* pp, int Lp,
                                        const float* inv, O* op, int D) {
    __m512 acc[GN][NV];
    for (int g = 0; g < GN; ++g)
        for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int t = 0; t < L; t += 2) {
        const bf16_t* a = v0 + off[t];
        const bf16_t* b = v0 + off[t + 1];  // (past the end: a row repeated, its probability 0)
        __m512i pr[NV];
        for (int c = 0; c < NV / 2; ++c) {
            const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(b + 32 * c);
            pr[2 * c] = _mm512_unpacklo_epi16(x, y);
            pr[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < GN; ++g) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(load_pair(pp + (size_t)g * Lp + t));
            for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], w, (__m512bh)pr[i]);
        }
    }
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < GN; ++g) {
        const __m512 vinv = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < NV / 2; ++c) {
            const __m512 lo = acc[g][2 * c], hi = acc[g][2 * c + 1];
            O* o = op + (int64_t)g * D + 32 * c;
            const __m512 first = _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), vinv);
            const __m512 second = _mm512_mul_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), vinv);
            if constexpr (sizeof(O) == 4) {
                _mm512_storeu_ps(o, first);
                _mm512_storeu_ps(o + 16, second);
            } else {
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(first));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), (__m256i)_mm512_cvtneps_pbh(second));
            }
        }
    }
}

template <int NV, typename O>
static inline void decode_values_heads(const bf16_t* v0, const int64_t* off, int L, const bf16_t* pp, int Lp,
                                       const float* inv, O* op, int D, int G) {
    for (int g = 0; g < G; g += 4) {
        const bf16_t* p = pp + (size_t)g * Lp;
        switch (std::min(4, G - g)) {
            case 1: decode_values_dpbf16<NV, 1>(v0, off, L, p, Lp, inv + g, op + (int64_t)g * D, D); break;
            case 2: decode_values_dpbf16<NV, 2>(v0, off, L, p, Lp, inv + g, op + (int64_t)g * D, D); break;
            case 3: decode_values_dpbf16<NV, 3>(v0, off, L, p, Lp, inv + g, op + (int64_t)g * D, D); break;
            default: decode_values_dpbf16<NV, 4>(v0, off, L, p, Lp, inv + g, op + (int64_t)g * D, D); break;
        }
    }
}

// decode_heads for bf16 pools with AVX512-BF16, head size a multiple of 32: the KV heads kh0 .. kh0+nkh-1 of one
// sequence, each with its G query heads, against tokens start .. end-1. The token rows' offsets are looked up once
// (padded with the last row to whole 16-token groups); scores are computed for sixteen tokens at a time (one dpbf16
// per 32 products, the sixteen accumulators summed by one transpose-and-add tree); the softmax is exponentiated
// sixteen lanes at a time and rounded to bf16 for the value product, which reads each value row once per group of up
// to four query heads (decode_values_dpbf16).
template <int DD, typename O>
__attribute__((noinline))
static void decode_heads_dpbf16(const bf16_t* qp, const bf16_t* kc, const bf16_t* vc, const int32_t* tab, int start,
                                int end, int Hkv, int kh0, int nkh, int G, int Drt, int bs, float scale, O* op,
                                float* lse_out, std::vector<float>& s) {
    const int D = DD > 0 ? DD : Drt;
    const int NH = nkh * G;
    const int L = end - start;
    const int Ls = (L + 15) & ~15;
    // scratch (floats): scores [NH][Ls], running maxima [NH][16], normalizers [NH], probabilities as bf16 [NH][Ls]
    // (Ls / 2 floats a head), row offsets [Ls] int64
    s.resize((size_t)NH * Ls + 16 * (size_t)NH + NH + (size_t)NH * Ls / 2 + 2 * (size_t)Ls + 16);
    float* scores = s.data();
    float* run_max = scores + (size_t)NH * Ls;
    float* inv = run_max + 16 * (size_t)NH;
    bf16_t* pp = reinterpret_cast<bf16_t*>(inv + NH);
    int64_t* off = reinterpret_cast<int64_t*>(((uintptr_t)(pp + (size_t)NH * Ls) + 7) & ~(uintptr_t)7);
    const int64_t tok_st = (int64_t)Hkv * D;
    {
        int bi = start / bs, o = start % bs;
        for (int t = 0; t < L; ++t) {
            off[t] = ((int64_t)tab[bi] * bs + o) * tok_st;
            if (++o == bs) o = 0, ++bi;
        }
        for (int t = L; t < Ls; ++t) off[t] = off[L - 1];
    }
    const bf16_t* k0 = kc + (int64_t)kh0 * D;
    const bf16_t* v0 = vc + (int64_t)kh0 * D;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int h = 0; h < NH; ++h) _mm512_storeu_ps(run_max + 16 * h, _mm512_set1_ps(-INFINITY));
    // Streams each segment of SEG tokens' keys and values into cache (plain loads, the rows of the tokens PF_AHEAD
    // on prefetched to L2) before computing its scores from cache. On the EPYC measured, loads from DRAM did not
    // overlap the arithmetic, prefetched or not (a prefetch of the next tokens' rows changed nothing), while a loop
    // of loads alone streams a block table's scattered rows at ~15 GB/s. One thread, 32 x 200 tokens, pools past L3,
    // in-process A/B: 0.71 ms a layer without the streaming loop, 0.50 with it for the keys, 0.43 for both (0.84 for
    // the previous kernel). On a fresh engine's pools (every sequence's blocks in order) the previous kernel's loads
    // did overlap its arithmetic and it took the same ~0.39 ms as this one.
    constexpr int SEG = 64, PF_AHEAD = 32;
    const int span = nkh * D;  // the item's heads' elements of a token row
    __m512i sink = _mm512_setzero_si512();
    for (int t = 0; t < std::min(PF_AHEAD, L); ++t)  // (the first rows too: 0.41 -> 0.39 ms)
        for (int o = 0; o < span; o += 32) {
            _mm_prefetch(reinterpret_cast<const char*>(k0 + off[t] + o), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(v0 + off[t] + o), _MM_HINT_T1);
        }
    for (int t0 = 0; t0 < L; t0 += 16) {
        if (t0 % SEG == 0) {
            for (int t = t0; t < std::min(t0 + SEG, L); ++t) {
                if (t + PF_AHEAD < L)
                    for (int o = 0; o < span; o += 32) {
                        _mm_prefetch(reinterpret_cast<const char*>(k0 + off[t + PF_AHEAD] + o), _MM_HINT_T1);
                        _mm_prefetch(reinterpret_cast<const char*>(v0 + off[t + PF_AHEAD] + o), _MM_HINT_T1);
                    }
                for (int o = 0; o < span; o += 32) {
                    sink = _mm512_or_si512(sink, _mm512_loadu_si512(k0 + off[t] + o));
                    sink = _mm512_or_si512(sink, _mm512_loadu_si512(v0 + off[t] + o));
                }
            }
        }
        for (int h = 0; h < NH; ++h) {
            const bf16_t* kh = k0 + (h / G) * D;
            const bf16_t* qh = qp + (int64_t)h * D;
            __m512 acc[16];
            for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
            for (int c = 0; c < D; c += 32) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + c);
                for (int j = 0; j < 16; ++j)
                    acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(kh + off[t0 + j] + c));
            }
            const __m512 sc = _mm512_mul_ps(hsum16x16(acc), vscale);
            _mm512_storeu_ps(scores + (size_t)h * Ls + t0, sc);
            // (lanes past the end repeat the last token's score: the running maximum stays exact)
            _mm512_storeu_ps(run_max + 16 * h, _mm512_max_ps(_mm512_loadu_ps(run_max + 16 * h), sc));
        }
    }
    asm volatile("" : : "v"(sink));  // (the streaming loads are kept)
    for (int h = 0; h < NH; ++h) {
        const float m = _mm512_reduce_max_ps(_mm512_loadu_ps(run_max + 16 * h));
        const __m512 vm = _mm512_set1_ps(m);
        const float* sh = scores + (size_t)h * Ls;
        bf16_t* ph = pp + (size_t)h * Ls;
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < Ls; t += 16) {
            const __mmask16 keep = L - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (L - t)) - 1);
            const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), vm), keep);
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + t), (__m256i)_mm512_cvtneps_pbh(p));
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[h] = 1.f / total;
        if (lse_out) lse_out[h] = m + std::log(total);
    }
    for (int k = 0; k < nkh; ++k)
        for (int d = 0; d < D; d += 64) {
            const bf16_t* vk = v0 + (int64_t)k * D + d;
            O* ok = op + (int64_t)k * G * D + d;
            if (D - d >= 64)
                decode_values_heads<4>(vk, off, L, pp + (size_t)k * G * Ls, Ls, inv + k * G, ok, D, G);
            else
                decode_values_heads<2>(vk, off, L, pp + (size_t)k * G * Ls, Ls, inv + k * G, ok, D, G);
        }
}

// paged_decode for bf16 pools with AVX512-BF16 (decode_heads_dpbf16), head size a multiple of 32. A sequence with
// more than DECODE_SPLIT keys is cut into equal parts of at most that many, each a work item of its own whose output
// (float32) and log-sum-exp are merged afterwards, so that a few long sequences (batch 1 at long context) keep every
// thread busy. The parts depend on the sequence's length only, never on the batch or the thread count: a row's
// numbers are the same whatever else runs in the call (speculative verify rows and plain decode agree). Work items:
// DecodeItems over the (sequence, part) units.
static constexpr int DECODE_SPLIT = 512;

static void paged_decode_dpbf16(const bf16_t* q, int64_t q_st, const bf16_t* kc, const bf16_t* vc,
                                const int32_t* tables, int64_t tab_st, const int32_t* seq_lens, const int64_t* rows,
                                int32_t start, bf16_t* out, int64_t o_st, float* lse, int B, int H, int Hkv, int D,
                                int bs, float scale, int heads_outer) {
    const int G = H / Hkv;
    std::vector<int> unit_b, unit_p, parts(B);
    for (int b = 0; b < B; ++b) {
        const int L = seq_lens[b] - start;
        parts[b] = L > DECODE_SPLIT ? (L + DECODE_SPLIT - 1) / DECODE_SPLIT : 1;
        for (int p = 0; p < parts[b]; ++p) unit_b.push_back(b), unit_p.push_back(p);
    }
    const int U = (int)unit_b.size();
    const bool split = U > B;
    std::vector<float> part_out(split ? (size_t)U * H * D : 0), part_lse(split ? (size_t)U * H : 0);
    const DecodeItems it(U, Hkv, heads_outer);
    const int per_item = it.heads();
    auto item = [&](int kh0, int u, std::vector<float>& s) {
        const int b = unit_b[u];
        const int64_t row = rows ? rows[b] : b;
        const bf16_t* qp = q + row * q_st + (int64_t)kh0 * G * D;
        const int end = seq_lens[b];
        if (end <= start) {
            no_keys(out + row * o_st + (int64_t)kh0 * G * D, lse ? lse + (int64_t)b * H + kh0 * G : nullptr,
                    per_item * G, D);
            return;
        }
        const int32_t* tab = tables + (int64_t)b * tab_st;
        const int size = (end - start + parts[b] - 1) / parts[b];
        const int s0 = start + unit_p[u] * size, e0 = std::min(end, s0 + size);
        with_head_size(D, [&](auto DD) {
            if (parts[b] == 1) {
                bf16_t* op = out + row * o_st + (int64_t)kh0 * G * D;
                float* lp = lse ? lse + (int64_t)b * H + kh0 * G : nullptr;
                decode_heads_dpbf16<decltype(DD)::value>(qp, kc, vc, tab, s0, e0, Hkv, kh0, per_item, G, D, bs, scale,
                                                         op, lp, s);
            } else {
                float* op = part_out.data() + ((size_t)u * H + kh0 * G) * D;
                float* lp = part_lse.data() + (size_t)u * H + kh0 * G;
                decode_heads_dpbf16<decltype(DD)::value>(qp, kc, vc, tab, s0, e0, Hkv, kh0, per_item, G, D, bs, scale,
                                                         op, lp, s);
            }
        });
    };
    // each split sequence's parts merged: weights exp(lse_p - lse), lse = log sum exp(lse_p)
    auto merge = [&]() {
        if (!split) return;
        #pragma omp for schedule(static)
        for (int u0 = 0; u0 < U; ++u0) {
            const int b = unit_b[u0];
            if (unit_p[u0] != 0 || parts[b] == 1) continue;
            const int n = parts[b];
            const int64_t row = rows ? rows[b] : b;
            for (int h = 0; h < H; ++h) {
                float m = -INFINITY;
                for (int p = 0; p < n; ++p) m = std::max(m, part_lse[(size_t)(u0 + p) * H + h]);
                float sum = 0.f, acc[256];
                for (int d = 0; d < D; ++d) acc[d] = 0.f;
                for (int p = 0; p < n; ++p) {
                    const float e = std::exp(part_lse[(size_t)(u0 + p) * H + h] - m);
                    sum += e;
                    const float* po = part_out.data() + ((size_t)(u0 + p) * H + h) * D;
                    for (int d = 0; d < D; ++d) acc[d] += e * po[d];
                }
                const float inv = 1.f / sum;
                bf16_t* op = out + row * o_st + (int64_t)h * D;
                for (int d = 0; d < D; ++d) op[d] = f32_to_bf16(acc[d] * inv);
                if (lse) lse[(int64_t)b * H + h] = m + std::log(sum);
            }
        }
    };
    run_decode_items(it, item, merge);
}
#endif

namespace {
// Decode attention (one query token per sequence) over a paged pool [N, bs, Hkv, D], in place.
// Sequence b's query row is rows[b] (or b when rows is null); it attends tokens start .. seq_lens[b]-1 of its
// block table. out rows follow q rows. lse (nullable) gets [B, H] log-sum-exp of the scaled scores.
// Returns -1 (doing nothing) for a head size it does not handle.
template <typename T>
int paged_decode(const T* q, int64_t q_st, const T* kc, const T* vc, const int32_t* tables, int64_t tab_st,
                 const int32_t* seq_lens, const int64_t* rows, int32_t start, T* out, int64_t o_st, float* lse, int B,
                 int H, int Hkv, int D, int bs, float scale, int heads_outer) {
    if (D > 256) return -1;
#ifdef FLOWRT_AVX512BF16
    if constexpr (sizeof(T) == 2) {
        if (D % 32 == 0) {
            paged_decode_dpbf16(q, q_st, kc, vc, tables, tab_st, seq_lens, rows, start, out, o_st, lse, B, H, Hkv, D,
                                bs, scale, heads_outer);
            return 0;
        }
    }
#endif
    const int G = H / Hkv;
    const DecodeItems it(B, Hkv, heads_outer);  // units: the sequences
    const int per_item = it.heads();
    auto item = [&](int kh0, int b, std::vector<float>& s) {
        const int64_t row = rows ? rows[b] : b;
        const T* qp = q + row * q_st + (int64_t)kh0 * G * D;
        T* op = out + row * o_st + (int64_t)kh0 * G * D;
        float* lp = lse ? lse + (int64_t)b * H + kh0 * G : nullptr;
        const int end = seq_lens[b];
        if (end <= start) return no_keys(op, lp, per_item * G, D);
        const int32_t* tab = tables + (int64_t)b * tab_st;
#if defined(FLOWRT_AVX512) && !defined(FLOWRT_AVX512BF16)
        if constexpr (sizeof(T) == 2) {
            if (D % 32 == 0) {
                return with_head_size(D, [&](auto DD) {
                    decode_heads_bf16_512<decltype(DD)::value>(qp, kc, vc, tab, start, end, Hkv, kh0, per_item, G, D,
                                                               bs, scale, op, lp, s);
                });
            }
        }
#endif
#ifdef FLOWRT_AVX2
        if (D % 8 == 0) {
            return with_head_size(D, [&](auto DD) {
                decode_heads<decltype(DD)::value, T>(qp, kc, vc, tab, start, end, Hkv, kh0, per_item, G, D, bs, scale,
                                                     op, lp, s);
            });
        }
#endif
        for (int k = 0; k < per_item; ++k)
            decode_scalar<T>(qp + k * G * D, kc, vc, tab, start, end, Hkv, kh0 + k, G, D, bs, scale, op + k * G * D,
                             lp ? lp + k * G : nullptr, s);
    };
    run_decode_items(it, item, [] {});
    return 0;
}
}  // namespace

// Attention of many query rows that read the same block table (a sequence's prefill chunk; every member of a group
// that shares a prefix, against that prefix), as small matrix products instead of one row at a time. Rows are
// grouped: group g is rows group_start[g] .. group_start[g+1]-1 (indices into rows/ends), reading block table g;
// row i attends the keys key_start .. ends[i]-1 of it. Work items are (group, KV head, tile of rows); a tile's query
// vectors are its rows x the query heads of the KV head. An item walks its keys in chunks of FLASH_CHUNK tokens: it
// packs the chunk's keys (transposed) and values into projection panels in its own buffers, computes the tile's
// scores and weighted values with gemm_tile (FMA-bound from L1/L2) and keeps an online softmax per query vector.
// Outputs: without lse_in, out is written, with lse_out (nullable, [R, H] in the order of rows) the log-sum-exp of
// each row's scores (-inf, and a zero output, for a row without keys); with lse_in, out already holds each row's
// attention over other keys with that log-sum-exp, and the two parts are merged.
// Returns -1 (doing nothing) without AVX2 + FMA or for a head size not a multiple of 16 (up to 256).
constexpr int FLASH_CHUNK = 256;
// query vectors a tile at most: each packed chunk serves them all (Zen3, 2 threads: 72 was a few % ahead of 24-48)
constexpr int FLASH_TILE_Q = 72;
// the same for the AVX-512 bf16 form (query vectors rounded up to whole 16-lane vectors: 64 is one score tile's width)
// (single thread, 4 x 512 causal, SmolLM2 shape: chunks of 64-256 keys and tiles of 64-128 query vectors within 3%)
constexpr int FLASH512_CHUNK = 128;
constexpr int FLASH512_TILE_Q = 64;

#ifdef FLOWRT_AVX2
namespace {
template <typename T>
struct FlashArgs {
    const T* q; int64_t q_st; const int64_t* rows; const int32_t* ends; const T* kc; const T* vc;
    T* out; int64_t o_st; const float* lse_in; float* lse_out; int H, Hkv, D, bs; float scale;
};

// The keys key_start + c0 .. + n of block table `tab`, KV head kh: keys as n/16 panels [D][16] (transposed eight by
// eight; a partial last panel padded with zero keys), values as D/16 panels [n][16].
template <typename T>
static void flash_pack(const FlashArgs<T>& a, const int32_t* tab, int kh, int pos0, int n, float* kp, float* vp) {
    const int D = a.D, bs = a.bs;
    const int64_t tok_st = (int64_t)a.Hkv * D;
    alignas(32) static const T zeros[256] = {};
    for (int p0 = 0; p0 < n; p0 += 16) {
        const T* krow[16];
        for (int j = 0; j < 16; ++j) {
            if (p0 + j >= n) {
                krow[j] = zeros;
                continue;
            }
            const int pos = pos0 + p0 + j;
            const int64_t off = ((int64_t)tab[pos / bs] * bs + pos % bs) * tok_st + (int64_t)kh * D;
            krow[j] = a.kc + off;
            const T* vs = a.vc + off;
            for (int dp = 0; dp < D / 16; ++dp) {
                float* vd = vp + ((size_t)dp * n + p0 + j) * 16;
                if constexpr (sizeof(T) == 4) {
                    std::memcpy(vd, vs + dp * 16, 64);
                } else {
                    _mm256_storeu_ps(vd, load8(vs + dp * 16));
                    _mm256_storeu_ps(vd + 8, load8(vs + dp * 16 + 8));
                }
            }
        }
        float* kdst = kp + (size_t)p0 * D;
        for (int j0 = 0; j0 < 16; j0 += 8)
            for (int d0 = 0; d0 < D; d0 += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; ++j) r[j] = load8(krow[j0 + j] + d0);
                transpose8(r);
                for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kdst + (d0 + d) * 16 + j0, r[d]);
            }
    }
}

struct FlashScratch {
    std::vector<float> buf;
    float *kp, *vp, *qt, *sc, *oc, *ob, *m, *l;
    void size(int Mq, int D) {
        const size_t pk = (size_t)FLASH_CHUNK * D;
        const size_t need = 2 * pk + (size_t)Mq * (3 * D + FLASH_CHUNK + 2) + 8;
        if (buf.size() < need) buf.resize(need);
        kp = buf.data() + ((-(reinterpret_cast<uintptr_t>(buf.data()) / 4)) & 7);  // 32-byte aligned panels
        vp = kp + pk;
        qt = vp + pk;
        sc = qt + (size_t)Mq * D;
        oc = sc + (size_t)Mq * FLASH_CHUNK;
        ob = oc + (size_t)Mq * D;
        m = ob + (size_t)Mq * D;
        l = m + Mq;
    }
};

// A work item's outputs: query vector i (row i0 + i / G, head kh * G + i % G) is o[i] / l[i] (a zero row without
// keys), with its log-sum-exp m[i] + log(l[i]) to lse_out, or merged with the part already in out (lse_in).
template <typename T>
static void flash_store(const FlashArgs<T>& a, int kh, int i0, int Mq, const float* ob, const float* m,
                        const float* l) {
    const int D = a.D, G = a.H / a.Hkv;
    for (int i = 0; i < Mq; ++i) {
        const int64_t row = a.rows[i0 + i / G], h = (int64_t)kh * G + i % G, st = (int64_t)(i0 + i / G) * a.H + h;
        T* dst = a.out + row * a.o_st + h * D;
        const float* o = ob + (size_t)i * D;
        const float lp = l[i] > 0.f ? m[i] + std::log(l[i]) : -INFINITY;
        if (a.lse_in) {  // merge with the part already in dst (normalized, log-sum-exp lse_in) by their weights
            const float lo = a.lse_in[st], mm = std::max(lp, lo);
            if (mm == -INFINITY) continue;
            const float pa = lp == -INFINITY ? 0.f : std::exp(lp - mm), pb = lo == -INFINITY ? 0.f : std::exp(lo - mm);
            const float wp = pa / (pa + pb) / (l[i] > 0.f ? l[i] : 1.f), wo = pb / (pa + pb);
            for (int d = 0; d < D; ++d) dst[d] = from_f32<T>(o[d] * wp + (wo != 0.f ? to_f32(dst[d]) * wo : 0.f));
            continue;
        }
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int d = 0; d < D; ++d) dst[d] = from_f32<T>(o[d] * inv);
        if (a.lse_out) a.lse_out[st] = lp;
    }
}


// One work item: rows idx[0..nr) (indices into rows/ends) of one group, KV head kh, keys key_start .. ends-1.
template <typename T>
static void flash_tile(const FlashArgs<T>& a, const int32_t* tab, int key_start, int kh, int i0, int nr,
                       FlashScratch& w) {
    const int D = a.D, G = a.H / a.Hkv, Mq = nr * G;
    int E = key_start;
    for (int r = 0; r < nr; ++r) E = std::max(E, a.ends[i0 + r]);
    for (int i = 0; i < Mq; ++i) {
        const T* src = a.q + a.rows[i0 + i / G] * a.q_st + ((int64_t)kh * G + i % G) * D;
        for (int d = 0; d < D; ++d) w.qt[(size_t)i * D + d] = to_f32(src[d]) * a.scale;
        w.m[i] = -INFINITY;
        w.l[i] = 0.f;
    }
    std::memset(w.ob, 0, sizeof(float) * (size_t)Mq * D);
    for (int c0 = key_start; c0 < E; c0 += FLASH_CHUNK) {
        const int n = std::min(FLASH_CHUNK, E - c0), np = (n + 15) / 16;
        flash_pack(a, tab, kh, c0, n, w.kp, w.vp);
        gemm_small(w.qt, D, Mq, D, w.kp, np, n - (np - 1) * 16, w.sc, FLASH_CHUNK);
        for (int i = 0; i < Mq; ++i) {
            float* si = w.sc + (size_t)i * FLASH_CHUNK;
            const int ni = std::min(n, a.ends[i0 + i / G] - c0);  // this row's keys in the chunk (causal limit)
            if (ni <= 0) {
                std::memset(si, 0, sizeof(float) * n);
                continue;
            }
            const float mn = std::max(w.m[i], row_max(si, ni));
            const float alpha = w.m[i] == -INFINITY ? 0.f : fexp(w.m[i] - mn);
            const float sum = exp_sum(si, ni, mn);
            for (int t = ni; t < n; ++t) si[t] = 0.f;
            w.l[i] = w.l[i] * alpha + sum;
            w.m[i] = mn;
            if (alpha != 1.f)
                for (int d = 0; d < D; ++d) w.ob[(size_t)i * D + d] *= alpha;
        }
        gemm_small(w.sc, FLASH_CHUNK, Mq, n, w.vp, D / 16, 16, w.oc, D);  // value panel dp starts at dp * n * 16
        for (size_t x = 0; x < (size_t)Mq * D; ++x) w.ob[x] += w.oc[x];
    }
    flash_store(a, kh, i0, Mq, w.ob, w.m, w.l);
}

#ifdef FLOWRT_AVX512
// The bf16 form on AVX-512 (tile512.h): scores come out transposed (key tokens down, query vectors across) so the
// online softmax runs sixteen query vectors to a register and the score product reads the keys in place from the
// pool (no packing); only the chunk's values are repacked (paired tokens with AVX512-BF16, widened without).

struct Flash512Scratch {
    std::vector<float> buf;
    std::vector<const bf16_t*> krow;
    float *s, *o, *m, *l, *alpha;
    int32_t* lim;                 // each query vector's end
    bf16_t* qtmp;                 // the query vectors side by side
    int32_t *qp, *pp, *vp;        // (bf16 form) queries, probabilities, values as pairs
    float *qf, *kf, *vf;          // (float form) queries, keys, values widened
    void size(int ss, int D) {
        const size_t rows = FLASH512_CHUNK;
        const size_t need = 16 + rows * ss + (size_t)ss * D + 4 * (size_t)ss + (size_t)ss * D / 2 + (size_t)D * ss
#ifdef FLOWRT_AVX512BF16
                            + (size_t)FLASH512_CHUNK / 2 * ss + (size_t)FLASH512_CHUNK / 2 * D;
#else
                            + 2 * rows * D;
#endif
        if (buf.size() < need) buf.resize(need);
        krow.resize(rows);
        float* p = buf.data() + ((-(reinterpret_cast<uintptr_t>(buf.data()) / 4)) & 15);  // 64-byte aligned
        s = p; p += rows * ss;
        o = p; p += (size_t)ss * D;
        m = p; l = m + ss; alpha = l + ss; lim = reinterpret_cast<int32_t*>(alpha + ss);
        qtmp = reinterpret_cast<bf16_t*>(lim + ss);
        p += 4 * (size_t)ss + (size_t)ss * D / 2;
#ifdef FLOWRT_AVX512BF16
        qp = reinterpret_cast<int32_t*>(p); p += (size_t)D / 2 * ss;
        pp = reinterpret_cast<int32_t*>(p); p += (size_t)FLASH512_CHUNK / 2 * ss;
        vp = reinterpret_cast<int32_t*>(p);
#else
        qf = p; p += (size_t)D * ss;
        kf = p; p += rows * D;
        vf = p;
#endif
    }
};

// flash_tile's work item in the AVX-512 form (bf16 pools only).
static void flash_tile512(const FlashArgs<bf16_t>& a, const int32_t* tab, int key_start, int kh, int i0, int nr,
                          Flash512Scratch& w) {
    const int D = a.D, G = a.H / a.Hkv, Mq = nr * G, ss = (Mq + 15) & ~15, nqv = ss / 16;
    const int64_t tok_st = (int64_t)a.Hkv * D;
    int E = key_start;
    for (int r = 0; r < nr; ++r) E = std::max(E, a.ends[i0 + r]);
    // the item's query vectors copied side by side (zeros for padding lanes), then as (d, d+1) pairs across query
    // vectors: one gather (from L1) per pair and 16 vectors
    for (int i = 0; i < ss; ++i) {
        const bool real = i < Mq;
        bf16_t* dst = w.qtmp + (size_t)i * D;
        if (real)
            std::memcpy(dst, a.q + a.rows[i0 + i / G] * a.q_st + ((int64_t)kh * G + i % G) * D, sizeof(bf16_t) * D);
        else
            std::memset(dst, 0, sizeof(bf16_t) * D);
        w.lim[i] = real ? a.ends[i0 + i / G] : 0;  // a padding lane sees no keys
        w.m[i] = -INFINITY;
        w.l[i] = 0.f;
    }
    const __m512i lane_off = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(D));
    for (int v = 0; v < ss / 16; ++v)
        for (int k = 0; k < D / 2; ++k) {
            const __m512i x = _mm512_i32gather_epi32(lane_off, w.qtmp + (size_t)16 * v * D + 2 * k, 2);
#ifdef FLOWRT_AVX512BF16
            _mm512_storeu_si512(w.qp + (size_t)k * ss + 16 * v, x);
#else
            _mm512_storeu_si512(w.qf + (size_t)(2 * k) * ss + 16 * v, _mm512_slli_epi32(x, 16));
            _mm512_storeu_si512(w.qf + (size_t)(2 * k + 1) * ss + 16 * v,
                                _mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
#endif
        }
    std::memset(w.o, 0, sizeof(float) * (size_t)ss * D);
    const __m512 vscale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int c0 = key_start; c0 < E; c0 += FLASH512_CHUNK) {
        const int n = std::min(FLASH512_CHUNK, E - c0);
        for (int t = 0; t < n; ++t) {
            const int pos = c0 + t;
            w.krow[t] = a.kc + ((int64_t)tab[pos / a.bs] * a.bs + pos % a.bs) * tok_st + (int64_t)kh * D;
        }
        // the next chunk's keys and values towards L2 while this one computes: a shared prefix read by decode rows is
        // past L3 by the next step (the weights stream through it), and its blocks are jumps the hardware
        // prefetcher does not follow
        for (int pos = c0 + FLASH512_CHUNK, stop = std::min(E, c0 + 2 * FLASH512_CHUNK); pos < stop; ++pos) {
            const int64_t off = ((int64_t)tab[pos / a.bs] * a.bs + pos % a.bs) * tok_st + (int64_t)kh * D;
            for (int o = 0; o < D * (int)sizeof(bf16_t); o += 64) {
                _mm_prefetch(reinterpret_cast<const char*>(a.kc + off) + o, _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char*>(a.vc + off) + o, _MM_HINT_T1);
            }
        }
        // the chunk's values: token pairs (a zero token after an odd last one), or widened rows
        for (int t = 0; t < n; t += 2) {
            const bf16_t* v0 = w.krow[t] - a.kc + a.vc;
            const bf16_t* v1 = t + 1 < n ? w.krow[t + 1] - a.kc + a.vc : nullptr;
            for (int d = 0; d < D; d += 16) {
#ifdef FLOWRT_AVX512BF16
                const __m512i lo = zext16(v0 + d), hi = v1 ? zext16(v1 + d) : _mm512_setzero_si512();
                _mm512_storeu_si512(w.vp + (size_t)(t / 2) * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
#else
                _mm512_storeu_ps(w.vf + (size_t)t * D + d, load16_bf16(v0 + d));
                if (v1) _mm512_storeu_ps(w.vf + (size_t)(t + 1) * D + d, load16_bf16(v1 + d));
#endif
            }
        }
#ifndef FLOWRT_AVX512BF16
        for (int t = 0; t < n; ++t)
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(w.kf + (size_t)t * D + d, load16_bf16(w.krow[t] + d));
#endif
        // scores: six tokens x up to four query vectors a tile
        for (int t0 = 0; t0 < n; t0 += 6)
            for (int v0 = 0; v0 < nqv; v0 += 4) {
#ifdef FLOWRT_AVX512BF16
                score_block(std::min(6, n - t0), std::min(4, nqv - v0), w.krow.data() + t0, w.qp + 16 * v0, ss, D,
                            w.s + (size_t)t0 * ss + 16 * v0);
#else
                score_block(std::min(6, n - t0), std::min(4, nqv - v0), w.kf + (size_t)t0 * D, w.qf + 16 * v0, ss,
                            D, w.s + (size_t)t0 * ss + 16 * v0);
#endif
            }
        // online softmax, sixteen query vectors at a time; a key past a row's end (causal) gets probability 0. Where
        // every lane sees the whole chunk (a shared prefix, the keys before a chunk's diagonal) nothing is masked.
        auto softmax16 = [&](int v, auto whole) __attribute__((always_inline)) {
            constexpr bool all_keys = decltype(whole)::value;
            const __m512i lim = _mm512_sub_epi32(_mm512_loadu_si512(w.lim + 16 * v), _mm512_set1_epi32(c0));
            auto keep = [&](int t) __attribute__((always_inline)) {
                return all_keys ? (__mmask16)0xffff : _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(t));
            };
            const float* sv = w.s + 16 * v;
            __m512 mx = ninf;
            for (int t = 0; t < n; ++t) mx = _mm512_mask_max_ps(mx, keep(t), mx, _mm512_loadu_ps(sv + (size_t)t * ss));
            // (the maximum of the raw scores, scaled once: scale > 0, as every attention scale is)
            const __m512 m_old = _mm512_loadu_ps(w.m + 16 * v), m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx, vscale));
            // rows without keys so far keep m = -inf; exponents are taken against 0 there (all masked anyway)
            const __m512 m_ref = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ),
                                                    _mm512_setzero_ps());
            __m512 sum = _mm512_setzero_ps();
            auto prob = [&](int t) __attribute__((always_inline)) {
                return exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sv + (size_t)t * ss), vscale, m_ref), keep(t));
            };
#ifdef FLOWRT_AVX512BF16
            // (P[i][t], P[i][t+1]) pairs: the two rows rounded to bf16, then interleaved
            const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                   22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int t = 0; t < n; t += 2) {
                const __m512 p0 = prob(t), p1 = t + 1 < n ? prob(t + 1) : _mm512_setzero_ps();
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
                _mm512_storeu_si512(w.pp + (size_t)(t / 2) * ss + 16 * v, _mm512_permutexvar_epi16(inter, both));
            }
#else
            for (int t = 0; t < n; ++t) {
                const __m512 p = prob(t);
                sum = _mm512_add_ps(sum, p);
                _mm512_storeu_ps(w.s + (size_t)t * ss + 16 * v, p);
            }
#endif
            const __m512 alpha = exp16(_mm512_sub_ps(m_old, m_ref));
            _mm512_storeu_ps(w.alpha + 16 * v, alpha);
            _mm512_storeu_ps(w.l + 16 * v, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(w.l + 16 * v), alpha), sum));
            _mm512_storeu_ps(w.m + 16 * v, m_new);
        };
        for (int v = 0; v < nqv; ++v) {
            if (_mm512_reduce_min_epi32(_mm512_loadu_si512(w.lim + 16 * v)) >= c0 + n)
                softmax16(v, std::true_type{});
            else
                softmax16(v, std::false_type{});
        }
        // o <- o * alpha + P V: six query vectors x up to 64 columns a tile
        for (int i = 0; i < Mq; i += 6)
            for (int d = 0; d < D; d += 64) {
#ifdef FLOWRT_AVX512BF16
                value_block(std::min(6, Mq - i), std::min(4, (D - d) / 16), w.pp + i, ss, w.vp + d, D, n,
                            w.o + (size_t)i * D + d, w.alpha + i);
#else
                value_block(std::min(6, Mq - i), std::min(4, (D - d) / 16), w.s + i, ss, w.vf + d, D, n,
                            w.o + (size_t)i * D + d, w.alpha + i);
#endif
            }
    }
    flash_store(a, kh, i0, Mq, w.o, w.m, w.l);
}
#endif
}  // namespace
#endif

namespace {
template <typename T>
int paged_flash(const T* q, int64_t q_st, const int64_t* rows, const int32_t* ends, const int32_t* group_start, int NG,
                const int32_t* tables, int64_t tab_st, int key_start, const T* kc, const T* vc, T* out, int64_t o_st,
                const float* lse_in, float* lse_out, int H, int Hkv, int D, int bs, float scale) {
#ifndef FLOWRT_AVX2
    return -1;
#else
    if (D % 16 != 0 || D > 256) return -1;
    const int G = H / Hkv;
#ifdef FLOWRT_AVX512
    constexpr bool wide = sizeof(T) == 2;  // bf16 on AVX-512: flash_tile512
#else
    constexpr bool wide = false;
#endif
    // rows per tile at most: ~FLASH_TILE_Q (FLASH512_TILE_Q) query vectors a tile
    const int rt = std::max(1, (wide ? FLASH512_TILE_Q : FLASH_TILE_Q) / G);
    std::vector<int> tiles(NG);
    int64_t n_items = 0;
    for (int g = 0; g < NG; ++g) {
        tiles[g] = (group_start[g + 1] - group_start[g] + rt - 1) / rt;
        n_items += (int64_t)Hkv * tiles[g];
    }
    // Few items for the threads (decode rows of a few forks against their shared prefix: one tile per KV head, 3 items
    // for 2 threads): each group's tiles multiplied by the factor (1-4) whose items the threads finish first, taken
    // in order, an item costing its padded query lanes x its keys. Splitting rows adds no lanes where the query
    // vectors were padded anyway (8 forks x 3 query heads: 24 lanes padded to 32, or twice 12 padded to 16) and
    // rereads keys then in L2. 8 forks x 1,024 prefix tokens, 2 threads, bf16: 3 items of 32 lanes become 6 of 16.
    if (n_items < 2 * (int64_t)flowrt_threads && flowrt_threads > 1) {
        const int lane = wide ? 16 : 6;  // query vectors padded to 16 lanes (AVX-512 form), 6-row tiles (AVX2 form)
        auto makespan = [&](int m) {
            std::vector<int64_t> busy(flowrt_threads, 0);
            for (int g = 0; g < NG; ++g) {
                const int nr = group_start[g + 1] - group_start[g], nt = std::min(nr, tiles[g] * m);
                const int rows_t = nr ? (nr + nt - 1) / nt : 0;
                int64_t keys = 0;
                for (int i = group_start[g]; i < group_start[g + 1]; ++i)
                    keys = std::max<int64_t>(keys, ends[i] - key_start);
                for (int kh = 0; kh < Hkv; ++kh)
                    for (int t = 0; t < nt; ++t) {
                        const int c = std::min(rows_t, nr - t * rows_t);
                        if (c <= 0) continue;
                        *std::min_element(busy.begin(), busy.end()) += (int64_t)(c * G + lane - 1) / lane * lane * keys;
                    }
            }
            return *std::max_element(busy.begin(), busy.end());
        };
        int best = 1;
        int64_t best_t = makespan(1);
        for (int m = 2; m <= 4; ++m) {
            const int64_t t = makespan(m);
            if (t < best_t) best = m, best_t = t;
        }
        for (int g = 0; g < NG; ++g) tiles[g] = std::min(group_start[g + 1] - group_start[g], tiles[g] * best);
    }
    // items: (group, KV head, tile), numbered through a prefix sum of each group's tiles
    std::vector<int64_t> first(NG + 1, 0);
    for (int g = 0; g < NG; ++g) first[g + 1] = first[g] + (int64_t)Hkv * tiles[g];
    const FlashArgs<T> a{q, q_st, rows, ends, kc, vc, out, o_st, lse_in, lse_out, H, Hkv, D, bs, scale};
    #pragma omp parallel if (first[NG] > 1) num_threads(flowrt_threads)
    {
        auto run = [&](auto& w, auto tile) {
            int g = 0;
            #pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < first[NG]; ++item) {
                while (first[g + 1] <= item) ++g;
                while (first[g] > item) --g;
                const int nr = group_start[g + 1] - group_start[g], nt = tiles[g];
                const int rows_t = (nr + nt - 1) / nt;  // the group's rows spread evenly over its tiles
                const int64_t local = item - first[g];
                const int kh = (int)(local / nt), t = (int)(local % nt);
                const int i0 = group_start[g] + t * rows_t;
                if (i0 < group_start[g + 1])
                    tile(a, tables + (int64_t)g * tab_st, key_start, kh, i0, std::min(rows_t, group_start[g + 1] - i0),
                         w);
            }
        };
#ifdef FLOWRT_AVX512
        if constexpr (wide) {
            static thread_local Flash512Scratch w;
            w.size((rt * G + 15) & ~15, D);
            run(w, flash_tile512);
        } else
#endif
        {
            static thread_local FlashScratch w;
            w.size(rt * G, D);
            run(w, flash_tile<T>);
        }
    }
    return 0;
#endif
}
}  // namespace

extern "C" {

int paged_decode_f32(const float* q, int64_t q_st, const float* kc, const float* vc, const int32_t* tables,
                     int64_t tab_st, const int32_t* seq_lens, const int64_t* rows, int32_t start, float* out,
                     int64_t o_st, float* lse, int B, int H, int Hkv, int D, int bs, float scale, int heads_outer) {
    return paged_decode<float>(q, q_st, kc, vc, tables, tab_st, seq_lens, rows, start, out, o_st, lse, B, H, Hkv, D,
                               bs, scale, heads_outer);
}

int paged_decode_bf16(const bf16_t* q, int64_t q_st, const bf16_t* kc, const bf16_t* vc, const int32_t* tables,
                      int64_t tab_st, const int32_t* seq_lens, const int64_t* rows, int32_t start, bf16_t* out,
                      int64_t o_st, float* lse, int B, int H, int Hkv, int D, int bs, float scale, int heads_outer) {
    return paged_decode<bf16_t>(q, q_st, kc, vc, tables, tab_st, seq_lens, rows, start, out, o_st, lse, B, H, Hkv, D,
                                bs, scale, heads_outer);
}

int paged_flash_f32(const float* q, int64_t q_st, const int64_t* rows, const int32_t* ends,
                    const int32_t* group_start, int NG, const int32_t* tables, int64_t tab_st, int key_start,
                    const float* kc, const float* vc, float* out, int64_t o_st, const float* lse_in, float* lse_out,
                    int H, int Hkv, int D, int bs, float scale) {
    return paged_flash<float>(q, q_st, rows, ends, group_start, NG, tables, tab_st, key_start, kc, vc, out, o_st,
                              lse_in, lse_out, H, Hkv, D, bs, scale);
}

int paged_flash_bf16(const bf16_t* q, int64_t q_st, const int64_t* rows, const int32_t* ends,
                     const int32_t* group_start, int NG, const int32_t* tables, int64_t tab_st, int key_start,
                     const bf16_t* kc, const bf16_t* vc, bf16_t* out, int64_t o_st, const float* lse_in,
                     float* lse_out, int H, int Hkv, int D, int bs, float scale) {
    return paged_flash<bf16_t>(q, q_st, rows, ends, group_start, NG, tables, tab_st, key_start, kc, vc, out, o_st,
                               lse_in, lse_out, H, Hkv, D, bs, scale);
}

}  // extern "C"
