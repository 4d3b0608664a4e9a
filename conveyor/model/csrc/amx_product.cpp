// amx_product.cpp: the many-rows product y = x W^T on AMX tiles (TDPBF16PS), for bfloat16 weights packed at load
// (bindings.cpp's bf16_linear_amx / bf16_silu_gate_amx / bf16_linear_argmax_amx, decode_layers.cpp) and for GGUF
// weights dequantized on the fly (gguf_linear.cpp's gguf_stack_product_amx; gguf_amx.cpp dequantizes).
//
// Operand roles. One tile product is C [16 x 16] float32 += A [16 x 32 k] bf16 . B [32 k x 16] bf16. Either the
// weight rows are A and the activation rows B (dequantized weights: kWeightsAsB false), or the roles are swapped
// (packed weights read in place: kWeightsAsB true, which stores y row-contiguous without a transpose). Two weight
// tiles x two activation tiles give the four accumulators (tmm0-3) of one "pair"; tmm4-7 hold the operands.
//
//   weights, packed at load (layers.pack_bf16_tiles), 32 rows (kBlockN) per block:
//     tiles[out / 16][in / 32][16 k pairs][16 rows][2]       one 1 KiB tile = 16 rows x 32 k, pair-interleaved
//       row tile t, k tile kt:  W[16t + r][32kt + 2p + h] at (t, kt, p, r, h)
//   weights, dequantized (GGUF): per block [2][in / 32][16 rows][32 k]   (A layout: rows 64 bytes apart)
//   activations, packed per chunk of rows (pack_activations):
//     packed[row tiles][in / 32][16 k pairs][16 rows][2]     (B layout; rows past the last are zeros)
//
//        k ->  kt=0        kt=1              y (bfloat16, rows x out)
//   W   +----------+----------+ ...          +----+----+
//   blk | A0 (16r) | A0'      |              | C0 | C1 |  <- 16 weight rows x 32 activation rows
//       | A1 (16r) | A1'      |              | C2 | C3 |     per pair, summed over every kt
//       +----------+----------+ ...          +----+----+
//   x chunk: B0 (16 rows), B1 (16 rows) per kt, from the packed panel in L2
//
// Inputs wider than kPanelValues are taken a panel of columns at a time (accumulators kept in float32 between
// panels). Results are stored as bfloat16 (non-temporal for large outputs), or for gated weights
// (interleave_gate_up: each 32-row block = 16 gate + their 16 up rows) silu(gate) * up, or only each row's argmax.
//
// Work: units of (one chunk of rows x kUnitBlocks weight blocks), taken in turn from an atomic counter by whichever
// thread is free, in one parallel region per call (or a caller's team: UnitTeam); no barrier inside a call.
//
// Tuning constants (all tuned with `conveyor bench throughput` for prompt-sized row counts and
// `conveyor bench decode-step` for decode-sized ones, on an AMX machine):
//   kBlockN                       weight rows per block (two A tiles): fixed by the four-accumulator pair.
//   kPanelValues                  input columns per panel: wider keeps more in registers' reach, narrower keeps
//                                 a chunk's packed panel in L2 for wide inputs.
//   kPackedBytes                  packed activations per chunk: more rows per chunk reuse each weight block more,
//                                 fewer keep the panel in L2 beside the weights.
//   kUnitBlocks                   weight blocks per unit: larger units cost fewer counter updates, smaller ones
//                                 balance the threads better.
//   kSumsBytes                    float32 accumulators kept between panels per thread (bounds blocks per unit).
//   kPrefetchRowTiles             chunk size (row tiles) from which the next weight block is requested while the
//                                 current one multiplies: hides loads for many rows, only adds loads for few.
//   kStreamAheadPieces            for 2-7 row tiles: how far ahead the block's own streams are requested.
//   kStreamRows, kStreamBytes     from these, y is written with non-temporal full-line stores (y larger than L2).
//   kStreamActivationsBlockBytes  where a weight block fits L1 in this, activation tiles load with the read-once
//                                 hint, so the block's tiles stay in L1 for the next pair.
//   DequantizedRows::kSliceValues, kPrefetchSlices   GGUF: dequantization slice size and how many slices ahead
//                                 the compact bytes are requested.
//
// Exactness invariant: every output value is summed by one thread in one order (k ascending, panel by panel) and
// rounded to bfloat16 once, however the work is split: the same bits on one thread or many, and from the team
// entry points as from the plain ones.
//
// Linux hands out the tile registers' state only on request (arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA)), asked once per process; available() is false where the CPU (cpuid) or the kernel says no.
#include "amx_product.h"
#include "vec_bf16.h"

#include "parallel.h"

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
static_assert(kTileValues == kTilePieceStride && 2 * kTile == kPackedRowMultiple, "one tile layout");
constexpr int64_t kBlockN = 32;    // weight rows multiplied together: two A tiles
constexpr int64_t kPanelValues = 2048;     // columns of the weights taken at a time (a multiple of 256)
constexpr int64_t kPackedBytes = 1 << 20;  // one panel of packed activations per chunk of rows (in L2 beside
                                           // the weights)
constexpr int64_t kUnitBlocks = 4;         // weight blocks a thread takes at a time (one panel)
constexpr int64_t kSumsBytes = 256 << 10;  // more panels: a thread takes as many blocks as have their
                                           // accumulators in this, kept between panels
