// Paged decode attention for CPUs: one query token per sequence attends over its own KV
// blocks, read in place through the block table (no gather into a padded copy, no mask).
//
// Work item = (sequence, KV head). Its query heads (heads / kv_heads of them: the GQA group)
// share every key and value row it loads. Two passes over the context: scores (q . k in
// float32), then softmax weights times V, accumulated in float32.
//
// With AVX-512 (F/BW/VL) and a common shape (head_dim 64 or 128, group 1..8, float32 or bfloat16) an
// unrolled path keeps the scaled query rows and the output accumulators in registers; bfloat16 at head_dim 64
// with a group of up to 4 (with AVX512_BF16) takes a leaner one (attend_item_bf16_64); any other shape or CPU
// runs the portable loops. An int8 cache (kv_cache_dtype='int8', kv_int8.h) takes its own kernels, in
// decode_attention_int8.cpp, reading its pages of codes and scales in place. Built at run time for the CPU it runs
// on (see conveyor/model/native.py).
//
//   cache (plain):  [num_blocks][block_size][kv_heads][head_dim]    token t of a sequence: block_tables[s][t / bs],
//                                                                   row t % bs
//   item (s, g):    q rows of heads g * group .. (g + 1) * group - 1 -> out rows of the same heads
//
// Tuning constants (`conveyor bench decode-step`): PREFETCH_AHEAD, the K/V rows requested ahead of the one read;
// kItemSetupTokens, an item's fixed cost in tokens for decode_attention_bounds' split.
// Exactness invariant: each item is computed by one thread in one order (tokens ascending), so the bits do not
// depend on the thread count or the split.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "decode_attention.h"
#include "kv_int8.h"
#include "stack_parts.h"
#include "vec_bf16.h"

namespace {

using conveyor_decode::Item;
using conveyor_decode::softmax_numerators;

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// bfloat16 -> float32 is a 16-bit shift of the bits; written on integers so that it vectorizes.
inline void row_to_float(const conveyor::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* wide = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) wide[d] = static_cast<uint32_t>(bits[d]) << 16;
}

inline int64_t slot_of(const int64_t* table, int64_t t, int64_t block_size) {
  return table[t / block_size] * block_size + t % block_size;
}

// Walks the slots of tokens t, t + 1, ... through a block table with no division per token (a 64-bit
// division per token and pass cost more than the arithmetic of a 64-wide head).
class SlotCursor {
 public:
  SlotCursor(const int64_t* table, int64_t block_size, int64_t t)
      : table_(table), block_size_(block_size), block_(t / block_size), offset_(t % block_size) {}
  int64_t slot() const { return table_[block_] * block_size_ + offset_; }
  void next() {
    if (++offset_ == block_size_) {
      offset_ = 0;
      ++block_;
    }
  }

 private:
  const int64_t* table_;
  int64_t block_size_, block_, offset_;
};

// scores: [rows, ctx] -> softmax along ctx, in place.
void softmax_rows(float* scores, int64_t rows, int64_t ctx) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * ctx;
    const float inv = 1.f / softmax_numerators(s, ctx);
#pragma omp simd
    for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
  }
}

// Portable path: any head_dim, group and floating dtype.
template <typename T>
void attend_item(const Item& it, const T* q, const T* k_cache, const T* v_cache, float* scores, T* out) {
  const int64_t D = it.head_dim, G = it.group;
  std::vector<float> q_rows(G * D), acc(G * D, 0.f), row(D);
  for (int64_t g = 0; g < G; ++g) {
    row_to_float(q + g * it.q_head_stride, q_rows.data() + g * D, D);
    for (int64_t d = 0; d < D; ++d) q_rows[g * D + d] *= it.scale;
  }
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 1: scores[g][t] = (scale * q_g) . k_t
    const int64_t slot = slot_of(it.table, t, it.block_size);
    row_to_float(k_cache + (slot * it.kv_heads + it.kv_head) * D, row.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q_rows.data() + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
      scores[g * it.ctx + t] = s;
    }
  }
  softmax_rows(scores, G, it.ctx);
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 2: acc[g] = sum_t p[g][t] * v_t
    const int64_t slot = slot_of(it.table, t, it.block_size);
    row_to_float(v_cache + (slot * it.kv_heads + it.kv_head) * D, row.data(), D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * it.ctx + t];
      float* a = acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
    }
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i]);
}

