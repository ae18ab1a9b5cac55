// y = x @ W for a weight kept as GGUF block codes (jaxpaged/models/gguf_blocks.py), on the CPU.
//
//   x       float32 [M, K]          activations, row-major
//   codes   uint8   [L, K, N]       ([L, K/32, 32, N] in the parameter tree: the same bytes), or
//           uint8   [L, K/2, N]     packed: [L, K/32, 16, N], byte j of a block holding the code of
//                                   k row j in its low four bits and of row j + 16 in its high four
//   scales  float32 [L, K/32, N]    W[k, n] = scales[l, k/32, n] * codes[l, k, n] + mins[l, k/32, n]
//   mins    float32 [L, K/32, N]
//   layer   int32   []              l: which of the L stacked weights
//   y       float32 [M, N]
//
// The whole stack comes in, not one layer's slice: inside the model's scan over layers a slice
// is a copy (XLA's dynamic-slice fusions are memcpys), which would cost as much as reading it.
//
// XLA:CPU runs this as a dequantization fusion that writes the float32 weight to memory, then
// Eigen's GEMM, which packs that weight again at every call. Here each code is read once per call, in
// order (each thread one contiguous range of k: matmul.h), and dequantized in registers (up to 8 rows
// of x) or, 64 k rows x 128 columns at a time, into a buffer that stays in L1 while every 8-row pass
// of x multiplies it.
//
// Each dequantized W[k, n] is the float gguf_blocks computes (one rounding of scale * code + min;
// the product is exact), so y differs from XLA's only in the order of the float32 sums over k.
// Built at first use with the host's compiler (-march=native): ../cpu_kernels.py.

#include "gguf_codes.h"
#include "matmul.h"

namespace ffi = xla::ffi;

namespace {

using jaxpaged::f32x16;
using jaxpaged::load_f32;
using jaxpaged::store_f32;
using jaxpaged::load_codes;
using jaxpaged::load_nibbles;

using jaxpaged::kRows;
using jaxpaged::kStrip;
using jaxpaged::Matmul;

constexpr int kBlock = 32;   // GGUF values per scale
constexpr int kChunk = 128;  // columns dequantized into the buffer at a time
constexpr int kGroup = 2;    // blocks of k rows dequantized at a time (64 x 128 floats: 32 KB)

struct Problem : Matmul {  // x, y, m, k, n; and this layer's codes, scales and minimums
  const uint8_t* codes;
  const float* scales;
  const float* mins;
};

// Bytes of codes per block row of W: 32 k rows of one byte, or 16 of two packed codes.
template <bool Packed>
constexpr int64_t kCodeRows = Packed ? kBlock / 2 : kBlock;

// Dequantizes the codes of blocks [b0, b1) (k rows 32 b0 .. 32 b1) and columns [c0, c1) into w,
// row-major with `width` = c1 - c0 floats per k row: 16 codes at a time, converted and scaled in
// registers (scale * code + min, the float gguf_blocks defines).
template <bool Packed>
void dequantize_group(const Problem& p, int64_t b0, int64_t b1, int64_t c0, int64_t c1, float* w) {
  const int64_t width = c1 - c0;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t n = c0; n < c1; n += 16) {
      const f32x16 scale = load_f32(p.scales + b * p.n + n), min = load_f32(p.mins + b * p.n + n);
      const uint8_t* codes = p.codes + b * kCodeRows<Packed> * p.n + n;
      float* out = w + (b - b0) * kBlock * width + (n - c0);
      for (int64_t i = 0; i < kCodeRows<Packed>; ++i) {
        if constexpr (Packed) {
          f32x16 low, high;
          load_nibbles(codes + i * p.n, low, high);
          store_f32(out + i * width, scale * low + min);
          store_f32(out + (i + kBlock / 2) * width, scale * high + min);
        } else {
          store_f32(out + i * width, scale * load_codes(codes + i * p.n) + min);
        }
      }
    }
}

