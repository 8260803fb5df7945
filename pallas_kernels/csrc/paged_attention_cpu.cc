// Ragged paged attention for the CPU, called from XLA through the FFI.
//
// Same contract as pallas_kernels/reference.py: flat ragged queries q[T, Hq, D] attend to
// their row's pages of kv_pages[L, 2, num_blocks, block_size, Hkv, D] at layer `layer`.
// The pages are read in place (no gather copy), each row only up to its own length, and
// the work (row, kv head, query tile) is spread over XLA's intra-op thread pool.
// Per work item: the tile's G * tile queries score every key of the row once (a K row is
// loaded once and reused for all of them), then softmax in float32, then P @ V.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryTile = 16;  // prefill tokens per work item

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float Convert(uint16_t x, float*) { return Bf16ToF32(x); }
inline uint16_t Convert(float x, uint16_t*) { return F32ToBf16(x); }

// A row of `n` values from `Src` to `Dst` (float32 <-> bfloat16 bits, or a plain copy).
template <typename Src, typename Dst>
inline void ConvertRow(const Src* src, Dst* dst, int64_t n) {
  if constexpr (std::is_same_v<Src, Dst>) {
    std::memcpy(dst, src, n * sizeof(Src));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = Convert(src[i], static_cast<Dst*>(nullptr));
  }
}

// A cached K or V row as float32: the page memory itself for float32, else converted into `buf`.
template <typename T>
inline const float* CacheRow(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    ConvertRow(src, buf, n);
    return buf;
  }
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void Axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

struct WorkItem {
  int32_t row, t0, t1, head;
};

struct Problem {
  int64_t hq, hkv, d, block_size, num_blocks, width;
  int64_t layer;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* qsl;
  float scale, soft_cap;
  int64_t window;
};

template <typename T>
void RunItem(const Problem& p, const WorkItem& w, const T* q, const T* kv, T* out,
             std::vector<float>& scratch) {
  const int64_t g = p.hq / p.hkv, d = p.d;
  const int64_t nt = w.t1 - w.t0, nq = nt * g;
  const int64_t seq_len = p.seq_lens[w.row], end = p.qsl[w.row + 1];
  const int64_t pos0 = seq_len - (end - w.t0);  // position of the tile's first token
  const int64_t kmax = pos0 + nt;               // keys [kmin, kmax) cover every query of the tile
  const int64_t kmin = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
  const int64_t nk = kmax - kmin;
  scratch.resize(nq * d * 2 + nq * nk + d);
  float* qf = scratch.data();
  float* acc = qf + nq * d;
  float* s = acc + nq * d;
  float* kf = s + nq * nk;
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t j = 0; j < g; ++j) {
      float* dst = qf + (t * g + j) * d;
      ConvertRow(q + ((w.t0 + t) * p.hq + w.head * g + j) * d, dst, d);
      for (int64_t i = 0; i < d; ++i) dst[i] *= p.scale;
    }
  const int32_t* table = p.block_tables + w.row * p.width;
  const int64_t page_stride = p.block_size * p.hkv * d;
  const T* k_base = kv + (p.layer * 2 + 0) * p.num_blocks * page_stride + w.head * d;
  const T* v_base = kv + (p.layer * 2 + 1) * p.num_blocks * page_stride + w.head * d;
  const int64_t row_stride = p.hkv * d;
  // Visits keys [kmin, kmax) in order, block by block (no division per key): f(k, offset of its row).
  auto for_each_key = [&](auto&& f) {
    for (int64_t b = kmin / p.block_size; b * p.block_size < kmax; ++b) {
      const int64_t page = table[b] * page_stride;
      const int64_t lo = std::max(kmin, b * p.block_size), hi = std::min(kmax, (b + 1) * p.block_size);
      for (int64_t k = lo; k < hi; ++k) f(k, page + (k - b * p.block_size) * row_stride);
    }
  };

  for_each_key([&](int64_t k, int64_t offset) {
    const float* kr = CacheRow(k_base + offset, kf, d);
    for (int64_t i = 0; i < nq; ++i) s[i * nk + (k - kmin)] = Dot(qf + i * d, kr, d);
  });
  std::memset(acc, 0, nq * d * sizeof(float));
  std::vector<float> denom(nq);
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t pos = pos0 + i / g;
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    float* si = s + i * nk;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t k = kmin; k < kmax; ++k) {
      float& x = si[k - kmin];
      if (k > pos || k < lo) {
        x = -std::numeric_limits<float>::infinity();
        continue;
      }
      if (p.soft_cap > 0.f) x = p.soft_cap * std::tanh(x / p.soft_cap);
      m = std::max(m, x);
    }
    float sum = 0.f;
    for (int64_t k = 0; k < nk; ++k) {
      const float e = si[k] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(si[k] - m);
      si[k] = e;
      sum += e;
    }
    denom[i] = sum;
  }
  for_each_key([&](int64_t k, int64_t offset) {
    const float* vr = CacheRow(v_base + offset, kf, d);
    for (int64_t i = 0; i < nq; ++i) {
      const float pk = s[i * nk + (k - kmin)];
      if (pk != 0.f) Axpy(pk, vr, acc + i * d, d);
    }
  });
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t i = t * g + j;
      const float inv = denom[i] > 0.f ? 1.f / denom[i] : 0.f;
      for (int64_t e = 0; e < d; ++e) acc[i * d + e] *= inv;
      ConvertRow(acc + i * d, out + ((w.t0 + t) * p.hq + w.head * g + j) * d, d);
    }
}

