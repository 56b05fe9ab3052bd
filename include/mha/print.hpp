// Printing tensors: std::cout << tensor, in PyTorch's layout.
//
//   tensor([[1.0000, 0.0000],
//           [0.4853, 0.5147]])
//
// What print(tensor) shows in PyTorch with its default options, character for character
// (tests/test_print.cpp holds PyTorch's own strings): nested brackets, one row of the last axis
// per line (wrapped at 80 columns), columns aligned across the tensor; 4 decimals ("0.4853"),
// whole numbers as "1.", or scientific notation ("1.5000e-05") when the nonzero finite values
// span more than 1000× or pass 1e8 or (not whole) go below 1e-4; bools as True and False; more
// than 1000 elements summarised to the first and last 3 entries of each axis longer than 6;
// ", dtype=torch.float64" (float16, bfloat16) after a tensor of another type than float and bool.
//
// The template only converts the elements to double; the formatting is one function that
// mha::compiled compiles once (see MHA_FUNCTION in mha/compiled.hpp).
#pragma once

#include <ostream>
#include <type_traits>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/tensor.hpp"

#if MHA_FUNCTION_DEFINITIONS
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#endif

namespace mha {
namespace detail {

// values: the tensor's elements in row-major order, as doubles (0 or 1 when booleans); dtype:
// PyTorch's name of a type other than float32 and bool ("torch.float64"), or null.
MHA_FUNCTION void write_tensor(std::ostream& out, const Shape& shape,
                               const std::vector<double>& values, bool booleans, const char* dtype);

#if MHA_FUNCTION_DEFINITIONS
// PyTorch's _tensor_str, with its default print options.
struct TensorPrinter {
  static constexpr Index kSummaryThreshold = 1000;
  static constexpr Index kEdgeItems = 3;
  static constexpr std::size_t kLineWidth = 80;

  TensorPrinter(std::ostream& out_, const Shape& shape_, const std::vector<double>& values_,
                bool booleans_)
      : out(out_),
        shape(shape_),
        values(values_),
        booleans(booleans_),
        summarise(shape_size(shape_) > kSummaryThreshold) {}

  std::ostream& out;
  const Shape& shape;
  const std::vector<double>& values;
  bool booleans = false;
  bool summarise = false;
  bool integers = true;  // every nonzero finite value is a whole number: "1." rather than "1.0000"
  bool scientific = false;
  std::size_t width = 1;

  // The entries of an axis to show: all, or the first and last kEdgeItems (-1 marks "...").
  std::vector<Index> shown(Index size) const {
    std::vector<Index> entries;
    const bool shorten = summarise && size > 2 * kEdgeItems;
    for (Index i = 0; i < size; ++i) {
      if (shorten && i == kEdgeItems) {
        entries.push_back(-1);
        i = size - kEdgeItems - 1;
        continue;
      }
      entries.push_back(i);
    }
    return entries;
  }

  Index stride(std::size_t axis) const {
    Index elements = 1;
    for (std::size_t a = axis + 1; a < shape.size(); ++a) elements *= shape[a];
    return elements;
  }

  std::string format(double value) const {
    if (booleans) return value != 0 ? "True" : "False";
    if (std::isnan(value)) return "nan";
    if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
    // At most 16 characters: fixed and whole-number formats only serve values below 1e8.
    char text[64];
    if (scientific) {
      (void)std::snprintf(text, sizeof text, "%.4e", value);
    } else if (integers) {
      (void)std::snprintf(text, sizeof text, "%.0f.", value);
    } else {
      (void)std::snprintf(text, sizeof text, "%.4f", value);
    }
    return text;
  }

  // Every element that will be printed, flat offsets in row-major order.
  // NOLINTNEXTLINE(misc-no-recursion): one level per axis, so as deep as the tensor's rank
  void collect(std::size_t axis, Index offset, std::vector<Index>& offsets) const {
    if (axis == shape.size()) {
      offsets.push_back(offset);
      return;
    }
    for (const Index i : shown(shape[axis])) {
      if (i >= 0) collect(axis + 1, offset + i * stride(axis), offsets);
    }
  }

