// Dense matmul for the CPU, called from XLA through the FFI: out[M, N] = x[M, K] @ w[K, N].
// A third operand, an int32 count `rows`, says how many leading rows of x matter (a padded
// batch's real tokens): only those are multiplied, out's other rows are zero.
//
// The weight is packed once on the host (pallas_kernels/cpu_matmul.py, pack_weight) into
// panels of kNR = 32 columns, each panel contiguous so a micro-kernel streams it front to back:
//   float32:  panel p = K rows of 32 floats, row k = w[k, 32p : 32p + 32].
//   bfloat16: panel p = K/2 pair rows; pair row q = 32 (w[2q, c], w[2q+1, c]) pairs for
//             c = 32p .. 32p+31 (the operand layout of vdpbf16ps); for odd K the panel ends
//             with the plain row w[K-1, 32p : 32p + 32]. Either way a panel holds K * 32
//             elements. Columns past N are zero.
// x is read in place (row-major): a bfloat16 pair (x[r, 2q], x[r, 2q+1]) is one 32-bit word.
//
// A micro-kernel keeps an R x 32 tile of out in 2R vector registers (AVX-512: R <= kMR = 12; AVX2
// covers the tile as two 16-column halves, R <= 6, see there; CPUs with neither run plain loops) and
// walks K once: per k (per pair for bfloat16) it loads one panel row (two vectors) and broadcasts one
// value (pair) from each of its R rows of x (AVX2 float32: from the R rows interleaved, see
// InterleavedRows). A unit of work is one panel for one block of rows,
// in near-equal row groups of at most kMR: with few rows there is one row block and each weight
// panel is streamed from memory exactly once, for all rows; with many rows the row blocks are
// sized to stay in L2 (AVX2: in L3, see kRowBlockBytes), and a panel stays in L2 across the row
// groups of its unit. Units are spread
// over XLA's intra-op thread pool (see RunUnits). Accumulation is in float32; bfloat16 results are
// rounded to nearest even, unless the caller asks for float32 out (bfloat16 x and weight).
//
// A second target (JaxpagedMatmulQuantCpu) takes the weight as GGUF-style affine blocks,
// w[k, c] = code * scale + offset with one (scale, offset) per 32 consecutive k of a column,
// in a uint8 array [P, K * (c + 8)]: panel p holds its codes, K rows of c bytes (c = 16: 4-bit
// codes, byte j holding column j in its low nibble and column j + 16 in its high one; c = 32: one
// byte per column), then per block of 32 rows the 32 columns' scales and the 32 offsets (floats).
// Each weight is rebuilt exactly (code * scale is exact in float32 for codes below 2^8 and float16
// scales, so the fused multiply-add rounds once, like code * scale + offset), in registers for a
// unit of few rows, on AVX2 one block of 32 k at a time into L1 for a few more (QuantBlocksF32), into
// a cached dense panel for more; the sums run in the dense kernel's order,
// so the result is bit-identical to the dense product with the dequantized weight: in float32, or
// for bfloat16 x with the dequantized weight rounded to bfloat16 (as pack_weight rounds it).

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#define JAXPAGED_MATMUL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXPAGED_MATMUL_AVX2 1
#endif
#if defined(JAXPAGED_MATMUL_AVX512) || defined(JAXPAGED_MATMUL_AVX2)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define JAXPAGED_AMX 1
#endif

#include "bf16.h"
#include "stacked.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxpaged::LayerWeight;
using jaxpaged::PickLayer;

constexpr int64_t kNR = 32;                    // columns per weight panel
#if defined(JAXPAGED_MATMUL_AVX2)
constexpr int kMR = 6;                         // most rows per micro-kernel call (16 registers)
#else
constexpr int kMR = 12;                        // most rows per micro-kernel call
#endif
#if defined(JAXPAGED_MATMUL_AVX2)
// Rows of x per row block: AVX2 reads them interleaved (one stream a row group, InterleavedRows),
// which L3 serves as well as L2, so fewer, larger blocks read (and rebuild) each weight panel fewer
// times (Zen 3, SmolLM2's shapes at 256-512 rows: 1.5 MiB 1.01-1.07x faster than 448 KiB, 6 MiB no
// faster than 1.5).
constexpr int64_t kRowBlockBytes = 1536 << 10;
#else
constexpr int64_t kRowBlockBytes = 448 << 10;  // rows of x per row block (kept in L2)
#endif
constexpr int64_t kMaxPanelsPerRun = 16;       // most units a worker claims at once
constexpr int64_t kPrefetchRows = 8;           // panel rows (pair rows) prefetched ahead into L1,
constexpr int64_t kStreamPrefetchRows = 32;    // or this many when streaming from memory (kAhead)
#if defined(JAXPAGED_MATMUL_AVX2)
constexpr int64_t kAheadGroups = 1;            // up to this many row groups prefetch the next panel
#else                                          // (AVX2, 8-24 rows: 1.2-1.7x faster with 1 than 4)
constexpr int64_t kAheadGroups = 4;
#endif
constexpr int64_t kPrefetchMinRows = 5;        // fewer rows: no software prefetch at all
constexpr int64_t kQuantBlock = 32;            // k rows sharing one (scale, offset) per column
#if defined(JAXPAGED_MATMUL_AVX512)
constexpr int kQuantMR = 8;                    // most rows per quantized micro-kernel call,
constexpr int64_t kQuantDirectRows = 16;       // and most rows a unit rebuilds weights in registers for:
constexpr int64_t kQuantDirectRowsBf16 = 4;    // more rows make the bfloat16 rebuild the bottleneck
#elif defined(JAXPAGED_MATMUL_AVX2)              // (against walking K block by block, QuantBlocksF32: 2 rows
constexpr int kQuantMR = 4;                    // 1.08-1.2x, 3 rows 1.06-1.25x, 4 rows 1.0-1.1x, 5-6 rows as
constexpr int64_t kQuantDirectRows = 4;        // two groups 0.8-0.87x; bfloat16 pairs would take AVX2 too
constexpr int64_t kQuantDirectRowsBf16 = 0;    // many registers)
constexpr int64_t kQuantBlockRows = 16;        // most rows of a float32 unit that walks K block by block
#endif

// Software prefetch modes of a micro-kernel call (bit flags). The first row group of a panel reads
// it from L3 or memory and prefetches it into L1 some rows ahead (kNear); with few row groups
// the calls also fetch the next panel into L2 (kAhead). Later groups find the panel in L2, where
// the hardware prefetchers do better alone. With fewer than kPrefetchMinRows rows a unit is a plain
// stream of loads, which the hardware prefetchers also serve better alone (M = 1: ~20% faster).
constexpr int kNear = 1, kAhead = 2, kPrefetchModes = 4;

template <int kPf>
constexpr int64_t NearRows() {
  return (kPf & kAhead) != 0 ? kStreamPrefetchRows : kPrefetchRows;
}

using jaxpaged::Bf16ToF32;
using jaxpaged::F32ToBf16;

// ---------------------------------------------------------------------------------------------
// Micro-kernels: out[R, cols] = a[R, k] (rows of x, stride lda) @ b (one panel), cols <= kNR,
// out's row stride ldc.

inline void StoreValue(float* c, float v) { *c = v; }
inline void StoreValue(uint16_t* c, float v) { *c = F32ToBf16(v); }

// x's 32-bit word at (row r, pair q) of rows with stride lda (bfloat16 elements).
inline uint32_t PairWord(const uint16_t* a, int64_t lda, int r, int64_t q) {
  uint32_t w;
  std::memcpy(&w, a + r * lda + 2 * q, sizeof(w));
  return w;
}

#if defined(JAXPAGED_MATMUL_AVX512) || defined(JAXPAGED_MATMUL_AVX2)
// Prefetches into L2, during the first steps of a micro-kernel, `lines` cache lines from `ahead`
// (a slice of the next panel, so that streaming it overlaps this panel's arithmetic).
inline void PrefetchAhead(const char* ahead, int64_t lines, int64_t step) {
  if (2 * step < lines) {
    _mm_prefetch(ahead + 128 * step, _MM_HINT_T1);
    if (2 * step + 1 < lines) _mm_prefetch(ahead + 128 * step + 64, _MM_HINT_T1);
  }
}

