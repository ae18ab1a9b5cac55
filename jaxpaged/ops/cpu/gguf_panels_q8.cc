// y = x @ W for a weight kept as GGUF block codes in 16-column panels (gguf_panels.cc's layout), in
// GGUF's integer arithmetic: x is first quantized to Q8_1 blocks, then each block's products are
// summed as integers. This is the arithmetic vLLM's GGUF layers run on a GPU (ggml_mul_mat_vec_a8 and
// ggml_mul_mat_a8 quantize the activations to Q8_1) and llama.cpp's on a CPU; its results are not
// float32's (each activation is rounded to 1/127 of its block's largest magnitude).
//
//   x       float32 [M, K]     per row and block b of 32 values: dx = max |x| * (1 / 127),
//                              qx = round(x / dx) (to nearest even), int8; sx = dx * sum(qx)
//   codes, scales, mins, layer     as gguf_panels.cc: W[k, c] = scale[b, c] * code[k, c] + min[b, c]
//   y       float32 [M, N]     y[r, c] = sum over b of (scale[b, c] * dx[r, b]) * sum_k code * qx
//                                                       + min[b, c] * sx[r, b]
//
// Every integer sum is exact (a code is 0..255, qx -127..127, 32 of them per block). With AVX512-VNNI
// and VBMI, 4 codes times 4 activations per 32-bit lane in one vpdpbusd: a panel's 64 bytes of four k
// rows (16 bytes each) are turned into 16 lanes of 4 k values by one byte permutation, and each row's
// 4 activations are broadcast. Otherwise the same sums in plain C++.
// Built at first use with the host's compiler (-march=native): ../cpu_kernels.py.

#include <cmath>
#include <vector>

#include "panels.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kBlock = 32;   // GGUF values per scale
constexpr int kPanel = 16;   // columns per panel
constexpr int kMaxRows = 16; // rows of x per pass over a panel
// llama.cpp divides max |x| by 127; a product by the float32 1/127 (within one ulp of it) is what XLA
// computes too (it turns a division into one), so ops/gguf_panels.py's quantize_q8_1 matches bit for bit.
constexpr float kInv127 = 1.0f / 127.0f;

struct Problem {
  int64_t m, k, n;
  const int8_t* qx;     // [m, k]
  const float* dx;      // [m, k / 32]
  const float* sx;      // [m, k / 32]
  const uint8_t* codes; // one layer's panels
  const float* scales;
  const float* mins;
  float* y;
};

// Q8_1 of rows [r0, r1) of x [m, k].
void quantize(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* qx, float* dx, float* sx) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * k + b * kBlock;
      int8_t* q = qx + r * k + b * kBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax * kInv127, inv = d != 0.0f ? 1.0f / d : 0.0f;
      // cvtps_epi32 rounds to nearest even (the default MXCSR mode), as nearbyint below
      const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
      const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(a));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(c));
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
#else
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax * kInv127, inv = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t total = 0;
      for (int i = 0; i < kBlock; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        total += q[i];
      }
#endif
      dx[r * blocks + b] = d;
      sx[r * blocks + b] = d * static_cast<float>(total);
    }
  }
}

// Bytes of codes per block of a panel: 32 k rows of 16 codes, or 16 rows of two packed codes.
template <bool Packed>
constexpr int64_t kBlockBytes = (Packed ? kBlock / 2 : kBlock) * kPanel;

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)

