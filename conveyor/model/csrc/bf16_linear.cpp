// Products with bfloat16 weights packed once at load in AMX's tile layout (conveyor.model.layers.pack_bf16_tiles):
//   bf16_linear_amx: y [rows, out] = x [rows, in] W^T for bfloat16 x, any number of rows, on AMX tiles
//                    (amx_product.cpp), the weights read in place, the next ones prefetched: bfloat16 products
//                    summed in float32, rounded once to bfloat16 (as oneDNN's, up to the order of the sums).
//   bf16_silu_gate_amx: act [rows, inner] = silu(x Wg^T) * (x Wu^T), the gated MLP's first half in one product,
//                    for [Wg; Wu] packed with its rows interleaved (conveyor.model.layers.interleave_gate_up).
//   bf16_linear_argmax_amx: tokens [rows] = argmax over y of each row (the first NaN, else the first largest of the
//                    bfloat16 values bf16_linear_amx would return), y never written: a greedy step's LM head and
//                    argmax in one pass over the weights.
#include <torch/extension.h>

#include "amx_product.h"

bool bf16_amx_available() { return conveyor_amx::available(); }

namespace {

void check_operands(const torch::Tensor& x, const torch::Tensor& tiles) {
  TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == torch::kBFloat16 && tiles.dim() == 4 &&
              tiles.is_contiguous() && tiles.size(2) == 16 && tiles.size(3) == 32 && tiles.size(0) % 2 == 0,
              "tiles must be a contiguous CPU bfloat16 tensor [out / 16 (even), in / 32, 16, 32] from "
              "pack_bf16_tiles, got ", tiles.sizes(), " ", tiles.scalar_type());
  const int64_t in_features = tiles.size(1) * 32;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
              x.size(1) == in_features, "x must be a CPU bfloat16 tensor [rows, ", in_features, "], got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(conveyor_amx::available(), "bf16_linear_amx needs AMX-BF16 (Intel Sapphire Rapids or later) and a "
              "kernel that grants tile data; this CPU or build has none: keep the weights in oneDNN's layout");
}

}  // namespace

torch::Tensor bf16_silu_gate_amx(const torch::Tensor& x, const torch::Tensor& tiles, int64_t inner) {
  check_operands(x, tiles);
  TORCH_CHECK(inner > 0 && inner % 16 == 0 && tiles.size(0) * 16 == 2 * inner, "tiles of ", tiles.size(0) * 16,
              " rows are not the interleaved gate and up rows of an inner width ", inner, " (a multiple of 16)");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const torch::Tensor xc = x.contiguous();  // [rows, in]
  auto act = torch::empty({rows, inner}, x.options());  // [rows, inner]
  if (rows == 0) return act;
  conveyor_amx::product_packed_silu_gate_bf16(xc.data_ptr<c10::BFloat16>(), rows, in_features, inner,
                                              tiles.data_ptr<c10::BFloat16>(), act.data_ptr<c10::BFloat16>());
  return act;
}

torch::Tensor bf16_linear_amx(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features) {
  constexpr int64_t rows_per_block = conveyor_amx::kPackedRowMultiple;
  check_operands(x, tiles);
  const int64_t padded_rows = tiles.size(0) * 16;
  TORCH_CHECK(out_features > padded_rows - rows_per_block && out_features <= padded_rows, "tiles of ", padded_rows,
              " rows (padded to a multiple of ", rows_per_block, ") do not hold ", out_features, " output rows");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const torch::Tensor xc = x.contiguous();  // [rows, in]
  auto y = torch::empty({rows, out_features}, x.options());  // [rows, out]
  if (rows == 0 || out_features == 0) return y;
  conveyor_amx::product_packed_bf16(xc.data_ptr<c10::BFloat16>(), rows, in_features, out_features,
                                    tiles.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  return y;
}

torch::Tensor bf16_linear_argmax_amx(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features) {
  constexpr int64_t rows_per_block = conveyor_amx::kPackedRowMultiple;
  check_operands(x, tiles);
  const int64_t padded_rows = tiles.size(0) * 16;
  TORCH_CHECK(out_features > 0 && out_features > padded_rows - rows_per_block && out_features <= padded_rows,
              "tiles of ", padded_rows, " rows (padded to a multiple of ", rows_per_block, ") do not hold ",
              out_features, " output rows");
  TORCH_CHECK(out_features <= INT32_MAX, "bf16_linear_argmax_amx takes at most 2^31 - 1 outputs, got ", out_features);
  const int64_t rows = x.size(0), in_features = x.size(1);
  const torch::Tensor xc = x.contiguous();  // [rows, in]
  auto tokens = torch::empty({rows}, x.options().dtype(torch::kInt64));  // [rows]
  if (rows == 0) return tokens;
  conveyor_amx::product_packed_argmax_bf16(xc.data_ptr<c10::BFloat16>(), rows, in_features, out_features,
                                           tiles.data_ptr<c10::BFloat16>(), tokens.data_ptr<int64_t>());
  return tokens;
}
