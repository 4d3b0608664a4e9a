// benchmarks/read_patterns_probe.c (session s16) with, in session s24, three more patterns: per-head-pf (the
// kernel's order with its requests 16 tokens ahead), head-major and head-major-pf (a block's rows of one KV head
// contiguous, as a head-major block layout would store them). kBlock (16) edited to 32 / 64 for the other runs.
//
//   gcc -O2 -mavx512f -fopenmp read_patterns_head_major.c -o /tmp/hm && OMP_NUM_THREADS=2 /tmp/hm
//
// A paged KV cache of W1's shape at its mean context (30 layers, 64 sequences x 208 tokens, 16-token blocks in a
// random order, 3 KV heads x 64 bfloat16 per token and head: 307 MB of K and V), read with plain vector loads:
//   sequential  one contiguous sweep over the same bytes (the hardware's best case);
//   per-head    what the vector kernel does: per (sequence, KV head), K rows then V rows of that head
//               (128 bytes of every 384);
//   whole-rows  per sequence, K then V, every head of a token at once (whole 6 KiB blocks in order);
//   rows+v      whole K rows, each token's V row requested to L2 beside it, then V head by head (what an attention
//               kernel with one item per sequence could do);
//   +work N     whole-rows with N x 6 independent FMAs per 64 bytes loaded, first from memory, then over the
//               first 4 sequences of layer 0 only (in cache): whether compute and memory overlap.
// Printed: ms per sweep (best of 6) and GB/s.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kLayers = 30, kSeqs = 64, kCtx = 208, kBlock = 16, kHeads = 3, kHeadBytes = 128, kTokenBytes = kHeads * kHeadBytes };
enum { kBlocksPerSeq = (kCtx + kBlock - 1) / kBlock, kBlockBytes = kBlock * kTokenBytes };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char* K[kLayers];
static char* V[kLayers];
static int table[kSeqs * kBlocksPerSeq];

static inline char* row(char* base, int seq, int t) {
  return base + (size_t)table[seq * kBlocksPerSeq + t / kBlock] * kBlockBytes + (size_t)(t % kBlock) * kTokenBytes;
}

static inline __m512 work(__m512 x, int n, __m512* a) {
  const __m512 m = _mm512_set1_ps(0.9999f);
  for (int w = 0; w < n; ++w)
    for (int i = 0; i < 6; ++i) a[i] = _mm512_fmadd_ps(a[i], m, x);
  return x;
}

// One sweep in `pattern`; returns a value that depends on every load.
static float sweep(const char* pattern, int n_work, int in_cache) {
  float sink = 0.f;
  for (int l = 0; l < kLayers; ++l) {
    const int layer = in_cache ? 0 : l;
#pragma omp parallel for schedule(static) reduction(+ : sink)
    for (int s = 0; s < kSeqs; ++s) {
      const int seq = in_cache ? s % 4 : s;
      __m512 acc = _mm512_setzero_ps(), a[6];
      for (int i = 0; i < 6; ++i) a[i] = _mm512_set1_ps(1.f);
      if (strcmp(pattern, "head-major") == 0 || strcmp(pattern, "head-major-pf") == 0) {
        const int pf = pattern[10] == '-';
        for (int h = 0; h < kHeads; ++h)
          for (int pass = 0; pass < 2; ++pass)
            for (int t = 0; t < kCtx; ++t) {
              char* base = pass ? V[layer] : K[layer];
              const char* r = base + (size_t)table[seq * kBlocksPerSeq + t / kBlock] * kBlockBytes + (size_t)h * kBlock * kHeadBytes + (size_t)(t % kBlock) * kHeadBytes;
              if (pf && t + 16 < kCtx) {
                const int u = t + 16;
                const char* q = base + (size_t)table[seq * kBlocksPerSeq + u / kBlock] * kBlockBytes + (size_t)h * kBlock * kHeadBytes + (size_t)(u % kBlock) * kHeadBytes;
                _mm_prefetch(q, _MM_HINT_T0); _mm_prefetch(q + 64, _MM_HINT_T0);
              }
              acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 64)));
            }
      } else if (strcmp(pattern, "per-head-pf") == 0) {
        for (int h = 0; h < kHeads; ++h)
          for (int pass = 0; pass < 2; ++pass)
            for (int t = 0; t < kCtx; ++t) {
              const char* r = row(pass ? V[layer] : K[layer], seq, t) + h * kHeadBytes;
              if (t + 16 < kCtx) { const char* q = row(pass ? V[layer] : K[layer], seq, t + 16) + h * kHeadBytes; _mm_prefetch(q, _MM_HINT_T0); _mm_prefetch(q + 64, _MM_HINT_T0); }
              acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 64)));
            }
      } else if (strcmp(pattern, "per-head") == 0) {
        for (int h = 0; h < kHeads; ++h)
          for (int pass = 0; pass < 2; ++pass)
            for (int t = 0; t < kCtx; ++t) {
              const char* r = row(pass ? V[layer] : K[layer], seq, t) + h * kHeadBytes;
              acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 64)));
            }
      } else if (strcmp(pattern, "rows+v") == 0) {
        for (int t = 0; t < kCtx; ++t) {
          const char* k = row(K[layer], seq, t);
          const char* v = row(V[layer], seq, t);
          for (int b = 0; b < kTokenBytes; b += 64) {
            _mm_prefetch(v + b, _MM_HINT_T1);
            acc = _mm512_add_ps(acc, _mm512_load_ps(k + b));
          }
        }
        for (int h = 0; h < kHeads; ++h)
          for (int t = 0; t < kCtx; ++t) {
            const char* r = row(V[layer], seq, t) + h * kHeadBytes;
            acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 64)));
          }
      } else {  // whole-rows (+work)
        for (int pass = 0; pass < 2; ++pass)
          for (int t = 0; t < kCtx; ++t) {
            const char* r = row(pass ? V[layer] : K[layer], seq, t);
            for (int b = 0; b < kTokenBytes; b += 64) acc = _mm512_add_ps(acc, work(_mm512_load_ps(r + b), n_work, a));
          }
      }
      for (int i = 0; i < 6; ++i) acc = _mm512_add_ps(acc, a[i]);
      sink += _mm512_reduce_add_ps(acc);
    }
  }
  return sink;
}

