// What the two matmul kernels share (gguf_matmul.cc: GGUF block codes; dense_matmul.cc: float32
// weights): y = x @ W for one layer of a stacked weight, split over k among XLA's intra-op threads.
//
// Thread t of T takes rows [t K/T, (t+1) K/T) of W (whole GGUF blocks for codes) for every column:
// one contiguous run of the weight, read in order, into its own partial sums: y itself for t = 0,
// its own [m, n] buffer for the others, added into y at the end (split over the threads too above
// 32768 floats). Column tasks (a strip of columns, all of k) read their weights a few cache lines
// per k row at a stride of N, which DRAM serves slowly (benchmarks/peers/README.md, ninth pass).
//
//        n0        n0+32                 a tile is a 32-column strip of W against 8 rows of x: 16
//   k  [ 16 f32 | 16 f32 ]  <- W          vector accumulators, 2 loads and 8 broadcasts per 16
//        x 8 rows broadcast               multiply-adds.
#pragma once

#include <algorithm>
#include <vector>

#include "common.h"

namespace jaxpaged {

struct Matmul {  // x [m, k] and y [m, n], row-major
  const float* x;
  float* y;
  int64_t m, k, n;
};

constexpr int kStrip = 32;       // columns per tile: two vectors
constexpr int kRows = 8;         // rows of x per pass over a strip
constexpr int kPassRows = 512;   // rows of x per pass over the weight: bounds the partial sums

// y[r0:r0+R, n0:n0+16*V] (V vectors of columns: 2, a whole strip, or 1, a 16-column tail) plus the
// `depth` k rows from k0 of w (`width` floats per row, column n0 first), starting from zero (k0 == 0)
// or from what y holds.
template <int R, int V>
void tile(const Matmul& p, const float* w, int64_t width, int64_t depth, int64_t k0, int64_t r0, int64_t n0) {
  f32x16 acc[R][V];
  float* y = p.y + r0 * p.n + n0;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = k0 == 0 ? f32x16{} : load_f32(y + r * p.n + 16 * v);
  const float* x = p.x + r0 * p.k + k0;
  for (int64_t i = 0; i < depth; ++i, w += width) {
    f32x16 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load_f32(w + 16 * v);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * p.k + i];
      for (int v = 0; v < V; ++v) acc[r][v] += xr * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store_f32(y + r * p.n + 16 * v, acc[r][v]);
}

template <int V>
void rows_tail(const Matmul& p, const float* w, int64_t width, int64_t depth, int64_t k0, int64_t r0, int64_t rows,
               int64_t n0) {
  switch (rows) {
    case 1: return tile<1, V>(p, w, width, depth, k0, r0, n0);
    case 2: return tile<2, V>(p, w, width, depth, k0, r0, n0);
    case 3: return tile<3, V>(p, w, width, depth, k0, r0, n0);
    case 4: return tile<4, V>(p, w, width, depth, k0, r0, n0);
    case 5: return tile<5, V>(p, w, width, depth, k0, r0, n0);
    case 6: return tile<6, V>(p, w, width, depth, k0, r0, n0);
    case 7: return tile<7, V>(p, w, width, depth, k0, r0, n0);
    default: return tile<8, V>(p, w, width, depth, k0, r0, n0);
  }
}

// y[:, c0:c1] plus x[:, k0:k0+depth] @ w, w holding those `depth` rows of columns c0 .. c1 - 1 at a
// stride of `width` floats (its column c0 first): every 8-row pass of x over each 32-column strip, so
// w (up to 32 KB) stays in L1 from the first pass to the last.
inline void passes(const Matmul& p, const float* w, int64_t width, int64_t depth, int64_t k0, int64_t c0, int64_t c1) {
  for (int64_t r0 = 0; r0 < p.m; r0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, p.m - r0);
    for (int64_t n0 = c0; n0 < c1; n0 += kStrip) {
      if (c1 - n0 < kStrip)
        rows_tail<1>(p, w + (n0 - c0), width, depth, k0, r0, rows, n0);
      else
        rows_tail<2>(p, w + (n0 - c0), width, depth, k0, r0, rows, n0);
    }
  }
}

// Runs part(slice, t, tasks, partials) for t in [0, tasks), each on its own thread: `slice` is `whole`
// for up to kPassRows of its rows at a time, and thread t adds its range of k into y (t = 0) or
// into partials + (t - 1) * slice.m * n; the partial sums are then added into y.
template <typename Part>
void split_over_k(xla::ffi::ThreadPool& pool, const Matmul& whole, int64_t tasks, Part part) {
  thread_local std::vector<float> partials;  // the sums of threads 1 .. tasks - 1: at most kPassRows x n each
  const int64_t n = whole.n;
  for (int64_t r = 0; r < whole.m; r += kPassRows) {
    const int64_t rows = std::min<int64_t>(kPassRows, whole.m - r);
    const Matmul slice{whole.x + r * whole.k, whole.y + r * n, rows, whole.k, n};
    partials.resize((tasks - 1) * rows * n);
    float* sums = partials.data();
    parallel_for(pool, tasks, [part, slice, tasks, sums](int64_t t) { part(slice, t, tasks, sums); });
    if (tasks == 1) continue;
    // y += the other threads' sums, in `pieces` ranges of whole vectors: one per 32768 floats (128 KB;
    // waking a second thread for less costs more than it saves)
    const int64_t total = rows * n, pieces = std::min<int64_t>(tasks, (total + 32767) / 32768);
    float* out = slice.y;
    parallel_for(pool, pieces, [out, sums, total, pieces, tasks](int64_t piece) {
      const int64_t begin = piece * (total / 16) / pieces * 16, end = (piece + 1) * (total / 16) / pieces * 16;
      for (int64_t i = begin; i < end; i += 16) {
        f32x16 acc = load_f32(out + i);
        for (int64_t t = 1; t < tasks; ++t) acc += load_f32(sums + (t - 1) * total + i);
        store_f32(out + i, acc);
      }
    });
  }
}

}  // namespace jaxpaged
