// Ragged paged attention for the CPU, called from XLA through the FFI.
//
// Same contract as pallas_kernels/reference.py: flat ragged queries q[T, Hq, D] attend to
// their row's pages of kv_pages[L, 2, num_blocks, block_size, Hkv, D] at layer `layer`.
// The pages are read in place (no gather copy), each row only up to its own length, and
// the work items are spread over XLA's intra-op thread pool, largest first. Keys are visited
// in chunks with a flash-style online softmax, so scratch does not grow with the context.
//
// Two kinds of work item:
// - Prefill tile: up to kTileRows query rows (tokens x the G query heads of one kv head).
//   The scaled queries are transposed once, so the scores of a key chunk come out as vectors
//   over queries (S^T[key][query], one broadcast key element per FMA, no horizontal sums) and
//   the softmax statistics are per-lane vectors. P @ V accumulates into register tiles.
// - Decode (one query token): all kv heads of a range of keys, so each page is streamed as one
//   contiguous block (the next one prefetched meanwhile). Each query scores 16 keys at once: per-key
//   product vectors are summed in a transpose-add tree. With few rows, long rows are split into
//   key ranges whose softmax states are merged at the end (flash-decoding), so one row can
//   still use every thread.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpaged::simd;  // NOLINT: the kernels are written in its 16-lane operations

constexpr int kDecodeKeys = 16;    // keys per online-softmax step in decode: one vector of keys
constexpr int kTileKeys = 32;      // keys per online-softmax step in a prefill tile
constexpr int kTileRows = 48;      // query rows per prefill tile: 3 vectors, the score kernel's width
constexpr int kMinSplitKeys = 64;  // smallest key range worth a work item of its own
// A prefill tile's register tiles: S^T in keys x query vectors, P @ V in up to 6 rows x vectors of
// the head dimension. AVX2 has 16 vector registers, two per 16-lane Vec, where 8 x 3 and 6 x 4
// tiles spill: 4 x 1 and 6 x 1 there (Zen 3, a 512-token chunk: 1.25-1.6x faster). A decode row's
// P @ V keeps 6 x 4 with AVX-512; AVX2 decodes a head dimension of whole 8-lane vectors with kernels
// of its own (Dot8Keys, DecodePv8), anything else with 6 x 4 as well.
#if JAXPAGED_AVX2
constexpr int kScoreKeys = 4, kScoreQueryVecs = 1, kTilePvVecs = 1;
#else
constexpr int kScoreKeys = 8, kScoreQueryVecs = 3, kTilePvVecs = 4;
#endif
constexpr int kDecodePvVecs = 4;
// Estimated cycles (see WorkItem::cost) below which a call runs on the caller's thread alone:
// waking a pool thread costs ~5-30 us here, more than it saves on smaller calls.
constexpr double kParallelCost = 150e3;
// Estimated cycles per byte of K/V a decode row reads. Its pages come from memory, not cache (a model
// step streams every layer's weights and pages in between): one row of 450 keys (SmolLM2, float32,
// 690 KB) took ~100 us on one thread in a decode step, ~7 GB/s = ~0.5 cycles a byte at 3.5 GHz.
// Priced as cache reads (~0.125), such a row ran on one thread for the time of several thread wake-ups.
constexpr double kCyclesPerKvByte = 0.5;

// Fully unrolled small loops let GCC keep arrays of accumulators in registers (without it,
// they are stored to the stack on every iteration).
#define UNROLL _Pragma("GCC unroll 16")

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1).
inline Vec SoftCap(Vec s, float cap) {
  const Vec e = Exp(Mul(s, Set1(2.f / cap)));
  return Mul(Set1(cap), Sub(Set1(1.f), Div(Set1(2.f), Add(e, Set1(1.f)))));
}

// ------------------------------------------------------------------------------ output dtypes
// (inputs are widened to float32 by LoadMasked)

using jaxpaged::Bf16ToF32;
using jaxpaged::F32ToBf16;

inline void FromF32(float x, float* dst) { *dst = x; }
inline void FromF32(float x, uint16_t* dst) { *dst = F32ToBf16(x); }

// ------------------------------------------------------------------------------ problem, items

struct Problem {
  int64_t hq, hkv, g, d, dpad, block_size, width, tile_tokens;
  int64_t kv_bytes;  // bytes per element of the pages
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  float scale, soft_cap;
  int64_t window;

  // Position of token t of row r, and the first key it sees.
  int64_t Position(int64_t r, int64_t t) const { return seq_lens[r] - (qsl[r + 1] - t); }
  int64_t FirstKey(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
};

struct WorkItem {
  int32_t row, t0, t1;  // query tokens [t0, t1) of `row`
  int32_t h0, h1;       // kv heads [h0, h1): one for a prefill tile, all for a decode row
  int32_t k0, k1;       // keys [k0, k1)
  int32_t part;         // >= 0: a decode row split by keys; its softmax state goes to partial slot `part`
  double cost;          // estimated cycles, ~ FMAs of 16 lanes plus memory traffic
};

// Per-thread scratch: Carve({n0, n1, ...}) hands out float arrays of those sizes, each starting
// on a whole vector, reusing one growing buffer across items.
class Scratch {
 public:
  template <size_t N>
  std::array<float*, N> Carve(const int64_t (&sizes)[N]) {
    int64_t total = 0;
    for (int64_t n : sizes) total += Round(n);
    if (static_cast<int64_t>(buf_.size()) < total) buf_.resize(total);
    std::array<float*, N> out;
    float* p = buf_.data();
    for (size_t i = 0; i < N; ++i) out[i] = p, p += Round(sizes[i]);
    return out;
  }

