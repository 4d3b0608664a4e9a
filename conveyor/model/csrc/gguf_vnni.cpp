// Integer dot products of GGUF blocks with int8-quantized activations (AVX-512 VNNI), llama.cpp's approach
// for few activation rows: each activation row is quantized once to int8 with a float scale per 32 columns
// (and, for Q4_K, per 256: ggml's Q8_K) (round to nearest, scale = max |x| / 127); each block's integer dot
// products run in vpdpbusd (unsigned weight codes x signed activations, four products per 32-bit lane), and
// the block's scales are applied in float (Q4_K's sub-block scales in integers). Types: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (the others take gguf_linear.cpp's float path).
// Also whole rows dequantized straight to bfloat16 with AVX-512 (Q8_0, Q4_0, Q4_K, Q6_K) for the tiles of
// gguf_linear_tiles (rounded as torch rounds: to nearest even).
//
// An activation quantized so differs from x by at most half its block's step; gguf_linear_rows uses this
// only for bfloat16 activations (float32 ones keep the exact float path), and the tests bound the error so.
#include <torch/extension.h>

#include <cstdint>
#include <cmath>
#include <cstring>

#include "gguf_vnni.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>

namespace conveyor_gguf {

namespace {

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

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

// Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m): codes 0..15, low nibbles columns 0..15, high ones 16..31.
template <bool kMin>
float dot_q4_01(const uint8_t* row, int64_t blocks, const QuantizedActivations& x) {
  constexpr int64_t kBytes = kMin ? 20 : 18;
  const __m128i low4 = _mm_set1_epi8(0xF);
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b, row += kBytes) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (kMin ? 4 : 2)));
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * b));
    const int32_t dot = hsum_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv));
    const int32_t xsum = x.sum16[2 * b] + x.sum16[2 * b + 1];
    const float d = half_at(row);
    total += kMin ? x.scale[b] * (d * static_cast<float>(dot) + half_at(row + 2) * static_cast<float>(xsum))
                  : x.scale[b] * d * static_cast<float>(dot - 8 * xsum);
  }
  return total;
}

// The 6-bit scale and minimum of sub-block j of a Q4_K block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K: 8 sub-blocks of 32, w = d sc q - dmin m, against activations quantized per 256 columns (one scale
// per super-block), so that the sub-block scales multiply integer sums and the block needs two float products:
//   sum_k w x = xs (d sum_j sc_j (q . x)_j - dmin sum_j m_j (sum of x)_j).
// 64 columns (two sub-blocks) per vpdpbusd; the 6-bit scales and minima are unpacked eight at a time.
float dot_q4_k(const uint8_t* row, int64_t blocks, const QuantizedActivations& x) {
  const __m256i low4 = _mm256_set1_epi8(0xF);
  // lanes 0-7 of the dot of columns 64j..64j+63 belong to sub-block 2j, lanes 8-15 to sub-block 2j+1
  const __m512i pair_scale[4] = {
      _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
      _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
      _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};
  __m512 acc = _mm512_setzero_ps();
  __m128 acc_min = _mm_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += 144) {
    const float xs = x.scale256[b];
    const float d = half_at(row) * xs, dmin = half_at(row + 2) * xs;
    // 12 bytes of scales as three words: sub-blocks 0-3 in the low 6 bits of words 0 (scales) and 1 (minima);
    // sub-blocks 4-7 in word 2's nibbles, topped with the 2 high bits of words 0 and 1 (ggml's get_scale_min_k4)
    uint32_t w[3];
    std::memcpy(w, row + 4, sizeof(w));
    const uint64_t scales = (w[0] & 0x3F3F3F3Fu) |
        static_cast<uint64_t>((w[2] & 0x0F0F0F0Fu) | (((w[0] >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t minima = (w[1] & 0x3F3F3F3Fu) |
        static_cast<uint64_t>(((w[2] >> 4) & 0x0F0F0F0Fu) | (((w[1] >> 6) & 0x03030303u) << 4)) << 32;
    const __m512i scale32 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scales)));  // lanes 0-7
    const uint8_t* qs = row + 16;
    const int8_t* xq = x.q256 + 256 * b;
    __m512i sum = _mm512_setzero_si512();  // [16] int32: sc_j (q . x) over 4 columns each
    for (int j = 0; j < 4; ++j) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low4)),
                                           _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4), 1);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(xq + 64 * j));
      sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(dot, _mm512_permutexvar_epi32(pair_scale[j], scale32)));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d), acc);
    const __m128i mins_dot = _mm_madd_epi16(  // [4] int32: m_j (sum of x)_j, two sub-blocks each
        _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(minima))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.sum32 + 8 * b)));
    acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(mins_dot), _mm_set1_ps(dmin), acc_min);
  }
  const __m128 t = _mm_add_ps(acc_min, _mm_movehl_ps(acc_min, acc_min));
  return _mm512_reduce_add_ps(acc) - _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Q6_K: 16 sub-blocks of 16, w = d sc (q - 32), q = 4 low bits (ql) + 2 high bits (qh).
