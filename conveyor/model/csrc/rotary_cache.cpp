// Rotary embedding of Q and K fused with the KV-cache write, for CPU steps: one pass over a
// token's fused QKV row replaces ~8 small torch ops per layer (slices, neg, cat, two muls, add,
// two index_copy_).
//
// Rounding follows transformers' rotate-half form in the tensor's dtype: q*cos and
// rotate_half(q)*sin are each rounded to the dtype, then their sum is rounded (cos and sin
// arrive already in the dtype, as conveyor.model.layers.RotaryEmbedding.tables gives them). Into an int8 cache
// each K and V row is quantized as conveyor/model/kv_int8.py quantize_rows does, to the same bytes.
//
//   qkv [tokens][heads + 2 kv_heads][head_dim] -> qk [tokens][heads + kv_heads][head_dim] (Q, then rotated K)
//   K, V rows -> cache slot slots[t]: [slot / block_size][slot % block_size][kv_heads][head_dim] (or int8 pages)
//
// Tuning constants (`conveyor bench decode-step`): kInlineElements, below which one thread does it all;
// kWriteAhead, tokens whose cache rows are requested for writing ahead. Each token is done by one thread: the bits
// do not depend on the thread count.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv_int8.h"
#include "stack_parts.h"
#include "vec_bf16.h"

namespace {

// Elements of QKV below which the op runs on the calling thread alone: a few rows take microseconds here, about
// an OpenMP fork/join; a 64-row decode step's (64 x 960) splits over the threads (see norm_act.cpp).
constexpr int64_t kInlineElements = int64_t{1} << 13;

#if defined(CONVEYOR_VEC_BF16)
using namespace conveyor_vec;

// One bfloat16 head, 16 lanes at a time; the same rounding steps as rotate_one below.
void rotate_head_bf16(const conveyor::BFloat16* x, const conveyor::BFloat16* c, const conveyor::BFloat16* s, conveyor::BFloat16* y,
                      int64_t half) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t d = 0; d < half; d += 16) {
    const __mmask16 m = tail_mask(half - d);
    const __m512 x1 = load_bf16(x + d, m), x2 = load_bf16(x + half + d, m);
    const __m512 first = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, load_bf16(c + d, m))),
                                       round_bf16(_mm512_mul_ps(_mm512_sub_ps(zero, x2), load_bf16(s + d, m))));
    const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load_bf16(c + half + d, m))),
                                        round_bf16(_mm512_mul_ps(x1, load_bf16(s + half + d, m))));
    store_bf16(y + d, first, m);
    store_bf16(y + half + d, second, m);
  }
}
#endif

template <typename T>
inline T rotate_one(T x, T partner, T c, T s, bool first_half) {
  // first half: x*cos - partner*sin; second half: x*cos + partner*sin, each product rounded to T
  const T a = static_cast<T>(static_cast<float>(x) * static_cast<float>(c));
  const float p = first_half ? -static_cast<float>(partner) : static_cast<float>(partner);
  const T b = static_cast<T>(static_cast<float>(static_cast<T>(p)) * static_cast<float>(s));
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

// One row (head_dim values) -> int8 codes and a float32 scale, as conveyor/model/kv_int8.py quantize_rows: codes
// round(x * (127 / amax)) (ties to even), scale amax / 127, both quotients in float64 rounded to float32.
template <typename T>
void quantize_row(const T* x, int64_t head_dim, int8_t* codes, float* scale) {
#if defined(CONVEYOR_VEC_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, conveyor::BFloat16>) {
    if (head_dim % 16 == 0) {  // the same arithmetic, 16 values at a time
      __m512 top = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(conveyor_vec::load16(x + d)));
      const float amax16 = _mm512_reduce_max_ps(top);
      const double wide16 = static_cast<double>(amax16);
      const __m512 inverse = _mm512_set1_ps(amax16 > 0.f ? static_cast<float>(127.0 / wide16) : 0.f);
      const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 code = _mm512_roundscale_ps(_mm512_mul_ps(conveyor_vec::load16(x + d), inverse),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + d),
                         _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(high, _mm512_max_ps(low, code)))));
      }
      *scale = static_cast<float>(wide16 / 127.0);
      return;
    }
  }
#endif
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const double wide = static_cast<double>(amax);
  const float inverse = amax > 0.f ? static_cast<float>(127.0 / wide) : 0.f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float code = std::nearbyint(static_cast<float>(x[d]) * inverse);
    codes[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  *scale = static_cast<float>(wide / 127.0);
}

// Where K and V rows go: a plain cache [num_blocks, block_size, kv_heads, head_dim] of T, or (codes != nullptr)
// an int8 one (kv_int8.h), whose K pages hold their codes dimension by dimension and V pages row by row.
template <typename T>
struct CacheRows {
  T* plain;
  int8_t* codes;
  conveyor_kv_int8::PageLayout layout;  // of an int8 cache
  bool keys;

  void write(int64_t slot, const T* rows, int64_t kv_heads, int64_t head_dim) const {
    if (codes == nullptr) {
      std::memcpy(plain + slot * kv_heads * head_dim, rows, kv_heads * head_dim * sizeof(T));
      return;
    }
    const int64_t block = slot / layout.block_size, offset = slot % layout.block_size;
    int8_t row[512];  // head_dim <= 512, checked
    for (int64_t h = 0; h < kv_heads; ++h) {
      int8_t* page = layout.page(codes, block, h);
      float* scale = layout.scales(page) + offset;
      if (!keys) {
        quantize_row(rows + h * head_dim, head_dim, page + layout.value_code(offset, 0), scale);
        continue;
      }
      quantize_row(rows + h * head_dim, head_dim, row, scale);
      for (int64_t d = 0; d < head_dim; ++d) page[layout.key_code(offset, d)] = row[d];
    }
  }
};