#if defined(CONVEYOR_VEC_AVX512)
using conveyor_vec::load16;
using conveyor_vec::Request;
using conveyor_vec::request_bytes;

// Rows of a context are scattered over blocks (and interleaved with the other KV heads), which the
// hardware prefetcher follows poorly: each pass requests the row it needs PREFETCH_AHEAD tokens
// ahead. Pass 1 also requests the V rows (into L2) that pass 2 reads next.
constexpr int64_t PREFETCH_AHEAD = 16;

// The rows of tokens 0, 1, 2, ... of one KV head (through the block table), in turn: each call requests the row
// PREFETCH_AHEAD tokens on (to L1) and, where a companion cache is given, that token's row of it (to L2): pass 1
// walks K and brings V on for pass 2.
template <typename T, int D>
class RowStream {
 public:
  RowStream(const Item& it, const T* base, const T* companion)
      : base_(base), companion_(companion), ctx_(it.ctx), stride_(it.kv_heads * D),
        here_(it.table, it.block_size, 0), ahead_(it.table, it.block_size, std::min(PREFETCH_AHEAD, it.ctx)) {}

  const T* next() {
    if (t_ + PREFETCH_AHEAD < ctx_) {
      const int64_t ahead_row = ahead_.slot() * stride_;
      request_bytes<Request::kReadL1, D * sizeof(T)>(base_ + ahead_row);
      if (companion_ != nullptr) request_bytes<Request::kReadL2, D * sizeof(T)>(companion_ + ahead_row);
      ahead_.next();
    }
    const T* row = base_ + here_.slot() * stride_;
    here_.next();
    ++t_;
    return row;
  }

 private:
  const T* base_;
  const T* companion_;
  int64_t ctx_, stride_, t_ = 0;
  SlotCursor here_, ahead_;
};

// AVX-512 path for G query heads of dimension 16 * V: query rows and accumulators in registers.
template <typename T, int G, int V>
void attend_item_avx512(const Item& it, const T* q, const T* k_cache, const T* v_cache, float* scores, T* out) {
  constexpr int D = 16 * V;
  const int64_t ctx = it.ctx;
  const T* k_base = k_cache + it.kv_head * D;
  const T* v_base = v_cache + it.kv_head * D;
  __m512 qv[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j)
      qv[g][j] = _mm512_mul_ps(load16(q + g * it.q_head_stride + 16 * j), _mm512_set1_ps(it.scale));
  RowStream<T, D> keys(it, k_base, v_base);
  for (int64_t t = 0; t < ctx; ++t) {  // pass 1: scores
    const T* k = keys.next();
    __m512 kv[V];
    for (int j = 0; j < V; ++j) kv[j] = load16(k + 16 * j);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int j = 1; j < V; ++j) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
      scores[g * ctx + t] = _mm512_reduce_add_ps(acc);
    }
  }
  softmax_rows(scores, G, ctx);
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  RowStream<T, D> values(it, v_base, nullptr);
  for (int64_t t = 0; t < ctx; ++t) {  // pass 2: weights times V
    const T* v = values.next();
    __m512 vv[V];
    for (int j = 0; j < V; ++j) vv[j] = load16(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * ctx + t]);
      for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
    }
  }
  alignas(64) float row[D];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < V; ++j) _mm512_store_ps(row + 16 * j, acc[g][j]);
    for (int d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(row[d]);
  }
}

#if defined(CONVEYOR_VEC_BF16)
// bfloat16, head_dim 64, a group of up to 4 query heads: the W1 shapes (the default model's 9 / 3 heads, the 1B's
// 32 / 8). Leaner than the path above, for a kernel whose compute and memory stalls add up rather than overlap
// (a bare read of the same rows takes a large share of the two-pass kernel's time):
//  - a row's 32-bit words hold pairs of values: the even values are the words shifted left by 16, the odd ones
//    the words with their low half cleared, one instruction per 16 values (widening 16 at a time takes two);
//    the query rows and the accumulators are kept in that order (even dims of 0..31, odd of 0..31, even of
//    32..63, odd of 32..63) and put back in order once per item;
//  - the scores of four tokens are folded into one 128-bit lane by a transposing add tree, not reduced one by one;
//  - the softmax's 1 / sum scales the accumulators once, not every weight;
//  - while pass 2 multiplies weights by V rows that pass 1 already brought to L2, it requests the next item's K
//    rows, so that memory works while the core computes.
inline void split_row(const conveyor::BFloat16* row, __m512 (&parts)[4]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i low_words = _mm512_loadu_si512(row), high_words = _mm512_loadu_si512(row + 32);
  parts[0] = _mm512_castsi512_ps(_mm512_slli_epi32(low_words, 16));
  parts[1] = _mm512_castsi512_ps(_mm512_and_si512(low_words, high));
  parts[2] = _mm512_castsi512_ps(_mm512_slli_epi32(high_words, 16));
  parts[3] = _mm512_castsi512_ps(_mm512_and_si512(high_words, high));
}