// Chunks of at least this many row tiles request the next weight block while multiplying the current one: with
// many pairs of row tiles per block that hides its loads, with a decode step's few it only adds loads. Chunks of 2
// to 7 row tiles request the pieces kStreamAheadPieces ahead in the block's own two streams instead (the next block
// follows in memory), during the first pair of row tiles. One row tile requests nothing.
constexpr int64_t kPrefetchRowTiles = 8;
constexpr int64_t kStreamAheadPieces = 8;
// Products of at least this many rows, or with an output of at least kStreamBytes, store y with non-temporal
// stores, full 64-byte lines that skip the caches: y is then larger than L2 (a prompt chunk's wide outputs, a decode
// step's logits), and reading each line before writing it would cost a memory read per line; a decode step's other
// outputs are small and read back at once from the cache by the next op.
constexpr int64_t kStreamRows = 256;
constexpr int64_t kStreamBytes = int64_t{1} << 20;
// The activation tiles are loaded with the read-once hint (TILELOADDT1) where a block of weights over one panel
// fits in this much of L1 beside them: each pair of row tiles then reads its activations once per block, while the
// block's weight tiles are read again by every pair, and with plain loads the activations push them out of L1.
// Wider blocks are read from L2 either way, and there the hint does not help.
constexpr int64_t kStreamActivationsBlockBytes = 40 << 10;

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

// Activation rows [m0, m0 + count) of x [*, in] -> packed [ceil(count / 16)][in / 32][16 k pairs][16 rows][2]:
// per tile of 16 rows and 32 columns, the rows' 16 pairs in 16 registers, transposed (rows past count are zeros):
// register transposes rather than a scalar scatter of the pairs.
void pack_activations(const conveyor::BFloat16* x, int64_t m0, int64_t count, int64_t in_features, uint32_t* packed) {
  const int64_t row_tiles = (count + kTile - 1) / kTile, k_tiles = in_features / kTileK;
  for (int64_t t = 0; t < row_tiles; ++t) {
    uint32_t* dst = packed + t * k_tiles * (kTileValues / 2);
    const int64_t rows = std::min(kTile, count - t * kTile);  // of this tile
    const conveyor::BFloat16* first = x + (m0 + t * kTile) * in_features;
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
      __m512 pairs[16];  // row r's 16 pairs of columns 32 kt.. -> (transposed) pair p of the 16 rows
      for (int64_t r = 0; r < kTile; ++r)
        pairs[r] = r < rows ? _mm512_loadu_ps(first + r * in_features + kt * kTileK) : _mm512_setzero_ps();
      conveyor_vec::transpose16(pairs);
      for (int64_t p = 0; p < kTile; ++p) _mm512_storeu_ps(dst + kt * (kTileValues / 2) + p * kTile, pairs[p]);
    }
  }
}

// Activation rows [m0, m0 + count) of x [*, in] -> tiles [ceil(count / 16)][in / 32][16 rows][32 k] (the A
// operand against weights packed as B): rows of a tile 64 bytes apart, whatever `in` (a row stride of 4 KiB would
// put a tile's 16 rows in one L1 set).
void pack_rows(const conveyor::BFloat16* x, int64_t m0, int64_t count, int64_t in_features, conveyor::BFloat16* packed) {
  const int64_t row_tiles = (count + kTile - 1) / kTile, k_tiles = in_features / kTileK;
  for (int64_t t = 0; t < row_tiles; ++t) {
    conveyor::BFloat16* dst = packed + t * k_tiles * kTileValues;
    for (int64_t r = 0; r < kTile; ++r) {
      const int64_t m = t * kTile + r;
      const conveyor::BFloat16* row = x + (m0 + m) * in_features;  // [in]
      for (int64_t kt = 0; kt < k_tiles; ++kt) {
        void* piece = dst + kt * kTileValues + r * kTileK;
        if (m < count) {
          _mm512_storeu_si512(piece, _mm512_loadu_si512(row + kt * kTileK));
        } else {
          _mm512_storeu_si512(piece, _mm512_setzero_si512());
        }
      }
    }
  }
}

// Two accumulator tiles C [16 activation rows][16 weight rows], weight rows 0..15 (c0) and 16..31 (c1) of a block,
// -> y[j, i] for the valid i < n (up to 32), j < m: one 64-byte store per row, non-temporal where `stream` (then
// y + j * out_features must start a line and n be 32).
void store_rows(const float* c0, const float* c1, int64_t n, int64_t m, conveyor::BFloat16* y, int64_t out_features,
                bool stream) {
  const __mmask32 mask = n >= 2 * kTile ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
  for (int64_t j = 0; j < m; ++j) {
    const __m512i both = reinterpret_cast<__m512i>(
        _mm512_cvtne2ps_pbh(_mm512_load_ps(c1 + j * kTile), _mm512_load_ps(c0 + j * kTile)));  // [32] bf16
    if (stream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(y + j * out_features), both);
    } else {
      _mm512_mask_storeu_epi16(y + j * out_features, mask, both);
    }
  }
}

// An accumulator tile c [16][16] float32 -> r, transposed: r[j] holds column j of c.
inline void load_transposed(const float* c, __m512 r[16]) {
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * kTile);
  conveyor_vec::transpose16(r);
}

// Two accumulator tiles C [16 weight rows][16 activation rows], weight rows 0..15 (c0) and 16..31 (c1) of a block,
// -> y[j, i] for the valid i < n (up to 32), j < m: both transposed in registers, then one 64-byte store per row.
void store_transposed_pair(const float* c0, const float* c1, int64_t n, int64_t m, conveyor::BFloat16* y,
                           int64_t out_features) {
  __m512 first[16], second[16];
  load_transposed(c0, first);
  if (n > kTile) {
    load_transposed(c1, second);
  } else {
    for (int i = 0; i < 16; ++i) second[i] = _mm512_setzero_ps();
  }
  const __mmask32 mask = n >= 2 * kTile ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
  for (int64_t j = 0; j < m; ++j) {
    _mm512_mask_storeu_epi16(y + j * out_features, mask,
                             reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second[j], first[j])));
  }
}

// Two accumulator tiles C [16 weight rows][16 activation rows], a block's gate rows (gate_sums) and the matching up
// rows (up_sums), -> y[j, 0..15] = silu(gate) * up for j < m: both transposed in registers, each sum rounded to
// bfloat16 as a [gate | up] output would be, then silu and the product rounded as silu_and_mul does (store_silu_gate_rows
// for the accumulators the other way round).
void store_transposed_silu_pair(const float* gate_sums, const float* up_sums, int64_t m, conveyor::BFloat16* y,
                                int64_t y_width) {
  __m512 gate[16], up[16];
  load_transposed(gate_sums, gate);
  load_transposed(up_sums, up);
  for (int64_t j = 0; j < m; ++j) {
    const __m512 act = conveyor_vec::silu_times_bf16(conveyor_vec::round_bf16(gate[j]), conveyor_vec::round_bf16(up[j]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j * y_width), conveyor_vec::to_bf16(act));  // [16] bf16
  }
}

