// Causal attention of a step's prompt chunks over their paged K/V, on AMX tiles: all chunks of all
// sequences in one call (no per-sequence SDPA call, no gather of cached blocks).
//
// A chunk is `n` query rows at positions ctx - n .. ctx - 1 of a sequence whose K/V (ctx tokens: the cached
// prefix and the chunk itself, already written) live in cache blocks reached through its block table; the
// query at position p attends to keys 0..p (with a sliding window W: keys p - W + 1..p, the blocks wholly
// before every query's window not read at all). Per (chunk, KV head) the keys and values are packed once into
// the pair-interleaved layouts TDPBF16PS reads:
//
//   scores  S [16 queries, 16 keys] float32 = Q [16 queries, head_dim] . K^T   (K^T tiles: [16 d pairs][16 keys])
//   output  O [16 queries, head_dim] += P [16 queries, 32 keys] bf16 . V       (V tiles:   [16 key pairs][16 d])
//
// and every query head of the KV head's group runs through them 16 queries at a time, in softmax steps of up to
// 128 keys, with an online softmax in float32 (running max and sum per query; the accumulated output rescaled
// once per step). The tile unit and the vector unit take turns within a step (S, then the softmax on vectors,
// then P.V), so the next step's S products are issued between the softmax's rows: they run while the core does
// the vector work. As in torch's fused CPU attention for bfloat16 (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp),
// the probabilities are rounded to bfloat16 for the P.V product; scores, softmax and sums stay float32 and the
// output is rounded once. A head's result depends only on its chunk, never on the other heads or chunks in the
// call or on how the work is split between threads.
//
// Work units (chunk, KV head, a range of query tiles) are taken from an atomic counter, heaviest first, in one
// parallel region per call (no barrier: see amx_product.cpp on shared machines). bfloat16 only, head_dim a
// multiple of 32, where AMX is available (conveyor_amx::available()); callers take torch's kernel otherwise.
//
// Tuning constants (`conveyor bench throughput` with long prompts, on an AMX machine):
//   kStepBlocks   key blocks (32 keys) per softmax step: fewer max/sum updates and rescales against more scores
//                 held per step.
//   kUnitTiles    query tiles (16 queries) per work unit: balance between threads against K/V packed per unit.
// Exactness invariant: each output row is computed by one thread in one order (keys ascending), so the bits do not
// depend on the thread count or on the other chunks in the call.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_product.h"
#include "kv_int8.h"
#include "vec_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(CONVEYOR_VEC_BF16)
#define CONVEYOR_PREFILL_AMX 1
#endif

namespace {

constexpr int64_t kTile = 16;       // rows of a tile; queries per query tile; keys per K^T tile
constexpr int64_t kKeyBlock = 32;   // keys of one bfloat16 P tile row (K/V are packed in blocks of 32 keys)
constexpr int64_t kStepBlocks = 4;  // key blocks per softmax step: one max / sum update and one rescale of the
                                    // output per 128 keys (fewer updates against more scores held per step;
                                    // tuned with `conveyor bench throughput` on long prompts)
constexpr int64_t kStepKeys = kKeyBlock * kStepBlocks;
constexpr int64_t kUnitTiles = 8;   // query tiles per work unit (128 queries)
constexpr float kExpFloor = -87.f;  // exp(-87) = 1.6e-38, still a normal float
constexpr float kMaskedScore = -1e30f;  // a masked score, and the running max before the first key: finite,
                                         // so that max - max is 0, never inf - inf; exp() of it is 0

struct Chunk {
  int64_t q_row, n, ctx;
  const int64_t* table;
};

// A work unit: query tiles [tile_begin, tile_end) of one chunk, for the query heads of one KV head.
struct Unit {
  int64_t chunk, kv_head, tile_begin, tile_end, cost;
};

#if defined(CONVEYOR_PREFILL_AMX)
using namespace conveyor_vec;

// Tiles (configured by conveyor_amx::configure_tiles: all 16 rows x 64 bytes): 0-3 output accumulators (four d
// tiles of 16); 4: Q or P; 5: a K^T or V tile; 6, 7: the two score tiles.

// The K or V rows of one KV head of a chunk as bfloat16: in place from a cache [num_blocks, block_size, kv_heads,
// head_dim], or read back from an int8 one (kv_int8.h: codes * scale in float32, rounded to bfloat16) into a buffer
// of the caller's.
struct RowSource {
  const conveyor::BFloat16* plain;
  const int8_t* codes;
  conveyor_kv_int8::PageLayout layout;  // the cache's dimensions (and an int8 cache's pages)
  int64_t kv_head;
  bool keys;  // an int8 K cache: pages hold their codes dimension by dimension

