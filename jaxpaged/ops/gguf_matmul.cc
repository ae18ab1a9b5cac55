// y = x @ W for a weight kept as GGUF block codes (jaxpaged/models/gguf_blocks.py), on the CPU.
//
//   x       float32 [M, K]          activations, row-major
//   codes   uint8   [L, K, N]       ([L, K/32, 32, N] in the parameter tree: the same bytes)
//   scales  float32 [L, K/32, N]    W[k, n] = scales[l, k/32, n] * codes[l, k, n] + mins[l, k/32, n]
//   mins    float32 [L, K/32, N]
//   layer   int32   []              l: which of the L stacked weights
//   y       float32 [M, N]
//
// The whole stack comes in, not one layer's slice: inside the model's scan over layers a slice
// is a copy (XLA's dynamic-slice fusions are memcpys), which would cost as much as reading it.
//
// XLA:CPU runs this as a dequantization fusion that writes the float32 weight, then Eigen's GEMM,
// which packs that weight again at every call. Here each weight byte is read once per call and
// dequantized in registers, right before the multiply-adds that use it:
//
//        n0        n0+32                 a task owns a 32-column strip of W (all K rows, ~18-48 KB
//   k  [ 16 f32 | 16 f32 ]  <- codes      of codes: it stays in L1) and computes y[:, n0:n0+32],
//        x 8 rows broadcast               8 rows of x at a time: 16 vector accumulators.
//
// Each dequantized W[k, n] is the float gguf_blocks computes (one rounding of scale * code + min;
// the product is exact), so y differs from XLA's only in the order of the float32 sums over k.
// The strips are shared out among XLA's intra-op threads by an atomic counter; the calling thread
// works too and then waits only for strips another thread has started, so a helper task that runs
// late (its pool busy) finds nothing left and returns: no call waits on a queued task.
//
// Built at first use with the host's compiler (-march=native), see gguf_matmul.py. GCC vector
// extensions keep it free of intrinsics: AVX-512 registers where the CPU has them, two AVX2 halves
// otherwise.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

constexpr int kBlock = 32;  // GGUF values per scale
constexpr int kStrip = 32;  // columns per task: two vectors
constexpr int kRows = 8;    // rows of x per pass over a strip
constexpr int kChunk = 128; // columns per task
constexpr int kGroup = 4;   // blocks of k rows per pass over a task's strips

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 codes as floats. GCC 12 scalarizes __builtin_convertvector from uint8, hence the intrinsics.
inline f32x16 load_codes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<f32x16>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
#elif defined(__AVX2__)
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  f32x16 v;
  std::memcpy(&v, &a, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &b, 32);
  return v;
#else
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