// Prefetches panel row (pair row) `row` into L1: its two 64-byte lines.
template <int kPf>
inline void PrefetchNear(const void* row) {
  if constexpr ((kPf & kNear) != 0) {
    const char* p = static_cast<const char*>(row) + NearRows<kPf>() * 128;
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
  }
}
#endif

#if defined(JAXPAGED_MATMUL_AVX512)

inline __mmask16 ColumnMask(int64_t cols, int half) {
  const int64_t c = std::clamp<int64_t>(cols - 16 * half, 0, 16);
  return static_cast<__mmask16>((1u << c) - 1u);
}

template <int R>
inline void StoreTile(__m512 (&acc)[R][2], float* c, int64_t ldc, int64_t cols) {
  if (cols == kNR) {
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(c + r * ldc, acc[r][0]);
      _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
    }
  } else {
    const __mmask16 m0 = ColumnMask(cols, 0), m1 = ColumnMask(cols, 1);
    for (int r = 0; r < R; ++r) {
      _mm512_mask_storeu_ps(c + r * ldc, m0, acc[r][0]);
      _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc[r][1]);
    }
  }
}

inline __m256i RoundToBf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

template <int R>
inline void StoreTile(__m512 (&acc)[R][2], uint16_t* c, int64_t ldc, int64_t cols) {
  if (cols == kNR) {
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc), RoundToBf16(acc[r][0]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 16), RoundToBf16(acc[r][1]));
    }
  } else {
    const __mmask16 m0 = ColumnMask(cols, 0), m1 = ColumnMask(cols, 1);
    for (int r = 0; r < R; ++r) {
      _mm256_mask_storeu_epi16(c + r * ldc, m0, RoundToBf16(acc[r][0]));
      _mm256_mask_storeu_epi16(c + r * ldc + 16, m1, RoundToBf16(acc[r][1]));
    }
  }
}

template <int R, int kPf>
void MicroF32(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc, int64_t cols,
              const char* ahead, int64_t ahead_lines) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; ++i) {
    const float* bi = b + i * kNR;
    PrefetchNear<kPf>(bi);
    if constexpr ((kPf & kAhead) != 0) PrefetchAhead(ahead, ahead_lines, i);
    const __m512 b0 = _mm512_loadu_ps(bi), b1 = _mm512_loadu_ps(bi + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + i]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  StoreTile<R>(acc, c, ldc, cols);
}

// One pair step: acc[r] += x.lo * w.lo + x.hi * w.hi per 32-bit lane (lane = one column), for the
// R pair words word(r).
template <int R, typename Word>
inline void PairStep(__m512 (&acc)[R][2], Word&& word, __m512i b0, __m512i b1) {
#if defined(__AVX512BF16__)
  for (int r = 0; r < R; ++r) {
    const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(word(r)));
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, (__m512bh)b0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, (__m512bh)b1);
  }
#else  // AVX-512F without BF16: split each pair into two float32 vectors
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512 b0l = _mm512_castsi512_ps(_mm512_slli_epi32(b0, 16));
  const __m512 b0h = _mm512_castsi512_ps(_mm512_and_si512(b0, hi_mask));
  const __m512 b1l = _mm512_castsi512_ps(_mm512_slli_epi32(b1, 16));
  const __m512 b1h = _mm512_castsi512_ps(_mm512_and_si512(b1, hi_mask));
  for (int r = 0; r < R; ++r) {
    const uint32_t w = word(r);
    const __m512 al = _mm512_set1_ps(Bf16ToF32(static_cast<uint16_t>(w)));
    const __m512 ah = _mm512_set1_ps(Bf16ToF32(static_cast<uint16_t>(w >> 16)));
    acc[r][0] = _mm512_fmadd_ps(ah, b0h, _mm512_fmadd_ps(al, b0l, acc[r][0]));
    acc[r][1] = _mm512_fmadd_ps(ah, b1h, _mm512_fmadd_ps(al, b1l, acc[r][1]));
  }
#endif
}

template <int R, int kPf, typename O>
void MicroBf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, O* c, int64_t ldc,
               int64_t cols, const char* ahead, int64_t ahead_lines) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
#pragma GCC unroll 2
  for (int64_t q = 0; q < pairs; ++q) {
    const uint16_t* bq = b + q * 2 * kNR;
    PrefetchNear<kPf>(bq);
    if constexpr ((kPf & kAhead) != 0) PrefetchAhead(ahead, ahead_lines, q);
    PairStep<R>(acc, [&](int r) { return PairWord(a, lda, r, q); }, _mm512_loadu_si512(bq),
                _mm512_loadu_si512(bq + 32));
  }
  if (k % 2) {  // the plain last row: each weight becomes the pair (w, 0), each x (x, 0)
    const auto* bq = reinterpret_cast<const __m256i*>(b + pairs * 2 * kNR);
    const __m512i b0 = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(bq));
    const __m512i b1 = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(bq + 1));
    PairStep<R>(acc, [&](int r) { return static_cast<uint32_t>(a[r * lda + k - 1]); }, b0, b1);
  }
  StoreTile<R>(acc, c, ldc, cols);
}

// A quantized panel row i (32 weights) rebuilt in two vectors from its codes and its block's scales
// and offsets (s0/s1, o0/o1).
template <int kBits>
inline void RebuildRow(const uint8_t* codes, int64_t i, __m512 s0, __m512 s1, __m512 o0, __m512 o1, __m512& b0,
                       __m512& b1) {
  const uint8_t* ci = codes + i * (kBits * kNR / 8);
  __m512i q0, q1;
  if constexpr (kBits == 4) {
    const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ci)));
    q0 = _mm512_and_si512(both, _mm512_set1_epi32(0xf));
    q1 = _mm512_srli_epi32(both, 4);
  } else {
    q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ci)));
    q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ci + 16)));
  }
  b0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), s0, o0);
  b1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), s1, o1);
}

// Calls f(i, b0, b1) for each row i of a quantized panel, in order, with its rebuilt weights.
template <int kBits, typename F>
inline void ForEachRebuiltRow(const uint8_t* codes, const float* qparams, int64_t k, F&& f) {
  for (int64_t blk = 0; blk < k / kQuantBlock; ++blk) {
    const float* qp = qparams + blk * 2 * kNR;
    const __m512 s0 = _mm512_loadu_ps(qp), s1 = _mm512_loadu_ps(qp + 16);
    const __m512 o0 = _mm512_loadu_ps(qp + kNR), o1 = _mm512_loadu_ps(qp + kNR + 16);
#pragma GCC unroll 2
    for (int64_t i = blk * kQuantBlock; i < (blk + 1) * kQuantBlock; ++i) {
      __m512 b0, b1;
      RebuildRow<kBits>(codes, i, s0, s1, o0, o1, b0, b1);
      f(i, b0, b1);
    }
  }
}

// Few rows: the dense kernel's row update on weights rebuilt in registers (the codes are read once).
template <int R, int kBits>
void MicroQuantF32(const float* a, int64_t lda, const uint8_t* codes, const float* qparams, int64_t k, float* c,
                   int64_t ldc, int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  ForEachRebuiltRow<kBits>(codes, qparams, k, [&](int64_t i, __m512 b0, __m512 b1) {
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * lda + i]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  });
  StoreTile<R>(acc, c, ldc, cols);
}

// Many rows: the panel rebuilt once into a float32 panel (K x 32) for the dense micro-kernels.
template <int kBits>
void RebuildPanel(const uint8_t* codes, const float* qparams, int64_t k, float* panel) {
  ForEachRebuiltRow<kBits>(codes, qparams, k, [&](int64_t i, __m512 b0, __m512 b1) {
    _mm512_storeu_ps(panel + i * kNR, b0);
    _mm512_storeu_ps(panel + i * kNR + 16, b1);
  });
}

