// The decoder's per-token elementwise layers for the CPU, called from XLA through the FFI: the rotary
// embedding (with the split of the fused q/k/v projection), RMSNorm (optionally fused with the residual
// add before it) and the gated MLP's SiLU(gate) * up. Each is one pass over its rows, where XLA's CPU fusions take several (a norm is
// a reduction fusion, then a second pass that scales) and run bfloat16 arithmetic as a float32 round
// trip per operation.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <thread>
#include <type_traits>

#include "bf16.h"
#include "stacked.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxpaged::simd;  // NOLINT: the kernels are written in its 16-lane operations
using jaxpaged::Bf16ToF32;
using jaxpaged::LayerWeight;
using jaxpaged::PickLayer;
using jaxpaged::F32ToBf16;

// ------------------------------------------------------------------------------------------ RMSNorm
// x = w * round(s * rsqrt(mean(s * s) + eps)) per row, with s = round(h + delta) (the residual stream
// after the add; s = h without delta), the statistics in float32 and round() to the rows' dtype: the
// roundings of HF's (and the model's XLA) RMSNorm, whose sum of squares differs only in its order.
// Rows past `rows` (a padded batch's padding) come out zero.

// Elements of the rows' dtype T (float, or uint16_t holding bfloat16) as float32, and back (rounded).
inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t x) { return Bf16ToF32(x); }
template <typename T>
inline T FromF32(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return F32ToBf16(x);
}
template <typename T>
inline float Round(float x) { return ToF32(FromF32<T>(x)); }

// Rows are read and written 16 elements at a time as float32 vectors (vec16.h), `m` masking a row's tail.
// With AVX512-BF16 a vector is rounded to bfloat16 in one instruction (nearest even; it treats float32
// denormals as zero, as XLA's CPU runtime does: it runs with denormals flushed).
#if JAXPAGED_AVX512
inline void Store16(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline __m256i ToBf16(Vec v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline void Store16(uint16_t* p, Vec v, Mask m) { _mm256_mask_storeu_epi16(p, m, ToBf16(v)); }
inline Vec Round(Vec v, float) { return v; }  // v rounded to the dtype and back: a no-op for float32
inline Vec Round(Vec v, uint16_t) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ToBf16(v)), 16));
}
#elif JAXPAGED_AVX2
inline void Store16(float* p, Vec v, Mask m) {
  if ((m & 0xFFFF) == 0xFFFF) return Store(p, v);
  _mm256_maskstore_ps(p, LaneMask(m), v.lo);
  _mm256_maskstore_ps(p + 8, LaneMask(m >> 8), v.hi);
}
inline void Store16(uint16_t* p, Vec v, Mask m) {
  const __m256i x = jaxpaged::Bf16x16(v.lo, v.hi);
  if ((m & 0xFFFF) == 0xFFFF) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  alignas(32) uint16_t y[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(y), x);
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1) p[i] = y[i];
}
inline Vec Round(Vec v, float) { return v; }
inline __m256 RoundBf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(jaxpaged::Bf16Lanes(v), 16)); }
inline Vec Round(Vec v, uint16_t) { return {RoundBf16(v.lo), RoundBf16(v.hi)}; }
#else
template <typename T>
inline void Store16(T* p, Vec v, Mask m) {
  float x[kLanes];
  Store(x, v);
  for (int i = 0; i < kLanes; ++i)
    if (m >> i & 1) p[i] = FromF32<T>(x[i]);
}
template <typename T>
inline Vec Round(Vec v, T) {
  float x[kLanes];
  Store(x, v);
  return Map([&](int i) { return Round<T>(x[i]); });
}
#endif

