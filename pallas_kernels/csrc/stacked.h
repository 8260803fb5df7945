// Weights stacked over a model's layers, for the CPU kernels. A weight operand may carry one more
// leading axis than the kernel's own weight, [L, ...], and the `layer` attribute picks one slice: a
// model then hands each jitted call one array per kind of weight instead of one per layer (every
// operand of a call costs dispatch time on the host), and no layer's slice is copied (XLA's CPU
// backend copies a sliced operand before a custom call).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxpaged {

struct LayerWeight {
  const void* data;     // the picked layer's weight
  const int64_t* dims;  // its `rank` dims
  bool ok;              // the operand has `rank` dims (then `layer` must be 0) or `rank` + 1 with 0 <= layer < L
};

// Buffer: an XLA FFI buffer (dimensions(), untyped_data(), size_bytes()).
template <typename Buffer>
LayerWeight PickLayer(const Buffer& w, size_t rank, int64_t layer) {
  const auto d = w.dimensions();
  if (d.size() == rank) return {w.untyped_data(), d.begin(), layer == 0};
  if (d.size() != rank + 1 || layer < 0 || layer >= d[0]) return {nullptr, nullptr, false};
  const auto layer_bytes = static_cast<int64_t>(w.size_bytes()) / d[0];
  return {static_cast<const char*>(w.untyped_data()) + layer * layer_bytes, d.begin() + 1, true};
}

}  // namespace jaxpaged
