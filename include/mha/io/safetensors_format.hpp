// The safetensors file format (Hugging Face's `safetensors`): reading, checking and writing
// files of stored tensors (StoredTensor: a dtype, a shape and raw bytes) and their metadata.
// Converting them to and from Tensor<T>, and a layer's parameters by name: safetensors.hpp.
//
// A file is: an 8-byte little-endian u64 N, N bytes of JSON header
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data buffer; offsets are relative to the buffer, elements little-endian, C order.
//
// Every file is treated as hostile: each header value is checked against the real size of the
// file before anything is allocated from it, and every problem throws mha::io::FileError naming
// the file (when there is one), the tensor and what is wrong. Deliberately lenient: unknown keys
// inside a tensor entry and buffer bytes that no tensor uses are ignored, as the reference
// readers do. Deliberately strict: duplicate JSON keys, which JSON libraries would silently
// collapse into one, are refused, so that two readers can never see different tensors.
//
// The functions that parse and write files (parse_safetensors, read_safetensors,
// serialize_safetensors, write_safetensors) are declared here and defined, with nlohmann/json, in
// safetensors_format_impl.hpp. Header-only (mha::io) this header includes those definitions, as
// inline functions; with mha::compiled built with nlohmann/json (which defines MHA_COMPILED_IO)
// they are compiled once into the library (src/io.cpp), and a file that includes this header
// parses no JSON library and compiles no JSON parser of its own.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "mha/errors.hpp"
#include "mha/io/element_bits.hpp"
#include "mha/tensor.hpp"

// The linkage of the functions defined in safetensors_format_impl.hpp: inline header-only, one
// external definition each in mha::compiled.
#ifdef MHA_COMPILED_IO
#define MHA_IO_FUNCTION
#else
#define MHA_IO_FUNCTION inline
#endif

namespace mha::io {

static_assert(std::numeric_limits<float>::is_iec559 && std::numeric_limits<double>::is_iec559,
              "safetensors stores IEEE 754 floats bit for bit");

// A file that cannot be read or written, or whose content is not a valid safetensors file.
class FileError : public std::runtime_error {
 public:
  explicit FileError(const std::string& what) : std::runtime_error(what) {}
};

// The element types of the safetensors format that this library knows. Files may hold any of
// them; only F32, F64, F16, BF16 (as float or double) and BOOL convert to tensors.
enum class Dtype { BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };

inline const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::BOOL:
      return "BOOL";
    case Dtype::U8:
      return "U8";
    case Dtype::I8:
      return "I8";
    case Dtype::I16:
      return "I16";
    case Dtype::U16:
      return "U16";
    case Dtype::F16:
      return "F16";
    case Dtype::BF16:
      return "BF16";
    case Dtype::I32:
      return "I32";
    case Dtype::U32:
      return "U32";
    case Dtype::F32:
      return "F32";
    case Dtype::F64:
      return "F64";
    case Dtype::I64:
      return "I64";
    case Dtype::U64:
      return "U64";
  }
  return "?";
}

// Bytes per element.
inline std::size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::BOOL:
    case Dtype::U8:
    case Dtype::I8:
      return 1;
    case Dtype::I16:
    case Dtype::U16:
    case Dtype::F16:
    case Dtype::BF16:
      return 2;
    case Dtype::I32:
    case Dtype::U32:
    case Dtype::F32:
      return 4;
    case Dtype::F64:
    case Dtype::I64:
    case Dtype::U64:
      return 8;
  }
  return 0;
}

// The dtype spelled `name` in a header ("F32", ...), or nothing for a name this library does not
// know (e.g. the F8 types).
inline std::optional<Dtype> parse_dtype(std::string_view name) {
  constexpr Dtype all[] = {Dtype::BOOL, Dtype::U8,   Dtype::I8,  Dtype::I16, Dtype::U16,
                           Dtype::F16,  Dtype::BF16, Dtype::I32, Dtype::U32, Dtype::F32,
                           Dtype::F64,  Dtype::I64,  Dtype::U64};
  for (Dtype dtype : all) {
    if (name == dtype_name(dtype)) return dtype;
  }
  return std::nullopt;
}

// One tensor as stored: its raw little-endian bytes, not yet converted to any C++ type.
struct StoredTensor {
  Dtype dtype = Dtype::F32;
  Shape shape;
  std::vector<unsigned char> bytes;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, StoredTensor> tensors;

