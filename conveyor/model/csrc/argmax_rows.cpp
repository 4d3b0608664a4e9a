// Greedy sampling's argmax: each row's first largest logit, as torch's `max(dim=-1).indices` gives it (the first
// NaN where a row holds one, since torch's max propagates NaN), without a float32 copy and without torch's
// generic reduction.
//
//   logits [rows, vocab] float32 or bfloat16, rows contiguous -> [rows] int64
//
// Two passes per row: the largest value (four independent accumulators), then the first lane equal to it (the
// row, 96 KiB in bfloat16, is still in L2). Rows are split over the OpenMP threads.
#include "kernels.h"

#include <cstdint>
#include <cstring>

#include "vec_bf16.h"

namespace {

using conveyor_vec::to_float;

using conveyor_vec::is_nan;

// -inf from its bit pattern (the same value as -std::numeric_limits<float>::infinity()).
inline float minus_infinity() {
  const uint32_t bits = 0xFF800000u;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Portable: the first NaN, else the first largest value.
template <typename T>
int64_t first_argmax_scalar(const T* row, int64_t vocab) {
  int64_t best_index = 0;
  float best = to_float(row[0]);
  for (int64_t t = 0; t < vocab; ++t) {
    const float v = to_float(row[t]);
    if (is_nan(v)) return t;
    if (v > best) {
      best = v;
      best_index = t;
    }
  }
  return best_index;
}

#if defined(CONVEYOR_VEC_AVX512)
using conveyor_vec::load16;

template <typename T>
int64_t first_argmax(const T* row, int64_t vocab) {
  const __m512 lowest = _mm512_set1_ps(minus_infinity());
  __m512 best[4] = {lowest, lowest, lowest, lowest};
  __mmask16 unordered = 0;  // lanes that met a NaN
  int64_t t = 0;
  for (; t + 64 <= vocab; t += 64) {
    for (int j = 0; j < 4; ++j) {
      const __m512 v = load16(row + t + 16 * j);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best[j] = _mm512_max_ps(best[j], v);
    }
  }
  for (; t < vocab; t += 16) {
    const __mmask16 lanes = conveyor_vec::tail_mask(vocab - t);
    const __m512 v = load16(row + t, lanes);
    unordered |= _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);
    best[0] = _mm512_mask_max_ps(best[0], lanes, best[0], v);
  }
  if (unordered) return first_argmax_scalar(row, vocab);  // torch's answer is the first NaN: rare, so plainly
  const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(best[0], best[1]), _mm512_max_ps(best[2], best[3])));
  const __m512 target = _mm512_set1_ps(peak);
  for (t = 0; t < vocab; t += 16) {
    const __mmask16 lanes = conveyor_vec::tail_mask(vocab - t);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, load16(row + t, lanes), target, _CMP_EQ_OQ);
    if (hit) return t + __builtin_ctz(static_cast<uint32_t>(hit));
  }
  return 0;  // not reached: peak is one of the row's values
}
#else
template <typename T>
int64_t first_argmax(const T* row, int64_t vocab) { return first_argmax_scalar(row, vocab); }
#endif

}  // namespace

namespace conveyor_ops {

void argmax_rows(conveyor::DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t stride,
                 int64_t* tokens) {
  const bool is_float = dtype == conveyor::DType::kFloat;
  const float* f32 = is_float ? static_cast<const float*>(logits) : nullptr;
  const conveyor::BFloat16* bf16 = is_float ? nullptr : static_cast<const conveyor::BFloat16*>(logits);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    tokens[i] = is_float ? first_argmax(f32 + i * stride, vocab) : first_argmax(bf16 + i * stride, vocab);
  }
}

}  // namespace conveyor_ops
