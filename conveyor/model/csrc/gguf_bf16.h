// gguf_bf16.cpp's interface: GGUF blocks dequantized to bfloat16 pieces of 32 values (AVX-512 BF16).
#pragma once

#include "scalar_types.h"

#include <cstdint>

namespace conveyor_gguf {

// Whether GGML type id `kind` dequantizes to bfloat16 here (every type gguf_dequant.h's Kind names, where the
// build has AVX-512 BF16; none otherwise).
bool bf16_kind(int64_t kind);

// `count` weights of type `kind` (bf16_kind) from the block at `blocks` on -> bfloat16, 32 values per piece, the
// pieces `stride` values apart from `out` on (32: one contiguous row); the float path's values rounded to
// nearest even.
void dequantize_pieces(int64_t kind, const uint8_t* blocks, int64_t count, conveyor::BFloat16* out, int64_t stride);

}  // namespace conveyor_gguf
