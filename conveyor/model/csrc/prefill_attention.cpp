// Causal attention of a step's prompt chunks over their paged K/V, on AMX tiles: all chunks of all
// sequences in one call (no per-sequence SDPA call, no gather of cached blocks).
//
// A chunk is `n` query rows at positions ctx - n .. ctx - 1 of a sequence whose K/V (ctx tokens: the cached
// prefix and the chunk itself, already written) live in cache blocks reached through its block table; the
// query at position p attends to keys 0..p (with a sliding window W: keys p - W + 1..p, the blocks wholly
// before every query's window not read at all). Per (chunk, KV head) the keys and values are packed once into
// the pair-interleaved layouts TDPBF16PS reads:
//
//   scores  S [16 queries, 32 keys] float32 = Q [16 queries, head_dim] . K^T   (K^T tiles: [16 d pairs][16 keys])
//   output  O [16 queries, head_dim] += P [16 queries, 32 keys] bf16 . V       (V tiles:   [16 key pairs][16 d])
//
// and every query head of the KV head's group runs through them 16 queries at a time, 32 keys at a time, with
// an online softmax in float32 (running max and sum per query; the accumulated output rescaled when the max
// grows). As in torch's fused CPU attention for bfloat16 (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp),
// the probabilities are rounded to bfloat16 for the P.V product; scores, softmax and sums stay float32 and the
// output is rounded once. A head's result depends only on its chunk, never on the other heads or chunks in the
// call or on how the work is split between threads.
//
// Work units (chunk, KV head, a range of query tiles) are taken from an atomic counter, heaviest first, in one
// parallel region per call (no barrier: see amx_product.cpp on shared machines). bfloat16 only, head_dim a
// multiple of 32, where AMX is available (conveyor_amx::available()); callers take torch's kernel otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_product.h"
#include "kv_int8.h"
#include "vec_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(CONVEYOR_VEC_BF16)
#define CONVEYOR_PREFILL_AMX 1
#endif

namespace {

constexpr int64_t kTile = 16;       // rows of a tile; queries per query tile; keys per K^T tile
constexpr int64_t kKeyBlock = 32;   // keys per softmax step: one bfloat16 P tile row
constexpr int64_t kUnitTiles = 8;   // query tiles per work unit (128 queries)
constexpr float kExpFloor = -87.f;  // exp(-87) = 1.6e-38, still a normal float
constexpr float kMasked = -1e30f;   // a masked score, and the running max before the first key: finite, since the
                                    // kernels are built with -ffast-math (no infinities assumed); exp() of it is 0

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
  const c10::BFloat16* plain;
  const int8_t* codes;
  conveyor_kv_int8::PageLayout layout;  // the cache's dimensions (and an int8 cache's pages)
  int64_t kv_head;
  bool keys;  // an int8 K cache: pages hold their codes dimension by dimension

