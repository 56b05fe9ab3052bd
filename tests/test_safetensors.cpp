// Tests of mha/io/safetensors.hpp: round trips, F16/BF16 bit patterns written out by hand from
// the IEEE definitions, one test per way a hostile file is refused, and a byte-flipping fuzz loop.
#include "mha/io/safetensors.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"

namespace {

using mha::Shape;
using mha::Tensor;
using mha::io::Dtype;
using mha::io::FileError;
using mha::io::SafetensorsFile;
using mha::io::StoredTensor;
using Bytes = std::vector<unsigned char>;

constexpr Dtype kAllDtypes[] = {Dtype::BOOL, Dtype::U8,   Dtype::I8,  Dtype::I16, Dtype::U16,
                                Dtype::F16,  Dtype::BF16, Dtype::I32, Dtype::U32, Dtype::F32,
                                Dtype::F64,  Dtype::I64,  Dtype::U64};

Bytes length_prefix(std::uint64_t length) {
  Bytes out(8);
  for (unsigned char& byte : out) {
    byte = static_cast<unsigned char>(length & 0xffu);
    length >>= 8;
  }
  return out;
}

// A file from a hand-written header and buffer; the header is not padded, as a careless writer
// would leave it.
Bytes make_file(const std::string& header, const Bytes& buffer = {}) {
  Bytes out = length_prefix(header.size());
  out.reserve(out.size() + header.size() + buffer.size());
  for (char c : header) out.push_back(static_cast<unsigned char>(c));
  for (unsigned char byte : buffer) out.push_back(byte);
  return out;
}

SafetensorsFile parse(const Bytes& bytes) {
  return mha::io::parse_safetensors(bytes.data(), bytes.size());
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The message of the FileError that `action` throws; any other outcome fails the test.
template <class Action>
std::string file_error(Action&& action) {
  try {
    action();
  } catch (const FileError& error) {
    return error.what();
  }
  FAIL("expected mha::io::FileError, nothing was thrown");
  return {};
}

std::string parse_error(const Bytes& bytes) {
  return file_error([&] { parse(bytes); });
}

std::string parse_error(const std::string& header, const Bytes& buffer = {}) {
  return parse_error(make_file(header, buffer));
}

Bytes le16(std::initializer_list<std::uint16_t> values) {
  Bytes out;
  for (std::uint16_t v : values) {
    out.push_back(static_cast<unsigned char>(v & 0xffu));
    out.push_back(static_cast<unsigned char>(v >> 8));
  }
  return out;
}

std::uint16_t read_le16(const Bytes& bytes, std::size_t i) {
  return static_cast<std::uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8));
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// Shape first, then every element bit for bit (so NaN equals NaN and -0 differs from 0).
template <class T>
void check_identical(const Tensor<T>& expected, const Tensor<T>& actual) {
  REQUIRE(expected.shape() == actual.shape());
  for (mha::Index i = 0; i < expected.size(); ++i) {
    INFO("element " << i << ": expected " << expected.data()[i] << ", got " << actual.data()[i]);
    CHECK(same_bits(expected.data()[i], actual.data()[i]));
  }
}

bool same_file(const SafetensorsFile& a, const SafetensorsFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, tensor] : a.tensors) {
    if (!b.has(name)) return false;
    const StoredTensor& other = b.at(name);
    if (tensor.dtype != other.dtype || tensor.shape != other.shape || tensor.bytes != other.bytes) {
      return false;
    }
  }
  return true;
}

// A valid file whose last tensor ends at the last byte, so that every prefix is invalid.
Bytes small_valid_file() {
  SafetensorsFile file;
  file.metadata["format"] = "pt";
  file.tensors["a"] = mha::io::from_tensor(Tensor<float>({2, 2}, {1.0f, -2.0f, 0.5f, 3.0f}));
  file.tensors["b"] = mha::io::from_tensor(Tensor<bool>({3}, {true, false, true}));
  file.tensors["c"] = mha::io::from_tensor_as(Tensor<double>({2}, {0.25, -8.0}), Dtype::F16);
  return mha::io::serialize_safetensors(file);
}

class TempPath {
 public:
  explicit TempPath(const std::string& stem) {
    std::random_device device;
    path_ = (std::filesystem::temp_directory_path() /
             ("mha_" + stem + "_" + std::to_string(device()) + ".safetensors"))
                .string();
  }
  ~TempPath() {
    std::error_code ignored;
    std::filesystem::remove(path_, ignored);
  }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

// Stands in for mha::MultiHeadAttention<T>: the io header only needs these four members.
template <class T>
struct FakeLayer {
  using Scalar = T;
  std::map<std::string, Tensor<T>> parameters;