 private:
  static int64_t Round(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }
  std::vector<float> buf_;
};

// K and V rows (kv head 0) of `n` consecutive keys from `k0`, walking the row's block table;
// entries up to N repeat the first row, so kernels may load full groups without reading
// anything outside the row's live context.
template <int N, typename T>
void KeyRows(const Problem& p, const int32_t* table, const T* k_layer, const T* v_layer, int64_t k0, int64_t n,
             const T** k, const T** v) {
  int64_t b = k0 / p.block_size, off = k0 % p.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = (static_cast<int64_t>(table[b]) * p.block_size + off) * p.hkv * p.d;
    k[i] = k_layer + at;
    v[i] = v_layer + at;
    if (++off == p.block_size) off = 0, ++b;
  }
  for (int64_t i = n; i < N; ++i) k[i] = k[0], v[i] = v[0];
}

// float32 rows of one kv head (at `offset` in each row): the page memory itself for float32
// pages, else converted into `buf` (N x dpad).
template <int N, typename T>
void HeadRows(const Problem& p, const T* const* rows, int64_t n, int64_t offset, float* buf, const float** out) {
  for (int64_t i = 0; i < N; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = rows[i] + offset;
    } else {
      float* dst = buf + i * p.dpad;
      if (i < n)
        for (int64_t e = 0; e < p.d; e += kLanes) Store(dst + e, LoadMasked(rows[i] + offset + e, FirstLanes(p.d - e)));
      out[i] = i < n ? dst : buf;
    }
  }
}

// ------------------------------------------------------------------------------ micro-kernels

// o[i][:] = alpha[i] * o[i][:] + sum_k p[k * ps_k + i * ps_i] * v[k][:] for R rows and NV vectors
// of the head dimension from vector v0 (V's last one masked by `tail`); the accumulators stay in
// registers over the keys.
template <int R, int NV>
void PvTile(const float* p, int64_t ps_k, int64_t ps_i, const float* alpha, const float* const* v, int64_t nk,
            float* o, int64_t ldo, int64_t v0, Mask tail) {
  Vec acc[R][NV];
  UNROLL for (int i = 0; i < R; ++i)
    UNROLL for (int n = 0; n < NV; ++n) acc[i][n] = Mul(Load(o + i * ldo + (v0 + n) * kLanes), Set1(alpha[i]));
  for (int64_t k = 0; k < nk; ++k) {
    Vec vv[NV];
    UNROLL for (int n = 0; n < NV; ++n)
      vv[n] = LoadMasked(v[k] + (v0 + n) * kLanes, n == NV - 1 ? tail : Mask(0xFFFF));
    UNROLL for (int i = 0; i < R; ++i) {
      const Vec pk = Set1(p[k * ps_k + i * ps_i]);
      UNROLL for (int n = 0; n < NV; ++n) acc[i][n] = Fma(pk, vv[n], acc[i][n]);
    }
  }
  UNROLL for (int i = 0; i < R; ++i)
    UNROLL for (int n = 0; n < NV; ++n) Store(o + i * ldo + (v0 + n) * kLanes, acc[i][n]);
}

template <int R>
void PvRows(const float* p, int64_t ps_k, int64_t ps_i, const float* alpha, const float* const* v, int64_t nk,
            float* o, int64_t ldo, int64_t v0, int64_t nv, Mask tail) {
  switch (nv) {
    case 1: return PvTile<R, 1>(p, ps_k, ps_i, alpha, v, nk, o, ldo, v0, tail);
    case 2: return PvTile<R, 2>(p, ps_k, ps_i, alpha, v, nk, o, ldo, v0, tail);
    case 3: return PvTile<R, 3>(p, ps_k, ps_i, alpha, v, nk, o, ldo, v0, tail);
    default: return PvTile<R, 4>(p, ps_k, ps_i, alpha, v, nk, o, ldo, v0, tail);
  }
}

// Rescale and accumulate `rows` rows of o (stride dpad) over nk keys: tiles of 6 rows x at most
// `vecs` (<= 4) vectors.
void AccumulatePv(const Problem& pr, const float* p, int64_t ps_k, int64_t ps_i, const float* alpha,
                  const float* const* v, int64_t nk, float* o, int64_t rows, int64_t vecs) {
  const int64_t nvec = pr.dpad / kLanes;
  for (int64_t i = 0; i < rows; i += 6) {
    const float* pi = p + i * ps_i;
    float* oi = o + i * pr.dpad;
    for (int64_t v0 = 0; v0 < nvec; v0 += vecs) {
      const int64_t nv = std::min<int64_t>(vecs, nvec - v0);
      const Mask tail = v0 + nv == nvec ? FirstLanes(pr.d - (nvec - 1) * kLanes) : Mask(0xFFFF);
      switch (std::min<int64_t>(6, rows - i)) {
        case 1: PvRows<1>(pi, ps_k, ps_i, alpha + i, v, nk, oi, pr.dpad, v0, nv, tail); break;
        case 2: PvRows<2>(pi, ps_k, ps_i, alpha + i, v, nk, oi, pr.dpad, v0, nv, tail); break;
        case 3: PvRows<3>(pi, ps_k, ps_i, alpha + i, v, nk, oi, pr.dpad, v0, nv, tail); break;
        case 4: PvRows<4>(pi, ps_k, ps_i, alpha + i, v, nk, oi, pr.dpad, v0, nv, tail); break;
        case 5: PvRows<5>(pi, ps_k, ps_i, alpha + i, v, nk, oi, pr.dpad, v0, nv, tail); break;
        default: PvRows<6>(pi, ps_k, ps_i, alpha + i, v, nk, oi, pr.dpad, v0, nv, tail); break;
      }
    }
  }
}