// One block of 32 weight rows over one panel of columns: two A operands, tile kt of each at + kt * kTileValues.
struct BlockTiles {
  const conveyor::BFloat16* first;   // rows 0..15 of the block
  const conveyor::BFloat16* second;  // rows 16..31
};

// The tiles of `ahead` (a block read next, in place, or the current block's own tiles a few pieces on; first null
// for none) -> toward L2, one tile's lines per k tile of the current block.
inline void prefetch_piece(const BlockTiles& ahead, int64_t kt) {
  if (ahead.first == nullptr) return;
  conveyor_vec::request_bytes<conveyor_vec::Request::kReadL2, kTileValues * 2>(ahead.first + kt * kTileValues);
  conveyor_vec::request_bytes<conveyor_vec::Request::kReadL2, kTileValues * 2>(ahead.second + kt * kTileValues);
}

// Four accumulators c [4][16][16] float32 (2 j + i: A tile i x B tile j) for A tiles a0, a1 ([k tiles][16][32]
// each: 16 rows of 32 values per k tile) and B tiles b0, b1 (the same, pair-interleaved), summed onto what c holds
// unless `first`; the second A or B tile only where kTwoA / kTwoB; the A or B tiles loaded with the read-once
// hint where stream_a / stream_b (kStreamActivationsBlockBytes). The tiles of `ahead` prefetched on the way;
// `each_step` called after each k tile's products are issued (vector work the core does while the tile unit
// multiplies, spread over the loop so that both stay busy), `meanwhile` once the products are issued, before their
// results are stored: the tile unit works through them while the core runs it (the previous pair's stores to y).
template <bool kTwoA, bool kTwoB, typename Meanwhile, typename EachStep>
void multiply(const conveyor::BFloat16* a0, const conveyor::BFloat16* a1, const conveyor::BFloat16* b0, const conveyor::BFloat16* b1,
              int64_t k_tiles, bool first, bool stream_a, bool stream_b, const BlockTiles& ahead, float* c,
              const Meanwhile& meanwhile, const EachStep& each_step) {
  if (first) {
    _tile_zero(0);
    if (kTwoA) _tile_zero(1);
    if (kTwoB) _tile_zero(2);
    if (kTwoA && kTwoB) _tile_zero(3);
  } else {
    _tile_loadd(0, c, 64);
    if (kTwoA) _tile_loadd(1, c + 256, 64);
    if (kTwoB) _tile_loadd(2, c + 512, 64);
    if (kTwoA && kTwoB) _tile_loadd(3, c + 768, 64);
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    prefetch_piece(ahead, kt);
    // The tile number is part of the instruction (a literal in the intrinsics' asm), hence a branch per load.
    if (stream_a) {
      _tile_stream_loadd(4, a0 + kt * kTileValues, 64);
    } else {
      _tile_loadd(4, a0 + kt * kTileValues, 64);
    }
    if (stream_b) {
      _tile_stream_loadd(6, b0 + kt * kTileValues, 64);
    } else {
      _tile_loadd(6, b0 + kt * kTileValues, 64);
    }
    if (kTwoA && stream_a) {
      _tile_stream_loadd(5, a1 + kt * kTileValues, 64);
    } else if (kTwoA) {
      _tile_loadd(5, a1 + kt * kTileValues, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    if (kTwoA) _tile_dpbf16ps(1, 5, 6);
    if (kTwoB) {
      if (stream_b) {
        _tile_stream_loadd(7, b1 + kt * kTileValues, 64);
      } else {
        _tile_loadd(7, b1 + kt * kTileValues, 64);
      }
      _tile_dpbf16ps(2, 4, 7);
      if (kTwoA) _tile_dpbf16ps(3, 5, 7);
    }
    each_step();
  }
  meanwhile();  // vector work while the tile unit finishes the products above
  _tile_stored(0, c, 64);
  if (kTwoA) _tile_stored(1, c + 256, 64);
  if (kTwoB) _tile_stored(2, c + 512, 64);
  if (kTwoA && kTwoB) _tile_stored(3, c + 768, 64);
}

// GGUF weights: each block dequantized by `weight_row` into the thread's scratch [2][panel k tiles][16][32], the A
// operand (the activations pair-interleaved as B, the accumulators [weight rows][activation rows]).
// A block is dequantized in slices (one row's columns of the panel each), so that the next block's slices can be
// spread over the current block's products (product's loop).
struct DequantizedRows {
  static constexpr bool kWeightsAsB = false;
  static constexpr bool kReadsInPlace = false;
  // One row of the panel per slice: smaller slices call weight_row more often, larger ones (16 rows) leave too few
  // slices to spread over the current block's products.
  static constexpr int64_t kSliceValues = kPanelValues;
  // The compact bytes of the slice this many slices on are requested (prefetch_row) as each slice is dequantized:
  // a slice is one row's 2048 values, a few hundred nanoseconds of work, about a memory load's latency. Inputs
  // wider than a panel read a panel's share of each row (1152 of 4608 bytes for Q4_K at 8192), runs too short
  // for the hardware's prefetcher to find on its own.
  static constexpr int64_t kPrefetchSlices = 2;
  const WeightRow& weight_row;
  const WeightRowPrefetch& prefetch_row;
  int64_t out_features;

  static int64_t slices(int64_t kc) { return kBlockN * ((kc + kSliceValues - 1) / kSliceValues); }

  // Slices [from, to) of block nb over columns k0..k0 + kc - 1 -> scratch (row by row, kSliceValues at a time).
  void dequantize(int64_t nb, int64_t k0, int64_t kc, conveyor::BFloat16* scratch, int64_t from, int64_t to) const {
    const int64_t n0 = nb * kBlockN, n = std::min(kBlockN, out_features - n0), panel_tiles = kc / kTileK;
    const int64_t per_row = (kc + kSliceValues - 1) / kSliceValues, total = slices(kc);
    const auto request = [&](int64_t slice) {
      const int64_t i = slice / per_row, first = slice % per_row * kSliceValues;
      if (slice < total && i < n) prefetch_row(n0 + i, k0 + first, std::min(kSliceValues, kc - first));
    };
    if (prefetch_row) {
      if (from == 0)
        for (int64_t slice = 0; slice < kPrefetchSlices; ++slice) request(slice);
      for (int64_t slice = from; slice < to; ++slice) request(slice + kPrefetchSlices);
    }
    for (int64_t slice = from; slice < to; ++slice) {
      const int64_t i = slice / per_row, first = slice % per_row * kSliceValues;
      const int64_t count = std::min(kSliceValues, kc - first);
      conveyor::BFloat16* dst = scratch + (i / kTile) * panel_tiles * kTileValues + (i % kTile) * kTileK +
                           first / kTileK * kTileValues;
      if (i < n) {
        weight_row(n0 + i, k0 + first, count, dst);
      } else {  // rows past the last: zeros (their results are not stored)
        for (int64_t kt = 0; kt < count / kTileK; ++kt) std::memset(dst + kt * kTileValues, 0, kTileK * 2);
      }
    }
  }

  static BlockTiles tiles(const conveyor::BFloat16* scratch, int64_t kc) {
    return {scratch, scratch + kc / kTileK * kTileValues};
  }

  BlockTiles block(int64_t nb, int64_t k0, int64_t kc, conveyor::BFloat16* scratch) const {
    dequantize(nb, k0, kc, scratch, 0, slices(kc));
    return tiles(scratch, kc);
  }
};

// The next block of a thread's work dequantized into the other scratch buffer, a share of its slices after each k
// tile's products are issued, while the tile unit multiplies the current block: the vector work and the tile
// products overlap instead of taking turns.
struct NextBlockSlices {
  const DequantizedRows* source = nullptr;  // null: nothing to dequantize
  int64_t nb = 0, k0 = 0, kc = 0;
  conveyor::BFloat16* scratch = nullptr;
  int64_t done = 0, total = 0, steps = 1, step = 0;

  void operator()() {  // one k tile's share
    if (source == nullptr) return;
    const int64_t target = std::min(total, (++step * total + steps - 1) / steps);
    if (target > done) source->dequantize(nb, k0, kc, scratch, done, target);
    done = std::max(done, target);
  }
  void finish() {
    if (source != nullptr && done < total) source->dequantize(nb, k0, kc, scratch, done, total);
    done = total;
  }
};

// Blocks of 32 weight rows laid out tile by tile over the whole input, [blocks][2][in / 32][16][32] (PackedTiles),
// read in place and prefetched: block nb's tiles over the panel starting at column k0.
inline BlockTiles tiles_in_place(const conveyor::BFloat16* tiles, int64_t k_tiles, int64_t nb, int64_t k0) {
  const conveyor::BFloat16* first = tiles + (2 * nb * k_tiles + k0 / kTileK) * kTileValues;
  return {first, first + k_tiles * kTileValues};
}

// bfloat16 weights packed at load, pair-interleaved ([out / 16][in / 32][16 k pairs][16 rows][2]): read in place
// as the B operand (the activations as A, the accumulators [activation rows][weight rows], stored straight).
struct PackedTiles {
  static constexpr bool kWeightsAsB = true;
  static constexpr bool kReadsInPlace = true;
  const conveyor::BFloat16* tiles;
  int64_t k_tiles;

  BlockTiles block(int64_t nb, int64_t k0, int64_t, conveyor::BFloat16*) const {
    return tiles_in_place(tiles, k_tiles, nb, k0);
  }
};

// Two accumulator tiles C [16 activation rows][16 weight rows], a block's gate rows (c0) and the matching up rows
// (c1), -> y[j, 0..15] = silu(gate) * up for j < m, each sum rounded to bfloat16 first as a [gate | up] output
// would be, then as silu_and_mul rounds (the same function). Where `staged` is given the block's 16 columns pair
// with the next block's into whole 64-byte lines, written with non-temporal stores: an even block's rows go to
// `staged` ([16][16] per activation tile), the odd block after it stores both halves (its y is 16 columns on).
inline void store_silu_gate_rows(const float* c0, const float* c1, int64_t m, conveyor::BFloat16* y, int64_t y_width,
                          bool odd_block, conveyor::BFloat16* staged) {
  for (int64_t j = 0; j < m; ++j) {
    const __m512 gate = conveyor_vec::round_bf16(_mm512_load_ps(c0 + j * kTile));
    const __m512 up = conveyor_vec::round_bf16(_mm512_load_ps(c1 + j * kTile));
    const __m256i act = conveyor_vec::to_bf16(conveyor_vec::silu_times_bf16(gate, up));  // [16] bf16
    if (staged == nullptr) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j * y_width), act);
    } else if (!odd_block) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(staged + j * kTile), act);
    } else {
      const __m256i before = _mm256_load_si256(reinterpret_cast<const __m256i*>(staged + j * kTile));
      _mm512_stream_si512(reinterpret_cast<__m512i*>(y - kTile + j * y_width),
                          _mm512_inserti64x4(_mm512_castsi256_si512(before), act, 1));
    }
  }
}

