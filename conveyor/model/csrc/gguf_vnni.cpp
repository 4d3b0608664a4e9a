// Integer dot products of GGUF blocks with int8-quantized activations (AVX-512 VNNI), llama.cpp's approach
// for few activation rows: each activation row is quantized once to int8 with a float scale per 32 columns
// (and, for Q4_K, Q5_K and Q6_K, per 256: ggml's Q8_K) (round to nearest, scale = max |x| / 127). The 32-weight
// types run vpdpbusd (unsigned weight codes x signed activations, four products per 32-bit lane) and apply each
// block's scale in float; Q4_K, Q5_K and Q6_K run vpmaddubsw (16-bit pair sums) then vpdpwssd by the 16-bit sub-block
// scale, so that a whole super-block is summed in integers, and unpack each weight block once for up to
// kDotRowsMax activation rows. Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (every kept-compact one).
// (Rows dequantized to bfloat16 for gguf_linear_tiles' tiles: gguf_bf16.cpp.)
//
// An activation quantized so differs from x by at most half its block's step; gguf_linear_rows uses this
// only for bfloat16 activations (float32 ones keep the exact float path), and the tests bound the error so.
#include "scalar_types.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>

#include "gguf_dequant.h"
#include "gguf_vnni.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>

namespace conveyor_gguf {

namespace {

// How far ahead of the block being multiplied its weight row is prefetched (rows are read once, in order).
constexpr int64_t kPrefetchBytes = 2048;

inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

float dot_q8_0(const uint8_t* row, int64_t blocks, const QuantizedActivations& x) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b, row += 34) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * b));
    // vpdpbusd multiplies unsigned by signed bytes: (x + 128) w - 128 w, exact for every code (-128 too)
    const __m256i dot = _mm256_sub_epi32(
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(xv, bias), w),
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias, w));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(half_at(row) * x.scale[b]), acc);
  }
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The 32-weight types with codes in nibbles: Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m), and with a fifth bit (kFifth)
// Q5_0 (w = d (q - 16)) and Q5_1 (w = d q + m). Low nibbles are columns 0..15, high ones 16..31; Q5's 32-bit qh
// (before the nibbles) holds column i's fifth bit at bit i.
template <bool kMin, bool kFifth>
float dot_nibbles(const uint8_t* row, int64_t blocks, const QuantizedActivations& x) {
  constexpr int64_t kHigh = kMin ? 4 : 2, kCodes = kHigh + (kFifth ? 4 : 0), kBytes = kCodes + 16;
  constexpr int32_t kOffset = kFifth ? 16 : 8;
  const __m128i low4 = _mm_set1_epi8(0xF);
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b, row += kBytes) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kCodes));
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
    if (kFifth) {
      uint32_t qh;
      std::memcpy(&qh, row + kHigh, sizeof(qh));
      q = _mm256_mask_add_epi8(q, static_cast<__mmask32>(qh), q, _mm256_set1_epi8(16));  // bit 4 is clear
    }
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * b));
    const int32_t dot = hsum_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv));
    const int32_t xsum = x.sum16[2 * b] + x.sum16[2 * b + 1];
    const float d = half_at(row);
    total += kMin ? x.scale[b] * (d * static_cast<float>(dot) + half_at(row + 2) * static_cast<float>(xsum))
                  : x.scale[b] * d * static_cast<float>(dot - kOffset * xsum);
  }
  return total;
}

