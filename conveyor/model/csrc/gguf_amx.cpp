// GGUF blocks dequantized to bfloat16 tile pieces for the AMX product (amx_product.cpp): prefill chunks and busy
// decode steps of kept-compact GGUF weights (gguf_linear_amx in gguf_linear.cpp). Each 32-value piece is one row
// of a weight tile (amx_product.h's kTilePieceStride apart), dequantized by gguf_bf16.cpp; pieces_to_pairs
// interleaves a tile's rows into the B operand's layout.
#include "gguf_amx.h"
#include "gguf_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace conveyor_amx {

void pieces_to_pairs(const conveyor::BFloat16* rows, conveyor::BFloat16* pairs) {
  // a[r]: row r's 16 pairs. After the two unpack rounds, u[4 g + c] holds, in 128-bit lane j, rows 4 g..4 g + 3 of
  // pair 4 j + c; the two lane shuffles then gather each pair's four lanes of rows.
  __m512i a[16], t[16], u[16];
  for (int r = 0; r < 16; ++r) a[r] = _mm512_loadu_si512(rows + 32 * r);
  for (int r = 0; r < 16; r += 2) {
    t[r] = _mm512_unpacklo_epi32(a[r], a[r + 1]);      // per lane: pairs 0, 1 of rows r, r + 1
    t[r + 1] = _mm512_unpackhi_epi32(a[r], a[r + 1]);  // pairs 2, 3
  }
  for (int g = 0; g < 4; ++g) {
    const __m512i* low = t + 4 * g;  // rows 4 g, 4 g + 1: low[0] pairs 0-1, low[1] pairs 2-3; rows + 2: low[2], low[3]
    u[4 * g + 0] = _mm512_unpacklo_epi64(low[0], low[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(low[0], low[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(low[1], low[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(low[1], low[3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i w_low = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i w_high = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i z_low = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i z_high = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    _mm512_storeu_si512(pairs + 32 * (c + 0), _mm512_shuffle_i32x4(w_low, z_low, 0x88));
    _mm512_storeu_si512(pairs + 32 * (c + 4), _mm512_shuffle_i32x4(w_low, z_low, 0xDD));
    _mm512_storeu_si512(pairs + 32 * (c + 8), _mm512_shuffle_i32x4(w_high, z_high, 0x88));
    _mm512_storeu_si512(pairs + 32 * (c + 12), _mm512_shuffle_i32x4(w_high, z_high, 0xDD));
  }
}

void dequantize_tile_row(int64_t kind, const uint8_t* blocks, int64_t count, conveyor::BFloat16* out) {
  conveyor_gguf::dequantize_pieces(kind, blocks, count, out, kTilePieceStride);
}

}  // namespace conveyor_amx

#else

namespace conveyor_amx {
void dequantize_tile_row(int64_t, const uint8_t*, int64_t, conveyor::BFloat16*) {}
void pieces_to_pairs(const conveyor::BFloat16*, conveyor::BFloat16*) {}
}  // namespace conveyor_amx

#endif
