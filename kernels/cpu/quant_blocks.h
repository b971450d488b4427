// The GGUF (ggml) block formats, read in place: each format as one struct that turns the 32-element block b of a
// row into a canonical form, w[e] = D[e / 16] * q[e] (+ M[e / 16] for the formats with a minimum), with q small
// integers (signed, or unsigned 0..63 for the formats with a minimum) and D, M float32 computed exactly as the gguf
// package's dequantizers compute them (so D * q + M is bit for bit the file's value). The products
// (quant_gemm.cpp) multiply q with int16 activations and scale by D; the dequantizer (quant_dequant.cpp) evaluates
// D * q + M. Block layouts: ggml's block_q*_* (gguf/quants.py's dequantize_blocks).
#pragma once

#include "common.h"

namespace qfmt {

enum Type : int {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20,
};

// IEEE half -> float, exact (subnormals, infinities and NaNs included).
static inline float half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  // subnormal: normalize
        int e = 113;
        while (!(man & 0x400u)) { man <<= 1; --e; }
        bits = sign | ((uint32_t)e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint32_t u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and minimum from the 12 packed bytes.
static inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K / Q5_K: the 32-block j's D = d * scale and M = -(dmin * min) from a super-block's first 16 bytes.
static inline void scales_k4(const uint8_t* p, int j, float* D, float* M) {
    int sc, mn;
    scale_min_k4(p + 4, j, sc, mn);
    D[0] = D[1] = half(p) * (float)sc;
    M[0] = M[1] = -(half(p + 2) * (float)mn);
}

#ifdef FLOWRT_AVX2
// Q4_K / Q5_K: all eight of a super-block's D (lane j: 32-block j) and M at once, in registers: the 12 scale bytes
// as three words u0, u1, u2 rearranged in one vector into the eight 6-bit scales (bytes 0-7) and minimums (8-15).
// scale j < 4: u0 byte j & 63; j >= 4: (u2 byte & 15) | (u0 byte >> 6) << 4; minimum: u1 in u0's place, u2 >> 4.
static inline void scales8_k4v(const uint8_t* p, __m256& D, __m256& M) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));  // u0, u1, u2 (and 4 bytes more)
    const __m128i x = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));            // u0, u2, u1, u2
    const __m128i y = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));            // u0, u0, u1, u1
    const __m128i lo = _mm_and_si128(x, _mm_setr_epi32(0x3f3f3f3f, 0, 0x3f3f3f3f, 0));
    const __m128i hi4 = _mm_and_si128(_mm_srlv_epi32(x, _mm_setr_epi32(0, 0, 0, 4)),
                                      _mm_setr_epi32(0, 0x0f0f0f0f, 0, 0x0f0f0f0f));
    const __m128i hi2 = _mm_and_si128(_mm_srli_epi32(y, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i sm = _mm_or_si128(lo, _mm_or_si128(hi4, hi2));
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)u32(p)));  // d, dmin
    D = _mm256_mul_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    M = _mm256_xor_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)))),
                      _mm256_set1_ps(-0.0f));
}
#endif

// ... the same as arrays, D[0..7] and M[0..7].
static inline void scales8_k4(const uint8_t* p, float* D, float* M) {
#ifdef FLOWRT_AVX2
    __m256 d, m;
    scales8_k4v(p, d, m);
    _mm256_storeu_ps(D, d);
    _mm256_storeu_ps(M, m);
#else
    const float d = half(p), dmin = half(p + 2);
    const uint32_t u0 = u32(p + 4), u1 = u32(p + 8), u2 = u32(p + 12);
    const uint32_t sc[2] = {u0 & 0x3f3f3f3fu, (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)};
    const uint32_t mn[2] = {u1 & 0x3f3f3f3fu, ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)};
    for (int j = 0; j < 8; ++j) {
        D[j] = d * (float)((sc[j >> 2] >> (8 * (j & 3))) & 0xff);
        M[j] = -(dmin * (float)((mn[j >> 2] >> (8 * (j & 3))) & 0xff));
    }
#endif
}

static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#ifdef FLOWRT_AVX2
// 16 packed bytes -> 32 bytes: the low nibbles (elements 0-15), then the high nibbles (16-31).
static inline __m256i nibbles16(const uint8_t* p) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

// 16 packed bytes -> the low nibbles (elements 0-15) in q0 and the high nibbles (16-31) in q1, as int16.
static inline void nibbles16_i16(const uint8_t* p, __m256i& q0, __m256i& q1) {
    const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q0 = _mm256_and_si256(t, _mm256_set1_epi16(0x0F));
    q1 = _mm256_srli_epi16(t, 4);
}