template <typename T>
void NormRow(const T* h, const T* delta, const T* w, T* sum, T* x, int64_t d, float eps) {
  Vec sq0 = Zero(), sq1 = Zero();  // two chains: the adds' latency
  for (int64_t j = 0; j < d; j += 16) {
    const Mask m = FirstLanes(d - j);
    Vec s = LoadMasked(h + j, m);
    if (delta != nullptr) {
      s = Round(Add(s, LoadMasked(delta + j, m)), T{});
      Store16(sum + j, s, m);
    }
    if (j / 16 % 2) sq1 = Fma(s, s, sq1);
    else sq0 = Fma(s, s, sq0);
  }
  if (delta != nullptr) h = sum;
  const Vec r = Set1(1.f / std::sqrt(ReduceAdd(Add(sq0, sq1)) / static_cast<float>(d) + eps));
  for (int64_t j = 0; j < d; j += 16) {
    const Mask m = FirstLanes(d - j);
    Store16(x + j, Mul(LoadMasked(w + j, m), Round(Mul(LoadMasked(h + j, m), r), T{})), m);
  }
}

// y = round(round(silu(g)) * u) with silu(g) = g / (1 + exp(-g)) in float32: the activation rounded
// once to the dtype (as torch's kernels and models.decoder.activate round it), then the product.
template <typename T>
void SiluMulRow(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const Mask m = FirstLanes(n - j);
    const Vec gv = LoadMasked(g + j, m);
    const Vec a = Round(Div(gv, Add(Set1(1.f), Exp(Mul(gv, Set1(-1.f))))), T{});
    Store16(y + j, Mul(a, LoadMasked(u + j, m)), m);
  }
}

// Rows per task when a call is split over the pool: below this many elements in all a call runs on
// the caller's thread alone (waking a pool thread costs more than the pass).
constexpr int64_t kParallelElements = 1 << 16;
constexpr int64_t kRowsPerTask = 32;

// run(r0, r1) over rows [0, rows), split into tasks of kRowsPerTask rows claimed by the caller and
// pool threads when the call is large enough.
template <typename F>
void ForRows(ffi::ThreadPool pool, int64_t rows, int64_t row_elements, F run) {
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  if (rows * row_elements < kParallelElements || tasks < 2 || pool.num_threads() < 1) {
    run(0, rows);
    return;
  }
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto c = std::make_shared<Counters>();
  auto work = [c, run, rows, tasks]() {
    for (int64_t i = c->next.fetch_add(1); i < tasks; i = c->next.fetch_add(1)) {
      run(i * kRowsPerTask, std::min(rows, (i + 1) * kRowsPerTask));
      c->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < std::min<int64_t>(pool.num_threads(), tasks - 1); ++i)
    pool.Schedule([c, work, tasks]() {
      if (c->next.load() < tasks) work();  // late tasks find nothing left
    });
  work();
  while (c->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

// f(T{}) with T the element type of `type` (float32, or bfloat16 held as uint16_t).
template <typename F>
void ForDtype(ffi::DataType type, F f) {
  if (type == ffi::DataType::F32) f(0.f);
  else f(uint16_t{0});
}

// The first `rows` of a [T, ...] buffer's rows are real (an int32 count, clamped); the rest are zeroed.
int64_t RealRowsZeroingRest(ffi::Buffer<ffi::S32> num_rows, std::initializer_list<ffi::AnyBuffer*> outs) {
  const int64_t tokens = outs.size() ? (*outs.begin())->dimensions()[0] : 0;
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, tokens);
  for (ffi::AnyBuffer* out : outs) {
    const size_t row_bytes = out->size_bytes() / std::max<int64_t>(tokens, 1);
    std::memset(static_cast<char*>(out->untyped_data()) + rows * row_bytes, 0, (tokens - rows) * row_bytes);
  }
  return rows;
}

// ------------------------------------------------------------------------------ rotary embeddings
// The fused projection's output qkv[T, (Hq + 2 Hkv) * D] -> q[T, Hq, D] and k[T, Hkv, D] rotated, v[T, Hkv, D]
// copied: y = x * C + swap(x) * S for each head, C and S the step's tables (T x D: (cos, cos) and
// (-sin, sin) per token), swap exchanging the two halves of a head: HF's rotate-half, with torch's
// roundings (each product and the sum rounded to the dtype; no fused multiply-add). One pass over qkv,
// where XLA's CPU backend sliced q, k and v out of it (three copies) before its rotation fusions (in
// bfloat16 4.6-5.9x slower than this kernel's rotation alone).

// One half of a head: y[j] = x[j] * c[j] + partner[j] * s[j], partner being the other half.
template <typename T>
inline void RotateHalf(const T* x, const T* partner, const T* c, const T* s, T* y, int64_t n) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const Mask m = FirstLanes(n - j);
    const Vec a = Round(Mul(LoadMasked(x + j, m), LoadMasked(c + j, m)), T{});
    const Vec b = Round(Mul(LoadMasked(partner + j, m), LoadMasked(s + j, m)), T{});
    Store16(y + j, Add(a, b), m);
  }
}

