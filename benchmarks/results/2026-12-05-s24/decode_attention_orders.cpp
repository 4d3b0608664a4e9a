// Session s24: the decode attention kernel's memory order against others, in a standalone harness (no torch).
//
//   g++ -O2 -march=native -fopenmp -ffast-math decode_attention_orders.cpp -o /tmp/da
//   OMP_NUM_THREADS=2 /tmp/da [seqs 64] [context 210] [tokens ahead 16]
//
// W1's shape (default model: 30 layers, 64 sequences, 3 KV heads x 64, groups of 3 query heads, 16-token blocks
// in a random order), caches on transparent huge pages as the engine's are (madvise; without it every variant
// ran ~1.7x slower: 28.8 against 17.0 ms for "current"). Every variant computes each (sequence, KV head) with
// the same arithmetic in the same order as csrc/decode_attention.cpp's attend_item_bf16_64<3> (checked: "same
// bits"); only the order of memory reads and the requests ahead differ:
//   current       the kernel's order: item (sequence, KV head); pass 1 reads K rows, requesting K 16 tokens ahead
//                 (L1) and V (L2); pass 2 reads V, requesting the next item's K (L2);
//   blocks K->L2 / K->L1   per sequence, pass 1 block by block, every KV head's rows of a block in turn, the next
//                 block's K and this block's V requested whole; pass 2 head by head, the next sequence's K
//                 requested meanwhile;
//   rows4 ...     per sequence, pass 1 four tokens at a time over every head (whole token rows), rows requested
//                 whole 16 tokens ahead (K to L1 or L2, V to L2 or not);
//   pairs         two items (two sequences, one KV head) interleaved token by token in both passes.
// Prints medians of 15 alternating rounds (ms for the 30 layers) and the threads' mean gap per layer.
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <chrono>
#include <sys/mman.h>
template <typename T> struct Huge { typedef T value_type; Huge() = default; template <typename U> Huge(const Huge<U>&) {} T* allocate(size_t n) { size_t b = (n * sizeof(T) + (2u<<20) - 1) & ~size_t((2u<<20) - 1); void* p = aligned_alloc(2u << 20, b); madvise(p, b, MADV_HUGEPAGE); return (T*)p; } void deallocate(T* p, size_t) { free(p); } template <typename U> bool operator==(const Huge<U>&) const { return true; } template <typename U> bool operator!=(const Huge<U>&) const { return false; } };
typedef uint16_t bf16;
constexpr int D = 64, G = 3, KH = 3, BS = 16;
static int SEQS = 64, CTX = 210, LAYERS = 30, AHEAD = 16;

inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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
float softmax_numerators(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(mx);
  for (; t < n; ++t) m = std::max(m, s[t]);
  __m512 sum = _mm512_setzero_ps();
  t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; t < n; ++t) { s[t] = std::exp(s[t] - m); total += s[t]; }
  return total;
}
inline void split_row(const bf16* row, __m512 (&parts)[4]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i lo = _mm512_loadu_si512(row), hi = _mm512_loadu_si512(row + 32);
  parts[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
  parts[1] = _mm512_castsi512_ps(_mm512_and_si512(lo, high));
  parts[2] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
  parts[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, high));
}
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
inline __m512 dot_parts(const __m512 (&qv)[G][4], const __m512 (&kv)[4], int g) {
  __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
  acc = _mm512_fmadd_ps(qv[g][1], kv[1], acc);
  acc = _mm512_fmadd_ps(qv[g][2], kv[2], acc);
  return _mm512_fmadd_ps(qv[g][3], kv[3], acc);
}
inline void pf(const void* p, int hint) {
  const char* c = (const char*)p;
  if (hint == 0) { _mm_prefetch(c, _MM_HINT_T0); _mm_prefetch(c + 64, _MM_HINT_T0); }
  else { _mm_prefetch(c, _MM_HINT_T1); _mm_prefetch(c + 64, _MM_HINT_T1); }
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
const __m512i kInterleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);

struct Seq { const int64_t* table; int64_t ctx; };
inline int64_t slot(const Seq& s, int64_t t) { return s.table[t / BS] * BS + t % BS; }
constexpr int64_t STRIDE = KH * D;