  // Key t's row in an exact cache.
  const conveyor::BFloat16* plain_row(const Chunk& c, int64_t t) const {
    const int64_t block_size = layout.block_size;
    return plain + ((c.table[t / block_size] * block_size + t % block_size) * layout.kv_heads + kv_head) *
                       layout.head_dim;
  }

  // Requests key t's row toward L1 (an exact cache's only: an int8 row is read back through a buffer).
  void request(const Chunk& c, int64_t t) const {
    if (codes == nullptr) request_bytes<Request::kReadL1>(plain_row(c, t), layout.head_dim * 2);
  }

  const conveyor::BFloat16* row(const Chunk& c, int64_t t, conveyor::BFloat16* buffer) const {
    if (codes == nullptr) return plain_row(c, t);
    const int64_t block_size = layout.block_size, head_dim = layout.head_dim;
    const int64_t block = c.table[t / block_size], offset = t % block_size;
    const int8_t* page = layout.page(codes, block, kv_head);
    const __m512 s = _mm512_set1_ps(layout.scales(page)[offset]);
    alignas(64) int8_t gathered[256];
    const int8_t* r = page + layout.value_code(offset, 0);
    if (keys) {
      for (int64_t d = 0; d < head_dim; ++d) gathered[d] = page[layout.key_code(offset, d)];
      r = gathered;
    }
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d))));
      store_bf16(buffer + d, _mm512_mul_ps(v, s), 0xFFFF);
    }
    return buffer;
  }
};