// s[r][lane] = sum_e k[r][e] * qt[e][lane] for kScoreKeys keys and NQ vectors of transposed queries.
template <int NQ>
void ScoreTile(const float* qt, int64_t ldq, const float* const* k, int64_t d, float* s, int64_t lds) {
  constexpr int kKeys = kScoreKeys;
  Vec acc[kKeys][NQ];
  UNROLL for (int r = 0; r < kKeys; ++r)
    UNROLL for (int n = 0; n < NQ; ++n) acc[r][n] = Zero();
  for (int64_t e = 0; e < d; ++e) {
    Vec q[NQ];
    UNROLL for (int n = 0; n < NQ; ++n) q[n] = Load(qt + e * ldq + n * kLanes);
    UNROLL for (int r = 0; r < kKeys; ++r) {
      const Vec kb = Set1(k[r][e]);
      UNROLL for (int n = 0; n < NQ; ++n) acc[r][n] = Fma(kb, q[n], acc[r][n]);
    }
  }
  UNROLL for (int r = 0; r < kKeys; ++r)
    UNROLL for (int n = 0; n < NQ; ++n) Store(s + r * lds + n * kLanes, acc[r][n]);
}

// Lane r = q . k[r] over NV vectors of the head dimension from vector v0 (the last one masked by
// `tail`), for 16 keys: the query stays in registers while the keys stream past.
template <int NV>
Vec DotBlock(const float* q, const float* const* k, int64_t v0, Mask tail) {
  Vec qv[NV], acc[kDecodeKeys];
  UNROLL for (int n = 0; n < NV; ++n) qv[n] = Load(q + (v0 + n) * kLanes);
  UNROLL for (int r = 0; r < kDecodeKeys; ++r) {
    const float* kr = k[r] + v0 * kLanes;
    acc[r] = Mul(qv[0], LoadMasked(kr, NV == 1 ? tail : Mask(0xFFFF)));
    UNROLL for (int n = 1; n < NV; ++n)
      acc[r] = Fma(qv[n], LoadMasked(kr + n * kLanes, n == NV - 1 ? tail : Mask(0xFFFF)), acc[r]);
  }
  return SumEach16(acc);
}

#if JAXPAGED_AVX2
// AVX2 decode kernels for a head dimension of whole 8-lane vectors, on 8-lane registers: the 16-lane
// Vec code (DotBlock, PvTile<3, 4>) keeps 16 or 24 accumulator vectors, 32-48 ymm registers of
// AVX2's 16, and spills them in its inner loops. Decode rows of 256 keys (SmolLM2's heads, pages
// consecutive in memory, two threads, Zen 3): 1.13x the 16-lane code's speed.

// Lane r = q . k[r] for 8 keys: 8 independent accumulator chains, the query loaded once per vector.
inline __m256 Dot8Keys(const float* q, const float* const* k, int64_t d) {
  __m256 acc[8];
  UNROLL for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; e += 8) {
    const __m256 qv = _mm256_loadu_ps(q + e);
    UNROLL for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[r] + e), acc[r]);
  }
  return SumEach8(acc);
}

// o[i][e0 .. e0 + 8 NV) = alpha[i] * o[i][..] + sum_k p[i * ps_i + k] * v[k][..] for R rows: R x NV
// accumulators (at most 12) stay in registers over the keys, V's vectors are memory operands.
template <int R, int NV>
void PvTile8(const float* p, int64_t ps_i, const float* alpha, const float* const* v, int64_t nk, float* o,
             int64_t ldo, int64_t e0) {
  __m256 acc[R][NV];
  UNROLL for (int i = 0; i < R; ++i)
    UNROLL for (int n = 0; n < NV; ++n)
      acc[i][n] = _mm256_mul_ps(_mm256_loadu_ps(o + i * ldo + e0 + 8 * n), _mm256_set1_ps(alpha[i]));
  for (int64_t k = 0; k < nk; ++k) {
    const float* vk = v[k] + e0;
    UNROLL for (int i = 0; i < R; ++i) {
      const __m256 pk = _mm256_broadcast_ss(p + i * ps_i + k);
      UNROLL for (int n = 0; n < NV; ++n) acc[i][n] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vk + 8 * n), acc[i][n]);
    }
  }
  UNROLL for (int i = 0; i < R; ++i)
    UNROLL for (int n = 0; n < NV; ++n) _mm256_storeu_ps(o + i * ldo + e0 + 8 * n, acc[i][n]);
}

template <int R>
void PvRows8(const float* p, int64_t ps_i, const float* alpha, const float* const* v, int64_t nk, float* o,
             int64_t ldo, int64_t d) {
  constexpr int kVecs = R == 1 ? 4 : 12 / R;  // 4, 6, 4 vectors for 1, 2, 3 rows
  int64_t e0 = 0;
  for (; e0 + 8 * kVecs <= d; e0 += 8 * kVecs) PvTile8<R, kVecs>(p, ps_i, alpha, v, nk, o, ldo, e0);
  for (; e0 < d; e0 += 8) PvTile8<R, 1>(p, ps_i, alpha, v, nk, o, ldo, e0);
}