// The vdpbf16ps operand of two rebuilt weight rows (lo = row 2q, hi = row 2q + 1; 16 columns):
// per column the pair (bf16(lo), bf16(hi)) in one 32-bit lane, each rounded to nearest even as
// pack_weight rounds a dequantized weight (the rebuilt weights are finite).
inline __m512i PairWords(__m512 lo, __m512 hi) {
#if defined(__AVX512BF16__)
  const __m512i kInterleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(kInterleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
  const auto rounded = [](__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  };
  return _mm512_or_si512(_mm512_srli_epi32(rounded(lo), 16),
                         _mm512_and_si512(rounded(hi), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#endif
}

// Calls f(q, b0, b1) for each pair row q of a quantized panel, in order, with its rebuilt weights
// as the packed bfloat16 panel holds them (columns 0..15, 16..31).
template <int kBits, typename F>
inline void ForEachRebuiltPair(const uint8_t* codes, const float* qparams, int64_t k, F&& f) {
  __m512 lo0, lo1;  // the pair's first row (k even: every row has its partner)
  ForEachRebuiltRow<kBits>(codes, qparams, k, [&](int64_t i, __m512 b0, __m512 b1) {
    if (i % 2 == 0) {
      lo0 = b0;
      lo1 = b1;
    } else {
      f(i / 2, PairWords(lo0, b0), PairWords(lo1, b1));
    }
  });
}

// Few rows, bfloat16: the dense kernel's pair steps on pairs rebuilt in registers, so the same
// products and sums as with the packed bfloat16 weight (the dequantized weight, rounded).
template <int R, int kBits, typename O>
void MicroQuantBf16(const uint16_t* a, int64_t lda, const uint8_t* codes, const float* qparams, int64_t k, O* c,
                    int64_t ldc, int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  ForEachRebuiltPair<kBits>(codes, qparams, k, [&](int64_t q, __m512i b0, __m512i b1) {
    PairStep<R>(acc, [&](int r) { return PairWord(a, lda, r, q); }, b0, b1);
  });
  StoreTile<R>(acc, c, ldc, cols);
}

template <int kBits>
void RebuildPanel(const uint8_t* codes, const float* qparams, int64_t k, uint16_t* panel) {
  ForEachRebuiltPair<kBits>(codes, qparams, k, [&](int64_t q, __m512i b0, __m512i b1) {
    _mm512_storeu_si512(panel + q * 2 * kNR, b0);
    _mm512_storeu_si512(panel + q * 2 * kNR + kNR, b1);
  });
}

#elif defined(JAXPAGED_MATMUL_AVX2)
// AVX2 + FMA: 16 vector registers of 8 floats, too few for an R x 32 tile. A call covers its tile as
// two column halves, one after the other, each an R x 16 tile in 2R accumulators (R <= kMR = 6, plus
// two weight vectors and a broadcast) walking K once; the first half prefetches whole panel rows,
// so the second finds them in L1/L2. Each output's sum runs over k in order, one fused multiply-add
// per k (per pair for bfloat16: the low product, then the high one), as the AVX-512 kernels'.

using jaxpaged::Bf16Lanes;
using jaxpaged::Bf16x16;

// 16 floats stored as bfloat16.
inline void StoreBf16x16(const float* v, uint16_t* c) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c), Bf16x16(_mm256_load_ps(v), _mm256_load_ps(v + 8)));
}

// Stores an R x 16 tile whose first `cols` (clamped to 0..16) columns are real. (Through a
// fully unrolled copy: GCC keeps the accumulators in registers only if no loop indexes them.)
template <int R, typename O>
inline void StoreHalf(__m256 (&acc)[R][2], O* c, int64_t ldc, int64_t cols) {
  alignas(32) float tile[R][16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tile[r], acc[r][0]);
    _mm256_store_ps(tile[r] + 8, acc[r][1]);
  }
  const int64_t n = std::clamp<int64_t>(cols, 0, 16);
  if constexpr (std::is_same_v<O, uint16_t>) {
    if (n == 16) {
      for (int r = 0; r < R; ++r) StoreBf16x16(tile[r], c + r * ldc);
      return;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) StoreValue(c + r * ldc + j, tile[r][j]);
}

// Columns 16h .. 16h + 15 of a float32 panel (out float32, or bfloat16 for widened bfloat16 units).
// The R rows of x come interleaved (see InterleavedRows): x[r, i] at a[i * R + r]. With kCarry the
// sums go on from those in c (R rows of 32 floats, 32-byte aligned) and are stored back whole there
// (a unit walking K one block at a time, QuantBlocksF32).
template <int R, int kPf, int kHalf, typename O, bool kCarry = false>
void HalfF32(const float* a, const float* b, int64_t k, O* c, int64_t ldc, int64_t cols, const char* ahead,
             int64_t ahead_lines) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    if constexpr (kCarry) {
      acc[r][0] = _mm256_load_ps(c + r * ldc + 16 * kHalf);
      acc[r][1] = _mm256_load_ps(c + r * ldc + 16 * kHalf + 8);
    } else {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
  }
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; ++i) {
    const float* bi = b + i * kNR;
    PrefetchNear<kPf>(bi);
    if constexpr ((kPf & kAhead) != 0) PrefetchAhead(ahead, ahead_lines, i);
    const __m256 b0 = _mm256_loadu_ps(bi + 16 * kHalf), b1 = _mm256_loadu_ps(bi + 16 * kHalf + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + i * R + r);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  if constexpr (kCarry) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(c + r * ldc + 16 * kHalf, acc[r][0]);
      _mm256_store_ps(c + r * ldc + 16 * kHalf + 8, acc[r][1]);
    }
  } else {
    StoreHalf<R>(acc, c + 16 * kHalf, ldc, cols - 16 * kHalf);
  }
}

// One block of 32 k (a quantized weight's block, rebuilt, b) for R interleaved rows, continuing the
// sums in the R x 32 tile acc.
template <int R>
void CarryF32(const float* a, const float* b, float* acc) {
  HalfF32<R, 0, 0, float, true>(a, b, kQuantBlock, acc, kNR, kNR, nullptr, 0);
  HalfF32<R, 0, 1, float, true>(a, b, kQuantBlock, acc, kNR, kNR, nullptr, 0);
}

template <size_t... R>
constexpr auto CarryTable(std::index_sequence<R...>) {
  return std::array<void (*)(const float*, const float*, float*), kMR>{&CarryF32<static_cast<int>(R) + 1>...};
}

// The MicroFn signature, with x's rows interleaved (its stride argument unused).
template <int R, int kPf, typename O = float>
void MicroF32(const float* a, int64_t, const float* b, int64_t k, O* c, int64_t ldc, int64_t cols,
              const char* ahead, int64_t ahead_lines) {
  HalfF32<R, kPf, 0>(a, b, k, c, ldc, cols, ahead, ahead_lines);
  if (cols > 16) HalfF32<R, 0, 1>(a, b, k, c, ldc, cols, nullptr, 0);
}

// A pair word's two bfloat16 halves as float32 lanes: (low, high).
inline __m256 PairLow(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 PairHigh(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Columns 16h .. 16h + 15 of a bfloat16 panel, for rows at most 3 (the pairs' low and high weights
// take four registers more than float32's).
template <int R, int kPf, int kHalf, typename O>
void HalfBf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, O* c, int64_t ldc, int64_t cols,
              const char* ahead, int64_t ahead_lines) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t q = 0; q < pairs; ++q) {
    const uint16_t* bq = b + q * 2 * kNR;
    PrefetchNear<kPf>(bq);
    if constexpr ((kPf & kAhead) != 0) PrefetchAhead(ahead, ahead_lines, q);
    const auto* words = reinterpret_cast<const __m256i*>(bq + 32 * kHalf);
    const __m256i w0 = _mm256_loadu_si256(words), w1 = _mm256_loadu_si256(words + 1);
    const __m256 l0 = PairLow(w0), h0 = PairHigh(w0), l1 = PairLow(w1), h1 = PairHigh(w1);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_set1_epi32(static_cast<int>(PairWord(a, lda, r, q)));
      const __m256 al = PairLow(x), ah = PairHigh(x);
      acc[r][0] = _mm256_fmadd_ps(ah, h0, _mm256_fmadd_ps(al, l0, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(ah, h1, _mm256_fmadd_ps(al, l1, acc[r][1]));
    }
  }
  if (k % 2) {  // the plain last row (odd K)
    const auto* row = reinterpret_cast<const __m128i*>(b + pairs * 2 * kNR + 16 * kHalf);
    const __m256 l0 = PairLow(_mm256_cvtepu16_epi32(_mm_loadu_si128(row)));
    const __m256 l1 = PairLow(_mm256_cvtepu16_epi32(_mm_loadu_si128(row + 1)));
    for (int r = 0; r < R; ++r) {
      const __m256 al = _mm256_set1_ps(Bf16ToF32(a[r * lda + k - 1]));
      acc[r][0] = _mm256_fmadd_ps(al, l0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(al, l1, acc[r][1]);
    }
  }
  StoreHalf<R>(acc, c + 16 * kHalf, ldc, cols - 16 * kHalf);
}

// Up to kMR rows as at most two calls of at most 3 rows per half.
template <int R, int kPf, int kHalf, typename O>
void RowsBf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, O* c, int64_t ldc, int64_t cols,
              const char* ahead, int64_t ahead_lines) {
  constexpr int kFirst = R <= 3 ? R : (R + 1) / 2;
  HalfBf16<kFirst, kPf, kHalf>(a, lda, b, k, c, ldc, cols, ahead, ahead_lines);
  if constexpr (R > kFirst) HalfBf16<R - kFirst, 0, kHalf>(a + kFirst * lda, lda, b, k, c + kFirst * ldc, ldc, cols,
                                                           nullptr, 0);
}

template <int R, int kPf, typename O>
void MicroBf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, O* c, int64_t ldc,
               int64_t cols, const char* ahead, int64_t ahead_lines) {
  RowsBf16<R, kPf, 0>(a, lda, b, k, c, ldc, cols, ahead, ahead_lines);
  if (cols > 16) RowsBf16<R, 0, 1>(a, lda, b, k, c, ldc, cols, nullptr, 0);
}