// Keys [first, keys) -> kt [(keys - first) / 16][head_dim / 32][16 d pairs][16 keys] (uint32 = two bfloat16 of one
// key); values -> vp [(keys - first) / 32][head_dim / 16][16 key pairs][16 d][2]. `first` and `keys` are multiples of
// 32; keys at or past ctx are zeros.
void pack_keys_values(const Chunk& c, int64_t first, int64_t keys, const RowSource& k_rows, const RowSource& v_rows,
                      int64_t head_dim, uint32_t* kt, uint16_t* vp) {
  const int64_t d_tiles32 = head_dim / 32, d_tiles16 = head_dim / 16;
  const int64_t valid = std::min(keys, c.ctx);
  alignas(64) conveyor::BFloat16 buffer[2][256];  // rows read back from an int8 cache (head_dim <= 256, checked)
  // K: 16 keys' rows at a time, each 32-value piece (16 pairs) of them transposed in registers into a tile
  alignas(64) conveyor::BFloat16 rows[kTile][256];  // rows read back from an int8 cache
  for (int64_t t = first; t < std::min(valid, first + kTile); ++t) k_rows.request(c, t);
  for (int64_t t0 = first; t0 < keys; t0 += kTile) {
    for (int64_t t = t0 + kTile; t < std::min(valid, t0 + 2 * kTile); ++t) k_rows.request(c, t);  // the next 16
    uint32_t* kt_tiles = kt + ((t0 - first) / kTile) * d_tiles32 * kTile * kTile;
    const conveyor::BFloat16* k_row[kTile];
    for (int64_t i = 0; i < kTile; ++i) k_row[i] = t0 + i < valid ? k_rows.row(c, t0 + i, rows[i]) : nullptr;
    for (int64_t dt = 0; dt < d_tiles32; ++dt) {
      __m512 piece[kTile];  // key i's values dt * 32 .. + 31: 16 pairs
      for (int64_t i = 0; i < kTile; ++i)
        piece[i] = k_row[i] != nullptr ? _mm512_castsi512_ps(_mm512_loadu_si512(k_row[i] + dt * 32))
                                       : _mm512_setzero_ps();
      transpose16(piece);  // piece[p]: pair p of the 16 keys
      for (int64_t p = 0; p < kTile; ++p)
        _mm512_store_ps(reinterpret_cast<float*>(kt_tiles + (dt * kTile + p) * kTile), piece[p]);
    }
  }
  // V: key pair j of a block (keys 2j, 2j + 1) -> row j of each d tile, d values interleaved with the pair's
  const __m512i first_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                              6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = first; t < std::min(valid, first + kTile); ++t) v_rows.request(c, t);
  for (int64_t t = first; t < keys; t += 2) {
    for (int64_t ahead = t + kTile; ahead < std::min(valid, t + kTile + 2); ++ahead) v_rows.request(c, ahead);
    uint16_t* block = vp + ((t - first) / kKeyBlock) * d_tiles16 * kTile * kTile * 2;
    const int64_t pair = (t % kKeyBlock) / 2;
    const conveyor::BFloat16* even = t < valid ? v_rows.row(c, t, buffer[0]) : nullptr;
    const conveyor::BFloat16* odd = t + 1 < valid ? v_rows.row(c, t + 1, buffer[1]) : nullptr;
    for (int64_t d = 0; d < head_dim; d += 32) {  // 32 d of both keys -> two d tiles' rows
      const __m512i a = even ? _mm512_loadu_si512(even + d) : zero;
      const __m512i b = odd ? _mm512_loadu_si512(odd + d) : zero;
      _mm512_storeu_si512(block + ((d / 16) * kTile + pair) * kTile * 2, _mm512_permutex2var_epi16(a, first_half, b));
      _mm512_storeu_si512(block + ((d / 16 + 1) * kTile + pair) * kTile * 2,
                          _mm512_permutex2var_epi16(a, second_half, b));
    }
  }
}

// The first key a query tile reads: 0, or with a window the start of its first query's window, rounded down to a
// key block.
inline int64_t first_key(int64_t first_pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / kKeyBlock * kKeyBlock : 0;
}

// scores [16][kStepKeys] = Q . K^T for a softmax step's key tiles (16 keys each; k_tiles: key tile j, d tile dt at
// + (j * d_tiles32 + dt) * 256), issued a key tile at a time so that they can be spread over the previous step's
// softmax: the tile unit multiplies while the core runs the vector work. (Issued after the softmax instead, the
// first tile instruction after it, a load of P or of K^T alike, stalled noticeably in a profile of a long prompt;
// one product issued every four rows removed that stall, which points at the tile unit being slow to
// start after the softmax's vector work rather than at the loads.) Key tile j sums in tile 4 + j % 4, stored once
// it is needed again or at the end; Q and K^T go through tiles 0 / 1 (even d tiles) and 2 / 3 (odd).
class ScoreIssuer {
 public:
  ScoreIssuer(const conveyor::BFloat16* q_tiles, const uint32_t* k_tiles, int64_t d_tiles32, int64_t key_tiles,
              float* scores)
      : q_tiles_(q_tiles), k_tiles_(k_tiles), d_tiles32_(d_tiles32), key_tiles_(key_tiles), scores_(scores) {}

