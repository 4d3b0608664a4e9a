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
// runs the portable loops. An int8 cache (kv_cache_dtype='int8', conveyor/model/kv_int8.py) takes its own pair of
// paths (attend_item_int8_avx512 for head_dim 64 or 128 and groups up to 8, else attend_item_int8), reading its
// pages of codes and scales in place. Built at run time for the CPU it runs on (see
// conveyor/model/native.py), with -ffast-math only for the compile step (vectorized expf where the inline exp is
// not built).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_bf16.h"

namespace {

template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// bfloat16 -> float32 is a 16-bit shift of the bits; written on integers so that it vectorizes.
inline void row_to_float(const c10::BFloat16* src, float* dst, int64_t n) {
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

// s [ctx] -> exp(s - max s) in place; returns their sum. With AVX512_BF16 the exponentials are the inline vector
// exp (conveyor_vec::exp_ps, ~2 ulp): libmvec's expf is a call per 16 values and takes a scalar path per lane for
// arguments that underflow, which a peaked softmax has many of (a 64-sequence step of W1's shapes: 3-5% faster).
inline float softmax_numerators(float* s, int64_t ctx) {
  float peak = s[0];
#pragma omp simd reduction(max : peak)
  for (int64_t t = 0; t < ctx; ++t) peak = s[t] > peak ? s[t] : peak;
#if defined(CONVEYOR_VEC_BF16)
  const __m512 top = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; t += 16) {
    const __mmask16 lanes = conveyor_vec::tail_mask(ctx - t);
    const __m512 e = conveyor_vec::exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + t), top));
    _mm512_mask_storeu_ps(s + t, lanes, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(lanes, e));
  }
  return _mm512_reduce_add_ps(sum);
#else
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < ctx; ++t) {
    s[t] = std::exp(s[t] - peak);
    total += s[t];
  }
  return total;
#endif
}

// scores: [rows, ctx] -> softmax along ctx, in place.
void softmax_rows(float* scores, int64_t rows, int64_t ctx) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * ctx;
    const float inv = 1.f / softmax_numerators(s, ctx);
#pragma omp simd
    for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
  }
}

struct Item {  // one (sequence, KV head): where its inputs and outputs live
  int64_t ctx, block_size, kv_heads, kv_head, head_dim, group, q_head_stride;
  const int64_t* table;
  float scale;
};

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
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return conveyor_vec::load_bf16(p); }

// Rows of a context are scattered over blocks (and interleaved with the other KV heads), which the
// hardware prefetcher follows poorly: each pass requests the row it needs PREFETCH_AHEAD tokens
// ahead. Pass 1 also requests the V rows (into L2) that pass 2 reads next.
constexpr int64_t PREFETCH_AHEAD = 16;

template <typename T, int D>
inline void prefetch_row(const T* row, int hint) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int offset = 0; offset < D * static_cast<int>(sizeof(T)); offset += 64) {
    if (hint == 0) _mm_prefetch(p + offset, _MM_HINT_T0);
    else _mm_prefetch(p + offset, _MM_HINT_T1);
  }
}

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
      prefetch_row<T, D>(base_ + ahead_row, 0);
      if (companion_ != nullptr) prefetch_row<T, D>(companion_ + ahead_row, 1);
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
// (measured: a bare read of the same rows takes ~60% of the two-pass kernel's time):
//  - a row's 32-bit words hold pairs of values: the even values are the words shifted left by 16, the odd ones
//    the words with their low half cleared, one instruction per 16 values (widening 16 at a time takes two);
//    the query rows and the accumulators are kept in that order (even dims of 0..31, odd of 0..31, even of
//    32..63, odd of 32..63) and put back in order once per item;
//  - the scores of four tokens are folded into one 128-bit lane by a transposing add tree, not reduced one by one;
//  - the softmax's 1 / sum scales the accumulators once, not every weight;
//  - while pass 2 multiplies weights by V rows that pass 1 already brought to L2, it requests the next item's K
//    rows, so that memory works while the core computes.
inline void split_row(const c10::BFloat16* row, __m512 (&parts)[4]) {
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
void attend_item_bf16_64(const Item& it, const Item* next, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                         const c10::BFloat16* v_cache, float* scores, c10::BFloat16* out) {
  using T = c10::BFloat16;
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
      prefetch_row<T, D>(next_k + next_ahead.slot() * stride, 1);
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
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (it.head_dim == 64) return attend_avx512_group<T, 4>(it, q, k, v, scores, out);
    if (it.head_dim == 128) return attend_avx512_group<T, 8>(it, q, k, v, scores, out);
  }
  return false;
}
#else
template <typename T>
bool attend_avx512(const Item&, const T*, const T*, const T*, float*, T*) { return false; }
#endif