// What a product writes: y = x W^T, or (weights packed in place, rows interleaved by interleave_gate_up) the gated
// activation silu(x Wg^T) * (x Wu^T), half as wide, or (weights packed in place) no y at all: each row's first
// largest value of y, as argmax over the bfloat16 y would find it (RowArgmax).
enum class Output { kProduct, kSiluGate, kArgmax };

// Output::kArgmax: one thread's running argmax of each row of y, in 16 lanes per row ([rows][16] values and
// indices): lane l holds the best of the columns l, l + 16, l + 32, ... the thread has seen so far, each value
// rounded to bfloat16 first (the value y would hold). A thread sees a row's blocks in ascending order (its units
// ascend), so a lane keeps the first of equal values by taking only a strictly larger one; a NaN (the largest for
// torch's max) replaces any number and is never replaced. Index -1: nothing seen yet.
struct RowArgmax {
  float* values = nullptr;
  int32_t* indices = nullptr;
};

// The lanes of every thread, [threads][rows][16] each, merged by product_packed_argmax_bf16 after the product.
struct ArgmaxLanes {
  float* values;
  int32_t* indices;
  int64_t rows;
};

// Lanes whose value is a NaN, from the bits (one test, whatever the compiler assumes about comparisons).
inline __mmask16 nan_lanes(__m512 v) {
  return _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)),
                                 _mm512_set1_epi32(0x7F800000));
}