  bool has(const std::string& name) const { return tensors.count(name) != 0; }
  // Throws FileError "missing tensor 'name'" when absent.
  const StoredTensor& at(const std::string& name) const;
};

// Header lengths above this are refused before anything is allocated for the header; real
// headers are a few hundred bytes per tensor. The reference implementation has the same cap.
inline constexpr std::uint64_t kMaxHeaderBytes = std::uint64_t{100} * 1024 * 1024;

namespace detail {

// Names and shapes come from untrusted files and may be megabytes long: keep messages readable.
inline std::string quote(std::string_view text) {
  constexpr std::size_t kMaxShown = 200;
  if (text.size() <= kMaxShown) return "'" + std::string(text) + "'";
  return "'" + std::string(text.substr(0, kMaxShown)) + "...' (" + std::to_string(text.size()) +
         " bytes)";
}

inline std::string format_dims(const Shape& shape) {
  constexpr std::size_t kMaxShown = 16;
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size() && i < kMaxShown; ++i) {
    out += (i > 0 ? ", " : "") + std::to_string(shape[i]);
  }
  if (shape.size() > kMaxShown) out += ", ... (" + std::to_string(shape.size()) + " axes)";
  return out + "]";
}

// Number of elements, or nothing when a dimension is negative or when the product of the
// non-zero dimensions does not fit in Index. The latter is stricter than needed for shapes with a
// zero, but guarantees that no product of a prefix of the shape overflows later.
inline std::optional<std::uint64_t> element_count(const Shape& shape) {
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<Index>::max());
  std::uint64_t nonzero = 1;
  bool has_zero = false;
  for (Index d : shape) {
    if (d < 0) return std::nullopt;
    if (d == 0) {
      has_zero = true;
      continue;
    }
    const auto u = static_cast<std::uint64_t>(d);
    if (nonzero > kMax / u) return std::nullopt;
    nonzero *= u;
  }
  return has_zero ? 0 : nonzero;
}

inline bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The checks a StoredTensor built in code (not read from a file) has not been through.
inline std::size_t checked_element_count(const StoredTensor& tensor, const std::string& name) {
  const std::optional<std::uint64_t> count = element_count(tensor.shape);
  if (!count) {
    throw FileError("tensor " + quote(name) + ": shape " + format_dims(tensor.shape) +
                    " has a negative dimension or too many elements");
  }
  const std::uint64_t size = dtype_size(tensor.dtype);
  if (*count > std::numeric_limits<std::uint64_t>::max() / size ||
      *count * size != tensor.bytes.size()) {
    throw FileError("tensor " + quote(name) + ": holds " + std::to_string(tensor.bytes.size()) +
                    " bytes, but shape " + format_dims(tensor.shape) + " of " +
                    dtype_name(tensor.dtype) + " needs " + std::to_string(*count) + " x " +
                    std::to_string(size) + " bytes");
  }
  return static_cast<std::size_t>(*count);
}

}  // namespace detail

inline const StoredTensor& SafetensorsFile::at(const std::string& name) const {
  const auto it = tensors.find(name);
  if (it == tensors.end()) throw FileError("missing tensor " + detail::quote(name));
  return it->second;
}

inline const StoredTensor& require(const SafetensorsFile& file, const std::string& name) {
  return file.at(name);
}

// Parses a whole file held in memory. `source` names it in error messages (e.g. its path).
MHA_IO_FUNCTION SafetensorsFile parse_safetensors(const unsigned char* data, std::size_t size,
                                                  const std::string& source = {});

// Reads the header first and then only the tensors' byte ranges, so memory use is that of the
// tensors, whatever the header claims.
MHA_IO_FUNCTION SafetensorsFile read_safetensors(const std::string& path);

// Tensors are laid out in name order, the header padded with spaces to a multiple of 8 bytes so
// that the data starts aligned.
MHA_IO_FUNCTION std::vector<unsigned char> serialize_safetensors(const SafetensorsFile& file);

MHA_IO_FUNCTION void write_safetensors(const std::string& path, const SafetensorsFile& file);

}  // namespace mha::io

#ifndef MHA_COMPILED_IO
#include "mha/io/safetensors_format_impl.hpp"
#endif