  std::map<std::string, Tensor<T>> state_dict() const { return parameters; }
  std::vector<std::string> parameter_names() const { return {"in_proj_weight", "out_proj.bias"}; }
  void load_state_dict(const std::map<std::string, Tensor<T>>& state) { parameters = state; }
};

}  // namespace

// ---- dtypes and round trips -----------------------------------------------------------------

TEST_CASE("dtype names, sizes and parsing agree", "[safetensors]") {
  for (Dtype dtype : kAllDtypes) {
    const std::string name = mha::io::dtype_name(dtype);
    INFO(name);
    REQUIRE(mha::io::parse_dtype(name) == dtype);
    CHECK(mha::io::dtype_size(dtype) >= 1);
  }
  CHECK(mha::io::dtype_size(Dtype::BF16) == 2);
  CHECK(mha::io::dtype_size(Dtype::F64) == 8);
  CHECK_FALSE(mha::io::parse_dtype("F8_E4M3").has_value());
  CHECK_FALSE(mha::io::parse_dtype("f32").has_value());
  CHECK_FALSE(mha::io::parse_dtype("").has_value());
}

TEST_CASE("every dtype round-trips byte for byte with metadata", "[safetensors]") {
  SafetensorsFile file;
  file.metadata = {{"format", "pt"}, {"note", "héllo \"quoted\" \n"}, {"", "empty key"}};
  std::mt19937 rng(7);
  for (Dtype dtype : kAllDtypes) {
    StoredTensor tensor;
    tensor.dtype = dtype;
    tensor.shape = {2, 3};
    tensor.bytes.resize(6 * mha::io::dtype_size(dtype));
    for (unsigned char& byte : tensor.bytes) {
      byte = dtype == Dtype::BOOL ? static_cast<unsigned char>(rng() & 1u)
                                  : static_cast<unsigned char>(rng() & 0xffu);
    }
    file.tensors[std::string("t_") + mha::io::dtype_name(dtype)] = tensor;
  }
  file.tensors["scalar"] = mha::io::from_tensor(Tensor<double>(Shape{}, 4.5));
  file.tensors["empty"] = mha::io::from_tensor(Tensor<float>({0, 3}));

  const Bytes bytes = mha::io::serialize_safetensors(file);
  const SafetensorsFile parsed = parse(bytes);
  CHECK(same_file(file, parsed));
  // Serialising is deterministic, so a second round trip gives the very same bytes.
  CHECK(mha::io::serialize_safetensors(parsed) == bytes);

  SECTION("the header is padded with spaces so that the data starts 8-byte aligned") {
    const std::uint64_t length = mha::io::detail::load_le(bytes.data(), 8);
    CHECK(length % 8 == 0);
    CHECK(bytes[8] == '{');
  }
  SECTION("through a file on disk") {
    const TempPath path("roundtrip");
    mha::io::write_safetensors(path.str(), file);
    CHECK(same_file(file, mha::io::read_safetensors(path.str())));
  }
  SECTION("the scalar and the empty tensor keep their shapes") {
    CHECK(parsed.at("scalar").shape.empty());
    CHECK(mha::io::to_tensor<double>(parsed.at("scalar"), "scalar").data()[0] == 4.5);
    CHECK(parsed.at("empty").shape == Shape{0, 3});
    CHECK(mha::io::to_tensor<float>(parsed.at("empty"), "empty").size() == 0);
  }
}

TEMPLATE_TEST_CASE("float, double and bool tensors convert back exactly", "[safetensors]", float,
                   double) {
  using T = TestType;
  const T inf = std::numeric_limits<T>::infinity();
  const Tensor<T> values(
      {2, 4}, {T(1), T(-2.5), T(0.1), T(-0.0), inf, -inf, std::numeric_limits<T>::denorm_min(),
               std::numeric_limits<T>::max()});
  const StoredTensor stored = mha::io::from_tensor(values);
  CHECK(stored.dtype == (std::is_same_v<T, float> ? Dtype::F32 : Dtype::F64));
  check_identical(values, mha::io::to_tensor<T>(stored, "values"));

  const Tensor<bool> mask({2, 2}, {true, false, false, true});
  const StoredTensor stored_mask = mha::io::from_tensor(mask);
  CHECK(stored_mask.dtype == Dtype::BOOL);
  CHECK(stored_mask.bytes == Bytes{1, 0, 0, 1});
  check_identical(mask, mha::io::to_bool_tensor(stored_mask, "mask"));

  SECTION("values exact in half precision survive F16 and BF16") {
    const Tensor<T> small({5}, {T(1), T(-2.5), T(0.375), T(-0.0), T(96)});
    for (Dtype dtype : {Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::F64}) {
      INFO(mha::io::dtype_name(dtype));
      check_identical(small, mha::io::to_tensor<T>(mha::io::from_tensor_as(small, dtype), "small"));
    }
  }
  SECTION("a NaN stays a NaN in every float dtype") {
    const Tensor<T> nan({1}, {std::numeric_limits<T>::quiet_NaN()});
    for (Dtype dtype : {Dtype::F16, Dtype::BF16, Dtype::F32, Dtype::F64}) {
      INFO(mha::io::dtype_name(dtype));
      CHECK(
          std::isnan(mha::io::to_tensor<T>(mha::io::from_tensor_as(nan, dtype), "nan").data()[0]));
    }
  }
  SECTION("a view converts like the tensor it views") {
    const StoredTensor from_view = mha::io::from_tensor(values.view());
    CHECK(from_view.bytes == stored.bytes);
  }
}

