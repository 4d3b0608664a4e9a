// Matrix products with GGUF-quantized weights kept in the file's own blocks (CPU):
//   gguf_linear_rows:  few activation rows (decode steps): bfloat16 activations are quantized to int8 (once
//                      per call) and multiplied with integer dot products (gguf_vnni.cpp, llama.cpp's way)
//                      where the type has one; otherwise (and for float32 activations, exactly) each weight
//                      row is dequantized once, in L1, and multiplied by every activation row (float32 sums);
//                      gguf_linear_rows_parts does the same for several matrices stacked by rows (a fused
//                      QKV of mixed types): one quantization of x, one parallel loop, one output;
//   gguf_linear_tiles: many rows (prefill chunks, busy decode steps): each thread dequantizes a tile of
//                      weight rows x all K (about kTileBytes, so that it stays in L2) to the activations'
//                      dtype in its own scratch and runs torch's GEMM (oneDNN: AVX-512 BF16 / AMX) on it;
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
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

constexpr int64_t kTileBytes = 512 * 1024;    // dequantized weights per GEMM tile (fewer, larger GEMMs)
constexpr int64_t kMinTileRows = 32;
constexpr int64_t kMinBytesPerThread = 32768;  // less is not worth waking a thread for

// Checks the blocks against K and the type; -> the format.
Format checked_format(const torch::Tensor& blocks, int64_t kind, int64_t in_features) {
  const Format f = conveyor_gguf::format_of(kind);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
              blocks.is_contiguous(), "blocks must be a contiguous CPU uint8 tensor [rows, row bytes], got ",
              blocks.sizes(), " ", blocks.scalar_type());
  TORCH_CHECK(in_features > 0 && in_features % f.block == 0 && blocks.size(1) == in_features / f.block * f.bytes,
              "blocks of ", blocks.size(1), " bytes per row do not hold ", in_features, " weights of a type with ",
              f.block, " weights in ", f.bytes, " bytes");
  return f;
}

void check_x(const torch::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == in_features &&
              (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat),
              "x must be a CPU float32 or bfloat16 tensor [rows, ", in_features, "], got ", x.sizes(), " ",
              x.scalar_type());
}

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

torch::Tensor gguf_dequantize(const torch::Tensor& blocks, int64_t kind, int64_t in_features) {
  const Format f = checked_format(blocks, kind, in_features);
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1);
  auto y = torch::empty({rows, in_features}, torch::kFloat);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinBytesPerThread / row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequant_row(f, bp + r * row_bytes, in_features, yp + r * in_features);
  });
  return y;
}

namespace {

// One weight matrix of a row-stacked product: rows first..first + rows - 1 of the output.
struct Part {
  const uint8_t* blocks;
  int64_t kind;
  int64_t row_bytes;
  int64_t first;
  Format format;
};

// The parts of a row stack of GGUF matrices (checked against in_features) and, in out_features, its rows.
std::vector<Part> stack_parts(const std::vector<torch::Tensor>& blocks, const std::vector<int64_t>& kinds,
                              int64_t in_features, const char* op, int64_t* out_features) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == kinds.size(), op, " needs one type id per block matrix and at "
              "least one matrix, got ", blocks.size(), " matrices and ", kinds.size(), " ids");
  std::vector<Part> parts;
  *out_features = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Format f = checked_format(blocks[i], kinds[i], in_features);
    parts.push_back({blocks[i].data_ptr<uint8_t>(), kinds[i], blocks[i].size(1), *out_features, f});
    *out_features += blocks[i].size(0);
  }
  return parts;
}

