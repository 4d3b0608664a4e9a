// AVX-512 helpers shared by the kernels, in two tiers:
//   always: to_float, a float32 or bfloat16 value as float32; is_nan from the bits; requests for the cache lines
//   of a span of bytes (request_line, request_bytes);
//   CONVEYOR_VEC_AVX512 (AVX-512 F/BW/VL): masked loads of 16 bfloat16 or float32 as 16 float32;
//   CONVEYOR_VEC_BF16 (also AVX512_BF16): rounding back to bfloat16, a vector exp and 2^x, a 16 x 16 transpose
//   of 32-bit values.
// Rounding to bfloat16 is round-to-nearest-even (vcvtneps2bf16), as torch rounds.
#pragma once

#include "scalar_types.h"

#include <cstdint>
#include <cstring>

namespace conveyor_vec {

inline float to_float(float v) { return v; }
inline float to_float(conveyor::BFloat16 v) { return static_cast<float>(v); }

// Whether v is a NaN, from its bits: one test that holds whatever flags the kernels are compiled with.
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// What a request asks of the cache line it names: to be read soon (into L1: PREFETCHT0; into L2: PREFETCHT1) or
// written soon (PREFETCHW: the line is read, if need be, and held for writing, so that the store does not wait).
enum class Request { kReadL1, kReadL2, kWrite };

// The cache line holding p requested. An asm statement, not _mm_prefetch: GCC 12 can delete a loop of
// _mm_prefetch / __builtin_prefetch calls over a length known only at run time, as code without effects (it did
// so with gguf_linear.cpp's and prefill attention's K/V row requests; check the object code for PREFETCH after
// changing a caller).
template <Request kHow>
inline void request_line(const void* p) {
#if defined(__x86_64__)
  const char& line = *static_cast<const char*>(p);
  if constexpr (kHow == Request::kReadL1) {
    asm volatile("prefetcht0 %0" : : "m"(line));
  } else if constexpr (kHow == Request::kReadL2) {
    asm volatile("prefetcht1 %0" : : "m"(line));
  } else {
#if defined(__PRFCHW__)  // the build's CPU has PREFETCHW (-march=native); else a read request does
    asm volatile("prefetchw %0" : : "m"(line));
#else
    asm volatile("prefetcht0 %0" : : "m"(line));
#endif
  }
#else
  (void)p;
#endif
}

// The lines of the `bytes` at p (p on a line, or the last partial line not included) requested, one each (for a
// length known when compiling, the overload below).
template <Request kHow>
inline void request_bytes(const void* p, int64_t bytes) {
  const char* line = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) request_line<kHow>(line + offset);
}

}  // namespace conveyor_vec

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define CONVEYOR_VEC_AVX512 1

namespace conveyor_vec {

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Up to 16 bfloat16 (masked) -> float32: the bits shifted into the high half.
inline __m512 load_bf16(const conveyor::BFloat16* p, __mmask16 mask = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 values from p (lanes outside `lanes` are not read, and are zero) as float32, for kernels templated on
// the logits' or activations' type.
inline __m512 load16(const float* p, __mmask16 lanes = 0xFFFF) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load16(const conveyor::BFloat16* p, __mmask16 lanes = 0xFFFF) { return load_bf16(p, lanes); }

// request_bytes for a span whose length is known when compiling (a row of a fixed head_dim): _mm_prefetch calls,
// which GCC unrolls and keeps, and schedules with the code around them (the asm form, opaque to the scheduler,
// slows a tight FMA loop such as the float32 product's).
template <Request kHow, int64_t kBytes>
inline void request_bytes(const void* p) {
  constexpr _mm_hint kHint = kHow == Request::kReadL1 ? _MM_HINT_T0 : kHow == Request::kReadL2 ? _MM_HINT_T1
                                                                                                : _MM_HINT_ET0;
  const char* line = static_cast<const char*>(p);
#pragma GCC unroll 64
  for (int64_t offset = 0; offset < kBytes; offset += 64) _mm_prefetch(line + offset, kHint);
}

}  // namespace conveyor_vec

#if defined(__AVX512BF16__)
#define CONVEYOR_VEC_BF16 1


namespace conveyor_vec {

// float32 -> bfloat16 bits, round to nearest even.
inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }

// float32 rounded to bfloat16 and back (the value a bfloat16 tensor would hold).
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

inline void store_bf16(conveyor::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(reinterpret_cast<void*>(p), mask, to_bf16(v));
}

// e^x for 16 float32 in registers, inline (libmvec's expf is a call per 16 values, and takes a scalar path per
// lane for arguments that underflow): x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (the
// Cephes coefficients of expf), 2^n applied by vscalefps, which also gives 0 and inf past float32's range.
// Arguments are clamped to [-104, 89] first (e^x is 0 or inf there in float32), so r stays small. Relative
// error ~2 ulp of float32, far below the bfloat16 rounding every caller applies.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));  // 1 + r + r^2 p(r)
  return _mm512_scalef_ps(p, n);
}

// 2^t for 16 float32 in registers with t in [-126, 0] (callers clamp): 2^round(t) by vscalefps times 2^f, |f| <= 1/2,
// by its Taylor series to degree 6 (relative error ~1e-7, an ulp of float32). Nine instructions against exp_ps's
// fifteen: for a softmax whose arguments the caller already scaled by log2(e) in the FMA that subtracts the max.
inline __m512 exp2_ps(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);  // ln(2)^k / k!, k = 6 .. 1
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// A 16 x 16 tile of 32-bit values (float32, or pairs of bfloat16 as floats) in 16 registers, rows -> columns:
// r[i][j] becomes r[j][i].
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// silu(gate) * up for 16 values that bfloat16 tensors hold, with transformers' roundings: silu(gate) rounded to
// bfloat16 before it multiplies up (the product is rounded by whoever stores it). exp's argument is capped so
// that it stays finite: an infinite denominator (or a reciprocal estimate of one) would turn the quotient into
// NaN (silu(-100) is -0 either way). One definition for the activation op and the product that fuses it.
inline __m512 silu_times_bf16(__m512 gate, __m512 up) {
  const __m512 e = exp_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate), _mm512_set1_ps(80.f)));
  const __m512 act = round_bf16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return _mm512_mul_ps(act, up);
}

}  // namespace conveyor_vec
#endif
#endif
