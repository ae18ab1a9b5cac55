// Decode attention on the CPU: one query token per sequence against its pages, read in place.
//
//   q             float32 [B, N, H]                    one token per sequence (N = K * G query heads)
//   kv_pages      float32 [L, 2, K, P, S, H]           the model's whole KV buffer (axis 1: K, V)
//   block_tables  int32   [B, pages_per_seq]           page ids of each sequence
//   seq_lens      int32   [B]                          keys of each sequence, this step's included (0: padding)
//   layer         int32   []                           which layer's pages
//   out           float32 [B, N, H]                    zeros for padding rows
//   attributes: scale (float32), window (int64; 0: none, else keys len - window .. len - 1)
//
// XLA's program for this (ops/attention.py, `_by_token`) gathers each KV head's pages into a new
// array, then runs batched dots and softmax fusions over it: the keys are written once and read
// twice more. Here a task, one (sequence, KV head), walks the sequence's pages where they lie:
//
//   page = block_tables[b, i]      kv_pages[layer, 0, k, page] : [S, H] keys, 4 KB at S=16, H=64
//   for each of the G query heads of KV head k:
//     scores of the page's S keys (dot products over H, one 16-lane vector of them), masked past
//     seq_len / before the window
//     online softmax: m = max so far, l = sum of exp(s - m), acc = sum of exp(s - m) * v,
//     rescaled by exp(m_old - m_new) when the max grows; out = acc / l at the end
//
// The pages ahead of the one being scored are requested into L2 and L1 (PagePrefetcher).
// Slots a sequence does not own (past its length, before its window) are never read, so a freed
// page's stale values cannot reach the output. The (B x K) tasks are shared out among XLA's
// intra-op threads (common.h). exp is a degree-6 polynomial after range reduction to [-ln2/2, ln2/2]
// (relative error ~1e-7 on the softmax range); the scale is applied to q before the dots.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using jaxpaged::exp16;
using jaxpaged::f32x16;
using jaxpaged::load_f32;
using jaxpaged::splat;
using jaxpaged::store_f32;
using jaxpaged::sum;

