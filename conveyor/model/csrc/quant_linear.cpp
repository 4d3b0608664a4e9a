// Tuning constants (`conveyor bench decode-step` with an int4 / int8 model): kMinBytesPerThread, weight bytes below
// which a thread is not worth waking; kPrefetchBytes, the software prefetch distance within a block.
// Exactness invariant: each output is summed by one thread in one order, whatever the thread count.
//
// Weight-only quantized matrix products for decode steps of a few rows (CPU), where every step
// streams every weight from memory once and the speed is the speed of that stream:
//   int4_linear: 4-bit codes in groups of 32 input columns with a bfloat16 scale and zero per group
//                (conveyor.model.quant's format: w = (q - 8) * scale + zero);
//   int8_linear: 8-bit codes with one float32 scale per output row (the LM head of an int4 model).
//
// Both take the weights in a layout packed for them by conveyor.model.quant (pack_int4_blocks,
// pack_int8_rows): 16 output rows side by side, so that one AVX-512 register holds one partial sum
// per output row and no horizontal reduction is needed.
//
// int4, per block of 16 rows x one group of 32 columns, 320 contiguous bytes:
//   8 quads of 32 bytes: quad t covers columns 4t..4t+3 of the group; byte 2r+p holds, for row r,
//   column 4t+p in its low nibble and column 4t+2+p in its high nibble;
//   then 16 bfloat16 scales, then 16 bfloat16 zeros.
// A code q (0..15) becomes the bfloat16 number q with one table lookup (vpermw), and vdpbf16ps
// multiplies pairs of them by pairs of bfloat16 activations, exactly, summing in float32. Per group:
//   sum_k w_k x_k = scale * sum_k q_k x_k + (zero - 8 scale) * sum_k x_k.
// int8, per block of 16 rows: [K][16] int8, widened to float32 and multiplied with FMAs.
//
// They need AVX-512 BF16; built without it they raise (the end of this file), and Python asks
// `quant_linear_vectorized()` before choosing them over torch's int4/int8 kernels.
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "vec_bf16.h"

#if defined(CONVEYOR_VEC_BF16)
namespace {

constexpr int64_t kRows = 16;         // output rows per block
constexpr int64_t kGroup = 32;        // input columns per int4 group
constexpr int64_t kCodeBytes = 256;   // 16 rows x 32 columns x 4 bits
constexpr int64_t kBlockBytes = 320;  // codes + 16 scales + 16 zeros (bfloat16)
constexpr int64_t kMinBytesPerThread = 32768;  // less is not worth waking a thread for
constexpr int64_t kPrefetchBytes = 2048;  // software prefetch distance ahead in a block (a wide range works alike)

using namespace conveyor_vec;

// The bfloat16 bit patterns of 0..15, twice: vpermw reads the low 5 bits of each index, so the low
// nibble of a zero-extended byte needs no mask.
inline __m512i nibble_to_bf16_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: 0..15 need 4 significant bits
  }
  return _mm512_load_si512(table);
}

inline __m512 bf16x16_to_float(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}

// R rows of x against one 16-row block of int4 weights (all groups); out [R][16] float32.
template <int R>
void int4_block(const uint8_t* blocks, int64_t groups, const conveyor::BFloat16* x, int64_t in_features,
                const float* xsums /* [R][groups] */, __m512i table, float* out) {
  constexpr int kChains = R <= 2 ? 4 : 2;
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = blocks + g * kBlockBytes;
    for (int64_t line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
    // kChains independent sums per row: one row alone would otherwise wait on vdpbf16ps's latency.
    __m512 acc[R][kChains];
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < kChains; ++c) acc[m][c] = _mm512_setzero_ps();
    const conveyor::BFloat16* xg = x + g * kGroup;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * t)));
      const __m512bh low = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(bytes, table));
      const __m512bh high = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table));
      const int c = kChains == 4 ? 2 * (t & 1) : 0;
      for (int m = 0; m < R; ++m) {
        int32_t pairs[2];  // (x[4t], x[4t+1]) and (x[4t+2], x[4t+3]) as two bfloat16 each
        std::memcpy(pairs, xg + m * in_features + 4 * t, sizeof(pairs));
        acc[m][c] = _mm512_dpbf16_ps(acc[m][c], low, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[0])));
        acc[m][c + 1] = _mm512_dpbf16_ps(acc[m][c + 1], high, reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[1])));
      }
    }
    const __m512 scale = bf16x16_to_float(block + kCodeBytes);
    const __m512 offset = _mm512_fnmadd_ps(eight, scale, bf16x16_to_float(block + kCodeBytes + 32));  // zero - 8 scale
    for (int m = 0; m < R; ++m) {
      __m512 dot = _mm512_add_ps(acc[m][0], acc[m][1]);
      if constexpr (kChains == 4) dot = _mm512_add_ps(dot, _mm512_add_ps(acc[m][2], acc[m][3]));
      total[m] = _mm512_fmadd_ps(scale, dot, total[m]);
      total[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsums[m * groups + g]), total[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * kRows, total[m]);
}

