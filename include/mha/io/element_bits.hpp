// The stored element types at the bit level: little-endian integers of any width, and IEEE
// binary16 (half), bfloat16, binary32 and binary64 to and from their bits, with the rounding
// (to nearest, ties to even, once) that narrowing needs. What the safetensors reader and writer
// convert with; independent of the host's byte order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace mha::io::detail {

// Byte-order independent: shifts rather than memcpy of integers, so nothing assumes the host.
inline std::uint64_t load_le(const unsigned char* p, std::size_t bytes) {
  std::uint64_t value = 0;
  for (std::size_t i = bytes; i-- > 0;) value = (value << 8) | p[i];
  return value;
}

inline void store_le(unsigned char* p, std::uint64_t value, std::size_t bytes) {
  for (std::size_t i = 0; i < bytes; ++i) {
    p[i] = static_cast<unsigned char>(value & 0xffu);
    value >>= 8;
  }
}

inline float float_from_bits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline double double_from_bits(std::uint64_t bits) {
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline std::uint64_t bits_of(double value) {
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// IEEE binary16 (1 sign, 5 exponent, 10 mantissa bits) to binary32, exact for every input,
// NaN payloads included.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return float_from_bits(sign);
    // Subnormal half: every one is a normal float; shift the leading 1 into the implicit bit.
    exponent = 113;  // 127 - 15 + 1: the float exponent of 2^-14, the subnormal half scale
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
    return float_from_bits(sign | (exponent << 23) | (mantissa << 13));
  }
  return float_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// bfloat16 is the top half of a binary32.
inline float bfloat16_to_float(std::uint16_t b) {
  return float_from_bits(static_cast<std::uint32_t>(b) << 16);
}

// Rounds `value` to the nearest binary format with `exponent_bits` and `mantissa_bits`, ties to
// even, overflow to infinity, and returns its bits. Works from double so that a double is
// rounded once (going through float first could round twice and be off by one ulp).
inline std::uint16_t round_to_small_float(double value, int exponent_bits, int mantissa_bits) {
  const std::uint32_t sign_bit = 1u << (exponent_bits + mantissa_bits);
  const std::uint32_t exponent_all_ones = ((1u << exponent_bits) - 1u) << mantissa_bits;
  const std::uint32_t sign = std::signbit(value) ? sign_bit : 0u;
  if (std::isnan(value)) {
    return static_cast<std::uint16_t>(sign | exponent_all_ones | (1u << (mantissa_bits - 1)));
  }
  const double magnitude = std::fabs(value);
  if (std::isinf(magnitude)) return static_cast<std::uint16_t>(sign | exponent_all_ones);
  if (magnitude == 0.0) return static_cast<std::uint16_t>(sign);

  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int min_exponent = 1 - bias;
  int e = 0;
  std::frexp(magnitude, &e);  // magnitude = f * 2^e with f in [0.5, 1)
  // Below the normal range, the spacing stays that of the smallest normal: subnormals.
  const int exponent = std::max(e - 1, min_exponent);
  // Scaling by a power of two is exact here: the result lies in [0, 2^(mantissa_bits + 1)).
  const double scaled = std::ldexp(magnitude, mantissa_bits - exponent);
  double rounded = std::floor(scaled);
  const double fraction = scaled - rounded;
  if (fraction > 0.5 || (fraction == 0.5 && std::fmod(rounded, 2.0) != 0.0)) rounded += 1.0;

  auto significand = static_cast<std::uint32_t>(rounded);
  int biased = 0;
  const std::uint32_t implicit_bit = 1u << mantissa_bits;
  if (significand >= implicit_bit) {
    biased = exponent + bias;
    if (significand >= 2 * implicit_bit) {  // rounding carried into the next binade
      significand >>= 1;
      ++biased;
    }
    significand -= implicit_bit;
  }
  if (biased >= (1 << exponent_bits) - 1) {
    return static_cast<std::uint16_t>(sign | exponent_all_ones);
  }
  return static_cast<std::uint16_t>(sign | (static_cast<std::uint32_t>(biased) << mantissa_bits) |
                                    significand);
}

inline std::uint16_t float_to_half(double value) {
  return round_to_small_float(value, 5, 10);
}
inline std::uint16_t float_to_bfloat16(double value) {
  return round_to_small_float(value, 8, 7);
}

// double to float with IEEE semantics for values beyond float's range (infinity when the value
// rounds past FLT_MAX), which a plain cast leaves undefined in C++.
inline float narrow_to_float(double value) {
  constexpr auto kMax = static_cast<double>(std::numeric_limits<float>::max());
  if (std::isfinite(value) && std::fabs(value) > kMax) {
    // Halfway between FLT_MAX and 2^128; FLT_MAX's significand is odd, so the tie goes up.
    const double halfway = kMax + std::ldexp(1.0, 103);
    const float limit = std::fabs(value) >= halfway ? std::numeric_limits<float>::infinity()
                                                    : std::numeric_limits<float>::max();
    return value < 0 ? -limit : limit;
  }
  return static_cast<float>(value);
}

template <class T>
T from_double(double value) {
  if constexpr (std::is_same_v<T, float>) {
    return narrow_to_float(value);
  } else {
    return value;
  }
}

}  // namespace mha::io::detail