// ---- int8 caches: [num_blocks, kv_heads, block_size * (head_dim + 4)], per (block, KV head) a page of block_size x
// head_dim int8 codes and then their block_size float32 scales (conveyor/model/kv_int8.py); K pages hold their codes
// dimension by dimension ([head_dim][block_size]), V pages row by row ([block_size][head_dim]). A row reads back as
// codes * scale; scores are ((scale * q) . codes) * row scale, and the softmax weights times the row scale multiply
// the V codes: all in float32, so the result is attention over the read-back values up to float32 rounding.

// A KV head's pages of one item, block by block.
struct PageWalk {
  const int8_t* head_base;  // the cache + kv_head * page
  const int64_t* table;
  int64_t page, page_stride, block_size, head_dim;
  const int8_t* page_of(int64_t block) const { return head_base + table[block] * page_stride; }
  const float* scales_of(const int8_t* p) const { return reinterpret_cast<const float*>(p + block_size * head_dim); }
};

inline PageWalk page_walk(const Item& it, const int8_t* cache) {
  const int64_t page = it.block_size * (it.head_dim + 4);
  return PageWalk{cache + it.kv_head * page, it.table, page, it.kv_heads * page, it.block_size, it.head_dim};
}

// scores [G][ctx] (softmax numerators) -> times each V row's scale, in place: the weights of the V codes.
inline void scale_by_rows(float* scores, int64_t G, int64_t ctx, const PageWalk& values) {
  for (int64_t t0 = 0; t0 < ctx; t0 += values.block_size) {
    const float* row_scales = values.scales_of(values.page_of(t0 / values.block_size));
    const int64_t n = std::min(values.block_size, ctx - t0);
    for (int64_t g = 0; g < G; ++g) {
      float* w = scores + g * ctx + t0;
#pragma omp simd
      for (int64_t o = 0; o < n; ++o) w[o] *= row_scales[o];
    }
  }
}

// Portable path: any head_dim and group.
template <typename T>
void attend_item_int8(const Item& it, const T* q, const int8_t* k_cache, const int8_t* v_cache, float* scores,
                      T* out) {
  const int64_t D = it.head_dim, G = it.group, bs = it.block_size;
  std::vector<float> q_rows(G * D), acc(G * D, 0.f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) q_rows[g * D + d] = static_cast<float>(q[g * it.q_head_stride + d]) * it.scale;
  const PageWalk keys = page_walk(it, k_cache), values = page_walk(it, v_cache);
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 1: scores[g][t] = ((scale * q_g) . codes_t) * s_t
    const int8_t* p = keys.page_of(t / bs);
    const int64_t o = t % bs;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q_rows.data() + g * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(p[d * bs + o]);
      scores[g * it.ctx + t] = dot * keys.scales_of(p)[o];
    }
  }
  std::vector<float> inv_sum(G);
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = 1.f / softmax_numerators(scores + g * it.ctx, it.ctx);
  scale_by_rows(scores, G, it.ctx, values);
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 2: acc[g] += (p[g][t] * s_t) * codes_t
    const int8_t* row = values.page_of(t / bs) + (t % bs) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * it.ctx + t];
      float* a = acc.data() + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(row[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
}

#if defined(CONVEYOR_VEC_AVX512)
// Requests a page's cache lines, at most kPrefetchLines of them (16 tokens of head_dim 128; the hardware prefetcher
// follows a longer page on its own), in a loop of constant length that unrolls.
constexpr int kPrefetchLines = 34;

inline void prefetch_page(const int8_t* p, int64_t bytes, int hint) {
  const char* base = reinterpret_cast<const char*>(p);
#pragma GCC unroll 34
  for (int line = 0; line < kPrefetchLines; ++line) {
    if (line * 64 >= bytes) break;
    if (hint == 0) _mm_prefetch(base + line * 64, _MM_HINT_T0);
    else _mm_prefetch(base + line * 64, _MM_HINT_T1);
  }
}

// 16 float32 -> 16 values of the output's type (bfloat16: round to nearest even, as static_cast does)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(CONVEYOR_VEC_BF16)
  conveyor_vec::store_bf16(p, v, 0xFFFF);
#else
  alignas(64) float row[16];
  _mm512_store_ps(row, v);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::BFloat16>(row[i]);
#endif
}

