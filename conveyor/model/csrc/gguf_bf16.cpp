// GGUF blocks dequantized to bfloat16, 32 values (a "piece") at a time, with AVX-512 BF16: a block of 32 weights
// is one piece, a K-quant super-block of 256 eight, written `stride` values apart. Two users: the AMX product's
// weight tiles (gguf_amx.cpp: pieces a tile row each, amx_product.h's kTilePieceStride apart) and whole rows for
// torch's GEMM where AMX is absent (gguf_linear_tiles: pieces 32 apart, one contiguous row). The values are the
// float path's (gguf_dequant.h) rounded to nearest even.
#include "gguf_bf16.h"
#include "gguf_dequant.h"

#include "scalar_types.h"

#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace conveyor_gguf {

namespace {

inline __m256i bf16_bits(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

inline void store_piece(conveyor::BFloat16* out, __m512 first, __m512 second) {  // 32 floats -> one piece
  _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first)));
}

// 32 codes (0..15, one per 16-bit lane) looked up in a table of 16 bfloat16 values -> one piece.
inline void store_lookup(conveyor::BFloat16* out, __m512i codes, __m512 table) {
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(codes, _mm512_zextsi256_si512(bf16_bits(table))));
}

inline __m512 iota16() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

void pieces_q8_0(const uint8_t* b, conveyor::BFloat16* out) {  // d, qs[32] int8: q d
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m512i first = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
  const __m512i second = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
  store_piece(out, _mm512_mul_ps(d, _mm512_cvtepi32_ps(first)), _mm512_mul_ps(d, _mm512_cvtepi32_ps(second)));
}

// qs[16] of a 32-weight block: low nibbles values 0-15, high ones 16-31 -> 32 codes 0..15, one per 16-bit lane.
inline __m512i codes_q4(const uint8_t* qs) {
  const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));  // [16]
  const __m256i low = _mm256_and_si256(q, _mm256_set1_epi16(0xF)), high = _mm256_srli_epi16(q, 4);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

void pieces_q4_0(const uint8_t* b, conveyor::BFloat16* out) {  // d, qs[16]: (q - 8) d
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(half_at(b)), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.f)));
  store_lookup(out, codes_q4(b + 2), table);
}

void pieces_q4_1(const uint8_t* b, conveyor::BFloat16* out) {  // d, m, qs[16]: q d + m (a product, then a sum)
  const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(half_at(b + 2));
  store_lookup(out, codes_q4(b + 4), _mm512_add_ps(_mm512_mul_ps(iota16(), d), m));
}

inline __m512 iota16_hi() { return _mm512_add_ps(iota16(), _mm512_set1_ps(16.f)); }

// 32 codes (0..31, one per 16-bit lane) looked up in a table of 32 values (16 and 16 floats) -> one piece.
inline void store_lookup32(conveyor::BFloat16* out, __m512i codes, __m512 first, __m512 second) {
  const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));  // [32] bf16
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(codes, table));
}

// codes_q4's nibbles with bit i of qh as value i's fifth bit -> 32 codes 0..31.
inline __m512i codes_q5(const uint8_t* qs, uint32_t qh) {
  const __m512i codes = codes_q4(qs);
  return _mm512_mask_add_epi16(codes, static_cast<__mmask32>(qh), codes, _mm512_set1_epi16(16));  // bit 4 is clear
}

void pieces_q5_0(const uint8_t* b, conveyor::BFloat16* out) {  // d, qh, qs[16]: (q - 16) d
  const __m512 d = _mm512_set1_ps(half_at(b)), sixteen = _mm512_set1_ps(16.f);
  uint32_t qh;
  std::memcpy(&qh, b + 2, sizeof(qh));
  store_lookup32(out, codes_q5(b + 6, qh), _mm512_mul_ps(_mm512_sub_ps(iota16(), sixteen), d),
                 _mm512_mul_ps(_mm512_sub_ps(iota16_hi(), sixteen), d));
}

void pieces_q5_1(const uint8_t* b, conveyor::BFloat16* out) {  // d, m, qh, qs[16]: q d + m (a product, then a sum)
  const __m512 d = _mm512_set1_ps(half_at(b)), m = _mm512_set1_ps(half_at(b + 2));
  uint32_t qh;
  std::memcpy(&qh, b + 4, sizeof(qh));
  store_lookup32(out, codes_q5(b + 8, qh), _mm512_add_ps(_mm512_mul_ps(iota16(), d), m),
                 _mm512_add_ps(_mm512_mul_ps(iota16_hi(), d), m));
}

// d, dmin, scales[12], qs[128]: 8 sub-blocks of 32 = 8 pieces; sub-block 2j the low nibbles of qs[32j..32j+31],
// 2j + 1 the high ones; each value d sc q - dmin m, looked up among its sub-block's 16. The two sub-blocks of a j
// share one table register (2j's values in words 0-15, 2j + 1's in 16-31: one conversion for both).
void pieces_q4_k(const uint8_t* b, conveyor::BFloat16* out, int64_t stride) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const __m512i low4 = _mm512_set1_epi16(0xF), second_table = _mm512_set1_epi16(16);
  for (int j = 0; j < 4; ++j) {
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j)));
    int sc0, m0, sc1, m1;
    scale_min_k4(2 * j, b + 4, &sc0, &m0);
    scale_min_k4(2 * j + 1, b + 4, &sc1, &m1);
    const __m512 first = _mm512_fmadd_ps(_mm512_set1_ps(d * sc0), iota16(), _mm512_set1_ps(-dmin * m0));
    const __m512 second = _mm512_fmadd_ps(_mm512_set1_ps(d * sc1), iota16(), _mm512_set1_ps(-dmin * m1));
    const __m512i tables = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));  // [32] bf16
    _mm512_storeu_si512(out + 2 * j * stride, _mm512_permutexvar_epi16(_mm512_and_si512(q, low4), tables));
    _mm512_storeu_si512(out + (2 * j + 1) * stride,
                        _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(q, 4), second_table), tables));
  }
}

