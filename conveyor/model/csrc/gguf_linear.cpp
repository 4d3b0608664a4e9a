// Matrix products with GGUF-quantized weights kept in the file's own blocks (CPU):
//   gguf_linear_rows:  few activation rows (decode steps): bfloat16 activations (and float32 ones where the
//                      caller asks: int8_float32) are quantized to int8 (once per call) and multiplied with
//                      integer dot products (gguf_vnni.cpp on AVX-512 VNNI, gguf_int8_avx2.cpp on AVX2;
//                      llama.cpp's way) where the type has one; otherwise (float32 activations by default:
//                      exactly) each weight row is dequantized once, in L1, and multiplied by every activation
//                      row (float32 sums);
//                      gguf_linear_rows_parts does the same for several matrices stacked by rows (a fused
//                      QKV of mixed types): one quantization of x, one parallel loop, one output;
//   gguf_linear_tiles: many rows (prefill chunks, busy decode steps): each thread dequantizes a tile of
//                      weight rows x all K (about kTileBytes, so that it stays in L2) to the activations'
//                      dtype in its own scratch and runs torch's GEMM (oneDNN: AVX-512 BF16 / AMX) on it
//                      (the op is in bindings.cpp, which sees torch; the row dequantizers are here);
//   gguf_linear_amx:   many rows of bfloat16 activations on AMX tiles (amx_product.cpp), each thread dequantizing
//                      its weight rows to bfloat16 itself, once per call (no GEMM library call per tile);
//                      gguf_linear_amx_parts: the same for a row stack of mixed types, in one call;
//   gguf_pack_tiles:   a row stack dequantized to bfloat16 in the tile layout of bf16_linear.cpp's products, into
//                      the caller's scratch (a prompt step's many rows: dequantized once, multiplied as a
//                      bfloat16 checkpoint's weights are, see conveyor/model/gguf_projection.py);
//   gguf_dequantize:   whole rows to float32 (embedding lookups, reference checks).
// The weights stay as the file stores them, [N rows][K / block blocks]: no float copy is kept beyond one call's
// (gguf_pack_tiles' scratch is reused by every projection).
//
// Block layouts and their dequantization are ggml's (gguf_dequant.h), for the types named by their GGML
// type ids; conveyor.model.gguf_quant holds the same table.
//
//   blocks [out rows][row bytes]   row n = in / block blocks of its type (a row stack: parts, each its own type)
//   x [rows, in] float32 / bfloat16 -> y [rows, out] in x's dtype
//
// Tuning constants (`conveyor bench decode-step` with a GGUF model): kMinBytesPerThread, weight bytes below which a
// thread is not worth waking; kRowBlock, weight rows multiplied by one group of quantized activation rows in turn.
// Exactness invariant: each output is summed by one thread in one order (k ascending), whatever the thread count
// and the number of activation rows beside it; the rows split follows weight bytes, never changing an output's
// arithmetic.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "gguf_amx.h"
#include "gguf_bf16.h"
#include "gguf_dequant.h"
#include "gguf_vnni.h"
#include "vec_bf16.h"

namespace {

using conveyor_gguf::dequant_row;
using conveyor_gguf::Format;

constexpr int64_t kMinBytesPerThread = 32768;  // less is not worth waking a thread for
constexpr int64_t kRowBlock = 8;  // weight rows that share each group of activation rows while it is in L1

// Each row of x [rows, in] quantized for the int8 dot products, in this thread's buffers (grown, never
// shrunk: a decode step's products allocate nothing). Valid until this thread's next call.
const std::vector<conveyor_gguf::QuantizedActivations>& quantized_rows(const float* x, int64_t rows,
                                                                       int64_t in_features) {
  thread_local std::vector<int8_t> q, q256, q256_k4;
  thread_local std::vector<float> scale, scale256;
  thread_local std::vector<int32_t> sum16;
  thread_local std::vector<int16_t> sum32, sum16_256;
  thread_local std::vector<conveyor_gguf::QuantizedActivations> acts;
  const int64_t groups = in_features / 32, values = rows * in_features;
  if (static_cast<int64_t>(q.size()) < values) {
    q.resize(values);
    q256.resize(values);
    q256_k4.resize(values);
    sum16_256.resize(values / 16);
    scale.resize(values / 32);
    sum16.resize(values / 16);
    sum32.resize(values / 32);
    scale256.resize(values / 32);  // in / 256 per row would do; rows of in % 256 != 0 leave it unused
  }
  acts.resize(rows);
  for (int64_t m = 0; m < rows; ++m)
    acts[m] = conveyor_gguf::quantize_activations(
        x + m * in_features, in_features,
        {q.data() + m * in_features, scale.data() + m * groups, sum16.data() + 2 * m * groups,
         q256.data() + m * in_features, scale256.data() + m * groups,
         sum32.data() + m * groups, q256_k4.data() + m * in_features, sum16_256.data() + 2 * m * groups});
  return acts;
}

}  // namespace