// 16 int8 codes (lanes outside `lanes` not read, zero) -> 16 float32
inline __m512 load_codes(const int8_t* p, __mmask16 lanes = 0xFFFF) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lanes, p)));
}

// AVX-512 path for G query heads of dimension 16 * V over int8 pages, each read front to back (the next one
// requested while this one is used). Pass 1 takes 16 tokens of a K page at a time, one per lane: per dimension
// one vector of their codes times the query's value, summed over dimensions in U independent accumulators per
// query head (no sums across lanes). Pass 2 keeps the output rows in registers. While pass 2 runs, the next
// item's K pages are requested (to L2), one per page of V used. The small loops over heads and vectors carry
// `#pragma GCC unroll`: unrolled only late, GCC kept the accumulator arrays in memory and stored all of them on
// every token (12 stores per token at G = 3; the kernel ran ~10% slower with its data in L2).
template <typename T, int G, int V>
void attend_item_int8_avx512(const Item& it, const Item* next, const T* q, const int8_t* k_cache,
                             const int8_t* v_cache, float* scores, T* out) {
  constexpr int D = 16 * V;
  constexpr int U = G >= 4 ? 2 : 4;  // accumulators per query head: G * U chains hide the FMA latency
  const int64_t ctx = it.ctx, bs = it.block_size, blocks = (ctx + bs - 1) / bs;
  const PageWalk keys = page_walk(it, k_cache), values = page_walk(it, v_cache);
  alignas(64) float qs[G][D];  // scaled query rows, broadcast one value at a time
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j)
      _mm512_store_ps(qs[g] + 16 * j, _mm512_mul_ps(load16(q + g * it.q_head_stride + 16 * j),
                                                    _mm512_set1_ps(it.scale)));
  const PageWalk next_keys = next == nullptr ? keys : page_walk(*next, k_cache);
  const int64_t next_blocks = next == nullptr ? 0 : (next->ctx + bs - 1) / bs;
  for (int64_t b = 0; b < blocks; ++b) {  // pass 1: scores, 16 tokens at a time
    const int8_t* p = keys.page_of(b);
    if (b + 1 < blocks) prefetch_page(keys.page_of(b + 1), keys.page, 0);
    prefetch_page(values.page_of(b), values.page, 1);  // for pass 2
    const float* row_scales = keys.scales_of(p);
    const int64_t first = b * bs, n = std::min(bs, ctx - first);
    for (int64_t o = 0; o < n; o += 16) {
      const __mmask16 lanes = conveyor_vec::tail_mask(n - o);
      __m512 acc[G][U];
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) acc[g][u] = _mm512_setzero_ps();
      const int8_t* column = p + o;
      for (int d = 0; d < D; d += U) {
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          const __m512 k = load_codes(column + (d + u) * bs, lanes);
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) acc[g][u] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g][d + u]), k, acc[g][u]);
        }
      }
      const __m512 s = _mm512_maskz_loadu_ps(lanes, row_scales + o);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        __m512 sum = acc[g][0];
