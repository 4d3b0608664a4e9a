// Integer dot products of GGUF blocks with int8-quantized activations on AVX2 + FMA (Zen 2/3, Intel client and
// older server CPUs): gguf_vnni.h's interface where gguf_vnni.cpp (AVX-512 VNNI) is not compiled. The activations
// are quantized exactly as there (per 32 columns and, for the K-quants, per 256: ggml's Q8_0 and Q8_K; scale =
// max |x| / 127, round to nearest even), so both tiers compute the same integer sums; only the float
// accumulation of the per-block results is ordered differently (8 lanes here, 16 there).
//
// AVX2 has no byte dot product into 32 bits: vpmaddubsw multiplies unsigned bytes by signed ones into 16-bit pair
// sums, and vpmaddwd sums those pairs into 32 bits (times a 16-bit factor: 1, or a K-quant sub-block's scale).
//   Q8_0 (signed codes): |w| times x with w's sign, so that the unsigned operand is |w| (at most 128, pair sums
//     at most 2 * 128 * 127, which fits 16 bits); the block's scale applies in float.
//   Q4_0, Q4_1, Q5_0, Q5_1 (unsigned codes 0..31): codes times x, the offset (-8, -16) or the minimum through the
//     activations' per-16 sums.
//   Q4_K, Q5_K: per 64 columns, 32 bytes whose low nibbles are one 32-column sub-block and high nibbles the next,
//     against the per-256 activations in their natural order; the sub-block scale multiplies the 16-bit pair sums
//     in vpmaddwd, so a super-block is summed in integers (at most 8 * 32 * 31 * 127 * 63) and needs two float
//     products (d and dmin).
//   Q6_K: per 128 columns, 64 bytes of low nibbles and 32 of high bit pairs make four 32-column pieces of codes
//     0..63 (pair sums at most 2 * 63 * 127); the offset -32 goes through the per-16 activation sums, in the same
//     integer sum.
// A weight row is unpacked once for up to kDotRowsMax activation rows (every type), and each row's sums run in the
// same order whatever the number of rows beside it. No tuning constants.
#include "scalar_types.h"

#include <cstdint>
#include <cstring>

#include "gguf_dequant.h"
#include "gguf_vnni.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(CONVEYOR_WITH_GGUF_VNNI)
#include <immintrin.h>

namespace conveyor_gguf {

namespace {

inline float hsum_ps(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// unsigned codes [32] . signed activations [32] -> [8] int32 partial sums
inline __m256i dot_u8_i8(__m256i codes, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

template <int M>
void dot_q8_0(const uint8_t* row, int64_t blocks, const QuantizedActivations* x, float* out) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += 34) {
    const __m256i w = load32(row + 2);
    const __m256i magnitude = _mm256_sign_epi8(w, w);  // |w|, the unsigned operand
    const float d = half_at(row);
    for (int m = 0; m < M; ++m) {
      const __m256i dot = dot_u8_i8(magnitude, _mm256_sign_epi8(load32(x[m].q + 32 * b), w));  // |w| . x sign(w)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x[m].scale[b]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum_ps(acc[m]);
}

// Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m), Q5_0 (w = d (q - 16)), Q5_1 (w = d q + m): low nibbles are columns
// 0..15, high ones 16..31; Q5's 32-bit qh (before the nibbles) holds column i's fifth bit at bit i.
template <int M, bool kMin, bool kFifth>
void dot_nibbles(const uint8_t* row, int64_t blocks, const QuantizedActivations* x, float* out) {
  constexpr int64_t kHigh = kMin ? 4 : 2, kCodes = kHigh + (kFifth ? 4 : 0), kBytes = kCodes + 16;
  constexpr int32_t kOffset = kFifth ? 16 : 8;
  const __m128i low4 = _mm_set1_epi8(0xF);
  // qh's byte i / 8 to byte i, then bit i % 8 of it tested
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bit_of = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  __m256 acc[M];
  float offsets[M];  // the minimum's (Q4_1, Q5_1) or the code offset's (Q4_0, Q5_0) share of each block
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), offsets[m] = 0.f;
  for (int64_t b = 0; b < blocks; ++b, row += kBytes) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kCodes));
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
    if (kFifth) {
      uint32_t qh;
      std::memcpy(&qh, row + kHigh, sizeof(qh));
      const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), spread);
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit_of), bit_of);  // 0xFF where the bit is set
      q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    const float d = half_at(row), minimum = kMin ? half_at(row + 2) : 0.f;
    for (int m = 0; m < M; ++m) {
      const __m256i dot = dot_u8_i8(q, load32(x[m].q + 32 * b));  // [8] int32, summed once at the end
      const float dx = d * x[m].scale[b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx), acc[m]);
      const float xsum = static_cast<float>(x[m].sum16[2 * b] + x[m].sum16[2 * b + 1]);
      offsets[m] += kMin ? minimum * x[m].scale[b] * xsum : -static_cast<float>(kOffset) * dx * xsum;
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum_ps(acc[m]) + offsets[m];
}

