// Plain C++ stand-ins for the tensor element types the kernels read and write, and the error the kernels raise.
// No torch header is included by any kernel source: only bindings.cpp sees torch, and it hands the kernels raw
// pointers (a torch bfloat16 tensor's data is an array of conveyor::BFloat16, bit for bit).
//
//   BFloat16  16 bits: float32's sign, exponent and top 7 mantissa bits. float -> bfloat16 rounds to nearest
//             even and turns every NaN into 0x7FC0, exactly as conveyor::BFloat16 does; bfloat16 -> float is exact.
//   Half      IEEE binary16. float -> half rounds to nearest even (F16C's vcvtps2ph where the build has it, the
//             same bits in software otherwise), as conveyor::Half does; half -> float is exact.
//   DType     the element type of a kernel's operands, chosen by the caller (bindings.cpp) from the tensor's.
//
// Arithmetic on two BFloat16 (or two Half) computes in float32 and rounds back, as c10's operators do; mixed with
// a float it stays float32.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace conveyor {

inline uint32_t float_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

struct BFloat16 {
  uint16_t x;

  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return from_bits_t(); }

  BFloat16() = default;
  constexpr BFloat16(uint16_t bits, from_bits_t) : x(bits) {}
  BFloat16(float value) : x(round_to_nearest_even(value)) {}  // NOLINT: implicit, as conveyor::BFloat16
  operator float() const { return bits_float(static_cast<uint32_t>(x) << 16); }  // NOLINT

  static uint16_t round_to_nearest_even(float value) {
    const uint32_t u = float_bits(value);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN, tested on the bits
    const uint32_t rounding_bias = ((u >> 16) & 1) + 0x7FFFu;
    return static_cast<uint16_t>((u + rounding_bias) >> 16);
  }
};

struct Half {
  uint16_t x;

  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return from_bits_t(); }

  Half() = default;
  constexpr Half(uint16_t bits, from_bits_t) : x(bits) {}
  Half(float value) : x(from_float(value)) {}  // NOLINT: implicit, as conveyor::Half
  operator float() const { return to_float(x); }  // NOLINT

  static uint16_t from_float(float f) {
#if defined(__F16C__)
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else  // FP16's fp16_ieee_from_fp32_value (conveyor::Half's software path)
    const float scale_to_inf = bits_float(UINT32_C(239) << 23), scale_to_zero = bits_float(UINT32_C(17) << 23);
    float base = ((f < 0 ? -f : f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = float_bits(f), shl1_w = w + w, sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = bits_float((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = float_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00), mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
#endif
  }

  static float to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else  // FP16's fp16_ieee_to_fp32_value
    const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & UINT32_C(0x80000000), two_w = w + w;
    const uint32_t exp_offset = UINT32_C(0xE0) << 23;
    const float normalized = bits_float((two_w >> 4) + exp_offset) * bits_float(UINT32_C(0x7800000));
    const uint32_t magic_mask = UINT32_C(126) << 23;
    const float denormalized = bits_float((two_w >> 17) | magic_mask) - 0.5f;
    const uint32_t result = sign | (two_w < (UINT32_C(1) << 27) ? float_bits(denormalized) : float_bits(normalized));
    return bits_float(result);
#endif
  }
};

#define CONVEYOR_LOW_PRECISION_OPS(T)                                                         \
  inline T operator+(T a, T b) { return static_cast<float>(a) + static_cast<float>(b); }      \
  inline T operator-(T a, T b) { return static_cast<float>(a) - static_cast<float>(b); }      \
  inline T operator*(T a, T b) { return static_cast<float>(a) * static_cast<float>(b); }      \
  inline T operator/(T a, T b) { return static_cast<float>(a) / static_cast<float>(b); }      \
  inline float operator+(T a, float b) { return static_cast<float>(a) + b; }                  \
  inline float operator-(T a, float b) { return static_cast<float>(a) - b; }                  \
  inline float operator*(T a, float b) { return static_cast<float>(a) * b; }                  \
  inline float operator/(T a, float b) { return static_cast<float>(a) / b; }                  \
  inline float operator+(float a, T b) { return a + static_cast<float>(b); }                  \
  inline float operator-(float a, T b) { return a - static_cast<float>(b); }                  \
  inline float operator*(float a, T b) { return a * static_cast<float>(b); }                  \
  inline float operator/(float a, T b) { return a / static_cast<float>(b); }                  \
  inline double operator+(T a, double b) { return static_cast<double>(static_cast<float>(a)) + b; } \
  inline double operator*(T a, double b) { return static_cast<double>(static_cast<float>(a)) * b; } \
  inline double operator+(double a, T b) { return a + static_cast<double>(static_cast<float>(b)); } \
  inline double operator*(double a, T b) { return a * static_cast<double>(static_cast<float>(b)); }

CONVEYOR_LOW_PRECISION_OPS(BFloat16)
CONVEYOR_LOW_PRECISION_OPS(Half)
#undef CONVEYOR_LOW_PRECISION_OPS

static_assert(sizeof(BFloat16) == 2 && sizeof(Half) == 2, "the element types are their 16 bits");

// The element type of a floating-point operand (bindings.cpp maps torch's dtypes onto it).
enum class DType : int { kDouble, kFloat, kBFloat16, kHalf };

// Calls f(T{}) with T the C++ type of `dtype` (the kernels' AT_DISPATCH_FLOATING_TYPES_AND2).
template <typename F>
void dispatch_floating(DType dtype, const F& f) {
  switch (dtype) {
    case DType::kDouble: f(double{}); break;
    case DType::kFloat: f(float{}); break;
    case DType::kBFloat16: f(BFloat16{}); break;
    case DType::kHalf: f(Half{}); break;
  }
}

// The message of a failed check, its parts streamed in order (as TORCH_CHECK's).
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace conveyor

// A kernel's check of its inputs' values (not their shapes: bindings.cpp checks those): raises std::runtime_error
// (Python's RuntimeError, as TORCH_CHECK's c10::Error is) with the message's parts concatenated.
#define CONVEYOR_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) throw std::runtime_error(::conveyor::message(__VA_ARGS__)); \
  } while (false)