// Items are claimed from an atomic counter by the caller and by pool tasks; the caller returns
// once every item is done. Tasks that start late find nothing left and only touch `state`.
struct SharedState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename T>
void RunAll(const Problem& p, const std::vector<WorkItem>& items, const T* q, const T* kv, T* out,
            ffi::ThreadPool pool) {
  auto state = std::make_shared<SharedState>();
  const int64_t n = static_cast<int64_t>(items.size());
  auto work = [state, &p, &items, q, kv, out, n]() {
    std::vector<float> scratch;
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) {
      RunItem(p, items[i], q, kv, out, scratch);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state, work, n]() {
      if (state->next.load() < n) work();
    });
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
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
  p.num_blocks = kd[2];
  p.block_size = kd[3];
  p.hkv = kd[4];
  p.width = block_tables.dimensions()[1];
  p.layer = layer.typed_data()[0];
  p.block_tables = block_tables.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.qsl = query_start_loc.typed_data();
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  if (p.hq % p.hkv != 0 || kd[5] != p.d || p.layer < 0 || p.layer >= kd[0])
    return ffi::Error::InvalidArgument("paged_attention_cpu: inconsistent head counts, head_dim or layer");
  const int64_t rows = seq_lens.dimensions()[0];

  std::vector<WorkItem> items;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t start = p.qsl[r], end = p.qsl[r + 1];
    if (p.seq_lens[r] <= 0 || end <= start) continue;
    for (int32_t t0 = start; t0 < end; t0 += kQueryTile)
      for (int32_t h = 0; h < p.hkv; ++h)
        items.push_back({static_cast<int32_t>(r), t0, std::min<int32_t>(end, t0 + kQueryTile), h});
  }
  // Tokens outside every row (padding) get zeros.
  const int64_t used = rows > 0 ? std::clamp<int64_t>(p.qsl[rows], 0, num_tokens) : 0;
  const int64_t row_bytes = p.hq * p.d * ffi::ByteWidth(q.element_type());
  std::memset(static_cast<char*>(out->untyped_data()) + used * row_bytes, 0, (num_tokens - used) * row_bytes);

  switch (q.element_type()) {
    case ffi::DataType::F32:
      RunAll(p, items, static_cast<const float*>(q.untyped_data()),
             static_cast<const float*>(kv_pages.untyped_data()), static_cast<float*>(out->untyped_data()), pool);
      break;
    case ffi::DataType::BF16:
      RunAll(p, items, static_cast<const uint16_t*>(q.untyped_data()),
             static_cast<const uint16_t*>(kv_pages.untyped_data()), static_cast<uint16_t*>(out->untyped_data()),
             pool);
      break;
    default:
      return ffi::Error::InvalidArgument("paged_attention_cpu: only float32 and bfloat16 are supported");
  }
  return ffi::Error::Success();
}

}  // namespace

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