// 16 candidates (value, index), the `valid` lanes, folded into 16 running lanes (RowArgmax's rule).
inline void fold_candidates(__m512& best, __m512i& best_index, __m512 value, __m512i index, __mmask16 valid) {
  const __mmask16 unset = _mm512_cmplt_epi32_mask(best_index, _mm512_setzero_si512());
  const __mmask16 larger = _mm512_cmp_ps_mask(value, best, _CMP_GT_OQ) | nan_lanes(value);
  const __mmask16 take = valid & (unset | (larger & ~nan_lanes(best)));
  best = _mm512_mask_mov_ps(best, take, value);
  best_index = _mm512_mask_mov_epi32(best_index, take, index);
}

// Two accumulator tiles C [16 activation rows][16 weight rows], a block's columns n0..n0 + 15 (c0) and
// n0 + 16..n0 + 31 (c1), of which the first n are real, -> rows row0..row0 + m - 1 of `best`.
void fold_argmax_rows(const float* c0, const float* c1, int64_t n, int64_t m, int64_t row0, int64_t n0,
                      const RowArgmax& best) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i first = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(n0)));
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int32_t>(kTile)));
  const __mmask16 valid_first = conveyor_vec::tail_mask(n);
  const __mmask16 valid_second = n > kTile ? conveyor_vec::tail_mask(n - kTile) : __mmask16{0};
  for (int64_t j = 0; j < m; ++j) {
    float* values = best.values + (row0 + j) * kTile;
    int32_t* indices = best.indices + (row0 + j) * kTile;
    __m512 v = _mm512_load_ps(values);
    __m512i i = _mm512_load_si512(indices);
    fold_candidates(v, i, conveyor_vec::round_bf16(_mm512_load_ps(c0 + j * kTile)), first, valid_first);
    if (valid_second != 0) {
      fold_candidates(v, i, conveyor_vec::round_bf16(_mm512_load_ps(c1 + j * kTile)), second, valid_second);
    }
    _mm512_store_ps(values, v);
    _mm512_store_si512(indices, i);
  }
}

// Rows [from, to) of a gated pair's results (row r: activation tile r / 16, its row r % 16; rows m_first.. of y;
// weights as B, Output::kSiluGate; staged as store_silu_gate_rows takes it, or null). store_pair stores all of a
// pair's rows; product() where `sliced` a slice of them after each k tile of the next pair's products, so that the
// core's SiLU epilogue runs between the tile unit's products. Stored after them all, it would wait behind the pair's
// products in the reorder buffer.
inline void store_silu_pair_rows(const float* c, int64_t from, int64_t to, int64_t m_first, int64_t n0,
                                 conveyor::BFloat16* y, int64_t y_width, conveyor::BFloat16* staged) {
  for (int64_t j = from / kTile; j * kTile < to; ++j) {  // activation tile
    const int64_t lo = std::max(from, j * kTile) - j * kTile, hi = std::min(to, (j + 1) * kTile) - j * kTile;
    const float* gate = c + j * kTile * kTile + lo * kTile;
    const float* up = c + (2 + j) * kTile * kTile + lo * kTile;
    store_silu_gate_rows(gate, up, hi - lo, y + (m_first + j * kTile + lo) * y_width + n0 / 2, y_width,
                         n0 / kBlockN % 2 == 1, staged == nullptr ? nullptr : staged + j * kTile * kTile + lo * kTile);
  }
}

// The accumulators of one pair of activation tiles (t, t + 1 where `two`) x one block of weights, the pair's
// four tiles at c, -> y [rows, y_width] (rows m0 + 16 t.., the block's columns n0..n0 + n - 1, or n0 / 2..
// n0 / 2 + 15 for kSiluGate); non-temporal stores where `stream` and the block's 32 columns fill a line.
// kSiluGate with `stream`: the pair's outputs staged at `staged` ([2][16][16]) for an even block, stored with the
// next, odd block's.
template <bool kWeightsAsB>
void store_pair(const float* c, bool two, int64_t m_first, int64_t rows, int64_t n0, int64_t n, conveyor::BFloat16* y,
                int64_t y_width, bool stream, Output output, conveyor::BFloat16* staged, const RowArgmax& best) {
  if (kWeightsAsB && output == Output::kSiluGate) {
    store_silu_pair_rows(c, 0, std::min((two ? 2 : 1) * kTile, rows - m_first), m_first, n0, y, y_width,
                         stream ? staged : nullptr);
    return;
  }
  for (int64_t j = 0; j < (two ? 2 : 1); ++j) {  // activation tile
    const int64_t m_tile = m_first + j * kTile, m = std::min(kTile, rows - m_tile);
    if (kWeightsAsB && output == Output::kArgmax) {
      fold_argmax_rows(c + j * kTile * kTile, c + (2 + j) * kTile * kTile, n, m, m_tile, n0, best);
      continue;
    }
    if (kWeightsAsB) {
      conveyor::BFloat16* to = y + m_tile * y_width + n0;
      const bool whole_lines = n == kBlockN && reinterpret_cast<uintptr_t>(to) % 64 == 0 && y_width % 32 == 0;
      store_rows(c + j * kTile * kTile, c + (2 + j) * kTile * kTile, n, m, to, y_width, stream && whole_lines);
      continue;
    }
    if (output == Output::kSiluGate) {  // a block's 32 weight rows: 16 gate rows, then their 16 up rows
      store_transposed_silu_pair(c + 2 * j * kTile * kTile, c + (2 * j + 1) * kTile * kTile, m,
                                 y + m_tile * y_width + n0 / 2, y_width);
      continue;
    }
    store_transposed_pair(c + 2 * j * kTile * kTile, c + (2 * j + 1) * kTile * kTile, n, m,
                          y + m_tile * y_width + n0, y_width);
  }
}

