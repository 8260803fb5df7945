// Prints what pallas_kernels/csrc/vec16.h computes on fixed inputs, one "name values..." line per
// check, so tests/test_vec16.py can compare the header's variants (AVX-512, AVX2, portable loops),
// built with different target flags, with each other and with numpy.
#include <cstdio>
#include <limits>

#include "vec16.h"

using namespace jaxpaged::simd;

namespace {

void Print(const char* name, const float* v, int n) {
  std::printf("%s", name);
  for (int i = 0; i < n; ++i) std::printf(" %.9g", v[i]);
  std::printf("\n");
}

void PrintVec(const char* name, Vec v) {
  float o[kLanes];
  Store(o, v);
  Print(name, o, kLanes);
}

}  // namespace

int main() {
  float x[kLanes * kLanes];
  uint32_t s = 12345;
  for (float& v : x) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<float>(s >> 8) / 16777216.f * 200.f - 100.f;  // [-100, 100)
  }
  // exp's edges: -inf, below and above the -87 cut, 0, near float32's overflow.
  const float edges[kLanes] = {-std::numeric_limits<float>::infinity(), -100.f, -87.5f, -87.f, -86.9f, -20.f, -1e-3f,
                               0.f, 1e-3f, 1.f, 20.f, 80.f, 88.f, 88.5f, 88.7f, 89.f};
  Print("inputs", x, kLanes * kLanes);
  Print("edges", edges, kLanes);
  PrintVec("exp_edges", Exp(Load(edges)));
  for (int i = 0; i < kLanes; ++i) {
    const Vec v = Load(x + kLanes * i);
    PrintVec("exp", Exp(Mul(v, Set1(0.5f))));
    const float r[4] = {ReduceAdd(v), ReduceMax(v), static_cast<float>(LessEqual(v, Set1(0.f))),
                        static_cast<float>(FirstLanes(i))};
    Print("reduce", r, 4);
    PrintVec("masked", LoadMasked(x + kLanes * i, FirstLanes(i)));
    PrintVec("select", Select(FirstLanes(i), v, Set1(-1.f)));
    PrintVec("arith", Div(Fma(v, v, Sub(Max(v, Zero()), Set1(2.f))), Add(Set1(3.f), Mul(v, v))));
  }
  uint16_t bf16[kLanes];
  for (int i = 0; i < kLanes; ++i) bf16[i] = static_cast<uint16_t>(0x3f80 + 7 * i);  // 1.0 and up
  for (int n = 0; n <= kLanes; n += 5) PrintVec("bf16", LoadMasked(bf16, FirstLanes(n)));
  Vec rows[kLanes];
  for (int i = 0; i < kLanes; ++i) rows[i] = Load(x + kLanes * i);
  PrintVec("sum_each", SumEach16(rows));
  Transpose16(rows);
  for (int i = 0; i < kLanes; ++i) PrintVec("transposed", rows[i]);
  return 0;
}
