// Plain reads of W1's KV per (sequence, KV head), in today's token-major blocks ([block][token][head][d]) against
// head-major blocks ([block][head][token][d]), 16- and 64-token blocks, blocks in random order (s28 probe).
//   gcc -O2 -mavx512f -fopenmp layout_probe.c -o /tmp/layout && OMP_NUM_THREADS=2 /tmp/layout
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
enum { kLayers = 30, kSeqs = 64, kCtx = 208, kHeads = 3, kHeadBytes = 128, kTokenBytes = kHeads * kHeadBytes };
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static char *K[kLayers], *V[kLayers];
static int* table;
static int B, BPS;  // block size, blocks per sequence
static void* huge(size_t bytes) {
  bytes = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
  void* p = aligned_alloc(2u << 20, bytes); madvise(p, bytes, 14); memset(p, 1, bytes); return p;
}
static inline const char* at(const char* base, int seq, int h, int t, int head_major) {
  const size_t block = (size_t)table[seq * BPS + t / B] * B * kTokenBytes;
  return base + block + (head_major ? ((size_t)h * B + t % B) * kHeadBytes : (size_t)(t % B) * kTokenBytes + h * kHeadBytes);
}
static float sweep(int head_major, int prefetch) {
  float sink = 0.f;
  for (int l = 0; l < kLayers; ++l) {
#pragma omp parallel for schedule(static) reduction(+ : sink)
    for (int s = 0; s < kSeqs; ++s) {
      __m512 acc = _mm512_setzero_ps();
      for (int h = 0; h < kHeads; ++h)
        for (int pass = 0; pass < 2; ++pass) {
          const char* base = pass ? V[l] : K[l];
          for (int t = 0; t < kCtx; ++t) {
            if (prefetch && t + 16 < kCtx) { const char* p = at(base, s, h, t + 16, head_major); _mm_prefetch(p, _MM_HINT_T0); _mm_prefetch(p + 64, _MM_HINT_T0); }
            const char* r = at(base, s, h, t, head_major);
            acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 64)));
          }
        }
      sink += _mm512_reduce_add_ps(acc);
    }
  }
  return sink;
}
int main(void) {
  int sizes[] = {16, 64};
  for (int si = 0; si < 2; ++si) {
    B = sizes[si]; BPS = (kCtx + B - 1) / B;
    const size_t pool = (size_t)kSeqs * BPS * B * kTokenBytes;
    for (int l = 0; l < kLayers; ++l) { K[l] = huge(pool); V[l] = huge(pool); }
    table = malloc(sizeof(int) * kSeqs * BPS);
    for (int i = 0; i < kSeqs * BPS; ++i) table[i] = i;
    srand(1);
    for (int i = kSeqs * BPS - 1; i > 0; --i) { const int j = rand() % (i + 1), x = table[i]; table[i] = table[j]; table[j] = x; }
    const char* names[] = {"token-major", "head-major"};
    for (int round = 0; round < 2; ++round)
      for (int hm = 0; hm < 2; ++hm)
        for (int pf = 0; pf < 2; ++pf) {
          double best = 1e9; float sink = 0;
          for (int rep = 0; rep < 5; ++rep) { double t0 = now(); sink += sweep(hm, pf); double dt = now() - t0; if (dt < best) best = dt; }
          const double bytes = 2.0 * kLayers * kSeqs * kCtx * kTokenBytes;
          printf("block %2d %-12s %-12s %7.2f ms %5.1f GB/s (%g)\n", B, names[hm], pf ? "prefetch16" : "plain", best * 1e3, bytes / best / 1e9, sink);
        }
    for (int l = 0; l < kLayers; ++l) { free(K[l]); free(V[l]); }
    free(table);
  }
}