// The 16 codes of quantized panel row i for columns 16h .. 16h + 15 as two vectors of 8 integers.
// 4-bit: the row's 16 bytes in both lanes, nibbles masked, then in-lane byte shuffles to 32-bit lanes
// (bytes 0-3 | 4-7 and 8-11 | 12-15); the zero-extending conversion, which crosses lanes, took ~1.3x as
// long (a 576-row panel rebuilt in L1, Zen 3).
template <int kBits, int kHalf>
inline void HalfCodes(const uint8_t* codes, int64_t i, __m256i& q0, __m256i& q1) {
  if constexpr (kBits == 4) {  // byte j: column j (low nibble), column j + 16 (high nibble)
    __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16)));
    if constexpr (kHalf == 1) bytes = _mm256_srli_epi16(bytes, 4);
    bytes = _mm256_and_si256(bytes, _mm256_set1_epi8(0xf));
    constexpr char z = -1;  // a shuffle index that writes zero
    q0 = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, z, z, z, 1, z, z, z, 2, z, z, z, 3, z, z, z, 4, z, z, z, 5,
                                                     z, z, z, 6, z, z, z, 7, z, z, z));
    q1 = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(8, z, z, z, 9, z, z, z, 10, z, z, z, 11, z, z, z, 12, z, z, z,
                                                     13, z, z, z, 14, z, z, z, 15, z, z, z));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 32 + 16 * kHalf));
    q0 = _mm256_cvtepu8_epi32(bytes);
    q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
  }
}

// Few rows, float32: columns 16h .. 16h + 15 with the weights rebuilt in registers as they are used
// (the codes are all a unit reads; the block's scales and offsets held), in at most kQuantMR rows:
// RebuiltHalf's weights and the dense kernel's sums, in its order.
template <int R, int kBits, int kHalf>
void HalfQuantF32(const float* a, int64_t lda, const uint8_t* codes, const float* qparams, int64_t k, float* c,
                  int64_t ldc, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < k / kQuantBlock; ++blk) {
    const float* qp = qparams + blk * 2 * kNR + 16 * kHalf;
    const __m256 s0 = _mm256_loadu_ps(qp), s1 = _mm256_loadu_ps(qp + 8);
    const __m256 o0 = _mm256_loadu_ps(qp + kNR), o1 = _mm256_loadu_ps(qp + kNR + 8);
#pragma GCC unroll 2
    for (int64_t i = blk * kQuantBlock; i < (blk + 1) * kQuantBlock; ++i) {
      __m256i q0, q1;
      HalfCodes<kBits, kHalf>(codes, i, q0, q1);
      const __m256 b0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), s0, o0);
      const __m256 b1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), s1, o1);
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + r * lda + i);
        acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
      }
    }
  }
  StoreHalf<R>(acc, c + 16 * kHalf, ldc, cols - 16 * kHalf);
}

// Declared for the tables' sake only: with kQuantDirectRowsBf16 = 0 no bfloat16 unit takes it.
template <int R, int kBits, typename O>
void MicroQuantBf16(const uint16_t* a, int64_t lda, const uint8_t* codes, const float* qparams, int64_t k, O* c,
                    int64_t ldc, int64_t cols);

// Quantized panel row i, columns 16h .. 16h + 15, rebuilt (code * scale + offset, one rounding).
template <int kBits, int kHalf>
inline void RebuiltHalf(const uint8_t* codes, const float* qparams, int64_t i, __m256& b0, __m256& b1) {
  const float* qp = qparams + (i / kQuantBlock) * 2 * kNR + 16 * kHalf;
  __m256i q0, q1;
  HalfCodes<kBits, kHalf>(codes, i, q0, q1);
  b0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_loadu_ps(qp), _mm256_loadu_ps(qp + kNR));
  b1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(qp + 8), _mm256_loadu_ps(qp + kNR + 8));
}

// One row of 4-bit weights: all 32 columns in one pass over K, four sums in flight where a half had
// two, whose chains of fused multiply-adds waited on the FMA latency (SmolLM2's 4-bit shapes, weights
// from memory, Zen 3: 1.01-1.17x). Each row's scales and offsets are loaded with it (RebuiltHalf):
// holding the block's in registers measured no faster, and a generic kernel over 1 or 2 halves
// spilled its accumulators (0.8-0.9x).
template <int kBits>
void OneRowQuantF32(const float* a, const uint8_t* codes, const float* qparams, int64_t k, float* c, int64_t cols) {
  __m256 lo[1][2], hi[1][2];
  lo[0][0] = lo[0][1] = hi[0][0] = hi[0][1] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k; ++i) {
    __m256 b0, b1, b2, b3;
    RebuiltHalf<kBits, 0>(codes, qparams, i, b0, b1);
    RebuiltHalf<kBits, 1>(codes, qparams, i, b2, b3);
    const __m256 av = _mm256_broadcast_ss(a + i);
    lo[0][0] = _mm256_fmadd_ps(av, b0, lo[0][0]);
    lo[0][1] = _mm256_fmadd_ps(av, b1, lo[0][1]);
    hi[0][0] = _mm256_fmadd_ps(av, b2, hi[0][0]);
    hi[0][1] = _mm256_fmadd_ps(av, b3, hi[0][1]);
  }
  StoreHalf<1>(lo, c, 0, cols);
  StoreHalf<1>(hi, c + 16, 0, cols - 16);
}

template <int R, int kBits>
void MicroQuantF32(const float* a, int64_t lda, const uint8_t* codes, const float* qparams, int64_t k, float* c,
                   int64_t ldc, int64_t cols) {
  if constexpr (R == 1 && kBits == 4) {  // (8-bit codes, twice the bytes, streamed no faster: 0.94-0.96x)
    OneRowQuantF32<kBits>(a, codes, qparams, k, c, cols);
  } else {
    HalfQuantF32<R, kBits, 0>(a, lda, codes, qparams, k, c, ldc, cols);
    if (cols > 16) HalfQuantF32<R, kBits, 1>(a, lda, codes, qparams, k, c, ldc, cols);
  }
}

template <int kBits>
void RebuildPanel(const uint8_t* codes, const float* qparams, int64_t k, float* panel) {
  for (int64_t i = 0; i < k; ++i) {
    __m256 b[4];
    RebuiltHalf<kBits, 0>(codes, qparams, i, b[0], b[1]);
    RebuiltHalf<kBits, 1>(codes, qparams, i, b[2], b[3]);
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(panel + i * kNR + 8 * v, b[v]);
  }
}

// Rounded to bfloat16 (as F32ToBf16) and paired: per column the word (bf16(row 2q), bf16(row 2q + 1)),
// as pack_weight lays the dequantized weight out.
template <int kBits>
void RebuildPanel(const uint8_t* codes, const float* qparams, int64_t k, uint16_t* panel) {
  for (int64_t q = 0; q < k / 2; ++q) {
    __m256 lo[4], hi[4];
    RebuiltHalf<kBits, 0>(codes, qparams, 2 * q, lo[0], lo[1]);
    RebuiltHalf<kBits, 1>(codes, qparams, 2 * q, lo[2], lo[3]);
    RebuiltHalf<kBits, 0>(codes, qparams, 2 * q + 1, hi[0], hi[1]);
    RebuiltHalf<kBits, 1>(codes, qparams, 2 * q + 1, hi[2], hi[3]);
    for (int v = 0; v < 4; ++v) {
      const __m256i words = _mm256_or_si256(Bf16Lanes(lo[v]), _mm256_slli_epi32(Bf16Lanes(hi[v]), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + q * 2 * kNR + 16 * v), words);
    }
  }
}