// Each token's K and V rows go to a slot of their own, scattered over the cache (a decode step's 64 tokens: 128 rows
// in as many blocks), and a store to a line that is not in the cache waits for the line to be read first: the rows
// of the token kWriteAhead on are requested for writing (PREFETCHW) while a token is rotated, so that those reads
// overlap the work. (An int8 cache's rows are spread over its pages: not requested.)
constexpr int64_t kWriteAhead = 8;

template <typename T>
inline void request_cache_rows(const CacheRows<T>& k_cache, const CacheRows<T>& v_cache, int64_t slot,
                               int64_t values) {
  if (k_cache.codes != nullptr) return;
  conveyor_vec::request_bytes<conveyor_vec::Request::kWrite>(k_cache.plain + slot * values, values * sizeof(T));
  conveyor_vec::request_bytes<conveyor_vec::Request::kWrite>(v_cache.plain + slot * values, values * sizeof(T));
}

// Tokens [begin, end) of rotary_and_cache_kernel's work.
template <typename T>
void rotary_and_cache_tokens(const T* qkv, const T* cos, const T* sin, const CacheRows<T>& k_cache,
                             const CacheRows<T>& v_cache, const int64_t* slots, T* qk, int64_t begin, int64_t end,
                             int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t row = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2;
  const int64_t values = kv_heads * head_dim;  // of a K or V row
  for (int64_t t = begin; t < std::min(end, begin + kWriteAhead); ++t)
    request_cache_rows(k_cache, v_cache, slots[t], values);
  for (int64_t t = begin; t < end; ++t) {
    if (t + kWriteAhead < end) request_cache_rows(k_cache, v_cache, slots[t + kWriteAhead], values);
    const T* src = qkv + t * row;
    const T* c = cos + t * head_dim;
    const T* s = sin + t * head_dim;
    T* dst = qk + t * (heads + kv_heads) * head_dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {  // Q heads, then K heads
      const T* x = src + h * head_dim;
      T* y = dst + h * head_dim;
#if defined(CONVEYOR_VEC_BF16)
      if constexpr (std::is_same_v<T, conveyor::BFloat16>) {
        rotate_head_bf16(x, c, s, y, half);
        continue;
      }
#endif
      for (int64_t d = 0; d < half; ++d) {
        y[d] = rotate_one(x[d], x[d + half], c[d], s[d], true);
        y[d + half] = rotate_one(x[d + half], x[d], c[d + half], s[d + half], false);
      }
    }
    const int64_t slot = slots[t];
    const T* k_rot = dst + heads * head_dim;
    const T* v = src + (heads + kv_heads) * head_dim;
    k_cache.write(slot, k_rot, kv_heads, head_dim);
    v_cache.write(slot, v, kv_heads, head_dim);
  }
}

template <typename T>
void rotary_and_cache_kernel(const T* qkv, const T* cos, const T* sin, const CacheRows<T>& k_cache,
                             const CacheRows<T>& v_cache, const int64_t* slots, T* qk, int64_t tokens, int64_t heads,
                             int64_t kv_heads, int64_t head_dim) {
  const int64_t row = (heads + 2 * kv_heads) * head_dim;
  conveyor_parallel::parallel_for(0, tokens, std::max<int64_t>(1, kInlineElements / row), [&](int64_t begin, int64_t end) {
    rotary_and_cache_tokens(qkv, cos, sin, k_cache, v_cache, slots, qk, begin, end, heads, kv_heads, head_dim);
  });
}

}  // namespace

void check_slots(const int64_t* slots, int64_t tokens, int64_t slots_total) {
  for (int64_t t = 0; t < tokens; ++t)
    CONVEYOR_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot ", slots[t], " is outside the cache (", slots_total,
                " slots)");
}

void rotary_and_cache_rows(const conveyor::BFloat16* qkv, const conveyor::BFloat16* cos, const conveyor::BFloat16* sin,
                           conveyor::BFloat16* k_cache, conveyor::BFloat16* v_cache, const int64_t* slots, conveyor::BFloat16* qk,
                           int64_t begin, int64_t end, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const CacheRows<conveyor::BFloat16> k_rows{k_cache, nullptr, {}, true}, v_rows{v_cache, nullptr, {}, false};
  rotary_and_cache_tokens(qkv, cos, sin, k_rows, v_rows, slots, qk, begin, end, heads, kv_heads, head_dim);
}

namespace conveyor_ops {

void rotary_and_cache(conveyor::DType dtype, const void* qkv, const void* cos, const void* sin, void* k_cache,
                      void* v_cache, int8_t* k_codes, int8_t* v_codes, const conveyor_kv_int8::PageLayout& layout,
                      const int64_t* slots, void* qk, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim) {
  conveyor::dispatch_floating(dtype, [&](auto zero) {
    using T = decltype(zero);
    const CacheRows<T> k_rows{static_cast<T*>(k_cache), k_codes, layout, true};
    const CacheRows<T> v_rows{static_cast<T*>(v_cache), v_codes, layout, false};
    rotary_and_cache_kernel<T>(static_cast<const T*>(qkv), static_cast<const T*>(cos), static_cast<const T*>(sin),
                               k_rows, v_rows, slots, static_cast<T*>(qk), tokens, heads, kv_heads, head_dim);
  });
}

}  // namespace conveyor_ops
