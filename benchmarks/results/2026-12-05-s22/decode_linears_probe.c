// Session s22: the default model's 30 layers' linears at 64 rows (qkv, o, gate/up, down: 212 MB of bfloat16 tiles,
// cold) on AMX, in loop structures other than amx_product.cpp's: "today" (its structure: per 32-column block,
// the two pairs of row tiles in turn, the block's own tiles requested 8 pieces ahead during the first pair; the
// prefetch hint and distance varied) and "1x4p" (one weight tile x four row tiles, K in panels whose activations
// stay in L1, accumulators kept in memory between panels, prefetch a fixed distance ahead in the order the
// weights are consumed). linear() VARIANT 1/2 (groups of blocks, pairs outer, the next group's weights requested
// spread over the current group's work), linear14 (1x4, burst prefetch), linear14p (1x4, K panels, prefetch in
// consumption order) and linear14s (1x4 over the whole K, prefetch in memory order) are the arms measured; main()
// as committed runs today's loop with and without NEXT (the next block requested during the last pair of row
// tiles); the other arms' loops in main() are switched off by their bounds (edit them to rerun one).
// Numbers: RESULTS.md "Session s22".
//   gcc -O2 -march=native -fopenmp decode_linears_probe.c -o /tmp/dl && flock /work/bench.lock env OMP_NUM_THREADS=2 /tmp/dl
// 64-row decode linears of the default model (30 layers: qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576)
// on AMX, weights packed as B, streamed from DRAM. Variants of the loop / prefetch.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;
static void configure(void) {
  TileConfig c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}
#define TV 512  // bf16 values per tile
typedef uint16_t bf16;
static inline void pf(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*(const char*)p)); }
static inline void pf1(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*(const char*)p)); }
static inline void pf2(const void* p) { asm volatile("prefetcht2 %0" : : "m"(*(const char*)p)); }
static int HINT = 1;
static inline void pfh(const void* p) { if (HINT == 0) pf(p); else if (HINT == 1) pf1(p); else pf2(p); }

typedef struct { int in, out; bf16* w; } Lin;
static int ROWS = 64;

static void store_acc(float* c, int m, bf16* y, int ystride) {
  for (int j = 0; j < m; ++j) {
    __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c + 256 + j * 16), _mm512_load_ps(c + j * 16));
    _mm512_storeu_si512(y + (size_t)j * ystride, b);
  }
}