// bfloat16 units of more than kWidenRows rows: x's rows and the panel widened to float32 (exactly)
// once per unit, then the float32 kernels. The same products and sums as the pair kernels (k in
// order, one fused multiply-add each), at the float32 kernels' speed: the pair kernels spend
// registers and instructions on widening inside their loop (256 x 576 x 3072: 1.5x slower).
constexpr int64_t kWidenRows = 12;

void WidenValues(const uint16_t* x, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(out + i,
                     PairLow(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)))));
  for (; i < count; ++i) out[i] = Bf16ToF32(x[i]);
}

void WidenPanel(const uint16_t* b, int64_t k, float* panel) {
  for (int64_t q = 0; q < k / 2; ++q)
    for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + q * 2 * kNR + 16 * v));
      _mm256_storeu_ps(panel + 2 * q * kNR + 8 * v, PairLow(w));
      _mm256_storeu_ps(panel + (2 * q + 1) * kNR + 8 * v, PairHigh(w));
    }
  if (k % 2) WidenValues(b + (k - 1) * kNR, kNR, panel + (k - 1) * kNR);  // the plain last row
}

#else  // portable fallback: same layouts, plain loops (the compiler vectorizes what it can)

template <int R, int>
void MicroF32(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc, int64_t cols,
              const char*, int64_t) {
  float acc[R][kNR] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < R; ++r) {
      const float av = a[r * lda + i];
#pragma omp simd
      for (int64_t j = 0; j < kNR; ++j) acc[r][j] += av * b[i * kNR + j];
    }
  for (int r = 0; r < R; ++r) std::memcpy(c + r * ldc, acc[r], cols * sizeof(float));
}

template <int R, int, typename O>
void MicroBf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, O* c, int64_t ldc,
               int64_t cols, const char*, int64_t) {
  float acc[R][kNR] = {};
  float lo[kNR], hi[kNR];
  for (int64_t q = 0; q < (k + 1) / 2; ++q) {
    const uint16_t* bq = b + q * 2 * kNR;
    const bool plain = 2 * q + 1 == k;  // odd K: the last row is stored unpaired
    for (int64_t j = 0; j < kNR; ++j) {
      lo[j] = Bf16ToF32(plain ? bq[j] : bq[2 * j]);
      hi[j] = plain ? 0.f : Bf16ToF32(bq[2 * j + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const float al = Bf16ToF32(a[r * lda + 2 * q]);
      const float ah = plain ? 0.f : Bf16ToF32(a[r * lda + 2 * q + 1]);
#pragma omp simd
      for (int64_t j = 0; j < kNR; ++j) acc[r][j] += al * lo[j] + ah * hi[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j) StoreValue(c + r * ldc + j, acc[r][j]);
}

template <int kBits>
void RebuildPanel(const uint8_t* codes, const float* qparams, int64_t k, float* panel) {
  for (int64_t i = 0; i < k; ++i) {
    const float* qp = qparams + (i / kQuantBlock) * 2 * kNR;
    const uint8_t* ci = codes + i * (kBits * kNR / 8);
    for (int64_t j = 0; j < kNR; ++j) {
      const int code = kBits == 4 ? (ci[j % 16] >> (4 * (j / 16))) & 0xf : ci[j];
      panel[i * kNR + j] = static_cast<float>(code) * qp[j] + qp[kNR + j];
    }
  }
}

template <int kBits>
void RebuildPanel(const uint8_t* codes, const float* qparams, int64_t k, uint16_t* panel) {
  std::vector<float> rows(k * kNR);
  RebuildPanel<kBits>(codes, qparams, k, rows.data());
  for (int64_t q = 0; q < k / 2; ++q)
    for (int64_t j = 0; j < kNR; ++j)
      for (int64_t h = 0; h < 2; ++h) panel[q * 2 * kNR + 2 * j + h] = F32ToBf16(rows[(2 * q + h) * kNR + j]);
}

#endif

// The micro-kernels of one input dtype T and output dtype O (T, or float32 for bfloat16 inputs),
// with or without prefetching ahead, by row count: MicroTables<T, O>()[prefetch mode][R - 1].
template <typename T, typename O>
using MicroFn = void (*)(const T*, int64_t, const T*, int64_t, O*, int64_t, int64_t, const char*, int64_t);

template <typename T, typename O, int kPf, int R>
constexpr MicroFn<T, O> MicroFor() {
  if constexpr (std::is_same_v<T, float>) {
    return &MicroF32<R, kPf>;
  } else {
    return &MicroBf16<R, kPf, O>;
  }
}

template <typename T, typename O, int kPf, size_t... R>
constexpr std::array<MicroFn<T, O>, kMR> MicroTable(std::index_sequence<R...>) {
  return {MicroFor<T, O, kPf, static_cast<int>(R) + 1>()...};
}

template <typename T, typename O, size_t... Pf>
constexpr std::array<std::array<MicroFn<T, O>, kMR>, kPrefetchModes> MicroTables(std::index_sequence<Pf...>) {
  return {MicroTable<T, O, static_cast<int>(Pf)>(std::make_index_sequence<kMR>())...};
}

#if defined(JAXPAGED_MATMUL_AVX512) || defined(JAXPAGED_MATMUL_AVX2)
template <int R, int kBits, typename T, typename O>
constexpr auto MicroQuantFor() {
  if constexpr (std::is_same_v<T, float>) {
    return &MicroQuantF32<R, kBits>;
  } else {
    return &MicroQuantBf16<R, kBits, O>;
  }
}

template <int kBits, typename T, typename O, size_t... R>
constexpr auto QuantTable(std::index_sequence<R...>) {
  using QuantFn = void (*)(const T*, int64_t, const uint8_t*, const float*, int64_t, O*, int64_t, int64_t);
  return std::array<QuantFn, sizeof...(R)>{MicroQuantFor<static_cast<int>(R) + 1, kBits, T, O>()...};
}
#endif

#if defined(JAXPAGED_AMX)
// ---------------------------------------------------------------------------------------------
// AMX (Intel Sapphire Rapids and later): bfloat16 units through the tile registers. The packed
// bfloat16 panel is already AMX's B layout: a pair row (w[2q, c], w[2q+1, c]) for 32 columns is
// 128 bytes, so 16 pair rows (32 k) of 16 columns are one B tile read with a 128-byte stride, and
// the next 16 columns the tile 64 bytes on. x rows are A tiles as they lie. A unit computes 32-row
// slices of its rows: two A tiles, two B tiles, four 16 x 16 float32 accumulator tiles, then
// stores them through the same rounding as the vector kernels. K must be a multiple of 32. Units
// of at most kMR rows stay on the vector kernels, which stream a weight from memory a little
// faster (the tiles win 2-5x from 64 rows on: benchmarks/matmul.py).

// The CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tile data (asked once).
bool AmxUsable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

std::atomic<bool> amx_enabled{true};

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 accumulate rows 0..15 of the slice (columns 0..15, 16..31), 2, 3 rows 16..31;
// 4, 5 hold those rows of x, 6, 7 the two column halves of the panel's 32 k.
template <typename O>
__attribute__((target("amx-tile,amx-bf16"))) void AmxPanel(const uint16_t* a, int64_t lda, const uint16_t* b,
                                                            int64_t k, O* c, int64_t ldc, int64_t cols,
                                                            int64_t rows) {
  alignas(64) float acc[32][kNR];
  int configured[2] = {-1, -1};
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const int m0 = static_cast<int>(std::min<int64_t>(16, rows - r0));
    const int m1 = static_cast<int>(std::clamp<int64_t>(rows - r0 - 16, 0, 16));
    if (configured[0] != m0 || configured[1] != m1) {
      TileConfig cfg;
      const int tile_rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
      for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = static_cast<uint8_t>(tile_rows[t]);
        cfg.colsb[t] = tile_rows[t] ? 64 : 0;
      }
      _tile_loadconfig(&cfg);
      configured[0] = m0;
      configured[1] = m1;
    }
    const uint16_t* a0 = a + r0 * lda;
    const uint16_t* a1 = a0 + 16 * lda;
    _tile_zero(0);
    _tile_zero(1);
    if (m1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kk = 0; kk < k; kk += 32) {
      const uint16_t* bk = b + kk * kNR;  // pair row kk / 2
      _tile_loadd(6, bk, 4 * kNR);
      _tile_loadd(7, bk + 32, 4 * kNR);
      _tile_loadd(4, a0 + kk, 2 * lda);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (m1) {
        _tile_loadd(5, a1 + kk, 2 * lda);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, &acc[0][0], 4 * kNR);
    _tile_stored(1, &acc[0][16], 4 * kNR);
    if (m1) {
      _tile_stored(2, &acc[16][0], 4 * kNR);
      _tile_stored(3, &acc[16][16], 4 * kNR);
    }
    for (int r = 0; r < m0 + m1; ++r) {
      __m512 row[1][2] = {{_mm512_load_ps(acc[r]), _mm512_load_ps(acc[r] + 16)}};
      StoreTile<1>(row, c + (r0 + r) * ldc, ldc, cols);
    }
  }
  _tile_release();
}
#endif

// ---------------------------------------------------------------------------------------------
// Work split and execution.

// The work is a list of units (row block, panel), row-block major. Workers claim runs of
// consecutive units from a shared counter: big runs first (a weight stream of many contiguous
// panels), shrinking to single panels at the end. A worker takes the units of its run one at a
// time, and once the counter is exhausted the others steal the back half of what it has not
// started: a worker that starts late or loses its core to another process holds up the others
// by at most the unit it is in.
struct Plan {
  int64_t m, k, n, panels;
  int64_t block_rows;  // rows per row block (the last one may be shorter)
  int64_t units;       // row blocks x panels
  int64_t workers;
};

Plan MakePlan(int64_t m, int64_t k, int64_t n, int64_t elem_bytes, int64_t workers) {
  const int64_t panels = (n + kNR - 1) / kNR;
  const int64_t fit = std::max<int64_t>(kMR, kRowBlockBytes / std::max<int64_t>(1, k * elem_bytes) / kMR * kMR);
  const int64_t row_blocks = (m + fit - 1) / fit;
  return {m, k, n, panels, (m + row_blocks - 1) / row_blocks, row_blocks * panels, workers};
}

template <typename T, typename O>
struct Job {
  Plan plan;
  const T* x;
  const T* w;
  O* out;
  uint64_t call;  // distinct per Gemm call (keys the interleaved rows a worker keeps, AVX2)
};

std::atomic<uint64_t> gemm_calls{0};

// Splits `rows` into ceil(rows / kMax) near-equal micro-kernel row counts.
template <int64_t kMax = kMR, typename F>
inline void ForEachRowGroup(int64_t rows, F&& f) {
  const int64_t groups = (rows + kMax - 1) / kMax;
  int64_t r0 = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r = rows / groups + (g < rows % groups ? 1 : 0);
    f(r0, r);
    r0 += r;
  }
}

// The rows of x a unit's float32 micro-kernels read, row group g (ForEachRowGroup's) at offset r0 * k
// for its first row r0: on AVX2 interleaved (below), elsewhere x's own rows (stride k).
#if defined(JAXPAGED_MATMUL_AVX2)
// AVX2: a row group of R rows interleaved k-major, x[r0 + r, i] at r0 * k + i * R + r, so that a k
// step broadcasts R neighbouring floats rather than one float from each of R rows k apart (one
// stream for the hardware prefetcher and the L1, not R; SmolLM2's shapes at 8-512 rows on two
// threads, Zen 3: 1.03-1.3x faster on a float32 weight, 1.0-1.1x on a 4-bit one).
// A worker interleaves a row block (rows from row0, float32 or bfloat16 widened exactly) once per
// call and keeps it for its units of that block.
template <typename T, int R>
void InterleaveGroup(const T* x, int64_t k, float* group) {  // (R a constant: 6x faster than a variable)
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < R; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        group[i * R + r] = x[r * k + i];
      } else {
        group[i * R + r] = Bf16ToF32(x[r * k + i]);
      }
    }
}

