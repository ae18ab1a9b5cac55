// What gguf_panels.cc (float32 x) and gguf_panels_q8.cc (Q8_1 x) share: reading the call's buffers of
// GGUF codes in 16-column panels, checked, at the layer the call names.
//
//   x [M, K] float32; codes [L, N/16, K or K/2 (two 4-bit codes per byte), 16] uint8;
//   scales, mins [L, N/16, K/32, 16] float32; layer int32 [] -> that layer's three runs
#pragma once

#include <string>

#include "gguf_codes.h"

namespace jaxpaged {

constexpr int kPanelBlock = 32;  // GGUF values per scale
constexpr int kPanelWidth = 16;  // columns per panel

struct PanelCall {
  int64_t m, k, n;
  bool packed;  // two 4-bit codes per byte
  const uint8_t* codes;
  const float* scales;
  const float* mins;
};

// The call's shapes checked (errors name `kernel`) and layer `layer` of the stack located in `call`.
inline xla::ffi::Error read_panels(const std::string& kernel, xla::ffi::Buffer<xla::ffi::F32>& x,
                                   xla::ffi::Buffer<xla::ffi::U8>& codes, xla::ffi::Buffer<xla::ffi::F32>& scales,
                                   xla::ffi::Buffer<xla::ffi::F32>& mins, xla::ffi::Buffer<xla::ffi::S32>& layer_buffer,
                                   PanelCall& call) {
  const auto x_dims = x.dimensions(), c_dims = codes.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 4 || s_dims.size() != 4 || layer_buffer.element_count() != 1)
    return xla::ffi::Error::InvalidArgument(
        kernel + ": x must be [M, K], codes [L, N/16, K or K/2, 16], scales [L, N/16, K/32, 16], layer a scalar");
  const int64_t m = x_dims[0], k = x_dims[1], num_layers = c_dims[0], num_panels = c_dims[1];
  const bool packed = c_dims[2] * 2 == k;
  if ((c_dims[2] != k && !packed) || c_dims[3] != kPanelWidth || k % kPanelBlock != 0 || s_dims[0] != num_layers ||
      s_dims[1] != num_panels || s_dims[2] != k / kPanelBlock || s_dims[3] != kPanelWidth ||
      mins.element_count() != scales.element_count())
    return xla::ffi::Error::InvalidArgument(
        kernel + ": codes [L, N/16, K or K/2, 16], scales and mins [L, N/16, K/32, 16], K % 32 == 0");
  // On the CPU every buffer is host memory: the layer index is read here, where the call runs.
  const int64_t layer = *layer_buffer.typed_data();
  if (layer < 0 || layer >= num_layers) return xla::ffi::Error::InvalidArgument(kernel + ": layer index out of range");
  const int64_t layer_codes = num_panels * c_dims[2] * kPanelWidth;
  const int64_t layer_scales = num_panels * (k / kPanelBlock) * kPanelWidth;
  call = {m, k, num_panels * kPanelWidth, packed, codes.typed_data() + layer * layer_codes,
          scales.typed_data() + layer * layer_scales, mins.typed_data() + layer * layer_scales};
  return xla::ffi::Error::Success();
}

}  // namespace jaxpaged
