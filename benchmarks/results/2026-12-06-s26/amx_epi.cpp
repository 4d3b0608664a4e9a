// Build and run (from the repository root, which the vec_bf16.h include below names as /work/main): g++ -O3 -march=native
// -ffast-math -ffp-contract=off -I.venv/lib/python3.11/site-packages/torch/include -o /tmp/amx_epi
// benchmarks/results/2026-12-06-s26/amx_epi.cpp && flock /work/bench.lock /tmp/amx_epi PAIRS
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
inline __m512 round_bf16_perm(__m512 v) {
  const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0,
                                       3, 0, 2, 0, 1, 0, 0, 0);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx,
                                                             _mm512_castsi256_si512(conveyor_vec::to_bf16(v))));
}
inline __m512 exp_capped(__m512 x) {  // x <= 80 given
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
inline __m512 silu_fast(__m512 gate, __m512 up) {
  const __m512 e = exp_capped(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate), _mm512_set1_ps(80.f)));
  const __m512 act = round_bf16_perm(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return _mm512_mul_ps(act, up);
}
template <bool kFast>
inline void epi_rows_fast(const float* c, int from, int to, c10::BFloat16* y, int yw) {
  for (int r = from; r < to; ++r) {
    const int j = r / 16, i = r % 16;
    const float* c0 = c + j * 256 + i * 16; const float* c1 = c + (2 + j) * 256 + i * 16;
    if (kFast) {
      const __m512 gate = round_bf16_perm(_mm512_load_ps(c0)), up = round_bf16_perm(_mm512_load_ps(c1));
      _mm256_storeu_si256((__m256i*)(y + r * yw), conveyor_vec::to_bf16(silu_fast(gate, up)));
    } else {
      silu_row(c0, c1, y + r * yw);
    }
  }
}
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
        if (kMode == 5 && pending) epi_rows_fast<true>(pending, kt * 32 / KT, (kt + 1) * 32 / KT, pend_y, yw);
        if (kMode == 6 && pending) epi_rows_fast<false>(pending, kt * 32 / KT, (kt + 1) * 32 / KT, pend_y, yw);
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
  time([&] { run<6>(acts, pairs, w, sums, blocks, y, yw); }, "sliced (today's math)");
  time([&] { run<5>(acts, pairs, w, sums, blocks, y, yw); }, "sliced, trimmed math");
  time([&] { run<6>(acts, pairs, w, sums, blocks, y, yw); }, "sliced (today's math)");
  time([&] { run<5>(acts, pairs, w, sums, blocks, y, yw); }, "sliced, trimmed math");
  time([&] { run<3>(acts, pairs, w, sums, blocks, y, yw); }, "NT epilogue after loop");
  time([&] { run<4>(acts, pairs, w, sums, blocks, y, yw); }, "NT epilogue sliced");
  _tile_release();
}

// bit check of the trimmed math against today's
#include <cstring>
int check() {
  uint32_t bad = 0; uint64_t n = 0;
  for (uint64_t b = 0; b < (1ull << 32); b += 997) {
    float v[16]; for (int l = 0; l < 16; ++l) { uint32_t u = (uint32_t)(b + l * 61); memcpy(&v[l], &u, 4); }
    __m512 x = _mm512_loadu_ps(v), u = _mm512_set1_ps(1.5f);
    __m512 g1 = conveyor_vec::round_bf16(x), g2 = round_bf16_perm(x);
    __m256i a = conveyor_vec::to_bf16(conveyor_vec::silu_times_bf16(g1, u)), c = conveyor_vec::to_bf16(silu_fast(g2, u));
    if (memcmp(&a, &c, 32) != 0) ++bad;
    ++n;
  }
  printf("checked %llu vectors, %u differ\n", (unsigned long long)n, bad);
  return 0;
}
static int checked = check();
