// The definitions of the functions of safetensors_format.hpp that parse and write files, with
// nlohmann/json: the JSON header's parse and its checks against the file's real size, reading a
// file, serializing and writing one. Included by safetensors_format.hpp (header-only: inline
// functions), or compiled once into mha::compiled by src/io.cpp (MHA_COMPILED_IO); include
// safetensors_format.hpp, not this header.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "mha/io/element_bits.hpp"
#include "mha/io/safetensors_format.hpp"

namespace mha::io {

namespace detail {

inline std::string describe_json(const nlohmann::json& value) {
  // Scalars print short; strings, arrays and objects may be huge (and dump() recurses).
  if (value.is_number() || value.is_boolean() || value.is_null()) return value.dump();
  if (value.is_string()) return "a string";
  if (value.is_array()) return "an array";
  if (value.is_object()) return "an object";
  return std::string("a ") + value.type_name();
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

}  // namespace detail

MHA_IO_FUNCTION SafetensorsFile parse_safetensors(const unsigned char* data, std::size_t size,
                                                  const std::string& source) {
  const detail::Source where =
      source.empty() ? detail::Source::memory() : detail::Source::file(source);
  if (data == nullptr && size != 0) where.fail("null data pointer with a non-zero size");
  return detail::parse_buffer(data, size, where);
}

MHA_IO_FUNCTION SafetensorsFile read_safetensors(const std::string& path) {
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

MHA_IO_FUNCTION std::vector<unsigned char> serialize_safetensors(const SafetensorsFile& file) {
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

MHA_IO_FUNCTION void write_safetensors(const std::string& path, const SafetensorsFile& file) {
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
