// 16-lane float32 vectors for the CPU kernels (attention, the layers' elementwise ops): AVX-512 when the
// compiler targets it (the build uses -march=native), else two AVX2 halves, else plain loops over 16 floats.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JAXPAGED_AVX512 1
// GCC 12's AVX-512 intrinsics start from deliberately undefined vectors, which -Wall (as
// setup.py builds) reports as uninitialized at every use: silenced for that header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXPAGED_AVX2 1
#include <immintrin.h>
#endif

namespace jaxpaged::simd {

constexpr int kLanes = 16;  // float32 lanes of one vector

#if JAXPAGED_AVX512

using Vec = __m512;
using Mask = __mmask16;

inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadMasked(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline Vec LoadMasked(const uint16_t* p, Mask m) {  // bfloat16 -> float32: the high 16 bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline Vec Select(Mask m, Vec a, Vec b) { return _mm512_mask_blend_ps(m, b, a); }  // m ? a : b
inline Mask LessEqual(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline float ReduceMax(Vec v) { return _mm512_reduce_max_ps(v); }
inline float ReduceAdd(Vec v) { return _mm512_reduce_add_ps(v); }
inline void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }  // to L2

// exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, exp(r) by its Taylor series to
// degree 7 (relative error < 1e-8 before rounding). Exactly 0 below -87 (and for -inf), where
// float32 exp leaves the normal range: masked scores and empty softmax states contribute nothing;
// +inf where float32 exp overflows (above ~88.72: x is clamped to 89 only to keep n in range).
inline Vec Exp(Vec x) {
  const Vec xc = _mm512_max_ps(_mm512_min_ps(x, Set1(89.f)), Set1(-88.f));
  const Vec n = _mm512_roundscale_ps(Mul(xc, Set1(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, Set1(0.693359375f), xc);  // ln 2 split in two for an exact n * ln2_hi
  r = _mm512_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
  Vec y = Set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) y = Fma(y, r, Set1(c));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, Set1(-87.f), _CMP_GE_OQ), y, n);
}

// Lane k = the sum of acc[k]'s lanes: pairs of vectors are folded in half and interleaved
// (512 -> 256 -> 128 -> 64 -> 32 bits), 15 adds instead of 16 horizontal sums.
inline Vec SumEach16(const Vec (&acc)[16]) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // halves 256-bit: [acc[2i] in 0..7 | acc[2i+1] in 8..15]
    a[i] = Add(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
               _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit block j holds key 4i + j
    b[i] = Add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
               _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block j: lanes 0-1 key 8i + j, lanes 2-3 key 8i + 4 + j
    c[i] = Add(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const Vec d = Add(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // Lane 4j + i now holds key 4i + j.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

// In place: r[j][i] becomes r[i][j] (interleave 32-bit, then 64-bit pairs, then 128-bit blocks twice).
inline void Transpose16(Vec (&r)[16]) {
  Vec t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {  // u[i + c] holds column 4b + c of rows i..i+3 in block b
      const __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
      u[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int c = 0; c < 4; ++c) {
    const Vec v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const Vec v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const Vec w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const Vec w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

#elif JAXPAGED_AVX2  // two 8-lane halves: lanes 0-7 in lo, 8-15 in hi

struct Vec {
  __m256 lo, hi;
};
using Mask = uint32_t;

inline Vec Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec Set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// All ones in lane i where bit i of m is set (lanes 0-7).
inline __m256i LaneMask(uint32_t m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bits), bits);
}
inline Vec LoadMasked(const float* p, Mask m) {  // masked-out lanes are 0 and not read
  if ((m & 0xFFFF) == 0xFFFF) return Load(p);
  return {_mm256_maskload_ps(p, LaneMask(m)), _mm256_maskload_ps(p + 8, LaneMask(m >> 8))};
}
inline __m256 Bf16x8ToF32(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline Vec LoadMasked(const uint16_t* p, Mask m) {  // bfloat16 -> float32: the high 16 bits
  alignas(32) uint16_t buf[kLanes];
  if ((m & 0xFFFF) != 0xFFFF) {
    for (int i = 0; i < kLanes; ++i) buf[i] = m >> i & 1 ? p[i] : uint16_t{0};
    p = buf;
  }
  return {Bf16x8ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          Bf16x8ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void Store(float* p, Vec v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline Vec Add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec Sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec Mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec Div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec Max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec Fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec Select(Mask m, Vec a, Vec b) {  // m ? a : b
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(LaneMask(m))),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(LaneMask(m >> 8)))};
}
inline Mask LessEqual(Vec a, Vec b) {
  return static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ))) |
         static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ))) << 8;
}
inline float Reduce8(__m256 v, __m128 (*op)(__m128, __m128)) {
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_movehdup_ps(x)));
}
inline float ReduceMax(Vec v) { return Reduce8(_mm256_max_ps(v.lo, v.hi), _mm_max_ps); }
inline float ReduceAdd(Vec v) { return Reduce8(_mm256_add_ps(v.lo, v.hi), _mm_add_ps); }
inline void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }  // to L2

