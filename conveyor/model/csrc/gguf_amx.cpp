// The many-rows product of weights dequantized on the fly, on AMX tiles (Intel Sapphire Rapids and later):
// prefill chunks and busy decode steps of kept-compact GGUF weights (gguf_linear_amx in gguf_linear.cpp).
//
//   C [16 weight rows, 16 activation rows] float32 += A [16 weight rows, 32 k] bf16 . B [32 k, 16 activation rows]
//
// The weight rows are the A operand: a thread dequantizes 32 of them (kBlockN) to bfloat16 into its own
// scratch, laid out tile by tile ([2][in / 32][16 rows][32 k], 1 KiB per tile: rows 64 bytes apart, so a tile
// load never strides a row of `in` values through one L1 set), and multiplies them by every activation row of
// the chunk before the next 32. The activations are the B operand in the pair-interleaved layout TDPBF16PS reads
// ([row tiles][in / 32][16 k pairs][16 rows][2]), in chunks of rows whose panel stays in L2 (kPackedBytes);
// rows past the last are zeros. Two weight tiles x two activation tiles make the four accumulators; the results
// are stored, transposed, to y as bfloat16. Inputs wider than kPanelValues are taken a panel of columns at a
// time (the weights dequantized for one panel, the accumulators kept in a float32 buffer between panels), so
// that a chunk holds as many rows however wide the input.
//
// Work is split in units (one chunk of rows x a few weight blocks), taken in turn by whichever thread is free,
// in one parallel region per call; each thread packs the chunk it works on into its own buffer. No barrier
// inside a call: on a shared 2-core machine each parallel region cost a wait for the second thread's core
// (a 2-thread call took ~4x a 1-thread one with a packing region and a product region per chunk).
//
// Linux hands out the tile registers' state only on request (arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA)), asked once per process; available() is false where the CPU (cpuid) or the kernel says no.
#include "gguf_amx.h"
#include "gguf_dequant.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace conveyor_amx {

namespace {

constexpr int64_t kTile = 16;      // rows of every tile
constexpr int64_t kTileK = 32;     // bfloat16 values in a tile row (64 bytes)
constexpr int64_t kTileValues = kTile * kTileK;  // = kTilePieceStride
constexpr int64_t kBlockN = 32;    // weight rows dequantized together: two A tiles
constexpr int64_t kPanelValues = 2048;     // columns of the weights dequantized at a time (a multiple of 256)
constexpr int64_t kPackedBytes = 1 << 20;  // one panel of packed activations per chunk of rows (in L2 beside
                                           // the weights)
constexpr int64_t kUnitBlocks = 4;         // weight blocks a thread takes at a time (one panel)
constexpr int64_t kSumsBytes = 256 << 10;  // more panels: a thread takes as many blocks as have their
                                           // accumulators in this, kept between panels

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool tile_data_granted() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Tiles 0-3: accumulators C[weight tile i][activation tile j] at 2 j + i; 4, 5: weight tiles; 6, 7: activations.
void configure_tiles() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTile;
  }
  _tile_loadconfig(&config);
}

// Activation rows [m0, m0 + count) of x [*, in] -> packed [ceil(count / 16)][in / 32][16 k pairs][16 rows][2].
void pack_activations(const c10::BFloat16* x, int64_t m0, int64_t count, int64_t in_features, uint32_t* packed) {
  const int64_t row_tiles = (count + kTile - 1) / kTile, k_tiles = in_features / kTileK;
  for (int64_t t = 0; t < row_tiles; ++t) {
    uint32_t* dst = packed + t * k_tiles * (kTileValues / 2);
    for (int64_t r = 0; r < kTile; ++r) {
      const int64_t m = t * kTile + r;
      if (m >= count) {
        for (int64_t kt = 0; kt < k_tiles; ++kt)
          for (int64_t p = 0; p < kTileK / 2; ++p) dst[kt * (kTileValues / 2) + p * kTile + r] = 0;
        continue;
      }
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x + (m0 + m) * in_features);  // [in / 2]
      for (int64_t kt = 0; kt < k_tiles; ++kt)
        for (int64_t p = 0; p < kTileK / 2; ++p) dst[kt * (kTileValues / 2) + p * kTile + r] = pairs[kt * 16 + p];
    }
  }
}