// y[r0 : r0 + R, 16 panel : 16 panel + 16] over all of k.
template <bool Packed, int R>
void tile(const Problem& p, int64_t r0, int64_t panel) {
  const int64_t blocks = p.k / kBlock;
  const uint8_t* codes = p.codes + panel * blocks * kBlockBytes<Packed>;
  // 64 bytes of 4 k rows t = 0..3 of 16 columns c (byte 16 t + c) -> lane c holding rows 0..3 (byte 4 c + t)
  alignas(64) static const uint8_t kOrder[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
      6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i order = _mm512_load_si512(kOrder), nibble = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = codes + b * kBlockBytes<Packed>;
    __builtin_prefetch(block + blocks * kBlockBytes<Packed>, 0, 2);  // the next panel's block
    __m512i w[8];  // w[g]: k rows 4g .. 4g + 3 of the block, 4 codes per column lane
    if constexpr (Packed) {  // byte row j holds k row j (low nibble) and j + 16 (high)
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(block + 64 * g));
        w[g] = _mm512_and_si512(v, nibble);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(block + 64 * g));
    }
    const __m512 scale = _mm512_loadu_ps(p.scales + (panel * blocks + b) * kPanel);
    const __m512 min = _mm512_loadu_ps(p.mins + (panel * blocks + b) * kPanel);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = p.qx + (r0 + r) * p.k + b * kBlock;
      __m512i dot = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        int32_t four;  // qx of k rows 4g .. 4g + 3
        std::memcpy(&four, q + 4 * g, 4);
        dot = _mm512_dpbusd_epi32(dot, w[g], _mm512_set1_epi32(four));
      }
      const int64_t at = (r0 + r) * blocks + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(p.dx[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(p.sx[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.n + panel * kPanel, acc[r]);
}

#else

// The same sums without VNNI: one column at a time.
template <bool Packed, int R>
void tile(const Problem& p, int64_t r0, int64_t panel) {
  const int64_t blocks = p.k / kBlock;
  const uint8_t* codes = p.codes + panel * blocks * kBlockBytes<Packed>;
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kPanel; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = codes + b * kBlockBytes<Packed>;
        const int8_t* q = p.qx + (r0 + r) * p.k + b * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) {
          const int code = Packed ? (block[(i % 16) * kPanel + c] >> (i < 16 ? 0 : 4)) & 15 : block[i * kPanel + c];
          dot += code * q[i];
        }
        const int64_t at = (r0 + r) * blocks + b, s = (panel * blocks + b) * kPanel + c;
        acc += static_cast<float>(dot) * (p.scales[s] * p.dx[at]);
        acc += p.mins[s] * p.sx[at];
      }
      p.y[(r0 + r) * p.n + panel * kPanel + c] = acc;
    }
  }
}

#endif

template <bool Packed, int... Rs>
void rows_of(const Problem& p, int64_t r0, int64_t rows, int64_t panel, std::integer_sequence<int, Rs...>) {
  using Tile = void (*)(const Problem&, int64_t, int64_t);
  static constexpr Tile kTiles[] = {tile<Packed, Rs + 1>...};
  kTiles[rows - 1](p, r0, panel);
}

// Panels [first, last) against every row of x, in passes of up to 16 rows: each pass over all the
// thread's panels, its rows' activations staying in L1 while the panels stream from L2 (the other order,
// each panel against every pass, measured 3-5% slower on SmolLM2's 210 projections at 32 and 64 rows,
// the same at 128: the two builds in alternating processes).
template <bool Packed>
void panel_range(const Problem& p, int64_t first, int64_t last) {
  for (int64_t r0 = 0; r0 < p.m; r0 += kMaxRows)
    for (int64_t panel = first; panel < last; ++panel)
      rows_of<Packed>(p, r0, std::min<int64_t>(kMaxRows, p.m - r0), panel,
                      std::make_integer_sequence<int, kMaxRows>{});
}

ffi::Error GgufPanelsQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::S32> layer_buffer,
                        ffi::ResultBuffer<ffi::F32> y) {
  jaxpaged::PanelCall call;
  if (ffi::Error error = jaxpaged::read_panels("gguf_panels_q8", x, codes, scales, mins, layer_buffer, call);
      !error.success())
    return error;
  const int64_t m = call.m, k = call.k, num_panels = call.n / kPanel;
  const bool packed = call.packed;
  if (m == 0) return ffi::Error::Success();
  thread_local std::vector<int8_t> qx;
  thread_local std::vector<float> dx, sx;
  qx.resize(m * k);
  dx.resize(m * k / kBlock);
  sx.resize(m * k / kBlock);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const float* xs = x.typed_data();
  int8_t* q = qx.data();
  float *d = dx.data(), *s = sx.data();
  // Quantizing 64 rows takes a few microseconds: one task per 64 rows
  const int64_t row_tasks = std::min<int64_t>(threads, (m + 63) / 64);
  jaxpaged::parallel_for(pool, row_tasks, [=](int64_t t) {
    quantize(xs, k, t * m / row_tasks, (t + 1) * m / row_tasks, q, d, s);
  });
  const Problem p{m, k, call.n, q, d, s, call.codes, call.scales, call.mins, y->typed_data()};
  const int64_t tasks = std::min<int64_t>(num_panels, threads);
  jaxpaged::parallel_for(pool, tasks, [p, tasks, packed, num_panels](int64_t t) {
    const int64_t first = t * num_panels / tasks, last = (t + 1) * num_panels / tasks;
    if (packed)
      panel_range<true>(p, first, last);
    else
      panel_range<false>(p, first, last);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_gguf_panels_q8, GgufPanelsQ8, jaxpaged::codes_matmul_binding());
