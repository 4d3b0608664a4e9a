// EXPERIMENT, not part of the package (benchmarks/ab_bf16_gemv.py builds it): a native bfloat16 GEMV, measured
// against oneDNN's product over the weights Conveyor packs at load. It did not win (benchmarks/RESULTS.md,
// "Memory, load time, bf16 single-stream, shared machines"), so the engine keeps oneDNN's product.
//
// bfloat16 products for the few rows of a single-stream decode step, over W as stored ([out, in], row-major).
//
// Why: at one row a decode step only has to stream each weight once, so its floor is weight bytes / memory
// bandwidth. This kernel reads W's rows straight from memory in 64-byte pieces and multiplies each piece with
// the activation rows (kept in L1) by vdpbf16ps: 16 float32 lanes, each adding two bf16 products. Four weight
// rows are read side by side (four sequential streams the hardware prefetcher follows, plus a software prefetch
// a few lines ahead); both threads split the output rows. The sums are float32 in k order per lane, reduced
// across lanes at the end of a row; the result is rounded to bfloat16 once (round to nearest even).
//
//   y[m][n] = bf16( sum_k x[m][k] * W[n][k] (+ bias[n]) )     for m < M (a few rows), n < N
//
// Needs AVX512_BF16; built without it the op raises and Python keeps oneDNN's product.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec_bf16.h"  // conveyor/model/csrc


#if defined(CONVEYOR_VEC_BF16)
#include <immintrin.h>

namespace {

constexpr int64_t kRowsPerBlock = 4;       // weight rows read side by side
constexpr int kMaxActRows = 4;             // activation rows per pass (4 x 4 accumulators)
constexpr int64_t kPrefetchBytes = 512;    // how far ahead of each weight stream to prefetch
constexpr int64_t kMinRowsPerTask = 16;    // fewer is not worth a thread

inline __m512bh load_pairs(const c10::BFloat16* p, __mmask32 mask) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p)));
}

// y[m][n0 .. n0 + R) for R <= 4 weight rows and M <= 4 activation rows.
template <int R, int M>
void rows_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K, int64_t n0,
                const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const c10::BFloat16* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + (n0 + r) * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) xs[m] = load_pairs(x + m * ldx + k, 0xFFFFFFFFu);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + k) + kPrefetchBytes, _MM_HINT_T0);
      const __m512bh wr = load_pairs(rows[r] + k, 0xFFFFFFFFu);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wr, xs[m]);
    }
  }
  if (k < K) {  // the last K % 32 columns, masked (masked-off lanes read as zero)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) xs[m] = load_pairs(x + m * ldx + k, mask);
    for (int r = 0; r < R; ++r) {
      const __m512bh wr = load_pairs(rows[r] + k, mask);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wr, xs[m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float b = bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.0f;
    for (int m = 0; m < M; ++m) y[m * ldy + n0 + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + b);
  }
}

template <int M>
void rows_range(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K, int64_t begin, int64_t end,
                const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  int64_t n = begin;
  for (; n + kRowsPerBlock <= end; n += kRowsPerBlock) rows_block<kRowsPerBlock, M>(x, ldx, w, K, n, bias, y, ldy);
  for (; n < end; ++n) rows_block<1, M>(x, ldx, w, K, n, bias, y, ldy);
}

void rows_range_any(int M, const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t K, int64_t begin,
                    int64_t end, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  switch (M) {
    case 1: rows_range<1>(x, ldx, w, K, begin, end, bias, y, ldy); break;
    case 2: rows_range<2>(x, ldx, w, K, begin, end, bias, y, ldy); break;
    case 3: rows_range<3>(x, ldx, w, K, begin, end, bias, y, ldy); break;
    default: rows_range<4>(x, ldx, w, K, begin, end, bias, y, ldy); break;
  }
}

}  // namespace

bool bf16_gemv_vectorized() { return true; }

torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_gemv: x [rows, in] and weight [out, in] must agree on in; got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_gemv: x and weight must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "bf16_gemv: x and weight must be contiguous");
  const int64_t rows = x.size(0), K = x.size(1), N = weight.size(0);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bf16_gemv: bias must be a contiguous bfloat16 [out]");
    b = bias->data_ptr<c10::BFloat16>();
  }
  auto y = torch::empty({rows, N}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Each task takes whole weight rows for every activation row: W is read from memory once.
  at::parallel_for(0, N, kMinRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxActRows) {
      const int M = static_cast<int>(std::min<int64_t>(kMaxActRows, rows - m0));
      rows_range_any(M, xp + m0 * K, K, wp, K, begin, end, b, yp + m0 * N, N);
    }
  });
  return y;
}

#else

bool bf16_gemv_vectorized() { return false; }

torch::Tensor bf16_gemv(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "bf16_gemv needs AVX512_BF16; this build has none (use oneDNN's product)");
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_gemv", &bf16_gemv, py::call_guard<py::gil_scoped_release>(), "x @ W^T, W bfloat16 [out, in] (CPU)");
  m.def("bf16_gemv_vectorized", &bf16_gemv_vectorized, "Whether bf16_gemv was built with AVX512_BF16");
}