// Q4_K: 8 sub-blocks of 32, w = d sc q - dmin m, against activations quantized per 256 columns (one scale
// per super-block), so that the sub-block scales multiply integer sums and the block needs two float products:
//   sum_k w x = xs (d sum_j sc_j (q . x)_j - dmin sum_j m_j (sum of x)_j).
// 64 bytes of codes at a time: their low nibbles are sub-blocks 4p and 4p + 2, their high ones 4p + 1 and
// 4p + 3, which is why the activations come in that order (q256_k4). vpmaddubsw multiplies codes and
// activations into 16-bit pair sums (at most 2 * 15 * 127), vpdpwssd those by the 16-bit sub-block scale into
// 32-bit sums: two single-uop instructions per 64 columns. The weights are unpacked once for all `M` rows.
//
// Q5_K (kFifth) is the same with 32 bytes of qh after the scales (the codes 48 bytes on): bit s of qh[l] is the fifth
// bit of sub-block s's column l, so codes go up to 31 (pair sums at most 2 * 31 * 127).
template <int M, bool kFifth = false>
void dot_q4_k(const uint8_t* row, int64_t blocks, const QuantizedActivations* x, float* out) {
  constexpr int64_t kBytes = kFifth ? 176 : 144, kCodes = kFifth ? 48 : 16;
  const __m512i low4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1);
  // shuffle controls: 128-bit lanes 0-1 take byte a of the scales as 16-bit words, lanes 2-3 byte b (0x80: zero)
  const auto pick = [](uint64_t a, uint64_t b) {
    const uint64_t words = 0x8000800080008000u, ones = 0x0001000100010001u;
    return _mm512_set_epi64(words | b * ones, words | b * ones, words | b * ones, words | b * ones,
                            words | a * ones, words | a * ones, words | a * ones, words | a * ones);
  };
  // sub-blocks of the low and high nibbles of bytes 0-63 (4p, 4p + 2; 4p + 1, 4p + 3) for p = 0, 1
  const __m512i pick_scale[4] = {pick(0, 2), pick(1, 3), pick(4, 6), pick(5, 7)};
  // the bytes of the scale field holding each scale's and minimum's low bits (6, or a nibble), and the top 2
  const __m128i low_bits_at = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
  const __m128i top_bits_at = _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7);
  const __m128i low_bits_mask = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m128i top_bits_mask = _mm_set1_epi8(0x30);
  __m512 acc[M];
  __m128 acc_min[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), acc_min[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += kBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 128, _MM_HINT_T0);
    if (kFifth) _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 175, _MM_HINT_T0);
    const float d = half_at(row), dmin = half_at(row + 2);
    // the 12 bytes b of scales and minima -> 8 scales (bytes 0-7) and 8 minima (bytes 8-15) at once, as ggml's
    // get_scale_min_k4: sub-block j < 4 has b[j] & 63 and b[j + 4] & 63; j >= 4 a nibble of b[j + 4] (low: the
    // scale, high: the minimum) topped with the 2 high bits of b[j - 4] and of b[j]
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4));
    const __m128i low_bits = _mm_shuffle_epi8(raw, low_bits_at);  // b[0-3], b[8-11], b[4-7], b[8-11]
    const __m128i nibbled = _mm_and_si128(  // high nibbles of the last four: srli_epi16 is exact there
        _mm_mask_blend_epi8(0xF000, low_bits, _mm_srli_epi16(low_bits, 4)), low_bits_mask);
    const __m128i scales_minima = _mm_ternarylogic_epi32(  // A | (B & C)
        nibbled, _mm_srli_epi16(_mm_shuffle_epi8(raw, top_bits_at), 2), top_bits_mask, 0xF8);
    const __m512i all_scales = _mm512_broadcastq_epi64(scales_minima);
    const __m128i minima16 = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(scales_minima, scales_minima));  // [8] int16
    __m512i sum[M];  // [16] int32 each: sc_j (q . x) over 4 columns
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_si512();
    // Q5_K: qh twice over (bytes 0-31 of a 64-byte load pair with qh[0-31], bytes 32-63 too)
    const __m512i qh = kFifth ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)))
                              : _mm512_setzero_si512();
    for (int p = 0; p < 2; ++p) {
      const __m512i packed = _mm512_loadu_si512(row + kCodes + 64 * p);
      __m512i low = _mm512_and_si512(packed, low4);
      __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      if (kFifth) {  // sub-blocks 4p, 4p + 2 (low nibbles of bytes 0-31, 32-63) and 4p + 1, 4p + 3 (high ones):
        // bits 4p (+ 1) of qh for the first 32 bytes, 4p + 2 (+ 3) for the last; a 16-bit shift then a mask of
        // each byte's bit 0 takes bit s of both bytes of a word
        const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * p)),
                                                 _mm256_set1_epi16(static_cast<int16_t>(4 * p + 2)), 1);
        const __m512i bits_low = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), one);
        const __m512i bits_high = _mm512_and_si512(_mm512_srlv_epi16(qh, _mm512_add_epi16(shift, _mm512_set1_epi16(1))),
                                                   one);
        low = _mm512_or_si512(low, _mm512_slli_epi16(bits_low, 4));
        high = _mm512_or_si512(high, _mm512_slli_epi16(bits_high, 4));
      }
      const __m512i scale_low = _mm512_shuffle_epi8(all_scales, pick_scale[2 * p]);
      const __m512i scale_high = _mm512_shuffle_epi8(all_scales, pick_scale[2 * p + 1]);
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = x[m].q256_k4 + 256 * b + 128 * p;
        sum[m] = _mm512_dpwssd_epi32(sum[m], _mm512_maddubs_epi16(low, _mm512_loadu_si512(xq)), scale_low);
        sum[m] = _mm512_dpwssd_epi32(sum[m], _mm512_maddubs_epi16(high, _mm512_loadu_si512(xq + 64)), scale_high);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float xs = x[m].scale256[b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_set1_ps(d * xs), acc[m]);
      const __m128i mins_dot = _mm_madd_epi16(  // [4] int32: m_j (sum of x)_j, two sub-blocks each
          minima16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[m].sum32 + 8 * b)));
      acc_min[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(mins_dot), _mm_set1_ps(dmin * xs), acc_min[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 t = _mm_add_ps(acc_min[m], _mm_movehl_ps(acc_min[m], acc_min[m]));
    out[m] = _mm512_reduce_add_ps(acc[m]) - _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
}

// Q6_K: 16 sub-blocks of 16, w = d sc (q - 32), q = 4 low bits (ql) + 2 high bits (qh), against activations
// quantized per 256 columns (as Q4_K):  sum_k w x = xs d sum_s sc_s ((q . x)_s - 32 (sum of x)_s), in integers
// (at most 16 * 63 * 127 * 128 per sub-block). Per 128 columns: 64 bytes of ql, whose low nibbles are columns
// 0-63 and high ones 64-127, topped by 2 bits each of 32 bytes of qh (bits 0-1 for columns 0-31, 2-3 for 32-63,
// 4-5 for 64-95, 6-7 for 96-127); vpmaddubsw / vpdpwssd as in Q4_K (pair sums at most 2 * 63 * 127).
template <int M>
void dot_q6_k(const uint8_t* row, int64_t blocks, const QuantizedActivations* x, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0xF), bits45 = _mm512_set1_epi8(0x30);
  // 128-bit lane L of scale vector k holds sub-block 4k + L's scale (16-bit), for 16 columns
  const __m512i pick[4] = {
      _mm512_set_epi64(0x0003000300030003, 0x0003000300030003, 0x0002000200020002, 0x0002000200020002,
                       0x0001000100010001, 0x0001000100010001, 0x0000000000000000, 0x0000000000000000),
      _mm512_set_epi64(0x0007000700070007, 0x0007000700070007, 0x0006000600060006, 0x0006000600060006,
                       0x0005000500050005, 0x0005000500050005, 0x0004000400040004, 0x0004000400040004),
      _mm512_set_epi64(0x000B000B000B000B, 0x000B000B000B000B, 0x000A000A000A000A, 0x000A000A000A000A,
                       0x0009000900090009, 0x0009000900090009, 0x0008000800080008, 0x0008000800080008),
      _mm512_set_epi64(0x000F000F000F000F, 0x000F000F000F000F, 0x000E000E000E000E, 0x000E000E000E000E,
                       0x000D000D000D000D, 0x000D000D000D000D, 0x000C000C000C000C, 0x000C000C000C000C)};
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += 210) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes + 192, _MM_HINT_T0);
    const float d = half_at(row + 208);
    const __m256i scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192)));
    const __m512i scales = _mm512_castsi256_si512(scale16);
    // -32 sc_s against each sub-block's activation sum: the codes' offset, in the same integer sum
    const __m512i offset_scale = _mm512_zextsi256_si512(_mm256_mullo_epi16(scale16, _mm256_set1_epi16(-32)));
    __m512i sum[M];  // [16] int32 each
    for (int m = 0; m < M; ++m)
      sum[m] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), offset_scale, _mm512_zextsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[m].sum16_256 + 16 * b))));
    for (int n = 0; n < 2; ++n) {
      const __m512i ql = _mm512_loadu_si512(row + 64 * n);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 128 + 32 * n));
      const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      // A | (B & C) and (A & C) | B as ternary-logic truth tables (A = 0xF0, B = 0xCC, C = 0xAA)
      const __m512i q_first = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, low4), _mm512_slli_epi16(high, 4),
                                                        bits45, 0xF8);
      const __m512i q_second = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), _mm512_and_si512(high, bits45),
                                                         low4, 0xEC);
      const __m512i scale_first = _mm512_permutexvar_epi16(pick[2 * n], scales);
      const __m512i scale_second = _mm512_permutexvar_epi16(pick[2 * n + 1], scales);
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = x[m].q256 + 256 * b + 128 * n;
        sum[m] = _mm512_dpwssd_epi32(sum[m], _mm512_maddubs_epi16(q_first, _mm512_loadu_si512(xq)), scale_first);
        sum[m] = _mm512_dpwssd_epi32(sum[m], _mm512_maddubs_epi16(q_second, _mm512_loadu_si512(xq + 64)),
                                     scale_second);
      }
    }
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_set1_ps(d * x[m].scale256[b]), acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

}  // namespace