// 32 packed bytes -> their low (hi = false) or high nibbles.
static inline __m256i nibbles32(const uint8_t* p, bool hi) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (hi) v = _mm256_srli_epi16(v, 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// byte e = 0xFF where bit e of `bits` is set, else 0 (the fifth bit of Q5_0 / Q5_1).
static inline __m256i bits_set(uint32_t bits) {
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                         3, 3, 3, 3, 3, 3, 3);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), idx);
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

// 32 bytes shifted right by s bits and masked to `mask` (2-bit fields of the K-quants).
static inline __m256i field(const uint8_t* p, int s, int mask) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8((char)mask));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX512-BW byte masks: a format's single high bit per element (Q5_0 / Q5_1 / Q5_K's fifth, Q3_K's third) becomes a
// mask register and one masked add or subtract, instead of being spread to bytes, shifted into place and or-ed in.
#define FLOWRT_BYTE_MASKS 1

// bit j of each of the 32 bytes at p (bit e of the mask: byte e)
static inline __mmask32 bit_j(const uint8_t* p, int j) {
    return _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8((char)(1 << j)));
}

// v + add in the bytes where m is set
static inline __m256i add_where(__m256i v, __mmask32 m, int add) {
    return _mm256_mask_add_epi8(v, m, v, _mm256_set1_epi8((char)add));
}

// A Q5_0 / Q5_1 block's quants as int16 (p: its 32-bit word of fifth bits, then 16 bytes of nibbles): each nibble,
// plus `add` where its fifth bit is set (add 16: Q5_1), or where it is clear (add -16: Q5_0's offset folded in).
static inline void nibbles5_i16(const uint8_t* p, int add, __m256i& q0, __m256i& q1) {
    const uint32_t h = add < 0 ? ~u32(p) : u32(p);
    nibbles16_i16(p + 4, q0, q1);
    q0 = _mm256_mask_add_epi16(q0, (__mmask16)h, q0, _mm256_set1_epi16((short)add));
    q1 = _mm256_mask_add_epi16(q1, (__mmask16)(h >> 16), q1, _mm256_set1_epi16((short)add));
}
#endif
#endif

// The K-quants' low bits: runs of 32 bytes holding 8 / BITS blocks each, block j of a super-block (0..7) in run
// j / (8 / BITS) at bit BITS * (j % (8 / BITS)); qs is the super-block's first run. low_bits: its 32 values.
template <int BITS>
static inline const uint8_t* low_bits_run(const uint8_t* qs, int j, int& shift) {
    constexpr int PER = 8 / BITS;
    shift = BITS * (j % PER);
    return qs + (j / PER) * 32;
}

template <int BITS>
static inline void low_bits(const uint8_t* qs, int j, int8_t* q) {
    int sh;
    const uint8_t* s = low_bits_run<BITS>(qs, j, sh);
    for (int i = 0; i < 32; ++i) q[i] = (int8_t)((s[i] >> sh) & ((1 << BITS) - 1));
}

#ifdef FLOWRT_AVX2
template <int BITS>
static inline __m256i low_bits_v(const uint8_t* qs, int j) {
    int sh;
    const uint8_t* s = low_bits_run<BITS>(qs, j, sh);
    return field(s, sh, (1 << BITS) - 1);
}
#endif

// Each format: QK elements in BYTES bytes; MIN: w = D q + M with unsigned q (else w = D q, q signed); HALVES: the two
// 16-element halves of a 32-block have their own D (and M). scales() gives D[2], M[2]; q() the 32 values (scalar);
// qv() the same as one vector (AVX2); the K-quants' scales8() all of a super-block's D, M at once (the values of
// scales() for its eight 32-blocks: two per block with HALVES, else one).