// q of item: G rows of D at q (contiguous)
void load_q(const bf16* q, float scale, __m512 (&qv)[G][4]) {
  for (int g = 0; g < G; ++g) { split_row(q + g * D, qv[g]); for (int j = 0; j < 4; ++j) qv[g][j] = _mm512_mul_ps(qv[g][j], _mm512_set1_ps(scale)); }
}
void finish(const __m512 (&acc)[G][4], const float* inv_sum, bf16* out) {
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_sum[g]);
    for (int h = 0; h < 2; ++h) {
      const __m512i even = _mm512_castsi256_si512(to_bf16(_mm512_mul_ps(acc[g][2 * h], inv)));
      const __m512i odd = _mm512_castsi256_si512(to_bf16(_mm512_mul_ps(acc[g][2 * h + 1], inv)));
      _mm512_storeu_si512(out + g * D + 32 * h, _mm512_permutex2var_epi16(even, kInterleave, odd));
    }
  }
}
// pass 2 for one head over V rows base (already offset by head), scores [G][ctx]
template <typename Req>
void pass2(const Seq& s, const bf16* vb, const float* scores, const float* inv, bf16* out, Req req, bool pf_ahead) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g) for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t u = 0; u < s.ctx; ++u) {
    req(u);
    if (pf_ahead && u + AHEAD < s.ctx) pf(vb + slot(s, u + AHEAD) * STRIDE, 0);
    __m512 vv[4];
    split_row(vb + slot(s, u) * STRIDE, vv);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * s.ctx + u]);
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
    }
  }
  finish(acc, inv, out);
}
// pass 1 of one head over tokens [t0, t1) (multiple of 4 except at the end) into scores [G][ctx]
inline void pass1_range(const Seq& s, const bf16* kb, const __m512 (&qv)[G][4], float* scores, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    __m512 part[4][G];
    for (int u = 0; u < 4; ++u) { __m512 kv[4]; split_row(kb + slot(s, t + u) * STRIDE, kv); for (int g = 0; g < G; ++g) part[u][g] = dot_parts(qv, kv, g); }
    for (int g = 0; g < G; ++g) _mm_storeu_ps(scores + g * s.ctx + t, sum4(part[0][g], part[1][g], part[2][g], part[3][g]));
  }
  for (; t < t1; ++t) { __m512 kv[4]; split_row(kb + slot(s, t) * STRIDE, kv); for (int g = 0; g < G; ++g) scores[g * s.ctx + t] = _mm512_reduce_add_ps(dot_parts(qv, kv, g)); }
}

// Today's order: item = (seq, head); pass 1 K rows with K AHEAD to L1 and V to L2, pass 2 V with next item's K to L2.
void attend_current(const Seq* seqs, int64_t s_begin, int64_t s_end, const bf16* q, const bf16* K, const bf16* V, bf16* out, float scale, std::vector<float>& scores) {
  for (int64_t si = s_begin; si < s_end; ++si) for (int h = 0; h < KH; ++h) {
    const Seq& s = seqs[si];
    __m512 qv[G][4];
    load_q(q + (si * KH + h) * G * D, scale, qv);
    scores.resize(G * s.ctx);
    const bf16* kb = K + h * D; const bf16* vb = V + h * D;
    int64_t t = 0;
    for (; t + 4 <= s.ctx; t += 4) {
      __m512 part[4][G];
      for (int u = 0; u < 4; ++u) {
        if (t + u + AHEAD < s.ctx) { const int64_t a = slot(s, t + u + AHEAD) * STRIDE; pf(kb + a, 0); pf(vb + a, 1); }
        __m512 kv[4]; split_row(kb + slot(s, t + u) * STRIDE, kv); for (int g = 0; g < G; ++g) part[u][g] = dot_parts(qv, kv, g);
      }
      for (int g = 0; g < G; ++g) _mm_storeu_ps(scores.data() + g * s.ctx + t, sum4(part[0][g], part[1][g], part[2][g], part[3][g]));
    }
    for (; t < s.ctx; ++t) { if (t + AHEAD < s.ctx) { const int64_t a = slot(s, t + AHEAD) * STRIDE; pf(kb + a, 0); pf(vb + a, 1); } __m512 kv[4]; split_row(kb + slot(s, t) * STRIDE, kv); for (int g = 0; g < G; ++g) scores[g * s.ctx + t] = _mm512_reduce_add_ps(dot_parts(qv, kv, g)); }
    float inv[G];
    for (int g = 0; g < G; ++g) inv[g] = 1.f / softmax_numerators(scores.data() + g * s.ctx, s.ctx);
    // next item
    const bool has_next = !(si + 1 == s_end && h == KH - 1);
    const Seq& ns = h == KH - 1 ? seqs[std::min(si + 1, s_end - 1)] : s;
    const bf16* nk = K + ((h + 1) % KH) * D;
    const int64_t next_ctx = has_next ? ns.ctx : 0, per = (next_ctx + s.ctx - 1) / s.ctx;
    int64_t requested = 0;
    auto req = [&](int64_t) { for (int64_t r = 0; r < per && requested < next_ctx; ++r, ++requested) pf(nk + slot(ns, requested) * STRIDE, 1); };
    pass2(s, vb, scores.data(), inv, out + (si * KH + h) * G * D, req, true);
  }
}

