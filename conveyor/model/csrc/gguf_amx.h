// gguf_amx.cpp's interface to gguf_linear.cpp: the many-rows product on AMX tiles.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <functional>

namespace conveyor_amx {

// Whether this build has the AMX path, the CPU has AMX-BF16 and Linux granted this process the tile data
// (asked once, on the first call).
bool available();

// The bfloat16 values of a weight row are laid out by tiles: its 32-value piece kt at out + kt * kTilePieceStride.
constexpr int64_t kTilePieceStride = 512;

// Values first..first + count - 1 of weight row `row` (0..out_features - 1; first a multiple of 2048, count of the
// row's block size) dequantized to bfloat16 into pieces at `out`.
using WeightRow = std::function<void(int64_t row, int64_t first, int64_t count, c10::BFloat16* out)>;

// Whether dequantize_tile_row reads GGML type id `kind` (Q4_0, Q8_0, Q4_K, Q6_K where AMX is built).
bool tile_kind(int64_t kind);

// `count` weights of type `kind` (tile_kind) from the block at `blocks` on -> bfloat16 pieces at `out` (as
// WeightRow), rounded as gguf_vnni's dequantize_row_bf16 rounds (the same float operations, then to nearest even).
void dequantize_tile_row(int64_t kind, const uint8_t* blocks, int64_t count, c10::BFloat16* out);

// y [rows, out] = x [rows, in] W^T for bfloat16 x and W given by `weight_row` (in a multiple of 32):
// bfloat16 products summed in float32 (AMX TDPBF16PS), rounded once to bfloat16. Runs on torch's intra-op
// threads; only where available().
void product_bf16(const c10::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                  const WeightRow& weight_row, c10::BFloat16* y);

}  // namespace conveyor_amx