// A decode row's P @ V for `rows` query rows (p[i * ps_i + k]), in groups of up to 3.
void DecodePv8(const float* p, int64_t ps_i, const float* alpha, const float* const* v, int64_t nk, float* o,
               int64_t ldo, int64_t rows, int64_t d) {
  for (int64_t i = 0; i < rows; i += 3) {
    switch (std::min<int64_t>(3, rows - i)) {
      case 1: PvRows8<1>(p + i * ps_i, ps_i, alpha + i, v, nk, o + i * ldo, ldo, d); break;
      case 2: PvRows8<2>(p + i * ps_i, ps_i, alpha + i, v, nk, o + i * ldo, ldo, d); break;
      default: PvRows8<3>(p + i * ps_i, ps_i, alpha + i, v, nk, o + i * ldo, ldo, d); break;
    }
  }
}
#endif

// Lane r = q . k[r] for 16 keys, in blocks of up to 8 vectors of the head dimension.
Vec Scores16(const Problem& p, const float* q, const float* const* k) {
#if JAXPAGED_AVX2
  if (p.d % 8 == 0) return {Dot8Keys(q, k, p.d), Dot8Keys(q, k + 8, p.d)};
#endif
  const int64_t nvec = p.dpad / kLanes;
  Vec x = Zero();
  for (int64_t v0 = 0; v0 < nvec; v0 += 8) {
    const int64_t nv = std::min<int64_t>(8, nvec - v0);
    const Mask tail = v0 + nv == nvec ? FirstLanes(p.d - (nvec - 1) * kLanes) : Mask(0xFFFF);
    switch (nv) {
      case 1: x = Add(x, DotBlock<1>(q, k, v0, tail)); break;
      case 2: x = Add(x, DotBlock<2>(q, k, v0, tail)); break;
      case 3: x = Add(x, DotBlock<3>(q, k, v0, tail)); break;
      case 4: x = Add(x, DotBlock<4>(q, k, v0, tail)); break;
      case 5: x = Add(x, DotBlock<5>(q, k, v0, tail)); break;
      case 6: x = Add(x, DotBlock<6>(q, k, v0, tail)); break;
      case 7: x = Add(x, DotBlock<7>(q, k, v0, tail)); break;
      default: x = Add(x, DotBlock<8>(q, k, v0, tail)); break;
    }
  }
  return x;
}

#if JAXPAGED_AVX512 && defined(__AVX512BF16__)
#define JAXPAGED_BF16_DOT 1
// Lane r = q . k[r] for 16 keys, q and keys in bfloat16 as stored (d elements each), by vdpbf16ps:
// 32 products per instruction summed in float32, with no widening pass over the keys.
inline Vec Scores16(const Problem& p, const uint16_t* q, const uint16_t* const* k) {
  Vec acc[kDecodeKeys];
  UNROLL for (int r = 0; r < kDecodeKeys; ++r) acc[r] = Zero();
  for (int64_t e = 0; e < p.d; e += 32) {
    const __mmask32 m = p.d - e >= 32 ? ~__mmask32{0} : (__mmask32{1} << (p.d - e)) - 1;
    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + e);
    UNROLL for (int r = 0; r < kDecodeKeys; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k[r] + e));
  }
  return SumEach16(acc);
}
#else
#define JAXPAGED_BF16_DOT 0
#endif

// ------------------------------------------------------------------------------ prefill tile
// (one kv head, see MakePlan)

