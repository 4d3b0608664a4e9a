// gguf_vnni.cpp's interface to gguf_linear.cpp: int8 dot products of GGUF blocks with quantized activations.
#pragma once

#include "scalar_types.h"

#include <cstdint>

namespace conveyor_gguf {

// One activation row quantized twice: per 32 columns, x[k] ~ scale[k / 32] * q[k] (the 32-weight types),
// and, where in is a multiple of 256, per 256 columns, x[k] ~ scale256[k / 256] * q256[k] (Q4_K and Q6_K, as
// ggml's Q8_K: one scale per super-block lets their sub-block scales be applied in integers).
struct QuantizedActivations {
  const int8_t* q;         // [in]
  const float* scale;      // [in / 32]
  const int32_t* sum16;    // [in / 16]: sums of q per 16 columns
  const int8_t* q256;      // [in]; null when in is not a multiple of 256
  const float* scale256;   // [in / 256]
  const int16_t* sum32;    // [in / 32]: sums of q256 per 32 columns (Q4_K's sub-blocks)
  const int8_t* q256_k4;   // [in]: q256 in Q4_K's nibble order (per 128 columns: 0-31, 64-95, 32-63, 96-127)
  const int16_t* sum16_256;  // [in / 16]: sums of q256 per 16 columns (Q6_K's sub-blocks)
};

// The storage one QuantizedActivations row points into (reused between calls: no allocation per product).
struct ActivationBuffer {
  int8_t* q;
  float* scale;
  int32_t* sum16;
  int8_t* q256;
  float* scale256;
  int16_t* sum32;
  int8_t* q256_k4;
  int16_t* sum16_256;
};

// Whether GGML type id `kind` has an int8 dot product here (false for all where VNNI is not built in).
bool vnni_kind(int64_t kind);

// x [in] (in a multiple of 32) -> the buffer's fields as QuantizedActivations describes (the per-256 ones
// only when in is a multiple of 256; q256 is then non-null in the result).
QuantizedActivations quantize_activations(const float* x, int64_t in_features, const ActivationBuffer& out);

// Activation rows one call of vnni_dot_rows takes at most.
constexpr int64_t kDotRowsMax = 4;

// One weight row of GGML type `kind` (vnni_kind) times `rows` (1..kDotRowsMax) quantized activation rows x[0..rows)
// -> out[0..rows): the weight blocks are unpacked once for all of them.
void vnni_dot_rows(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations* x,
                   int64_t rows, float* out);

}  // namespace conveyor_gguf
