// gguf_amx.cpp's interface to gguf_linear.cpp: GGUF blocks dequantized to bfloat16 tile pieces for the AMX
// product (amx_product.h).
#pragma once

#include "amx_product.h"

namespace conveyor_amx {

// Whether dequantize_tile_row reads GGML type id `kind` (Q4_0, Q8_0, Q4_K, Q6_K where AMX is built).
bool tile_kind(int64_t kind);

// `count` weights of type `kind` (tile_kind) from the block at `blocks` on -> bfloat16 pieces at `out` (as
// WeightRow), rounded as gguf_vnni's dequantize_row_bf16 rounds (the same float operations, then to nearest even).
void dequantize_tile_row(int64_t kind, const uint8_t* blocks, int64_t count, c10::BFloat16* out);

}  // namespace conveyor_amx