// An accumulator tile C [16 weight rows][16 activation rows] -> y[m0 + j, n0 + i] for the valid i < n, j < m.
void store_transposed(const float* c, int64_t n, int64_t m, c10::BFloat16* y, int64_t out_features) {
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kTile));
  const __mmask16 mask = n >= kTile ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  for (int64_t j = 0; j < m; ++j) {
    const __m512 values = _mm512_i32gather_ps(column, c + j, 4);  // C[0..15][j]
    _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + j * out_features), mask,
                             reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
  }
}

// C for two weight tiles (a0, a1: [k tiles][16][32]) x one or two activation tiles (b0, b1: the same):
// c [4][16][16] float32 (accumulator 2 j + i: weight tile i, activation tile j), summed onto what c holds unless
// `first`.
template <bool kTwo>
void multiply(const c10::BFloat16* a0, const c10::BFloat16* a1, const c10::BFloat16* b0, const c10::BFloat16* b1,
              int64_t k_tiles, bool first, float* c) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwo) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c, 64);
    _tile_loadd(1, c + 256, 64);
    if (kTwo) {
      _tile_loadd(2, c + 512, 64);
      _tile_loadd(3, c + 768, 64);
    }
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    _tile_loadd(4, a0 + kt * kTileValues, 64);
    _tile_loadd(6, b0 + kt * kTileValues, 64);
    _tile_loadd(5, a1 + kt * kTileValues, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if (kTwo) {
      _tile_loadd(7, b1 + kt * kTileValues, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if (kTwo) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// --- one block -> bfloat16 pieces (32 values = one tile row each) ----------------------------------------

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

inline __m256i bf16_bits(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

inline void store_piece(c10::BFloat16* out, __m512 first, __m512 second) {  // 32 floats -> one piece
  _mm512_storeu_si512(out, _mm512_inserti64x4(_mm512_castsi256_si512(bf16_bits(first)), bf16_bits(second), 1));
}

// 32 codes (0..15, one per 16-bit lane) looked up in a table of 16 bfloat16 values -> one piece.
inline void store_lookup(c10::BFloat16* out, __m512i codes, __m512 table) {
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(codes, _mm512_zextsi256_si512(bf16_bits(table))));
}

inline __m512 iota16() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

inline __m512i ints16(const uint8_t* p) {  // 16 bytes -> 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

void tiles_q8_0(const uint8_t* b, c10::BFloat16* out) {  // d, qs[32] int8: q d
  const __m512 d = _mm512_set1_ps(half_at(b));
  const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)));
  const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
  const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
  store_piece(out, _mm512_mul_ps(d, first), _mm512_mul_ps(d, second));
}

void tiles_q4_0(const uint8_t* b, c10::BFloat16* out) {  // d, qs[16]: (q - 8) d; low nibbles first
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(half_at(b)), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.f)));
  const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));  // [16]
  const __m256i low = _mm256_and_si256(q, _mm256_set1_epi16(0xF)), high = _mm256_srli_epi16(q, 4);
  store_lookup(out, _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1), table);
}

using conveyor_gguf::scale_min_k4;  // ggml's get_scale_min_k4

// d, dmin, scales[12], qs[128]: 8 sub-blocks of 32 = 8 pieces; sub-block 2j the low nibbles of qs[32j..32j+31],
// 2j + 1 the high ones; each value d sc q - dmin m, looked up among its sub-block's 16.
void tiles_q4_k(const uint8_t* b, c10::BFloat16* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const __m512i low4 = _mm512_set1_epi16(0xF);
  for (int j = 0; j < 4; ++j) {
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j)));
    for (int h = 0; h < 2; ++h) {
      int sc, m;
      scale_min_k4(2 * j + h, b + 4, &sc, &m);
      const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d * sc), iota16(), _mm512_set1_ps(-dmin * m));
      const __m512i codes = h == 0 ? _mm512_and_si512(q, low4) : _mm512_srli_epi16(q, 4);
      store_lookup(out + (2 * j + h) * kTilePieceStride, codes, table);
    }
  }
}