float dot_q6_k(const uint8_t* row, int64_t blocks, const QuantizedActivations& x) {
  const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
  // lane i of a 64-column dot covers columns 4i..4i+3, i.e. 16-column sub-block i / 4
  const __m512i first = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i four = _mm512_set1_epi32(4);
  __m512 acc = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += 210) {
    const uint8_t* ql = row;
    const uint8_t* qh = row + 128;
    const float d = half_at(row + 208);
    const __m512 sub_scale = _mm512_mul_ps(  // [16]: d sc[s] x-scale of sub-block s
        _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192))))),
        _mm512_loadu_ps(x.scale16 + 16 * b));
    offsets = _mm512_fmadd_ps(sub_scale, _mm512_cvtepi32_ps(_mm512_loadu_si512(x.sum16 + 16 * b)), offsets);
    for (int n = 0; n < 2; ++n, ql += 64, qh += 32) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(h, low2), 4));
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4));
      const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4));
      const __m256i q4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4));
      const int8_t* xb = x.q + 256 * b + 128 * n;
      const __m512i dot12 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_inserti64x4(
          _mm512_castsi256_si512(q1), q2, 1), _mm512_loadu_si512(xb));
      const __m512i dot34 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_inserti64x4(
          _mm512_castsi256_si512(q3), q4, 1), _mm512_loadu_si512(xb + 64));
      const __m512i base = _mm512_add_epi32(first, _mm512_set1_epi32(8 * n));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot12), _mm512_permutexvar_ps(base, sub_scale), acc);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot34), _mm512_permutexvar_ps(_mm512_add_epi32(base, four),
                                                                             sub_scale), acc);
    }
  }
  return _mm512_reduce_add_ps(acc) - 32.f * _mm512_reduce_add_ps(offsets);
}

inline void store_bf16(c10::BFloat16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

inline __m512 bytes16(const uint8_t* p) {  // 16 unsigned bytes -> 16 int32 lanes (as integers)
  return _mm512_castsi512_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512i ints16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

void bf16_q8_0(const uint8_t* b, c10::BFloat16* y) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  for (int h = 0; h < 2; ++h)
    store_bf16(y + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * h))))));
}

void bf16_q4_0(const uint8_t* b, c10::BFloat16* y) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m512i q = ints16(b + 2), low4 = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
  store_bf16(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, low4), eight))));
  store_bf16(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight))));
}

void bf16_q4_k(const uint8_t* b, c10::BFloat16* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const __m512i low4 = _mm512_set1_epi32(0xF);
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    int sc, m;
    scale_min_k4(2 * j, b + 4, &sc, &m);
    const __m512 d1 = _mm512_set1_ps(d * sc), m1 = _mm512_set1_ps(-dmin * m);
    scale_min_k4(2 * j + 1, b + 4, &sc, &m);
    const __m512 d2 = _mm512_set1_ps(d * sc), m2 = _mm512_set1_ps(-dmin * m);
    for (int h = 0; h < 2; ++h) {
      const __m512i v = ints16(q + 16 * h);
      store_bf16(y + 16 * h, _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), m1));
      store_bf16(y + 32 + 16 * h, _mm512_fmadd_ps(d2, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), m2));
    }
  }
}

