// What the CPU kernels (gguf_matmul.cc, dense_matmul.cc, paged_attention.cc, ragged_attention.cc)
// share: 16-float vectors and a parallel loop over XLA's intra-op threads.
//
// GCC vector extensions keep the kernels free of intrinsics: AVX-512 registers where the CPU has
// them, two AVX2 halves otherwise (the kernels are compiled with -march=native: ../cpu_kernels.py).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_f32(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

inline f32x16 splat(float x) { return f32x16{} + x; }

inline float sum(f32x16 v) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

inline float max(f32x16 v) {  // the largest lane, by halving
  v = v > __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) ? v :
      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) ? v :
      __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) ? v :
      __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return std::max(v[0], v[1]);
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// exp(x) for x <= 0 (attention scores minus their running max): a degree-6 polynomial after range
// reduction to [-ln2/2, ln2/2], relative error ~1e-7 there; below -87 it flushes to the smallest normal.
inline f32x16 exp16(f32x16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const f32x16 round = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * splat(1.44269504088896341f) + round) - round;
  const f32x16 r = (x - n * splat(0.693359375f)) + n * splat(2.12194440e-4f);  // x - n ln2, in two parts
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const f32x16 y = p * r * r + r + splat(1.0f);
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;  // 2^n
  f32x16 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

constexpr int kSpinsBeforeYield = 1024;  // ~20 us of pause instructions

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Runs task(t) for t in [0, num_tasks) on the calling thread and up to num_threads - 1 of the pool's.
// Tasks are handed out by an atomic counter; the caller works too and then waits only for the tasks
// other threads have started. A helper that runs late (its pool busy with other work) finds nothing
// left and returns, so no call ever waits on a queued helper: no deadlock when every pool thread is
// itself inside such a call. The state outlives the call in the helpers' shared_ptr.
template <typename Task>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t num_tasks, Task task) {
  struct State {
    Task task;
    int64_t num_tasks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    State(Task t, int64_t n) : task(std::move(t)), num_tasks(n) {}
    void work() {
      for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
        task(t);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (num_tasks <= 0) return;
  auto state = std::make_shared<State>(std::move(task), num_tasks);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->work(); });
  state->work();
  // Wait for the tasks helpers took: spin briefly, then yield the core. Where the machine's cores are
  // all busy (two test workers or engines on 2 cores), the helper may be waiting for this very core,
  // and spinning on would only delay it.
  for (int spins = 0; state->done.load(std::memory_order_acquire) < num_tasks; ++spins) {
    if (spins < kSpinsBeforeYield)
      pause();
    else
      std::this_thread::yield();
  }
}

}  // namespace jaxpaged