static float sequential(void) {
  float sink = 0.f;
  const size_t bytes = (size_t)kSeqs * kBlocksPerSeq * kBlockBytes;
  for (int l = 0; l < kLayers; ++l)
    for (int pass = 0; pass < 2; ++pass) {
      const char* base = pass ? V[l] : K[l];
#pragma omp parallel reduction(+ : sink)
      {
        const size_t share = bytes / omp_get_num_threads(), first = share * omp_get_thread_num();
        __m512 acc = _mm512_setzero_ps();
        for (size_t b = first; b < first + share; b += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(base + b));
        sink += _mm512_reduce_add_ps(acc);
      }
    }
  return sink;
}

static void report(const char* name, float (*fn)(const char*, int, int), const char* pattern, int n_work,
                   int in_cache) {
  double best = 1e9;
  float sink = 0.f;
  for (int rep = 0; rep < 6; ++rep) {
    const double start = now();
    sink += fn == NULL ? sequential() : fn(pattern, n_work, in_cache);
    const double took = now() - start;
    if (took < best) best = took;
  }
  const double bytes = 2.0 * kLayers * kSeqs * kCtx * kTokenBytes;
  printf("%-28s %7.2f ms  %5.1f GB/s   (%g)\n", name, best * 1e3, bytes / best / 1e9, sink);
}

int main(void) {
  const size_t pool = (size_t)kSeqs * kBlocksPerSeq * kBlockBytes;
  for (int l = 0; l < kLayers; ++l) {
    K[l] = aligned_alloc(4096, pool);
    V[l] = aligned_alloc(4096, pool);
    memset(K[l], 0, pool);
    memset(V[l], 0, pool);
  }
  for (int i = 0; i < kSeqs * kBlocksPerSeq; ++i) table[i] = i;
  srand(1);
  for (int i = kSeqs * kBlocksPerSeq - 1; i > 0; --i) {  // blocks in a random order, as a busy cache hands them out
    const int j = rand() % (i + 1), held = table[i];
    table[i] = table[j];
    table[j] = held;
  }
  printf("threads %d, %.0f MB of K and V per sweep\n", omp_get_max_threads(), 2.0 * kLayers * kSeqs * kCtx * kTokenBytes / 1e6);
  report("sequential", NULL, NULL, 0, 0);
  report("per-head", sweep, "per-head", 0, 0);
  report("per-head-pf", sweep, "per-head-pf", 0, 0);
  report("head-major", sweep, "head-major", 0, 0);
  report("head-major-pf", sweep, "head-major-pf", 0, 0);
  report("whole-rows", sweep, "whole-rows", 0, 0);
  report("rows+v", sweep, "rows+v", 0, 0);
  for (int n = 1; n <= 4; n *= 2) {
    char name[64];
    snprintf(name, sizeof name, "whole-rows +work %d", n);
    report(name, sweep, "whole-rows", n, 0);
    snprintf(name, sizeof name, "  the same, in cache");
    report(name, sweep, "whole-rows", n, 1);
  }
  return 0;
}