template <typename T>
inline void RotateHeads(const T* x, const T* c, const T* s, T* y, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, x += d, y += d) {
    RotateHalf(x, x + half, c, s, y, half);
    RotateHalf(x + half, x, c + half, s + half, y + half, half);
  }
}

ffi::Error RopeQkvImpl(ffi::ThreadPool pool, ffi::AnyBuffer qkv, ffi::AnyBuffer cos_table, ffi::AnyBuffer sin_table,
                       ffi::Buffer<ffi::S32> num_rows, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> k,
                       ffi::Result<ffi::AnyBuffer> v) {
  const auto qd = q->dimensions(), kd = k->dimensions(), xd = qkv.dimensions();
  const ffi::DataType type = qkv.element_type();
  const int64_t tokens = xd.size() == 2 ? xd[0] : -1;
  const int64_t d = qd.size() == 3 ? qd[2] : 0;
  if (xd.size() != 2 || qd.size() != 3 || kd.size() != 3 || qd[0] != tokens || kd[0] != tokens || kd[2] != d ||
      d % 2 != 0 || v->element_count() != k->element_count() || xd[1] != (qd[1] + 2 * kd[1]) * d ||
      cos_table.element_count() != static_cast<size_t>(tokens * d) ||
      sin_table.element_count() != cos_table.element_count())
    return ffi::Error::InvalidArgument("rope_qkv_cpu: expected qkv[T,(Hq+2Hkv)*D] (D even), q[T,Hq,D], k and v "
                                       "[T,Hkv,D], tables of T x D elements");
  for (const ffi::DataType t : {cos_table.element_type(), sin_table.element_type(), q->element_type(),
                                k->element_type(), v->element_type()})
    if (t != type || (type != ffi::DataType::F32 && type != ffi::DataType::BF16))
      return ffi::Error::InvalidArgument("rope_qkv_cpu: qkv, the tables and the outputs share a dtype, float32 or "
                                         "bfloat16");
  ffi::AnyBuffer qo = *q, ko = *k, vo = *v;
  const int64_t rows = RealRowsZeroingRest(num_rows, {&qo, &ko, &vo});
  const int64_t hq = qd[1], hkv = kd[1], width = xd[1];
  auto typed = [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(qkv.untyped_data());
    const T* cs = static_cast<const T*>(cos_table.untyped_data());
    const T* ss = static_cast<const T*>(sin_table.untyped_data());
    T* qp = static_cast<T*>(qo.untyped_data());
    T* kp = static_cast<T*>(ko.untyped_data());
    T* vp = static_cast<T*>(vo.untyped_data());
    ForRows(pool, rows, width, [=](int64_t r0, int64_t r1) {
      for (int64_t t = r0; t < r1; ++t) {
        const T* row = x + t * width;
        RotateHeads(row, cs + t * d, ss + t * d, qp + t * hq * d, hq, d);
        RotateHeads(row + hq * d, cs + t * d, ss + t * d, kp + t * hkv * d, hkv, d);
        std::memcpy(vp + t * hkv * d, row + (hq + hkv) * d, hkv * d * sizeof(T));
      }
    });
  };
  ForDtype(type, typed);
  return ffi::Error::Success();
}

