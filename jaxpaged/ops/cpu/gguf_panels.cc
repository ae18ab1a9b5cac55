// y = x @ W for a weight kept as GGUF block codes in 16-column panels, on the CPU: the layer
// projections as the runner serves them and a tied LM head (jaxpaged/models/gguf_blocks.py).
//
//   x       float32 [M, K]                 activations, row-major
//   codes   uint8   [L, N/16, K, 16]       panel p of layer l: columns 16p .. 16p + 15 of W, k-major,
//                                          16 bytes per k row; or
//           uint8   [L, N/16, K/2, 16]     packed 4-bit codes: in each block of 32 k rows, byte row j
//                                          holds row j in its low four bits and row j + 16 in its high
//   scales  float32 [L, N/16, K/32, 16]    W[k, 16p + c] = scales[l, p, k/32, c] * code + mins[l, p, k/32, c]
//   mins    float32 [L, N/16, K/32, 16]
//   layer   int32   []                     l: which of the L stacked weights
//   y       float32 [M, N]
//
// A panel's codes, scales and minimums are three contiguous runs. Each thread takes whole pairs of
// panels, all of k, and keeps its accumulators in registers from the first k row to the last: it
// reads in order, writes y once and needs no partial sums. (gguf_matmul.cc, on GGUF's own layout,
// where a block row spans every column, reads 16-32 rows at a stride of N for each strip; the panels
// read at 1.3-1.6x its rate from 1 to 16 rows, benchmarks/peers/README.md, eleventh pass.) The codes
// are dequantized in registers right before their multiply-adds, anew for every 8-row pass of x (a
// pair's codes stay in L1 between passes); a buffer of dequantized floats shared by the passes was
// slower at every row count measured.
//
// Each dequantized W[k, n] is the float gguf_blocks computes (one rounding of scale * code + min; the
// product is exact), so y differs from XLA's only in the order of the float32 sums over k.
// Built at first use with the host's compiler (-march=native): ../cpu_kernels.py.

#include "gguf_codes.h"
#include "matmul.h"
#include "panels.h"

namespace ffi = xla::ffi;