  // Issues key tiles up to `upto` (of key_tiles).
  void issue(int64_t upto) {
    for (upto = std::min(upto, key_tiles_); issued_ < upto; ++issued_) {
      const int64_t j = issued_;
      const uint32_t* k = k_tiles_ + j * d_tiles32_ * kTile * kTile;
      // key tile j: key tile j - 4's sums stored, its own summed in the same tile (the tile intrinsics take their
      // register numbers as literals, hence a macro)
#define CONVEYOR_KEY_TILE(SUMS)                                                   \
  if (j >= 4) _tile_stored(SUMS, scores_ + (j - 4) * kTile, kStride);             \
  _tile_zero(SUMS);                                                               \
  for (int64_t dt = 0; dt < d_tiles32_; dt += 2) {                                \
    _tile_loadd(0, q_tiles_ + dt * kTile * 32, 64);                               \
    _tile_loadd(1, k + dt * kTile * kTile, 64);                                   \
    _tile_dpbf16ps(SUMS, 0, 1);                                                   \
    if (dt + 1 < d_tiles32_) {                                                    \
      _tile_loadd(2, q_tiles_ + (dt + 1) * kTile * 32, 64);                       \
      _tile_loadd(3, k + (dt + 1) * kTile * kTile, 64);                           \
      _tile_dpbf16ps(SUMS, 2, 3);                                                 \
    }                                                                             \
  }
      switch (j % 4) {
        case 0: { CONVEYOR_KEY_TILE(4) } break;
        case 1: { CONVEYOR_KEY_TILE(5) } break;
        case 2: { CONVEYOR_KEY_TILE(6) } break;
        default: { CONVEYOR_KEY_TILE(7) }
      }
#undef CONVEYOR_KEY_TILE
    }
  }

  // Issues the rest and stores the last sums.
  void finish() {
    issue(key_tiles_);
    for (int64_t j = std::max<int64_t>(0, key_tiles_ - 4); j < key_tiles_; ++j) {
      switch (j % 4) {
        case 0: _tile_stored(4, scores_ + j * kTile, kStride); break;
        case 1: _tile_stored(5, scores_ + j * kTile, kStride); break;
        case 2: _tile_stored(6, scores_ + j * kTile, kStride); break;
        default: _tile_stored(7, scores_ + j * kTile, kStride);
      }
    }
  }

 private:
  static constexpr int64_t kStride = kStepKeys * sizeof(float);

  const conveyor::BFloat16* q_tiles_;
  const uint32_t* k_tiles_;
  int64_t d_tiles32_, key_tiles_, issued_ = 0;
  float* scores_;
};

// partial [16][64] = P . V over kBlocks key blocks for d tiles d0 .. d0 + kGroup - 1 (2 or 4 of 16 values): P tiles
// ([kBlocks][16][32] bfloat16) through tile 4, V tiles (v_tiles: key block b, d tile dd at + (b * d_tiles16 + dd) *
// 512) rotating through tiles 5-7, sums in tiles 0-3.
template <int kBlocks, int kGroup>
inline void value_tiles(const conveyor::BFloat16* p_tiles, const uint16_t* v_tiles, int64_t d_tiles16, int64_t d0,
                        float* partial) {
  static_assert(kGroup == 2 || kGroup == 4, "two or four d tiles");
  constexpr int64_t tile = kTile * kTile * 2;  // values of a V tile
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kGroup == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int b = 0; b < kBlocks; ++b) {
    const uint16_t* v = v_tiles + (b * d_tiles16 + d0) * tile;
    _tile_loadd(4, p_tiles + b * kTile * kKeyBlock, 64);
    _tile_loadd(5, v, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, v + tile, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (kGroup == 4) {
      _tile_loadd(7, v + 2 * tile, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 3 * tile, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, partial, 256);
  _tile_stored(1, partial + 16, 256);
  if constexpr (kGroup == 4) {
    _tile_stored(2, partial + 32, 256);
    _tile_stored(3, partial + 48, 256);
  }
}

// Calls f(std::integral_constant<int, n>) for n in 1..kStepBlocks: a softmax step's key blocks as a constant.
template <typename F>
inline void with_step_blocks(int64_t n, F&& f) {
  static_assert(kStepBlocks == 4, "one case per step size");
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{});
  }
}

// What one query tile carries from softmax step to softmax step.
struct TileState {
  alignas(64) float row_max[kTile];  // the running max of each row's scores (kMaskedScore before its first key)
  alignas(64) float row_sum[kTile];  // the running sum of exp(score - row_max)
};