// Rows of activations packed at a time: one panel of them fills kPackedBytes.
int64_t chunk_rows_for(int64_t in_features) {
  const int64_t panel_values = std::min(in_features, kPanelValues);
  return std::max<int64_t>(2 * kTile, kPackedBytes / (panel_values * 2) / (2 * kTile) * 2 * kTile);
}

// `team`: run by every thread of a team already in one parallel region (UnitTeam); null: in a parallel region of
// its own.
template <typename Weights>
void product(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
             const Weights& weight_source, conveyor::BFloat16* y, Output output = Output::kProduct,
             const ArgmaxLanes* argmax = nullptr, const UnitTeam* team = nullptr) {
  constexpr bool kWeightsAsB = Weights::kWeightsAsB, kReadsInPlace = Weights::kReadsInPlace;
  const int64_t k_tiles = in_features / kTileK, panels = (in_features + kPanelValues - 1) / kPanelValues;
  const int64_t panel_values = std::min(in_features, kPanelValues), chunk_rows = chunk_rows_for(in_features);
  const int64_t chunk_tiles = (std::min(chunk_rows, rows) + kTile - 1) / kTile, chunk_pairs = (chunk_tiles + 1) / 2;
  const int64_t n_blocks = (out_features + kBlockN - 1) / kBlockN;
  const int64_t pair_floats = 4 * kTile * kTile;  // the four accumulators of a pair of activation tiles
  // Several panels: as many blocks per unit as have their accumulators in kSumsBytes, but no more than a
  // quarter of each thread's share of the chunk's blocks, so that a few rows still spread over every thread.
  const int64_t threads = team != nullptr ? team->threads : conveyor_parallel::num_threads();
  const int64_t share = std::max<int64_t>(1, n_blocks / (4 * threads));
  const int64_t blocks_per_unit =
      panels > 1 ? std::clamp<int64_t>(kSumsBytes / (chunk_pairs * pair_floats * 4), 1, share) : kUnitBlocks;
  // kSiluGate pairs its blocks (even, odd) within a unit, so that one thread writes whole lines of y.
  const int64_t unit_blocks =
      output == Output::kSiluGate ? std::max<int64_t>(2, blocks_per_unit / 2 * 2) : blocks_per_unit;
  const int64_t units_per_chunk = (n_blocks + unit_blocks - 1) / unit_blocks;
  const int64_t units = (rows + chunk_rows - 1) / chunk_rows * units_per_chunk;
  // One parallel region per call, its units (a chunk of rows x unit_blocks weight blocks, chunk by chunk) taken
  // in turn by whichever thread is free (each claims its next unit before it starts one, to prefetch or dequantize
  // its first block meanwhile), each thread packing the chunk it works on itself: no barrier inside a call, so
  // that on a shared machine a thread waiting for its core holds up no other.
  const int64_t y_width = output == Output::kSiluGate ? out_features / 2 : out_features;
  const bool stream_activations = kBlockN * panel_values * 2 <= kStreamActivationsBlockBytes;
  const bool stream_a = kWeightsAsB && stream_activations, stream_b = !kWeightsAsB && stream_activations;
  const bool stream = output != Output::kArgmax && (rows >= kStreamRows || rows * y_width * 2 >= kStreamBytes) &&
                      (output == Output::kProduct ||
                       (kWeightsAsB && y_width % (2 * kTile) == 0 && reinterpret_cast<uintptr_t>(y) % 64 == 0));
  // The gated product (weights as B) over chunks of many row tiles: the pending pair's stores sliced over the next
  // pair's k tiles (store_silu_pair_rows). With few row tiles (two pairs per block, the weights read from memory)
  // slicing does not pay, nor for plain outputs, whose stores are a conversion per row.
  const bool sliced = kWeightsAsB && output == Output::kSiluGate && chunk_tiles >= kPrefetchRowTiles;
  std::atomic<int64_t> own_next_unit{0};
  std::atomic<int64_t>& next_unit = team != nullptr ? *team->next_unit : own_next_unit;
  const auto run_units = [&] {
    thread_local TileBuffer<uint32_t> packed_storage;  // [chunk row tiles][k tiles][16][32] bf16 (as pairs)
    thread_local TileBuffer<conveyor::BFloat16> scratch;    // [2][panel k tiles][16][32] (dequantized weights)
    thread_local TileBuffer<float> sums;               // [unit blocks (1 for one panel)][chunk pairs][4][16][16]
    thread_local TileBuffer<conveyor::BFloat16> staged;     // kSiluGate, streamed: [chunk pairs][2][16][16]
    packed_storage.resize(chunk_tiles * k_tiles * kTileValues / 2);
    const int64_t block_values = 2 * (panel_values / kTileK) * kTileValues;  // one block over one panel
    if (!kReadsInPlace) scratch.resize(2 * block_values);  // the block multiplied, and the next one
    conveyor::BFloat16* const buffers[2] = {scratch.data(), scratch.data() + block_values};
    int current = 0;             // the buffer holding the block multiplied now
    bool current_ready = false;  // whether it was dequantized while the previous block multiplied
    sums.resize((panels > 1 ? unit_blocks : 1) * chunk_pairs * pair_floats);
    staged.resize(output == Output::kSiluGate && stream ? chunk_pairs * 2 * kTile * kTile : 0);
    const conveyor::BFloat16* packed = reinterpret_cast<const conveyor::BFloat16*>(packed_storage.data());
    int64_t packed_m0 = -1;  // the chunk packed_storage holds
    RowArgmax best;  // Output::kArgmax: this thread's lanes
    if (argmax != nullptr) {
      const int64_t offset = conveyor_parallel::thread_index() * argmax->rows * kTile;
      best = {argmax->values + offset, argmax->indices + offset};
    }
    configure_tiles();
    int64_t unit = next_unit++;
    while (unit < units) {
      const int64_t following = next_unit++;
      const int64_t m0 = unit / units_per_chunk * chunk_rows, count = std::min(chunk_rows, rows - m0);
      const int64_t row_tiles = (count + kTile - 1) / kTile, pairs = (row_tiles + 1) / 2;
      if (m0 != packed_m0) {
        if (kWeightsAsB) {
          pack_rows(x, m0, count, in_features, reinterpret_cast<conveyor::BFloat16*>(packed_storage.data()));
        } else {
          pack_activations(x, m0, count, in_features, packed_storage.data());
        }
        packed_m0 = m0;
      }
      const int64_t g0 = unit % units_per_chunk * unit_blocks, g_end = std::min(n_blocks, g0 + unit_blocks);
      // The last panel's results of a pair go to y while the tile unit multiplies the next pair, a block's last
      // pair's while the next block's first multiplies (at the unit's end, at once). Stored right after its own
      // block instead, a block's last pair would overlap nothing.
      struct Pending {
        const float* sums = nullptr;  // null: none
        bool two = false;
        int64_t m_first = 0, n0 = 0, n = 0;
        conveyor::BFloat16* staged = nullptr;
        int64_t stored = 0;  // how many of its rows are stored (sliced)
      } pending;
      const auto pending_rows = [&] { return std::min((pending.two ? 2 : 1) * kTile, rows - pending.m_first); };
      const auto store_pending = [&] {
        if (pending.sums == nullptr) return;
        if (sliced) {
          store_silu_pair_rows(pending.sums, pending.stored, pending_rows(), pending.m_first, pending.n0, y, y_width,
                               pending.staged);
        } else {
          store_pair<kWeightsAsB>(pending.sums, pending.two, pending.m_first, rows, pending.n0, pending.n, y,
                                  y_width, stream, output, pending.staged, best);
        }
        pending.sums = nullptr;
      };
      // After k tile `step` (1-based) of `steps`: the pending pair's rows stored up to its share of them.
      const auto store_pending_share = [&](int64_t step, int64_t steps) {
        if (!sliced || pending.sums == nullptr) return;
        const int64_t target = pending_rows() * step / steps;
        if (target <= pending.stored) return;
        store_silu_pair_rows(pending.sums, pending.stored, target, pending.m_first, pending.n0, y, y_width,
                             pending.staged);
        pending.stored = target;
      };
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t k0 = p * kPanelValues, kc = std::min(kPanelValues, in_features - k0), kt0 = k0 / kTileK;
        const int64_t panel_tiles = kc / kTileK;
        for (int64_t nb = g0; nb < g_end; ++nb) {
          const int64_t n0 = nb * kBlockN, n = std::min(kBlockN, out_features - n0);
          // The block this thread takes next: the unit's next one, the unit's first over the next panel, or the
          // following unit's first (-1: none).
          int64_t next_nb = -1, next_k0 = 0;
          if (nb + 1 < g_end) {
            next_nb = nb + 1;
            next_k0 = k0;
          } else if (p + 1 < panels) {
            next_nb = g0;
            next_k0 = k0 + kPanelValues;
          } else if (following < units) {
            next_nb = following % units_per_chunk * unit_blocks;
          }
          const int64_t next_kc = std::min(kPanelValues, in_features - next_k0);
          BlockTiles w{nullptr, nullptr}, ahead{nullptr, nullptr};  // ahead: what to prefetch, read in place
          NextBlockSlices next_slices;  // dequantized meanwhile, into the other buffer
          if constexpr (kReadsInPlace) {
            w = weight_source.block(nb, k0, kc, nullptr);
            if (next_nb >= 0) ahead = weight_source.block(next_nb, next_k0, next_kc, nullptr);
          } else {
            if (!current_ready) weight_source.block(nb, k0, kc, buffers[current]);
            w = DequantizedRows::tiles(buffers[current], kc);
            if (next_nb >= 0) {
              next_slices = {&weight_source, next_nb, next_k0, next_kc, buffers[1 - current], 0,
                             DequantizedRows::slices(next_kc), pairs * panel_tiles, 0};
            }
          }
          int64_t step = 0;  // k tiles issued in the current multiply
          const auto each_step = [&] {
            next_slices();
            store_pending_share(++step, panel_tiles);
          };
          const bool first = p == 0, last = p == panels - 1;
          for (int64_t t = 0; t < row_tiles; t += 2) {
            const conveyor::BFloat16* x0 = packed + (t * k_tiles + kt0) * kTileValues;
            const conveyor::BFloat16* x1 = x0 + k_tiles * kTileValues;
            const bool two = t + 1 < row_tiles;
            BlockTiles prefetch{nullptr, nullptr};
            if (t == 0 && row_tiles >= kPrefetchRowTiles) {
              prefetch = ahead;
            } else if (t == 0 && kReadsInPlace && two) {
              prefetch = {w.first + kStreamAheadPieces * kTileValues, w.second + kStreamAheadPieces * kTileValues};
            }
            step = 0;
            // The accumulators of the pair of row tiles t, t + 1 over this block.
            float* c = sums.data() + ((panels > 1 ? nb - g0 : 0) * pairs + t / 2) * pair_floats;
            if (kWeightsAsB && two) {  // A: activation tiles, B: weight tiles
              multiply<true, true>(x0, x1, w.first, w.second, panel_tiles, first, stream_a, stream_b, prefetch, c,
                                   store_pending, each_step);
            } else if (kWeightsAsB) {
              multiply<false, true>(x0, nullptr, w.first, w.second, panel_tiles, first, stream_a, stream_b, prefetch,
                                    c, store_pending, each_step);
            } else if (two) {  // A: weight tiles, B: activation tiles
              multiply<true, true>(w.first, w.second, x0, x1, panel_tiles, first, stream_a, stream_b, prefetch, c,
                                   store_pending, each_step);
            } else {
              multiply<true, false>(w.first, w.second, x0, nullptr, panel_tiles, first, stream_a, stream_b, prefetch,
                                    c, store_pending, each_step);
            }
            if (last) {
              pending = {c, two, m0 + t * kTile, n0, n,
                         staged.empty() ? nullptr : staged.data() + t / 2 * 2 * kTile * kTile, 0};
            }
          }
          if constexpr (!kReadsInPlace) {
            next_slices.finish();
            current_ready = next_slices.source != nullptr;
            if (current_ready) current = 1 - current;
          }
        }
      }
      store_pending();
      unit = following;
    }
    _tile_release();
    if (stream) _mm_sfence();  // the non-temporal stores reach memory before the region's end is seen
  };
  if (team != nullptr) {
    run_units();
    return;
  }
  conveyor_parallel::parallel_for(0, std::min<int64_t>(threads, units), 1, [&](int64_t, int64_t) { run_units(); });
}

}  // namespace