template <typename T>
void TileItem(const Problem& p, const WorkItem& w, const T* q, const T* k_layer, const T* v_layer, T* out,
              Scratch& sc) {
  const int64_t g = p.g, d = p.d, h = w.h0, nt = w.t1 - w.t0, rows = nt * g;
  const int64_t nqv = (rows + kLanes - 1) / kLanes, ld = nqv * kLanes;  // rows padded to whole vectors
  const int64_t pos0 = p.Position(w.row, w.t0);
  const int32_t* table = p.block_tables + w.row * p.width;
  // qt: scaled queries transposed, qt[e][t * g + j]; lane i sees keys [lo[i], pos[i]] (padding
  // lanes none; positions as floats, exact below 2^24); m, l: running max and sum; s: scores,
  // then probabilities, s[key][lane].
  const auto [qt, pos, lo, m, l, alpha, s, o, kbuf, vbuf] =
      sc.Carve({d * ld, ld, ld, ld, ld, ld, kTileKeys * ld, rows * p.dpad, kTileKeys * p.dpad, kTileKeys * p.dpad});
  const T* krows[kTileKeys];
  const T* vrows[kTileKeys];
  const float* kr[kTileKeys];
  const float* vr[kTileKeys];

  for (int64_t i = 0; i < ld; ++i) {
    pos[i] = i < rows ? static_cast<float>(pos0 + i / g) : -1.f;
    lo[i] = i < rows ? static_cast<float>(p.FirstKey(pos0 + i / g)) : 0.f;
  }
  const int64_t first_full = p.FirstKey(pos0 + nt - 1);  // keys [first_full, pos0] are seen by every row

  const T* src[kTileRows];
  for (int64_t i = 0; i < rows; ++i) src[i] = q + ((w.t0 + i / g) * p.hq + h * g + i % g) * d;
  for (int64_t i0 = 0; i0 < ld; i0 += kLanes)
    for (int64_t e0 = 0; e0 < d; e0 += kLanes) {
      Vec r[kLanes];
      UNROLL for (int i = 0; i < kLanes; ++i)
        r[i] = i0 + i < rows ? Mul(LoadMasked(src[i0 + i] + e0, FirstLanes(d - e0)), Set1(p.scale)) : Zero();
      Transpose16(r);
      for (int64_t e = 0; e < std::min<int64_t>(kLanes, d - e0); ++e) Store(qt + (e0 + e) * ld + i0, r[e]);
    }
  std::fill(m, m + ld, kNegInf);
  std::fill(l, l + ld, 0.f);
  std::fill(o, o + rows * p.dpad, 0.f);
  for (int64_t c = w.k0; c < w.k1; c += kTileKeys) {
    const int64_t nk = std::min<int64_t>(kTileKeys, w.k1 - c);
    KeyRows<kTileKeys>(p, table, k_layer, v_layer, c, nk, krows, vrows);
    HeadRows<kTileKeys>(p, krows, nk, h * d, kbuf, kr);
    HeadRows<kTileKeys>(p, vrows, nk, h * d, vbuf, vr);
    for (int64_t r0 = 0; r0 < nk; r0 += kScoreKeys)
      for (int64_t v0 = 0; v0 < nqv; v0 += kScoreQueryVecs) {
        float* dst = s + r0 * ld + v0 * kLanes;
        switch (std::min<int64_t>(kScoreQueryVecs, nqv - v0)) {
          case 1: ScoreTile<1>(qt + v0 * kLanes, ld, kr + r0, d, dst, ld); break;
          case 2: ScoreTile<2>(qt + v0 * kLanes, ld, kr + r0, d, dst, ld); break;
          default: ScoreTile<3>(qt + v0 * kLanes, ld, kr + r0, d, dst, ld); break;
        }
      }
    const bool masked = c < first_full || c + nk - 1 > pos0;  // the causal diagonal or the window's edge
    // Online softmax, vertically: each lane is one query row.
    for (int64_t v0 = 0; v0 < ld; v0 += kLanes) {
      const Vec vpos = Load(pos + v0), vlo = Load(lo + v0), m_old = Load(m + v0);
      Vec mx = m_old;
      for (int64_t k = 0; k < nk; ++k) {
        Vec x = Load(s + k * ld + v0);
        if (p.soft_cap > 0.f) x = SoftCap(x, p.soft_cap);
        if (masked) {
          const Vec key = Set1(static_cast<float>(c + k));
          x = Select(LessEqual(key, vpos) & LessEqual(vlo, key), x, Set1(kNegInf));
        }
        if (masked || p.soft_cap > 0.f) Store(s + k * ld + v0, x);
        mx = Max(mx, x);
      }
      const Vec base = Select(LessEqual(mx, Set1(kNegInf)), Zero(), mx);  // no key seen yet: any base
      const Vec a = Exp(Sub(m_old, base));
      Vec sum = Zero();
      for (int64_t k = 0; k < nk; ++k) {
        const Vec e = Exp(Sub(Load(s + k * ld + v0), base));
        Store(s + k * ld + v0, e);
        sum = Add(sum, e);
      }
      Store(alpha + v0, a);
      Store(l + v0, Fma(Load(l + v0), a, sum));
      Store(m + v0, mx);
    }
    AccumulatePv(p, s, ld, 1, alpha, vr, nk, o, rows, kTilePvVecs);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    T* dst = out + ((w.t0 + i / g) * p.hq + h * g + i % g) * d;
    for (int64_t e = 0; e < d; ++e) FromF32(o[i * p.dpad + e] * inv, dst + e);
  }
}

// ------------------------------------------------------------------------------ decode

// Softmax state of one query row: running max, sum of exponentials, unnormalized output.
inline int64_t PartSize(const Problem& p) { return p.hq * (p.dpad + 2); }