// The 32-element formats: a block of NBYTES opens with its half scale d (and, WITH_MIN, its half minimum m), one D
// (and M) for the whole block; Q is where its quants start.
template <int NBYTES, bool WITH_MIN>
struct Block32 {
    static constexpr int QK = 32, BYTES = NBYTES, Q = WITH_MIN ? 4 : 2;
    static constexpr bool MIN = WITH_MIN, HALVES = false;
    static void scales(const uint8_t* r, int b, float* D, float* M) {
        D[0] = D[1] = half(r + b * BYTES);
        if constexpr (WITH_MIN) M[0] = M[1] = half(r + b * BYTES + 2);
    }
    // the quants of block b, for the formats that pack 32 of them in 16 bytes of nibbles: element i is the low
    // nibble of byte i, element i + 16 its high one, each mapped by value()
    template <typename V>
    static void nibbles(const uint8_t* r, int b, int8_t* q, V value) {
        const uint8_t* s = r + b * BYTES + Q;
        for (int i = 0; i < 16; ++i) { q[i] = value(s[i] & 0xF); q[i + 16] = value(s[i] >> 4); }
    }
    // ... the Q5 ones: a nibble and a fifth bit from the 32-bit word h that precedes the 16 nibble bytes
    template <typename V>
    static void nibbles5(const uint8_t* r, int b, int8_t* q, V value) {
        const uint8_t* p = r + b * BYTES + Q;
        const uint32_t h = u32(p);
        for (int i = 0; i < 16; ++i) {
            q[i] = value((p[4 + i] & 0xF) | (((h >> i) & 1) << 4));
            q[i + 16] = value((p[4 + i] >> 4) | (((h >> (i + 16)) & 1) << 4));
        }
    }
};

struct Q8_0F : Block32<34, false> {
    static void q(const uint8_t* r, int b, int8_t* q) { std::memcpy(q, r + b * BYTES + Q, 32); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + b * BYTES + Q));
    }
    static void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) {
        q0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + b * BYTES + Q)));
        q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + b * BYTES + Q + 16)));
    }
#endif
};

struct Q4_0F : Block32<18, false> {
    static void q(const uint8_t* r, int b, int8_t* q) { nibbles(r, b, q, [](int v) { return (int8_t)(v - 8); }); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        return _mm256_sub_epi8(nibbles16(r + b * BYTES + Q), _mm256_set1_epi8(8));
    }
    static void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) {
        nibbles16_i16(r + b * BYTES + Q, q0, q1);
        q0 = _mm256_sub_epi16(q0, _mm256_set1_epi16(8));
        q1 = _mm256_sub_epi16(q1, _mm256_set1_epi16(8));
    }
#endif
};

struct Q4_1F : Block32<20, true> {
    static void q(const uint8_t* r, int b, int8_t* q) { nibbles(r, b, q, [](int v) { return (int8_t)v; }); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) { return nibbles16(r + b * BYTES + Q); }
    static void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) { nibbles16_i16(r + b * BYTES + Q, q0, q1); }
#endif
};

struct Q5_0F : Block32<22, false> {
    static void q(const uint8_t* r, int b, int8_t* q) { nibbles5(r, b, q, [](int v) { return (int8_t)(v - 16); }); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {  // (nibble | bit << 4) - 16 = the nibble, or it | 0xF0 without the bit
        const uint8_t* p = r + b * BYTES + Q;
#ifdef FLOWRT_BYTE_MASKS
        return add_where(nibbles16(p + 4), (__mmask32)~u32(p), -16);
#else
        return _mm256_or_si256(nibbles16(p + 4), _mm256_andnot_si256(bits_set(u32(p)), _mm256_set1_epi8((char)0xF0)));
#endif
    }
#ifdef FLOWRT_BYTE_MASKS
    static void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) { nibbles5_i16(r + b * BYTES + Q, -16, q0, q1); }
#endif
#endif
};

struct Q5_1F : Block32<24, true> {
    static void q(const uint8_t* r, int b, int8_t* q) { nibbles5(r, b, q, [](int v) { return (int8_t)v; }); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        const uint8_t* p = r + b * BYTES + Q;
#ifdef FLOWRT_BYTE_MASKS
        return add_where(nibbles16(p + 4), (__mmask32)u32(p), 16);
#else
        return _mm256_or_si256(nibbles16(p + 4), _mm256_and_si256(bits_set(u32(p)), _mm256_set1_epi8(0x10)));
#endif
    }
#ifdef FLOWRT_BYTE_MASKS
    static void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) { nibbles5_i16(r + b * BYTES + Q, 16, q0, q1); }
#endif
#endif
};

struct IQ4_NLF : Block32<18, false> {
    static void q(const uint8_t* r, int b, int8_t* q) { nibbles(r, b, q, [](int v) { return IQ4NL_VALUES[v]; }); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4NL_VALUES));
        return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles16(r + b * BYTES + Q));
    }
#endif
};