// The AVX-512 Exp's algorithm on 8 lanes; 2^n is applied as two powers of two (n up to 128 for
// x near 88.7 has no float32 2^n of its own).
inline __m256 Exp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.f)), _mm256_set1_ps(-88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  y = _mm256_mul_ps(_mm256_mul_ps(y, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}
inline Vec Exp(Vec x) { return {Exp8(x.lo), Exp8(x.hi)}; }

// Lane k of the result = the sum of a[k]'s lanes, for 8 vectors (a tree of horizontal adds).
inline __m256 SumEach8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline Vec SumEach16(const Vec (&acc)[16]) {
  __m256 lo[8], hi[8];
  for (int k = 0; k < 8; ++k) {
    lo[k] = _mm256_add_ps(acc[k].lo, acc[k].hi);
    hi[k] = _mm256_add_ps(acc[8 + k].lo, acc[8 + k].hi);
  }
  return {SumEach8(lo), SumEach8(hi)};
}

template <typename F>
inline Vec Map(F f) {
  alignas(32) float r[kLanes];
  for (int i = 0; i < kLanes; ++i) r[i] = f(i);
  return Load(r);
}
inline void Transpose16(Vec (&r)[16]) {
  alignas(32) float m[kLanes][kLanes];
  for (int i = 0; i < kLanes; ++i) Store(m[i], r[i]);
  for (int i = 0; i < kLanes; ++i) r[i] = Map([&](int j) { return m[j][i]; });
}

#else  // portable fallback

struct Vec {
  float v[kLanes];
};
using Mask = uint32_t;

template <typename F>
inline Vec Map(F f) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = f(i);
  return r;
}
inline Vec Zero() { return Map([](int) { return 0.f; }); }
inline Vec Set1(float x) { return Map([x](int) { return x; }); }
inline Vec Load(const float* p) { return Map([p](int i) { return p[i]; }); }
inline Vec LoadMasked(const float* p, Mask m) { return Map([p, m](int i) { return m >> i & 1 ? p[i] : 0.f; }); }
inline Vec LoadMasked(const uint16_t* p, Mask m) {
  return Map([p, m](int i) {
    const uint32_t bits = m >> i & 1 ? uint32_t{p[i]} << 16 : 0u;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  });
}
inline void Store(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec Add(Vec a, Vec b) { return Map([&](int i) { return a.v[i] + b.v[i]; }); }
inline Vec Sub(Vec a, Vec b) { return Map([&](int i) { return a.v[i] - b.v[i]; }); }
inline Vec Mul(Vec a, Vec b) { return Map([&](int i) { return a.v[i] * b.v[i]; }); }
inline Vec Div(Vec a, Vec b) { return Map([&](int i) { return a.v[i] / b.v[i]; }); }
inline Vec Max(Vec a, Vec b) { return Map([&](int i) { return std::max(a.v[i], b.v[i]); }); }
inline Vec Fma(Vec a, Vec b, Vec c) { return Map([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); }); }
inline Vec Select(Mask m, Vec a, Vec b) { return Map([&](int i) { return m >> i & 1 ? a.v[i] : b.v[i]; }); }
inline Mask LessEqual(Vec a, Vec b) {
  Mask m = 0;
  for (int i = 0; i < kLanes; ++i) m |= Mask{a.v[i] <= b.v[i]} << i;
  return m;
}
inline float ReduceMax(Vec v) { return *std::max_element(v.v, v.v + kLanes); }
inline float ReduceAdd(Vec v) {
  float s = 0.f;
  for (float x : v.v) s += x;
  return s;
}
inline void Prefetch(const void*) {}
inline Vec Exp(Vec x) { return Map([&](int i) { return x.v[i] < -87.f ? 0.f : std::exp(x.v[i]); }); }
inline Vec SumEach16(const Vec (&acc)[16]) { return Map([&](int k) { return ReduceAdd(acc[k]); }); }
inline void Transpose16(Vec (&r)[16]) {
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < i; ++j) std::swap(r[i].v[j], r[j].v[i]);
}

#endif

inline Mask FirstLanes(int64_t n) { return n >= kLanes ? Mask(0xFFFF) : Mask((1u << n) - 1); }

}  // namespace jaxpaged::simd