// y[m, n] for one output row n of `part` (row bytes `row`) and every activation row m, through `store`.
template <typename Store>
inline void row_products(const Part& part, const uint8_t* row, int64_t n, int64_t rows, int64_t in_features,
                         const float* xf, const conveyor_gguf::QuantizedActivations* acts, std::vector<float>& w,
                         Store store) {
  if (acts != nullptr && conveyor_gguf::vnni_kind(part.kind)) {  // the row unpacked once per kDotRowsMax rows
    float out[conveyor_gguf::kDotRowsMax];
    for (int64_t m0 = 0; m0 < rows; m0 += conveyor_gguf::kDotRowsMax) {
      const int64_t count = std::min(rows - m0, conveyor_gguf::kDotRowsMax);
      conveyor_gguf::vnni_dot_rows(part.kind, row, in_features, acts + m0, count, out);
      for (int64_t m = 0; m < count; ++m) store(m0 + m, n, out[m]);
    }
    return;
  }
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

torch::Tensor gguf_linear_rows_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                     const std::vector<int64_t>& kinds, int64_t in_features) {
  int64_t out_features = 0, total_bytes = 0;
  const std::vector<Part> parts = stack_parts(blocks, kinds, in_features, "gguf_linear_rows_parts", &out_features);
  check_x(x, in_features);
  for (const torch::Tensor& b : blocks) total_bytes += b.numel();
  const int64_t rows = x.size(0);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const torch::Tensor xc = x.contiguous();  // [rows, in]
  thread_local std::vector<float> x_float;  // [rows, in]: x widened here (no tensor op, no allocation per call)
  x_float.resize(rows * in_features);
  if (bf16) {
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    for (int64_t k = 0; k < rows * in_features; ++k) x_float[k] = static_cast<float>(xb[k]);
  } else {
    std::memcpy(x_float.data(), xc.data_ptr<float>(), rows * in_features * sizeof(float));
  }
  const float* xf = x_float.data();
  bool int8_dots = false;
  for (const Part& part : parts) int8_dots = int8_dots || (bf16 && conveyor_gguf::vnni_kind(part.kind));
  const conveyor_gguf::QuantizedActivations* acts = int8_dots ? quantized_rows(xf, rows, in_features).data() : nullptr;
  auto y = torch::empty({rows, out_features}, x.options());  // [rows, out]
  // each thread takes an equal share of the weight bytes (parts of different types differ in bytes per row)
  const auto row_at_byte = [&](int64_t byte) {  // the output row holding weight byte `byte` of the stack
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t part_rows = (i + 1 < parts.size() ? parts[i + 1].first : out_features) - parts[i].first;
      if (byte < part_rows * parts[i].row_bytes) return parts[i].first + byte / parts[i].row_bytes;
      byte -= part_rows * parts[i].row_bytes;
    }
    return out_features;
  };
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                total_bytes / kMinBytesPerThread));
  at::parallel_for(0, shares, 1, [&](int64_t first_share, int64_t end_share) {
    thread_local std::vector<float> w;  // one dequantized weight row (the float path)
    const int64_t begin = row_at_byte(first_share * total_bytes / shares);
    const int64_t end = row_at_byte(end_share * total_bytes / shares);
    size_t p = 0;
    for (int64_t n = begin; n < end; ++n) {
      while (p + 1 < parts.size() && n >= parts[p + 1].first) ++p;
      const Part& part = parts[p];
      const uint8_t* row = part.blocks + (n - part.first) * part.row_bytes;
      if (bf16) {
        c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
        row_products(part, row, n, rows, in_features, xf, acts, w,
                     [&](int64_t m, int64_t col, float v) { yp[m * out_features + col] = c10::BFloat16(v); });
      } else {
        float* yp = y.data_ptr<float>();
        row_products(part, row, n, rows, in_features, xf, acts, w,
                     [&](int64_t m, int64_t col, float v) { yp[m * out_features + col] = v; });
      }
    }
  });
  return y;
}

torch::Tensor gguf_linear_rows(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                               int64_t in_features) {
  return gguf_linear_rows_parts(x, {blocks}, {kind}, in_features);
}

torch::Tensor gguf_linear_tiles(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                                int64_t in_features) {
  const Format f = checked_format(blocks, kind, in_features);
  check_x(x, in_features);
  const int64_t rows = x.size(0), out_features = blocks.size(0), row_bytes = blocks.size(1);
  const torch::Tensor xc = x.contiguous();  // [rows, in]
  auto y = torch::empty({rows, out_features}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t threads = at::get_num_threads();
  const int64_t fits = std::max(kMinTileRows, kTileBytes / (in_features * static_cast<int64_t>(x.element_size())));
  const int64_t tile_rows = std::max<int64_t>(1, std::min(fits, (out_features + threads - 1) / threads));
  const int64_t tiles = (out_features + tile_rows - 1) / tile_rows;
  const int64_t element = x.element_size();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(in_features);
    torch::Tensor tile = torch::empty({tile_rows, in_features}, x.options());  // [tile rows, in]
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile_rows, n = std::min(tile_rows, out_features - n0);
      for (int64_t r = 0; r < n; ++r) {
        if (x.scalar_type() == torch::kBFloat16 && conveyor_gguf::bf16_kind(kind)) {
          conveyor_gguf::dequantize_pieces(kind, bp + (n0 + r) * row_bytes, in_features,
                                           tile.data_ptr<c10::BFloat16>() + r * in_features, 32);  // one row
          continue;
        }
        dequant_row(f, bp + (n0 + r) * row_bytes, in_features, w.data());
        if (x.scalar_type() == torch::kFloat) {
          std::copy(w.begin(), w.end(), tile.data_ptr<float>() + r * in_features);
        } else {
          c10::BFloat16* dst = tile.data_ptr<c10::BFloat16>() + r * in_features;
          for (int64_t k = 0; k < in_features; ++k) dst[k] = c10::BFloat16(w[k]);
        }
      }
      const torch::Tensor part = torch::mm(xc, tile.narrow(0, 0, n).t()).contiguous();  // [rows, n]
      // copied by hand: torch ops writing y here would run outside the caller's inference mode
      const char* src = static_cast<const char*>(part.data_ptr());
      char* dst = static_cast<char*>(y.data_ptr());
      for (int64_t m = 0; m < rows; ++m)
        std::memcpy(dst + (m * out_features + n0) * element, src + m * n * element, n * element);
    }
  });
  return y;
}

