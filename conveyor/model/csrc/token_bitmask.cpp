// Structured output: every token a row's grammar forbids set to -inf in the logits, in place.
//
//   logits  [batch, vocab] float32 or bfloat16, rows contiguous
//   rows    [k] int64: which logits rows the k masks belong to (distinct)
//   bitmask [k, words] int32, words = ceil(vocab / 32): token t is allowed iff bit t % 32 of word t / 32 is set
//
// A word with all 32 bits set (the common case outside the grammar's forbidden set) is skipped without
// touching the logits, so the cost is one read of the masks plus one write per forbidden token.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

template <typename T>
void mask_rows(T* logits, int64_t row_stride, int64_t vocab, const int64_t* rows, int64_t k, const uint32_t* bits,
               int64_t words) {
  // -inf from its bit pattern: the sources compile with -ffast-math, under which infinity() is not to be relied on.
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
      for (int64_t b = 0; b < n; ++b) {
        if (!((allowed >> b) & 1u)) row[base + b] = minus_inf;
      }
    }
  }
}

}  // namespace

void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && rows.device().is_cpu() && bitmask.device().is_cpu(),
              "apply_token_bitmask_ is a CPU kernel; got logits on ", logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [batch, vocab] with contiguous rows, got ",
              logits.sizes(), " strides ", logits.strides());
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16,
              "logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(),
              "rows must be a contiguous [k] int64 tensor, got ", rows.sizes(), " ", rows.scalar_type());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [k, words] int32 tensor, got ", bitmask.sizes(), " ", bitmask.scalar_type());
  const int64_t batch = logits.size(0), vocab = logits.size(1), k = rows.size(0), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == k, "bitmask has ", bitmask.size(0), " rows for ", k, " row indices");
  TORCH_CHECK(words * 32 >= vocab, "bitmask has ", words, " words per row, too few for ", vocab, " tokens (need ",
              (vocab + 31) / 32, ")");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < batch, "row index ", row_ids[i], " is outside the ", batch,
                " logits rows");
  }
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  if (logits.scalar_type() == torch::kFloat32) {
    mask_rows(logits.data_ptr<float>(), logits.stride(0), vocab, row_ids, k, bits, words);
  } else {
    mask_rows(logits.data_ptr<at::BFloat16>(), logits.stride(0), vocab, row_ids, k, bits, words);
  }
}
