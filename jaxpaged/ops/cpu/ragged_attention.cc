// Ragged attention on the CPU: any mix of prompt chunks and decode tokens against their pages, read in
// place (the steps paged_attention.cc, decode only, does not take).
//
//   q                float32 [T, N, H]          the step's tokens (N = K * G query heads)
//   kv_pages         float32 [L, 2, K, P, S, H] the model's whole KV buffer (axis 1: K, V)
//   block_tables     int32   [B, pages_per_seq] page ids of each sequence
//   seq_lens         int32   [B]                keys of each sequence, this step's included
//   query_start_loc  int32   [B + 1]            sequence b owns tokens query_start_loc[b] .. [b + 1] - 1
//   layer            int32   []                 which layer's pages
//   sinks            float32 [N]                one more logit per query head (gpt-oss), of value 0; -inf: none
//   out              float32 [T, N, H]          zeros for padding tokens (at or past query_start_loc[B])
//   attributes: scale (float32), window (int64; 0: none, else a token sees its last `window` keys)
//
// Token t of sequence b sits at position seq_lens[b] - q_len + (t - query_start_loc[b]) and sees the
// keys up to it (ops/attention.py, the oracle); one at a negative position sees none and gets zeros. XLA's program for a prompt chunk (`_by_query_block`)
// copies each sequence's keys into chunks and scores them against a whole 64-token block, masked. Here
// a task is one (sequence, KV head, block of up to 32 of its tokens), and walks the pages it needs:
//
//   keys^T of the page [H, 16]: transposed once per task and page, in L1
//   per 4 query rows (token, query head): 16 scores per row as one vector, sum over h of
//     q[row, h] * keys^T[h]; masked (causal, window, page_size); online softmax (max m, sum l);
//     then acc[row] += weights . values, the page's values read once per 4 rows
//   rows whose tokens sit before the page, or past its window, skip it
//
// Slots a sequence does not own are never read. Tasks go out longest first (common.h's counter).

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
using jaxpaged::i32x16;
using jaxpaged::load_f32;
using jaxpaged::splat;
using jaxpaged::store_f32;

constexpr int kMaxPage = 16;     // keys of a page scored as one vector
constexpr int64_t kBlock = 32;   // tokens of one sequence per task
constexpr int kRows = 8;         // query rows scored together against a page
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  const float* q;
  const float* kv;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* sinks;
  float* out;
  int64_t num_heads, num_kv_heads, group, head_dim, num_pages, page_size, pages_per_seq, layer, window;
  float scale;
  std::atomic<bool>* bad_page;
};

struct Task {
  int32_t seq, head, first, last;  // tokens first .. last - 1 of the step
  int64_t cost;
};

// One stage of a 16 x 16 transpose: rows i and i + b (i & b == 0) swap the off-diagonal halves of
// their 2b x 2b blocks. Lane l of the new row i: row i's lane l where l & b is 0, else row i + b's lane
// l - b; of the new row i + b: row i's lane l + b where l & b is 0, else row i + b's lane l.
template <int b>
inline void transpose_stage(f32x16 r[16]) {
#define LO(l) (((l) & b) ? 16 + (l) - b : (l))
#define HI(l) (((l) & b) ? 16 + (l) : (l) + b)
  for (int i = 0; i < 16; ++i) {
    if (i & b) continue;
    const f32x16 x = r[i], y = r[i + b];
    r[i] = __builtin_shufflevector(x, y, LO(0), LO(1), LO(2), LO(3), LO(4), LO(5), LO(6), LO(7), LO(8), LO(9), LO(10), LO(11), LO(12), LO(13), LO(14), LO(15));
    r[i + b] = __builtin_shufflevector(x, y, HI(0), HI(1), HI(2), HI(3), HI(4), HI(5), HI(6), HI(7), HI(8), HI(9), HI(10), HI(11), HI(12), HI(13), HI(14), HI(15));
  }
#undef LO
#undef HI
}

inline void transpose16(f32x16 r[16]) {  // rows 0 .. 15 of 16 floats, transposed in place
  transpose_stage<8>(r);
  transpose_stage<4>(r);
  transpose_stage<2>(r);
  transpose_stage<1>(r);
}