bool gguf_amx_available() { return conveyor_amx::available(); }

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
                          c10::BFloat16* out) {
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

void check_amx(const char* op) {
  TORCH_CHECK(conveyor_amx::available(), op, " needs AMX-BF16 (Intel Sapphire Rapids or later) and a kernel that "
              "grants tile data; this CPU or build has none: use gguf_linear_tiles");
}

// The AMX product of a row stack with x [rows, in] (bfloat16): y = x W^T [rows, out], or where `silu_gate` (W = [Wg; Wu],
// halves of a multiple of 16 rows) silu(x Wg^T) * (x Wu^T) [rows, out / 2]. `op` names the operation in errors about
// the stack, `input_op` in those about x.
torch::Tensor stack_product_amx(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                const std::vector<int64_t>& kinds, int64_t in_features, bool silu_gate, const char* op,
                                const char* input_op) {
  int64_t out_features = 0;
  const std::vector<Part> parts = stack_parts(blocks, kinds, in_features, op, &out_features);
  check_x(x, in_features);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, input_op, " multiplies bfloat16 activations, got ",
              x.scalar_type(), "; use gguf_linear_tiles for float32 ones");
  check_amx(input_op);
  TORCH_CHECK(!silu_gate || out_features % 32 == 0, op, " takes a [gate; up] stack whose halves split into 16-row "
              "tiles; got ", out_features, " rows");
  const torch::Tensor xc = x.contiguous();  // [rows, in]
  const int64_t rows = xc.size(0), inner = out_features / 2;
  auto y = torch::empty({rows, silu_gate ? inner : out_features}, x.options());  // [rows, out or inner]
  if (rows == 0 || out_features == 0) return y;
  // The product's weight row n: the stack's own, or in interleave_gate_up's order.
  const auto stack_row_of = [silu_gate, inner](int64_t n) { return silu_gate ? gate_up_stack_row(n, inner) : n; };
  const conveyor_amx::WeightRow weight_row = [&](int64_t n, int64_t first, int64_t count, c10::BFloat16* out) {
    dequantize_stack_row(parts, stack_row_of(n), first, count, out);
  };
  const conveyor_amx::WeightRowPrefetch prefetch_row = [&](int64_t n, int64_t first, int64_t count) {
    prefetch_stack_row(parts, stack_row_of(n), first, count);
  };
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  if (silu_gate) {
    conveyor_amx::product_silu_gate_bf16(xp, rows, in_features, inner, weight_row, prefetch_row,
                                         y.data_ptr<c10::BFloat16>());
  } else {
    conveyor_amx::product_bf16(xp, rows, in_features, out_features, weight_row, prefetch_row,
                               y.data_ptr<c10::BFloat16>());
  }
  return y;
}

}  // namespace

torch::Tensor gguf_linear_amx_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                    const std::vector<int64_t>& kinds, int64_t in_features) {
  return stack_product_amx(x, blocks, kinds, in_features, false, "gguf_linear_amx_parts", "gguf_linear_amx");
}

torch::Tensor gguf_silu_gate_amx_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& blocks,
                                       const std::vector<int64_t>& kinds, int64_t in_features) {
  return stack_product_amx(x, blocks, kinds, in_features, true, "gguf_silu_gate_amx_parts",
                           "gguf_silu_gate_amx_parts");
}

void gguf_pack_tiles(const std::vector<torch::Tensor>& blocks, const std::vector<int64_t>& kinds,
                     int64_t in_features, bool gate_up, torch::Tensor& tiles) {
  int64_t out_features = 0;
  const std::vector<Part> parts = stack_parts(blocks, kinds, in_features, "gguf_pack_tiles", &out_features);
  check_amx("gguf_pack_tiles");
  constexpr int64_t kRows = 16, kValues = conveyor_amx::kTilePieceStride;  // a tile: 16 rows x 32 values
  const int64_t k_tiles = in_features / 32, row_tiles = (out_features + 2 * kRows - 1) / (2 * kRows) * 2;
  TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == torch::kBFloat16 && tiles.is_contiguous() &&
              tiles.dim() == 4 && tiles.size(0) == row_tiles && tiles.size(1) == k_tiles && tiles.size(2) == kRows &&
              tiles.size(3) == 32, "tiles must be a contiguous CPU bfloat16 tensor [", row_tiles, ", ", k_tiles,
              ", 16, 32] for ", out_features, " rows of ", in_features, " weights, got ", tiles.sizes(), " ",
              tiles.scalar_type());
  TORCH_CHECK(in_features % 32 == 0, "gguf_pack_tiles needs an input width that is a multiple of 32, got ",
              in_features);
  const int64_t inner = out_features / 2;
  TORCH_CHECK(!gate_up || (inner % kRows == 0 && out_features % 2 == 0), "gate/up rows interleave 16 and 16: ",
              out_features, " rows are not two halves of a multiple of 16");
  c10::BFloat16* const out = tiles.data_ptr<c10::BFloat16>();
  at::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local conveyor_amx::TileBuffer<c10::BFloat16> pieces;  // [k tiles][16 rows][32]: one row tile
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

torch::Tensor gguf_linear_amx(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                              int64_t in_features) {
  return gguf_linear_amx_parts(x, {blocks}, {kind}, in_features);
}

bool gguf_linear_vectorized() {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}
