// What the fuzz targets share: how a broken property is reported (a message, then abort(), which
// libFuzzer records as a crash with its input and the replay test as a failure), and the counts
// of inputs by outcome, printed at exit: the figures of a fuzzing run (how many malformed inputs
// were tried, how many reached the code behind the checks).
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

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

}  // namespace mha_fuzz