  // As PyTorch's _Formatter: the mode and the column width come from the nonzero finite values
  // printed (booleans: from all of them).
  void choose_format() {
    std::vector<Index> offsets;
    collect(0, 0, offsets);
    std::vector<double> finite;
    for (const Index o : offsets) {
      const double value = values[static_cast<std::size_t>(o)];
      if (booleans) {
        width = std::max(width, format(value).size());
      } else if (std::isfinite(value) && value != 0) {
        finite.push_back(value);
      }
    }
    if (finite.empty()) return;
    double smallest = std::abs(finite[0]), largest = smallest;
    for (const double value : finite) {
      smallest = std::min(smallest, std::abs(value));
      largest = std::max(largest, std::abs(value));
      if (value != std::ceil(value)) integers = false;
    }
    scientific = largest / smallest > 1000 || largest > 1e8 || (!integers && smallest < 1e-4);
    for (const double value : finite) width = std::max(width, format(value).size());
  }

  std::string padded(double value) const {
    const std::string text = format(value);
    return std::string(width > text.size() ? width - text.size() : 0, ' ') + text;
  }

  // The sub-tensor at `axis`, whose "[" is at column `indent`.
  // NOLINTNEXTLINE(misc-no-recursion): one level per axis, so as deep as the tensor's rank
  void write(std::size_t axis, Index offset, std::size_t indent) const {
    if (axis == shape.size()) {
      out << padded(values[static_cast<std::size_t>(offset)]);
      return;
    }
    const std::vector<Index> entries = shown(shape[axis]);
    out << '[';
    if (axis + 1 == shape.size()) {
      // The last axis: as many entries per line as fit in kLineWidth, lines continued one
      // column right of the bracket.
      const std::size_t per_line =
          std::max<std::size_t>(1, indent < kLineWidth ? (kLineWidth - indent) / (width + 2) : 0);
      for (std::size_t n = 0; n < entries.size(); ++n) {
        if (n > 0) {
          out << (n % per_line == 0 ? ",\n" + std::string(indent + 1, ' ') : std::string(", "));
        }
        out << (entries[n] < 0 ? std::string(" ...")
                               : padded(values[static_cast<std::size_t>(offset + entries[n])]));
      }
    } else {
      // Blank lines between the blocks of an axis, one fewer per axis below the first.
      const std::string separator =
          "," + std::string(shape.size() - axis - 1, '\n') + std::string(indent + 1, ' ');
      for (std::size_t n = 0; n < entries.size(); ++n) {
        if (n > 0) out << separator;
        if (entries[n] < 0) {
          out << "...";
        } else {
          write(axis + 1, offset + entries[n] * stride(axis), indent + 1);
        }
      }
    }
    out << ']';
  }
};

MHA_FUNCTION void write_tensor(std::ostream& out, const Shape& shape,
                               const std::vector<double>& values, bool booleans,
                               const char* dtype) {
  TensorPrinter printer(out, shape, values, booleans);
  const std::size_t indent = 7;  // "tensor("
  out << "tensor(";
  if (values.empty()) {
    out << "[]";
    if (shape.size() != 1) {
      out << ", size=(";
      for (std::size_t a = 0; a < shape.size(); ++a) out << (a > 0 ? ", " : "") << shape[a];
      out << ')';
    }
  } else {
    printer.choose_format();
    printer.write(0, 0, indent);
  }
  if (dtype != nullptr) out << ", dtype=" << dtype;
  out << ')';
}
#endif

// PyTorch's name of a type that print(tensor) names: null for float32 and bool, which it does not.
template <class T>
const char* torch_dtype_name() {
  if constexpr (std::is_same_v<T, double>) {
    return "torch.float64";
  } else if constexpr (std::is_same_v<T, Eigen::half>) {
    return "torch.float16";
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return "torch.bfloat16";
  } else {
    return nullptr;
  }
}

}  // namespace detail

template <class T>
std::ostream& operator<<(std::ostream& out, const TensorView<T>& tensor) {
  using Scalar = std::remove_const_t<T>;
  std::vector<double> values(static_cast<std::size_t>(tensor.size()));
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<double>(tensor.data()[i]);
  }
  const char* dtype = detail::torch_dtype_name<Scalar>();
  detail::write_tensor(out, tensor.shape(), values, std::is_same_v<Scalar, bool>, dtype);
  return out;
}

template <class T>
std::ostream& operator<<(std::ostream& out, const Tensor<T>& tensor) {
  return out << tensor.view();
}

}  // namespace mha
