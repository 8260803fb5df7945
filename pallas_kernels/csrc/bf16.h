// bfloat16 <-> float32 for the CPU kernels. Widening is exact; narrowing rounds to nearest even and
// keeps a NaN a (quiet) NaN. Branch-free, so loops of them vectorize.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jaxpaged {

inline float Bf16ToF32(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

#if defined(__AVX2__)
// 8 floats as bfloat16 in the low halves of 32-bit lanes: F32ToBf16 (nearest even, NaN kept quiet).
inline __m256i Bf16Lanes(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}

// 16 floats (two vectors of 8) as 16 packed bfloat16.
inline __m256i Bf16x16(__m256 lo, __m256 hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(Bf16Lanes(lo), Bf16Lanes(hi)), 0xd8);
}
#endif

}  // namespace jaxpaged