bool vnni_kind(int64_t kind) {
  switch (kind) {
    case 2: case 3: case 6: case 7: case 8: case 12: case 13: case 14: return true;
    default: return false;
  }
}

namespace {

inline float abs_max(const float* x, int64_t n) {  // n a multiple of 16
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  return _mm512_reduce_max_ps(m);
}

// 16 columns x * inverse rounded to nearest even (the default rounding mode, as nearbyint) -> q; -> their sum
inline int32_t round16(const float* x, float inverse, int8_t* q) {
  const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(inverse)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(v));
  return _mm512_reduce_add_epi32(v);
}

}  // namespace

QuantizedActivations quantize_activations(const float* x, int64_t in_features, const ActivationBuffer& out) {
  for (int64_t b = 0; b < in_features / 32; ++b) {
    const float amax = abs_max(x + 32 * b, 32);
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    out.scale[b] = amax / 127.f;
    for (int half = 0; half < 2; ++half)
      out.sum16[2 * b + half] = round16(x + 32 * b + 16 * half, inverse, out.q + 32 * b + 16 * half);
  }
  if (in_features % 256 != 0) return {out.q, out.scale, out.sum16, nullptr, nullptr, nullptr, nullptr, nullptr};
  for (int64_t b = 0; b < in_features / 256; ++b) {
    const float amax = abs_max(x + 256 * b, 256);
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    out.scale256[b] = amax / 127.f;
    for (int j = 0; j < 16; ++j) {
      const int64_t k = 256 * b + 16 * j;
      out.sum16_256[k / 16] = static_cast<int16_t>(round16(x + k, inverse, out.q256 + k));
    }
  }
  for (int64_t k = 0; k < in_features; k += 32) {
    out.sum32[k / 32] = static_cast<int16_t>(out.sum16_256[k / 16] + out.sum16_256[k / 16 + 1]);
    // Q4_K's order per 128 columns: 0-31, 64-95, 32-63, 96-127 (32 columns i of 4 go to place i / 2 + 2 (i % 2))
    const int64_t piece = (k % 128) / 32, place = piece / 2 + 2 * (piece % 2);
    std::memcpy(out.q256_k4 + k - k % 128 + 32 * place, out.q256 + k, 32);
  }
  return {out.q, out.scale, out.sum16, out.q256, out.scale256, out.sum32, out.q256_k4, out.sum16_256};
}

