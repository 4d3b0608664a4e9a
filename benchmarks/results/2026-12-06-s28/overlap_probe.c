// Whether a decode step's weights can be fetched in the shadow of its attention (s28 probe).
//   gcc -O2 -mavx512f -fopenmp overlap_probe.c -o /tmp/overlap && OMP_NUM_THREADS=2 /tmp/overlap
// W1's KV shape (30 layers, 64 seqs x 208 tokens, 16-token blocks in random order, 3 KV heads x 128 B), read
// per (sequence, KV head) as the kernel does; the default model's layer weights (7.1 MB per layer, 214 MB) read
// sequentially after each layer's attention (today's order), or requested during the attention (spread over its
// rows) and read after it.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kLayers = 30, kSeqs = 64, kCtx = 208, kBlock = 16, kHeads = 3, kHeadBytes = 128, kTokenBytes = kHeads * kHeadBytes };
enum { kBlocksPerSeq = (kCtx + kBlock - 1) / kBlock, kBlockBytes = kBlock * kTokenBytes };
static const size_t kLayerWeights = 7077888;  // bytes: (960 + 576 + 3072) x 576 + 576 x 1536, bf16

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static char *K[kLayers], *V[kLayers], *W[kLayers];
static int table[kSeqs * kBlocksPerSeq];
static inline const char* row(const char* base, int seq, int t) {
  return base + (size_t)table[seq * kBlocksPerSeq + t / kBlock] * kBlockBytes + (size_t)(t % kBlock) * kTokenBytes;
}
static void* huge(size_t bytes) {
  bytes = (bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
  void* p = aligned_alloc(2u << 20, bytes); madvise(p, bytes, 14 /*MADV_HUGEPAGE*/); memset(p, 1, bytes); return p;
}

// mode 0: attention only; 1: weights only; 2: attention then weights; 3: weights requested (prefetcht1) during
// attention, then read; 4: weights requested with prefetcht2; 5: as 3 with prefetchnta
static float step(int mode) {
  float sink = 0.f;
  for (int l = 0; l < kLayers; ++l) {
#pragma omp parallel reduction(+ : sink)
    {
      const int nt = omp_get_num_threads(), me = omp_get_thread_num();
      const size_t share = kLayerWeights / nt, wfirst = share * me;
      const char* w = W[l] + wfirst;
      __m512 acc = _mm512_setzero_ps();
      if (mode != 1) {
        // my sequences (static split), and the weight lines to request per token row read
        const int s0 = kSeqs * me / nt, s1 = kSeqs * (me + 1) / nt;
        const size_t rows = (size_t)(s1 - s0) * kHeads * 2 * kCtx;
        const size_t lines = share / 64;
        size_t requested = 0, done_rows = 0;
        for (int s = s0; s < s1; ++s)
          for (int h = 0; h < kHeads; ++h)
            for (int pass = 0; pass < 2; ++pass)
              for (int t = 0; t < kCtx; ++t) {
                const char* r = row(pass ? V[l] : K[l], s, t) + h * kHeadBytes;
                acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_load_ps(r), _mm512_load_ps(r + 64)));
                if (mode >= 3) {
                  ++done_rows;
                  const size_t want = lines * done_rows / rows;
                  for (; requested < want; ++requested) {
                    const char* p = w + requested * 64;
                    if (mode == 3) _mm_prefetch(p, _MM_HINT_T1);
                    else if (mode == 4) _mm_prefetch(p, _MM_HINT_T2);
                    else _mm_prefetch(p, _MM_HINT_NTA);
                  }
                }
              }
      }
#pragma omp barrier
      if (mode != 0)
        for (size_t b = 0; b < share; b += 64) acc = _mm512_add_ps(acc, _mm512_load_ps(w + b));
      sink += _mm512_reduce_add_ps(acc);
    }
  }
  return sink;
}

int main(void) {
  const size_t pool = (size_t)kSeqs * kBlocksPerSeq * kBlockBytes;
  for (int l = 0; l < kLayers; ++l) { K[l] = huge(pool); V[l] = huge(pool); W[l] = huge(kLayerWeights); }
  for (int i = 0; i < kSeqs * kBlocksPerSeq; ++i) table[i] = i;
  srand(1);
  for (int i = kSeqs * kBlocksPerSeq - 1; i > 0; --i) { const int j = rand() % (i + 1), x = table[i]; table[i] = table[j]; table[j] = x; }
  const char* names[] = {"attention (per-head) only", "weights only (sequential)", "attention, then weights",
                         "weights requested T1 during attention", "weights requested T2 during attention",
                         "weights requested NTA during attention"};
  for (int round = 0; round < 3; ++round)
    for (int mode = 0; mode < 6; ++mode) {
      double best = 1e9; float sink = 0;
      for (int rep = 0; rep < 5; ++rep) { double t0 = now(); sink += step(mode); double dt = now() - t0; if (dt < best) best = dt; }
      printf("round %d  %-40s %7.2f ms  (%g)\n", round, names[mode], best * 1e3, sink);
    }
  return 0;
}
