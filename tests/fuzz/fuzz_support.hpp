// What the fuzz targets share: how a broken property is reported (a message, then abort(), which
// libFuzzer records as a crash with its input and the replay test as a failure), and the counts
// of inputs by outcome, printed at exit: the figures of a fuzzing run (how many malformed inputs
// were tried, how many reached the code behind the checks); and the reading of an input as a
// stream of choices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "mha/tensor.hpp"

namespace mha_fuzz {

[[noreturn]] inline void violation(const std::string& message) {
  std::fprintf(stderr, "fuzz property violated: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

// Inputs counted by outcome, e.g. {"malformed", "ran"}; one per target, a static, so that its
// destructor prints the counts at the normal exit of libFuzzer or of the replay.
class Tally {
 public:
  Tally(const char* target, std::vector<const char*> outcomes)
      : target_(target), outcomes_(std::move(outcomes)), counts_(outcomes_.size(), 0) {}
  Tally(const Tally&) = delete;
  Tally& operator=(const Tally&) = delete;
  ~Tally() {
    unsigned long long total = 0;
    std::string parts;
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      total += counts_[i];
      parts += std::string(i ? ", " : "") + std::to_string(counts_[i]) + " " + outcomes_[i];
    }
    std::fprintf(stderr, "%s: %llu inputs: %s\n", target_, total, parts.c_str());
  }

  // Counts one input with outcome `index` (into the outcomes given at construction).
  void count(std::size_t index) { ++counts_[index]; }

 private:
  const char* target_;
  std::vector<const char*> outcomes_;
  std::vector<unsigned long long> counts_;
};

// Reads the fuzz input as a stream of choices; past its end every choice is the smallest, so a
// short input is a small, plain case.
class Choices {
 public:
  Choices(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint8_t byte() { return position_ < size_ ? data_[position_++] : 0; }
  bool flag() { return (byte() & 1) != 0; }
  // Uniform enough in [low, high] for a fuzzer, which steers the bytes anyway.
  mha::Index in(mha::Index low, mha::Index high) {
    return low + static_cast<mha::Index>(byte() % static_cast<unsigned>(high - low + 1));
  }
  std::uint64_t seed() {
    std::uint64_t value = 0;
    for (int i = 0; i < 4; ++i) value = (value << 8) | byte();
    return value;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

}  // namespace mha_fuzz
