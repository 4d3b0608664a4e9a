// What decode attention's two kernel files share (decode_attention.cpp: exact caches, and the op itself;
// decode_attention_int8.cpp: int8 caches): the work item and the softmax's exponentials.
#pragma once

#include "scalar_types.h"
#include "scalar_types.h"

#include <cmath>
#include <cstdint>

#include "vec_bf16.h"

namespace conveyor_decode {

// s [ctx] -> exp(s - max s) in place; returns their sum. With AVX512_BF16 the exponentials are the inline vector
// exp (conveyor_vec::exp_ps, ~2 ulp): libmvec's expf is a call per 16 values and takes a scalar path per lane for
// arguments that underflow, which a peaked softmax has many of. Without AVX512_BF16, libm's expf per value (the
// kernels are not built with -ffast-math, so it is not vectorized: exact, and only the fallback path).
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

struct Item {  // one (sequence, KV head): where its inputs and outputs live
  int64_t ctx, block_size, kv_heads, kv_head, head_dim, group, q_head_stride;
  const int64_t* table;
  float scale;
};

// One item over an int8 cache [num_blocks, kv_heads, block_size * (head_dim + 4)] (kv_int8.h), into out [group,
// head_dim]; scores holds group * ctx floats. `next` is the item this thread takes after this one (its K pages are
// requested meanwhile), or null. Defined in decode_attention_int8.cpp for the op's dtypes: double, float, bfloat16
// and half.
template <typename T>
void attend_int8(const Item& it, const Item* next, const T* q, const int8_t* k_cache, const int8_t* v_cache,
                 float* scores, T* out);

}  // namespace conveyor_decode