#pragma GCC unroll 8
        for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[g][u]);
        _mm512_mask_storeu_ps(scores + g * ctx + first + o, lanes, _mm512_mul_ps(sum, s));
      }
    }
  }
  float inv_sum[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) inv_sum[g] = 1.f / softmax_numerators(scores + g * ctx, ctx);  // 1 / sum: at the end
  scale_by_rows(scores, G, ctx, values);
  __m512 acc[G][V];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
  // pass 2: weights times V (pages pass 1 requested), in one flat loop over the tokens; at each page the next
  // page and one of the next item's K pages are requested
  const int8_t* v_row = values.page_of(0);
  int64_t next_requested = 0;
  for (int64_t t = 0, o = 0, b = 0; t < ctx; ++t, ++o, v_row += D) {
    if (o == bs) {
      o = 0;
      v_row = values.page_of(++b);
    }
    if (o == 0) {
      if (b + 1 < blocks) prefetch_page(values.page_of(b + 1), values.page, 0);
      if (next_requested < next_blocks) prefetch_page(next_keys.page_of(next_requested++), next_keys.page, 1);
    }
    __m512 vv[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) vv[j] = load_codes(v_row + 16 * j);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(scores[g * ctx + t]);
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(weight, vv[j], acc[g][j]);
    }
  }
  while (next_requested < next_blocks) prefetch_page(next_keys.page_of(next_requested++), next_keys.page, 1);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {  // straight from the registers
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) store16(out + g * D + 16 * j, _mm512_mul_ps(acc[g][j], inv));
  }
}

template <typename T, int V>
bool attend_int8_group(const Item& it, const Item* next, const T* q, const int8_t* k, const int8_t* v, float* scores,
                       T* out) {
  switch (it.group) {
    case 1: attend_item_int8_avx512<T, 1, V>(it, next, q, k, v, scores, out); return true;
    case 2: attend_item_int8_avx512<T, 2, V>(it, next, q, k, v, scores, out); return true;
    case 3: attend_item_int8_avx512<T, 3, V>(it, next, q, k, v, scores, out); return true;
    case 4: attend_item_int8_avx512<T, 4, V>(it, next, q, k, v, scores, out); return true;
    case 5: attend_item_int8_avx512<T, 5, V>(it, next, q, k, v, scores, out); return true;
    case 6: attend_item_int8_avx512<T, 6, V>(it, next, q, k, v, scores, out); return true;
    case 7: attend_item_int8_avx512<T, 7, V>(it, next, q, k, v, scores, out); return true;
    case 8: attend_item_int8_avx512<T, 8, V>(it, next, q, k, v, scores, out); return true;
    default: return false;
  }
}

template <typename T>
bool attend_int8_avx512(const Item& it, const Item* next, const T* q, const int8_t* k, const int8_t* v,
                        float* scores, T* out) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (it.head_dim == 64) return attend_int8_group<T, 4>(it, next, q, k, v, scores, out);
    if (it.head_dim == 128) return attend_int8_group<T, 8>(it, next, q, k, v, scores, out);
  }
  return false;
}
#else
template <typename T>
bool attend_int8_avx512(const Item&, const Item*, const T*, const int8_t*, const int8_t*, float*, T*) {
  return false;
}
#endif

template <typename T>
void decode_attention_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                             torch::Tensor& out, double scale, int64_t block_size, int64_t kv_heads) {
  const int64_t num_seqs = q.size(0), heads = q.size(1), head_dim = q.size(2), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads, q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = int8_cache ? nullptr : k_cache.data_ptr<T>();
  const T* v_ptr = int8_cache ? nullptr : v_cache.data_ptr<T>();
  const int8_t* k_codes = int8_cache ? k_cache.data_ptr<int8_t>() : nullptr;
  const int8_t* v_codes = int8_cache ? v_cache.data_ptr<int8_t>() : nullptr;
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();

  const auto item = [&](int64_t index) -> Item {  // index = seq * kv_heads + kv_head
    const int64_t seq = index / kv_heads;
    return Item{len_ptr[seq], block_size, kv_heads, index % kv_heads, head_dim, group, q_head_stride,
                table_ptr + seq * max_blocks, static_cast<float>(scale)};
  };
  // One contiguous range of items per thread, of about equal cost (the tokens each reads, plus a few for its
  // setup): a step's sequences differ in length, and equal counts of items (OpenMP's static split) left one
  // thread waiting for the other ~5% of the call on W1's contexts. Each item is computed the same wherever it runs.
  const int64_t items = num_seqs * kv_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds(threads + 1, items);  // thread t takes items bounds[t]..bounds[t + 1] - 1
  bounds[0] = 0;
  {
    constexpr int64_t kItemSetupTokens = 8;
    const auto cost = [&](int64_t seq) { return len_ptr[seq] + kItemSetupTokens; };  // one item of sequence seq
    int64_t total = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) total += cost(seq) * kv_heads;
    int64_t done = 0, t = 1;
    for (int64_t index = 0; index < items && t < threads; ++index) {
      done += cost(index / kv_heads);
      while (t < threads && done * threads >= total * t) bounds[t++] = index + 1;
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t first_range, int64_t end_range) {
    const int64_t begin = bounds[first_range], end = bounds[end_range];
    std::vector<float> scores;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t seq = index / kv_heads, kv_head = index % kv_heads;
      const Item it = item(index);
      scores.resize(group * it.ctx);
      const T* q_item = q_ptr + seq * q_seq_stride + kv_head * group * q_head_stride;
      T* out_item = out_ptr + (seq * heads + kv_head * group) * head_dim;
      const Item following = index + 1 < end ? item(index + 1) : Item{};
      if (int8_cache) {
        if (!attend_int8_avx512(it, index + 1 < end ? &following : nullptr, q_item, k_codes, v_codes, scores.data(),
                                out_item))
          attend_item_int8(it, q_item, k_codes, v_codes, scores.data(), out_item);
        continue;
      }
#if defined(CONVEYOR_VEC_BF16)
      if (attend_bf16_64(it, index + 1 < end ? &following : nullptr, q_item, k_ptr, v_ptr, scores.data(), out_item))
        continue;
#endif
      if (!attend_avx512(it, q_item, k_ptr, v_ptr, scores.data(), out_item))
        attend_item(it, q_item, k_ptr, v_ptr, scores.data(), out_item);
    }
  });
}

}  // namespace

