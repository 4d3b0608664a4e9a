// gguf_amx.cpp's interface to gguf_linear.cpp: GGUF blocks dequantized to bfloat16 tile pieces for the AMX
// product (amx_product.h).
#pragma once

#include "amx_product.h"

namespace conveyor_amx {

// Whether dequantize_tile_row reads GGML type id `kind` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
// where AMX is built).
bool tile_kind(int64_t kind);

// `count` weights of type `kind` (tile_kind) from the block at `blocks` on -> bfloat16 pieces at `out` (as
// WeightRow), rounded as gguf_vnni's dequantize_row_bf16 rounds (the same float operations, then to nearest even).
void dequantize_tile_row(int64_t kind, const uint8_t* blocks, int64_t count, c10::BFloat16* out);

// One tile of 16 weight rows x 32 values as pieces (row r's values at rows + 32 r: the A operand's layout, what
// dequantize_tile_row writes) -> the same values pair-interleaved (value 2 p + h of row r at pairs + 32 p + 2 r + h:
// the B operand's layout, as conveyor.model.layers.pack_bf16_tiles writes it). A 16 x 16 transpose of 32-bit pairs.
void pieces_to_pairs(const c10::BFloat16* rows, c10::BFloat16* pairs);

}  // namespace conveyor_amx
