// y = x @ W for a weight kept as GGUF block codes in 16-column panels: a tied LM head, W = E^T for the
// embedding E [N, K] (jaxpaged/models/gguf_blocks.py, `panel_leaves`), on the CPU.
//
//   x       float32 [M, K]              activations, row-major
//   codes   uint8   [N/16, K, 16]       panel p: columns 16p .. 16p + 15 of W (vocabulary rows of E),
//                                       k-major, 16 bytes per k
//   scales  float32 [N/16, K/32, 16]    W[k, 16p + j] = scales[p, k/32, j] * codes[p, k, j] + mins[p, k/32, j]
//   mins    float32 [N/16, K/32, 16]
//   y       float32 [M, N]
//
// A head is short in k and long in n (SmolLM2: 576 x 49152). gguf_matmul.cc's layout keeps a k row of
// every column together, so a thread walking all of k for a few columns would read a few bytes every
// N; here a panel's codes, scales and minimums are three contiguous runs, and each thread takes whole
// panels, all of k: y is written once, with no partial sums. The codes are dequantized in registers
// right before their multiply-adds, anew for every 8-row pass of x (a pair's 18 KB of codes stay in
// L1 between passes). A buffer of dequantized floats shared by the passes, as gguf_matmul.cc keeps
// beyond 8 rows, was slower here at every row count measured (16 rows: 7.1 against 5.8-5.9 ms,
// benchmarks/peers/README.md, eleventh pass).
//
// Each dequantized W[k, n] is the float gguf_blocks computes (one rounding of scale * code + min; the
// product is exact), so y differs from XLA's only in the order of the float32 sums over k.
// Built at first use with the host's compiler (-march=native): ../cpu_kernels.py.

#include "gguf_codes.h"
#include "matmul.h"

namespace ffi = xla::ffi;

namespace {

using jaxpaged::f32x16;
using jaxpaged::load_codes;
using jaxpaged::load_f32;
using jaxpaged::store_f32;
using jaxpaged::Matmul;

constexpr int kBlock = 32;    // GGUF values per scale
constexpr int kPanel = 16;    // columns per panel

struct Panels : Matmul {  // x, y, m, k, n; and the panels' codes, scales and minimums
  const uint8_t* codes;
  const float* scales;
  const float* mins;

  const uint8_t* panel_codes(int64_t panel) const { return codes + panel * k * kPanel; }
  const float* panel_scales(int64_t panel) const { return scales + panel * (k / kBlock) * kPanel; }
  const float* panel_mins(int64_t panel) const { return mins + panel * (k / kBlock) * kPanel; }
};

// y[0:R, 16 panel .. 16 (panel + V)]: V panels (1 or 2) against R <= 8 rows over all of k, the
// accumulators in registers from the first k to the last.
template <int R, int V>
void tile_direct(const Panels& p, int64_t r0, int64_t panel) {
  f32x16 acc[R][V] = {};
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    f32x16 scale[V], min[V];
    const uint8_t* codes[V];
    for (int v = 0; v < V; ++v) {
      scale[v] = load_f32(p.panel_scales(panel + v) + b * kPanel);
      min[v] = load_f32(p.panel_mins(panel + v) + b * kPanel);
      codes[v] = p.panel_codes(panel + v) + b * kBlock * kPanel;
    }
    // the next pair's codes at this block, requested into L2 while this pair's are multiplied
    for (int v = V; v < 2 * V; ++v)
      for (int line = 0; line < kBlock * kPanel; line += 64) __builtin_prefetch(codes[0] + v * p.k * kPanel + line, 0, 2);
    const float* x = p.x + r0 * p.k + b * kBlock;
    for (int i = 0; i < kBlock; ++i) {
      f32x16 w[V];
      for (int v = 0; v < V; ++v) w[v] = scale[v] * load_codes(codes[v] + i * kPanel) + min[v];
      for (int r = 0; r < R; ++r) {
        const float xr = x[r * p.k + i];
        for (int v = 0; v < V; ++v) acc[r][v] += xr * w[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store_f32(p.y + (r0 + r) * p.n + (panel + v) * kPanel, acc[r][v]);
}

// Every row of x in passes of up to 8.
template <int V>
void direct(const Panels& p, int64_t panel) {
  for (int64_t r0 = 0; r0 < p.m; r0 += jaxpaged::kRows) {
    switch (std::min<int64_t>(jaxpaged::kRows, p.m - r0)) {
      case 1: tile_direct<1, V>(p, r0, panel); break;
      case 2: tile_direct<2, V>(p, r0, panel); break;
      case 3: tile_direct<3, V>(p, r0, panel); break;
      case 4: tile_direct<4, V>(p, r0, panel); break;
      case 5: tile_direct<5, V>(p, r0, panel); break;
      case 6: tile_direct<6, V>(p, r0, panel); break;
      case 7: tile_direct<7, V>(p, r0, panel); break;
      default: tile_direct<8, V>(p, r0, panel); break;
    }
  }
}

ffi::Error GgufPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions(), c_dims = codes.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 3 || s_dims.size() != 3)
    return ffi::Error::InvalidArgument("gguf_panels: x must be [M, K], codes [N/16, K, 16], scales [N/16, K/32, 16]");
  const int64_t m = x_dims[0], k = x_dims[1], num_panels = c_dims[0];
  if (c_dims[1] != k || c_dims[2] != kPanel || k % kBlock != 0 || s_dims[0] != num_panels ||
      s_dims[1] != k / kBlock || s_dims[2] != kPanel || mins.element_count() != scales.element_count())
    return ffi::Error::InvalidArgument("gguf_panels: codes [N/16, K, 16], scales and mins [N/16, K/32, 16], K % 32 == 0");
  const Panels p{{x.typed_data(), y->typed_data(), m, k, num_panels * kPanel},
                 codes.typed_data(), scales.typed_data(), mins.typed_data()};
  if (m == 0) return ffi::Error::Success();
  // Thread t of `tasks` takes pairs of panels [t pairs / tasks, (t + 1) pairs / tasks): contiguous runs.
  const int64_t pairs = (num_panels + 1) / 2;
  const int64_t tasks = std::min<int64_t>(pairs, std::max<int64_t>(1, pool.num_threads()));
  jaxpaged::parallel_for(pool, tasks, [p, pairs, tasks, num_panels](int64_t t) {
    for (int64_t pair = t * pairs / tasks; pair < (t + 1) * pairs / tasks; ++pair) {
      const int64_t panel = 2 * pair, count = std::min<int64_t>(2, num_panels - panel);
      if (count == 2)
        direct<2>(p, panel);
      else
        direct<1>(p, panel);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_gguf_panels, GgufPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
