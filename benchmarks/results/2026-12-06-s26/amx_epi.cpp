// Microbenchmark: 2x2 k loop (A activations streamed from an L2 chunk, B weights block in L1) with a SiLU epilogue of
// the previous pair's accumulators: none, after the loop (today), or sliced (rows spread over the next k loop).
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sys/syscall.h>
#include <unistd.h>
#include "/work/main/conveyor/model/csrc/vec_bf16.h"
struct alignas(64) Cfg { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
constexpr int KT = 18;
inline void silu_row(const float* c0, const float* c1, c10::BFloat16* y) {
  const __m512 gate = conveyor_vec::round_bf16(_mm512_load_ps(c0));
  const __m512 up = conveyor_vec::round_bf16(_mm512_load_ps(c1));
  _mm256_storeu_si256((__m256i*)y, conveyor_vec::to_bf16(conveyor_vec::silu_times_bf16(gate, up)));
}
// rows r of the pending pair: tile j = r / 16, row r % 16: gate acc (j), up acc (2 + j)
template <bool kNT>
inline void epi_rows(const float* c, int from, int to, c10::BFloat16* y, int yw) {
  for (int r = from; r < to; ++r) {
    const int j = r / 16, i = r % 16;
    if (kNT) {
      const float* c0 = c + j * 256 + i * 16; const float* c1 = c + (2 + j) * 256 + i * 16;
      const __m512 gate = conveyor_vec::round_bf16(_mm512_load_ps(c0));
      const __m512 up = conveyor_vec::round_bf16(_mm512_load_ps(c1));
      const __m256i act = conveyor_vec::to_bf16(conveyor_vec::silu_times_bf16(gate, up));
      _mm512_stream_si512((__m512i*)(y + r * yw), _mm512_inserti64x4(_mm512_castsi256_si512(act), act, 1));
    } else {
      silu_row(c + j * 256 + i * 16, c + (2 + j) * 256 + i * 16, y + r * yw);
    }
  }
}
template <int kMode>
void run(const uint16_t* acts, int pairs, const uint16_t* w, float* sums, int blocks, c10::BFloat16* y, int yw) {
  float* pending = nullptr;
  c10::BFloat16* pend_y = nullptr;
  for (int nb = 0; nb < blocks; ++nb) {
    const uint16_t* b0 = w; const uint16_t* b1 = w + KT * 512;
    for (int p = 0; p < pairs; ++p) {
      float* c = sums + (p % 2) * 1024;
      const uint16_t* a0 = acts + (2 * p) * KT * 512; const uint16_t* a1 = a0 + KT * 512;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int kt = 0; kt < KT; ++kt) {
        _tile_stream_loadd(4, a0 + kt * 512, 64);
        _tile_loadd(6, b0 + kt * 512, 64);
        _tile_stream_loadd(5, a1 + kt * 512, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(7, b1 + kt * 512, 64);
        _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        if ((kMode == 2 || kMode == 4) && pending) epi_rows<kMode == 4>(pending, kt * 32 / KT, (kt + 1) * 32 / KT, pend_y, yw);
      }
      if ((kMode == 1 || kMode == 3) && pending) epi_rows<kMode == 3>(pending, 0, 32, pend_y, yw);
      _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
      pending = c; pend_y = y + (size_t)p * 32 * yw + (nb % 48) * 32;
    }
  }
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg cfg{}; cfg.palette = 1; for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
  int pairs = argc > 1 ? atoi(argv[1]) : 28;
  const int yw = 1536;
  uint16_t* acts = (uint16_t*)aligned_alloc(64, (size_t)pairs * 2 * KT * 1024);
  uint16_t* w = (uint16_t*)aligned_alloc(64, 2 * KT * 1024);
  float* sums = (float*)aligned_alloc(64, 8192);
  c10::BFloat16* y = (c10::BFloat16*)aligned_alloc(64, (size_t)pairs * 32 * yw * 2);
  for (size_t i = 0; i < (size_t)pairs * 2 * KT * 512; ++i) acts[i] = 0x3c00 + (i % 7);
  for (size_t i = 0; i < 2 * KT * 512; ++i) w[i] = 0x3c00 + (i % 5);
  const int blocks = 96;
  auto time = [&](auto fn, const char* name) {
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {
      auto t0 = std::chrono::steady_clock::now(); fn();
      double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, ns / (double(blocks) * pairs * KT * 4));
    }
    printf("%-28s %.2f ns per TDP\n", name, best);
  };
  time([&] { run<0>(acts, pairs, w, sums, blocks, y, yw); }, "no epilogue");
  time([&] { run<1>(acts, pairs, w, sums, blocks, y, yw); }, "epilogue after loop");
  time([&] { run<2>(acts, pairs, w, sums, blocks, y, yw); }, "epilogue sliced");
  time([&] { run<3>(acts, pairs, w, sums, blocks, y, yw); }, "NT epilogue after loop");
  time([&] { run<4>(acts, pairs, w, sums, blocks, y, yw); }, "NT epilogue sliced");
  _tile_release();
}
