// Build and run (from the repository root): g++ -O2 -march=native -o /tmp/amx_order benchmarks/results/2026-12-06-s26/amx_order.cpp && flock /work/bench.lock /tmp/amx_order PAIRS
// Microbenchmark: TDP order within a 2x2 k step, A (activations, L2-resident chunk, optional T1 hint) x B (weights block in L1).
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <algorithm>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Cfg { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
constexpr int KT = 18;  // k tiles (576)
template <int kOrder, bool kStreamA>
void run(const uint16_t* acts, int pairs, const uint16_t* w, float* c, int blocks) {
  for (int nb = 0; nb < blocks; ++nb) {
    const uint16_t* b0 = w; const uint16_t* b1 = w + KT * 512;
    for (int p = 0; p < pairs; ++p) {
      const uint16_t* a0 = acts + (2 * p) * KT * 512; const uint16_t* a1 = a0 + KT * 512;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int kt = 0; kt < KT; ++kt) {
        if constexpr (kOrder == 0) {  // today's order
          if (kStreamA) _tile_stream_loadd(4, a0 + kt * 512, 64); else _tile_loadd(4, a0 + kt * 512, 64);
          _tile_loadd(6, b0 + kt * 512, 64);
          if (kStreamA) _tile_stream_loadd(5, a1 + kt * 512, 64); else _tile_loadd(5, a1 + kt * 512, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(7, b1 + kt * 512, 64);
          _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        } else if constexpr (kOrder == 1) {  // a0 freed first
          if (kStreamA) _tile_stream_loadd(4, a0 + kt * 512, 64); else _tile_loadd(4, a0 + kt * 512, 64);
          _tile_loadd(6, b0 + kt * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, b1 + kt * 512, 64);
          _tile_dpbf16ps(2, 4, 7);
          if (kStreamA) _tile_stream_loadd(5, a1 + kt * 512, 64); else _tile_loadd(5, a1 + kt * 512, 64);
          _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(3, 5, 7);
        } else if constexpr (kOrder == 2) {  // a0 freed first, loads early
          if (kStreamA) _tile_stream_loadd(4, a0 + kt * 512, 64); else _tile_loadd(4, a0 + kt * 512, 64);
          _tile_loadd(6, b0 + kt * 512, 64);
          _tile_loadd(7, b1 + kt * 512, 64);
          if (kStreamA) _tile_stream_loadd(5, a1 + kt * 512, 64); else _tile_loadd(5, a1 + kt * 512, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(3, 5, 7);
        } else {  // preloaded: no loads (peak)
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
    }
  }
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg cfg{}; cfg.palette = 1; for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  _tile_loadconfig(&cfg);
  int pairs = argc > 1 ? atoi(argv[1]) : 28;
  uint16_t* acts = (uint16_t*)aligned_alloc(64, (size_t)pairs * 2 * KT * 1024);
  uint16_t* w = (uint16_t*)aligned_alloc(64, 2 * KT * 1024);
  float* c = (float*)aligned_alloc(64, 4096);
  for (size_t i = 0; i < (size_t)pairs * 2 * KT * 512; ++i) acts[i] = 0x3f80 + (i % 7);
  for (size_t i = 0; i < 2 * KT * 512; ++i) w[i] = 0x3f80 + (i % 5);
  const int blocks = 200;
  auto time = [&](auto fn, const char* name) {
    double best = 1e9;
    for (int r = 0; r < 7; ++r) {
      auto t0 = std::chrono::steady_clock::now(); fn();
      double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, ns / (double(blocks) * pairs * KT * 4));
    }
    printf("%-28s %.2f ns per TDP\n", name, best);
  };
  time([&] { run<3, false>(acts, pairs, w, c, blocks); }, "peak (no loads)");
  time([&] { run<0, false>(acts, pairs, w, c, blocks); }, "order0 plain");
  time([&] { run<0, true>(acts, pairs, w, c, blocks); }, "order0 streamA");
  time([&] { run<1, false>(acts, pairs, w, c, blocks); }, "order1 plain");
  time([&] { run<1, true>(acts, pairs, w, c, blocks); }, "order1 streamA");
  time([&] { run<2, false>(acts, pairs, w, c, blocks); }, "order2 plain");
  time([&] { run<2, true>(acts, pairs, w, c, blocks); }, "order2 streamA");
  _tile_release();
}
