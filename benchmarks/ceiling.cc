// The CPU's ceilings and the native float32 matmul against them, outside XLA (built and run by
// benchmarks/ceiling.py, which documents the output):
//   ceiling peak THREADS         fused multiply-add GFLOP/s (12 independent chains per thread)
//   ceiling bandwidth THREADS    GB/s of a streaming read of 1 GiB
//   ceiling gemm COLD K N M...   per M: ms of the dense float32 kernel and of the 4-bit one
//                                (COLD = 1: weights rotated through >= 96 MiB of copies, as a
//                                model's layers leave them in memory)
// The kernels are the package's own (pallas_kernels/csrc/matmul_cpu.cc, compiled into this
// program), on a pool of one helper thread besides the caller, as XLA's two-thread pool gives them.

#include "pallas_kernels/csrc/matmul_cpu.cc"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <string>

namespace {

volatile float g_sink;  // results written here, so the timed loops are not optimized away

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

class HelperPool {
 public:
  explicit HelperPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~HelperPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void Schedule(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  int64_t num_threads() const { return static_cast<int64_t>(threads_.size()) + 1; }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::vector<std::thread> threads_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

template <typename F>
double OnThreads(int threads, F&& f) {  // seconds for f(i) on `threads` threads at once
  std::vector<std::thread> ts;
  const double t0 = Now();
  for (int i = 0; i < threads; ++i) ts.emplace_back([&f, i] { f(i); });
  for (auto& t : ts) t.join();
  return Now() - t0;
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // the widest vector register the target has
#else
constexpr int kLanes = 8;   // AVX2's (narrower targets use pairs or quads of theirs)
#endif
using Vec = float __attribute__((vector_size(4 * kLanes)));

// a * b + c as one fused multiply-add (the package builds with -ffp-contract=off and spells its
// fused multiply-adds out; this loop is only a peak).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
double PeakGflops(int threads) {
  constexpr int64_t kIters = 20'000'000;
  constexpr int kChains = 12;  // enough independent chains to cover the FMA latency
  const double seconds = OnThreads(threads, [&](int) {
    Vec acc[kChains], b, c;
    for (int i = 0; i < kLanes; ++i) b[i] = 0.9999f, c[i] = 1e-4f;
    for (int j = 0; j < kChains; ++j)
      for (int i = 0; i < kLanes; ++i) acc[j][i] = 0.001f * j;
    for (int64_t it = 0; it < kIters; ++it)
      for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * b + c;
    float s = 0;
    for (int j = 0; j < kChains; ++j)
      for (int i = 0; i < kLanes; ++i) s += acc[j][i];
    g_sink = s;
  });
  return threads * kIters * kChains * kLanes * 2.0 / seconds / 1e9;
}
#pragma GCC pop_options

double BandwidthGbs(int threads) {
  constexpr int64_t kFloats = int64_t{1} << 28;  // 1 GiB
  std::vector<float> buf(kFloats, 1.0f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double seconds = OnThreads(threads, [&](int t) {
      const int64_t chunk = kFloats / threads;
      const float* p = buf.data() + t * chunk;
      Vec s0 = {}, s1 = {}, s2 = {}, s3 = {};
      for (int64_t i = 0; i < chunk; i += 4 * kLanes) {
        Vec v0, v1, v2, v3;
        std::memcpy(&v0, p + i, sizeof(Vec));
        std::memcpy(&v1, p + i + kLanes, sizeof(Vec));
        std::memcpy(&v2, p + i + 2 * kLanes, sizeof(Vec));
        std::memcpy(&v3, p + i + 3 * kLanes, sizeof(Vec));
        s0 += v0, s1 += v1, s2 += v2, s3 += v3;
      }
      const Vec s = s0 + s1 + s2 + s3;
      float total = 0;
      for (int i = 0; i < kLanes; ++i) total += s[i];
      g_sink = total;
    });
    best = std::max(best, kFloats * 4.0 / seconds / 1e9);
  }
  return best;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void TimeGemms(bool cold, int64_t k, int64_t n, const std::vector<int64_t>& ms) {
  HelperPool pool(1);
  const int64_t panels = (n + kNR - 1) / kNR;
  const int64_t dense_floats = panels * k * kNR, quant_bytes = panels * k * (kNR / 2 + 2 * sizeof(float));
  const int64_t copies = cold ? std::max<int64_t>(1, (int64_t{96} << 20) / (dense_floats * 4)) : 1;
  std::mt19937 rng(0);
  std::vector<std::vector<float>> dense(copies, std::vector<float>(dense_floats));
  std::vector<std::vector<uint8_t>> quant(copies, std::vector<uint8_t>(quant_bytes));
  for (auto& d : dense)
    for (auto& v : d) v = static_cast<float>(rng() % 2001) * 1e-4f - 0.1f;
  for (auto& q : quant) {
    for (int64_t p = 0; p < panels; ++p) {  // codes, then per 32 rows the 32 scales and 32 offsets
      uint8_t* panel = q.data() + p * k * (kNR / 2 + 2 * sizeof(float));
      for (int64_t i = 0; i < k * kNR / 2; ++i) panel[i] = static_cast<uint8_t>(rng());
      auto* params = reinterpret_cast<float*>(panel + k * kNR / 2);
      for (int64_t i = 0; i < k / kQuantBlock * 2 * kNR; ++i) params[i] = (i / kNR) % 2 ? -0.05f : 0.01f;
    }
  }
  for (const int64_t m : ms) {
    std::vector<float> x(m * k, 0.5f), out(m * n);
    std::vector<double> dense_s, quant_s;
    int64_t next = 0;
    for (int rep = 0; rep < 32; ++rep) {  // the variants alternate, the first round is a warm-up
      const double t0 = Now();
      Gemm<float, float>(x.data(), dense[next++ % copies].data(), out.data(), m, k, n, pool);
      const double t1 = Now();
      QuantGemm<4, float, float>(x.data(), quant[next++ % copies].data(), out.data(), m, k, n, pool);
      const double t2 = Now();
      if (rep > 0) dense_s.push_back(t1 - t0), quant_s.push_back(t2 - t1);
    }
    std::printf("gemm %lld %lld %lld %.6f %.6f\n", static_cast<long long>(m), static_cast<long long>(k),
                static_cast<long long>(n), Median(dense_s) * 1e3, Median(quant_s) * 1e3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  if ((what == "peak" || what == "bandwidth") && argc == 3) {
    const int threads = std::atoi(argv[2]);
    std::printf("%s %d %.3f\n", what.c_str(), threads, what == "peak" ? PeakGflops(threads) : BandwidthGbs(threads));
    return 0;
  }
  if (what == "gemm" && argc >= 6) {
    std::vector<int64_t> ms;
    for (int i = 5; i < argc; ++i) ms.push_back(std::atoll(argv[i]));
    TimeGemms(std::atoi(argv[2]) != 0, std::atoll(argv[3]), std::atoll(argv[4]), ms);
    return 0;
  }
  std::fprintf(stderr, "usage: ceiling peak THREADS | bandwidth THREADS | gemm COLD K N M...\n");
  return 2;
}
