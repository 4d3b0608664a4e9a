// Structured output's grammar masks against the logits, two ways:
//   apply_token_bitmask_: every token a row's grammar forbids set to -inf, in place (any sampling);
//   argmax_allowed:       each masked row's first largest allowed logit (greedy sampling), with no write.
//
//   logits  [batch, vocab] float32 or bfloat16, rows contiguous
//   rows    [k] int64: which logits rows the k masks belong to (distinct)
//   bitmask [k, words] int32, words = ceil(vocab / 32): token t is allowed iff bit t % 32 of word t / 32 is set
//
// Both skip work by whole words: apply_token_bitmask_ leaves an all-ones word's 32 logits untouched and
// writes an all-zeros word's as one run; argmax_allowed reads no logit of an all-zeros word, so a row
// with a few allowed tokens (a number, a keyword) costs a read of its mask and little more. Each row is done by one
// thread in one order (tokens ascending): the result does not depend on the thread count.
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec_bf16.h"

namespace {

template <typename T>
void mask_rows(T* logits, int64_t row_stride, int64_t vocab, const int64_t* rows, int64_t k, const uint32_t* bits,
               int64_t words) {
  // -inf from its bit pattern (the same value as -std::numeric_limits<float>::infinity()).
  const uint32_t minus_inf_bits = 0xFF800000u;
  float minus_inf_float;
  std::memcpy(&minus_inf_float, &minus_inf_bits, sizeof(float));
  const T minus_inf = T(minus_inf_float);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < k; ++i) {
    T* row = logits + rows[i] * row_stride;
    const uint32_t* mask = bits + i * words;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t allowed = mask[w];
      if (allowed == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t n = std::min<int64_t>(32, vocab - base);
      if (allowed == 0) {
        std::fill_n(row + base, n, minus_inf);
        continue;
      }
      for (int64_t b = 0; b < n; ++b) {
        if (!((allowed >> b) & 1u)) row[base + b] = minus_inf;
      }
    }
  }
}

// The bits of word w that are tokens (the last word's bits past the vocabulary are not).
inline uint32_t word_bits(const uint32_t* mask, int64_t w, int64_t vocab) {
  const int64_t n = vocab - w * 32;
  return n >= 32 ? mask[w] : n <= 0 ? 0u : mask[w] & ((1u << n) - 1u);
}

using conveyor_vec::to_float;
#if defined(CONVEYOR_VEC_AVX512)
using conveyor_vec::load16;
#endif

// Index of the first largest logit of `row` among the tokens `mask` allows; 0 when it allows none (where
// argmax over a row of -inf would land). Two passes over the allowed words: the largest value, then the
// first token holding it (float equality is exact: the value is one of the row's own).
template <typename T>
int64_t first_allowed_argmax(const T* row, int64_t vocab, const uint32_t* mask, int64_t words) {
#if defined(CONVEYOR_VEC_AVX512)
  __m512 best_lo = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  __m512 best_hi = best_lo;
  bool any = false;
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t allowed = word_bits(mask, w, vocab);
    if (allowed == 0) continue;
    any = true;
    const __mmask16 lo = static_cast<__mmask16>(allowed), hi = static_cast<__mmask16>(allowed >> 16);
    best_lo = _mm512_mask_max_ps(best_lo, lo, best_lo, load16(row + w * 32, lo));
    if (hi) best_hi = _mm512_mask_max_ps(best_hi, hi, best_hi, load16(row + w * 32 + 16, hi));
  }
  if (!any) return 0;
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(best_lo, best_hi)));
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t allowed = word_bits(mask, w, vocab);
    if (allowed == 0) continue;
    const __mmask16 lo = static_cast<__mmask16>(allowed), hi = static_cast<__mmask16>(allowed >> 16);
    const uint32_t hit = static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(lo, load16(row + w * 32, lo), best, _CMP_EQ_OQ))
        | (hi ? static_cast<uint32_t>(_mm512_mask_cmp_ps_mask(hi, load16(row + w * 32 + 16, hi), best, _CMP_EQ_OQ)) << 16
              : 0u);
    if (hit) return w * 32 + __builtin_ctz(hit);
  }
  return 0;  // not reached: the largest allowed value is in the row
#else
  float best = std::numeric_limits<float>::lowest();
  int64_t best_index = -1;
  for (int64_t w = 0; w < words; ++w) {
    uint32_t allowed = word_bits(mask, w, vocab);
    while (allowed) {
      const int64_t t = w * 32 + __builtin_ctz(allowed);
      allowed &= allowed - 1;
      const float v = to_float(row[t]);
      if (best_index < 0 || v > best) {
        best = v;
        best_index = t;
      }
    }
  }
  return best_index < 0 ? 0 : best_index;
#endif
}

}  // namespace

namespace conveyor_ops {

void check_bitmask_rows(const int64_t* row_ids, int64_t k, int64_t batch, const char* op) {
  for (int64_t i = 0; i < k; ++i) {
    CONVEYOR_CHECK(row_ids[i] >= 0 && row_ids[i] < batch, op, ": row index ", row_ids[i], " is outside the ", batch,
                   " logits rows");
  }
}

void apply_token_bitmask(conveyor::DType dtype, void* logits, int64_t stride, int64_t vocab, const int64_t* row_ids,
                         int64_t k, const uint32_t* bits, int64_t words) {
  if (dtype == conveyor::DType::kFloat) {
    mask_rows(static_cast<float*>(logits), stride, vocab, row_ids, k, bits, words);
  } else {
    mask_rows(static_cast<conveyor::BFloat16*>(logits), stride, vocab, row_ids, k, bits, words);
  }
}

void argmax_allowed(conveyor::DType dtype, const void* logits, int64_t stride, int64_t vocab, const int64_t* row_ids,
                    int64_t k, const uint32_t* bits, int64_t words, int64_t* tokens) {
  const bool is_float = dtype == conveyor::DType::kFloat;
  const float* f32 = is_float ? static_cast<const float*>(logits) : nullptr;
  const conveyor::BFloat16* bf16 = is_float ? nullptr : static_cast<const conveyor::BFloat16*>(logits);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < k; ++i) {
    tokens[i] = is_float ? first_allowed_argmax(f32 + row_ids[i] * stride, vocab, bits + i * words, words)
                         : first_allowed_argmax(bf16 + row_ids[i] * stride, vocab, bits + i * words, words);
  }
}

}  // namespace conveyor_ops