TEST_CASE("F64 read as float rounds to nearest and overflows to infinity", "[safetensors]") {
  const float max = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  // Floats near FLT_MAX = (2 - 2^-23) * 2^127 are 2^104 apart; 2^103 past it is the tie.
  const double top = static_cast<double>(max);
  const Tensor<double> wide({6}, {1.0 / 3.0, 1e300, -1e300, top, top + std::ldexp(1.0, 102),
                                  -(top + std::ldexp(1.0, 103))});
  const Tensor<float> narrow = mha::io::to_tensor<float>(mha::io::from_tensor(wide), "wide");
  CHECK(narrow(0) == 1.0f / 3.0f);
  CHECK(narrow(1) == inf);
  CHECK(narrow(2) == -inf);
  CHECK(narrow(3) == max);
  CHECK(narrow(4) == max);
  CHECK(narrow(5) == -inf);
  CHECK(mha::io::from_tensor_as(wide, Dtype::F32).bytes == mha::io::from_tensor(narrow).bytes);
}

// ---- F16 and BF16 bit patterns ---------------------------------------------------------------
// binary16: sign, 5 exponent bits (bias 15), 10 mantissa bits. bfloat16: sign, 8 exponent bits
// (bias 127), 7 mantissa bits. Each pattern below is derived by hand from those definitions.

TEMPLATE_TEST_CASE("F16 bit patterns read as their IEEE values", "[safetensors]", float, double) {
  using T = TestType;
  const T inf = std::numeric_limits<T>::infinity();
  const std::vector<std::pair<std::uint16_t, double>> cases = {
      {0x3C00, 1.0},                      // exponent 15 = 2^0
      {0xC100, -2.5},                     // -(1 + 256/1024) * 2^1
      {0x7BFF, 65504.0},                  // (1 + 1023/1024) * 2^15, the largest finite
      {0x0400, std::ldexp(1.0, -14)},     // smallest normal
      {0x0001, std::ldexp(1.0, -24)},     // smallest subnormal: 1/1024 * 2^-14
      {0x03FF, std::ldexp(1023.0, -24)},  // largest subnormal
      {0x8001, -std::ldexp(1.0, -24)},    // negative subnormal
      {0x3555, std::ldexp(1365.0, -12)},  // 0.333251953125, the half nearest 1/3
      {0x0000, 0.0},
  };
  StoredTensor stored;
  stored.dtype = Dtype::F16;
  stored.shape = {static_cast<mha::Index>(cases.size()) + 4};
  for (const auto& entry : cases) {
    const Bytes pair = le16({entry.first});
    stored.bytes.insert(stored.bytes.end(), pair.begin(), pair.end());
  }
  const Bytes specials = le16({0x7C00, 0xFC00, 0x8000, 0x7E00});  // +inf, -inf, -0, NaN
  stored.bytes.insert(stored.bytes.end(), specials.begin(), specials.end());

  const Tensor<T> values = mha::io::to_tensor<T>(stored, "half");
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO("pattern 0x" << std::hex << cases[i].first);
    CHECK(values(static_cast<mha::Index>(i)) == static_cast<T>(cases[i].second));
  }
  const auto n = static_cast<mha::Index>(cases.size());
  CHECK(values(n) == inf);
  CHECK(values(n + 1) == -inf);
  CHECK(values(n + 2) == T(0));
  CHECK(std::signbit(values(n + 2)));
  CHECK(std::isnan(values(n + 3)));

  SECTION("writing the values back gives the same bit patterns") {
    const StoredTensor written = mha::io::from_tensor_as(values, Dtype::F16);
    CHECK(written.bytes == stored.bytes);
  }
}

