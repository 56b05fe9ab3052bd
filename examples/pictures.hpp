// What the examples share for their heatmap pictures: the --output-dir option, and writing one
// set of attention weights as SVG (mha/heatmap.hpp, always) and PNG (mha/io/heatmap_png.hpp,
// when the example is built with stb: CMake defines MHA_EXAMPLE_PNG where mha::png exists).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <mha/heatmap.hpp>
#ifdef MHA_EXAMPLE_PNG
#include <mha/io/heatmap_png.hpp>
#endif

namespace example_pictures {

inline constexpr const char* kUsage =
    "  --output-dir DIR  where the heatmap pictures go (default: the current directory)\n";

// Takes "--output-dir DIR" out of argv, so that the example's own parser never sees it, and
// puts DIR in `dir` ("" when the option is absent). False when --output-dir has no value.
inline bool take_output_dir(int& argc, char** argv, std::string& dir) {
  int kept = 1;
  for (int k = 1; k < argc; ++k) {
    if (std::string(argv[k]) == "--output-dir") {
      if (k + 1 >= argc) return false;
      dir = argv[++k];
    } else {
      argv[kept++] = argv[k];
    }
  }
  argc = kept;
  argv[argc] = nullptr;  // as main's argv ends
  return true;
}

// Writes <dir>/<stem>.svg, and <dir>/<stem>.png when built with stb, creating `dir` if needed.
// Returns the paths written. Throws what the writers throw (std::runtime_error when a file cannot
// be written, std::filesystem::filesystem_error when the directory cannot be made).
inline std::vector<std::string> write_heatmaps(const std::string& dir, const std::string& stem,
                                               const mha::HeatmapWeights& weights,
                                               const std::vector<std::string>& query_labels,
                                               const std::vector<std::string>& key_labels,
                                               const mha::HeatmapOptions& options) {
  if (!dir.empty()) std::filesystem::create_directories(dir);
  const auto path = [&](const char* extension) {
    return dir.empty() ? stem + extension
                       : (std::filesystem::path(dir) / (stem + extension)).string();
  };
  std::vector<std::string> written;
  written.push_back(path(".svg"));
  mha::save_heatmap_svg(written.back(), weights, query_labels, key_labels, options);
#ifdef MHA_EXAMPLE_PNG
  written.push_back(path(".png"));
  mha::save_heatmap_png(written.back(), weights, query_labels, key_labels, options);
#endif
  return written;
}

}  // namespace example_pictures