inline void store_f32(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

struct Problem {
  const float* x;
  const uint8_t* codes;
  const float* scales;
  const float* mins;
  float* y;
  int64_t m, k, n;
};

// y[r0:r0+R, n0:n0+16*V] (V vectors of columns: 2, a whole strip, or 1, a 16-column tail) over the
// k rows of blocks [b0, b1): starting from zero (b0 == 0) or from what y holds.
template <int R, int V>
void tile(const Problem& p, int64_t r0, int64_t n0, int64_t b0, int64_t b1) {
  f32x16 acc[R][V];
  float* y = p.y + r0 * p.n + n0;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = b0 == 0 ? f32x16{} : load_f32(y + r * p.n + 16 * v);
  const float* x = p.x + r0 * p.k;
  for (int64_t b = b0; b < b1; ++b) {
    f32x16 scale[V], min[V];
    for (int v = 0; v < V; ++v) {
      scale[v] = load_f32(p.scales + b * p.n + n0 + 16 * v);
      min[v] = load_f32(p.mins + b * p.n + n0 + 16 * v);
    }
    const uint8_t* codes = p.codes + b * kBlock * p.n + n0;
    for (int64_t i = 0; i < kBlock; ++i, codes += p.n) {
      f32x16 w[V];
      for (int v = 0; v < V; ++v) w[v] = scale[v] * load_codes(codes + 16 * v) + min[v];
      const int64_t k = b * kBlock + i;
      for (int r = 0; r < R; ++r) {
        const float xr = x[r * p.k + k];
        for (int v = 0; v < V; ++v) acc[r][v] += xr * w[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store_f32(y + r * p.n + 16 * v, acc[r][v]);
}

template <int V>
void rows_tail(const Problem& p, int64_t r0, int64_t rows, int64_t n0, int64_t b0, int64_t b1) {
  switch (rows) {
    case 1: return tile<1, V>(p, r0, n0, b0, b1);
    case 2: return tile<2, V>(p, r0, n0, b0, b1);
    case 3: return tile<3, V>(p, r0, n0, b0, b1);
    case 4: return tile<4, V>(p, r0, n0, b0, b1);
    case 5: return tile<5, V>(p, r0, n0, b0, b1);
    case 6: return tile<6, V>(p, r0, n0, b0, b1);
    case 7: return tile<7, V>(p, r0, n0, b0, b1);
    default: return tile<8, V>(p, r0, n0, b0, b1);
  }
}

// Task t: the columns [128 t, 128 t + 128) (fewer in the last task), every row. The codes are read
// a group of 4 blocks (128 k rows) at a time, each row's 128 bytes for all 4 strips of the task
// while they are in L1, so the task walks its rows of codes in order: DRAM is read as a stream.
void chunk(const Problem& p, int64_t t) {
  const int64_t c0 = t * kChunk, c1 = std::min(p.n, c0 + kChunk), num_blocks = p.k / kBlock;
  for (int64_t r0 = 0; r0 < p.m; r0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - r0);
    for (int64_t b0 = 0; b0 < num_blocks; b0 += kGroup) {
      const int64_t b1 = std::min(num_blocks, b0 + kGroup);
      // The next group's codes for these columns, requested now: 128 rows N bytes apart.
      const int64_t b2 = std::min(num_blocks, b1 + kGroup);
      for (const uint8_t* row = p.codes + b1 * kBlock * p.n + c0; row < p.codes + b2 * kBlock * p.n; row += p.n)
        for (int64_t line = 0; line < c1 - c0; line += 64) __builtin_prefetch(row + line);
      for (int64_t n0 = c0; n0 < c1; n0 += kStrip) {
        if (c1 - n0 < kStrip)
          rows_tail<1>(p, r0, rows, n0, b0, b1);
        else
          rows_tail<2>(p, r0, rows, n0, b0, b1);
      }
    }
  }
}

struct Shared {
  Problem problem;
  int64_t num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      chunk(problem, t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error GgufMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                      ffi::Buffer<ffi::S32> layer_buffer, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto s_dims = scales.dimensions();
  if (x_dims.size() != 2 || s_dims.size() != 3 || layer_buffer.element_count() != 1)
    return ffi::Error::InvalidArgument("gguf_matmul: x must be [M, K], scales [L, K/32, N], layer a scalar");
  const int64_t m = x_dims[0], k = x_dims[1], num_layers = s_dims[0], n = s_dims[2];
  if (k != s_dims[1] * kBlock || codes.element_count() != static_cast<size_t>(num_layers * k * n) ||
      mins.element_count() != scales.element_count() || n % 16 != 0)
    return ffi::Error::InvalidArgument("gguf_matmul: codes [L, K, N], scales/mins [L, K/32, N], N % 16 == 0");
  // On the CPU every buffer is host memory: the layer index is read here, where the call runs.
  const int64_t layer = *layer_buffer.typed_data();
  if (layer < 0 || layer >= num_layers)
    return ffi::Error::InvalidArgument("gguf_matmul: layer index out of range");
  auto shared = std::make_shared<Shared>();
  const int64_t blocks = layer * (k / kBlock) * n;  // scales (and mins) before this layer's
  shared->problem = {x.typed_data(), codes.typed_data() + blocks * kBlock, scales.typed_data() + blocks,
                     mins.typed_data() + blocks, y->typed_data(), m, k, n};
  shared->num_tasks = (n + kChunk - 1) / kChunk;
  if (m == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), shared->num_tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  // Every task has been taken; wait for the ones helpers are still computing.
  while (shared->done.load(std::memory_order_acquire) < shared->num_tasks) pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_gguf_matmul, GgufMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