template <typename T, size_t... R>
constexpr auto InterleaveTable(std::index_sequence<R...>) {
  return std::array<void (*)(const T*, int64_t, float*), kMR>{&InterleaveGroup<T, static_cast<int>(R) + 1>...};
}

template <typename T>
const float* InterleavedRows(const T* x, int64_t k, int64_t rows, uint64_t call, int64_t row0) {
  static constexpr auto kInterleave = InterleaveTable<T>(std::make_index_sequence<kMR>());
  struct Block {
    uint64_t call = ~uint64_t{0};
    int64_t row0 = -1;
    std::vector<float> values;
  };
  thread_local Block block;
  if (block.call != call || block.row0 != row0) {
    block.values.resize(rows * k);
    ForEachRowGroup(rows, [&](int64_t r0, int64_t r) {
      kInterleave[r - 1](x + r0 * k, k, block.values.data() + r0 * k);
    });
    block.call = call;
    block.row0 = row0;
  }
  return block.values.data();
}

inline const float* KernelRows(const float* x, int64_t k, int64_t rows, uint64_t call, int64_t row0) {
  return InterleavedRows(x, k, rows, call, row0);
}
#else
inline const float* KernelRows(const float* x, int64_t, int64_t, uint64_t, int64_t) { return x; }
#endif
inline const uint16_t* KernelRows(const uint16_t* x, int64_t, int64_t, uint64_t, int64_t) { return x; }

// Whether a unit of `rows` rows of T (K = k) runs on AMX tiles rather than the vector kernels.
template <typename T>
inline bool TilesFor(int64_t rows, int64_t k) {
#if defined(JAXPAGED_AMX)
  if constexpr (std::is_same_v<T, uint16_t>)
    return rows > kMR && k % 32 == 0 && amx_enabled.load(std::memory_order_relaxed) && AmxUsable();
#endif
  (void)rows;
  (void)k;
  return false;
}

#if !defined(JAXPAGED_AMX)
template <typename O>
void AmxPanel(const uint16_t*, int64_t, const uint16_t*, int64_t, O*, int64_t, int64_t, int64_t) {}
#endif

#if defined(JAXPAGED_MATMUL_AVX2)
template <typename O, size_t... R>
constexpr std::array<MicroFn<float, O>, kMR> WideTable(std::index_sequence<R...>) {
  return {&MicroF32<static_cast<int>(R) + 1, 0, O>...};
}

// A bfloat16 unit (row block rb, panel b) on the float32 kernels: the block's rows widened (and
// interleaved) once per worker and call, the panel per unit.
template <typename O>
void RunWidened(const Job<uint16_t, O>& job, int64_t rb, const uint16_t* b, O* c, int64_t cols) {
  static constexpr auto kWide = WideTable<O>(std::make_index_sequence<kMR>());
  thread_local std::vector<float> panel;
  const Plan& p = job.plan;
  const int64_t row0 = rb * p.block_rows, rows = std::min(p.block_rows, p.m - row0);
  const float* x = InterleavedRows(job.x + row0 * p.k, p.k, rows, job.call, row0);
  panel.resize(p.k * kNR);
  WidenPanel(b, p.k, panel.data());
  ForEachRowGroup(rows, [&](int64_t r0, int64_t r) {
    kWide[r - 1](x + r0 * p.k, p.k, panel.data(), p.k, c + r0 * p.n, p.n, cols, nullptr, 0);
  });
}
#endif