template <typename T>
void DecodeItem(const Problem& p, const WorkItem& w, const T* q, const T* k_layer, const T* v_layer, T* out,
                float* parts, Scratch& sc) {
  const int64_t g = p.g, d = p.d, dpad = p.dpad;
  const int64_t rows = (w.h1 - w.h0) * g, row0 = w.h0 * g;  // query heads [row0, row0 + rows)
  const int32_t* table = p.block_tables + w.row * p.width;
  // qs: scaled queries zero-padded to dpad; s: probabilities s[row][key]; m, l, alpha, sum are
  // read in whole vectors (Carve rounds their sizes up).
  const auto [qs, m, l, alpha, sum, s, o, kbuf, vbuf] = sc.Carve(
      {rows * dpad, rows, rows, rows, rows, rows * kDecodeKeys, rows * dpad, kDecodeKeys * dpad, kDecodeKeys * dpad});
  // bfloat16 with AVX512-BF16: queries and keys are multiplied as stored, the scores scaled after.
  constexpr bool bf16_dot = JAXPAGED_BF16_DOT && std::is_same_v<T, uint16_t>;
  const T* q_rows = q + (w.t0 * p.hq + row0) * d;
  if (!bf16_dot)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t e = 0; e < dpad; e += kLanes)
        Store(qs + i * dpad + e, Mul(LoadMasked(q_rows + i * d + e, FirstLanes(d - e)), Set1(p.scale)));
  const int64_t rows_padded = (rows + kLanes - 1) / kLanes * kLanes;
  std::fill(m, m + rows_padded, kNegInf);
  std::fill(l, l + rows_padded, 0.f);
  std::fill(alpha, alpha + rows_padded, 0.f);
  std::fill(sum, sum + rows_padded, 0.f);
  std::fill(o, o + rows * dpad, 0.f);

  const T* krows[kDecodeKeys];
  const T* vrows[kDecodeKeys];
  const T* knext[kDecodeKeys];
  const T* vnext[kDecodeKeys];
  const float* kr[kDecodeKeys];
  const float* vr[kDecodeKeys];
  if (w.k0 < w.k1)
    KeyRows<kDecodeKeys>(p, table, k_layer, v_layer, w.k0, std::min<int64_t>(kDecodeKeys, w.k1 - w.k0), knext, vnext);
  for (int64_t c = w.k0; c < w.k1; c += kDecodeKeys) {
    const int64_t nk = std::min<int64_t>(kDecodeKeys, w.k1 - c);
    const int64_t nn = std::clamp<int64_t>(w.k1 - c - kDecodeKeys, 0, kDecodeKeys);  // keys in the next chunk
    std::copy(knext, knext + kDecodeKeys, krows);
    std::copy(vnext, vnext + kDecodeKeys, vrows);
    if (nn > 0) KeyRows<kDecodeKeys>(p, table, k_layer, v_layer, c + kDecodeKeys, nn, knext, vnext);
    // The next chunk is usually another page: fetch its K and V rows into L2 meanwhile, a few lines
    // before each score row and each head's P @ V, so that the misses overlap this chunk's arithmetic
    // (in bursts of a head's part, or all at once, the prefetches fill the miss queue and stall the
    // loop: 32 rows x 256 keys from memory on one thread, 1.4x faster spread).
    const char* next_rows[2 * kDecodeKeys];  // K rows, then V rows, from kv head h0
    for (int64_t i = 0; i < nn; ++i) {
      next_rows[i] = reinterpret_cast<const char*>(knext[i] + w.h0 * d);
      next_rows[nn + i] = reinterpret_cast<const char*>(vnext[i] + w.h0 * d);
    }
    const int64_t row_lines = ((w.h1 - w.h0) * d * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    const int64_t lines_per_point = (2 * nn * row_lines + rows + w.h1 - w.h0 - 1) / (rows + w.h1 - w.h0);
    int64_t next_row = 0, next_line = 0;
    auto prefetch_next = [&] {
      for (int64_t n = 0; n < lines_per_point && next_row < 2 * nn; ++n) {
        Prefetch(next_rows[next_row] + 64 * next_line);
        if (++next_line == row_lines) next_line = 0, ++next_row;
      }
    };
    for (int64_t h = w.h0; h < w.h1; ++h) {
      if constexpr (bf16_dot) {
#if JAXPAGED_BF16_DOT
        const T* kh[kDecodeKeys];  // keys past nk repeat the first (their scores are masked below)
        for (int64_t i = 0; i < kDecodeKeys; ++i) kh[i] = krows[i < nk ? i : 0] + h * d;
        for (int64_t i = (h - w.h0) * g; i < (h - w.h0 + 1) * g; ++i) {
          prefetch_next();
          Store(s + i * kDecodeKeys, Mul(Scores16(p, q_rows + i * d, kh), Set1(p.scale)));
        }
#endif
      } else {
        HeadRows<kDecodeKeys>(p, krows, nk, h * d, kbuf, kr);
        for (int64_t i = (h - w.h0) * g; i < (h - w.h0 + 1) * g; ++i) {
          prefetch_next();
          Store(s + i * kDecodeKeys, Scores16(p, qs + i * dpad, kr));
        }
      }
    }
    // Online softmax of every row at once: independent chains of horizontal reductions overlap,
    // and the rescaling factors are exponentiated 16 rows at a time.
    const Mask live = FirstLanes(nk);
    for (int64_t i = 0; i < rows; ++i) {
      Vec x = Load(s + i * kDecodeKeys);
      if (p.soft_cap > 0.f) x = SoftCap(x, p.soft_cap);
      x = Select(live, x, Set1(kNegInf));
      const float mx = std::max(m[i], ReduceMax(x));
      const Vec e = Exp(Sub(x, Set1(mx)));
      Store(s + i * kDecodeKeys, e);
      alpha[i] = m[i] - mx;
      sum[i] = ReduceAdd(e);
      m[i] = mx;
    }
    for (int64_t i = 0; i < rows; i += kLanes) {
      const Vec a = Exp(Load(alpha + i));
      Store(alpha + i, a);
      Store(l + i, Fma(Load(l + i), a, Load(sum + i)));
    }
    for (int64_t h = w.h0; h < w.h1; ++h) {
      const int64_t i0 = (h - w.h0) * g;
      prefetch_next();
      HeadRows<kDecodeKeys>(p, vrows, nk, h * d, vbuf, vr);
#if JAXPAGED_AVX2
      if (d % 8 == 0) {
        DecodePv8(s + i0 * kDecodeKeys, kDecodeKeys, alpha + i0, vr, nk, o + i0 * dpad, dpad, g, d);
        continue;
      }
#endif
      AccumulatePv(p, s + i0 * kDecodeKeys, 1, kDecodeKeys, alpha + i0, vr, nk, o + i0 * dpad, g, kDecodePvVecs);
    }
  }
  if (w.part >= 0) {
    float* part = parts + w.part * PartSize(p);
    std::copy(m, m + rows, part + row0);
    std::copy(l, l + rows, part + p.hq + row0);
    std::copy(o, o + rows * dpad, part + 2 * p.hq + row0 * dpad);
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    T* dst = out + (w.t0 * p.hq + row0 + i) * d;
    for (int64_t e = 0; e < d; ++e) FromF32(o[i * dpad + e] * inv, dst + e);
  }
}

