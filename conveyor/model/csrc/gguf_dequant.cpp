// The scalar GGUF dequantizers of gguf_dequant.h: one block -> `block` float32 values, ggml's arithmetic.
#include "gguf_dequant.h"

#include "scalar_types.h"
#include "scalar_types.h"

#include <cstring>

namespace conveyor_gguf {

namespace {

// --- one block -> `block` floats -------------------------------------------------------------------

void dequant_q4_0(const uint8_t* b, float* y) {  // d, qs[16]: (q - 8) d
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const uint8_t* b, float* y) {  // d, m, qs[16]: q d + m
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0xF) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void dequant_q5_0(const uint8_t* b, float* y) {  // d, qh (32 high bits), qs[16]: (q - 16) d
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, sizeof(qh));
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int high0 = ((qh >> j) << 4) & 0x10, high1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>(((qs[j] & 0xF) | high0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | high1) - 16) * d;
  }
}

void dequant_q5_1(const uint8_t* b, float* y) {  // d, m, qh, qs[16]: q d + m
  const float d = half_at(b), m = half_at(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, sizeof(qh));
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int high0 = ((qh >> j) << 4) & 0x10, high1 = (qh >> (j + 12)) & 0x10;
    y[j] = static_cast<float>((qs[j] & 0xF) | high0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | high1) * d + m;
  }
}

void dequant_q8_0(const uint8_t* b, float* y) {  // d, qs[32] int8: q d
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void dequant_q4_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qs[128]: 8 sub-blocks of 32
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    int sc, m;
    scale_min_k4(2 * j, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
  }
}

void dequant_q5_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qh[32], qs[128]
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; ++j, ql += 32, y += 64) {
    int sc, m;
    scale_min_k4(2 * j, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    const int bit1 = 2 * j, bit2 = 2 * j + 1;
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>((ql[l] & 0xF) | (((qh[l] >> bit1) & 1) << 4)) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>((ql[l] >> 4) | (((qh[l] >> bit2) & 1) << 4)) - m2;
  }
}

void dequant_q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16] int8, d: 16 sub-blocks of 16
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is] * static_cast<float>(q1);
      y[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
      y[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
      y[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
    }
  }
}

}  // namespace

Format format_of(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {32, 18, dequant_q4_0};
    case kQ4_1: return {32, 20, dequant_q4_1};
    case kQ5_0: return {32, 22, dequant_q5_0};
    case kQ5_1: return {32, 24, dequant_q5_1};
    case kQ8_0: return {32, 34, dequant_q8_0};
    case kQ4_K: return {256, 144, dequant_q4_k};
    case kQ5_K: return {256, 176, dequant_q5_k};
    case kQ6_K: return {256, 210, dequant_q6_k};
    default: break;
  }
  CONVEYOR_CHECK(false, "GGML weight type id ", kind, " has no native kernel; supported ids: 2 (Q4_0), 3 (Q4_1), "
              "6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K)");
  return {};
}

}  // namespace conveyor_gguf
