// Fused residual add + RMSNorm, and the gated MLP activation, for CPU decode steps, where a
// handful of tiny torch ops per layer cost more in dispatch than in arithmetic.
//
// Rounding follows transformers (and conveyor.model.layers) exactly where the dtype is low
// precision: the residual sum is rounded to the dtype, normalised in float32, rounded, then
// multiplied by the weight and rounded again; silu(gate) is rounded before it multiplies up.
// Only the order of the float32 sum of squares differs from torch's.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "stack_parts.h"
#include "vec_bf16.h"

namespace {

// Elements below which an op runs on the calling thread alone (tuned with `conveyor bench decode-step`): a few
// rows' RMSNorm (a single request's decode step) costs about what an OpenMP fork/join does, while a full decode
// batch's rows (64 x 576 of the default model) are worth splitting, also beside other busy processes. Splitting
// never changes the bits: each row is computed by one thread in one order.
constexpr int64_t kInlineElements = int64_t{1} << 13;

#if defined(CONVEYOR_VEC_BF16)
using namespace conveyor_vec;

// bfloat16 row, 16 lanes at a time; same rounding steps as the scalar template below.
void add_rms_norm_row_bf16(conveyor::BFloat16* h, const conveyor::BFloat16* delta, const conveyor::BFloat16* weight,
                           conveyor::BFloat16* out, int64_t dim, float eps) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    __m512 x = load_bf16(h + i, m);
    if (delta != nullptr) {
      x = round_bf16(_mm512_add_ps(x, load_bf16(delta + i, m)));
      store_bf16(h + i, x, m);
    }
    sum = _mm512_fmadd_ps(x, x, sum);
  }
  const float inv_rms = 1.f / std::sqrt(_mm512_reduce_add_ps(sum) / static_cast<float>(dim) + eps);
  const __m512 inv = _mm512_set1_ps(inv_rms);
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(h + i, m), inv));
    store_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i, m), normed), m);
  }
}

void silu_and_mul_row_bf16(const conveyor::BFloat16* gate, const conveyor::BFloat16* up, conveyor::BFloat16* out, int64_t inner) {
  for (int64_t i = 0; i < inner; i += 16) {
    const __mmask16 m = tail_mask(inner - i);
    store_bf16(out + i, silu_times_bf16(load_bf16(gate + i, m), load_bf16(up + i, m)), m);
  }
}
#endif

// Row r of hidden (updated in place to hidden + delta when delta is given) -> out's row r.
template <typename T>
void add_rms_norm_row(T* hr, const T* dr, const T* weight, T* o, int64_t dim, float epsilon) {
#if defined(CONVEYOR_VEC_BF16)
  if constexpr (std::is_same_v<T, conveyor::BFloat16>) {
    add_rms_norm_row_bf16(hr, dr, weight, o, dim, epsilon);
    return;
  }
#endif
  if (dr != nullptr) {
    for (int64_t i = 0; i < dim; ++i) hr[i] = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) {
    const float x = static_cast<float>(hr[i]);
    sum += x * x;
  }
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(dim) + epsilon);
  for (int64_t i = 0; i < dim; ++i) {
    const T normed = static_cast<T>(static_cast<float>(hr[i]) * inv_rms);
    o[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

template <typename T>
void add_rms_norm_kernel(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t dim, double eps) {
  const float epsilon = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, kInlineElements / dim);
  conveyor_parallel::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      add_rms_norm_row(h + r * dim, delta == nullptr ? nullptr : delta + r * dim, weight, out + r * dim, dim, epsilon);
  });
}

template <typename T>
void silu_and_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t inner) {
  const int64_t grain = std::max<int64_t>(1, kInlineElements / inner);
  conveyor_parallel::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * inner;
      const T* up = gate + inner;
      T* o = out + r * inner;
#if defined(CONVEYOR_VEC_BF16)
      if constexpr (std::is_same_v<T, conveyor::BFloat16>) {
        silu_and_mul_row_bf16(gate, up, o, inner);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) {
        const float g = static_cast<float>(gate[i]);
        // exp's argument is capped so that it stays finite, as the vector path's (silu(-100) is -0
        // either way).
        const T act = static_cast<T>(g / (1.f + std::exp(std::min(-g, 80.f))));
        o[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

namespace conveyor_ops {

void add_rms_norm(conveyor::DType dtype, void* hidden, const void* delta, const void* weight, void* out, int64_t rows,
                  int64_t dim, double eps) {
  conveyor::dispatch_floating(dtype, [&](auto zero) {
    using T = decltype(zero);
    add_rms_norm_kernel<T>(static_cast<T*>(hidden), static_cast<const T*>(delta), static_cast<const T*>(weight),
                           static_cast<T*>(out), rows, dim, eps);
  });
}

void silu_and_mul(conveyor::DType dtype, const void* gate_up, void* out, int64_t rows, int64_t inner) {
  conveyor::dispatch_floating(dtype, [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_kernel<T>(static_cast<const T*>(gate_up), static_cast<T*>(out), rows, inner);
  });
}

}  // namespace conveyor_ops

void add_rms_norm_rows(conveyor::BFloat16* hidden, const conveyor::BFloat16* delta, const conveyor::BFloat16* weight,
                       conveyor::BFloat16* out, int64_t begin, int64_t end, int64_t dim, double eps) {
  for (int64_t r = begin; r < end; ++r) {
    add_rms_norm_row(hidden + r * dim, delta == nullptr ? nullptr : delta + r * dim, weight, out + r * dim, dim,
                     static_cast<float>(eps));
  }
}