namespace conveyor_ops {

void gguf_dequantize(const Format& f, const uint8_t* bp, int64_t rows, int64_t row_bytes, int64_t in_features,
                     float* yp) {
  conveyor_parallel::parallel_for(0, rows, std::max<int64_t>(1, kMinBytesPerThread / row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequant_row(f, bp + r * row_bytes, in_features, yp + r * in_features);
  });
}

}  // namespace conveyor_ops

namespace {

using Part = conveyor_ops::GgufPart;

// The float path: y[m, n] for one output row n of `part` (row bytes `row`), dequantized once into w, and every
// activation row m, through `store`.
template <typename Store>
inline void row_products(const Part& part, const uint8_t* row, int64_t n, int64_t rows, int64_t in_features,
                         const float* xf, std::vector<float>& w, Store store) {
  w.resize(in_features);
  dequant_row(part.format, row, in_features, w.data());
  const float* wp = w.data();
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = xf + m * in_features;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < in_features; ++k) sum += wp[k] * xm[k];
    store(m, n, sum);
  }
}

}  // namespace

namespace conveyor_ops {

void gguf_linear_rows_parts(const std::vector<Part>& parts, int64_t out_features, int64_t total_bytes, bool bf16,
                            bool int8_dots, const void* x, int64_t rows, int64_t in_features, void* y) {
  thread_local std::vector<float> x_float;  // [rows, in]: x widened here (no tensor op, no allocation per call)
  x_float.resize(rows * in_features);
  if (bf16) {
    const conveyor::BFloat16* xb = static_cast<const conveyor::BFloat16*>(x);
    for (int64_t k = 0; k < rows * in_features; ++k) x_float[k] = static_cast<float>(xb[k]);
  } else {
    std::memcpy(x_float.data(), x, rows * in_features * sizeof(float));
  }
  const float* xf = x_float.data();
  bool any_int8_kind = false;
  for (const Part& part : parts) any_int8_kind = any_int8_kind || conveyor_gguf::vnni_kind(part.kind);
  const conveyor_gguf::QuantizedActivations* acts =
      int8_dots && any_int8_kind ? quantized_rows(xf, rows, in_features).data() : nullptr;
  // each thread takes an equal share of the weight bytes (parts of different types differ in bytes per row)
  const auto row_at_byte = [&](int64_t byte) {  // the output row holding weight byte `byte` of the stack
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t part_rows = (i + 1 < parts.size() ? parts[i + 1].first : out_features) - parts[i].first;
      if (byte < part_rows * parts[i].row_bytes) return parts[i].first + byte / parts[i].row_bytes;
      byte -= part_rows * parts[i].row_bytes;
    }
    return out_features;
  };
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(conveyor_parallel::num_threads(),
                                                                total_bytes / kMinBytesPerThread));
  conveyor_parallel::parallel_for(0, shares, 1, [&](int64_t first_share, int64_t end_share) {
    thread_local std::vector<float> w;  // one dequantized weight row (the float path)
    const int64_t begin = row_at_byte(first_share * total_bytes / shares);
    const int64_t end = row_at_byte(end_share * total_bytes / shares);
    size_t p = 0;
    const auto store = [&](int64_t m, int64_t col, float v) {
      if (bf16) {
        static_cast<conveyor::BFloat16*>(y)[m * out_features + col] = conveyor::BFloat16(v);
      } else {
        static_cast<float*>(y)[m * out_features + col] = v;
      }
    };
    // kRowBlock weight rows at a time: each group of kDotRowsMax quantized activation rows is read from L1 by
    // every weight row of the block (with many activation rows they no longer fit L1 whole)
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      const size_t first_part = p;
      for (int64_t m0 = 0; m0 < rows; m0 += (acts != nullptr ? conveyor_gguf::kDotRowsMax : rows)) {
        p = first_part;
        for (int64_t n = n0; n < n1; ++n) {
          while (p + 1 < parts.size() && n >= parts[p + 1].first) ++p;
          const Part& part = parts[p];
          const uint8_t* row = part.blocks + (n - part.first) * part.row_bytes;
          if (acts != nullptr && conveyor_gguf::vnni_kind(part.kind)) {
            float out[conveyor_gguf::kDotRowsMax];
            const int64_t count = std::min(rows - m0, conveyor_gguf::kDotRowsMax);
            conveyor_gguf::vnni_dot_rows(part.kind, row, in_features, acts + m0, count, out);
            for (int64_t m = 0; m < count; ++m) store(m0 + m, n, out[m]);
          } else if (m0 == 0) {  // the float path: every activation row at once
            row_products(part, row, n, rows, in_features, xf, w, store);
          }
        }
      }
    }
  });
}

}  // namespace conveyor_ops