// Block-major: per sequence, pass 1 block by block (every head's rows of a block, the next block's K and this
// block's V requested whole), then pass 2 head by head from L2, the next sequence's first K blocks requested.
template <int KHINT>
void attend_blocks(const Seq* seqs, int64_t s_begin, int64_t s_end, const bf16* q, const bf16* K, const bf16* V, bf16* out, float scale, std::vector<float>& scores) {
  constexpr int64_t kBlockBytes = BS * STRIDE * 2;
  for (int64_t si = s_begin; si < s_end; ++si) {
    const Seq& s = seqs[si];
    __m512 qv[KH][G][4];
    for (int h = 0; h < KH; ++h) load_q(q + (si * KH + h) * G * D, scale, qv[h]);
    scores.resize(KH * G * s.ctx);
    const int64_t nblocks = (s.ctx + BS - 1) / BS;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t t0 = b * BS, t1 = std::min(s.ctx, t0 + BS);
      // request: next block's K (to L1/L2), this block's V (to L2)
      if (b + 1 < nblocks) { const char* nk = (const char*)(K + s.table[b + 1] * BS * STRIDE); for (int64_t l = 0; l < kBlockBytes; l += 64) _mm_prefetch(nk + l, KHINT == 0 ? _MM_HINT_T0 : _MM_HINT_T1); }
      { const char* v = (const char*)(V + s.table[b] * BS * STRIDE); for (int64_t l = 0; l < kBlockBytes; l += 64) _mm_prefetch(v + l, _MM_HINT_T1); }
      for (int h = 0; h < KH; ++h) pass1_range(s, K + h * D, qv[h], scores.data() + h * G * s.ctx, t0, t1);
    }
    for (int h = 0; h < KH; ++h) {
      float* sc = scores.data() + h * G * s.ctx;
      float inv[G];
      for (int g = 0; g < G; ++g) inv[g] = 1.f / softmax_numerators(sc + g * s.ctx, s.ctx);
      // next sequence's K, block by block spread over pass 2 of the 3 heads
      const bool has_next = si + 1 < s_end;
      const Seq& ns = seqs[std::min(si + 1, s_end - 1)];
      const int64_t nlines = has_next ? ((ns.ctx + BS - 1) / BS) * (kBlockBytes / 64) : 0;
      const int64_t first = nlines * h / KH, last = nlines * (h + 1) / KH;
      int64_t req_i = first;
      const int64_t per = (last - first + s.ctx - 1) / std::max<int64_t>(1, s.ctx);
      auto req = [&](int64_t) {
        for (int64_t r = 0; r < per && req_i < last; ++r, ++req_i) {
          const int64_t blk = req_i / (kBlockBytes / 64), line = req_i % (kBlockBytes / 64);
          _mm_prefetch((const char*)(K + ns.table[blk] * BS * STRIDE) + line * 64, _MM_HINT_T1);
        }
      };
      pass2(s, V + h * D, sc, inv, out + (si * KH + h) * G * D, req, false);
    }
  }
}