void bf16_q6_k(const uint8_t* b, c10::BFloat16* y) {
  const float d = half_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const __m512i low4 = _mm512_set1_epi32(0xF), low2 = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
    for (int h = 0; h < 2; ++h) {
      const __m512i l0 = ints16(ql + 16 * h), l1 = ints16(ql + 32 + 16 * h), hb = ints16(qh + 16 * h);
      const __m512i q1 = _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_slli_epi32(_mm512_and_si512(hb, low2), 4));
      const __m512i q2 = _mm512_or_si512(_mm512_and_si512(l1, low4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2), low2), 4));
      const __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(l0, 4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 4), low2), 4));
      const __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(l1, 4), _mm512_slli_epi32(_mm512_srli_epi32(hb, 6), 4));
      const __m512i qs[4] = {q1, q2, q3, q4};
      for (int i = 0; i < 4; ++i)
        store_bf16(y + 32 * i + 16 * h, _mm512_mul_ps(_mm512_set1_ps(d * sc[h + 2 * i]),
                                                      _mm512_cvtepi32_ps(_mm512_sub_epi32(qs[i], off))));
    }
  }
}

}  // namespace

bool bf16_kind(int64_t kind) { return kind == 2 || kind == 8 || kind == 12 || kind == 14; }

void dequantize_row_bf16(int64_t kind, const uint8_t* row, int64_t in_features, c10::BFloat16* y) {
  switch (kind) {
    case 2: for (int64_t k = 0; k < in_features; k += 32, row += 18) bf16_q4_0(row, y + k); break;
    case 8: for (int64_t k = 0; k < in_features; k += 32, row += 34) bf16_q8_0(row, y + k); break;
    case 12: for (int64_t k = 0; k < in_features; k += 256, row += 144) bf16_q4_k(row, y + k); break;
    default: for (int64_t k = 0; k < in_features; k += 256, row += 210) bf16_q6_k(row, y + k); break;
  }
}

bool vnni_kind(int64_t kind) { return kind == 2 || kind == 3 || kind == 8 || kind == 12 || kind == 14; }

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
    out.scale[b] = out.scale16[2 * b] = out.scale16[2 * b + 1] = amax / 127.f;
    for (int half = 0; half < 2; ++half)
      out.sum16[2 * b + half] = round16(x + 32 * b + 16 * half, inverse, out.q + 32 * b + 16 * half);
  }
  if (in_features % 256 != 0) return {out.q, out.scale, out.scale16, out.sum16, nullptr, nullptr, nullptr};
  for (int64_t b = 0; b < in_features / 256; ++b) {
    const float amax = abs_max(x + 256 * b, 256);
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    out.scale256[b] = amax / 127.f;
    for (int j = 0; j < 8; ++j) {
      const int64_t k = 256 * b + 32 * j;
      out.sum32[k / 32] = static_cast<int16_t>(round16(x + k, inverse, out.q256 + k) +
                                               round16(x + k + 16, inverse, out.q256 + k + 16));
    }
  }
  return {out.q, out.scale, out.scale16, out.sum16, out.q256, out.scale256, out.sum32};
}

float vnni_dot(int64_t kind, const uint8_t* row, int64_t in_features, const QuantizedActivations& x) {
  switch (kind) {
    case 2: return dot_q4_01<false>(row, in_features / 32, x);
    case 3: return dot_q4_01<true>(row, in_features / 32, x);
    case 8: return dot_q8_0(row, in_features / 32, x);
    case 12: return dot_q4_k(row, in_features / 256, x);
    default: return dot_q6_k(row, in_features / 256, x);
  }
}

}  // namespace conveyor_gguf

#else  // no AVX-512 VNNI: gguf_linear_rows takes the float path for every type

namespace conveyor_gguf {
bool bf16_kind(int64_t) { return false; }
void dequantize_row_bf16(int64_t, const uint8_t*, int64_t, c10::BFloat16*) {}
bool vnni_kind(int64_t) { return false; }
QuantizedActivations quantize_activations(const float*, int64_t, const ActivationBuffer&) { return {}; }
float vnni_dot(int64_t, const uint8_t*, int64_t, const QuantizedActivations&) { return 0.f; }
}  // namespace conveyor_gguf

#endif