// ggml's get_scale_min_k4 for all 8 sub-blocks of a Q4_K / Q5_K super-block's 12 scale bytes
inline void scales_minima_k4(const uint8_t* s, int16_t* scale, int16_t* minimum) {
  for (int j = 0; j < 4; ++j) {
    scale[j] = static_cast<int16_t>(s[j] & 63);
    minimum[j] = static_cast<int16_t>(s[j + 4] & 63);
  }
  for (int j = 4; j < 8; ++j) {
    scale[j] = static_cast<int16_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    minimum[j] = static_cast<int16_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Q4_K (and Q5_K with kFifth: 32 bytes of qh after the scales, the codes 48 bytes on; bit s of qh[l] is the fifth
// bit of sub-block s's column l): sum_k w x = xs (d sum_j sc_j (q . x)_j - dmin sum_j m_j (sum of x)_j).
template <int M, bool kFifth = false>
void dot_q4_k(const uint8_t* row, int64_t blocks, const QuantizedActivations* x, float* out) {
  constexpr int64_t kBytes = kFifth ? 176 : 144, kCodes = kFifth ? 48 : 16;
  const __m256i low4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  __m256 acc[M];
  float minima_total[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), minima_total[m] = 0.f;
  for (int64_t b = 0; b < blocks; ++b, row += kBytes) {
    const float d = half_at(row), dmin = half_at(row + 2);
    int16_t scale[8], minimum[8];
    scales_minima_k4(row + 4, scale, minimum);
    const __m256i qh = kFifth ? load32(row + 16) : _mm256_setzero_si256();
    __m256i sum[M];  // [8] int32 each
    for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // columns 64 j .. 64 j + 63: sub-blocks 2 j (low nibbles) and 2 j + 1 (high)
      const __m256i packed = load32(row + kCodes + 32 * j);
      __m256i low = _mm256_and_si256(packed, low4);
      __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      if (kFifth) {  // a 16-bit shift then each byte's bit 0: bit s of both bytes of a word
        low = _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        high = _mm256_or_si256(high, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      const __m256i scale_low = _mm256_set1_epi16(scale[2 * j]), scale_high = _mm256_set1_epi16(scale[2 * j + 1]);
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = x[m].q256 + 256 * b + 64 * j;
        sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(low, load32(xq)), scale_low));
        sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(high, load32(xq + 32)), scale_high));
      }
    }
    for (int m = 0; m < M; ++m) {
      const float xs = x[m].scale256[b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_set1_ps(d * xs), acc[m]);
      int32_t minima_dot = 0;  // m_j (sum of x)_j
      for (int j = 0; j < 8; ++j) minima_dot += minimum[j] * x[m].sum32[8 * b + j];
      minima_total[m] += dmin * xs * static_cast<float>(minima_dot);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum_ps(acc[m]) - minima_total[m];
}

// Q6_K: 16 sub-blocks of 16, w = d sc (q - 32), q = 4 low bits (ql) + 2 high bits (qh), d at byte 208, the int8
// scales at 192: sum_k w x = xs d sum_s sc_s ((q . x)_s - 32 (sum of x)_s).
template <int M>
void dot_q6_k(const uint8_t* row, int64_t blocks, const QuantizedActivations* x, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0xF), bits45 = _mm256_set1_epi8(0x30);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += 210) {
    const float d = half_at(row + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    __m256i sum[M];
    for (int m = 0; m < M; ++m) {
      int32_t offset = 0;  // -32 sc_s (sum of x)_s
      for (int s = 0; s < 16; ++s) offset += sc[s] * x[m].sum16_256[16 * b + s];
      sum[m] = _mm256_setr_epi32(-32 * offset, 0, 0, 0, 0, 0, 0, 0);
    }
    for (int n = 0; n < 2; ++n) {  // columns 128 n ..: ql bytes 64 n .., qh bytes 128 + 32 n ..
      const __m256i ql_first = load32(row + 64 * n), ql_second = load32(row + 64 * n + 32);
      const __m256i qh = load32(row + 128 + 32 * n);
      const __m256i q[4] = {  // columns l, l + 32, l + 64, l + 96 of this half, l = 0..31
          _mm256_or_si256(_mm256_and_si256(ql_first, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
          _mm256_or_si256(_mm256_and_si256(ql_second, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql_first, 4), low4), _mm256_and_si256(qh, bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql_second, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45))};
      for (int i = 0; i < 4; ++i) {
        const int s = 8 * n + 2 * i;  // the piece's 16-column sub-blocks: s (128-bit lane 0) and s + 1 (lane 1)
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = x[m].q256 + 256 * b + 128 * n + 32 * i;
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(q[i], load32(xq)), scale));
        }
      }
    }
    for (int m = 0; m < M; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_set1_ps(d * x[m].scale256[b]), acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = hsum_ps(acc[m]);
}