// Rows by four: per sequence, pass 1 four tokens at a time over every head (whole token rows), the rows
// AHEAD tokens on requested whole (K to L1, V to L2); pass 2 head by head from L2.
template <int KHINT, bool VREQ>
void attend_rows4(const Seq* seqs, int64_t s_begin, int64_t s_end, const bf16* q, const bf16* K, const bf16* V, bf16* out, float scale, std::vector<float>& scores) {
  for (int64_t si = s_begin; si < s_end; ++si) {
    const Seq& s = seqs[si];
    alignas(64) __m512 qv[KH][G][4];
    for (int h = 0; h < KH; ++h) load_q(q + (si * KH + h) * G * D, scale, qv[h]);
    scores.resize(KH * G * s.ctx);
    int64_t t = 0;
    auto request = [&](int64_t u) {
      if (u < s.ctx) {
        const int64_t a = slot(s, u) * STRIDE;
        const char* k = (const char*)(K + a); const char* v = (const char*)(V + a);
        for (int l = 0; l < STRIDE * 2; l += 64) { _mm_prefetch(k + l, KHINT == 0 ? _MM_HINT_T0 : _MM_HINT_T1); if (VREQ) _mm_prefetch(v + l, _MM_HINT_T1); }
      }
    };
    for (; t + 4 <= s.ctx; t += 4) {
      for (int u = 0; u < 4; ++u) request(t + u + AHEAD);
      for (int h = 0; h < KH; ++h) {
        const bf16* kb = K + h * D;
        __m512 part[4][G];
        for (int u = 0; u < 4; ++u) { __m512 kv[4]; split_row(kb + slot(s, t + u) * STRIDE, kv); for (int g = 0; g < G; ++g) part[u][g] = dot_parts(qv[h], kv, g); }
        float* sc = scores.data() + h * G * s.ctx;
        for (int g = 0; g < G; ++g) _mm_storeu_ps(sc + g * s.ctx + t, sum4(part[0][g], part[1][g], part[2][g], part[3][g]));
      }
    }
    for (; t < s.ctx; ++t) { request(t + AHEAD); for (int h = 0; h < KH; ++h) pass1_range(s, K + h * D, qv[h], scores.data() + h * G * s.ctx, t, t + 1); }
    for (int h = 0; h < KH; ++h) {
      float* sc = scores.data() + h * G * s.ctx;
      float inv[G];
      for (int g = 0; g < G; ++g) inv[g] = 1.f / softmax_numerators(sc + g * s.ctx, s.ctx);
      const bool has_next = si + 1 < s_end;
      const Seq& ns = seqs[std::min(si + 1, s_end - 1)];
      // the next sequence's first AHEAD rows of K, during the last head's pass 2
      int64_t req_i = 0;
      const int64_t want = (has_next && h == KH - 1) ? std::min<int64_t>(AHEAD, ns.ctx) : 0;
      auto req = [&](int64_t u) {
        if (req_i < want && u % 4 == 0) {
          const char* k = (const char*)(K + slot(ns, req_i) * STRIDE);
          for (int l = 0; l < STRIDE * 2; l += 64) _mm_prefetch(k + l, _MM_HINT_T1);
          ++req_i;
        }
      };
      pass2(s, V + h * D, sc, inv, out + (si * KH + h) * G * D, req, !VREQ);
    }
  }
}

