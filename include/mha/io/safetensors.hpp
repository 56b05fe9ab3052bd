// Reading and writing safetensors files, the tensor format of Hugging Face's `safetensors`,
// and moving tensors and a layer's parameters (by their PyTorch state_dict names) in and out:
// the file format itself (FileError, Dtype, StoredTensor, SafetensorsFile, read_safetensors,
// write_safetensors, ...) is in safetensors_format.hpp, which this header includes; here are
// the conversions between stored tensors and Tensor<T> (float, double, Eigen::half,
// Eigen::bfloat16, bool), and save_parameters / load_parameters for a layer.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/io/element_bits.hpp"
#include "mha/io/safetensors_format.hpp"
#include "mha/tensor.hpp"

namespace mha::io {

namespace detail {
template <class T>
constexpr const char* scalar_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, double>) return "double";
  if constexpr (std::is_same_v<T, Eigen::half>) return "Eigen::half";
  return "Eigen::bfloat16";
}
// A 16-bit float from its bits, and back.
template <class T>
T from_bits16(std::uint16_t bits) {
  return Eigen::numext::bit_cast<T>(bits);
}
template <class T>
std::uint16_t bits16_of(T value) {
  return Eigen::numext::bit_cast<std::uint16_t>(value);
}
}  // namespace detail

// The tensor converted to T (float, double, Eigen::half or Eigen::bfloat16) from F32, F64, F16
// or BF16. F16 into Eigen::half and BF16 into Eigen::bfloat16 are copied bit for bit; narrowing
// conversions round to nearest, ties to even, once; widening ones are exact.
template <class T>
Tensor<T> to_tensor(const StoredTensor& stored, const std::string& name) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>,
                "to_tensor converts to float, double, Eigen::half or Eigen::bfloat16; use "
                "to_bool_tensor for masks");
  const Dtype dtype = stored.dtype;
  if (dtype != Dtype::F32 && dtype != Dtype::F64 && dtype != Dtype::F16 && dtype != Dtype::BF16) {
    throw FileError("tensor " + detail::quote(name) +
                    ": expected dtype F32, F64, F16 or BF16 to read as " +
                    detail::scalar_name<T>() + ", got " + dtype_name(dtype));
  }
  if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    constexpr Dtype native = std::is_same_v<T, Eigen::half> ? Dtype::F16 : Dtype::BF16;
    const std::size_t count = detail::checked_element_count(stored, name);
    Tensor<T> out(stored.shape);
    const std::size_t size = dtype_size(dtype);
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t bits = detail::load_le(stored.bytes.data() + i * size, size);
      if (dtype == native) {
        out.data()[i] = detail::from_bits16<T>(static_cast<std::uint16_t>(bits));
        continue;
      }
      const double wide =
          dtype == Dtype::F64   ? detail::double_from_bits(bits)
          : dtype == Dtype::F32 ? detail::float_from_bits(static_cast<std::uint32_t>(bits))
          : dtype == Dtype::F16 ? detail::half_to_float(static_cast<std::uint16_t>(bits))
                                : detail::bfloat16_to_float(static_cast<std::uint16_t>(bits));
      out.data()[i] = detail::from_bits16<T>(
          native == Dtype::F16 ? detail::float_to_half(wide) : detail::float_to_bfloat16(wide));
    }
    return out;
  } else {
    const std::size_t count = detail::checked_element_count(stored, name);
    Tensor<T> out(stored.shape);
    T* dst = out.data();
    const unsigned char* src = stored.bytes.data();
    const std::size_t size = dtype_size(dtype);
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t bits = detail::load_le(src + i * size, size);
      switch (dtype) {
        case Dtype::F32:
          dst[i] = static_cast<T>(detail::float_from_bits(static_cast<std::uint32_t>(bits)));
          break;
        case Dtype::F64:
          dst[i] = detail::from_double<T>(detail::double_from_bits(bits));
          break;
        case Dtype::F16:
          dst[i] = static_cast<T>(detail::half_to_float(static_cast<std::uint16_t>(bits)));
          break;
        default:
          dst[i] = static_cast<T>(detail::bfloat16_to_float(static_cast<std::uint16_t>(bits)));
          break;
      }
    }
    return out;
  }
}

// A mask from a BOOL tensor, whose bytes must each be 0 or 1.
inline Tensor<bool> to_bool_tensor(const StoredTensor& stored, const std::string& name) {
  if (stored.dtype != Dtype::BOOL) {
    throw FileError("tensor " + detail::quote(name) + ": expected dtype BOOL, got " +
                    dtype_name(stored.dtype));
  }
  const std::size_t count = detail::checked_element_count(stored, name);
  Tensor<bool> out(stored.shape);
  for (std::size_t i = 0; i < count; ++i) {
    const unsigned char byte = stored.bytes[i];
    if (byte > 1) {
      throw FileError("tensor " + detail::quote(name) + ": BOOL element " + std::to_string(i) +
                      " is the byte " + std::to_string(byte) + ", expected 0 or 1");
    }
    out.data()[i] = byte == 1;
  }
  return out;
}