TEMPLATE_TEST_CASE("BF16 bit patterns read as their IEEE values", "[safetensors]", float, double) {
  using T = TestType;
  const std::vector<std::pair<std::uint16_t, double>> cases = {
      {0x3F80, 1.0},                       // exponent 127 = 2^0
      {0xC020, -2.5},                      // -(1 + 32/128) * 2^1
      {0x7F7F, std::ldexp(255.0, 120)},    // (1 + 127/128) * 2^127, the largest finite
      {0x0080, std::ldexp(1.0, -126)},     // smallest normal
      {0x0001, std::ldexp(1.0, -133)},     // smallest subnormal: 1/128 * 2^-126
      {0x807F, -std::ldexp(127.0, -133)},  // largest negative subnormal
      {0x4780, 65536.0},                   // 2^16
      {0x0000, 0.0},
  };
  StoredTensor stored;
  stored.dtype = Dtype::BF16;
  stored.shape = {static_cast<mha::Index>(cases.size()) + 3};
  for (const auto& entry : cases) {
    const Bytes pair = le16({entry.first});
    stored.bytes.insert(stored.bytes.end(), pair.begin(), pair.end());
  }
  const Bytes specials = le16({0x7F80, 0xFF80, 0x7FC0});  // +inf, -inf, NaN
  stored.bytes.insert(stored.bytes.end(), specials.begin(), specials.end());

  const Tensor<T> values = mha::io::to_tensor<T>(stored, "bf16");
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO("pattern 0x" << std::hex << cases[i].first);
    CHECK(values(static_cast<mha::Index>(i)) == static_cast<T>(cases[i].second));
  }
  const auto n = static_cast<mha::Index>(cases.size());
  CHECK(values(n) == std::numeric_limits<T>::infinity());
  CHECK(values(n + 1) == -std::numeric_limits<T>::infinity());
  CHECK(std::isnan(values(n + 2)));

  SECTION("writing the values back gives the same bit patterns") {
    CHECK(mha::io::from_tensor_as(values, Dtype::BF16).bytes == stored.bytes);
  }
}

TEST_CASE("F16 and BF16 writing rounds to nearest, ties to even", "[safetensors]") {
  // Each value with the bits it must round to.
  const std::vector<std::pair<double, std::uint16_t>> half = {
      {1.0 + std::ldexp(1.0, -11), 0x3C00},      // halfway 1 and 1+2^-10: to the even 1
      {1.0 + 3 * std::ldexp(1.0, -11), 0x3C02},  // halfway 1+2^-10 and 1+2^-9: to the even
      {1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -30), 0x3C01},  // just above halfway
      {65519.0, 0x7BFF},  // below halfway to 65536: stays finite
      {65520.0, 0x7C00},  // halfway to 2^16: ties to even, infinity
      {1e6, 0x7C00},
      {-1e6, 0xFC00},
      {std::ldexp(1.0, -25), 0x0000},  // half the smallest subnormal: to the even 0
      {std::ldexp(3.0, -25), 0x0002},  // 1.5 subnormal steps: to the even 2
      {std::ldexp(1.0, -25) + std::ldexp(1.0, -40), 0x0001},
      {std::ldexp(1023.5, -24), 0x0400},  // rounds up from the largest subnormal to normal
      {1e-30, 0x0000},
      {-1e-30, 0x8000},
  };
  const std::vector<std::pair<double, std::uint16_t>> bfloat = {
      {1.0 + std::ldexp(1.0, -8), 0x3F80},
      {1.0 + 3 * std::ldexp(1.0, -8), 0x3F82},
      // Just above halfway only in double: rounding via float first would give 0x3F80.
      {1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), 0x3F81},
      {std::ldexp(255.5, 120), 0x7F80},  // halfway past the largest finite: infinity
      {std::ldexp(1.0, -134), 0x0000},   // half the smallest subnormal
      {std::ldexp(3.0, -134), 0x0002},
      {1e300, 0x7F80},
  };
  for (const auto& [table, dtype] :
       {std::make_pair(&half, Dtype::F16), std::make_pair(&bfloat, Dtype::BF16)}) {
    Tensor<double> values({static_cast<mha::Index>(table->size())});
    for (std::size_t i = 0; i < table->size(); ++i) {
      values(static_cast<mha::Index>(i)) = (*table)[i].first;
    }
    const StoredTensor stored = mha::io::from_tensor_as(values, dtype);
    for (std::size_t i = 0; i < table->size(); ++i) {
      INFO(mha::io::dtype_name(dtype) << " value " << (*table)[i].first);
      CHECK(read_le16(stored.bytes, i) == (*table)[i].second);
    }
  }
}

// ---- refusals --------------------------------------------------------------------------------

TEST_CASE("every truncation of a valid file is refused", "[safetensors][refuse]") {
  const Bytes bytes = small_valid_file();
  REQUIRE_NOTHROW(parse(bytes));
  for (std::size_t length = 0; length < bytes.size(); ++length) {
    INFO("prefix of " << length << " bytes out of " << bytes.size());
    const Bytes prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(length));
    const std::string message = parse_error(prefix);
    if (length < 8) CHECK(contains(message, "shorter than the 8-byte header length"));
  }
  SECTION("also through the file reader") {
    const TempPath path("truncated");
    for (std::size_t length :
         {std::size_t{0}, std::size_t{7}, std::size_t{8}, std::size_t{20}, bytes.size() - 1}) {
      {
        std::ofstream out(path.str(), std::ios::binary | std::ios::trunc);
        out.write(reinterpret_cast<const char*>(bytes.data()),
                  static_cast<std::streamsize>(length));
      }
      INFO("prefix of " << length << " bytes");
      CHECK(contains(file_error([&] { mha::io::read_safetensors(path.str()); }), path.str()));
    }
  }
}