// h[T, d], delta (null or like h), w[d] (or [L, d], `layer` picking one); sum (null, or like h: h + delta), x like h.
ffi::Error NormImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, const ffi::AnyBuffer* delta, ffi::AnyBuffer w,
                    ffi::Buffer<ffi::S32> num_rows, ffi::AnyBuffer* sum, ffi::AnyBuffer x, float eps, int64_t layer) {
  const auto hd = h.dimensions();
  const LayerWeight weight = PickLayer(w, 1, layer);
  if (hd.size() != 2 || !weight.ok || weight.dims[0] != hd[1] ||
      (delta != nullptr && delta->element_count() != h.element_count()))
    return ffi::Error::InvalidArgument("rms_norm_cpu: expected h[T,d], a weight [d] (or [L,d] and a layer below L), "
                                       "delta like h");
  const ffi::DataType type = h.element_type();
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16) || w.element_type() != type ||
      x.element_type() != type || (delta != nullptr && delta->element_type() != type))
    return ffi::Error::InvalidArgument("rms_norm_cpu: h, delta, the weight and the outputs share a dtype, "
                                       "float32 or bfloat16");
  const int64_t d = hd[1];
  const int64_t rows = sum ? RealRowsZeroingRest(num_rows, {&x, sum}) : RealRowsZeroingRest(num_rows, {&x});
  auto typed = [&](auto zero) {
    using T = decltype(zero);
    const T* hp = static_cast<const T*>(h.untyped_data());
    const T* dp = delta ? static_cast<const T*>(delta->untyped_data()) : nullptr;
    const T* wp = static_cast<const T*>(weight.data);
    T* sp = sum ? static_cast<T*>(sum->untyped_data()) : nullptr;
    T* xp = static_cast<T*>(x.untyped_data());
    ForRows(pool, rows, d, [=](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        NormRow(hp + r * d, dp ? dp + r * d : nullptr, wp, sp ? sp + r * d : nullptr, xp + r * d, d, eps);
    });
  };
  ForDtype(type, typed);
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> num_rows,
                       ffi::Result<ffi::AnyBuffer> x, float eps, int64_t layer) {
  return NormImpl(pool, h, nullptr, w, num_rows, nullptr, *x, eps, layer);
}

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer h, ffi::AnyBuffer delta, ffi::AnyBuffer w,
                          ffi::Buffer<ffi::S32> num_rows, ffi::Result<ffi::AnyBuffer> sum,
                          ffi::Result<ffi::AnyBuffer> x, float eps, int64_t layer) {
  ffi::AnyBuffer s = *sum;
  return NormImpl(pool, h, &delta, w, num_rows, &s, *x, eps, layer);
}

// gate_up[T, 2n] (the gate's n columns, then the up projection's) -> y[T, n].
ffi::Error SiluMulImpl(ffi::ThreadPool pool, ffi::AnyBuffer gate_up, ffi::Buffer<ffi::S32> num_rows,
                       ffi::Result<ffi::AnyBuffer> y) {
  const auto gd = gate_up.dimensions();
  const ffi::DataType type = gate_up.element_type();
  if (gd.size() != 2 || gd[1] % 2 != 0 || y->element_count() != gate_up.element_count() / 2)
    return ffi::Error::InvalidArgument("silu_and_mul_cpu: expected gate_up[T,2n] and y[T,n]");
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16) || y->element_type() != type)
    return ffi::Error::InvalidArgument("silu_and_mul_cpu: gate_up and y share a dtype, float32 or bfloat16");
  ffi::AnyBuffer out = *y;
  const int64_t rows = RealRowsZeroingRest(num_rows, {&out}), n = gd[1] / 2;
  auto typed = [&](auto zero) {
    using T = decltype(zero);
    const T* g = static_cast<const T*>(gate_up.untyped_data());
    T* yp = static_cast<T*>(out.untyped_data());
    ForRows(pool, rows, 3 * n, [=](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) SiluMulRow(g + 2 * r * n, g + (2 * r + 1) * n, yp + r * n, n);
    });
  };
  ForDtype(type, typed);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRopeQkvCpu, RopeQkvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRmsNormCpu, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedAddRmsNormCpu, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedSiluAndMulCpu, SiluMulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