namespace {

// One weight row of GGML type `kind` (vnni_kind) times one quantized activation row.
float vnni_dot(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations& x) {
  switch (kind) {
    case 2: return dot_nibbles<false, false>(row, in_features / 32, x);
    case 3: return dot_nibbles<true, false>(row, in_features / 32, x);
    case 6: return dot_nibbles<false, true>(row, in_features / 32, x);
    case 7: return dot_nibbles<true, true>(row, in_features / 32, x);
    case 8: return dot_q8_0(row, in_features / 32, x);
    default: {
      float out;
      vnni_dot_rows(kind, row, in_features, &x, 1, &out);
      return out;
    }
  }
}

template <int M>
void dot_rows(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations* x, float* out) {
  if (kind == 12) return dot_q4_k<M>(row, in_features / 256, x, out);
  if (kind == 13) return dot_q4_k<M, true>(row, in_features / 256, x, out);
  return dot_q6_k<M>(row, in_features / 256, x, out);
}

}  // namespace

void vnni_dot_rows(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations* x,
                   int64_t rows, float* out) {
  if (kind != 12 && kind != 13 && kind != 14) {
    for (int64_t m = 0; m < rows; ++m) out[m] = vnni_dot(kind, row, in_features, x[m]);
    return;
  }
  for (int64_t m = 0; m < rows; m += kDotRowsMax) {  // callers pass at most kDotRowsMax; more go in turns
    switch (std::min(rows - m, kDotRowsMax)) {
      case 1: dot_rows<1>(kind, row, in_features, x + m, out + m); break;
      case 2: dot_rows<2>(kind, row, in_features, x + m, out + m); break;
      case 3: dot_rows<3>(kind, row, in_features, x + m, out + m); break;
      default: dot_rows<4>(kind, row, in_features, x + m, out + m); break;
    }
  }
}

}  // namespace conveyor_gguf

#else  // no AVX-512 VNNI: gguf_linear_rows takes the float path for every type

namespace conveyor_gguf {
bool vnni_kind(int64_t) { return false; }
QuantizedActivations quantize_activations(const float*, int64_t, const ActivationBuffer&) { return {}; }
void vnni_dot_rows(int64_t, const uint8_t*, int64_t, const QuantizedActivations*, int64_t, float*) {}
}  // namespace conveyor_gguf

#endif