TEST_CASE("a header length over the limit or past the file is refused", "[safetensors][refuse]") {
  Bytes huge = length_prefix(std::uint64_t{1} << 63);
  huge.push_back('{');
  CHECK(contains(parse_error(huge), "over the limit"));
  CHECK(contains(parse_error(length_prefix(mha::io::kMaxHeaderBytes + 1)), "over the limit"));
  CHECK(contains(parse_error(length_prefix(~std::uint64_t{0})), "over the limit"));

  Bytes beyond = length_prefix(1000);
  beyond.insert(beyond.end(), 50, ' ');
  CHECK(contains(parse_error(beyond), "beyond the end of the file"));

  SECTION("through the file reader, without reading more than the file") {
    const TempPath path("huge_header");
    {
      std::ofstream out(path.str(), std::ios::binary);
      const Bytes prefix = length_prefix(mha::io::kMaxHeaderBytes);
      out.write(reinterpret_cast<const char*>(prefix.data()), 8);
      out << "{}";
    }
    CHECK(contains(file_error([&] { mha::io::read_safetensors(path.str()); }),
                   "beyond the end of the file"));
  }
}

TEST_CASE("a header that is not a JSON object is refused", "[safetensors][refuse]") {
  for (const std::string& header :
       {std::string(), std::string("not json"), std::string("{\"a\": "), std::string("{} x"),
        std::string("{\"a\": 1,}"), std::string("{\"a\": 1} // comment"),
        std::string("{\"a\": \"\xff\"}"), std::string("{\"a\"\0: 1}", 9)}) {
    INFO("header: " << header);
    CHECK(contains(parse_error(header), "not valid JSON"));
  }
  CHECK(contains(parse_error("[]"), "expected a JSON object"));
  CHECK(contains(parse_error("\"text\""), "expected a JSON object"));
  CHECK(contains(parse_error("42"), "expected a JSON object"));
}

TEST_CASE("an empty header object and trailing unused bytes are accepted", "[safetensors]") {
  CHECK(parse(make_file("{}")).tensors.empty());
  CHECK(parse(make_file("{}      ")).tensors.empty());
  const SafetensorsFile file = parse(
      make_file(R"({"x": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3], "extra": [1, 2]}})",
                {9, 8, 7, 6, 5}));
  CHECK(file.at("x").bytes == Bytes{8, 7});
}

TEST_CASE("deeply nested JSON does not overflow the stack", "[safetensors][refuse]") {
  const std::size_t depth = 100000;
  const std::string header = "{\"a\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
  CHECK(contains(parse_error(header), "tensor 'a': entry is an array"));
}

TEST_CASE("data offsets out of range, reversed or overlapping are refused",
          "[safetensors][refuse]") {
  const Bytes buffer(16, 0);
  SECTION("end beyond the buffer") {
    const std::string message =
        parse_error(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}})", buffer);
    CHECK(contains(message, "tensor 'w'"));
    CHECK(contains(message, "beyond the data buffer of 16 bytes"));
  }
  SECTION("offsets too large for any integer type") {
    CHECK(contains(parse_error(R"({"w": {"dtype": "U8", "shape": [1],
                                   "data_offsets": [18446744073709551615, 18446744073709551616]}})",
                               buffer),
                   "data_offsets entry is"));
    CHECK(contains(parse_error(R"({"w": {"dtype": "U8", "shape": [0],
                                   "data_offsets": [18446744073709551615, 18446744073709551615]}})",
                               buffer),
                   "beyond the data buffer"));
  }
  SECTION("begin after end") {
    CHECK(contains(
        parse_error(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [6, 4]}})", buffer),
        "begin after they end"));
  }
  SECTION("overlap") {
    const std::string message = parse_error(
        R"({"p": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "q": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
        buffer);
    CHECK(contains(message, "'p' [0, 8] and 'q' [4, 12] overlap"));
  }
  SECTION("one tensor inside another, listed out of order") {
    CHECK(contains(parse_error(R"({"z": {"dtype": "U8", "shape": [1], "data_offsets": [5, 6]},
                                  "a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
                                  "m": {"dtype": "U8", "shape": [1], "data_offsets": [9, 10]}})",
                               buffer),
                   "overlap"));
  }
  SECTION("the same range twice") {
    CHECK(contains(parse_error(R"({"p": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                  "q": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                               buffer),
                   "overlap"));
  }
  SECTION("adjacent, unordered and empty tensors are fine") {
    const SafetensorsFile file = parse(make_file(
        R"({"b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
            "a": {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4]},
            "e": {"dtype": "F32", "shape": [3, 0], "data_offsets": [2, 2]}})",
        buffer));
    CHECK(file.tensors.size() == 3);
    CHECK(file.at("e").bytes.empty());
  }
}