// one 2x2 pass: x tiles x0,x1 (A), block tiles w0,w1 (B) over kt tiles; accumulate to c[4*256]
static inline void mult(const bf16* x0, const bf16* x1, const bf16* w0, const bf16* w1, int kt_n, float* c,
                        const char* pfp, int pf_lines_per_kt) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int kt = 0; kt < kt_n; ++kt) {
    if (pfp) for (int l = 0; l < pf_lines_per_kt; ++l) pfh(pfp + ((size_t)kt * pf_lines_per_kt + l) * 64);
    _tile_loadd(4, x0 + kt * TV, 64);
    _tile_loadd(6, w0 + kt * TV, 64);
    _tile_loadd(5, x1 + kt * TV, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(7, w1 + kt * TV, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
}

static int NEXT = 0;
static int VARIANT = 0, GROUP_KB = 512, AHEAD = 8;
// x packed [row_tiles][kt][16][32]
static void linear(const bf16* x, const Lin* L, bf16* y) {
  const int kt_n = L->in / 32, nblocks = L->out / 32, rt = (ROWS + 15) / 16;
  const size_t block_vals = (size_t)2 * kt_n * TV;
#pragma omp parallel
  {
    configure();
    float c[1024] __attribute__((aligned(64)));
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int b0 = nblocks * id / nt, b1 = nblocks * (id + 1) / nt;
    if (VARIANT == 0) {  // today's: per block, pairs; stream-ahead AHEAD pieces during the first pair
      for (int nb = b0; nb < b1; ++nb) {
        const bf16* w0 = L->w + nb * block_vals; const bf16* w1 = w0 + (size_t)kt_n * TV;
        for (int t = 0; t < rt; t += 2) {
          const bf16* x0 = x + (size_t)t * kt_n * TV; const bf16* x1 = x0 + (size_t)kt_n * TV;
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          for (int kt = 0; kt < kt_n; ++kt) {
            if (t == 0 && AHEAD) {
              const char* a = (const char*)(w0 + (kt + AHEAD) * TV); const char* b = (const char*)(w1 + (kt + AHEAD) * TV);
              for (int l = 0; l < 16; ++l) { pf1(a + l * 64); pf1(b + l * 64); }
            }
            if (NEXT && t == rt - 2 && nb + 1 < b1) {  // the next block, during the last pair
              const char* a = (const char*)(w0 + block_vals + kt * TV); const char* b = (const char*)(w1 + block_vals + kt * TV);
              for (int l = 0; l < 16; ++l) { pfh(a + l * 64); pfh(b + l * 64); }
            }
            _tile_loadd(4, x0 + kt * TV, 64); _tile_loadd(6, w0 + kt * TV, 64); _tile_loadd(5, x1 + kt * TV, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(7, w1 + kt * TV, 64); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
          store_acc(c, 16, y + (size_t)t * 16 * L->out + nb * 32, L->out);
          store_acc(c + 512, 16, y + (size_t)(t + 1) * 16 * L->out + nb * 32, L->out);
        }
      }
    } else {  // groups of blocks: pairs outer, blocks inner; next group's bytes prefetched spread over the work
      int G = (int)((size_t)GROUP_KB * 1024 / (block_vals * 2)); if (G < 1) G = 1;
      // first group: prefetch upfront? (VARIANT 2: yes, the first 16 KB)
      for (int g0 = b0; g0 < b1; g0 += G) {
        const int g1 = g0 + G < b1 ? g0 + G : b1;
        const int n2 = (g1 + G < b1 ? g1 + G : b1) - g1;  // blocks of the next group
        const char* next = (const char*)(L->w + g1 * block_vals);
        const size_t next_lines = (size_t)n2 * block_vals * 2 / 64;
        const size_t steps = (size_t)(rt / 2) * (g1 - g0) * kt_n;
        const int per = steps ? (int)((next_lines + steps - 1) / steps) : 0;
        size_t step = 0;
        for (int t = 0; t < rt; t += 2) {
          const bf16* x0 = x + (size_t)t * kt_n * TV; const bf16* x1 = x0 + (size_t)kt_n * TV;
          for (int nb = g0; nb < g1; ++nb) {
            const bf16* w0 = L->w + nb * block_vals; const bf16* w1 = w0 + (size_t)kt_n * TV;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int kt = 0; kt < kt_n; ++kt, ++step) {
              if (n2) for (int l = 0; l < per; ++l) { size_t li = step * per + l; if (li < next_lines) pfh(next + li * 64); }
              if (t == 0 && g0 == b0 && VARIANT == 2) {  // first group demand: stream ahead as today
                const char* a = (const char*)(w0 + (kt + AHEAD) * TV); const char* b = (const char*)(w1 + (kt + AHEAD) * TV);
                for (int l = 0; l < 16; ++l) { pf1(a + l * 64); pf1(b + l * 64); }
              }
              _tile_loadd(4, x0 + kt * TV, 64); _tile_loadd(6, w0 + kt * TV, 64); _tile_loadd(5, x1 + kt * TV, 64);
              _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
              _tile_loadd(7, w1 + kt * TV, 64); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
            store_acc(c, 16, y + (size_t)t * 16 * L->out + nb * 32, L->out);
            store_acc(c + 512, 16, y + (size_t)(t + 1) * 16 * L->out + nb * 32, L->out);
          }
        }
      }
    }
    _tile_release();
  }
}


// VARIANT 3: one weight tile x four row tiles (4 accumulators), K in panels of PANEL k tiles (x's panel in L1),
// panels outer, weight tiles inner, accumulators kept in a per-thread buffer between panels.
static int PANEL = 8;
static void linear14(const bf16* x, const Lin* L, bf16* y) {
  const int kt_n = L->in / 32, ntiles = L->out / 16, rt = 4;
#pragma omp parallel
  {
    configure();
    static __thread float* sums = 0; static __thread size_t cap = 0;
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int n0 = ntiles * id / nt, n1 = ntiles * (id + 1) / nt;
    const size_t need = (size_t)(n1 - n0) * 4 * 256;
    if (cap < need) { free(sums); sums = aligned_alloc(64, need * 4); cap = need; }
    for (int k0 = 0; k0 < kt_n; k0 += PANEL) {
      const int k1 = k0 + PANEL < kt_n ? k0 + PANEL : kt_n;
      const int first = k0 == 0, last = k1 == kt_n;
      for (int n = n0; n < n1; ++n) {
        const bf16* w = L->w + (size_t)n * kt_n * TV;
        float* c = sums + (size_t)(n - n0) * 1024;
        if (first) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
        else { _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64); }
        if (AHEAD) { const char* a = (const char*)(w + (size_t)(k1 + kt_n) * TV);  // same panel of the next tile
          for (int l = 0; l < 16 * (k1 - k0); l += 1) pf1(a - (size_t)(k1 - k0) * TV * 2 + l * 64); }
        for (int kt = k0; kt < k1; ++kt) {
          _tile_loadd(4, w + (size_t)kt * TV, 64);
          _tile_loadd(5, x + (size_t)(0 * kt_n + kt) * TV, 64); _tile_dpbf16ps(0, 5, 4);
          _tile_loadd(6, x + (size_t)(1 * kt_n + kt) * TV, 64); _tile_dpbf16ps(1, 6, 4);
          _tile_loadd(7, x + (size_t)(2 * kt_n + kt) * TV, 64); _tile_dpbf16ps(2, 7, 4);
          _tile_loadd(5, x + (size_t)(3 * kt_n + kt) * TV, 64); _tile_dpbf16ps(3, 5, 4);
        }
        _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
        if (last) for (int j = 0; j < rt; ++j)
          for (int r = 0; r < 16; ++r) {
            __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + j * 256 + r * 16));
            _mm256_storeu_si256((__m256i*)(y + (size_t)(j * 16 + r) * L->out + n * 16), b);
          }
      }
    }
    _tile_release();
  }
}

// VARIANT 4: 1x4, panels outer, continuous prefetch D KiB ahead in consumption order (HINT).
static void linear14p(const bf16* x, const Lin* L, bf16* y) {
  const int kt_n = L->in / 32, ntiles = L->out / 16, rt = 4;
#pragma omp parallel
  {
    configure();
    static __thread float* sums = 0; static __thread size_t cap = 0;
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int n0 = ntiles * id / nt, n1 = ntiles * (id + 1) / nt;
    const size_t need = (size_t)(n1 - n0) * 4 * 256;
    if (cap < need) { free(sums); sums = aligned_alloc(64, need * 4); cap = need; }
    for (int k0 = 0; k0 < kt_n; k0 += PANEL) {
      const int k1 = k0 + PANEL < kt_n ? k0 + PANEL : kt_n, pw = k1 - k0;
      const int first = k0 == 0, last = k1 == kt_n;
      for (int n = n0; n < n1; ++n) {
        const bf16* w = L->w + (size_t)n * kt_n * TV;
        float* c = sums + (size_t)(n - n0) * 1024;
        if (first) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
        else { _tile_loadd(0, c, 64); _tile_loadd(1, c + 256, 64); _tile_loadd(2, c + 512, 64); _tile_loadd(3, c + 768, 64); }
        for (int kt = k0; kt < k1; ++kt) {
          if (AHEAD) {  // the piece AHEAD steps on in consumption order
            int a = kt - k0 + AHEAD, nn = n + a / pw, kk = k0 + a % pw, kp = k0;
            if (nn >= n1) { nn = n0 + (nn - n1); kp = k1; kk = kp + a % pw; }
            if (nn < n1 && kk < kt_n) { const char* p = (const char*)(L->w + ((size_t)nn * kt_n + kk) * TV);
              for (int l = 0; l < 16; ++l) pfh(p + l * 64); }
          }
          _tile_loadd(4, w + (size_t)kt * TV, 64);
          _tile_loadd(5, x + (size_t)(0 * kt_n + kt) * TV, 64); _tile_dpbf16ps(0, 5, 4);
          _tile_loadd(6, x + (size_t)(1 * kt_n + kt) * TV, 64); _tile_dpbf16ps(1, 6, 4);
          _tile_loadd(7, x + (size_t)(2 * kt_n + kt) * TV, 64); _tile_dpbf16ps(2, 7, 4);
          _tile_loadd(5, x + (size_t)(3 * kt_n + kt) * TV, 64); _tile_dpbf16ps(3, 5, 4);
        }
        _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
        if (last) for (int j = 0; j < rt; ++j)
          for (int r = 0; r < 16; ++r) {
            __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + j * 256 + r * 16));
            _mm256_storeu_si256((__m256i*)(y + (size_t)(j * 16 + r) * L->out + n * 16), b);
          }
      }
    }
    _tile_release();
  }
}