// Scores, masks and folds one page into rows r0 .. r0 + n - 1 (n <= kRows) of the task's state.
// Row r0 + i sees the page's lanes row_lo[i] .. row_hi[i] - 1. The sums l are kept per lane (l[r] is
// 16 floats), added up once at the end.
template <int n>
void fold_page(const Problem& p, const float* keys_t, const float* values, int64_t r0, const float* q,
               float* acc, float* m, float* l, const int64_t* row_lo, const int64_t* row_hi, int64_t j0,
               int64_t j1) {
  const int64_t H = p.head_dim, V = H / 16;
  f32x16 s[n];
  for (int i = 0; i < n; ++i) s[i] = f32x16{};
  for (int64_t h = 0; h < H; ++h) {
    const f32x16 k = load_f32(keys_t + h * kMaxPage);
    for (int i = 0; i < n; ++i) s[i] += splat(q[(r0 + i) * H + h]) * k;
  }
  i32x16 lane;
  for (int j = 0; j < kMaxPage; ++j) lane[j] = j;
  alignas(64) float w[n][kMaxPage];  // the weights, broadcast from memory in the PV loop
  float correction[n];
  bool any = false;
  for (int i = 0; i < n; ++i) {
    const auto visible = (lane >= static_cast<int32_t>(row_lo[i])) & (lane < static_cast<int32_t>(row_hi[i]));
    s[i] = visible ? s[i] : splat(kNegInf);
    const float page_max = jaxpaged::max(s[i]);
    float* mi = m + r0 + i;
    if (page_max == kNegInf) {  // nothing of this page is visible to the row
      store_f32(w[i], f32x16{});
      correction[i] = 1.0f;
      continue;
    }
    any = true;
    correction[i] = 1.0f;
    if (page_max > *mi) {  // a new running max: what was summed so far is rescaled
      correction[i] = *mi == kNegInf ? 0.0f : std::exp(*mi - page_max);
      *mi = page_max;
    }
    const f32x16 weights = visible ? exp16(s[i] - splat(*mi)) : f32x16{};
    store_f32(w[i], weights);
    float* li = l + (r0 + i) * 16;
    store_f32(li, load_f32(li) * splat(correction[i]) + weights);
  }
  if (!any) return;
  for (int64_t v = 0; v < V; ++v) {
    f32x16 a[n];
    for (int i = 0; i < n; ++i) a[i] = load_f32(acc + (r0 + i) * H + 16 * v) * splat(correction[i]);
    for (int64_t j = j0; j < j1; ++j) {
      const f32x16 value = load_f32(values + j * H + 16 * v);
      for (int i = 0; i < n; ++i) a[i] += splat(w[i][j]) * value;
    }
    for (int i = 0; i < n; ++i) store_f32(acc + (r0 + i) * H + 16 * v, a[i]);
  }
}

void attend(const Problem& p, const Task& task) {
  const int64_t G = p.group, H = p.head_dim, S = p.page_size, K = p.num_kv_heads, k = task.head, b = task.seq;
  const int64_t q_start = p.query_start_loc[b], q_len = p.query_start_loc[b + 1] - q_start;
  const int64_t seq_len = p.seq_lens[b], len = std::min<int64_t>(seq_len, p.pages_per_seq * S);
  const int64_t tokens = task.last - task.first, rows = tokens * G;
  // This thread's scratch, kept across tasks and calls: scaled queries and accumulators [rows, H], the
  // running max m and sum l per row, a page's keys transposed [H, 16].
  thread_local std::vector<float> scratch;
  scratch.resize(2 * rows * H + 17 * rows + H * kMaxPage + 16);
  float* q = scratch.data();
  float* acc = q + rows * H;
  float* l = acc + rows * H;
  float* m = l + 16 * rows;
  float* keys_t = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(m + rows) + 63) & ~uintptr_t{63});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < G * H; ++i) q[t * G * H + i] = p.q[((task.first + t) * p.num_heads + k * G) * H + i] * p.scale;
  std::fill(acc, acc + rows * H, 0.0f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + 16 * rows, 0.0f);
  // Positions of the task's first and last token; keys past len have no page and stay unseen.
  const int64_t pos0 = seq_len - q_len + (task.first - q_start);
  const int64_t last_key = std::min(pos0 + tokens - 1, len - 1);
  const int64_t first_key = std::max<int64_t>(0, p.window > 0 ? pos0 - p.window + 1 : 0);
  const int64_t head_stride = p.num_pages * S * H;
  const float* keys_of_head = p.kv + ((p.layer * 2 + 0) * K + k) * head_stride;
  const float* values_of_head = p.kv + ((p.layer * 2 + 1) * K + k) * head_stride;
  for (int64_t i = first_key / S; i * S <= last_key; ++i) {
    const int32_t page = p.block_tables[b * p.pages_per_seq + i];
    if (page < 0 || page >= p.num_pages) {
      p.bad_page->store(true);
      return;
    }
    const int64_t base = i * S;
    const int64_t j0 = std::max(first_key, base) - base, j1 = std::min(last_key + 1, base + S) - base;
    const float* keys = keys_of_head + page * S * H;
    for (int64_t c = 0; c < H; c += 16) {  // 16 dims of the page's keys at a time, unowned slots as zeros
      f32x16 block[16];
      for (int64_t j = 0; j < kMaxPage; ++j) block[j] = j >= j0 && j < j1 ? load_f32(keys + j * H + c) : f32x16{};
      transpose16(block);
      for (int64_t h = 0; h < 16; ++h) store_f32(keys_t + (c + h) * kMaxPage, block[h]);
    }
    // Tokens that see some key of lanes j0 .. j1 - 1: position >= base + j0 and (window) position -
    // window + 1 <= base + j1 - 1.
    const int64_t t_lo = std::max<int64_t>(0, base + j0 - pos0);
    const int64_t t_hi = p.window > 0 ? std::min<int64_t>(tokens, base + j1 - 1 + p.window - pos0) : tokens;
    int64_t row_lo[kRows], row_hi[kRows];
    for (int64_t r = t_lo * G; r < t_hi * G; r += kRows) {
      const int64_t n = std::min<int64_t>(kRows, t_hi * G - r);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = pos0 + (r + i) / G;  // the row's token's position, and its keys in this page
        row_lo[i] = std::max(j0, (p.window > 0 ? pos - p.window + 1 : 0) - base);
        row_hi[i] = std::min(j1, pos + 1 - base);
      }
      const float* values = values_of_head + page * S * H;
      switch (n) {
#define FOLD(rows) \
  case rows: fold_page<rows>(p, keys_t, values, r, q, acc, m, l, row_lo, row_hi, j0, j1); break;
        FOLD(8) FOLD(7) FOLD(6) FOLD(5) FOLD(4) FOLD(3) FOLD(2) FOLD(1)
#undef FOLD
      }
    }
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float sum = jaxpaged::sum(load_f32(l + 16 * r));
      // The sink joins the sum at the common max (sink -inf: c = 1 and total = sum, the plain 1 / sum).
      const float sink = p.sinks[k * G + g], m_new = std::max(m[r], sink);
      const float c = sum > 0.0f ? std::exp(m[r] - m_new) : 0.0f, total = sum * c + std::exp(sink - m_new);
      const f32x16 inverse = splat(sum > 0.0f ? c / total : 0.0f);  // no visible key: zeros
      float* out = p.out + ((task.first + t) * p.num_heads + k * G + g) * H;
      for (int64_t v = 0; v < H / 16; ++v) store_f32(out + 16 * v, load_f32(acc + r * H + 16 * v) * inverse);
    }
}

