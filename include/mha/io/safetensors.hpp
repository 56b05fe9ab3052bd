// Reading and writing safetensors files, the tensor format of Hugging Face's `safetensors`,
// and moving tensors and a layer's parameters (by their PyTorch state_dict names) in and out.
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
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "mha/errors.hpp"
#include "mha/tensor.hpp"

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

inline std::string describe_json(const nlohmann::json& value) {
  // Scalars print short; strings, arrays and objects may be huge (and dump() recurses).
  if (value.is_number() || value.is_boolean() || value.is_null()) return value.dump();
  if (value.is_string()) return "a string";
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
  return std::string("a ") + value.type_name();
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

// Prefixes every message with where the bytes came from.
class Source {
 public:
  explicit Source(std::string prefix) : prefix_(std::move(prefix)) {}
  static Source file(const std::string& path) { return Source("safetensors file " + quote(path)); }
  static Source memory() { return Source("safetensors data"); }

  [[noreturn]] void fail(const std::string& message) const {
    throw FileError(prefix_ + ": " + message);
  }

 private:
  std::string prefix_;
};

struct HeaderEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  Shape shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<HeaderEntry> entries;
};

// Checks the 8-byte length prefix against the cap and the size of the whole file.
inline std::uint64_t header_length(const unsigned char* prefix, std::uint64_t file_size,
                                   const Source& source) {
  const std::uint64_t length = load_le(prefix, 8);
  if (length > kMaxHeaderBytes) {
    source.fail("header length " + std::to_string(length) + " is over the limit of " +
                std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (length > file_size - 8) {
    source.fail("header length " + std::to_string(length) + " goes beyond the end of the file (" +
                std::to_string(file_size) + " bytes)");
  }
  return length;
}

inline std::optional<std::uint64_t> json_non_negative_integer(const nlohmann::json& value) {
  if (value.is_number_unsigned()) return value.get<std::uint64_t>();
  if (value.is_number_integer() && value.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(value.get<std::int64_t>());
  }
  return std::nullopt;
}

inline const nlohmann::json& json_member(const nlohmann::json& entry, const char* key,
                                         const std::string& what, const Source& source) {
  const auto it = entry.find(key);
  if (it == entry.end()) source.fail(what + ": missing \"" + key + "\"");
  return *it;
}

inline HeaderEntry parse_entry(const std::string& name, const nlohmann::json& entry,
                               std::uint64_t buffer_size, const Source& source) {
  const std::string what = "tensor " + quote(name);
  if (!entry.is_object()) {
    source.fail(what + ": entry is " + describe_json(entry) +
                ", expected an object with dtype, shape and data_offsets");
  }
  HeaderEntry out;
  out.name = name;

  const nlohmann::json& dtype = json_member(entry, "dtype", what, source);
  if (!dtype.is_string())
    source.fail(what + ": dtype is " + describe_json(dtype) + ", expected a string");
  const auto& dtype_text = dtype.get_ref<const std::string&>();
  const std::optional<Dtype> parsed = parse_dtype(dtype_text);
  if (!parsed) {
    source.fail(what + ": unknown dtype " + quote(dtype_text) +
                " (known: BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64)");
  }
  out.dtype = *parsed;

  const nlohmann::json& shape = json_member(entry, "shape", what, source);
  if (!shape.is_array())
    source.fail(what + ": shape is " + describe_json(shape) + ", expected an array");
  constexpr auto kMaxDim = static_cast<std::uint64_t>(std::numeric_limits<Index>::max());
  out.shape.reserve(shape.size());
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    const std::optional<std::uint64_t> dim = json_non_negative_integer(shape[axis]);
    if (!dim || *dim > kMaxDim) {
      source.fail(what + ": shape entry " + std::to_string(axis) + " is " +
                  describe_json(shape[axis]) + ", expected a non-negative integer");
    }
    out.shape.push_back(static_cast<Index>(*dim));
  }
  const std::optional<std::uint64_t> count = element_count(out.shape);
  if (!count) source.fail(what + ": shape " + format_dims(out.shape) + " has too many elements");

  const nlohmann::json& offsets = json_member(entry, "data_offsets", what, source);
  if (!offsets.is_array() || offsets.size() != 2) {
    source.fail(what + ": data_offsets is " + describe_json(offsets) +
                (offsets.is_array() ? " of " + std::to_string(offsets.size()) + " elements" : "") +
                ", expected [begin, end]");
  }
  for (const nlohmann::json& offset : offsets) {
    if (!json_non_negative_integer(offset)) {
      source.fail(what + ": data_offsets entry is " + describe_json(offset) +
                  ", expected a non-negative integer");
    }
  }
  out.begin = *json_non_negative_integer(offsets[0]);
  out.end = *json_non_negative_integer(offsets[1]);
  const std::string range = "[" + std::to_string(out.begin) + ", " + std::to_string(out.end) + "]";
  if (out.begin > out.end) source.fail(what + ": data_offsets " + range + " begin after they end");
  if (out.end > buffer_size) {
    source.fail(what + ": data_offsets " + range + " go beyond the data buffer of " +
                std::to_string(buffer_size) + " bytes");
  }
  const std::uint64_t size = dtype_size(out.dtype);
  const std::uint64_t stored = out.end - out.begin;
  if (*count > std::numeric_limits<std::uint64_t>::max() / size || *count * size != stored) {
    source.fail(what + ": data_offsets " + range + " hold " + std::to_string(stored) +
                " bytes, but shape " + format_dims(out.shape) + " of " + dtype_name(out.dtype) +
                " needs " + std::to_string(*count) + " x " + std::to_string(size) + " bytes");
  }
  return out;
}

// Parses and checks the JSON header; buffer_size is the number of bytes after the header.
inline Header parse_header(const unsigned char* text, std::size_t length, std::uint64_t buffer_size,
                           const Source& source) {
  // nlohmann keeps the last of duplicate keys; the parse callback sees each key, so record the
  // first duplicate and refuse it afterwards.
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate;
  const auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event,
                            nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      open_objects.emplace_back();
    } else if (event == Event::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == Event::key && !open_objects.empty() && !duplicate) {
      if (!open_objects.back().insert(parsed.get<std::string>()).second) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  nlohmann::json json;
  try {
    const auto* first = reinterpret_cast<const char*>(text);
    json = nlohmann::json::parse(first, first + length, callback);
  } catch (const nlohmann::json::exception& error) {
    source.fail(std::string("header is not valid JSON: ") + error.what());
  }
  if (duplicate) source.fail("header has the key " + quote(*duplicate) + " more than once");
  if (!json.is_object()) {
    source.fail("header is " + describe_json(json) + ", expected a JSON object");
  }

  Header header;
  for (const auto& [name, value] : json.items()) {
    if (name != "__metadata__") {
      header.entries.push_back(parse_entry(name, value, buffer_size, source));
      continue;
    }
    if (!value.is_object()) {
      source.fail("__metadata__ is " + describe_json(value) + ", expected an object of strings");
    }
    for (const auto& [key, text_value] : value.items()) {
      if (!text_value.is_string()) {
        source.fail("__metadata__ value of " + quote(key) + " is " + describe_json(text_value) +
                    ", expected a string");
      }
      header.metadata.emplace(key, text_value.get<std::string>());
    }
  }

  // Empty tensors own no bytes, so they overlap nothing wherever they point.
  std::vector<const HeaderEntry*> by_offset;
  for (const HeaderEntry& entry : header.entries) {
    if (entry.begin < entry.end) by_offset.push_back(&entry);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const HeaderEntry* a, const HeaderEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  // Sorted by begin, any overlap shows up between neighbours.
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const HeaderEntry& previous = *by_offset[i - 1];
    const HeaderEntry& current = *by_offset[i];
    if (current.begin < previous.end) {
      source.fail("tensors " + quote(previous.name) + " [" + std::to_string(previous.begin) + ", " +
                  std::to_string(previous.end) + "] and " + quote(current.name) + " [" +
                  std::to_string(current.begin) + ", " + std::to_string(current.end) + "] overlap");
    }
  }
  return header;
}

inline SafetensorsFile parse_buffer(const unsigned char* data, std::size_t size,
                                    const Source& source) {
  if (size < 8) {
    source.fail("it is " + std::to_string(size) +
                " bytes long, shorter than the 8-byte header length");
  }
  const std::uint64_t length = header_length(data, size, source);
  const auto header_size = static_cast<std::size_t>(length);
  const unsigned char* buffer = data + 8 + header_size;
  Header header = parse_header(data + 8, header_size, size - 8 - header_size, source);
  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  for (HeaderEntry& entry : header.entries) {
    StoredTensor& tensor = file.tensors[entry.name];
    tensor.dtype = entry.dtype;
    tensor.shape = std::move(entry.shape);
    tensor.bytes.assign(buffer + entry.begin, buffer + entry.end);
  }
  return file;
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
inline SafetensorsFile parse_safetensors(const unsigned char* data, std::size_t size,
                                         const std::string& source = {}) {
  const detail::Source where =
      source.empty() ? detail::Source::memory() : detail::Source::file(source);
  if (data == nullptr && size != 0) where.fail("null data pointer with a non-zero size");
  return detail::parse_buffer(data, size, where);
}

// Reads the header first and then only the tensors' byte ranges, so memory use is that of the
// tensors, whatever the header claims.
inline SafetensorsFile read_safetensors(const std::string& path) {
  const detail::Source source = detail::Source::file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int error = errno;
    source.fail("cannot open for reading" +
                (error != 0 ? ": " + std::generic_category().message(error) : std::string()));
  }
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (!in || end < 0) source.fail("cannot determine its size");
  const auto file_size = static_cast<std::uint64_t>(end);
  if (file_size < 8) {
    source.fail("it is " + std::to_string(file_size) +
                " bytes long, shorter than the 8-byte header length");
  }

  const auto read_at = [&](std::uint64_t offset, unsigned char* out, std::uint64_t count) {
    if (count == 0) return;
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(reinterpret_cast<char*>(out), static_cast<std::streamsize>(count));
    if (!in || static_cast<std::uint64_t>(in.gcount()) != count) {
      source.fail("read failure at byte " + std::to_string(offset) + " (" + std::to_string(count) +
                  " bytes wanted)");
    }
  };
  unsigned char prefix[8];
  read_at(0, prefix, 8);
  const std::uint64_t length = detail::header_length(prefix, file_size, source);
  std::vector<unsigned char> text(static_cast<std::size_t>(length));
  read_at(8, text.data(), length);
  detail::Header header =
      detail::parse_header(text.data(), text.size(), file_size - 8 - length, source);

  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  for (detail::HeaderEntry& entry : header.entries) {
    StoredTensor& tensor = file.tensors[entry.name];
    tensor.dtype = entry.dtype;
    tensor.shape = std::move(entry.shape);
    tensor.bytes.resize(static_cast<std::size_t>(entry.end - entry.begin));
    read_at(8 + length + entry.begin, tensor.bytes.data(), tensor.bytes.size());
  }
  return file;
}

// Tensors are laid out in name order, the header padded with spaces to a multiple of 8 bytes so
// that the data starts aligned.
inline std::vector<unsigned char> serialize_safetensors(const SafetensorsFile& file) {
  nlohmann::json header = nlohmann::json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, tensor] : file.tensors) {
    if (name == "__metadata__") {
      throw FileError("tensor name '__metadata__' is reserved for the metadata");
    }
    detail::checked_element_count(tensor, name);
    const std::uint64_t end = offset + tensor.bytes.size();
    header[name] = {{"dtype", dtype_name(tensor.dtype)},
                    {"shape", tensor.shape},
                    {"data_offsets", nlohmann::json::array({offset, end})}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& error) {
    // Names and metadata must be valid UTF-8.
    throw FileError(std::string("cannot write safetensors header: ") + error.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<unsigned char> out(8 + text.size());
  detail::store_le(out.data(), text.size(), 8);
  std::memcpy(out.data() + 8, text.data(), text.size());
  out.reserve(out.size() + static_cast<std::size_t>(offset));
  for (const auto& entry : file.tensors) {
    out.insert(out.end(), entry.second.bytes.begin(), entry.second.bytes.end());
  }
  return out;
}

inline void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  const std::vector<unsigned char> bytes = serialize_safetensors(file);
  const detail::Source source = detail::Source::file(path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    const int error = errno;
    source.fail("cannot open for writing" +
                (error != 0 ? ": " + std::generic_category().message(error) : std::string()));
  }
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) source.fail("write failure");
}

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