inline float abs_max(const float* x, int64_t n) {  // n a multiple of 8
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// 16 columns x * inverse rounded to nearest even (the default rounding mode, as nearbyint) -> q; -> their sum
inline int32_t round16(const float* x, float inverse, int8_t* q) {
  const __m256 scale = _mm256_set1_ps(inverse);
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), scale));
  const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), scale));
  // packs work per 128-bit lane: a0-3 b0-3 a4-7 b4-7 as 16-bit words, put back in order before narrowing again
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                   _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
  return hsum_epi32(_mm256_add_epi32(a, b));
}

template <int M>
void dot_rows(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations* x, float* out) {
  switch (kind) {
    case 2: return dot_nibbles<M, false, false>(row, in_features / 32, x, out);
    case 3: return dot_nibbles<M, true, false>(row, in_features / 32, x, out);
    case 6: return dot_nibbles<M, false, true>(row, in_features / 32, x, out);
    case 7: return dot_nibbles<M, true, true>(row, in_features / 32, x, out);
    case 8: return dot_q8_0<M>(row, in_features / 32, x, out);
    case 12: return dot_q4_k<M>(row, in_features / 256, x, out);
    case 13: return dot_q4_k<M, true>(row, in_features / 256, x, out);
    default: return dot_q6_k<M>(row, in_features / 256, x, out);
  }
}

}  // namespace

bool vnni_kind(int64_t kind) {
  switch (kind) {
    case 2: case 3: case 6: case 7: case 8: case 12: case 13: case 14: return true;
    default: return false;
  }
}

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
  for (int64_t k = 0; k < in_features; k += 32)
    out.sum32[k / 32] = static_cast<int16_t>(out.sum16_256[k / 16] + out.sum16_256[k / 16 + 1]);
  // q256_k4 (the AVX-512 Q4_K order) is not read here: the dots take q256 in its natural order
  return {out.q, out.scale, out.sum16, out.q256, out.scale256, out.sum32, nullptr, out.sum16_256};
}

void vnni_dot_rows(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations* x,
                   int64_t rows, float* out) {
  for (int64_t m = 0; m < rows; m += kDotRowsMax) {  // callers pass at most kDotRowsMax; more go in turns
    switch (rows - m < kDotRowsMax ? rows - m : kDotRowsMax) {
      case 1: dot_rows<1>(kind, row, in_features, x + m, out + m); break;
      case 2: dot_rows<2>(kind, row, in_features, x + m, out + m); break;
      case 3: dot_rows<3>(kind, row, in_features, x + m, out + m); break;
      default: dot_rows<4>(kind, row, in_features, x + m, out + m); break;
    }
  }
}

}  // namespace conveyor_gguf

#endif