// Combines the softmax states of a row's key ranges into its output row.
template <typename T>
void MergeParts(const Problem& p, const float* parts, int64_t count, T* out) {
  const int64_t size = PartSize(p);
  for (int64_t i = 0; i < p.hq; ++i) {
    float mx = kNegInf;
    for (int64_t s = 0; s < count; ++s) mx = std::max(mx, parts[s * size + i]);
    std::vector<float> acc(p.d, 0.f);
    float sum = 0.f;
    for (int64_t s = 0; s < count; ++s) {
      const float* part = parts + s * size;
      const float f = std::exp(part[i] - mx);
      sum += f * part[p.hq + i];
      for (int64_t e = 0; e < p.d; ++e) acc[e] += f * part[2 * p.hq + i * p.dpad + e];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t e = 0; e < p.d; ++e) FromF32(acc[e] * inv, out + i * p.d + e);
  }
}

// ------------------------------------------------------------------------------ scheduling

// Work items of every live row, largest first, plus (first part, count, token) of each split
// decode row, and how many threads to run them on.
struct Plan {
  std::vector<WorkItem> items;
  int64_t threads = 1;
  struct Split {
    int32_t part, count, token;
  };
  std::vector<Split> splits;
  int32_t num_parts = 0;
};

Plan MakePlan(const Problem& p, int64_t rows, int64_t workers) {
  Plan plan;
  std::vector<WorkItem> decode;
  double total = 0.;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t start = p.qsl[r], end = p.qsl[r + 1];
    if (p.seq_lens[r] <= 0 || end <= start) continue;
    for (int32_t t0 = start; t0 < end; t0 += p.tile_tokens) {
      const int32_t t1 = std::min<int32_t>(end, t0 + p.tile_tokens);
      const int64_t k1 = std::max<int64_t>(0, p.Position(r, t1 - 1) + 1);
      const int32_t k0 = static_cast<int32_t>(std::min(k1, p.FirstKey(p.Position(r, t0))));
      const int64_t nkeys = k1 - k0;
      if (t1 - t0 == 1) {  // a decode row: per key and kv head, scores and P @ V for G queries and its K/V bytes
        const double per_key = p.hkv * (2 * p.g * p.dpad / kLanes + 2 * p.d * p.kv_bytes * kCyclesPerKvByte);
        const WorkItem w{static_cast<int32_t>(r), t0, t1, 0, static_cast<int32_t>(p.hkv), k0,
                         static_cast<int32_t>(k1), -1, nkeys * per_key + 1000.};
        decode.push_back(w);
        total += w.cost;
        continue;
      }
      const int64_t nqv = ((t1 - t0) * p.g + kLanes - 1) / kLanes;
      for (int32_t h = 0; h < p.hkv; ++h) {  // per key, D FMAs per query vector for S^T and as many for P @ V
        plan.items.push_back({static_cast<int32_t>(r), t0, t1, h, h + 1, k0, static_cast<int32_t>(k1), -1,
                              static_cast<double>(nkeys * nqv * 2 * p.d) + 1000.});
        total += plan.items.back().cost;
      }
    }
  }
  plan.threads = total >= kParallelCost ? workers : 1;
  // Long decode rows are split into key ranges (multiples of kDecodeKeys) until every item is at most
  // 1/4 of a thread's share, so that a batch of few rows still keeps every thread busy.
  const double limit = total / (4. * plan.threads);
  for (const WorkItem& w : decode) {
    const int64_t nkeys = w.k1 - w.k0;
    const int64_t pieces =
        plan.threads > 1 ? std::min<int64_t>(static_cast<int64_t>(w.cost / limit), nkeys / kMinSplitKeys) : 1;
    if (pieces <= 1) {
      plan.items.push_back(w);
      continue;
    }
    const int64_t step = (nkeys / pieces + kDecodeKeys - 1) / kDecodeKeys * kDecodeKeys;
    const int32_t first = plan.num_parts;
    for (int64_t k = w.k0; k < w.k1; k += step) {
      WorkItem piece = w;
      piece.k0 = static_cast<int32_t>(k);
      piece.k1 = static_cast<int32_t>(std::min<int64_t>(w.k1, k + step));
      piece.part = plan.num_parts++;
      piece.cost = w.cost * (piece.k1 - piece.k0) / nkeys;
      plan.items.push_back(piece);
    }
    plan.splits.push_back({first, plan.num_parts - first, w.t0});
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return plan;
}