TEST_CASE("a byte length that does not match the shape is refused", "[safetensors][refuse]") {
  const Bytes buffer(32, 0);
  const std::string message =
      parse_error(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", buffer);
  CHECK(contains(message, "tensor 'w'"));
  CHECK(contains(message, "hold 20 bytes, but shape [2, 3] of F32 needs 6 x 4 bytes"));
  CHECK(contains(
      parse_error(R"({"w": {"dtype": "F64", "shape": [], "data_offsets": [0, 4]}})", buffer),
      "needs 1 x 8 bytes"));
  // Huge shapes are refused by comparing with the byte range, never by allocating them.
  CHECK(contains(parse_error(R"({"w": {"dtype": "F64", "shape": [4294967296, 1073741824],
                            "data_offsets": [0, 32]}})",
                             buffer),
                 "needs 4611686018427387904 x 8 bytes"));
}

TEST_CASE("an unknown or ill-typed dtype is refused", "[safetensors][refuse]") {
  const Bytes buffer(8, 0);
  const std::string message = parse_error(
      R"({"attn.weight": {"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}})", buffer);
  CHECK(contains(message, "tensor 'attn.weight'"));
  CHECK(contains(message, "unknown dtype 'F8_E4M3'"));
  CHECK(contains(
      parse_error(R"({"w": {"dtype": "f32", "shape": [2], "data_offsets": [0, 8]}})", buffer),
      "unknown dtype 'f32'"));
  CHECK(
      contains(parse_error(R"({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", buffer),
               "dtype is 4, expected a string"));
}

TEST_CASE("bad shape entries are refused", "[safetensors][refuse]") {
  const Bytes buffer(8, 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[-1, 2]", "shape entry 0 is -1"},
      {"[2, \"4\"]", "shape entry 1 is a string"},
      {"[2.0]", "shape entry 0 is 2.0"},
      {"[2.5]", "shape entry 0 is 2.5"},
      {"[1e3]", "shape entry 0 is 1000.0"},
      {"[null]", "shape entry 0 is null"},
      {"[true]", "shape entry 0 is true"},
      {"[[2]]", "shape entry 0 is an array"},
      {"[9223372036854775808]", "shape entry 0 is 9223372036854775808"},
      {"[4294967296, 4294967296]", "has too many elements"},
      {"[4294967296, 0, 4294967296]", "has too many elements"},
      {"8", "shape is 8, expected an array"},
      {"{}", "shape is an object, expected an array"},
  };
  for (const auto& [shape, expected] : cases) {
    INFO("shape " << shape);
    const std::string message = parse_error(
        R"({"w": {"dtype": "U8", "shape": )" + shape + R"(, "data_offsets": [0, 8]}})", buffer);
    CHECK(contains(message, "tensor 'w'"));
    CHECK(contains(message, expected));
  }
}

TEST_CASE("entries that are not objects or lack a field are refused", "[safetensors][refuse]") {
  const Bytes buffer(8, 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"w": 3})", "tensor 'w': entry is 3, expected an object"},
      {R"({"w": [1, 2]})", "entry is an array"},
      {R"({"w": {"shape": [2], "data_offsets": [0, 2]}})", "tensor 'w': missing \"dtype\""},
      {R"({"w": {"dtype": "U8", "data_offsets": [0, 2]}})", "missing \"shape\""},
      {R"({"w": {"dtype": "U8", "shape": [2]}})", "missing \"data_offsets\""},
      {R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2, 4]}})", "of 3 elements"},
      {R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [2]}})", "expected [begin, end]"},
      {R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": "0-2"}})", "expected [begin, end]"},
      {R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [-2, 0]}})",
       "data_offsets entry is -2"},
      {R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0.0, 2]}})",
       "data_offsets entry is 0.0"},
  };
  for (const auto& [header, expected] : cases) {
    INFO(header);
    CHECK(contains(parse_error(header, buffer), expected));
  }
}

TEST_CASE("metadata that is not an object of strings is refused", "[safetensors][refuse]") {
  CHECK(contains(parse_error(R"({"__metadata__": {"epoch": 3}})"),
                 "__metadata__ value of 'epoch' is 3, expected a string"));
  CHECK(
      contains(parse_error(R"({"__metadata__": {"a": "ok", "b": null}})"), "value of 'b' is null"));
  CHECK(contains(parse_error(R"({"__metadata__": {"nested": {"x": "y"}}})"), "is an object"));
  CHECK(contains(parse_error(R"({"__metadata__": ["a", "b"]})"),
                 "__metadata__ is an array, expected an object of strings"));
  const SafetensorsFile file = parse(make_file(R"({"__metadata__": {"format": "pt"}})"));
  CHECK(file.metadata.at("format") == "pt");
}