  const c10::BFloat16* row(const Chunk& c, int64_t t, c10::BFloat16* buffer) const {
    const int64_t block_size = layout.block_size, head_dim = layout.head_dim;
    const int64_t block = c.table[t / block_size], offset = t % block_size;
    if (codes == nullptr) return plain + ((block * block_size + offset) * layout.kv_heads + kv_head) * head_dim;
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
  const int64_t d_pairs = head_dim / 2, d_tiles32 = head_dim / 32, d_tiles16 = head_dim / 16;
  const int64_t valid = std::min(keys, c.ctx);
  alignas(64) c10::BFloat16 buffer[2][256];  // rows read back from an int8 cache (head_dim <= 256, checked)
  for (int64_t t = first; t < keys; ++t) {
    uint32_t* kt_tile = kt + ((t - first) / kTile) * d_tiles32 * kTile * kTile;
    const int64_t col = t % kTile;
    if (t >= valid) {
      for (int64_t p = 0; p < d_pairs; ++p) kt_tile[(p / kTile) * kTile * kTile + (p % kTile) * kTile + col] = 0;
      continue;
    }
    const uint32_t* k_row = reinterpret_cast<const uint32_t*>(k_rows.row(c, t, buffer[0]));
    for (int64_t p = 0; p < d_pairs; ++p) kt_tile[(p / kTile) * kTile * kTile + (p % kTile) * kTile + col] = k_row[p];
  }
  // V: key pair j of a block (keys 2j, 2j + 1) -> row j of each d tile, d values interleaved with the pair's
  const __m512i first_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                              6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t t = first; t < keys; t += 2) {
    uint16_t* block = vp + ((t - first) / kKeyBlock) * d_tiles16 * kTile * kTile * 2;
    const int64_t pair = (t % kKeyBlock) / 2;
    const c10::BFloat16* even = t < valid ? v_rows.row(c, t, buffer[0]) : nullptr;
    const c10::BFloat16* odd = t + 1 < valid ? v_rows.row(c, t + 1, buffer[1]) : nullptr;
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

// One query tile (16 rows of head `head`, queries q0 .. q0 + 15 of the chunk, the valid ones < n) over its keys
// (0, or its window's first, .. its last position), from kt / vp packed from key `packed_first` on -> out rows.
void attend_tile(const Chunk& c, int64_t head, int64_t q0, int64_t window, const c10::BFloat16* q,
                 int64_t q_row_stride, int64_t head_dim, float scale, int64_t packed_first, const uint32_t* kt,
                 const uint16_t* vp, c10::BFloat16* q_tiles, c10::BFloat16* p_tile, float* scores, float* acc,
                 float* partial, c10::BFloat16* out, int64_t out_row_stride) {
  const int64_t rows = std::min(kTile, c.n - q0), d_tiles32 = head_dim / 32, d_tiles16 = head_dim / 16;
  const int64_t first_pos = c.ctx - c.n + q0;  // position of the tile's first query
  const int64_t last_pos = first_pos + rows - 1;
  // Q rows -> [head_dim / 32][16][32] bfloat16 (rows past the chunk zero)
  for (int64_t r = 0; r < kTile; ++r) {
    for (int64_t dt = 0; dt < d_tiles32; ++dt) {
      c10::BFloat16* dst = q_tiles + (dt * kTile + r) * 32;
      if (r < rows) {
        std::memcpy(dst, q + (c.q_row + q0 + r) * q_row_stride + head * head_dim + dt * 32, 64);
      } else {
        std::memset(dst, 0, 64);
      }
    }
  }
  alignas(64) float row_max[kTile], row_sum[kTile];
  for (int64_t r = 0; r < kTile; ++r) {
    row_max[r] = kMasked;
    row_sum[r] = 0.f;
  }
  std::fill(acc, acc + kTile * head_dim, 0.f);
  const __m512 scale_v = _mm512_set1_ps(scale), masked_v = _mm512_set1_ps(kMasked);
  const __m512 floor_v = _mm512_set1_ps(kExpFloor);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t blocks = last_pos / kKeyBlock + 1;
  for (int64_t kb = first_key(first_pos, window) / kKeyBlock; kb < blocks; ++kb) {
    const int64_t packed = kb - packed_first / kKeyBlock;  // the block's index in kt / vp
    // S = Q . K^T for keys kb * 32 .. + 31
    _tile_zero(6);
    _tile_zero(7);
    const uint32_t* k0 = kt + (2 * packed) * d_tiles32 * kTile * kTile;
    const uint32_t* k1 = k0 + d_tiles32 * kTile * kTile;
    for (int64_t dt = 0; dt < d_tiles32; ++dt) {
      _tile_loadd(4, q_tiles + dt * kTile * 32, 64);
      _tile_loadd(5, k0 + dt * kTile * kTile, 64);
      _tile_dpbf16ps(6, 4, 5);
      _tile_loadd(5, k1 + dt * kTile * kTile, 64);
      _tile_dpbf16ps(7, 4, 5);
    }
    _tile_stored(6, scores, 128);
    _tile_stored(7, scores + kTile, 128);
    // online softmax, row by row; P rows rounded to bfloat16 into the A tile of the P.V product. exp() only ever
    // sees arguments >= kExpFloor (libmvec's expf takes a slow scalar path per lane for arguments that underflow);
    // masked keys get probability 0 through the mask instead.
    const int64_t key0 = kb * kKeyBlock;
    const bool masked = key0 + kKeyBlock - 1 > first_pos ||  // some key past some row's position,
                        (window > 0 && key0 < last_pos - window + 1);  // or before some row's window
    alignas(64) float new_max[kTile], block_sum[kTile];
    for (int64_t r = 0; r < kTile; ++r) {
      __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(scores + r * 32), scale_v);
      __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(scores + r * 32 + 16), scale_v);
      __mmask16 valid0 = 0xFFFF, valid1 = 0xFFFF;
      if (masked) {  // keys outside this row's range (rows past the chunk attend like its last row)
        const int64_t pos = std::min(first_pos + r, last_pos);
        const __m512i last_v = _mm512_set1_epi32(static_cast<int>(pos - key0));  // the last key allowed, in block
        const __m512i first_v = _mm512_set1_epi32(static_cast<int>(window > 0 ? pos - window + 1 - key0 : -1));
        const __m512i lane1 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
        valid0 = _mm512_cmple_epi32_mask(lane, last_v) & _mm512_cmpge_epi32_mask(lane, first_v);
        valid1 = _mm512_cmple_epi32_mask(lane1, last_v) & _mm512_cmpge_epi32_mask(lane1, first_v);
      }
      const float block_max = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_mask_mov_ps(masked_v, valid0, s0), _mm512_mask_mov_ps(masked_v, valid1, s1)));
      new_max[r] = std::max(row_max[r], block_max);  // kMasked while no key of the row's range came yet
      const __m512 m = _mm512_set1_ps(new_max[r]);
      const __m512 p0 = _mm512_maskz_mov_ps(valid0, _ZGVeN16v_expf(_mm512_max_ps(_mm512_sub_ps(s0, m), floor_v)));
      const __m512 p1 = _mm512_maskz_mov_ps(valid1, _ZGVeN16v_expf(_mm512_max_ps(_mm512_sub_ps(s1, m), floor_v)));
      block_sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      _mm512_storeu_si512(p_tile + r * 32,
                          _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(p0)), to_bf16(p1), 1));
    }
    // alpha = exp(old max - new max): 1 where the max held; while the old max is kMasked the sums and outputs it
    // scales are 0
    const __m512 new_max_v = _mm512_load_ps(new_max);
    alignas(64) float alpha[kTile];
    _mm512_store_ps(alpha, _ZGVeN16v_expf(_mm512_max_ps(_mm512_sub_ps(_mm512_load_ps(row_max), new_max_v), floor_v)));
    _mm512_store_ps(row_sum, _mm512_fmadd_ps(_mm512_load_ps(row_sum), _mm512_load_ps(alpha), _mm512_load_ps(block_sum)));
    _mm512_store_ps(row_max, new_max_v);
    // O = O * alpha + P . V, four d tiles (64 values) at a time
    const uint16_t* v_block = vp + packed * d_tiles16 * kTile * kTile * 2;
    _tile_loadd(4, p_tile, 64);
    for (int64_t d0 = 0; d0 < d_tiles16; d0 += 4) {
      const int64_t group = std::min<int64_t>(4, d_tiles16 - d0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      _tile_loadd(5, v_block + (d0 + 0) * kTile * kTile * 2, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (group > 1) {
        _tile_loadd(5, v_block + (d0 + 1) * kTile * kTile * 2, 64);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (group > 2) {
        _tile_loadd(5, v_block + (d0 + 2) * kTile * kTile * 2, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (group > 3) {
        _tile_loadd(5, v_block + (d0 + 3) * kTile * kTile * 2, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, partial, 256);
      _tile_stored(1, partial + 16, 256);
      _tile_stored(2, partial + 32, 256);
      _tile_stored(3, partial + 48, 256);
      for (int64_t r = 0; r < kTile; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t j = 0; j < group; ++j) {
          float* o = acc + r * head_dim + (d0 + j) * kTile;
          _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), a, _mm512_loadu_ps(partial + r * 64 + j * kTile)));
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
    c10::BFloat16* o = out + (c.q_row + q0 + r) * out_row_stride + head * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16)
      store_bf16(o + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * head_dim + d), inv), 0xFFFF);
  }
}
#endif

}  // namespace