namespace {

// The part of a row stack holding output row n, and where that row's blocks from value `first` on start.
std::pair<const Part*, const uint8_t*> stack_row(const std::vector<Part>& parts, int64_t n, int64_t first) {
  size_t p = parts.size() - 1;
  while (n < parts[p].first) --p;
  const Part& part = parts[p];
  return {&part, part.blocks + (n - part.first) * part.row_bytes + first / part.format.block * part.format.bytes};
}

// Row n of a [gate; up] stack of 2 inner rows taken in interleave_gate_up's order -> its row in the stack: 16-row
// tile t = n / 16 holds gate rows 16 (t / 2).. for even t, the matching up rows for odd t.
inline int64_t gate_up_stack_row(int64_t n, int64_t inner) {
  constexpr int64_t kRows = 16;
  const int64_t t = n / kRows;
  return t % 2 * inner + t / 2 * kRows + n % kRows;
}

// Values first..first + count - 1 of output row n of a row stack -> bfloat16 pieces at out (amx_product.h's
// WeightRow), the float path's values rounded to nearest even.
void dequantize_stack_row(const std::vector<Part>& parts, int64_t n, int64_t first, int64_t count,
                          conveyor::BFloat16* out) {
  const auto [part, blocks] = stack_row(parts, n, first);
  conveyor_amx::dequantize_tile_row(part->kind, blocks, count, out);  // every kept-compact type has tiles
}

// The bytes dequantize_stack_row reads for the same values, requested into L1 (amx_product.h's WeightRowPrefetch;
// T0 and T1 hints measured alike).
void prefetch_stack_row(const std::vector<Part>& parts, int64_t n, int64_t first, int64_t count) {
  const auto [part, blocks] = stack_row(parts, n, first);
  const int64_t bytes = count / part->format.block * part->format.bytes;
  conveyor_vec::request_bytes<conveyor_vec::Request::kReadL1>(blocks, bytes);
  // the last line too, where the run does not start on a line
  conveyor_vec::request_line<conveyor_vec::Request::kReadL1>(blocks + bytes - 1);
}

}  // namespace

namespace conveyor_ops {

// The AMX product of a row stack with x [rows, in] (bfloat16): y = x W^T [rows, out], or where `silu_gate` (W =
// [Wg; Wu], halves of a multiple of 16 rows) silu(x Wg^T) * (x Wu^T) [rows, out / 2].
void gguf_stack_product_amx(const std::vector<Part>& parts, int64_t out_features, bool silu_gate,
                            const conveyor::BFloat16* xp, int64_t rows, int64_t in_features, conveyor::BFloat16* y) {
  const int64_t inner = out_features / 2;
  if (rows == 0 || out_features == 0) return;
  // The product's weight row n: the stack's own, or in interleave_gate_up's order.
  const auto stack_row_of = [silu_gate, inner](int64_t n) { return silu_gate ? gate_up_stack_row(n, inner) : n; };
  const conveyor_amx::WeightRow weight_row = [&](int64_t n, int64_t first, int64_t count, conveyor::BFloat16* out) {
    dequantize_stack_row(parts, stack_row_of(n), first, count, out);
  };
  const conveyor_amx::WeightRowPrefetch prefetch_row = [&](int64_t n, int64_t first, int64_t count) {
    prefetch_stack_row(parts, stack_row_of(n), first, count);
  };
  if (silu_gate) {
    conveyor_amx::product_silu_gate_bf16(xp, rows, in_features, inner, weight_row, prefetch_row, y);
  } else {
    conveyor_amx::product_bf16(xp, rows, in_features, out_features, weight_row, prefetch_row, y);
  }
}

void gguf_pack_tiles(const std::vector<Part>& parts, int64_t out_features, int64_t in_features, bool gate_up,
                     conveyor::BFloat16* out) {
  constexpr int64_t kRows = 16, kValues = conveyor_amx::kTilePieceStride;  // a tile: 16 rows x 32 values
  const int64_t k_tiles = in_features / 32, row_tiles = (out_features + 2 * kRows - 1) / (2 * kRows) * 2;
  const int64_t inner = out_features / 2;
  conveyor_parallel::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local conveyor_amx::TileBuffer<conveyor::BFloat16> pieces;  // [k tiles][16 rows][32]: one row tile
    pieces.resize(k_tiles * kValues);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t n = gate_up ? gate_up_stack_row(t * kRows + r, inner) : t * kRows + r;
        if (n < out_features) {
          dequantize_stack_row(parts, n, 0, in_features, pieces.data() + r * 32);
        } else {  // rows past the last: zeros, as pack_bf16_tiles pads
          for (int64_t kt = 0; kt < k_tiles; ++kt) std::memset(pieces.data() + kt * kValues + r * 32, 0, 64);
        }
      }
      for (int64_t kt = 0; kt < k_tiles; ++kt)
        conveyor_amx::pieces_to_pairs(pieces.data() + kt * kValues, out + (t * k_tiles + kt) * kValues);
    }
  });
}

}  // namespace conveyor_ops