// The softmax half of a step over keys key0 .. key0 + 32 kBlocks - 1: scores -> P tiles ([kBlocks][16][32]
// bfloat16) and alpha (each row's rescale of what its output accumulated), the running max and sum updated. Float32
// throughout, a row's 16 keys a vector: one horizontal max and one sum per row and step; exp(x) as 2^(x log2 e),
// the log2(e) taken in the FMA that subtracts the max. kMasked: some key is past some row's position or before
// its window (rows past the chunk attend like its last row); masked keys get probability 0 through the mask.
template <int kBlocks, bool kMasked>
void step_probabilities(const float* scores, float scale, int64_t key0, int64_t first_pos, int64_t last_pos,
                        int64_t window, TileState& state, conveyor::BFloat16* p_tiles, float* alpha, ScoreIssuer& next) {
  constexpr int kVectors = 2 * kBlocks;  // 16 keys each
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 scale_v = _mm512_set1_ps(scale), masked_v = _mm512_set1_ps(kMaskedScore);
  const __m512 log2e_v = _mm512_set1_ps(kLog2e), floor_v = _mm512_set1_ps(kExpFloor * kLog2e);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  alignas(64) float new_max[kTile], step_sum[kTile];
  for (int64_t r = 0; r < kTile; ++r) {
    __m512 s[kVectors];
    __mmask16 valid[kVectors];
    const float* row = scores + r * kStepKeys;
    const int64_t pos = std::min(first_pos + r, last_pos);
    const __m512i last_v = _mm512_set1_epi32(static_cast<int>(pos - key0));  // the last key allowed, in the step
    const __m512i first_v = _mm512_set1_epi32(static_cast<int>(window > 0 ? pos - window + 1 - key0 : -1));
    __m512 top = masked_v;
    for (int v = 0; v < kVectors; ++v) {
      s[v] = _mm512_mul_ps(_mm512_load_ps(row + 16 * v), scale_v);
      if constexpr (kMasked) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * v));
        valid[v] = _mm512_cmple_epi32_mask(key, last_v) & _mm512_cmpge_epi32_mask(key, first_v);
        top = _mm512_max_ps(top, _mm512_mask_mov_ps(masked_v, valid[v], s[v]));
      } else {
        top = _mm512_max_ps(top, s[v]);
      }
    }
    new_max[r] = std::max(state.row_max[r], _mm512_reduce_max_ps(top));  // kMaskedScore while no key came yet
    const __m512 m = _mm512_set1_ps(new_max[r] * kLog2e);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < kVectors; v += 2) {  // exp() only sees arguments >= kExpFloor
      __m512 p0 = exp2_ps(_mm512_max_ps(_mm512_fmsub_ps(s[v], log2e_v, m), floor_v));
      __m512 p1 = exp2_ps(_mm512_max_ps(_mm512_fmsub_ps(s[v + 1], log2e_v, m), floor_v));
      if constexpr (kMasked) {
        p0 = _mm512_maskz_mov_ps(valid[v], p0);
        p1 = _mm512_maskz_mov_ps(valid[v + 1], p1);
      }
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_store_si512(p_tiles + (v / 2 * kTile + r) * kKeyBlock,
                         _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(p0)), to_bf16(p1), 1));
    }
    step_sum[r] = _mm512_reduce_add_ps(sum);
    next.issue((r + 1) * kStepKeys / kTile / kTile);  // the next step's key tiles, spread over the rows
  }
  // alpha = exp(old max - new max): 1 where the max held; while the old max is kMaskedScore the sums and outputs it
  // scales are 0
  const __m512 new_max_v = _mm512_load_ps(new_max);
  const __m512 drop = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(state.row_max), new_max_v), log2e_v);
  _mm512_store_ps(alpha, exp2_ps(_mm512_max_ps(drop, floor_v)));
  _mm512_store_ps(state.row_sum,
                  _mm512_fmadd_ps(_mm512_load_ps(state.row_sum), _mm512_load_ps(alpha), _mm512_load_ps(step_sum)));
  _mm512_store_ps(state.row_max, new_max_v);
}

