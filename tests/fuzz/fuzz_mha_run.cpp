// Fuzz target: mha_run's whole input handling. The bytes are the IN file of mha_run; it is parsed
// and given to mha::tools::run_multihead_attention, as mha_run's main does.
// Properties: no crash, no exception but mha::ShapeError and mha::io::FileError (what mha_run
// reports as bad input), and an accepted input gives an output of query's shape that writes
// back to a file.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "mha_run.hpp"

namespace {

mha_fuzz::Tally tally("fuzz_mha_run",
                      {"not a safetensors file (FileError)", "skipped (unbacked huge input)",
                       "refused by mha_run (ShapeError, FileError)", "ran"});

// An input tensor with no elements is backed by no bytes, so its other dimensions are free: a
// 300-byte file can hold query [2^40, 0, E], a legitimately shaped problem whose add_zero_attn
// key rows alone take terabytes, as they would in PyTorch. mha_run reports the std::bad_alloc
// as "out of memory", but libFuzzer stops at any allocation above -rss_limit_mb as if it were a
// crash, so such inputs are skipped. Every other size is bounded by the input's length (and
// empty parameters, which would set E, are refused by mha_run itself).
constexpr mha::Index kMaxUnbackedDim = 4096;

bool has_unbacked_huge_input(const mha::io::SafetensorsFile& file) {
  for (const auto& [name, tensor] : file.tensors) {
    if (!tensor.bytes.empty() || mha::tools::detail::input_names().count(name) == 0) continue;
    for (mha::Index dim : tensor.shape) {
      if (dim > kMaxUnbackedDim) return true;
    }
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using mha_fuzz::violation;
  mha::io::SafetensorsFile in;
  try {
    in = mha::io::parse_safetensors(data, size);
  } catch (const mha::io::FileError&) {
    tally.count(0);
    return 0;
  }
  if (has_unbacked_huge_input(in)) {
    tally.count(1);
    return 0;
  }
  mha::io::SafetensorsFile out;
  try {
    out = mha::tools::run_multihead_attention(in);
  } catch (const mha::ShapeError&) {
    tally.count(2);
    return 0;
  } catch (const mha::io::FileError&) {
    tally.count(2);
    return 0;
  }
  tally.count(3);
  if (!out.has("output") || out.at("output").shape != in.at("query").shape) {
    violation("the output is missing or not of query's shape");
  }
  try {
    mha::io::serialize_safetensors(out);
  } catch (const mha::io::FileError& error) {
    violation(std::string("the output does not write: ") + error.what());
  }
  return 0;
}