bool prefill_attention_available() {
#if defined(CONVEYOR_PREFILL_AMX)
  return conveyor_amx::available();
#else
  return false;
#endif
}

// q [tokens, heads, head_dim] bfloat16 (head_dim contiguous, heads adjacent); k_cache, v_cache [num_blocks,
// block_size, kv_heads, head_dim] bfloat16 contiguous, or int8 [num_blocks, kv_heads, block_size * (head_dim + 4)]
// (conveyor/model/kv_int8.py), holding every chunk's K/V already; block_tables [chunks, max_blocks] int64; spans
// [chunks, 3] int64 (first query row in q, queries, context length); out [tokens, heads, head_dim] contiguous: the
// chunks' rows are written, other rows are left as they are. window: the layer's sliding window (keys p - window
// + 1 .. p), 0 for none.
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& spans, double scale, int64_t window,
                       torch::Tensor& out) {
  TORCH_CHECK(prefill_attention_available(), "prefill_attention needs AMX-BF16 (see prefill_attention_available)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q must be a bfloat16 CPU tensor [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "the K and V caches must be contiguous, of one shape and dtype");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  int64_t kv_heads = 0, block_size = 0;
  if (int8_cache) {
    const auto pages = conveyor_kv_int8::page_layout(k_cache, head_dim, 256, "prefill_attention");
    kv_heads = pages.kv_heads;
    block_size = pages.block_size;
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 && k_cache.size(3) == head_dim,
                "caches must be bfloat16 [num_blocks, block_size, kv_heads, head_dim] with q's head_dim (or int8)");
    kv_heads = k_cache.size(2);
    block_size = k_cache.size(1);
  }
  TORCH_CHECK(head_dim % 32 == 0 && kv_heads > 0 && heads % kv_heads == 0,
              "head_dim must be a multiple of 32 and heads a multiple of kv_heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "out must be contiguous bfloat16 with q's shape");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == torch::kInt64 && spans.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == spans.size(0) &&
                  block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "spans [chunks, 3] and block_tables [chunks, max_blocks] must be contiguous int64");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 for none), got ", window);