TEST_CASE("duplicate keys are refused", "[safetensors][refuse]") {
  const Bytes buffer(8, 0);
  CHECK(contains(parse_error(R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                                 "w": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
                             buffer),
                 "header has the key 'w' more than once"));
  CHECK(contains(
      parse_error(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [4], "data_offsets": [0, 4]}})",
                  buffer),
      "key 'dtype' more than once"));
  CHECK(contains(parse_error(R"({"__metadata__": {"a": "1", "a": "2"}})"), "key 'a'"));
  CHECK(contains(parse_error(R"({"__metadata__": {}, "__metadata__": {}})"), "'__metadata__'"));
  // The same key in two different objects is no duplicate.
  CHECK_NOTHROW(parse(make_file(R"({"__metadata__": {"shape": "x"},
                                    "shape": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                                buffer)));
}

TEST_CASE("conversions refuse the wrong dtype and bad BOOL bytes", "[safetensors][refuse]") {
  const SafetensorsFile file = parse(make_file(
      R"({"mask": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]},
          "bad_mask": {"dtype": "BOOL", "shape": [2], "data_offsets": [4, 6]},
          "ids": {"dtype": "I32", "shape": [1], "data_offsets": [8, 12]},
          "w": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}})",
      {1, 0, 0, 1, 0, 2, 0, 0, 7, 0, 0, 0, 0, 0, 128, 63}));
  CHECK(mha::io::to_bool_tensor(file.at("mask"), "mask")(3));
  CHECK(mha::io::to_tensor<float>(file.at("w"), "w")(0) == 1.0f);

  std::string message =
      file_error([&] { mha::io::to_bool_tensor(file.at("bad_mask"), "bad_mask"); });
  CHECK(contains(message, "tensor 'bad_mask': BOOL element 1 is the byte 2, expected 0 or 1"));

  message = file_error([&] { mha::io::to_tensor<float>(file.at("mask"), "mask"); });
  CHECK(contains(message, "tensor 'mask'"));
  CHECK(contains(message, "F32, F64, F16 or BF16"));
  CHECK(contains(message, "got BOOL"));
  CHECK(contains(file_error([&] { mha::io::to_tensor<double>(file.at("ids"), "ids"); }),
                 "to read as double, got I32"));
  CHECK(contains(file_error([&] { mha::io::to_bool_tensor(file.at("w"), "w"); }),
                 "tensor 'w': expected dtype BOOL, got F32"));

  SECTION("a tensor built in code with the wrong byte count") {
    StoredTensor broken = file.at("w");
    broken.shape = {3};
    CHECK(contains(file_error([&] { mha::io::to_tensor<float>(broken, "broken"); }),
                   "holds 4 bytes, but shape [3] of F32 needs 3 x 4 bytes"));
    SafetensorsFile out;
    out.tensors["broken"] = broken;
    CHECK(contains(file_error([&] { mha::io::serialize_safetensors(out); }), "tensor 'broken'"));
    broken.shape = {-4};
    CHECK(contains(file_error([&] { mha::io::to_tensor<float>(broken, "broken"); }),
                   "negative dimension"));
  }
  SECTION("writing a bool tensor as a float dtype is a bad argument") {
    const Tensor<bool> mask({1}, {true});
    CHECK_THROWS_AS(mha::io::from_tensor_as(mask, Dtype::F32), mha::ShapeError);
    CHECK_THROWS_AS(mha::io::from_tensor_as(Tensor<float>({1}, {1.0f}), Dtype::I32),
                    mha::ShapeError);
  }
}

TEST_CASE("lookups and writing refuse missing, reserved and non-UTF-8 names",
          "[safetensors][refuse]") {
  SafetensorsFile file;
  file.tensors["key"] = mha::io::from_tensor(Tensor<float>({1}, {2.0f}));
  CHECK(file.has("key"));
  CHECK_FALSE(file.has("query"));
  CHECK(file_error([&] { file.at("query"); }) == "missing tensor 'query'");
  CHECK(file_error([&] { mha::io::require(file, "query"); }) == "missing tensor 'query'");

  SafetensorsFile reserved;
  reserved.tensors["__metadata__"] = file.at("key");
  CHECK(contains(file_error([&] { mha::io::serialize_safetensors(reserved); }), "reserved"));

  SafetensorsFile bad_utf8;
  bad_utf8.tensors["\xff"] = file.at("key");
  CHECK(contains(file_error([&] { mha::io::serialize_safetensors(bad_utf8); }),
                 "cannot write safetensors header"));
}