// ql[128], qh[64], scales[16] int8, d: value l + 32 i of half n (l < 32, i < 4) is d sc[8 n + l / 16 + 2 i]
// (q - 32) with q's low 4 bits from ql[64 n + l + 32 (i & 1)] (high nibble for i >= 2) and high 2 from
// qh[32 n + l] >> 2 i: piece 4 n + i.
void tiles_q6_k(const uint8_t* b, c10::BFloat16* out) {
  const float d = half_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const __m512i low4 = _mm512_set1_epi32(0xF), low2 = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = b + 64 * n;
    const uint8_t* qh = b + 128 + 32 * n;
    __m512 values[4][2];
    for (int h = 0; h < 2; ++h) {
      const __m512i l0 = ints16(ql + 16 * h), l1 = ints16(ql + 32 + 16 * h), hb = ints16(qh + 16 * h);
      const __m512i q[4] = {
          _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_slli_epi32(_mm512_and_si512(hb, low2), 4)),
          _mm512_or_si512(_mm512_and_si512(l1, low4),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2), low2), 4)),
          _mm512_or_si512(_mm512_srli_epi32(l0, 4),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 4), low2), 4)),
          _mm512_or_si512(_mm512_srli_epi32(l1, 4), _mm512_slli_epi32(_mm512_srli_epi32(hb, 6), 4))};
      for (int i = 0; i < 4; ++i)
        values[i][h] = _mm512_mul_ps(_mm512_set1_ps(d * sc[8 * n + h + 2 * i]),
                                     _mm512_cvtepi32_ps(_mm512_sub_epi32(q[i], off)));
    }
    for (int i = 0; i < 4; ++i) store_piece(out + (4 * n + i) * kTilePieceStride, values[i][0], values[i][1]);
  }
}

}  // namespace

bool tile_kind(int64_t kind) { return kind == 2 || kind == 8 || kind == 12 || kind == 14; }

void dequantize_tile_row(int64_t kind, const uint8_t* blocks, int64_t count, c10::BFloat16* out) {
  constexpr int64_t piece = kTilePieceStride;
  const uint8_t* b = blocks;
  switch (kind) {
    case 2: for (int64_t k = 0; k < count; k += 32, b += 18, out += piece) tiles_q4_0(b, out); break;
    case 8: for (int64_t k = 0; k < count; k += 32, b += 34, out += piece) tiles_q8_0(b, out); break;
    case 12: for (int64_t k = 0; k < count; k += 256, b += 144, out += 8 * piece) tiles_q4_k(b, out); break;
    default: for (int64_t k = 0; k < count; k += 256, b += 210, out += 8 * piece) tiles_q6_k(b, out); break;
  }
}

bool available() {
  static const bool granted = tile_data_granted();
  return granted;
}

