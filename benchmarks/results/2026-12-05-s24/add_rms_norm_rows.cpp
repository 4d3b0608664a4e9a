// add_rms_norm at a decode step's shape (64 x 576 bf16): today's row kernel against four rows interleaved
// (each row's arithmetic in the same order: the same bits).
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>
typedef uint16_t bf16;
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }
inline __m512 load_bf16(const bf16* p, __mmask16 m = 0xFFFF) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16)); }
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16)); }
inline void store_bf16(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }

void row_today(bf16* h, const bf16* delta, const bf16* weight, bf16* out, int64_t dim, float eps) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    __m512 x = load_bf16(h + i, m);
    if (delta != nullptr) { x = round_bf16(_mm512_add_ps(x, load_bf16(delta + i, m))); store_bf16(h + i, x, m); }
    sum = _mm512_fmadd_ps(x, x, sum);
  }
  const float inv_rms = 1.f / std::sqrt(_mm512_reduce_add_ps(sum) / (float)dim + eps);
  const __m512 inv = _mm512_set1_ps(inv_rms);
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(h + i, m), inv));
    store_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i, m), normed), m);
  }
}
template <int R>
void rows_interleaved(bf16* h, const bf16* delta, const bf16* weight, bf16* out, int64_t dim, float eps) {
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    for (int r = 0; r < R; ++r) {
      __m512 x = load_bf16(h + r * dim + i, m);
      if (delta != nullptr) { x = round_bf16(_mm512_add_ps(x, load_bf16(delta + r * dim + i, m))); store_bf16(h + r * dim + i, x, m); }
      sum[r] = _mm512_fmadd_ps(x, x, sum[r]);
    }
  }
  __m512 inv[R];
  for (int r = 0; r < R; ++r) inv[r] = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sum[r]) / (float)dim + eps));
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    const __m512 w = load_bf16(weight + i, m);
    for (int r = 0; r < R; ++r) {
      const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(h + r * dim + i, m), inv[r]));
      store_bf16(out + r * dim + i, _mm512_mul_ps(w, normed), m);
    }
  }
}
int main() {
  const int L = 30, rows = 64, dim = 576;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  auto tob = [](float f) { uint32_t u; memcpy(&u, &f, 4); return (bf16)((u + 0x7FFF + ((u >> 16) & 1)) >> 16); };
  std::vector<std::vector<bf16>> H(L), D(L), O(L), H2(L), O2(L); std::vector<bf16> W(dim);
  for (auto& x : W) x = tob(nd(rng));
  for (int l = 0; l < L; ++l) { H[l].resize(rows * dim); D[l].resize(rows * dim); O[l].resize(rows * dim); O2[l].resize(rows * dim); for (auto& x : H[l]) x = tob(nd(rng)); for (auto& x : D[l]) x = tob(nd(rng)); H2[l] = H[l]; }
  auto a = [&](int l) { for (int r = 0; r < rows; ++r) row_today(H[l].data() + r * dim, D[l].data() + r * dim, W.data(), O[l].data() + r * dim, dim, 1e-5f); };
  auto b = [&](int l) { for (int r = 0; r < rows; r += 4) rows_interleaved<4>(H2[l].data() + r * dim, D[l].data() + r * dim, W.data(), O2[l].data() + r * dim, dim, 1e-5f); };
  for (int l = 0; l < L; ++l) { a(l); b(l); }
  bool same = true; for (int l = 0; l < L; ++l) same &= (O[l] == O2[l]) && (H[l] == H2[l]);
  printf("same bits: %d\n", (int)same);
  std::vector<double> ta, tb;
  for (int rep = 0; rep < 40; ++rep) {
    auto t0 = std::chrono::steady_clock::now(); for (int l = 0; l < L; ++l) a(l);
    auto t1 = std::chrono::steady_clock::now(); for (int l = 0; l < L; ++l) b(l);
    auto t2 = std::chrono::steady_clock::now();
    ta.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / L); tb.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count() / L);
  }
  std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end());
  printf("per call: today %.2f us, four rows interleaved %.2f us\n", ta[20], tb[20]);
}
