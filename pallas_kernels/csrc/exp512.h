// exp on float32 AVX-512 vectors for the CPU kernels (the attention's softmax, the MLP's SiLU).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace jaxpaged {

// exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, exp(r) by its Taylor series to
// degree 7 (relative error < 1e-8 before rounding). Exactly 0 below -87 (and for -inf), where
// float32 exp leaves the normal range: masked scores and empty softmax states contribute nothing;
// +inf where float32 exp overflows (above ~88.72: x is clamped to 89 only to keep n in range).
inline __m512 Exp512(__m512 x) {
  const __m512 xc = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);  // ln 2 split in two for an exact n * ln2_hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), y, n);
}

}  // namespace jaxpaged

#endif
