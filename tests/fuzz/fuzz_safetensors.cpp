// Fuzz target: mha::io's safetensors reader on arbitrary bytes, then every tensor it accepts
// through each conversion of the public API.
// Properties: no crash, no exception but mha::io::FileError for bad input; an accepted file
// writes back and re-reads to the same tensors and metadata; each conversion to float, double,
// Eigen::half, Eigen::bfloat16 or bool either refuses the dtype with FileError or gives a tensor
// of the stored shape whose conversion back to the stored dtype gives the stored bytes (NaNs
// compared as NaNs: conversions keep NaN but not its payload); read as an int8 layer's file
// (io/int8_checkpoint.hpp, with one or two heads), a file is refused with FileError or ShapeError
// or gives a layer whose file reads back to the same int8 values and scales.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "mha/io/int8_checkpoint.hpp"
#include "mha/io/safetensors.hpp"

namespace {

using mha::io::Dtype;
using mha::io::StoredTensor;
using mha_fuzz::violation;

bool is_float_dtype(Dtype dtype) {
  return dtype == Dtype::F32 || dtype == Dtype::F64 || dtype == Dtype::F16 || dtype == Dtype::BF16;
}

// The element's value as a double, exactly (every stored float format widens exactly).
double stored_value(const StoredTensor& tensor, std::size_t i) {
  const std::size_t size = mha::io::dtype_size(tensor.dtype);
  const std::uint64_t bits = mha::io::detail::load_le(tensor.bytes.data() + i * size, size);
  switch (tensor.dtype) {
    case Dtype::F64:
      return mha::io::detail::double_from_bits(bits);
    case Dtype::F32:
      return mha::io::detail::float_from_bits(static_cast<std::uint32_t>(bits));
    case Dtype::F16:
      return mha::io::detail::half_to_float(static_cast<std::uint16_t>(bits));
    default:
      return mha::io::detail::bfloat16_to_float(static_cast<std::uint16_t>(bits));
  }
}

// Same bytes, except that a NaN may come back as another NaN.
void check_same_values(const StoredTensor& original, const StoredTensor& back,
                       const std::string& what) {
  if (back.dtype != original.dtype || back.shape != original.shape ||
      back.bytes.size() != original.bytes.size()) {
    violation(what + ": dtype, shape or size changed");
  }
  const std::size_t size = mha::io::dtype_size(original.dtype);
  for (std::size_t i = 0; i < original.bytes.size() / size; ++i) {
    const double a = stored_value(original, i), b = stored_value(back, i);
    if (std::isnan(a) && std::isnan(b)) continue;
    if (std::memcmp(original.bytes.data() + i * size, back.bytes.data() + i * size, size) != 0) {
      violation(what + ": element " + std::to_string(i) + " changed");
    }
  }
}

// Converting to T is lossless for the dtypes at least as wide as T's own: those come back.
template <class T>
void check_conversion(const StoredTensor& stored, const std::string& name, bool lossless) {
  mha::Tensor<T> converted;
  try {
    converted = mha::io::to_tensor<T>(stored, name);
  } catch (const mha::io::FileError&) {
    if (is_float_dtype(stored.dtype)) violation(name + ": a float dtype was refused");
    return;
  }
  if (!is_float_dtype(stored.dtype)) violation(name + ": a non-float dtype was converted");
  if (converted.shape() != stored.shape) violation(name + ": the shape changed in conversion");
  if (!lossless) {
    // Still a valid tensor to store in any float dtype.
    for (Dtype dtype : {Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::F64}) {
      const StoredTensor again = mha::io::from_tensor_as(converted, dtype);
      mha::io::detail::checked_element_count(again, name);
    }
    return;
  }
  check_same_values(stored, mha::io::from_tensor_as(converted, stored.dtype),
                    name + " as " + mha::io::detail::scalar_name<T>());
}

void check_tensor(const StoredTensor& stored, const std::string& name) {
  const Dtype dtype = stored.dtype;
  check_conversion<double>(stored, name, true);
  check_conversion<float>(stored, name, dtype != Dtype::F64);
  check_conversion<Eigen::half>(stored, name, dtype == Dtype::F16);
  check_conversion<Eigen::bfloat16>(stored, name, dtype == Dtype::BF16);
  try {
    const mha::Tensor<bool> mask = mha::io::to_bool_tensor(stored, name);
    if (dtype != Dtype::BOOL) violation(name + ": a non-BOOL dtype was read as a mask");
    if (mha::io::from_tensor(mask).bytes != stored.bytes) {
      violation(name + ": BOOL does not come back");
    }
  } catch (const mha::io::FileError&) {
    // Refused: another dtype, or a byte other than 0 and 1.
    if (dtype == Dtype::BOOL) {
      bool all_bits = true;
      for (unsigned char byte : stored.bytes) all_bits = all_bits && byte <= 1;
      if (all_bits) violation(name + ": a valid BOOL tensor was refused");
    }
  }
}

mha_fuzz::Tally tally("fuzz_safetensors",
                      {"malformed (FileError)", "read", "read, and loaded as an int8 layer"});

// The file as an int8 layer's with `heads` heads: refused, or loaded; whether it loaded.
bool check_int8_layer(const mha::io::SafetensorsFile& file, mha::Index heads) {
  try {
    const auto frozen = mha::io::frozen_int8_from_file(file, heads);
    const auto again = mha::io::frozen_int8_from_file(mha::io::int8_file(frozen), heads);
    const auto expected = frozen.int8_weights(), actual = again.int8_weights();
    if (expected.size() != actual.size()) violation("int8 weights lost in the round trip");
    for (const auto& [name, weight] : expected) {
      const auto other = actual.find(name);
      if (other == actual.end() || other->second.values != weight.values ||
          other->second.scales != weight.scales) {
        violation("int8 weight " + name + " changed in the round trip");
      }
    }
    return true;
  } catch (const mha::io::FileError&) {
    return false;
  } catch (const mha::ShapeError&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  mha::io::SafetensorsFile file;
  try {
    file = mha::io::parse_safetensors(data, size);
  } catch (const mha::io::FileError&) {
    tally.count(0);
    return 0;
  }
  // Every accepted file serialises (names and metadata came from valid JSON) and reads back.
  mha::io::SafetensorsFile again;
  try {
    const std::vector<unsigned char> bytes = mha::io::serialize_safetensors(file);
    again = mha::io::parse_safetensors(bytes.data(), bytes.size());
  } catch (const mha::io::FileError& error) {
    violation(std::string("an accepted file does not write back: ") + error.what());
  }
  if (again.metadata != file.metadata) violation("metadata changed in the round trip");
  if (again.tensors.size() != file.tensors.size()) violation("tensors lost in the round trip");
  for (const auto& [name, stored] : file.tensors) {
    const StoredTensor& back = again.at(name);
    if (back.dtype != stored.dtype || back.shape != stored.shape || back.bytes != stored.bytes) {
      violation(name + ": changed in the round trip");
    }
    check_tensor(stored, name);
  }
  const bool int8 = check_int8_layer(file, 1);
  tally.count(check_int8_layer(file, 2) || int8 ? 2 : 1);
  return 0;
}