#if defined(CONVEYOR_PREFILL_AMX)
  const int64_t num_chunks = spans.size(0), max_blocks = block_tables.size(1), group = heads / kv_heads;
  const int64_t* span = spans.data_ptr<int64_t>();
  std::vector<Chunk> chunks(num_chunks);
  std::vector<Unit> units;
  int64_t max_keys = 0;
  for (int64_t i = 0; i < num_chunks; ++i) {
    const int64_t q_row = span[3 * i], n = span[3 * i + 1], ctx = span[3 * i + 2];
    TORCH_CHECK(n >= 1 && ctx >= n && q_row >= 0 && q_row + n <= q.size(0) &&
                    (ctx + block_size - 1) / block_size <= max_blocks,
                "chunk ", i, ": rows ", q_row, "+", n, " with context ", ctx, " do not fit q or its block table");
    chunks[i] = Chunk{q_row, n, ctx, block_tables.data_ptr<int64_t>() + i * max_blocks};
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
  const c10::BFloat16* q_ptr = q.data_ptr<c10::BFloat16>();
  const c10::BFloat16* k_ptr = int8_cache ? nullptr : k_cache.data_ptr<c10::BFloat16>();
  const c10::BFloat16* v_ptr = int8_cache ? nullptr : v_cache.data_ptr<c10::BFloat16>();
  const int8_t* k_codes = int8_cache ? k_cache.data_ptr<int8_t>() : nullptr;
  const int8_t* v_codes = int8_cache ? v_cache.data_ptr<int8_t>() : nullptr;
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  const conveyor_kv_int8::PageLayout layout{kv_heads, block_size, head_dim};
  const int64_t q_row_stride = q.stride(0), out_row_stride = heads * head_dim;
  const float scale_f = static_cast<float>(scale);
  std::atomic<int64_t> next_unit{0};
  const int64_t num_units = static_cast<int64_t>(units.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_units), 1, [&](int64_t, int64_t) {
    thread_local conveyor_amx::TileBuffer<uint32_t> kt;  // [keys / 16][head_dim / 32][16][16]
    thread_local conveyor_amx::TileBuffer<uint16_t> vp;  // [keys / 32][head_dim / 16][16][16][2]
    thread_local conveyor_amx::TileBuffer<c10::BFloat16> q_tiles, p_tile;
    thread_local conveyor_amx::TileBuffer<float> scores, acc, partial;
    kt.resize(max_keys * head_dim / 2);
    vp.resize(max_keys * head_dim);
    q_tiles.resize(kTile * head_dim);
    p_tile.resize(kTile * kKeyBlock);
    scores.resize(kTile * kKeyBlock);
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
        for (int64_t t = unit.tile_begin; t < unit.tile_end; ++t)
          attend_tile(c, h, t * kTile, window, q_ptr, q_row_stride, head_dim, scale_f, first, kt.data(), vp.data(),
                      q_tiles.data(), p_tile.data(), scores.data(), acc.data(), partial.data(), out_ptr,
                      out_row_stride);
    }
    _tile_release();
  });
#endif
}
