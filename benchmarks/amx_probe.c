// What the tile unit of this machine does, in isolation from our product kernel (session s16).
//
//   gcc -O2 -march=native benchmarks/amx_probe.c -o /tmp/amx_probe && /tmp/amx_probe
//
// One thread:
//   - TDPBF16PS back to back (four accumulators), and TILESTORED, in ns each;
//   - tile loads streaming 512 MB from memory (1 KiB tiles in order), alone and with four products per tile (a
//     64-row decode step's shape), in GB/s;
//   - the 2 x 2 kernel of a prefill product over one chunk (896 activation rows x 576 in x 3072 out, activations
//     in L2, weights from L2/L3): bare; with the accumulators stored each pair; and with each pair's results
//     written to a 896 x 3072 bfloat16 output (non-temporal 64-byte lines, as the product does for many rows)
//     either after the next pair's k loop or spread over it, two rows per k step; and the same for a SiLU-gate
//     epilogue (exp, divide, multiply per 16 values). In ns per product (TDPBF16PS) and TFLOP/s.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

static void configure(void) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

static inline __m512 exp16(__m512 x) {  // the shape of conveyor_vec::exp_ps (same instruction count)
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.98756915e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819995e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345191e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657959e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666655e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.00000012e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

enum { kK = 18, kPairs = 28, kBlocks = 96, kOut = 3072 };
enum Epilogue { kNone, kTileStores, kStoresAfter, kStoresSpread, kSiluAfter, kSiluSpread };

static char* act;        // [pairs][2][k][16][32] bf16: the chunk's activations
static char* weights;    // [blocks][2][k][16][32] bf16
static uint16_t* out;    // [896][3072] bf16
static float sums[2][4][256] __attribute__((aligned(64)));

// Row j (0..31) of a pair's results (four accumulators [16][16]) -> its 64-byte line of `out`.
static inline void store_row(float (*c)[256], int pair, int block, int j, int silu) {
  const __m512 lo = _mm512_load_ps(c[j / 16] + (j % 16) * 16), hi = _mm512_load_ps(c[2 + j / 16] + (j % 16) * 16);
  uint16_t* dst = out + (size_t)(pair * 32 + j) * kOut + block * 32;
  if (silu) {
    const __m512 act16 = _mm512_div_ps(lo, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), lo))));
    _mm256_stream_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act16, hi)));
  } else {
    _mm512_stream_si512((__m512i*)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

static double chunk(enum Epilogue epilogue) {
  const int silu = epilogue == kSiluAfter || epilogue == kSiluSpread;
  const int spread = epilogue == kStoresSpread || epilogue == kSiluSpread;
  const int after = epilogue == kStoresAfter || epilogue == kSiluAfter;
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const double start = now();
    for (int nb = 0; nb < kBlocks; ++nb) {
      const char* w0 = weights + (size_t)nb * 2 * kK * 1024;
      const char* w1 = w0 + kK * 1024;
      for (int p = 0; p < kPairs; ++p) {
        const char* a0 = act + (size_t)p * 2 * kK * 1024;
        const char* a1 = a0 + kK * 1024;
        float(*prev)[256] = sums[(p + 1) & 1];
        float(*cur)[256] = sums[p & 1];
        const int prev_pair = p == 0 ? kPairs - 1 : p - 1;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kt = 0; kt < kK; ++kt) {
          if (spread && kt < 16) {
            store_row(prev, prev_pair, nb, 2 * kt, silu);
            store_row(prev, prev_pair, nb, 2 * kt + 1, silu);
          }
          _tile_loadd(4, a0 + kt * 1024, 64);
          _tile_loadd(6, w0 + kt * 1024, 64);
          _tile_loadd(5, a1 + kt * 1024, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(7, w1 + kt * 1024, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        if (after)
          for (int j = 0; j < 32; ++j) store_row(prev, prev_pair, nb, j, silu);
        if (epilogue != kNone) {
          _tile_stored(0, cur[0], 64);
          _tile_stored(1, cur[1], 64);
          _tile_stored(2, cur[2], 64);
          _tile_stored(3, cur[3], 64);
        }
      }
    }
    const double took = now() - start;
    if (took < best) best = took;
  }
  return best / ((double)kBlocks * kPairs * kK * 4);
}

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    printf("no AMX tile data for this process\n");
    return 1;
  }
  configure();
  static char tile[8][1024] __attribute__((aligned(64)));
  memset(tile, 0, sizeof tile);
  _tile_loadd(4, tile[4], 64);
  _tile_loadd(5, tile[5], 64);
  const long n = 2000000;
  double start = now();
  for (long i = 0; i < n; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  printf("TDPBF16PS, four accumulators:   %5.2f ns each\n", (now() - start) / (4.0 * n) * 1e9);
  start = now();
  for (long i = 0; i < n; ++i) _tile_stored(0, tile[0], 64);
  printf("TILESTORED to L1:               %5.2f ns each\n", (now() - start) / n * 1e9);

  const size_t stream_bytes = (size_t)512 << 20;
  char* stream = aligned_alloc(4096, stream_bytes);
  memset(stream, 1, stream_bytes);
  for (int products = 0; products <= 4; products += 4) {
    double best = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      start = now();
      for (size_t b = 0; b < stream_bytes; b += 1024) {
        _tile_loadd(6, stream + b, 64);
        if (products) {
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 6);
          _tile_dpbf16ps(2, 4, 6);
          _tile_dpbf16ps(3, 4, 6);
        }
      }
      if (now() - start < best) best = now() - start;
    }
    printf("tile loads from memory, %d products per tile: %5.1f GB/s\n", products, stream_bytes / best / 1e9);
  }
  free(stream);

  act = aligned_alloc(64, (size_t)kPairs * 2 * kK * 1024);
  weights = aligned_alloc(64, (size_t)kBlocks * 2 * kK * 1024);
  out = aligned_alloc(64, (size_t)kPairs * 32 * kOut * 2);
  srand(1);
  for (size_t i = 0; i < (size_t)kPairs * 2 * kK * 1024; ++i) act[i] = (i & 1) ? 0x3c : (char)rand();
  for (size_t i = 0; i < (size_t)kBlocks * 2 * kK * 1024; ++i) weights[i] = (i & 1) ? 0x3c : (char)rand();
  memset(out, 0, (size_t)kPairs * 32 * kOut * 2);
  const char* names[] = {"bare", "accumulators stored", "stores after k loop", "stores spread over k loop",
                         "SiLU after k loop", "SiLU spread over k loop"};
  for (int e = kNone; e <= kSiluSpread; ++e) {
    const double per = chunk((enum Epilogue)e);
    printf("prefill chunk, %-26s %5.2f ns per product, %4.2f TFLOP/s\n", names[e], per * 1e9, 16384 / per / 1e12);
  }
  _tile_release();
  return 0;
}
