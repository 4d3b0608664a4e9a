// float32 matrix products for the row counts of decode steps and small prefill chunks (CPU).
//
// Why: with few rows and weights streamed from DRAM (every decode step), a generic GEMM runs well below the
// machine's FMA rate; this one overlaps the weight stream with the arithmetic. Past a few hundred rows torch's
// GEMM is the faster one (conveyor.model.layers chooses; tune with `conveyor bench decode-step --dtype float32`).
//
// Layout (conveyor.model.layers.pack_f32_panels): W [out, in] is cut into panels of 32 output
// columns, each stored [in][32], so a panel is one contiguous stream and a row of it is two
// AVX-512 registers:
//   panels[p][k][c] = W[32 p + c][k]     (zero past the last output row)
//
// Per panel, blocks of up to 12 activation rows each keep 12 x 32 float32 sums in 24 registers:
// one k step loads two weight registers, broadcasts 12 activations and issues 24 FMAs. The rows are
// first copied k-major per block ([K][12]), so that the broadcasts read from one pointer. The first
// row block streams the panel from memory into L2, the others re-read it from there. While a panel
// is multiplied, the next one is prefetched into L2, spread evenly over its (depth chunk, row block)
// units, so the memory stream overlaps the arithmetic.
// Sums run in k order with fused multiply-adds over 128 input columns at a time, which are then added
// up in y (summing all columns in one register chain doubled the error against float64). Not torch's
// order: results differ from torch's in the last bits (tests bound both against float64). Exactness invariant:
// each output is summed by one thread in one order whatever the thread count, so the bits do not depend on it.
//
// Tuning constants (`conveyor bench decode-step --dtype float32`, and `conveyor bench throughput` for chunks):
//   kMaxBlockRows            activation rows per register block (24 accumulators of the 32 registers).
//   kDepth                   input columns summed in registers before y is updated (error vs passes over y).
//   kChunkBytes              activation rows per chunk (they and a panel stay in L2).
//   kMinPanelBytesPerThread  less weight per thread is not worth waking a thread for.
//
// More rows than fit L2 beside a panel are done in chunks, each streaming the weights again.
// Needs AVX-512F; built without it the op raises and Python keeps torch's GEMM.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanelCols = 32;          // output columns per panel: two AVX-512 registers
constexpr int kMaxBlockRows = 12;           // activation rows per register block (24 accumulators)
constexpr int64_t kDepth = 128;             // input columns summed in registers before y is updated
constexpr int64_t kChunkBytes = 786432;     // activation rows per chunk: 768 KiB of them (L2 is 2 MiB)
constexpr int64_t kMinPanelBytesPerThread = 32768;  // less is not worth waking a thread for

// Prefetch plan for the next panel: this row block prefetches its share of it from `start`, advancing
// `step` bytes per k step and touching `lines` cache lines from there (several when the share is more
// than 64 bytes per k step).
struct Prefetch {
  const char* start = nullptr;
  int64_t step = 0;
  int lines = 0;
};

// y[r][0..cols) (+)= a[0..K)[r] . panel[0..K)[0..32) for R rows, sums in registers; `first` stores
// the sums, otherwise they are added to y; bias (when given) is added last. a holds the R rows packed
// k-major ([K][R]), so all broadcasts read from one pointer.
template <int R>
void block_rows(const float* a, const float* panel, int64_t K, float* y, int64_t ldy, int64_t cols, bool first,
                const float* bias, Prefetch prefetch) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanelCols);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanelCols + 16);
    for (int line = 0; line < prefetch.lines; ++line)
      _mm_prefetch(prefetch.start + k * prefetch.step + 64 * line, _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[k * R + r]);
      acc[r][0] = _mm512_fmadd_ps(x, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, w1, acc[r][1]);
    }
  }
  const __mmask16 low = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 bias0 = _mm512_setzero_ps(), bias1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias0 = _mm512_maskz_loadu_ps(low, bias);
    bias1 = _mm512_maskz_loadu_ps(high, bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    __m512 v0 = acc[r][0], v1 = acc[r][1];
    if (!first) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(low, y + r * ldy), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(high, y + r * ldy + 16), v1);
    }
    if (bias != nullptr) {
      v0 = _mm512_add_ps(v0, bias0);
      v1 = _mm512_add_ps(v1, bias1);
    }
    _mm512_mask_storeu_ps(y + r * ldy, low, v0);
    _mm512_mask_storeu_ps(y + r * ldy + 16, high, v1);
  }
}

using BlockFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, bool, const float*, Prefetch);

