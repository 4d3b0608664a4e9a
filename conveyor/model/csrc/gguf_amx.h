// gguf_amx.cpp's interface to gguf_linear.cpp: GGUF blocks dequantized to bfloat16 tile pieces for the AMX
// product (amx_product.h).
#pragma once

#include "amx_product.h"

namespace conveyor_amx {

// `count` weights of GGML type `kind` (any of gguf_dequant.h's Kind) from the block at `blocks` on -> bfloat16
// pieces at `out` (as WeightRow), rounded as the float path (gguf_dequant.h) then to nearest even.
void dequantize_tile_row(int64_t kind, const uint8_t* blocks, int64_t count, conveyor::BFloat16* out);

// One tile of 16 weight rows x 32 values as pieces (row r's values at rows + 32 r: the A operand's layout, what
// dequantize_tile_row writes) -> the same values pair-interleaved (value 2 p + h of row r at pairs + 32 p + 2 r + h:
// the B operand's layout, as conveyor.model.layers.pack_bf16_tiles writes it). A 16 x 16 transpose of 32-bit pairs.
void pieces_to_pairs(const conveyor::BFloat16* rows, conveyor::BFloat16* pairs);

}  // namespace conveyor_amx