// Unit u; `more` if the same worker will most likely run u + 1 next.
template <typename T, typename O>
void RunUnit(const Job<T, O>& job, int64_t u, bool more) {
  static constexpr auto kTables = MicroTables<T, O>(std::make_index_sequence<kPrefetchModes>());
  const Plan& p = job.plan;
  const int64_t panel_lines = p.k * kNR * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t rb = u / p.panels, panel = u % p.panels;
  const int64_t row0 = rb * p.block_rows, rows = std::min(p.block_rows, p.m - row0);
  const int64_t groups = (rows + kMR - 1) / kMR;
  const T* b = job.w + panel * p.k * kNR;
  const int64_t cols = std::min(kNR, p.n - panel * kNR);
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (TilesFor<T>(rows, p.k)) {
      AmxPanel(job.x + row0 * p.k, p.k, b, p.k, job.out + row0 * p.n + panel * kNR, p.n, cols, rows);
      return;
    }
#if defined(JAXPAGED_MATMUL_AVX2)
    if (rows > kWidenRows) {
      RunWidened(job, rb, b, job.out + row0 * p.n + panel * kNR, cols);
      return;
    }
#endif
  }
  // With few row groups (the weight is read from memory about as fast as it is used), each
  // group prefetches its share of the next panel into L2.
  const char* next = reinterpret_cast<const char*>(b + p.k * kNR);
  const bool prefetch = rows >= kPrefetchMinRows;
  const T* x = KernelRows(job.x + row0 * p.k, p.k, rows, job.call, row0);
  const bool ahead = prefetch && more && panel + 1 < p.panels && groups <= kAheadGroups;
  const int64_t share = ahead ? (panel_lines + groups - 1) / groups : 0;
  int64_t g = 0;
  ForEachRowGroup(rows, [&](int64_t r0, int64_t r) {
    const int64_t first = std::min(panel_lines, g * share);
    const int mode = (prefetch && g++ == 0 ? kNear : 0) | (ahead ? kAhead : 0);
    kTables[mode][r - 1](x + r0 * p.k, p.k, b, p.k, job.out + (row0 + r0) * p.n + panel * kNR, p.n,
                         cols, next + 64 * first, std::min(share, panel_lines - first));
  });
}

// A worker's unstarted units [begin, end) in one word, so that its owner (taking from the front)
// and thieves (taking the back half) agree through compare-and-swap.
struct alignas(64) Range {
  std::atomic<uint64_t> word{0};
  static uint64_t Pack(int64_t begin, int64_t end) {
    return static_cast<uint64_t>(begin) | static_cast<uint64_t>(end) << 32;
  }
  static int64_t Begin(uint64_t w) { return static_cast<int64_t>(w & 0xffffffffu); }
  static int64_t End(uint64_t w) { return static_cast<int64_t>(w >> 32); }
};

// Shared by the caller and the pool tasks; the caller returns once every unit is done. Tasks
// that start late find nothing left and only touch `state`.
struct SharedState {
  explicit SharedState(int64_t workers) : ranges(workers) {}
  std::atomic<int64_t> next{0};  // first unit not yet handed out
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> joined{0};
  std::vector<Range> ranges;     // one per worker
};

// Gives `mine` a new run: from the shared counter, else the back half of another worker's
// unstarted units. False when there is nothing left to start.
inline bool Refill(SharedState& s, Range& mine, int64_t n, int64_t share) {
  for (int64_t u0 = s.next.load(); u0 < n;) {
    const int64_t u1 = u0 + std::clamp<int64_t>((n - u0) / share, 1, kMaxPanelsPerRun);
    if (s.next.compare_exchange_weak(u0, u1)) {  // on failure u0 holds the current value
      mine.word.store(Range::Pack(u0, u1));
      return true;
    }
  }
  for (Range& other : s.ranges) {
    uint64_t w = other.word.load();
    while (Range::Begin(w) < Range::End(w)) {
      const int64_t begin = Range::Begin(w), end = Range::End(w), mid = begin + (end - begin) / 2;
      if (other.word.compare_exchange_weak(w, Range::Pack(begin, mid))) {
        mine.word.store(Range::Pack(mid, end));
        return true;
      }
    }
  }
  return false;
}

// Runs run_unit(u, more) for every unit u < n on up to `workers` threads (the caller and pool tasks).
template <typename RunUnitFn, typename Pool>
void RunUnits(int64_t n, int64_t workers, const RunUnitFn& run_unit, Pool& pool) {
  const int64_t share = 2 * workers;
  const int64_t helpers = std::min<int64_t>(workers, n) - 1;
  auto state = std::make_shared<SharedState>(helpers + 1);
  auto work = [state, &run_unit, n, share]() {
    SharedState& s = *state;
    Range& mine = s.ranges[s.joined.fetch_add(1)];
    do {
      for (uint64_t r = mine.word.load(); Range::Begin(r) < Range::End(r);) {
        const int64_t u = Range::Begin(r), end = Range::End(r);
        if (!mine.word.compare_exchange_weak(r, Range::Pack(u + 1, end))) continue;
        run_unit(u, u + 1 < end);
        s.done.fetch_add(1, std::memory_order_release);
        r = mine.word.load();
      }
    } while (Refill(s, mine, n, share));
  };
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state, work, n]() {
      if (state->done.load() < n) work();
    });
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// False if the problem has too many units for Range's 32-bit halves (N over 2^36 / M columns).
template <typename T, typename O, typename Pool>
bool Gemm(const T* x, const T* w, O* out, int64_t m, int64_t k, int64_t n, Pool& pool) {
  if (m == 0 || n == 0) return true;
  if (k == 0) {
    std::memset(out, 0, m * n * sizeof(O));
    return true;
  }
#if defined(JAXPAGED_MATMUL_AVX2)
  const int64_t row_bytes = sizeof(float);  // bfloat16 row blocks sized for their widened rows
#else
  const int64_t row_bytes = sizeof(T);
#endif
  const Plan plan = MakePlan(m, k, n, row_bytes, std::max<int64_t>(1, pool.num_threads()));
  if (plan.units >= (int64_t{1} << 31)) return false;
  const Job<T, O> job{plan, x, w, out, gemm_calls.fetch_add(1, std::memory_order_relaxed)};
  RunUnits(plan.units, plan.workers, [&job](int64_t u, bool more) { RunUnit(job, u, more); }, pool);
  return true;
}

#if defined(JAXPAGED_MATMUL_AVX2)
// A float32 unit of few rows (above kQuantDirectRows, at most kQuantBlockRows) on AVX2: the panel
// rebuilt one block of 32 k at a time into L1 (4 KiB), each row group's sums carried across the
// blocks in a tile, instead of the whole panel rebuilt into L2 and read back by every row group: the
// rebuild's stores stay in L1 and the short blocks let the two halves' latency-bound chains overlap
// (SmolLM2's 4-bit shapes, weights from memory, two threads, Zen 3: 5-8 rows 1.15-1.25x, 16 rows
// 1.05-1.1x, 32 rows no faster). The same products, summed in the same order as the dense kernel's.
template <int kBits>
void QuantBlocksF32(const float* x, int64_t rows, const uint8_t* codes, const float* qparams, int64_t k, float* c,
                    int64_t ldc, int64_t cols) {
  static constexpr auto kCarry = CarryTable(std::make_index_sequence<kMR>());
  alignas(32) float block[kQuantBlock * kNR];
  alignas(32) float acc[kQuantBlockRows * kNR] = {};
  const int64_t code_rows = kQuantBlock * kBits * kNR / 8;  // code bytes of a block
  for (int64_t blk = 0; blk < k / kQuantBlock; ++blk) {
    RebuildPanel<kBits>(codes + blk * code_rows, qparams + blk * 2 * kNR, kQuantBlock, block);
    ForEachRowGroup(rows, [&](int64_t r0, int64_t r) {
      kCarry[r - 1](x + r0 * k + blk * kQuantBlock * r, block, acc + r0 * kNR);
    });
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * ldc, acc + r * kNR, cols * sizeof(float));
}
#endif

