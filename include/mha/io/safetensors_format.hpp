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
#include "mha/io/element_bits.hpp"
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

}  // namespace mha::io