ffi::Error RaggedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_pages,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                           ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> layer_buffer,
                           ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float scale,
                           int64_t window) {
  const auto qd = q.dimensions(), kvd = kv_pages.dimensions(), btd = block_tables.dimensions();
  if (qd.size() != 3 || kvd.size() != 6 || btd.size() != 2 || kvd[1] != 2)
    return ffi::Error::InvalidArgument("ragged_attention: q [T, N, H], kv_pages [L, 2, K, P, S, H], block_tables [B, pages]");
  const int64_t num_tokens = qd[0], num_heads = qd[1], head_dim = qd[2], num_kv_heads = kvd[2], batch = btd[0];
  if (kvd[5] != head_dim || head_dim % 16 || num_heads % num_kv_heads || kvd[4] > kMaxPage ||
      seq_lens.element_count() != static_cast<size_t>(batch) ||
      query_start_loc.element_count() != static_cast<size_t>(batch + 1) ||
      sinks.element_count() != static_cast<size_t>(num_heads))
    return ffi::Error::InvalidArgument("ragged_attention: head_dim % 16 == 0, N % K == 0, page_size <= 16, "
                                       "seq_lens [B], query_start_loc [B + 1], sinks [N]");
  const int64_t layer = *layer_buffer.typed_data();
  if (layer < 0 || layer >= kvd[0]) return ffi::Error::InvalidArgument("ragged_attention: layer index out of range");
  const int32_t* starts = query_start_loc.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  if (starts[0] < 0 || starts[batch] > num_tokens)
    return ffi::Error::InvalidArgument("ragged_attention: query_start_loc runs outside the step's tokens");
  std::vector<Task> tasks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = starts[b + 1] - starts[b];
    if (q_len < 0) return ffi::Error::InvalidArgument("ragged_attention: query_start_loc decreases");
    for (int64_t first = starts[b]; first < starts[b + 1]; first += kBlock) {
      const int64_t last = std::min<int64_t>(first + kBlock, starts[b + 1]);
      const int64_t keys = lens[b] - (starts[b + 1] - last);  // the block's last token sees this many
      for (int64_t k = 0; k < num_kv_heads; ++k)
        tasks.push_back({static_cast<int32_t>(b), static_cast<int32_t>(k), static_cast<int32_t>(first),
                         static_cast<int32_t>(last), (last - first) * (window > 0 ? std::min(keys, window) : keys)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  float* result = out->typed_data();
  const int64_t row = num_heads * head_dim;
  std::fill(result, result + starts[0] * row, 0.0f);  // tokens no sequence owns: zeros
  std::fill(result + starts[batch] * row, result + num_tokens * row, 0.0f);
  std::atomic<bool> bad_page{false};
  const Problem problem{q.typed_data(), kv_pages.typed_data(), block_tables.typed_data(), lens, starts,
                        sinks.typed_data(), result,
                        num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim, kvd[3], kvd[4], btd[1], layer,
                        window, scale, &bad_page};
  const Task* task_list = tasks.data();
  jaxpaged::parallel_for(pool, static_cast<int64_t>(tasks.size()),
                         [problem, task_list](int64_t t) { attend(problem, task_list[t]); });
  if (bad_page.load()) return ffi::Error::InvalidArgument("ragged_attention: a block table holds a page id out of range");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxpaged_ragged_attention, RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