// VARIANT 5: 1x4 over the whole K (accumulators in registers), weights consumed in memory order, prefetch DIST KiB ahead.
static void linear14s(const bf16* x, const Lin* L, bf16* y) {
  const int kt_n = L->in / 32, ntiles = L->out / 16;
#pragma omp parallel
  {
    configure();
    float c[1024] __attribute__((aligned(64)));
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int n0 = ntiles * id / nt, n1 = ntiles * (id + 1) / nt;
    const char* end = (const char*)(L->w + (size_t)n1 * kt_n * TV);
    for (int n = n0; n < n1; ++n) {
      const bf16* w = L->w + (size_t)n * kt_n * TV;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int kt = 0; kt < kt_n; ++kt) {
        const char* p = (const char*)(w + (size_t)kt * TV) + (size_t)AHEAD * 1024;
        if (AHEAD && p < end) for (int l = 0; l < 16; ++l) pfh(p + l * 64);
        _tile_loadd(4, w + (size_t)kt * TV, 64);
        _tile_loadd(5, x + (size_t)(0 * kt_n + kt) * TV, 64); _tile_dpbf16ps(0, 5, 4);
        _tile_loadd(6, x + (size_t)(1 * kt_n + kt) * TV, 64); _tile_dpbf16ps(1, 6, 4);
        _tile_loadd(7, x + (size_t)(2 * kt_n + kt) * TV, 64); _tile_dpbf16ps(2, 7, 4);
        _tile_loadd(5, x + (size_t)(3 * kt_n + kt) * TV, 64); _tile_dpbf16ps(3, 5, 4);
      }
      _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < 16; ++r) {
          __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + j * 256 + r * 16));
          _mm256_storeu_si256((__m256i*)(y + (size_t)(j * 16 + r) * L->out + n * 16), b);
        }
    }
    _tile_release();
  }
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no amx"); return 1; }
  const int shapes[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}};
  const int layers = 30;
  Lin L[120];
  size_t total = 0;
  for (int i = 0; i < layers; ++i)
    for (int s = 0; s < 4; ++s) {
      Lin* l = &L[i * 4 + s]; l->in = shapes[s][0]; l->out = shapes[s][1];
      size_t n = (size_t)l->in * l->out; l->w = aligned_alloc(4096, n * 2);
      for (size_t j = 0; j < n; ++j) l->w[j] = 0x3c00 + (j * 2654435761u >> 20) % 64;
      total += n * 2;
    }
  bf16* x = aligned_alloc(64, 64 * 1536 * 2); for (int j = 0; j < 64 * 1536; ++j) x[j] = 0x3c00 + j % 32;
  bf16* y = aligned_alloc(64, 64 * 3072 * 2);
  char* flush = malloc(256 << 20);
  printf("weights %.1f MB\n", total / 1e6);
  const char* names[] = {"today (stream-ahead 8)", "groups, spread prefetch", "groups + first-group stream-ahead"};
  for (int round = 0; round < 2; ++round) {
    for (int v = 0; v < 4; ++v) for (int hint = 1; hint <= 1; ++hint) for (int gk = 8; gk <= 8; gk *= 2) {
      VARIANT = 0; NEXT = v > 0; HINT = v == 3 ? 0 : v; AHEAD = gk;
      memset(flush, round, 256 << 20);
      double best = 1e9;
      for (int rep = 0; rep < 3; ++rep) {
        double t = now();
        for (int i = 0; i < 120; ++i) linear(x, &L[i], y);
        t = now() - t; if (t < best) best = t;
      }
      printf("%-36s next %d hint T%d ahead %4d: %.2f ms (%.1f GB/s)\n", names[0], NEXT, HINT, gk, best * 1e3, total / best / 1e9);
    }
    for (int p = 8; p <= 64; p *= 8) for (int ah = 0; ah <= -1; ++ah) {
      PANEL = p; AHEAD = ah; memset(flush, round, 256 << 20);
      double best = 1e9;
      for (int rep = 0; rep < 3; ++rep) { double t = now(); for (int i = 0; i < 120; ++i) linear14(x, &L[i], y); t = now() - t; if (t < best) best = t; }
      double th = now(); for (int r = 0; r < 30; ++r) for (int s = 0; s < 4; ++s) linear14(x, &L[s], y); th = now() - th;
      printf("1x4 panels of %2d k tiles, prefetch %d: %.2f ms (%.1f GB/s); one layer hot x30 %.2f ms\n", p, ah, best * 1e3, total / best / 1e9, th * 1e3);
    }
    for (int p = 64; p <= -1; p += 2) for (HINT = 0; HINT <= 2; ++HINT) for (int ah = (HINT ? 4 : 0); ah <= (HINT ? 64 : 0); ah = ah ? ah * 2 : 1) {
      PANEL = p; AHEAD = ah; memset(flush, round, 256 << 20);
      double best = 1e9;
      for (int rep = 0; rep < 3; ++rep) { double t = now(); for (int i = 0; i < 120; ++i) linear14s(x, &L[i], y); t = now() - t; if (t < best) best = t; }
      printf("1x4s whole K %d, T%d ahead %2d: %.2f ms (%.1f GB/s)\n", p, HINT, ah, best * 1e3, total / best / 1e9);
    }
    AHEAD = 8;
    for (int s = 0; s < 0; ++s) {  // L2-hot: one op repeated
      const Lin* l = &L[s]; const double dps = (double)(l->out / 32) * 2 * (l->in / 32) * 4;
      VARIANT = 0; AHEAD = 8; linear(x, l, y); double t = now(); for (int r = 0; r < 200; ++r) linear(x, l, y); t = (now() - t) / 200;
      PANEL = 8; AHEAD = 0; linear14(x, l, y); double t2 = now(); for (int r = 0; r < 200; ++r) linear14(x, l, y); t2 = (now() - t2) / 200;
      AHEAD = 8;
      printf("op %d (%dx%d) repeated: today %.1f us (%.2f ns/dp/thread), 1x4 p8 %.1f us (%.2f)\n", s, l->in, l->out, t * 1e6, t * 1e9 * 2 / dps, t2 * 1e6, t2 * 1e9 * 2 / dps);
    }
    // hot: layer 0 only x30
    VARIANT = 0; double t = now();
    for (int r = 0; r < 30; ++r) for (int s = 0; s < 4; ++s) linear(x, &L[s], y);
    t = now() - t; printf("today, one layer hot x30: %.2f ms\n", t * 1e3);
  }
  return 0;
}