// Items are claimed from an atomic counter by the caller and by pool tasks; the caller returns
// once every item is done. Tasks that start late find nothing left and only touch `state`.
struct SharedState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename T>
void RunAll(const Problem& p, const Plan& plan, const T* q, const T* k_layer, const T* v_layer, T* out,
            ffi::ThreadPool pool) {
  auto state = std::make_shared<SharedState>();
  const std::vector<WorkItem>& items = plan.items;
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<float> parts(plan.num_parts * PartSize(p));
  auto work = [state, &p, &items, q, k_layer, v_layer, out, n, parts = parts.data()]() {
    Scratch scratch;
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) {
      if (items[i].t1 - items[i].t0 == 1)
        DecodeItem(p, items[i], q, k_layer, v_layer, out, parts, scratch);
      else
        TileItem(p, items[i], q, k_layer, v_layer, out, scratch);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(plan.threads, n) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state, work, n]() {
      if (state->next.load() < n) work();
    });
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  for (const Plan::Split& s : plan.splits)
    MergeParts(p, parts.data() + s.part * PartSize(p), s.count, out + s.token * p.hq * p.d);
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages,
                              ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Result<ffi::AnyBuffer> out, float scale, int64_t sliding_window,
                              float soft_cap) {
  const auto qd = q.dimensions();
  const auto kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 6 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged_attention_cpu: expected q[T,Hq,D], kv_pages[L,2,N,bs,Hkv,D], "
                                       "block_tables[R,W]");
  if (q.element_type() != kv_pages.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged_attention_cpu: q, kv_pages and out must share a dtype");
  Problem p;
  const int64_t num_tokens = qd[0];
  p.hq = qd[1];
  p.d = qd[2];
  const int64_t num_blocks = kd[2];
  p.block_size = kd[3];
  p.hkv = kd[4];
  p.kv_bytes = ffi::ByteWidth(kv_pages.element_type());
  p.width = block_tables.dimensions()[1];
  const int64_t layer_index = layer.typed_data()[0];
  p.block_tables = block_tables.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.qsl = query_start_loc.typed_data();
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  if (p.hkv <= 0 || p.hq % p.hkv != 0 || kd[5] != p.d || p.d <= 0 || layer_index < 0 || layer_index >= kd[0])
    return ffi::Error::InvalidArgument("paged_attention_cpu: inconsistent head counts, head_dim or layer");
  p.g = p.hq / p.hkv;
  p.dpad = (p.d + kLanes - 1) / kLanes * kLanes;
  p.tile_tokens = std::max<int64_t>(1, kTileRows / p.g);
  const int64_t rows = seq_lens.dimensions()[0];

  // Padding tokens, and any tokens of rows without context, get zeros.
  const int64_t row_bytes = p.hq * p.d * ffi::ByteWidth(q.element_type());
  char* out_bytes = static_cast<char*>(out->untyped_data());
  auto zero_tokens = [&](int64_t t0, int64_t t1) {
    t0 = std::clamp<int64_t>(t0, 0, num_tokens);
    t1 = std::clamp<int64_t>(t1, t0, num_tokens);
    std::memset(out_bytes + t0 * row_bytes, 0, (t1 - t0) * row_bytes);
  };
  zero_tokens(rows > 0 ? p.qsl[rows] : 0, num_tokens);
  for (int64_t r = 0; r < rows; ++r)
    if (p.seq_lens[r] <= 0) zero_tokens(p.qsl[r], p.qsl[r + 1]);

  const Plan plan = MakePlan(p, rows, std::max<int64_t>(1, pool.num_threads()));
  const int64_t layer_stride = 2 * num_blocks * p.block_size * p.hkv * p.d;
  const int64_t kv_stride = layer_stride / 2;
  switch (q.element_type()) {
    case ffi::DataType::F32: {
      const float* kv = static_cast<const float*>(kv_pages.untyped_data()) + layer_index * layer_stride;
      RunAll(p, plan, static_cast<const float*>(q.untyped_data()), kv, kv + kv_stride,
             static_cast<float*>(out->untyped_data()), pool);
      break;
    }
    case ffi::DataType::BF16: {
      const uint16_t* kv = static_cast<const uint16_t*>(kv_pages.untyped_data()) + layer_index * layer_stride;
      RunAll(p, plan, static_cast<const uint16_t*>(q.untyped_data()), kv, kv + kv_stride,
             static_cast<uint16_t*>(out->untyped_data()), pool);
      break;
    }
    default:
      return ffi::Error::InvalidArgument("paged_attention_cpu: only float32 and bfloat16 are supported");
  }
  return ffi::Error::Success();
}

// Stores one layer's new K and V rows (k, v[T, Hkv, D]) at their flat slots of the page array,
// in place: the result is the page array itself (aliased to the input by the caller), so a step
// writes T rows instead of XLA's scatter, which for bfloat16 converts the whole pool to float32
// and back. Slots < 0 or past the pool are padding and write nothing.
ffi::Error WriteKvImpl(ffi::AnyBuffer kv_pages, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out) {
  const auto kd = kv_pages.dimensions();
  const auto td = k.dimensions();
  const auto vd = v.dimensions();
  if (kd.size() != 6 || td.size() != 3 || vd.size() != 3 || !std::equal(td.begin(), td.end(), vd.begin()) ||
      td[1] != kd[4] || td[2] != kd[5] || slot_mapping.dimensions().size() != 1 ||
      slot_mapping.dimensions()[0] != td[0])
    return ffi::Error::InvalidArgument("write_kv_cpu: expected kv_pages[L,2,N,bs,Hkv,D], k and v [T,Hkv,D], "
                                       "slot_mapping[T]");
  if (k.element_type() != kv_pages.element_type() || v.element_type() != kv_pages.element_type())
    return ffi::Error::InvalidArgument("write_kv_cpu: k, v and kv_pages must share a dtype");
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= kd[0])
    return ffi::Error::InvalidArgument("write_kv_cpu: layer out of range");
  char* pages = static_cast<char*>(out->untyped_data());
  if (pages != kv_pages.untyped_data())  // not aliased (XLA kept the input alive): start from a copy
    std::memcpy(pages, kv_pages.untyped_data(), kv_pages.size_bytes());
  const int64_t row_bytes = td[1] * td[2] * ffi::ByteWidth(k.element_type());
  const int64_t num_slots = kd[2] * kd[3];
  const int64_t half = num_slots * row_bytes;  // K (or V) part of one layer
  char* k_dst = pages + layer_index * 2 * half;
  const char* k_src = static_cast<const char*>(k.untyped_data());
  const char* v_src = static_cast<const char*>(v.untyped_data());
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < td[0]; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) continue;
    std::memcpy(k_dst + s * row_bytes, k_src + t * row_bytes, row_bytes);
    std::memcpy(k_dst + half + s * row_bytes, v_src + t * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedWriteKvCpu, WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
