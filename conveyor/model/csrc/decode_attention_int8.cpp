// Paged decode attention over an int8 KV cache (kv_cache_dtype='int8'; the layout in kv_int8.h): one item
// (sequence, KV head) at a time, for decode_attention.cpp's op, which splits the work and checks the inputs.
// Scores are ((scale * q) . codes) * row scale, and the softmax weights times the row scale multiply the V codes,
// all in float32: attention over the read-back values up to float32 rounding. An AVX-512 path for head_dim 64 or
// 128 and groups up to 8 (attend_item_int8_avx512) reads the pages in place; any other shape or CPU takes the
// portable loops (attend_item_int8).
#include "decode_attention.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kv_int8.h"

namespace conveyor_decode {

namespace {

// A KV head's pages of one item, block by block.
struct PageWalk {
  conveyor_kv_int8::PageLayout layout;
  const int8_t* cache;
  const int64_t* table;
  int64_t kv_head;
  const int8_t* page_of(int64_t block) const { return layout.page(cache, table[block], kv_head); }
  const float* scales_of(const int8_t* p) const { return layout.scales(p); }
  int64_t page_bytes() const { return layout.page_bytes(); }
};

inline PageWalk page_walk(const Item& it, const int8_t* cache) {
  return PageWalk{{it.kv_heads, it.block_size, it.head_dim}, cache, it.table, it.kv_head};
}

// scores [G][ctx] (softmax numerators) -> times each V row's scale, in place: the weights of the V codes.
inline void scale_by_rows(float* scores, int64_t G, int64_t ctx, const PageWalk& values) {
  for (int64_t t0 = 0; t0 < ctx; t0 += values.layout.block_size) {
    const float* row_scales = values.scales_of(values.page_of(t0 / values.layout.block_size));
    const int64_t n = std::min(values.layout.block_size, ctx - t0);
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
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(p[keys.layout.key_code(o, d)]);
      scores[g * it.ctx + t] = dot * keys.scales_of(p)[o];
    }
  }
  std::vector<float> inv_sum(G);
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = 1.f / softmax_numerators(scores + g * it.ctx, it.ctx);
  scale_by_rows(scores, G, it.ctx, values);
  for (int64_t t = 0; t < it.ctx; ++t) {  // pass 2: acc[g] += (p[g][t] * s_t) * codes_t
    const int8_t* row = values.page_of(t / bs) + values.layout.value_code(t % bs, 0);
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
inline void store16(conveyor::BFloat16* p, __m512 v) {
#if defined(CONVEYOR_VEC_BF16)
  conveyor_vec::store_bf16(p, v, 0xFFFF);
#else
  alignas(64) float row[16];
  _mm512_store_ps(row, v);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<conveyor::BFloat16>(row[i]);
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
// every token (12 stores per token at G = 3).
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
      _mm512_store_ps(qs[g] + 16 * j, _mm512_mul_ps(conveyor_vec::load16(q + g * it.q_head_stride + 16 * j),
                                                    _mm512_set1_ps(it.scale)));
  const PageWalk next_keys = next == nullptr ? keys : page_walk(*next, k_cache);
  const int64_t next_blocks = next == nullptr ? 0 : (next->ctx + bs - 1) / bs;
  for (int64_t b = 0; b < blocks; ++b) {  // pass 1: scores, 16 tokens at a time
    const int8_t* p = keys.page_of(b);
    if (b + 1 < blocks) prefetch_page(keys.page_of(b + 1), keys.page_bytes(), 0);
    prefetch_page(values.page_of(b), values.page_bytes(), 1);  // for pass 2
    const float* row_scales = keys.scales_of(p);
    const int64_t first = b * bs, n = std::min(bs, ctx - first);
    for (int64_t o = 0; o < n; o += 16) {
      const __mmask16 lanes = conveyor_vec::tail_mask(n - o);
      __m512 acc[G][U];
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) acc[g][u] = _mm512_setzero_ps();
      const int8_t* column = p + keys.layout.key_code(o, 0);  // dimension d of these tokens: column + d * bs
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
      if (b + 1 < blocks) prefetch_page(values.page_of(b + 1), values.page_bytes(), 0);
      if (next_requested < next_blocks) prefetch_page(next_keys.page_of(next_requested++), next_keys.page_bytes(), 1);
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
  while (next_requested < next_blocks) prefetch_page(next_keys.page_of(next_requested++), next_keys.page_bytes(), 1);
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
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, conveyor::BFloat16>) {
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

}  // namespace

template <typename T>
void attend_int8(const Item& it, const Item* next, const T* q, const int8_t* k_cache, const int8_t* v_cache,
                 float* scores, T* out) {
  if (!attend_int8_avx512(it, next, q, k_cache, v_cache, scores, out))
    attend_item_int8(it, q, k_cache, v_cache, scores, out);
}

template void attend_int8<double>(const Item&, const Item*, const double*, const int8_t*, const int8_t*, float*,
                                  double*);
template void attend_int8<float>(const Item&, const Item*, const float*, const int8_t*, const int8_t*, float*, float*);
template void attend_int8<conveyor::BFloat16>(const Item&, const Item*, const conveyor::BFloat16*, const int8_t*,
                                         const int8_t*, float*, conveyor::BFloat16*);
template void attend_int8<conveyor::Half>(const Item&, const Item*, const conveyor::Half*, const int8_t*, const int8_t*, float*,
                                     conveyor::Half*);

}  // namespace conveyor_decode
