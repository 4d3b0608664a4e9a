// GGUF blocks dequantized to float32, one block at a time, exactly as ggml does it (ggml-quants.c,
// dequantize_row_*): the reference every native GGUF product is checked against, and the float path of the
// types without a vectorized one (gguf_linear.cpp's row and tile kernels).
// Types are named by their GGML type ids; conveyor.model.gguf_quant holds the same table.
#pragma once

#include "scalar_types.h"

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace conveyor_gguf {

enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The float16 scale stored at p (any alignment) as float32: exact either way (vcvtph2ps where F16C is built in).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(conveyor::Half(bits, conveyor::Half::from_bits()));
#endif
}

// The 6-bit scale and minimum of sub-block j (0..7) of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One type's block shape and its dequantizer (one block -> `block` floats).
struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  void (*dequant)(const uint8_t*, float*);
};

// The format of GGML type id `kind`; an error naming the supported ids for any other.
Format format_of(int64_t kind);

// `in_features` weights of one row (a whole number of blocks) -> y [in].
inline void dequant_row(const Format& f, const uint8_t* row, int64_t in_features, float* y) {
  for (int64_t k = 0; k < in_features; k += f.block, row += f.bytes) f.dequant(row, y + k);
}

}  // namespace conveyor_gguf