// out[m, n] = x[m, k] @ a quantized weight w[P, panel bytes], x float32 or bfloat16 (T), out T or
// float32 (O). Units as the dense Gemm's (row block, panel); a unit of few rows (kQuantDirectRows,
// AVX-512 and AVX2) rebuilds the weights in registers as it goes (the codes are all it reads), an
// AVX2 float32 unit of up to kQuantBlockRows rows one block of k at a time (QuantBlocksF32), any
// other unit rebuilds its panel once into the dense layout in cache (thread-local) and runs the
// dense kernels on it. Either way each output is the dense kernel's sum over the same weights
// (bfloat16: the rebuilt weight rounded, as pack_weight rounds the dequantized one), and bfloat16
// units take tiles exactly where the dense Gemm's do. False if the problem is too large.
template <int kBits, typename T, typename O, typename Pool>
bool QuantGemm(const T* x, const uint8_t* w, O* out, int64_t m, int64_t k, int64_t n, Pool& pool) {
  static constexpr auto kDense = MicroTables<T, O>(std::make_index_sequence<kPrefetchModes>());
  if (m == 0 || n == 0) return true;
  const Plan plan = MakePlan(m, k, n, sizeof(T), std::max<int64_t>(1, pool.num_threads()));
  if (plan.units >= (int64_t{1} << 31)) return false;
  const int64_t code_bytes = k * kBits * kNR / 8;
  const int64_t panel_bytes = code_bytes + k / kQuantBlock * 2 * kNR * static_cast<int64_t>(sizeof(float));
  const uint64_t call = gemm_calls.fetch_add(1, std::memory_order_relaxed);
  RunUnits(plan.units, plan.workers, [&](int64_t u, bool) {
    const int64_t rb = u / plan.panels, panel = u % plan.panels;
    const int64_t row0 = rb * plan.block_rows, rows = std::min(plan.block_rows, m - row0);
    const uint8_t* codes = w + panel * panel_bytes;
    const auto* qparams = reinterpret_cast<const float*>(codes + code_bytes);
    const int64_t cols = std::min(kNR, n - panel * kNR);
    const T* a = x + row0 * k;
    O* c = out + row0 * n + panel * kNR;
#if defined(JAXPAGED_MATMUL_AVX512) || defined(JAXPAGED_MATMUL_AVX2)
    constexpr int64_t kDirectRows = std::is_same_v<T, float> ? kQuantDirectRows : kQuantDirectRowsBf16;
    if constexpr (kDirectRows > 0) {
      static constexpr auto kDirect = QuantTable<kBits, T, O>(std::make_index_sequence<kQuantMR>());
      if (rows <= kDirectRows) {
        ForEachRowGroup<kQuantMR>(rows, [&](int64_t r0, int64_t r) {
          kDirect[r - 1](a + r0 * k, k, codes, qparams, k, c + r0 * n, n, cols);
        });
        return;
      }
    }
#endif
#if defined(JAXPAGED_MATMUL_AVX2)
    if constexpr (std::is_same_v<T, float>) {
      if (rows <= kQuantBlockRows) {
        QuantBlocksF32<kBits>(KernelRows(a, k, rows, call, row0), rows, codes, qparams, k, c, n, cols);
        return;
      }
    }
#endif
    thread_local std::vector<T> rebuilt;
    if (static_cast<int64_t>(rebuilt.size()) < k * kNR) rebuilt.resize(k * kNR);
    RebuildPanel<kBits>(codes, qparams, k, rebuilt.data());
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (TilesFor<T>(rows, k)) {
        AmxPanel(a, k, rebuilt.data(), k, c, n, cols, rows);
        return;
      }
    }
    const T* rows_x = KernelRows(a, k, rows, call, row0);
    ForEachRowGroup(rows, [&](int64_t r0, int64_t r) {
      kDense[0][r - 1](rows_x + r0 * k, k, rebuilt.data(), k, c + r0 * n, n, cols, nullptr, 0);
    });
  }, pool);
  return true;
}

// x float32 or bfloat16, out x's dtype or float32 (bfloat16 products' unrounded sums).
ffi::Error CheckDtypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out) {
  if (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("matmul_cpu: only float32 and bfloat16 are supported");
  if (out.element_type() != x.element_type() && out.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("matmul_cpu: out must be x's dtype or float32");
  return ffi::Error::Success();
}

// f(x, out) with typed pointers (float/float, bf16/bf16 or bf16/float; CheckDtypes passed), then
// out's rows from m on (a padded batch's padding) zeroed; an error if f says the problem is too large.
template <typename F>
ffi::Error RunTyped(const ffi::AnyBuffer& x, ffi::AnyBuffer& out, int64_t m, F&& f) {
  const auto* xb = static_cast<const uint16_t*>(x.untyped_data());
  const bool ok = x.element_type() == ffi::DataType::F32
                      ? f(static_cast<const float*>(x.untyped_data()), static_cast<float*>(out.untyped_data()))
                  : out.element_type() == ffi::DataType::F32 ? f(xb, static_cast<float*>(out.untyped_data()))
                                                             : f(xb, static_cast<uint16_t*>(out.untyped_data()));
  if (!ok) return ffi::Error::InvalidArgument("matmul_cpu: problem too large");
  const auto od = out.dimensions();
  const size_t row_bytes = od[1] * ffi::ByteWidth(out.element_type());
  std::memset(static_cast<char*>(out.untyped_data()) + m * row_bytes, 0, (od[0] - m) * row_bytes);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Buffer<ffi::S32> rows,
                      ffi::Result<ffi::AnyBuffer> out, int64_t layer) {
  const auto xd = x.dimensions();
  const LayerWeight w = PickLayer(packed, 3, layer);
  const auto od = out->dimensions();
  if (xd.size() != 2 || !w.ok || od.size() != 2 || w.dims[2] != kNR)
    return ffi::Error::InvalidArgument("matmul_cpu: expected x[M,K], packed[P,K,32] (or [L,P,K,32] and a layer "
                                       "below L), out[M,N]");
  if (rows.element_count() != 1) return ffi::Error::InvalidArgument("matmul_cpu: rows must be one int32");
  const int64_t k = xd[1], n = od[1];
  if (w.dims[1] != k || od[0] != xd[0] || (n + kNR - 1) / kNR != w.dims[0])
    return ffi::Error::InvalidArgument("matmul_cpu: x, packed weight and out shapes do not agree");
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);  // rows past it: padding
  if (x.element_type() != packed.element_type())
    return ffi::Error::InvalidArgument("matmul_cpu: x and the packed weight must share a dtype");
  if (ffi::Error e = CheckDtypes(x, *out); e.failure()) return e;
  return RunTyped(x, *out, m, [&](const auto* a, auto* c) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(a)>>;
    return Gemm(a, static_cast<const T*>(w.data), c, m, k, n, pool);
  });
}

// out[M, N] = x[M, K] @ a quantized weight w[P, K * (c + 8)] (c = 16 or 32 code bytes per panel row,
// see the top of the file); x float32 or bfloat16, out x's dtype or float32; rows past `rows` are zero.
ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed,
                           ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out, int64_t layer) {
  const auto xd = x.dimensions();
  const LayerWeight w = PickLayer(packed, 2, layer);
  const auto od = out->dimensions();
  if (xd.size() != 2 || !w.ok || od.size() != 2 || od[0] != xd[0] || (od[1] + kNR - 1) / kNR != w.dims[0])
    return ffi::Error::InvalidArgument("matmul_cpu: expected x[M,K], a quantized weight [P, bytes] (or [L, P, bytes] "
                                       "and a layer below L), out[M,N]");
  if (rows.element_count() != 1) return ffi::Error::InvalidArgument("matmul_cpu: rows must be one int32");
  if (ffi::Error e = CheckDtypes(x, *out); e.failure()) return e;
  const int64_t k = xd[1], n = od[1];
  const int64_t code_bytes = k == 0 ? 0 : w.dims[1] / k - 8;
  if (k % kQuantBlock != 0 || k == 0 || w.dims[1] % k != 0 || (code_bytes != kNR / 2 && code_bytes != kNR))
    return ffi::Error::InvalidArgument("matmul_cpu: the quantized weight's panels do not match K (a multiple of 32)");
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const auto* codes = static_cast<const uint8_t*>(w.data);
  return RunTyped(x, *out, m, [&](const auto* a, auto* c) {
    return code_bytes == kNR / 2 ? QuantGemm<4>(a, codes, c, m, k, n, pool)
                                 : QuantGemm<8>(a, codes, c, m, k, n, pool);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMatmulQuantCpu, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer"));

// Whether bfloat16 products use AMX: 1 if they do (the CPU and kernel allow it and it is enabled),
// 0 if not; `enable` 0 or 1 switches it (benchmarks and tests compare the paths), -1 only asks.
extern "C" int JaxpagedMatmulAmx(int enable) {
#if defined(JAXPAGED_AMX)
  if (enable >= 0) amx_enabled.store(enable != 0);
  return amx_enabled.load() && AmxUsable() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}

// 1 if the micro-kernels were compiled for AVX-512 or AVX2 + FMA vectors, 0 if they are the portable
// loops (a build machine without either), which XLA's own dot outruns in float32.
extern "C" int JaxpagedMatmulVectorized() {
#if defined(JAXPAGED_MATMUL_AVX512) || defined(JAXPAGED_MATMUL_AVX2)
  return 1;
#else
  return 0;
#endif
}
