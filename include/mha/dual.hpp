// Dual<T>: a number and its derivative with respect to one input (forward-mode differentiation).
// The flash backward calls a score_mod (flex.hpp) with Dual<T>{score, 1} to get both the modified
// score and its derivative with respect to the score in one call, so a score_mod written once,
// generic in its score's type (a lambda taking `auto score`), serves forward and backward.
// Arithmetic with plain numbers (positions, captured parameters) treats them as constants.
// Functions of a Dual are found by argument-dependent lookup: write `using std::tanh;
// tanh(score / c)` and the same line compiles for float, double and Dual.
#pragma once

#include <cmath>
#include <type_traits>

namespace mha {

template <class T>
struct Dual {
  T value = T(0);
  T derivative = T(0);

  friend Dual operator+(Dual a, Dual b) { return {a.value + b.value, a.derivative + b.derivative}; }
  friend Dual operator-(Dual a, Dual b) { return {a.value - b.value, a.derivative - b.derivative}; }
  friend Dual operator*(Dual a, Dual b) {
    return {a.value * b.value, a.derivative * b.value + a.value * b.derivative};
  }
  friend Dual operator/(Dual a, Dual b) {
    return {a.value / b.value,
            (a.derivative * b.value - a.value * b.derivative) / (b.value * b.value)};
  }
  friend Dual operator-(Dual a) { return {-a.value, -a.derivative}; }
  // A plain number is a constant: its derivative is 0.
  friend Dual operator+(Dual a, T c) { return {a.value + c, a.derivative}; }
  friend Dual operator+(T c, Dual a) { return {c + a.value, a.derivative}; }
  friend Dual operator-(Dual a, T c) { return {a.value - c, a.derivative}; }
  friend Dual operator-(T c, Dual a) { return {c - a.value, -a.derivative}; }
  friend Dual operator*(Dual a, T c) { return {a.value * c, a.derivative * c}; }
  friend Dual operator*(T c, Dual a) { return {c * a.value, c * a.derivative}; }
  friend Dual operator/(Dual a, T c) { return {a.value / c, a.derivative / c}; }
  friend Dual operator/(T c, Dual a) {
    return {c / a.value, -c * a.derivative / (a.value * a.value)};
  }
  // Comparisons see the value: a score_mod may branch on the score (a piecewise function).
  friend bool operator<(Dual a, Dual b) { return a.value < b.value; }
  friend bool operator>(Dual a, Dual b) { return a.value > b.value; }
  friend bool operator<(Dual a, T c) { return a.value < c; }
  friend bool operator>(Dual a, T c) { return a.value > c; }

  friend Dual tanh(Dual a) {
    const T t = std::tanh(a.value);
    return {t, a.derivative * (T(1) - t * t)};
  }
  friend Dual exp(Dual a) {
    const T e = std::exp(a.value);
    return {e, a.derivative * e};
  }
  friend Dual log(Dual a) { return {std::log(a.value), a.derivative / a.value}; }
  friend Dual sqrt(Dual a) {
    const T r = std::sqrt(a.value);
    return {r, a.derivative / (T(2) * r)};
  }
  friend Dual abs(Dual a) { return a.value < T(0) ? -a : a; }
};

// The value of a score (a plain number is its own value).
template <class T>
T value_of(T x) {
  return x;
}
template <class T>
T value_of(Dual<T> x) {
  return x.value;
}

}  // namespace mha