// d, dmin, scales[12], qh[32], qs[128]: as Q4_K, with bit 2j (2j + 1) of qh[l] the fifth bit of sub-block 2j's
// (2j + 1's) value l; each value d sc q - dmin m (a product, then a difference), looked up among its sub-block's 32.
void pieces_q5_k(const uint8_t* b, conveyor::BFloat16* out, int64_t stride) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const __m512i low4 = _mm512_set1_epi16(0xF), fifth = _mm512_set1_epi16(16);
  const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));  // [32]
  for (int j = 0; j < 4; ++j) {
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * j)));
    for (int h = 0; h < 2; ++h) {  // sub-block 2 j + h: low nibbles, then high ones
      int sc, m;
      scale_min_k4(2 * j + h, b + 4, &sc, &m);
      const __m512 scale = _mm512_set1_ps(d * sc), minimum = _mm512_set1_ps(dmin * m);
      const __m512i bits = _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(qh, 2 * j + h), 4), fifth);
      const __m512i codes = _mm512_or_si512(_mm512_and_si512(h == 0 ? q : _mm512_srli_epi16(q, 4), low4), bits);
      store_lookup32(out + (2 * j + h) * stride, codes,
                     _mm512_sub_ps(_mm512_mul_ps(scale, iota16()), minimum),
                     _mm512_sub_ps(_mm512_mul_ps(scale, iota16_hi()), minimum));
    }
  }
}

// 16 signed codes (bytes) -> floats times `scale`: as the float path computes d sc (q - 32).
inline __m512 scaled16(__m128i codes, float scale) {
  return _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
}

// ql[128], qh[64], scales[16] int8, d: value l + 32 i of half n (l < 32, i < 4) is d sc[8 n + l / 16 + 2 i]
// (q - 32) with q's low 4 bits from ql[64 n + l + 32 (i & 1)] (high nibble for i >= 2) and high 2 from
// qh[32 n + l] >> 2 i: piece 4 n + i. The codes are assembled 32 at a time in bytes.
void pieces_q6_k(const uint8_t* b, conveyor::BFloat16* out, int64_t stride) {
  const float d = half_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
  for (int n = 0; n < 2; ++n) {
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n));       // l, i = 0, 2
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32));  // i = 1, 3
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    for (int i = 0; i < 4; ++i) {
      const __m256i ql = i & 1 ? ql1 : ql0;
      const __m256i low = _mm256_and_si256(i >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), low2), 4);
      const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(low, high), off);  // [32] q - 32
      store_piece(out + (4 * n + i) * stride,
                  scaled16(_mm256_castsi256_si128(codes), d * sc[8 * n + 2 * i]),
                  scaled16(_mm256_extracti128_si256(codes, 1), d * sc[8 * n + 1 + 2 * i]));
    }
  }
}

}  // namespace

bool bf16_kind(int64_t kind) {
  switch (kind) {
    case 2: case 3: case 6: case 7: case 8: case 12: case 13: case 14: return true;
    default: return false;
  }
}

void dequantize_pieces(int64_t kind, const uint8_t* blocks, int64_t count, conveyor::BFloat16* out, int64_t stride) {
  const uint8_t* b = blocks;
  switch (kind) {
    case 2: for (int64_t k = 0; k < count; k += 32, b += 18, out += stride) pieces_q4_0(b, out); break;
    case 3: for (int64_t k = 0; k < count; k += 32, b += 20, out += stride) pieces_q4_1(b, out); break;
    case 6: for (int64_t k = 0; k < count; k += 32, b += 22, out += stride) pieces_q5_0(b, out); break;
    case 7: for (int64_t k = 0; k < count; k += 32, b += 24, out += stride) pieces_q5_1(b, out); break;
    case 8: for (int64_t k = 0; k < count; k += 32, b += 34, out += stride) pieces_q8_0(b, out); break;
    case 12: for (int64_t k = 0; k < count; k += 256, b += 144, out += 8 * stride) pieces_q4_k(b, out, stride); break;
    case 13: for (int64_t k = 0; k < count; k += 256, b += 176, out += 8 * stride) pieces_q5_k(b, out, stride); break;
    case 14: for (int64_t k = 0; k < count; k += 256, b += 210, out += 8 * stride) pieces_q6_k(b, out, stride); break;
    default: CONVEYOR_CHECK(false, "GGML type id ", kind, " has no bfloat16 dequantizer");  // callers check bf16_kind
  }
}

}  // namespace conveyor_gguf

#else

namespace conveyor_gguf {
bool bf16_kind(int64_t) { return false; }
void dequantize_pieces(int64_t, const uint8_t*, int64_t, conveyor::BFloat16*, int64_t) {}
}  // namespace conveyor_gguf

#endif
