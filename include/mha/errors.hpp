// Errors and checks shared by every header of mha.
//
// Public entry points always check their arguments, in every build type, and throw
// mha::ShapeError (a std::invalid_argument) whose message names the argument, the expected
// and the actual shape, e.g. "key_padding_mask: expected [2, 5], got [2, 4]".
// MHA_ASSERT guards internal invariants inside kernels only; NDEBUG removes it, so it must
// never be what stops bad user input.
#pragma once

#include <cassert>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mha/compiled.hpp"

#if MHA_FUNCTION_DEFINITIONS
#include <sstream>
#endif

#ifndef MHA_ASSERT
#define MHA_ASSERT(condition) assert(condition)
#endif

namespace mha {

using Index = std::ptrdiff_t;
using Shape = std::vector<Index>;

// Bad arguments: wrong shapes, inconsistent options or parameters.
class ShapeError : public std::invalid_argument {
 public:
  explicit ShapeError(const std::string& what) : std::invalid_argument(what) {}
};

namespace detail {

// A dimension the caller may leave open in an expected shape, e.g. {B, kAnyDim, E}; printed "*".
constexpr Index kAnyDim = -1;

// "[2, 5, 16]", with "*" for kAnyDim.
MHA_FUNCTION std::string format_shape(const Shape& shape);

inline bool shape_matches(const Shape& expected, const Shape& actual) {
  if (expected.size() != actual.size()) return false;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != kAnyDim && expected[i] != actual[i]) return false;
  }
  return true;
}

// Throws ShapeError "argument: expected <expected>, got <actual>".
[[noreturn]] MHA_FUNCTION void throw_shape(const std::string& argument, const std::string& expected,
                                           const Shape& actual);

inline void check_shape(const std::string& argument, const Shape& expected, const Shape& actual) {
  if (!shape_matches(expected, actual)) throw_shape(argument, format_shape(expected), actual);
}

// Throws ShapeError "argument: message".
[[noreturn]] MHA_FUNCTION void throw_argument(const std::string& argument,
                                              const std::string& message);

#if MHA_FUNCTION_DEFINITIONS
MHA_FUNCTION std::string format_shape(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) {
    out << (i > 0 ? ", " : "");
    if (shape[i] == kAnyDim) {
      out << '*';
    } else {
      out << shape[i];
    }
  }
  out << ']';
  return out.str();
}

MHA_FUNCTION void throw_shape(const std::string& argument, const std::string& expected,
                              const Shape& actual) {
  throw ShapeError(argument + ": expected " + expected + ", got " + format_shape(actual));
}

MHA_FUNCTION void throw_argument(const std::string& argument, const std::string& message) {
  throw ShapeError(argument + ": " + message);
}
#endif

}  // namespace detail
}  // namespace mha