TEST_CASE("I/O errors name the file", "[safetensors][refuse]") {
  const std::string missing =
      (std::filesystem::temp_directory_path() / "mha_no_such_dir" / "weights.safetensors").string();
  std::string message = file_error([&] { mha::io::read_safetensors(missing); });
  CHECK(contains(message, missing));
  CHECK(contains(message, "cannot open for reading"));

  message = file_error([&] { mha::io::write_safetensors(missing, SafetensorsFile{}); });
  CHECK(contains(message, missing));
  CHECK(contains(message, "cannot open for writing"));

  const std::string directory = std::filesystem::temp_directory_path().string();
  CHECK(contains(file_error([&] { mha::io::read_safetensors(directory); }), directory));
}

// ---- fuzzing ---------------------------------------------------------------------------------

TEST_CASE("random byte flips either parse or throw FileError", "[safetensors][fuzz]") {
  const Bytes original = small_valid_file();
  const std::size_t header_end =
      8 + static_cast<std::size_t>(mha::io::detail::load_le(original.data(), 8));
  std::mt19937 rng(12345);
  int parsed_count = 0;
  for (int iteration = 0; iteration < 2000; ++iteration) {
    Bytes bytes = original;
    const auto flips = 1 + rng() % 4;
    for (unsigned f = 0; f < flips; ++f) {
      // Mostly the length prefix and header: flipped data bytes always parse.
      const std::size_t limit = rng() % 8 == 0 ? bytes.size() : header_end;
      const std::size_t position = rng() % limit;
      bytes[position] = static_cast<unsigned char>(bytes[position] ^ (1 + rng() % 255));
    }
    INFO("iteration " << iteration);
    SafetensorsFile file;
    try {
      file = parse(bytes);
    } catch (const FileError&) {
      continue;  // refused cleanly; anything else escapes and fails the test
    }
    ++parsed_count;
    // What parses must convert or be refused cleanly, and serialise back to the same content.
    for (const auto& [name, tensor] : file.tensors) {
      try {
        if (tensor.dtype == Dtype::BOOL) {
          mha::io::to_bool_tensor(tensor, name);
        } else {
          mha::io::to_tensor<float>(tensor, name);
        }
      } catch (const FileError&) {
      }
    }
    CHECK(same_file(file, parse(mha::io::serialize_safetensors(file))));
  }
  // Flips that land in the data or in spaces leave a valid file.
  CHECK(parsed_count > 0);
}

// ---- layer parameters ------------------------------------------------------------------------

TEMPLATE_TEST_CASE("a layer's parameters save and load by their state_dict names",
                   "[safetensors][layer]", float, double) {
  using T = TestType;
  FakeLayer<T> saved;
  saved.parameters["in_proj_weight"] = Tensor<T>({3, 2}, {T(1), T(2), T(3), T(-4), T(0.5), T(6)});
  saved.parameters["out_proj.bias"] = Tensor<T>({2}, {T(0.25), T(-1)});
  const TempPath path("layer");
  mha::io::save_parameters(saved, path.str(), {{"embed_dim", "2"}});

  const SafetensorsFile file = mha::io::read_safetensors(path.str());
  CHECK(file.metadata.at("embed_dim") == "2");
  CHECK(file.at("in_proj_weight").dtype == (std::is_same_v<T, float> ? Dtype::F32 : Dtype::F64));

  FakeLayer<T> loaded;
  mha::io::load_parameters(loaded, path.str());
  REQUIRE(loaded.parameters.size() == 2);
  for (const auto& [name, tensor] : saved.parameters) {
    INFO(name);
    check_identical(tensor, loaded.parameters.at(name));
  }

  SECTION("names absent from the file are skipped, extra tensors ignored") {
    SafetensorsFile partial;
    partial.tensors["out_proj.bias"] = mha::io::from_tensor_as(Tensor<T>({1}, {T(3)}), Dtype::F16);
    partial.tensors["unrelated"] = mha::io::from_tensor(Tensor<float>({1}, {1.0f}));
    const auto state = mha::io::read_state_dict<T>(partial, {"in_proj_weight", "out_proj.bias"});
    REQUIRE(state.size() == 1);
    CHECK(state.at("out_proj.bias")(0) == T(3));
  }
  SECTION("a parameter of the wrong dtype is refused, naming the file and the tensor") {
    SafetensorsFile wrong;
    wrong.tensors["in_proj_weight"] = mha::io::from_tensor(Tensor<bool>({1}, {true}));
    mha::io::write_safetensors(path.str(), wrong);
    const std::string message = file_error([&] { mha::io::load_parameters(loaded, path.str()); });
    CHECK(contains(message, path.str()));
    CHECK(contains(message, "tensor 'in_proj_weight'"));
    CHECK(contains(message, "got BOOL"));
  }
}
