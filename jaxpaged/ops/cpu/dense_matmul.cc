// y = x @ W for a float32 weight stacked over layers, on the CPU (a layer projection of a float engine).
//
//   x       float32 [M, K]          activations, row-major
//   w       float32 [L, K, N]       the whole stack (the model's `q_proj` etc. leaf, out axes merged)
//   layer   int32   []              l: which of the L stacked weights
//   y       float32 [M, N]
//
// Inside the model's scan over layers XLA:CPU slices each layer's weight out of the stack (a
// dynamic-slice fusion: a memcpy of every weight, every step) and hands it to Eigen's GEMM, which packs
// it again. Here the layer's weight is read where it lies, once, each thread one contiguous range of
// its rows (matmul.h), 64 rows x 32 columns (a strip) at a time multiplied by every 8-row pass of x
// while they are in L1. Same float32 products as XLA's dot; the sums over k in another order. Built at first
// use with the host's compiler (-march=native): ../cpu_kernels.py. Before each 32-column strip is
// multiplied, the same columns of the next 64 rows are requested into L2 (prefetcht1; into L1 it was
// slower): SmolLM2's projections of 30 layers at one row take 17-19 instead of 26-30 ms, at 4 rows
// 18-20 instead of 21-23, at 16 rows no less (33 ms; the peers README, tenth pass).

#include "matmul.h"

namespace ffi = xla::ffi;

namespace {

using jaxpaged::Matmul;

constexpr int64_t kDepth = 64;  // rows of W per group

// Thread t of `tasks`: rows [K0, K1) of this layer's weight w [K, N], into y (t = 0) or its partials.
void k_range(const Matmul& whole, const float* w, int64_t t, int64_t tasks, float* partials) {
  const int64_t first = t * whole.k / tasks, last = (t + 1) * whole.k / tasks, n = whole.n;
  Matmul p = whole;  // rows relative to `first`; x keeps its row stride k
  p.x += first;
  if (t > 0) p.y = partials + (t - 1) * p.m * n;
  w += first * n;
  const int64_t rows = last - first;
  for (int64_t k0 = 0; k0 < rows; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, rows - k0);
    const int64_t ahead_depth = std::min(kDepth, rows - (k0 + kDepth));  // the next group of rows, if any
    for (int64_t n0 = 0; n0 < n; n0 += jaxpaged::kStrip) {
      const int64_t width = std::min<int64_t>(jaxpaged::kStrip, n - n0);
      for (int64_t i = 0; i < ahead_depth; ++i)  // this strip's columns in the next group of rows
        for (int64_t c = 0; c < width; c += 16) __builtin_prefetch(w + (k0 + kDepth + i) * n + n0 + c, 0, 2);
      jaxpaged::passes(p, w + k0 * n + n0, n, depth, k0, n0, n0 + width);
    }
  }
}

ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::S32> layer_buffer, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 3 || layer_buffer.element_count() != 1)
    return ffi::Error::InvalidArgument("dense_matmul: x must be [M, K], w [L, K, N], layer a scalar");
  const int64_t m = x_dims[0], k = x_dims[1], num_layers = w_dims[0], n = w_dims[2];
  if (w_dims[1] != k || n % 16 != 0)
    return ffi::Error::InvalidArgument("dense_matmul: w [L, K, N] with x's K, N % 16 == 0");
  // On the CPU every buffer is host memory: the layer index is read here, where the call runs.
  const int64_t layer = *layer_buffer.typed_data();
  if (layer < 0 || layer >= num_layers) return ffi::Error::InvalidArgument("dense_matmul: layer index out of range");
  const float* weight = w.typed_data() + layer * k * n;
  const int64_t tasks = std::min<int64_t>(std::max<int64_t>(1, k / kDepth), std::max<int64_t>(1, pool.num_threads()));
  jaxpaged::split_over_k(pool, Matmul{x.typed_data(), y->typed_data(), m, k, n}, tasks,
                         [weight](const Matmul& slice, int64_t t, int64_t tasks, float* partials) {
                           k_range(slice, weight, t, tasks, partials);
                         });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_dense_matmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