// Stores a float, double, Eigen::half or Eigen::bfloat16 tensor as F16, BF16, F32 or F64
// (rounding to nearest, ties to even, when narrowing), or a bool tensor as BOOL.
template <class T>
StoredTensor from_tensor_as(TensorView<T> view, Dtype dtype) {
  using Scalar = std::remove_const_t<T>;
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double> ||
                    std::is_same_v<Scalar, Eigen::half> ||
                    std::is_same_v<Scalar, Eigen::bfloat16> || std::is_same_v<Scalar, bool>,
                "safetensors stores float, double, Eigen::half, Eigen::bfloat16 or bool tensors");
  if constexpr (std::is_same_v<Scalar, bool>) {
    if (dtype != Dtype::BOOL) {
      mha::detail::throw_argument(
          "from_tensor_as",
          std::string("a bool tensor is stored as BOOL, not ") + dtype_name(dtype));
    }
  } else if (dtype != Dtype::F16 && dtype != Dtype::BF16 && dtype != Dtype::F32 &&
             dtype != Dtype::F64) {
    mha::detail::throw_argument("from_tensor_as",
                                std::string("a floating-point tensor is stored as F16, "
                                            "BF16, F32 or F64, not ") +
                                    dtype_name(dtype));
  }
  StoredTensor out;
  out.dtype = dtype;
  out.shape = view.shape();
  const auto count = static_cast<std::size_t>(view.size());
  const std::size_t size = dtype_size(dtype);
  out.bytes.resize(count * size);
  unsigned char* dst = out.bytes.data();
  for (std::size_t i = 0; i < count; ++i) {
    const Scalar value = view.data()[i];
    if constexpr (std::is_same_v<Scalar, bool>) {
      dst[i] = value ? 1 : 0;
    } else {
      double wide;  // the value, exactly
      if constexpr (mha::detail::is_16bit_v<Scalar>) {
        wide = static_cast<double>(static_cast<float>(value));
      } else {
        wide = static_cast<double>(value);
      }
      std::uint64_t bits = 0;
      switch (dtype) {
        case Dtype::F16:
          if constexpr (std::is_same_v<Scalar, Eigen::half>) {
            bits = detail::bits16_of(value);  // NaN payloads too
          } else {
            bits = detail::float_to_half(wide);
          }
          break;
        case Dtype::BF16:
          if constexpr (std::is_same_v<Scalar, Eigen::bfloat16>) {
            bits = detail::bits16_of(value);
          } else {
            bits = detail::float_to_bfloat16(wide);
          }
          break;
        case Dtype::F32:
          bits = detail::bits_of(detail::narrow_to_float(wide));
          break;
        default:
          bits = detail::bits_of(wide);
          break;
      }
      detail::store_le(dst + i * size, bits, size);
    }
  }
  return out;
}

template <class T>
StoredTensor from_tensor_as(const Tensor<T>& tensor, Dtype dtype) {
  return from_tensor_as(tensor.view(), dtype);
}

// Stores float as F32, double as F64, Eigen::half as F16, Eigen::bfloat16 as BF16 and bool as
// BOOL, bit for bit.
template <class T>
StoredTensor from_tensor(TensorView<T> view) {
  using Scalar = std::remove_const_t<T>;
  constexpr Dtype dtype = std::is_same_v<Scalar, bool>              ? Dtype::BOOL
                          : std::is_same_v<Scalar, double>          ? Dtype::F64
                          : std::is_same_v<Scalar, Eigen::half>     ? Dtype::F16
                          : std::is_same_v<Scalar, Eigen::bfloat16> ? Dtype::BF16
                                                                    : Dtype::F32;
  return from_tensor_as(view, dtype);
}

template <class T>
StoredTensor from_tensor(const Tensor<T>& tensor) {
  return from_tensor(tensor.view());
}

// The tensors of `file` named in `names`, converted to T; names absent from the file are
// skipped (the layer's load_state_dict decides whether that is an error), and tensors of the
// file that are not in `names` are ignored.
template <class T>
std::map<std::string, Tensor<T>> read_state_dict(const SafetensorsFile& file,
                                                 const std::vector<std::string>& names) {
  std::map<std::string, Tensor<T>> out;
  for (const std::string& name : names) {
    const auto it = file.tensors.find(name);
    if (it != file.tensors.end()) out.emplace(name, to_tensor<T>(it->second, name));
  }
  return out;
}

// Writes every entry of layer.state_dict() under its PyTorch name, in the layer's scalar type.
// A template on the layer so that this header does not depend on the layer's.
template <class Layer>
void save_parameters(const Layer& layer, const std::string& path,
                     std::map<std::string, std::string> metadata = {}) {
  SafetensorsFile file;
  file.metadata = std::move(metadata);
  for (const auto& [name, tensor] : layer.state_dict())
    file.tensors.emplace(name, from_tensor(tensor));
  write_safetensors(path, file);
}

template <class Layer>
void load_parameters(Layer& layer, const std::string& path) {
  const SafetensorsFile file = read_safetensors(path);
  using Scalar = typename Layer::Scalar;
  std::map<std::string, Tensor<Scalar>> state;
  try {
    state = read_state_dict<Scalar>(file, layer.parameter_names());
  } catch (const FileError& error) {
    throw FileError("safetensors file " + detail::quote(path) + ": " + error.what());
  }
  layer.load_state_dict(state);
}

}  // namespace mha::io