// The product's tiles: 0-3 accumulators C[weight tile i][activation tile j] at 2 j + i; 4, 5 weights; 6, 7
// activations (the prefill attention's: prefill_attention.cpp).
void configure_tiles() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTile;
  }
  // GCC does not know that ldtilecfg reads these 64 bytes: without the barrier it may move the stores above past
  // it, and ldtilecfg faults on whatever the stack held (how sharing this function across files crashed once).
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

bool available() {
  static const bool granted = tile_data_granted();
  return granted;
}

void product_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                  const WeightRow& weight_row, const WeightRowPrefetch& prefetch_row, conveyor::BFloat16* y) {
  product(x, rows, in_features, out_features, DequantizedRows{weight_row, prefetch_row, out_features}, y);
}

void product_silu_gate_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t inner,
                            const WeightRow& weight_row, const WeightRowPrefetch& prefetch_row, conveyor::BFloat16* y) {
  product(x, rows, in_features, 2 * inner, DequantizedRows{weight_row, prefetch_row, 2 * inner}, y, Output::kSiluGate);
}

void product_packed_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                         const conveyor::BFloat16* tiles, conveyor::BFloat16* y) {
  product(x, rows, in_features, out_features, PackedTiles{tiles, in_features / kTileK}, y);
}

void product_packed_silu_gate_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t inner,
                                   const conveyor::BFloat16* tiles, conveyor::BFloat16* y) {
  product(x, rows, in_features, 2 * inner, PackedTiles{tiles, in_features / kTileK}, y, Output::kSiluGate);
}