namespace {

using jaxpaged::f32x16;
using jaxpaged::load_codes;
using jaxpaged::load_f32;
using jaxpaged::load_nibbles;
using jaxpaged::store_f32;
using jaxpaged::Matmul;

constexpr int kBlock = 32;  // GGUF values per scale
constexpr int kPanel = 16;  // columns per panel

struct Panels : Matmul {  // x, y, m, k, n; and one layer's panels: codes, scales and minimums
  const uint8_t* codes;
  const float* scales;
  const float* mins;
};

// Bytes of codes per k row of a panel's block: 32 rows of 16 bytes, or 16 of two packed codes each.
template <bool Packed>
constexpr int64_t kCodeRows = Packed ? kBlock / 2 : kBlock;

// y[r0:r0+R, 16 panel .. 16 (panel + V)]: V panels (1 or 2) against R <= 8 rows over all of k.
template <bool Packed, int R, int V>
void tile(const Panels& p, int64_t r0, int64_t panel) {
  const int64_t blocks = p.k / kBlock, panel_codes = blocks * kCodeRows<Packed> * kPanel;
  f32x16 acc[R][V] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    f32x16 scale[V], min[V];
    const uint8_t* codes[V];
    for (int v = 0; v < V; ++v) {
      scale[v] = load_f32(p.scales + ((panel + v) * blocks + b) * kPanel);
      min[v] = load_f32(p.mins + ((panel + v) * blocks + b) * kPanel);
      codes[v] = p.codes + (panel + v) * panel_codes + b * kCodeRows<Packed> * kPanel;
    }
    // the next pair's codes at this block, requested into L2 while this pair's are multiplied
    for (int v = V; v < 2 * V; ++v)
      for (int64_t line = 0; line < kCodeRows<Packed> * kPanel; line += 64)
        __builtin_prefetch(codes[0] + v * panel_codes + line, 0, 2);
    const float* x = p.x + r0 * p.k + b * kBlock;
    for (int i = 0; i < kCodeRows<Packed>; ++i) {
      if constexpr (Packed) {  // k rows i and i + 16 of the block
        f32x16 low[V], high[V];
        for (int v = 0; v < V; ++v) {
          load_nibbles(codes[v] + i * kPanel, low[v], high[v]);
          low[v] = scale[v] * low[v] + min[v];
          high[v] = scale[v] * high[v] + min[v];
        }
        for (int r = 0; r < R; ++r) {
          const float xl = x[r * p.k + i], xh = x[r * p.k + i + kBlock / 2];
          for (int v = 0; v < V; ++v) {
            acc[r][v] += xl * low[v];
            acc[r][v] += xh * high[v];
          }
        }
      } else {
        f32x16 w[V];
        for (int v = 0; v < V; ++v) w[v] = scale[v] * load_codes(codes[v] + i * kPanel) + min[v];
        for (int r = 0; r < R; ++r) {
          const float xr = x[r * p.k + i];
          for (int v = 0; v < V; ++v) acc[r][v] += xr * w[v];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store_f32(p.y + (r0 + r) * p.n + (panel + v) * kPanel, acc[r][v]);
}

// Every row of x for panels [panel, panel + V), in passes of up to 8 rows.
template <bool Packed, int V>
void panels(const Panels& p, int64_t panel) {
  for (int64_t r0 = 0; r0 < p.m; r0 += jaxpaged::kRows) {
    switch (std::min<int64_t>(jaxpaged::kRows, p.m - r0)) {
      case 1: tile<Packed, 1, V>(p, r0, panel); break;
      case 2: tile<Packed, 2, V>(p, r0, panel); break;
      case 3: tile<Packed, 3, V>(p, r0, panel); break;
      case 4: tile<Packed, 4, V>(p, r0, panel); break;
      case 5: tile<Packed, 5, V>(p, r0, panel); break;
      case 6: tile<Packed, 6, V>(p, r0, panel); break;
      case 7: tile<Packed, 7, V>(p, r0, panel); break;
      default: tile<Packed, 8, V>(p, r0, panel); break;
    }
  }
}

// Thread t of `tasks`: pairs of panels [t pairs / tasks, (t + 1) pairs / tasks), contiguous runs.
template <bool Packed>
void pair_range(const Panels& p, int64_t t, int64_t tasks) {
  const int64_t num_panels = p.n / kPanel, pairs = (num_panels + 1) / 2;
  for (int64_t pair = t * pairs / tasks; pair < (t + 1) * pairs / tasks; ++pair) {
    if (num_panels - 2 * pair >= 2)
      panels<Packed, 2>(p, 2 * pair);
    else
      panels<Packed, 1>(p, 2 * pair);
  }
}

ffi::Error GgufPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer_buffer,
                      ffi::ResultBuffer<ffi::F32> y) {
  jaxpaged::PanelCall call;
  if (ffi::Error error = jaxpaged::read_panels("gguf_panels", x, codes, scales, mins, layer_buffer, call); !error.success())
    return error;
  if (call.m == 0) return ffi::Error::Success();
  const int64_t num_panels = call.n / kPanel;
  const bool packed = call.packed;
  const Panels p{{x.typed_data(), y->typed_data(), call.m, call.k, call.n}, call.codes, call.scales, call.mins};
  const int64_t tasks = std::min<int64_t>((num_panels + 1) / 2, std::max<int64_t>(1, pool.num_threads()));
  jaxpaged::parallel_for(pool, tasks, [p, tasks, packed](int64_t t) {
    if (packed)
      pair_range<true>(p, t, tasks);
    else
      pair_range<false>(p, t, tasks);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_gguf_panels, GgufPanels, jaxpaged::codes_matmul_binding());