// Two items at once: (seq a, head h) and (seq b, head h) interleaved token by token in both passes (two
// independent row streams in flight), each with today's requests; an odd one out runs alone.
void attend_pairs(const Seq* seqs, int64_t s_begin, int64_t s_end, const bf16* q, const bf16* K, const bf16* V, bf16* out, float scale, std::vector<float>& scores) {
  std::vector<float> scores2;
  int64_t si = s_begin;
  for (; si + 2 <= s_end; si += 2) for (int h = 0; h < KH; ++h) {
    const Seq& sa = seqs[si]; const Seq& sb = seqs[si + 1];
    __m512 qa[G][4], qb[G][4];
    load_q(q + (si * KH + h) * G * D, scale, qa);
    load_q(q + ((si + 1) * KH + h) * G * D, scale, qb);
    scores.resize(G * sa.ctx); scores2.resize(G * sb.ctx);
    const bf16* kb = K + h * D; const bf16* vb = V + h * D;
    const int64_t common = std::min(sa.ctx, sb.ctx) / 4 * 4;
    for (int64_t t = 0; t < common; t += 4) {
      __m512 pa[4][G], pb[4][G];
      for (int u = 0; u < 4; ++u) {
        if (t + u + AHEAD < sa.ctx) { const int64_t a = slot(sa, t + u + AHEAD) * STRIDE; pf(kb + a, 0); pf(vb + a, 1); }
        if (t + u + AHEAD < sb.ctx) { const int64_t a = slot(sb, t + u + AHEAD) * STRIDE; pf(kb + a, 0); pf(vb + a, 1); }
        __m512 kv[4];
        split_row(kb + slot(sa, t + u) * STRIDE, kv); for (int g = 0; g < G; ++g) pa[u][g] = dot_parts(qa, kv, g);
        split_row(kb + slot(sb, t + u) * STRIDE, kv); for (int g = 0; g < G; ++g) pb[u][g] = dot_parts(qb, kv, g);
      }
      for (int g = 0; g < G; ++g) _mm_storeu_ps(scores.data() + g * sa.ctx + t, sum4(pa[0][g], pa[1][g], pa[2][g], pa[3][g]));
      for (int g = 0; g < G; ++g) _mm_storeu_ps(scores2.data() + g * sb.ctx + t, sum4(pb[0][g], pb[1][g], pb[2][g], pb[3][g]));
    }
    pass1_range(sa, kb, qa, scores.data(), common, sa.ctx);
    pass1_range(sb, kb, qb, scores2.data(), common, sb.ctx);
    float ia[G], ib[G];
    for (int g = 0; g < G; ++g) { ia[g] = 1.f / softmax_numerators(scores.data() + g * sa.ctx, sa.ctx); ib[g] = 1.f / softmax_numerators(scores2.data() + g * sb.ctx, sb.ctx); }
    // pass 2 both, interleaved; next pair's K requested (to L2)
    const bool has_next = si + 3 < s_end || h + 1 < KH;
    const Seq& na = h + 1 < KH ? sa : seqs[std::min(si + 2, s_end - 1)];
    const Seq& nb2 = h + 1 < KH ? sb : seqs[std::min(si + 3, s_end - 1)];
    const bf16* nk = K + ((h + 1) % KH) * D;
    __m512 aa[G][4], ab[G][4];
    for (int g = 0; g < G; ++g) for (int j = 0; j < 4; ++j) { aa[g][j] = _mm512_setzero_ps(); ab[g][j] = _mm512_setzero_ps(); }
    const int64_t n2 = std::max(sa.ctx, sb.ctx);
    int64_t ra = 0, rb = 0;
    const int64_t wa = has_next ? na.ctx : 0, wb = has_next ? nb2.ctx : 0;
    for (int64_t u = 0; u < n2; ++u) {
      if (ra < wa) { pf(nk + slot(na, ra) * STRIDE, 1); ++ra; }
      if (rb < wb) { pf(nk + slot(nb2, rb) * STRIDE, 1); ++rb; }
      __m512 vv[4];
      if (u < sa.ctx) { split_row(vb + slot(sa, u) * STRIDE, vv); for (int g = 0; g < G; ++g) { const __m512 p = _mm512_set1_ps(scores[g * sa.ctx + u]); for (int j = 0; j < 4; ++j) aa[g][j] = _mm512_fmadd_ps(p, vv[j], aa[g][j]); } }
      if (u < sb.ctx) { split_row(vb + slot(sb, u) * STRIDE, vv); for (int g = 0; g < G; ++g) { const __m512 p = _mm512_set1_ps(scores2[g * sb.ctx + u]); for (int j = 0; j < 4; ++j) ab[g][j] = _mm512_fmadd_ps(p, vv[j], ab[g][j]); } }
    }
    finish(aa, ia, out + (si * KH + h) * G * D);
    finish(ab, ib, out + ((si + 1) * KH + h) * G * D);
  }
  if (si < s_end) attend_current(seqs, si, s_end, q, K, V, out, scale, scores);
}