// a, b, c, d -> [sum of a, sum of b, sum of c, sum of d]
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // [4][a b c d]
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

template <int G>
inline __m512 dot_parts(const __m512 (&qv)[G][4], const __m512 (&kv)[4], int g) {
  __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
  acc = _mm512_fmadd_ps(qv[g][1], kv[1], acc);
  acc = _mm512_fmadd_ps(qv[g][2], kv[2], acc);
  return _mm512_fmadd_ps(qv[g][3], kv[3], acc);
}

template <int G>
void attend_item_bf16_64(const Item& it, const Item* next, const conveyor::BFloat16* q, const conveyor::BFloat16* k_cache,
                         const conveyor::BFloat16* v_cache, float* scores, conveyor::BFloat16* out) {
  using T = conveyor::BFloat16;
  constexpr int D = 64;
  const int64_t ctx = it.ctx, stride = it.kv_heads * D;
  const T* k_base = k_cache + it.kv_head * D;
  const T* v_base = v_cache + it.kv_head * D;
  __m512 qv[G][4];  // scaled query rows, split like the keys
  for (int g = 0; g < G; ++g) {
    split_row(q + g * it.q_head_stride, qv[g]);
    for (int j = 0; j < 4; ++j) qv[g][j] = _mm512_mul_ps(qv[g][j], _mm512_set1_ps(it.scale));
  }
  RowStream<T, D> keys(it, k_base, v_base);
  int64_t t = 0;
  for (; t + 4 <= ctx; t += 4) {  // pass 1: scores, four tokens at a time
    __m512 part[4][G];
    for (int u = 0; u < 4; ++u) {
      __m512 kv[4];
      split_row(keys.next(), kv);
      for (int g = 0; g < G; ++g) part[u][g] = dot_parts<G>(qv, kv, g);
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(scores + g * ctx + t, sum4(part[0][g], part[1][g], part[2][g], part[3][g]));
  }
  for (; t < ctx; ++t) {
    __m512 kv[4];
    split_row(keys.next(), kv);
    for (int g = 0; g < G; ++g) scores[g * ctx + t] = _mm512_reduce_add_ps(dot_parts<G>(qv, kv, g));
  }
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = 1.f / softmax_numerators(scores + g * ctx, ctx);  // 1 / sum: at the end
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  // The next item's key rows, requested (to L2) at the pace that spreads them over this pass.
  const int64_t next_ctx = next == nullptr ? 0 : next->ctx, next_per_token = (next_ctx + ctx - 1) / ctx;
  const T* next_k = next == nullptr ? nullptr : k_cache + next->kv_head * D;
  SlotCursor next_ahead(next == nullptr ? it.table : next->table, it.block_size, 0);
  int64_t next_requested = 0;
  RowStream<T, D> values(it, v_base, nullptr);
  for (int64_t u = 0; u < ctx; ++u) {  // pass 2: weights times V
    for (int64_t r = 0; r < next_per_token && next_requested < next_ctx; ++r, ++next_requested, next_ahead.next())
      request_bytes<Request::kReadL2, D * sizeof(T)>(next_k + next_ahead.slot() * stride);
    __m512 vv[4];
    split_row(values.next(), vv);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * ctx + u]);
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
    }
  }
  // 16-bit lanes of (even, odd) -> values 2i, 2i + 1: index i of the first operand, 32 + i of the second
  const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int h = 0; h < 2; ++h) {  // values 32 h .. 32 h + 31
      const __m512i even = _mm512_castsi256_si512(conveyor_vec::to_bf16(_mm512_mul_ps(acc[g][2 * h], inv)));
      const __m512i odd = _mm512_castsi256_si512(conveyor_vec::to_bf16(_mm512_mul_ps(acc[g][2 * h + 1], inv)));
      _mm512_storeu_si512(out + g * D + 32 * h, _mm512_permutex2var_epi16(even, interleave, odd));
    }
  }
}