// y[0:R, n0:n0+16*V] for R <= 8 rows (one pass): the codes dequantized in registers right before
// their multiply-adds, for blocks [b0, b1), starting from zero (b0 == 0) or from what y holds. With
// a single pass a buffer would cost a store and a load per weight for nothing (1 row: 2x slower).
template <bool Packed, int R, int V>
void tile_direct(const Problem& p, int64_t r0, int64_t n0, int64_t b0, int64_t b1) {
  f32x16 acc[R][V];
  float* y = p.y + r0 * p.n + n0;
  const float* x = p.x + r0 * p.k;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = b0 == 0 ? f32x16{} : load_f32(y + r * p.n + 16 * v);
  for (int64_t b = b0; b < b1; ++b) {
    f32x16 scale[V], min[V];
    for (int v = 0; v < V; ++v) {
      scale[v] = load_f32(p.scales + b * p.n + n0 + 16 * v);
      min[v] = load_f32(p.mins + b * p.n + n0 + 16 * v);
    }
    const uint8_t* codes = p.codes + b * kCodeRows<Packed> * p.n + n0;
    for (int64_t i = 0; i < kCodeRows<Packed>; ++i, codes += p.n) {
      if constexpr (Packed) {  // k rows i and i + 16 of the block
        f32x16 low[V], high[V];
        for (int v = 0; v < V; ++v) {
          load_nibbles(codes + 16 * v, low[v], high[v]);
          low[v] = scale[v] * low[v] + min[v];
          high[v] = scale[v] * high[v] + min[v];
        }
        for (int r = 0; r < R; ++r) {
          const float xl = x[r * p.k + b * kBlock + i], xh = x[r * p.k + b * kBlock + i + kBlock / 2];
          for (int v = 0; v < V; ++v) {  // two fused multiply-adds into acc, one per k row
            acc[r][v] += xl * low[v];
            acc[r][v] += xh * high[v];
          }
        }
      } else {
        f32x16 w[V];
        for (int v = 0; v < V; ++v) w[v] = scale[v] * load_codes(codes + 16 * v) + min[v];
        for (int r = 0; r < R; ++r) {
          const float xr = x[r * p.k + b * kBlock + i];
          for (int v = 0; v < V; ++v) acc[r][v] += xr * w[v];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store_f32(y + r * p.n + 16 * v, acc[r][v]);
}

template <bool Packed, int V>
void direct(const Problem& p, int64_t r0, int64_t rows, int64_t n0, int64_t b0, int64_t b1) {
  switch (rows) {
    case 1: return tile_direct<Packed, 1, V>(p, r0, n0, b0, b1);
    case 2: return tile_direct<Packed, 2, V>(p, r0, n0, b0, b1);
    case 3: return tile_direct<Packed, 3, V>(p, r0, n0, b0, b1);
    case 4: return tile_direct<Packed, 4, V>(p, r0, n0, b0, b1);
    case 5: return tile_direct<Packed, 5, V>(p, r0, n0, b0, b1);
    case 6: return tile_direct<Packed, 6, V>(p, r0, n0, b0, b1);
    case 7: return tile_direct<Packed, 7, V>(p, r0, n0, b0, b1);
    default: return tile_direct<Packed, 8, V>(p, r0, n0, b0, b1);
  }
}

// Columns [c0, c1) of rows r0 .. r0 + rows - 1 (at most 8) for blocks [b0, b1): whole strips, then
// a 16-column tail.
template <bool Packed>
void direct_columns(const Problem& p, int64_t r0, int64_t rows, int64_t c0, int64_t c1, int64_t b0, int64_t b1,
                    int64_t ahead_blocks) {
  for (int64_t n0 = c0; n0 < c1; n0 += kStrip) {
    // this strip's codes, scales and minimums in the next `ahead_blocks` blocks, requested into L2
    for (int64_t b = b1; b < b1 + ahead_blocks; ++b) {
      for (int64_t i = 0; i < kCodeRows<Packed>; ++i) __builtin_prefetch(p.codes + (b * kCodeRows<Packed> + i) * p.n + n0, 0, 2);
      for (int64_t c = 0; c < kStrip; c += 16) {
        __builtin_prefetch(p.scales + b * p.n + n0 + c, 0, 2);
        __builtin_prefetch(p.mins + b * p.n + n0 + c, 0, 2);
      }
    }
    if (c1 - n0 < kStrip)
      direct<Packed, 1>(p, r0, rows, n0, b0, b1);
    else
      direct<Packed, 2>(p, r0, rows, n0, b0, b1);
  }
}

// Thread t of `tasks` (matmul.h): blocks [B0, B1) of k for every column and row, whose codes are one
// contiguous run read in order, into y (t = 0) or its partial sums. The next group is requested while
// the current one is multiplied: up to 8 rows strip by strip, each strip's share just before it (one
// row: SmolLM2's projections of 30 layers 6.1-8.2 -> 5.0-5.1 ms against the whole group at once, the
// peers README's tenth pass), beyond 8 rows the whole group at once.
template <bool Packed>
void k_range(const Problem& whole, int64_t t, int64_t tasks, float* partials) {
  const int64_t num_blocks = whole.k / kBlock, first = t * num_blocks / tasks, last = (t + 1) * num_blocks / tasks;
  Problem p = whole;  // blocks relative to `first`; x keeps its row stride k
  p.x += first * kBlock;
  p.codes += first * kCodeRows<Packed> * p.n;
  p.scales += first * p.n;
  p.mins += first * p.n;
  if (t > 0) p.y = partials + (t - 1) * p.m * p.n;
  const int64_t count = last - first;
  auto request = [&](int64_t b0) {  // the codes of blocks b0 .. b0 + kGroup - 1: whole rows, contiguous
    const uint8_t* end = p.codes + std::min(count, b0 + kGroup) * kCodeRows<Packed> * p.n;
    for (const uint8_t* line = p.codes + std::min(count, b0) * kCodeRows<Packed> * p.n; line < end; line += 64)
      __builtin_prefetch(line);
  };
  if (p.m > kRows) request(0);
  for (int64_t b0 = 0; b0 < count; b0 += kGroup) {
    const int64_t b1 = std::min(count, b0 + kGroup);
    if (p.m <= kRows) {  // the next group requested strip by strip, a little at a time
      direct_columns<Packed>(p, 0, p.m, 0, p.n, b0, b1, std::min(count, b1 + kGroup) - b1);
      continue;
    }
    request(b1);
    alignas(64) static thread_local float w[kGroup * kBlock * kChunk];
    for (int64_t c0 = 0; c0 < p.n; c0 += kChunk) {
      const int64_t c1 = std::min(p.n, c0 + kChunk);
      dequantize_group<Packed>(p, b0, b1, c0, c1, w);
      jaxpaged::passes(p, w, c1 - c0, (b1 - b0) * kBlock, b0 * kBlock, c0, c1);
    }
  }
}

ffi::Error GgufMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                      ffi::Buffer<ffi::S32> layer_buffer, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto s_dims = scales.dimensions();
  if (x_dims.size() != 2 || s_dims.size() != 3 || layer_buffer.element_count() != 1)
    return ffi::Error::InvalidArgument("gguf_matmul: x must be [M, K], scales [L, K/32, N], layer a scalar");
  const int64_t m = x_dims[0], k = x_dims[1], num_layers = s_dims[0], n = s_dims[2];
  const auto c_dims = codes.dimensions();
  const bool packed = c_dims.size() == 4 && c_dims[2] == kBlock / 2;
  if (k != s_dims[1] * kBlock || c_dims.size() != 4 || c_dims[0] != num_layers || c_dims[1] != s_dims[1] ||
      (c_dims[2] != kBlock && !packed) || c_dims[3] != n || mins.element_count() != scales.element_count() ||
      n % 16 != 0)
    return ffi::Error::InvalidArgument("gguf_matmul: codes [L, K/32, 32, N] or packed [L, K/32, 16, N], "
                                       "scales and mins [L, K/32, N], N % 16 == 0");
  // On the CPU every buffer is host memory: the layer index is read here, where the call runs.
  const int64_t layer = *layer_buffer.typed_data();
  if (layer < 0 || layer >= num_layers)
    return ffi::Error::InvalidArgument("gguf_matmul: layer index out of range");
  const int64_t blocks = layer * (k / kBlock) * n;  // scales (and mins) before this layer's
  const int64_t tasks = std::min<int64_t>(k / kBlock, std::max<int64_t>(1, pool.num_threads()));
  const uint8_t* layer_codes = codes.typed_data() + blocks * (packed ? kBlock / 2 : kBlock);
  const float *layer_scales = scales.typed_data() + blocks, *layer_mins = mins.typed_data() + blocks;
  jaxpaged::split_over_k(pool, Matmul{x.typed_data(), y->typed_data(), m, k, n}, tasks,
                         [=](const Matmul& slice, int64_t t, int64_t tasks, float* partials) {
                           const Problem problem{slice, layer_codes, layer_scales, layer_mins};
                           if (packed)
                             k_range<true>(problem, t, tasks, partials);
                           else
                             k_range<false>(problem, t, tasks, partials);
                         });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_gguf_matmul, GgufMatmul, jaxpaged::codes_matmul_binding());