int main(int argc, char** argv) {
  if (argc > 1) SEQS = atoi(argv[1]);
  if (argc > 2) CTX = atoi(argv[2]);
  if (argc > 3) AHEAD = atoi(argv[3]);
  const int64_t bps = (CTX + BS - 1) / BS, nb = SEQS * bps + 8;
  std::mt19937 rng(1);
  std::vector<std::vector<bf16, Huge<bf16>>> Ks(LAYERS), Vs(LAYERS);
  std::normal_distribution<float> nd;
  auto tob = [](float f) { uint32_t u; memcpy(&u, &f, 4); return (bf16)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); };
  for (int l = 0; l < LAYERS; ++l) { Ks[l].resize(nb * BS * STRIDE); Vs[l].resize(nb * BS * STRIDE); for (auto& x : Ks[l]) x = tob(nd(rng)); for (auto& x : Vs[l]) x = tob(nd(rng)); }
  std::vector<int64_t> perm(nb); for (int64_t i = 0; i < nb; ++i) perm[i] = i; std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> table(SEQS * bps); for (int64_t i = 0; i < SEQS * bps; ++i) table[i] = perm[i];
  std::vector<Seq> seqs(SEQS); for (int i = 0; i < SEQS; ++i) seqs[i] = {table.data() + i * bps, CTX};
  std::vector<bf16> q(SEQS * KH * G * D); for (auto& x : q) x = tob(nd(rng));
  std::vector<bf16> out_a(q.size()), out_b(q.size()), out_c(q.size()), out_d(q.size()), out_e(q.size()), out_f(q.size()), out_g(q.size());
  const float scale = 0.125f;
  double gap_total = 0, busy_total = 0;
  auto run = [&](int which, std::vector<bf16>& out) {
    for (int l = 0; l < LAYERS; ++l) {
      double th[2] = {0, 0};
#pragma omp parallel
      {
        auto s0 = std::chrono::steady_clock::now();
        thread_local std::vector<float> scores;
        const int T = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t b = SEQS * i / T, e = SEQS * (i + 1) / T;
        if (which == 0) attend_current(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        else if (which == 1) attend_blocks<1>(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        else if (which == 3) attend_rows4<0, true>(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        else if (which == 4) attend_rows4<1, true>(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        else if (which == 5) attend_rows4<0, false>(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        else if (which == 6) attend_pairs(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        else attend_blocks<0>(seqs.data(), b, e, q.data(), Ks[l].data(), Vs[l].data(), out.data(), scale, scores);
        th[omp_get_thread_num() & 1] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
      }
      if (which == 0) { gap_total += std::fabs(th[0] - th[1]); busy_total += std::max(th[0], th[1]); }
    }
  };
  std::vector<bf16>* outs[] = {&out_a, &out_b, &out_c, &out_d, &out_e, &out_f, &out_g};
  for (int w = 0; w < 7; ++w) run(w, *outs[w]);
  for (int w = 1; w < 7; ++w) printf("same bits %d: %d\n", w, (int)(out_a == *outs[w]));
  const char* names[] = {"current", "blocks K->L2", "blocks K->L1", "rows4 K0 V", "rows4 K1 V", "rows4 K0 noV", "pairs"};
  std::vector<std::vector<double>> all(7);
  for (int rep = 0; rep < 15; ++rep) for (int w = 0; w < 7; ++w) {
    auto t0 = std::chrono::steady_clock::now();
    run(w, *outs[w]);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    all[w].push_back(ms);
  }
  printf("current: per layer max thread %.3f ms, mean |gap| %.3f ms\n", busy_total / (16.0 * LAYERS), gap_total / (16.0 * LAYERS));
  for (int w = 0; w < 7; ++w) { std::sort(all[w].begin(), all[w].end()); printf("%-14s median %.2f ms  min %.2f\n", names[w], all[w][7], all[w][0]); }
}