// The output half of a step: acc [16][head_dim] = acc * alpha + P . V, up to four d tiles (64 values) at a time
// (head_dim is a multiple of 32: 2 or 4).
template <int kBlocks>
void step_values(const conveyor::BFloat16* p_tiles, const uint16_t* v_tiles, int64_t head_dim, const float* alpha,
                 float* acc, float* partial) {
  const int64_t d_tiles16 = head_dim / 16;
  for (int64_t d0 = 0; d0 < d_tiles16; d0 += 4) {
    const int64_t group = std::min<int64_t>(4, d_tiles16 - d0);
    if (group == 4) {
      value_tiles<kBlocks, 4>(p_tiles, v_tiles, d_tiles16, d0, partial);
    } else {
      value_tiles<kBlocks, 2>(p_tiles, v_tiles, d_tiles16, d0, partial);
    }
    for (int64_t r = 0; r < kTile; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t j = 0; j < group; ++j) {
        float* o = acc + r * head_dim + (d0 + j) * kTile;
        _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), a, _mm512_load_ps(partial + r * 64 + j * kTile)));
      }
    }
  }
}

// One query tile (16 rows of head `head`, queries q0 .. q0 + 15 of the chunk, the valid ones < n) over its keys
// (0, or its window's first, .. its last position), from kt / vp packed from key `packed_first` on -> out rows, in
// softmax steps of up to kStepBlocks key blocks, the next step's scores issued over a step's softmax (ScoreIssuer)
// and taken between its softmax and its P . V.
void attend_tile(const Chunk& c, int64_t head, int64_t q0, int64_t window, const conveyor::BFloat16* q,
                 int64_t q_row_stride, int64_t head_dim, float scale, int64_t packed_first, const uint32_t* kt,
                 const uint16_t* vp, conveyor::BFloat16* q_tiles, conveyor::BFloat16* p_tiles, float* scores, float* acc,
                 float* partial, conveyor::BFloat16* out, int64_t out_row_stride) {
  const int64_t rows = std::min(kTile, c.n - q0), d_tiles32 = head_dim / 32, d_tiles16 = head_dim / 16;
  const int64_t first_pos = c.ctx - c.n + q0;  // position of the tile's first query
  const int64_t last_pos = first_pos + rows - 1;
  // Q rows -> [head_dim / 32][16][32] bfloat16 (rows past the chunk zero)
  for (int64_t r = 0; r < kTile; ++r) {
    for (int64_t dt = 0; dt < d_tiles32; ++dt) {
      conveyor::BFloat16* dst = q_tiles + (dt * kTile + r) * 32;
      if (r < rows) {
        std::memcpy(dst, q + (c.q_row + q0 + r) * q_row_stride + head * head_dim + dt * 32, 64);
      } else {
        std::memset(dst, 0, 64);
      }
    }
  }
  TileState state;
  for (int64_t r = 0; r < kTile; ++r) {
    state.row_max[r] = kMaskedScore;
    state.row_sum[r] = 0.f;
  }
  std::fill(acc, acc + kTile * head_dim, 0.f);
  const int64_t blocks = last_pos / kKeyBlock + 1, first_block = first_key(first_pos, window) / kKeyBlock;
  // step i: key blocks first_block + i * kStepBlocks .. (< blocks), its scores in the half i % 2 of `scores`
  const auto packed = [&](int64_t kb) { return kb - packed_first / kKeyBlock; };  // key block kb's index in kt / vp
  const auto scores_of = [&](int64_t kb) {
    return scores + ((kb - first_block) / kStepBlocks % 2) * kTile * kStepKeys;
  };
  const auto issuer = [&](int64_t kb) {  // the scores of the step from key block kb on
    return ScoreIssuer(q_tiles, kt + 2 * packed(kb) * d_tiles32 * kTile * kTile, d_tiles32,
                       kb < blocks ? 2 * std::min(kStepBlocks, blocks - kb) : 0, scores_of(kb));
  };
  issuer(first_block).finish();
  alignas(64) float alpha[kTile];
  for (int64_t kb = first_block; kb < blocks; kb += kStepBlocks) {
    const int64_t key0 = kb * kKeyBlock;
    const float* step_scores = scores_of(kb);
    ScoreIssuer next = issuer(kb + kStepBlocks);
    with_step_blocks(std::min(kStepBlocks, blocks - kb), [&](auto n) {
      constexpr int kBlocks = decltype(n)::value;
      if (key0 + kKeyBlock * kBlocks - 1 > first_pos || (window > 0 && key0 < last_pos - window + 1)) {
        step_probabilities<kBlocks, true>(step_scores, scale, key0, first_pos, last_pos, window, state, p_tiles, alpha,
                                          next);
      } else {
        step_probabilities<kBlocks, false>(step_scores, scale, key0, first_pos, last_pos, window, state, p_tiles,
                                           alpha, next);
      }
      next.finish();
      step_values<kBlocks>(p_tiles, vp + packed(kb) * d_tiles16 * kTile * kTile * 2, head_dim, alpha, acc, partial);
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / state.row_sum[r]);
    conveyor::BFloat16* o = out + (c.q_row + q0 + r) * out_row_stride + head * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16)
      store_bf16(o + d, _mm512_mul_ps(_mm512_load_ps(acc + r * head_dim + d), inv), 0xFFFF);
  }
}
#endif

}  // namespace