// R rows of x (float32) against one 16-row block of int8 weights; out [R][16] float32 (unscaled).
template <int R>
void int8_block(const int8_t* codes, const float* x, int64_t in_features, float* out) {
  constexpr int kChains = R == 1 ? 4 : 2;  // independent FMA chains per row
  __m512 acc[R][kChains];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < kChains; ++c) acc[m][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kChains <= in_features; k += kChains) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + k * kRows + kPrefetchBytes), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (k + c) * kRows))));
      for (int m = 0; m < R; ++m) acc[m][c] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * in_features + k + c]), acc[m][c]);
    }
  }
  for (; k < in_features; ++k) {
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kRows))));
    for (int m = 0; m < R; ++m) acc[m][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * in_features + k]), acc[m][0]);
  }
  for (int m = 0; m < R; ++m) {
    __m512 sum = acc[m][0];
    for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[m][c]);
    _mm512_storeu_ps(out + m * kRows, sum);
  }
}

// y [rows, out] bfloat16 from the float32 block results, scaled per row and with the bias added.
void store_block(const float* sums /* [rows][16] */, int64_t rows, int64_t block, int64_t out_features,
                 const float* row_scale, const conveyor::BFloat16* bias, conveyor::BFloat16* y) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t n = block * kRows + r;
      float v = sums[m * kRows + r];
      if (row_scale != nullptr) v *= row_scale[n];
      if (bias != nullptr) v = static_cast<float>(static_cast<conveyor::BFloat16>(v)) + static_cast<float>(bias[n]);
      y[m * out_features + n] = static_cast<conveyor::BFloat16>(v);
    }
  }
}

}  // namespace

namespace conveyor_ops {

// x [rows, in] bfloat16; blocks [num_blocks = out / 16, groups = in / 32, 320] uint8 (layout above); bias [out] or
// null -> y [rows, out] bfloat16.
void int4_linear(const conveyor::BFloat16* xp, int64_t rows, const uint8_t* bp, int64_t num_blocks, int64_t groups,
                 const conveyor::BFloat16* biasp, conveyor::BFloat16* yp) {
  const int64_t in_features = groups * kGroup, out_features = num_blocks * kRows;
  if (rows == 0 || out_features == 0) return;
  // [rows][groups]: sum of each group's activations (a denormal x counts here but is zero to vdpbf16ps:
  // an error below 1e-38)
  std::vector<float> xsums(rows * groups);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) s += static_cast<float>(xp[m * in_features + g * kGroup + k]);
      xsums[m * groups + g] = s;
    }
  }
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / (groups * kBlockBytes));
  conveyor_parallel::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * kRows);
    const __m512i table = nibble_to_bf16_table();
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = bp + b * groups * kBlockBytes;
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4)
        int4_block<4>(block, groups, xp + m * in_features, in_features, xsums.data() + m * groups, table,
                      sums.data() + m * kRows);
      const float* xs = xsums.data() + m * groups;
      float* out = sums.data() + m * kRows;
      switch (rows - m) {
        case 3: int4_block<3>(block, groups, xp + m * in_features, in_features, xs, table, out); break;
        case 2: int4_block<2>(block, groups, xp + m * in_features, in_features, xs, table, out); break;
        case 1: int4_block<1>(block, groups, xp + m * in_features, in_features, xs, table, out); break;
        default: break;
      }
      store_block(sums.data(), rows, b, out_features, nullptr, biasp, yp);
    }
  });
}

// x [rows, in] (bfloat16 widened to float32); codes [num_blocks = out / 16, in, 16] int8 (pack_int8_rows); scale [out]
// float32 -> y [rows, out] bfloat16.
void int8_linear(const float* xp, int64_t rows, int64_t in_features, const int8_t* cp, int64_t num_blocks,
                 const float* sp, conveyor::BFloat16* yp) {
  const int64_t out_features = num_blocks * kRows;
  if (rows == 0 || out_features == 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / (in_features * kRows));
  conveyor_parallel::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(rows * kRows);
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* block = cp + b * in_features * kRows;
      int64_t m = 0;
      for (; m + 2 <= rows; m += 2) int8_block<2>(block, xp + m * in_features, in_features, sums.data() + m * kRows);
      if (m < rows) int8_block<1>(block, xp + m * in_features, in_features, sums.data() + m * kRows);
      store_block(sums.data(), rows, b, out_features, sp, nullptr, yp);
    }
  });
}

bool quant_linear_vectorized() { return true; }

}  // namespace conveyor_ops

#else  // no AVX-512 BF16 in this build (the compiler's -march=native lacks it): bindings.cpp raises before calling

namespace conveyor_ops {
bool quant_linear_vectorized() { return false; }
void int4_linear(const conveyor::BFloat16*, int64_t, const uint8_t*, int64_t, int64_t, const conveyor::BFloat16*,
                 conveyor::BFloat16*) {}
void int8_linear(const float*, int64_t, int64_t, const int8_t*, int64_t, const float*, conveyor::BFloat16*) {}
}  // namespace conveyor_ops

#endif
