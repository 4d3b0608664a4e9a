// The many-rows product on AMX tiles (amx_product.cpp): y = x W^T for bfloat16 activations, the weights either
// dequantized 32 rows at a time by the caller (GGUF blocks, gguf_linear.cpp) or packed once at load in the
// tile layout (bfloat16 checkpoints, bf16_linear.cpp).
#pragma once

#include "scalar_types.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <new>
#include <vector>

namespace conveyor_amx {

// An allocator whose storage starts on a 64-byte cache line. Tile loads and stores read 16 rows of 64 bytes: a
// buffer that starts 16 bytes into a line (what malloc gives) makes every row straddle two lines, which makes a tile
// load from L1 several times slower.
template <typename T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}  // NOLINT: rebinding, as std::allocator_traits needs
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

// A thread's scratch that tiles are loaded from or stored to.
template <typename T>
using TileBuffer = std::vector<T, LineAligned<T>>;

// Whether this build has the AMX path, the CPU has AMX-BF16 and Linux granted this process the tile data
// (asked once, on the first call).
bool available();

// This thread's tiles: all eight 16 rows x 64 bytes (palette 1), as every AMX kernel here uses them; call before
// the first tile instruction of a parallel region's thread (_tile_release at its end).
void configure_tiles();

// The bfloat16 values of a weight row are laid out by tiles: its 32-value piece kt at out + kt * kTilePieceStride.
constexpr int64_t kTilePieceStride = 512;

// Values first..first + count - 1 of weight row `row` (0..out_features - 1; first a multiple of 2048, count of the
// row's block size) dequantized to bfloat16 into pieces at `out`.
using WeightRow = std::function<void(int64_t row, int64_t first, int64_t count, conveyor::BFloat16* out)>;

// The same values' compact bytes requested from memory ahead of WeightRow's call (may be empty: none).
using WeightRowPrefetch = std::function<void(int64_t row, int64_t first, int64_t count)>;

// y [rows, out] = x [rows, in] W^T for bfloat16 x and W given by `weight_row` (in a multiple of 32):
// bfloat16 products summed in float32 (AMX TDPBF16PS), rounded once to bfloat16. Runs on torch's intra-op
// threads; only where available().
void product_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                  const WeightRow& weight_row, const WeightRowPrefetch& prefetch_row, conveyor::BFloat16* y);

// y [rows, inner] = silu(x Wg^T) * (x Wu^T) for the 2 inner rows of [Wg; Wu] given by `weight_row` in
// interleave_gate_up's order (block b's rows 0..15 are gate rows 16 b.., rows 16..31 the matching up rows; the caller
// maps them; inner a multiple of 16): each sum rounds to bfloat16 as product_bf16's would, then silu and the product
// round as silu_and_mul does (the same function), so the same bits as product_bf16 followed by silu_and_mul.
void product_silu_gate_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t inner,
                            const WeightRow& weight_row, const WeightRowPrefetch& prefetch_row, conveyor::BFloat16* y);

// W packed in tiles for the B operand: tiles [ceil(out / 32) * 2][in / 32][16 k pairs][16 rows][2], tile t's
// piece kt holding rows 16 t..16 t + 15 x columns 32 kt..32 kt + 31, pair-interleaved (rows past out_features
// zero; in a multiple of 32): conveyor.model.layers.pack_bf16_tiles.
constexpr int64_t kPackedRowMultiple = 32;

// The same product for W packed by tiles (kPackedRowMultiple): read in place, the next weights prefetched.
void product_packed_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                         const conveyor::BFloat16* tiles, conveyor::BFloat16* y);

// y [rows, inner] = silu(x Wg^T) * (x Wu^T) for W = [Wg; Wu] [2 inner, in] packed by tiles with its rows
// interleaved 16 and 16 (conveyor.model.layers.interleave_gate_up; inner a multiple of 16): each block of 32 rows
// holds 16 gate rows and their 16 up rows, so its accumulators give 16 finished outputs. The sums round to
// bfloat16 as product_packed_bf16's would, then silu and the product round as the separate op does.
void product_packed_silu_gate_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t inner,
                                   const conveyor::BFloat16* tiles, conveyor::BFloat16* y);

// A team of threads already in one parallel region that runs a product together (decode_layers.cpp): every one of
// them calls a *_team function below with the same arguments and the same counter (0 before the first call), and
// they take its units in turn from it as the threads of the functions above do from theirs (the same bits). A thread
// returns when no unit is left to take, while the others may still be finishing theirs: the caller waits for them
// (a barrier) before it reads y.
struct UnitTeam {
  int64_t threads;                   // in the team
  std::atomic<int64_t>* next_unit;   // the next unit to take: one counter per product call
};

void product_packed_bf16_team(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                              const conveyor::BFloat16* tiles, conveyor::BFloat16* y, const UnitTeam& team);
void product_packed_silu_gate_bf16_team(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t inner,
                                        const conveyor::BFloat16* tiles, conveyor::BFloat16* y, const UnitTeam& team);

// Each row's first largest value of x W^T for bfloat16 weights packed as for product_packed_bf16: tokens [rows]
// = argmax over the bfloat16 product (the first NaN, else the first largest; torch's max(dim).indices), without
// writing the product: a greedy decode step's LM head and argmax in one pass over the weights.
void product_packed_argmax_bf16(const conveyor::BFloat16* x, int64_t rows, int64_t in_features, int64_t out_features,
                                const conveyor::BFloat16* tiles, int64_t* tokens);

}  // namespace conveyor_amx