namespace conveyor_ops {

bool prefill_attention_available() {
#if defined(CONVEYOR_PREFILL_AMX)
  return conveyor_amx::available();
#else
  return false;
#endif
}

// q [tokens, heads, head_dim] bfloat16 (head_dim contiguous, heads adjacent, rows q_row_stride apart); plain caches
// k_ptr, v_ptr [num_blocks, block_size, kv_heads, head_dim] bfloat16, or int8 pages k_codes, v_codes (kv_int8.h; the
// other pair null), holding every chunk's K/V already; block_tables [num_chunks, max_blocks]; spans [num_chunks, 3]
// (first query row in q, queries, context length; checked against q and the tables here); out [tokens, heads,
// head_dim]: the chunks' rows are written, other rows are left as they are. window: the layer's sliding window
// (keys p - window + 1 .. p), 0 for none. Call only where prefill_attention_available().
void prefill_attention(const conveyor::BFloat16* q_ptr, int64_t tokens, int64_t q_row_stride, int64_t heads,
                       int64_t head_dim, const conveyor::BFloat16* k_ptr, const conveyor::BFloat16* v_ptr,
                       const int8_t* k_codes, const int8_t* v_codes, int64_t kv_heads, int64_t block_size,
                       const int64_t* block_tables, int64_t max_blocks, const int64_t* span, int64_t num_chunks,
                       double scale, int64_t window, conveyor::BFloat16* out_ptr) {
#if defined(CONVEYOR_PREFILL_AMX)
  const int64_t group = heads / kv_heads;
  std::vector<Chunk> chunks(num_chunks);
  std::vector<Unit> units;
  int64_t max_keys = 0;
  for (int64_t i = 0; i < num_chunks; ++i) {
    const int64_t q_row = span[3 * i], n = span[3 * i + 1], ctx = span[3 * i + 2];
    CONVEYOR_CHECK(n >= 1 && ctx >= n && q_row >= 0 && q_row + n <= tokens &&
                    (ctx + block_size - 1) / block_size <= max_blocks,
                "chunk ", i, ": rows ", q_row, "+", n, " with context ", ctx, " do not fit q or its block table");
    chunks[i] = Chunk{q_row, n, ctx, block_tables + i * max_blocks};
    max_keys = std::max(max_keys, (ctx + kKeyBlock - 1) / kKeyBlock * kKeyBlock);
    const int64_t tiles = (n + kTile - 1) / kTile;
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t t0 = 0; t0 < tiles; t0 += kUnitTiles) {
        const int64_t t1 = std::min(tiles, t0 + kUnitTiles);
        const int64_t last_key = ctx - n + std::min(n, t1 * kTile);  // keys the unit's last tile reads
        units.push_back(Unit{i, g, t0, t1, (t1 - t0) * (last_key - first_key(ctx - n + t0 * kTile, window))});
      }
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  const conveyor_kv_int8::PageLayout layout{kv_heads, block_size, head_dim};
  const int64_t out_row_stride = heads * head_dim;
  const float scale_f = static_cast<float>(scale);
  std::atomic<int64_t> next_unit{0};
  const int64_t num_units = static_cast<int64_t>(units.size());
  conveyor_parallel::parallel_for(0, std::min<int64_t>(conveyor_parallel::num_threads(), num_units), 1, [&](int64_t, int64_t) {
    thread_local conveyor_amx::TileBuffer<uint32_t> kt;  // [keys / 16][head_dim / 32][16][16]
    thread_local conveyor_amx::TileBuffer<uint16_t> vp;  // [keys / 32][head_dim / 16][16][16][2]
    thread_local conveyor_amx::TileBuffer<conveyor::BFloat16> q_tiles, p_tiles;
    thread_local conveyor_amx::TileBuffer<float> scores, acc, partial;
    kt.resize(max_keys * head_dim / 2);
    vp.resize(max_keys * head_dim);
    q_tiles.resize(kTile * head_dim);
    p_tiles.resize(kStepBlocks * kTile * kKeyBlock);
    scores.resize(2 * kTile * kStepKeys);  // this softmax step's scores and the next's
    acc.resize(kTile * head_dim);
    partial.resize(kTile * 64);
    conveyor_amx::configure_tiles();
    for (int64_t u = next_unit++; u < num_units; u = next_unit++) {
      const Unit& unit = units[u];
      const Chunk& c = chunks[unit.chunk];
      const int64_t last_query = std::min(c.n, unit.tile_end * kTile) - 1;
      const int64_t keys = (c.ctx - c.n + last_query + 1 + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      const int64_t first = first_key(c.ctx - c.n + unit.tile_begin * kTile, window);
      const RowSource k_rows{k_ptr, k_codes, layout, unit.kv_head, true};
      const RowSource v_rows{v_ptr, v_codes, layout, unit.kv_head, false};
      pack_keys_values(c, first, keys, k_rows, v_rows, head_dim, kt.data(), vp.data());
      for (int64_t h = unit.kv_head * group; h < (unit.kv_head + 1) * group; ++h)
        for (int64_t t = unit.tile_begin; t < unit.tile_end; ++t) {
          // the next tile's query rows (the next head's first tile after the last), requested while this one
          // attends: they come cold from the rotary op
          const bool last_tile = t + 1 == unit.tile_end;
          const int64_t next_h = last_tile ? h + 1 : h, next_t = last_tile ? unit.tile_begin : t + 1;
          const int64_t next_end = next_h < (unit.kv_head + 1) * group ? std::min(c.n, (next_t + 1) * kTile) : 0;
          for (int64_t r = next_t * kTile; r < next_end; ++r)
            request_bytes<Request::kReadL2>(q_ptr + (c.q_row + r) * q_row_stride + next_h * head_dim, head_dim * 2);
          attend_tile(c, h, t * kTile, window, q_ptr, q_row_stride, head_dim, scale_f, first, kt.data(), vp.data(),
                      q_tiles.data(), p_tiles.data(), scores.data(), acc.data(), partial.data(), out_ptr,
                      out_row_stride);
        }
    }
    _tile_release();
  });
#else
  (void)q_ptr, (void)tokens, (void)q_row_stride, (void)heads, (void)head_dim, (void)k_ptr, (void)v_ptr, (void)k_codes,
      (void)v_codes, (void)kv_heads, (void)block_size, (void)block_tables, (void)max_blocks, (void)span,
      (void)num_chunks, (void)scale, (void)window, (void)out_ptr;
#endif
}

}  // namespace conveyor_ops