template <typename T>
bool attend_bf16_64(const Item& it, const Item* next, const T* q, const T* k, const T* v, float* scores, T* out) {
  if constexpr (std::is_same_v<T, conveyor::BFloat16>) {
    if (it.head_dim != 64) return false;
    switch (it.group) {
      case 1: attend_item_bf16_64<1>(it, next, q, k, v, scores, out); return true;
      case 2: attend_item_bf16_64<2>(it, next, q, k, v, scores, out); return true;
      case 3: attend_item_bf16_64<3>(it, next, q, k, v, scores, out); return true;
      case 4: attend_item_bf16_64<4>(it, next, q, k, v, scores, out); return true;
      default: return false;
    }
  }
  return false;
}
#endif

template <typename T, int V>
bool attend_avx512_group(const Item& it, const T* q, const T* k, const T* v, float* scores, T* out) {
  switch (it.group) {
    case 1: attend_item_avx512<T, 1, V>(it, q, k, v, scores, out); return true;
    case 2: attend_item_avx512<T, 2, V>(it, q, k, v, scores, out); return true;
    case 3: attend_item_avx512<T, 3, V>(it, q, k, v, scores, out); return true;
    case 4: attend_item_avx512<T, 4, V>(it, q, k, v, scores, out); return true;
    case 5: attend_item_avx512<T, 5, V>(it, q, k, v, scores, out); return true;
    case 6: attend_item_avx512<T, 6, V>(it, q, k, v, scores, out); return true;
    case 7: attend_item_avx512<T, 7, V>(it, q, k, v, scores, out); return true;
    case 8: attend_item_avx512<T, 8, V>(it, q, k, v, scores, out); return true;
    default: return false;
  }
}

template <typename T>
bool attend_avx512(const Item& it, const T* q, const T* k, const T* v, float* scores, T* out) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, conveyor::BFloat16>) {
    if (it.head_dim == 64) return attend_avx512_group<T, 4>(it, q, k, v, scores, out);
    if (it.head_dim == 128) return attend_avx512_group<T, 8>(it, q, k, v, scores, out);
  }
  return false;
}
#else
template <typename T>
bool attend_avx512(const Item&, const T*, const T*, const T*, float*, T*) { return false; }
#endif

// One layer's decode attention over a step's items, in pointers: q rows seq_stride / head_stride apart; a plain
// cache's k, v in T, or an int8 one's k_codes, v_codes (the others null).
template <typename T>
struct Items {
  const T* q;
  int64_t q_seq_stride, q_head_stride;
  const T* k;
  const T* v;
  const int8_t* k_codes;
  const int8_t* v_codes;
  const int64_t* block_tables;
  int64_t max_blocks;
  const int64_t* context_lens;
  int64_t block_size, heads, kv_heads, head_dim;
  float scale;
  T* out;

  Item item(int64_t index) const {  // index = seq * kv_heads + kv_head
    const int64_t seq = index / kv_heads;
    return Item{context_lens[seq], block_size, kv_heads, index % kv_heads, head_dim, heads / kv_heads,
                q_head_stride, block_tables + seq * max_blocks, scale};
  }
};

// Items [begin, end) of `items`; scores: the caller's scratch.
template <typename T>
void attend_items(const Items<T>& items, int64_t begin, int64_t end, std::vector<float>& scores) {
  const int64_t kv_heads = items.kv_heads, group = items.heads / kv_heads, head_dim = items.head_dim;
  for (int64_t index = begin; index < end; ++index) {
    const int64_t seq = index / kv_heads, kv_head = index % kv_heads;
    const Item it = items.item(index);
    if (static_cast<int64_t>(scores.size()) < group * it.ctx) scores.resize(group * it.ctx);
    const T* q_item = items.q + seq * items.q_seq_stride + kv_head * group * items.q_head_stride;
    T* out_item = items.out + (seq * items.heads + kv_head * group) * head_dim;
    const Item following = index + 1 < end ? items.item(index + 1) : Item{};
    if (items.k_codes != nullptr) {
      conveyor_decode::attend_int8(it, index + 1 < end ? &following : nullptr, q_item, items.k_codes, items.v_codes,
                                   scores.data(), out_item);
      continue;
    }
#if defined(CONVEYOR_VEC_BF16)
    if (attend_bf16_64(it, index + 1 < end ? &following : nullptr, q_item, items.k, items.v, scores.data(), out_item))
      continue;
#endif
    if (!attend_avx512(it, q_item, items.k, items.v, scores.data(), out_item))
      attend_item(it, q_item, items.k, items.v, scores.data(), out_item);
  }
}