// q [num_seqs, heads, head_dim] (last dim contiguous); k_cache, v_cache [num_blocks, block_size, kv_heads,
// head_dim] contiguous in q's dtype, or int8 caches [num_blocks, kv_heads, block_size * (head_dim + 4)]
// (conveyor/model/kv_int8.py); block_tables [num_seqs, max_blocks] int64; context_lens [num_seqs] int64, each in
// 1..max_blocks * block_size (checked, with the block ids each context uses: a bad one raises instead of reading
// outside the cache). Returns [num_seqs, heads, head_dim] in q's dtype.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_seqs, heads, head_dim] with a contiguous last dim");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the K and V caches must be contiguous, of one shape and dtype");
  const int64_t head_dim = q.size(2);
  int64_t block_size = 0, kv_heads = 0;
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(2) % (head_dim + 4) == 0,
                "int8 caches must be [num_blocks, kv_heads, block_size * (head_dim + 4)]; got ", k_cache.sizes(),
                " for head_dim ", head_dim);
    kv_heads = k_cache.size(1);
    block_size = k_cache.size(2) / (head_dim + 4);
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == head_dim,
                "caches must be [num_blocks, block_size, kv_heads, head_dim] with q's head_dim");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches must share a dtype (or the caches be int8)");
    kv_heads = k_cache.size(2);
    block_size = k_cache.size(1);
  }
  TORCH_CHECK(kv_heads > 0 && block_size > 0 && q.size(1) % kv_heads == 0, "heads (", q.size(1),
              ") must be a multiple of kv_heads (", kv_heads, ", the cache's)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  context_lens.dim() == 1 && context_lens.size(0) == q.size(0) &&
                  context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous(),
              "block_tables [num_seqs, max_blocks] and context_lens [num_seqs] must be contiguous int64");
  // a length past the table or a block id outside the cache would read memory that is not the cache's
  const int64_t capacity = block_tables.size(1) * block_size, num_blocks = k_cache.size(0);
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < q.size(0); ++seq) {
    const int64_t ctx = len_ptr[seq];
    TORCH_CHECK(ctx >= 1 && ctx <= capacity, "context_lens[", seq, "] is ", ctx, "; each must be in 1..", capacity,
                " (block_tables' width ", block_tables.size(1), " x block_size ", block_size, ")");
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b) {
      const int64_t id = table_ptr[seq * block_tables.size(1) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", seq, "][", b, "] is ", id,
                  "; the blocks a context uses must be in 0..", num_blocks - 1, " (the cache's blocks)");
    }
  }
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_kernel<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, out, scale, block_size,
                                      kv_heads);
  });
  return out;
}