template <int... Rows>
constexpr std::array<BlockFn, sizeof...(Rows)> block_table(std::integer_sequence<int, Rows...>) {
  return {&block_rows<Rows + 1>...};
}

constexpr std::array<BlockFn, kMaxBlockRows> kBlockFns = block_table(std::make_integer_sequence<int, kMaxBlockRows>{});

// Register blocks of a chunk of `rows` rows: as few as hold them, sizes differing by at most one
// (the larger ones first).
int64_t num_blocks(int64_t rows) { return (rows + kMaxBlockRows - 1) / kMaxBlockRows; }
int64_t block_size(int64_t rows, int64_t b) { return rows / num_blocks(rows) + (b < rows % num_blocks(rows) ? 1 : 0); }
int64_t block_start(int64_t rows, int64_t b) {
  return b * (rows / num_blocks(rows)) + std::min(b, rows % num_blocks(rows));
}

// x rows [m0, m0 + rows) -> packed [rows * K]: block by block, each k-major [K][block rows].
void pack_rows(const float* x, int64_t K, int64_t m0, int64_t rows, float* packed) {
  const int64_t blocks = num_blocks(rows);
  conveyor_parallel::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = block_start(rows, b), R = block_size(rows, b);
      float* out = packed + r0 * K;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < K; ++k) out[k * R + r] = x[(m0 + r0 + r) * K + k];
    }
  });
}

// rows [m0, m0 + rows) of y against panels [begin, end), from their packed copy: per panel, per
// kDepth input columns, per register block. Each (depth, block) unit prefetches an equal share of the
// next panel.
void panels_range(const float* packed, const float* panels, int64_t K, int64_t out_features, const float* bias,
                  float* y, int64_t m0, int64_t rows, int64_t begin, int64_t end) {
  const int64_t panel_floats = K * kPanelCols;
  const int64_t blocks = num_blocks(rows);
  const int64_t depths = (K + kDepth - 1) / kDepth;
  const int64_t share = (panel_floats * 4 + blocks * depths - 1) / (blocks * depths);  // bytes per unit
  for (int64_t p = begin; p < end; ++p) {
    const float* panel = panels + p * panel_floats;
    const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + panel_floats) : nullptr;
    const int64_t cols = std::min(kPanelCols, out_features - p * kPanelCols);
    for (int64_t d = 0; d < depths; ++d) {
      const int64_t k0 = d * kDepth, depth = std::min(kDepth, K - k0);
      const int64_t step = (share + depth - 1) / depth;  // share / depth, rounded up (to 64 * lines above 64)
      const int lines = static_cast<int>((step + 63) / 64);
      int64_t r0 = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t R = block_size(rows, b);
        Prefetch prefetch;  // none after the range's last panel
        if (next != nullptr) prefetch = {next + (d * blocks + b) * share, lines > 1 ? 64 * lines : step, lines};
        kBlockFns[R - 1](packed + r0 * K + k0 * R, panel + k0 * kPanelCols, depth,
                         y + (m0 + r0) * out_features + p * kPanelCols, out_features, cols, d == 0,
                         d + 1 == depths && bias != nullptr ? bias + p * kPanelCols : nullptr, prefetch);
        r0 += R;
      }
    }
  }
}

}  // namespace

namespace conveyor_ops {

// x [rows, K] float32; panels [num_panels, K, 32] float32 (layout above); bias [out] or null -> y [rows, out].
void f32_linear(const float* xp, int64_t rows, int64_t K, const float* wp, int64_t num_panels, int64_t out_features,
                const float* bp, float* yp) {
  if (rows == 0 || out_features == 0) return;
  const int64_t chunk_limit = std::max<int64_t>(kMaxBlockRows, kChunkBytes / (4 * K));
  const int64_t chunks = (rows + chunk_limit - 1) / chunk_limit;
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  const int64_t grain = std::max<int64_t>(1, kMinPanelBytesPerThread / (K * kPanelCols * 4));
  const std::unique_ptr<float[]> packed(new float[chunk_rows * K]);  // every element written before read
  for (int64_t m0 = 0; m0 < rows; m0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - m0);
    pack_rows(xp, K, m0, n, packed.get());
    conveyor_parallel::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
      panels_range(packed.get(), wp, K, out_features, bp, yp, m0, n, begin, end);
    });
  }
}

bool f32_linear_vectorized() { return true; }

}  // namespace conveyor_ops

#else  // no AVX-512 in this build (the compiler's -march=native lacks it): bindings.cpp raises before calling

namespace conveyor_ops {
bool f32_linear_vectorized() { return false; }
void f32_linear(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*) {}
}  // namespace conveyor_ops

#endif