void product_bf16(const c10::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                  const WeightRow& weight_row, c10::BFloat16* y) {
  const int64_t k_tiles = in_features / kTileK, panels = (in_features + kPanelValues - 1) / kPanelValues;
  const int64_t panel_values = std::min(in_features, kPanelValues);
  const int64_t chunk_rows = std::max<int64_t>(2 * kTile, kPackedBytes / (panel_values * 2) / (2 * kTile) * 2 * kTile);
  const int64_t chunk_tiles = (std::min(chunk_rows, rows) + kTile - 1) / kTile, chunk_pairs = (chunk_tiles + 1) / 2;
  const int64_t n_blocks = (out_features + kBlockN - 1) / kBlockN;
  const int64_t pair_floats = 4 * kTile * kTile;  // the four accumulators of a pair of activation tiles
  const int64_t unit_blocks =
      panels > 1 ? std::max<int64_t>(1, kSumsBytes / (chunk_pairs * pair_floats * 4)) : kUnitBlocks;
  const int64_t units_per_chunk = (n_blocks + unit_blocks - 1) / unit_blocks;
  const int64_t units = (rows + chunk_rows - 1) / chunk_rows * units_per_chunk;
  // One parallel region per call, its units (a chunk of rows x unit_blocks weight blocks, chunk by chunk) taken
  // in turn by whichever thread is free, each thread packing the chunk it works on itself: no barrier inside a
  // call, so that on a shared machine a thread waiting for its core holds up no other.
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), units), 1, [&](int64_t, int64_t) {
    thread_local std::vector<uint32_t> packed_storage;  // [chunk row tiles][k tiles][16][16] bf16 pairs
    thread_local std::vector<c10::BFloat16> weights;    // [2][panel k tiles][16][32]
    thread_local std::vector<float> sums;               // [unit blocks (1 for one panel)][chunk pairs][4][16][16]
    packed_storage.resize(chunk_tiles * k_tiles * kTileValues / 2);
    weights.resize(2 * (panel_values / kTileK) * kTileValues);
    sums.resize((panels > 1 ? unit_blocks : 1) * chunk_pairs * pair_floats);
    const c10::BFloat16* packed = reinterpret_cast<const c10::BFloat16*>(packed_storage.data());
    int64_t packed_m0 = -1;  // the chunk packed_storage holds
    configure_tiles();
    for (int64_t unit = next_unit++; unit < units; unit = next_unit++) {
      const int64_t m0 = unit / units_per_chunk * chunk_rows, count = std::min(chunk_rows, rows - m0);
      const int64_t row_tiles = (count + kTile - 1) / kTile, pairs = (row_tiles + 1) / 2;
      if (m0 != packed_m0) {
        pack_activations(x, m0, count, in_features, packed_storage.data());
        packed_m0 = m0;
      }
      const int64_t g0 = unit % units_per_chunk * unit_blocks, g_end = std::min(n_blocks, g0 + unit_blocks);
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t k0 = p * kPanelValues, kc = std::min(kPanelValues, in_features - k0), kt0 = k0 / kTileK;
        const int64_t panel_tiles = kc / kTileK;
        for (int64_t nb = g0; nb < g_end; ++nb) {
          const int64_t n0 = nb * kBlockN, n = std::min(kBlockN, out_features - n0);
          for (int64_t i = 0; i < kBlockN; ++i) {
            c10::BFloat16* dst = weights.data() + (i / kTile) * panel_tiles * kTileValues + (i % kTile) * kTileK;
            if (i < n) {
              weight_row(n0 + i, k0, kc, dst);
            } else {  // rows past the last: zeros (their results are not stored)
              for (int64_t kt = 0; kt < panel_tiles; ++kt) std::memset(dst + kt * kTileValues, 0, kTileK * 2);
            }
          }
          const bool first = p == 0, last = p == panels - 1;
          for (int64_t t = 0; t < row_tiles; t += 2) {
            const c10::BFloat16* b0 = packed + (t * k_tiles + kt0) * kTileValues;
            const bool two = t + 1 < row_tiles;
            float* c = sums.data() + ((panels > 1 ? nb - g0 : 0) * pairs + t / 2) * pair_floats;
            const c10::BFloat16* a1 = weights.data() + panel_tiles * kTileValues;
            if (two) {
              multiply<true>(weights.data(), a1, b0, b0 + k_tiles * kTileValues, panel_tiles, first, c);
            } else {
              multiply<false>(weights.data(), a1, b0, nullptr, panel_tiles, first, c);
            }
            if (!last) continue;
            for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
              const int64_t m_first = m0 + (t + j) * kTile, m = std::min(kTile, rows - m_first);
              for (int64_t i = 0; i < 2; ++i) {
                const int64_t n_valid = std::min(kTile, n - i * kTile);
                if (n_valid <= 0) continue;
                store_transposed(c + (2 * j + i) * kTile * kTile, n_valid, m,
                                 y + m_first * out_features + n0 + i * kTile, out_features);
              }
            }
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace conveyor_amx

#else

namespace conveyor_amx {
bool available() { return false; }
bool tile_kind(int64_t) { return false; }
void dequantize_tile_row(int64_t, const uint8_t*, int64_t, c10::BFloat16*) {}
void product_bf16(const c10::BFloat16*, int64_t, int64_t, int64_t, const WeightRow&, c10::BFloat16*) {}
}  // namespace conveyor_amx

#endif