template <typename T>
void decode_attention_kernel(const Items<T>& items, int64_t num_seqs, int64_t kv_heads) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(conveyor_parallel::num_threads(), num_seqs * kv_heads));
  const std::vector<int64_t> bounds = decode_attention_bounds(items.context_lens, num_seqs, kv_heads, threads);
  conveyor_parallel::parallel_for(0, threads, 1, [&](int64_t first_range, int64_t end_range) {
    std::vector<float> scores;
    attend_items(items, bounds[first_range], bounds[end_range], scores);
  });
}

}  // namespace

void check_contexts(const int64_t* context_lens, const int64_t* block_tables, int64_t num_seqs, int64_t max_blocks,
                    int64_t block_size, int64_t num_blocks) {
  // a length past the table or a block id outside the cache would read memory that is not the cache's
  const int64_t capacity = max_blocks * block_size;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t ctx = context_lens[seq];
    CONVEYOR_CHECK(ctx >= 1 && ctx <= capacity, "context_lens[", seq, "] is ", ctx, "; each must be in 1..", capacity,
                " (block_tables' width ", max_blocks, " x block_size ", block_size, ")");
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b) {
      const int64_t id = block_tables[seq * max_blocks + b];
      CONVEYOR_CHECK(id >= 0 && id < num_blocks, "block_tables[", seq, "][", b, "] is ", id,
                  "; the blocks a context uses must be in 0..", num_blocks - 1, " (the cache's blocks)");
    }
  }
}

// One contiguous range of items per thread, of about equal cost (the tokens each reads, plus a few for its
// setup): a step's sequences differ in length, and equal counts of items (OpenMP's static split) leave one thread
// waiting for the other. Each item is computed the same wherever it runs.
std::vector<int64_t> decode_attention_bounds(const int64_t* context_lens, int64_t num_seqs, int64_t kv_heads,
                                             int64_t threads) {
  const int64_t items = num_seqs * kv_heads;
  std::vector<int64_t> bounds(threads + 1, items);  // thread t takes items bounds[t]..bounds[t + 1] - 1
  bounds[0] = 0;
  constexpr int64_t kItemSetupTokens = 8;
  const auto cost = [&](int64_t seq) { return context_lens[seq] + kItemSetupTokens; };  // one item of sequence seq
  int64_t total = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) total += cost(seq) * kv_heads;
  int64_t done = 0, t = 1;
  for (int64_t index = 0; index < items && t < threads; ++index) {
    done += cost(index / kv_heads);
    while (t < threads && done * threads >= total * t) bounds[t++] = index + 1;
  }
  return bounds;
}

void decode_attention_items(const conveyor::BFloat16* q, int64_t q_seq_stride, int64_t q_head_stride,
                            const conveyor::BFloat16* k_cache, const conveyor::BFloat16* v_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* context_lens, int64_t block_size, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, double scale, conveyor::BFloat16* out, int64_t begin,
                            int64_t end, std::vector<float>& scores) {
  const Items<conveyor::BFloat16> items{q, q_seq_stride, q_head_stride, k_cache, v_cache, nullptr, nullptr, block_tables,
                                   max_blocks, context_lens, block_size, heads, kv_heads, head_dim,
                                   static_cast<float>(scale), out};
  attend_items(items, begin, end, scores);
}

namespace conveyor_ops {

void decode_attention(conveyor::DType dtype, const void* q, int64_t q_seq_stride, int64_t q_head_stride,
                      const void* k_cache, const void* v_cache, const int8_t* k_codes, const int8_t* v_codes,
                      const int64_t* block_tables, int64_t max_blocks, const int64_t* context_lens, int64_t num_seqs,
                      int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, void* out) {
  conveyor::dispatch_floating(dtype, [&](auto zero) {
    using T = decltype(zero);
    const Items<T> items{static_cast<const T*>(q), q_seq_stride, q_head_stride, static_cast<const T*>(k_cache),
                         static_cast<const T*>(v_cache), k_codes, v_codes, block_tables, max_blocks, context_lens,
                         block_size, heads, kv_heads, head_dim, static_cast<float>(scale), static_cast<T*>(out)};
    decode_attention_kernel<T>(items, num_seqs, kv_heads);
  });
}

}  // namespace conveyor_ops