void product_packed_bf16_team(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                              const conveyor::BFloat16* tiles, conveyor::BFloat16* y, const UnitTeam& team) {
  product(x, rows, in_features, out_features, PackedTiles{tiles, in_features / kTileK}, y, Output::kProduct, nullptr,
          &team);
}

void product_packed_silu_gate_bf16_team(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t inner,
                                        const conveyor::BFloat16* tiles, conveyor::BFloat16* y, const UnitTeam& team) {
  product(x, rows, in_features, 2 * inner, PackedTiles{tiles, in_features / kTileK}, y, Output::kSiluGate, nullptr,
          &team);
}

namespace {

using conveyor_vec::is_nan;

// Whether candidate (value, index) comes before the best so far (index -1: none) in torch's max(dim).indices
// order: the first NaN, else the first largest value.
inline bool comes_first(float value, int32_t index, float best, int32_t best_index) {
  if (best_index < 0) return true;
  const bool value_nan = is_nan(value), best_nan = is_nan(best);
  if (value_nan != best_nan) return value_nan;
  if (value_nan || value == best) return index < best_index;
  return value > best;
}

}  // namespace

void product_packed_argmax_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                                const conveyor::BFloat16* tiles, int64_t* tokens) {
  const int64_t threads = conveyor_parallel::num_threads();
  TileBuffer<float> values(threads * rows * kTile, 0.f);
  TileBuffer<int32_t> indices(threads * rows * kTile, -1);
  const ArgmaxLanes lanes{values.data(), indices.data(), rows};
  product(x, rows, in_features, out_features, PackedTiles{tiles, in_features / kTileK}, nullptr, Output::kArgmax,
          &lanes);
  for (int64_t r = 0; r < rows; ++r) {
    float best = 0.f;
    int32_t best_index = -1;
    for (int64_t t = 0; t < threads; ++t) {
      for (int64_t l = 0; l < kTile; ++l) {
        const int64_t at = (t * rows + r) * kTile + l;
        if (indices[at] >= 0 && comes_first(values[at], indices[at], best, best_index)) {
          best = values[at];
          best_index = indices[at];
        }
      }
    }
    tokens[r] = best_index;
  }
}

}  // namespace conveyor_amx

#else

namespace conveyor_amx {
bool available() { return false; }
void configure_tiles() {}
void product_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const WeightRow&, const WeightRowPrefetch&,
                  conveyor::BFloat16*) {}
void product_silu_gate_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const WeightRow&,
                            const WeightRowPrefetch&, conveyor::BFloat16*) {}
void product_packed_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*, conveyor::BFloat16*) {}
void product_packed_silu_gate_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                                   conveyor::BFloat16*) {}
void product_packed_argmax_bf16(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*, int64_t*) {}
void product_packed_bf16_team(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*, conveyor::BFloat16*,
                              const UnitTeam&) {}
void product_packed_silu_gate_bf16_team(const conveyor::BFloat16*, int64_t, int64_t, int64_t, const conveyor::BFloat16*,
                                        conveyor::BFloat16*, const UnitTeam&) {}
}  // namespace conveyor_amx

#endif
