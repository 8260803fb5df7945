// bfloat16 <-> float32 for the CPU kernels. Widening is exact; narrowing rounds to nearest even and
// keeps a NaN a (quiet) NaN. Branch-free, so loops of them vectorize.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace jaxpaged