// Q2_K: scales[16] (low nibble scale, high nibble minimum per 16 elements), qs[64] (2-bit), d, dmin.
struct Q2_KF {
    static constexpr int QK = 256, BYTES = 84;
    static constexpr bool MIN = true, HALVES = true;
    static void scales(const uint8_t* r, int b, float* D, float* M) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const float d = half(p + 80), dmin = half(p + 82);
        const int j = b & 7;
        for (int h = 0; h < 2; ++h) {
            const uint8_t s = p[2 * j + h];
            D[h] = d * (float)(s & 0xF);
            M[h] = -(dmin * (float)(s >> 4));
        }
    }
    static void scales8(const uint8_t* p, float* D, float* M) {
        const float d = half(p + 80), dmin = half(p + 82);
        for (int i = 0; i < 16; ++i) { D[i] = d * (float)(p[i] & 0xF); M[i] = -(dmin * (float)(p[i] >> 4)); }
    }
    static void q(const uint8_t* r, int b, int8_t* q) { low_bits<2>(r + (b >> 3) * BYTES + 16, b & 7, q); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) { return low_bits_v<2>(r + (b >> 3) * BYTES + 16, b & 7); }
#endif
};

// Q3_K: hmask[32] (the third bit, set = no -4 offset), qs[64] (2-bit), scales[12] (16 6-bit scales, -32), d.
struct Q3_KF {
    static constexpr int QK = 256, BYTES = 110;
    static constexpr bool MIN = false, HALVES = true;
    static int scale(const uint8_t* s, int i) {
        const int lo = (s[i & 7] >> (4 * (i >> 3))) & 0xF, hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        return (lo | (hi << 4)) - 32;
    }
    static void scales(const uint8_t* r, int b, float* D, float*) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const float d = half(p + 108);
        const int j = b & 7;
        D[0] = d * (float)scale(p + 96, 2 * j);
        D[1] = d * (float)scale(p + 96, 2 * j + 1);
    }
    static void scales8(const uint8_t* p, float* D, float*) {
        const float d = half(p + 108);
        for (int i = 0; i < 16; ++i) D[i] = d * (float)scale(p + 96, i);
    }
    static void q(const uint8_t* r, int b, int8_t* q) {  // hmask bit j of byte i: block j's element i
        const uint8_t* p = r + (b >> 3) * BYTES;
        const int j = b & 7;
        low_bits<2>(p + 32, j, q);
        for (int i = 0; i < 32; ++i) q[i] = (int8_t)(q[i] - (((p[i] >> j) & 1) ? 0 : 4));
    }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const __m256i lo = low_bits_v<2>(p + 32, b & 7);
#ifdef FLOWRT_BYTE_MASKS
        return add_where(lo, (__mmask32)~bit_j(p, b & 7), -4);
#else
        const __m256i hb = field(p, b & 7, 1);  // 1 where the offset is 0
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 2)), _mm256_set1_epi8(4));
#endif
    }
#endif
};

// Q4_K: d, dmin, scales[12] (8 6-bit scales and minimums), qs[128] (sub-blocks 2i / 2i+1: low / high nibbles).
// Q4_K and Q5_K open alike (d, dmin, the 12 scale bytes): one D and one M per 32-block.
template <int NBYTES>
struct K4Block {
    static constexpr int QK = 256, BYTES = NBYTES;
    static constexpr bool MIN = true, HALVES = false;
    static void scales(const uint8_t* r, int b, float* D, float* M) { scales_k4(r + (b >> 3) * BYTES, b & 7, D, M); }
    static void scales8(const uint8_t* p, float* D, float* M) { scales8_k4(p, D, M); }
#ifdef FLOWRT_AVX2
    static void scales8v(const uint8_t* p, __m256* D, __m256* M) { scales8_k4v(p, D[0], M[0]); }
#endif
};

struct Q4_KF : K4Block<144> {
    static void q(const uint8_t* r, int b, int8_t* q) { low_bits<4>(r + (b >> 3) * BYTES + 16, b & 7, q); }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) { return low_bits_v<4>(r + (b >> 3) * BYTES + 16, b & 7); }
    static void qv16(const uint8_t* r, int b, __m256i& q0, __m256i& q1) {
        const uint8_t* p = r + (b >> 3) * BYTES + 16 + ((b & 7) >> 1) * 32;
        const __m128i sh = _mm_cvtsi32_si128(4 * (b & 1));
        const __m256i m = _mm256_set1_epi16(0x0F);
        q0 = _mm256_and_si256(_mm256_srl_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), sh), m);
        q1 = _mm256_and_si256(_mm256_srl_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p + 16))), sh), m);
    }
#endif
};

// Q5_K: Q4_K's fields, then qh[32] (bit j of byte i: sub-block j's fifth bit of element i) before qs[128].
struct Q5_KF : K4Block<176> {
    static void q(const uint8_t* r, int b, int8_t* q) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const int j = b & 7;
        low_bits<4>(p + 48, j, q);
        for (int i = 0; i < 32; ++i) q[i] = (int8_t)(q[i] | (((p[16 + i] >> j) & 1) << 4));
    }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const __m256i lo = low_bits_v<4>(p + 48, b & 7);