// The lane sums of 16 vectors as one vector (lane t: the sum of d[t]), by halving: each level adds
// the two halves of every vector's partial sums, two vectors per output, so 15 adds and 30 shuffles
// in all instead of 16 horizontal sums.
inline f32x16 transpose_sum(f32x16 d[16]) {
  f32x16 e[8], f[4], g[2];
  for (int i = 0; i < 8; ++i)  // e[i]: 8 partials of d[2i], then 8 of d[2i+1]
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // f[i]: 4 partials each of d[4i] .. d[4i+3]
    f[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(e[2 * i], e[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // g[i]: 2 partials each of d[8i] .. d[8i+7]
    g[i] = __builtin_shufflevector(f[2 * i], f[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(f[2 * i], f[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

struct Problem {
  const float* q;
  const float* kv;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* sinks;  // [N]: one more logit per query head (gpt-oss), of value 0; -inf: none
  float* out;
  int64_t num_kv_heads, group, head_dim, num_pages, page_size, pages_per_seq, layer, window;
  float scale;
  std::atomic<bool>* bad_page;
};

constexpr int kMaxPage = 16;  // tokens per page the score vector holds

// The keys and values of `page` (one KV head's pools, `page_floats` floats a page), requested into L2
// (level 2) or L1 (level 3).
template <int level>
inline void prefetch_page(const float* keys_of_head, const float* values_of_head, int64_t page, int64_t page_floats) {
  for (int64_t line = 0; line < page_floats; line += 16) {
    __builtin_prefetch(keys_of_head + page * page_floats + line, 0, level);
    __builtin_prefetch(values_of_head + page * page_floats + line, 0, level);
  }
}

// A walk over one KV head's pages i = begin .. end - 1 of a sequence (`pages`: its block table row;
// page ids outside [0, num_pages) are skipped here and refused by the caller). A sequence's pages lie
// anywhere in the pool, 4 KB per (page, KV head) at 16 tokens of 64 floats, and the hardware prefetcher
// stops at each one's end: requesting only the next page, the decode kernel read keys and values at
// 11-12 GB/s (30 layers, 16 sequences, 128-768 keys, random pages); kAhead pages ahead into L2 and the
// next into L1, 14-16 GB/s (benchmarks/peers/README.md, ninth pass).
struct PagePrefetcher {
  static constexpr int64_t kAhead = 8;
  const int32_t* pages;
  int64_t end, num_pages;
  const float *keys_of_head, *values_of_head;
  int64_t page_floats;

  void request(int64_t i, bool into_l1) const {
    if (i >= end || pages[i] < 0 || pages[i] >= num_pages) return;
    if (into_l1)
      prefetch_page<3>(keys_of_head, values_of_head, pages[i], page_floats);
    else
      prefetch_page<2>(keys_of_head, values_of_head, pages[i], page_floats);
  }
  void start(int64_t begin) const {  // before the walk: its first kAhead pages into L2
    for (int64_t i = begin; i < begin + kAhead; ++i) request(i, false);
  }
  void at(int64_t i) const {  // while page i is used: page i + kAhead into L2, page i + 1 into L1
    request(i + kAhead, false);
    request(i + 1, true);
  }
};

void attend(const Problem& p, int64_t task) {
  const int64_t b = task / p.num_kv_heads, k = task % p.num_kv_heads;
  const int64_t G = p.group, H = p.head_dim, S = p.page_size, V = H / 16;
  float* out = p.out + (b * p.num_kv_heads + k) * G * H;
  const int64_t len = std::min<int64_t>(p.seq_lens[b], p.pages_per_seq * S);
  if (len <= 0) {
    std::fill(out, out + G * H, 0.0f);
    return;
  }
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, len - p.window) : 0;
  // This thread's scratch, kept across tasks and calls (no allocation per task once it has grown):
  // the scaled queries, the accumulators [G, H], the running max m and sum l per query head.
  thread_local std::vector<float> scratch;
  scratch.resize(2 * G * H + 2 * G);
  float *q = scratch.data(), *acc = q + G * H, *m = acc + G * H, *l = m + G;
  for (int64_t i = 0; i < G * H; ++i) q[i] = p.q[(b * p.num_kv_heads + k) * G * H + i] * p.scale;
  std::fill(acc, acc + G * H, 0.0f);
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G, 0.0f);
  const int64_t head_stride = p.num_pages * S * H;                     // one (layer, K|V, head) pool
  const float* keys_of_head = p.kv + ((p.layer * 2 + 0) * p.num_kv_heads + k) * head_stride;
  const float* values_of_head = p.kv + ((p.layer * 2 + 1) * p.num_kv_heads + k) * head_stride;
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t num_seq_pages = (len + S - 1) / S;
  const PagePrefetcher prefetch{p.block_tables + b * p.pages_per_seq, num_seq_pages, p.num_pages,
                                          keys_of_head, values_of_head, S * H};
  prefetch.start(start / S);
  for (int64_t i = start / S; i * S < len; ++i) {
    const int32_t page = p.block_tables[b * p.pages_per_seq + i];
    if (page < 0 || page >= p.num_pages) {
      p.bad_page->store(true);
      std::fill(out, out + G * H, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    const float* keys = keys_of_head + page * S * H;
    const float* values = values_of_head + page * S * H;
    prefetch.at(i);  // the pages ahead, requested while this one is scored
    const int64_t t0 = std::max<int64_t>(0, start - i * S), t1 = std::min<int64_t>(S, len - i * S);
    const auto owned = (lane >= splat(float(t0))) & (lane < splat(float(t1)));  // lanes of this sequence's keys
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * H;
      f32x16 dots[kMaxPage];  // per token: q . k as 16 partial sums
      for (int64_t t = 0; t < kMaxPage; ++t) {
        dots[t] = f32x16{};
        if (t < t0 || t >= t1) continue;  // not this sequence's key (or past page_size): never read
        f32x16 dot = load_f32(qg) * load_f32(keys + t * H);
        for (int64_t v = 1; v < V; ++v) dot += load_f32(qg + 16 * v) * load_f32(keys + t * H + 16 * v);
        dots[t] = dot;
      }
      // lane t: token t's score (masked lanes -inf, then weight 0), all in vector registers
      const f32x16 scores = owned ? transpose_sum(dots) : splat(-std::numeric_limits<float>::infinity());
      const float page_max = jaxpaged::max(scores);
      const float m_new = std::max(m[g], page_max);
      const float correction = m[g] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[g] - m_new);
      m[g] = m_new;
      const f32x16 weights = owned ? exp16(scores - splat(m_new)) : f32x16{};
      l[g] = l[g] * correction + sum(weights);
      float* acc_g = acc + g * H;
      for (int64_t v = 0; v < V; ++v) {
        f32x16 a = load_f32(acc_g + 16 * v) * splat(correction);
        for (int64_t t = t0; t < t1; ++t) a += splat(weights[t]) * load_f32(values + t * H + 16 * v);
        store_f32(acc_g + 16 * v, a);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    // The sink joins the sum at the common max (sink -inf: c = 1 and total = l, the plain acc / l).
    const float sink = p.sinks[k * G + g], m_new = std::max(m[g], sink);
    const float c = std::exp(m[g] - m_new), total = l[g] * c + std::exp(sink - m_new);
    for (int64_t v = 0; v < V; ++v)
      store_f32(out + g * H + 16 * v, load_f32(acc + g * H + 16 * v) * splat(c) / splat(total));
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_pages,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> layer_buffer, ffi::Buffer<ffi::F32> sinks,
                          ffi::ResultBuffer<ffi::F32> out, float scale, int64_t window) {
  const auto qd = q.dimensions(), kvd = kv_pages.dimensions(), btd = block_tables.dimensions();
  if (qd.size() != 3 || kvd.size() != 6 || btd.size() != 2 || kvd[1] != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [B, N, H], kv_pages [L, 2, K, P, S, H], block_tables [B, pages]");
  const int64_t batch = qd[0], num_heads = qd[1], head_dim = qd[2], num_kv_heads = kvd[2];
  if (kvd[5] != head_dim || head_dim % 16 || num_heads % num_kv_heads || kvd[4] > kMaxPage ||
      btd[0] != batch || seq_lens.element_count() != static_cast<size_t>(batch) ||
      sinks.element_count() != static_cast<size_t>(num_heads))
    return ffi::Error::InvalidArgument("paged_attention: head_dim % 16 == 0, N % K == 0, page_size <= 16, B rows "
                                       "everywhere, sinks [N]");
  const int64_t layer = *layer_buffer.typed_data();
  if (layer < 0 || layer >= kvd[0]) return ffi::Error::InvalidArgument("paged_attention: layer index out of range");
  std::atomic<bool> bad_page{false};
  const Problem problem{q.typed_data(), kv_pages.typed_data(), block_tables.typed_data(), seq_lens.typed_data(),
                        sinks.typed_data(), out->typed_data(), num_kv_heads, num_heads / num_kv_heads, head_dim, kvd[3], kvd[4],
                        btd[1], layer, window, scale, &bad_page};
  jaxpaged::parallel_for(pool, batch * num_kv_heads, [problem](int64_t t) { attend(problem, t); });
  if (bad_page.load()) return ffi::Error::InvalidArgument("paged_attention: a block table holds a page id out of range");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