#ifdef FLOWRT_BYTE_MASKS
        return add_where(lo, bit_j(p + 16, b & 7), 16);
#else
        return _mm256_or_si256(lo, _mm256_slli_epi16(field(p + 16, b & 7, 1), 4));
#endif
    }
#endif
};

// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per 16 elements), d; values - 32.
struct Q6_KF {
    static constexpr int QK = 256, BYTES = 210;
    static constexpr bool MIN = false, HALVES = true;
    static void scales(const uint8_t* r, int b, float* D, float*) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const float d = half(p + 208);
        const int j = b & 7;
        D[0] = d * (float)(int8_t)p[192 + 2 * j];
        D[1] = d * (float)(int8_t)p[192 + 2 * j + 1];
    }
    static void scales8(const uint8_t* p, float* D, float*) {
        const float d = half(p + 208);
        for (int i = 0; i < 16; ++i) D[i] = d * (float)(int8_t)p[192 + i];
    }
#ifdef FLOWRT_AVX2
    // the sixteen scales as the first halves' (lane j: block j's elements 0-15) and the second halves' D
    static void scales8v(const uint8_t* p, __m256* D, __m256*) {
        const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)),
                                            _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        const __m256 dv = _mm256_set1_ps(half(p + 208));
        D[0] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        D[1] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    }
#endif
    static void q(const uint8_t* r, int b, int8_t* q) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const int n = (b & 7) >> 2, c = b & 3;
        const uint8_t* ql = p + n * 64 + (c & 1) * 32;
        const uint8_t* qh = p + 128 + n * 32;
        for (int i = 0; i < 32; ++i)
            q[i] = (int8_t)((((ql[i] >> (4 * (c >> 1))) & 0xF) | (((qh[i] >> (2 * c)) & 3) << 4)) - 32);
    }
#ifdef FLOWRT_AVX2
    static __m256i qv(const uint8_t* r, int b) {
        const uint8_t* p = r + (b >> 3) * BYTES;
        const int n = (b & 7) >> 2, c = b & 3;
        const __m256i lo = nibbles32(p + n * 64 + (c & 1) * 32, c >> 1);
        const __m256i hi = _mm256_slli_epi16(field(p + 128 + n * 32, 2 * c, 3), 4);
        return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
    }
#endif
};

// Block b of a row as 32 values of the storage type T (float or bf16_t): D * q (+ M), a multiply and an add in float32,
// the gguf package's order, so float32 values equal gguf.quants.dequantize bit for bit (bf16: rounded to nearest even).
template <typename F, typename T>
static inline void block_values(const uint8_t* row, int b, T* out) {
    float D[2], Mn[2] = {0.f, 0.f};
    F::scales(row, b, D, Mn);
#ifdef FLOWRT_AVX2
    const __m256i q = F::qv(row, b);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
        __m256 v = _mm256_mul_ps(_mm256_set1_ps(D[i >> 1]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])));
        if constexpr (F::MIN) v = _mm256_add_ps(v, _mm256_set1_ps(Mn[i >> 1]));
        store8(out + 8 * i, v);
    }
#else
    int8_t q[32];
    F::q(row, b, q);
    for (int i = 0; i < 32; ++i) {
        float v = D[i >> 4] * (float)q[i];
        if constexpr (F::MIN) v = v + Mn[i >> 4];
        out[i] = from_f32<T>(v);
    }
#endif
}

template <typename F> struct Tag { using type = F; };

// Calls f(Tag<Format>{}) for the format `type` (f a generic lambda); returns -1 for a type without one.
template <typename Fn>
static inline int dispatch(int type, Fn&& f) {
    switch (type) {
        case Q8_0: f(Tag<Q8_0F>{}); return 0;
        case Q4_0: f(Tag<Q4_0F>{}); return 0;
        case Q4_1: f(Tag<Q4_1F>{}); return 0;
        case Q5_0: f(Tag<Q5_0F>{}); return 0;
        case Q5_1: f(Tag<Q5_1F>{}); return 0;
        case IQ4_NL: f(Tag<IQ4_NLF>{}); return 0;
        case Q2_K: f(Tag<Q2_KF>{}); return 0;
        case Q3_K: f(Tag<Q3_KF>{}); return 0;
        case Q4_K: f(Tag<Q4_KF>{}); return 0;
        case Q5_K: f(Tag<Q5_KF>{}); return 0;
        case Q6_K: f(Tag<Q6_KF>{}); return 0;
        default: return -1;
    }
}

}  // namespace qfmt
