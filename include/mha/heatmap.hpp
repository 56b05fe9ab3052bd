// Attention heatmaps as SVG pictures, with nothing but the standard library: one panel per head
// in a grid, query tokens down the left of each panel, key tokens (rotated) along its top, and
// one colour scale shared by all panels with a colour bar, in the manner of BertViz's head view.
//
// Shapes (letters as in mha/tensor.hpp): the attn_weights of a forward with need_weights,
//   [B, H, L, S]  batched, average_attn_weights = false: one panel per head of batch entry b
//   [H, L, S]     unbatched, per head (HeatmapOptions::rank3 = Rank3Weights::kHeads, the default)
//   [B, L, S]     batched, averaged over heads (Rank3Weights::kBatch): one panel
//   [L, S]        unbatched, averaged over heads: one panel
// A rank-3 tensor cannot be told apart by its shape, hence the option. S counts every key the
// weights have a column for, bias_k and zero-attention keys included, so key_labels has S
// entries.
//
// Colour scale: from 0 (the map's first colour, white for Blues) to scale_max (its last, the
// darkest), the same for every panel so that heads can be compared. scale_max defaults to the
// largest weight drawn, so that a flat head over many keys is not all white; set it to 1 for the
// absolute scale of probabilities. The colour bar gives the numbers.
//
// mha/io/heatmap_png.hpp draws the same layout as a PNG with stb (optional, target mha::png).
// The functions are defined in mha/heatmap_impl.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "mha/compiled.hpp"
#include "mha/errors.hpp"
#include "mha/tensor.hpp"

namespace mha {

// Colour maps from matplotlib. Blues and Greys get darker as the weight grows (the largest weight
// is the darkest cell); Viridis gets lighter, and is readable by colour-blind viewers and in
// greyscale print.
enum class ColourMap { kBlues, kGreys, kViridis };

// How a rank-3 weights tensor is read: [H, L, S] (an unbatched forward with
// average_attn_weights = false) or [B, L, S] (a batched forward with average_attn_weights = true).
enum class Rank3Weights { kHeads, kBatch };

struct Rgb {
  std::uint8_t r = 255, g = 255, b = 255;
  friend bool operator==(const Rgb& x, const Rgb& y) {
    return x.r == y.r && x.g == y.g && x.b == y.b;
  }
  friend bool operator!=(const Rgb& x, const Rgb& y) { return !(x == y); }
};

struct HeatmapOptions {
  std::string title;                      // above the panels; none when empty
  std::vector<Index> heads;               // the heads to draw, in this order; empty: all heads
  std::vector<std::string> panel_titles;  // one per panel drawn; empty: "head h" / "mean of heads"
  Index batch = 0;                        // the batch entry drawn from [B, H, L, S] or [B, L, S]
  Rank3Weights rank3 = Rank3Weights::kHeads;  // how a rank-3 weights tensor is read
  Index cell_size = 18;                       // the side of one weight's square, in pixels
  Index columns = 4;                          // panels per row of the grid
  ColourMap colour_map = ColourMap::kBlues;
  double scale_max = 0;        // the weight given the map's last colour; 0: the largest drawn
  Index max_label_chars = 14;  // longer labels are cut and end in an ellipsis
  Index font_size = 11;        // SVG text, in pixels (above cell_size, row labels overlap);
                               // the PNG uses its own bitmap font, 9 * png_scale pixels high
  Index png_scale = 2;         // PNG pixels per SVG pixel: cells of png_scale * cell_size
};

// The colour map's colour at t in [0, 1] (clamped; NaN counts as 0). Every cell of a heatmap of
// weight w has colour heatmap_colour(map, w / scale_max).
MHA_FUNCTION Rgb heatmap_colour(ColourMap map, double t);

// "#rrggbb", as SVG writes colours.
MHA_FUNCTION std::string to_hex(const Rgb& colour);

// The weights to draw, without a copy: any float or double Tensor or TensorView converts to it.
// It points into the tensor, so it is for passing to the functions below, not for keeping.
class HeatmapWeights {
 public:
  HeatmapWeights(const TensorView<const float>& view)  // NOLINT(google-explicit-constructor)
      : shape_(view.shape()), floats_(view.data()) {}
  HeatmapWeights(const TensorView<const double>& view)  // NOLINT(google-explicit-constructor)
      : shape_(view.shape()), doubles_(view.data()) {}
  HeatmapWeights(const TensorView<float>& view)  // NOLINT(google-explicit-constructor)
      : HeatmapWeights(TensorView<const float>(view)) {}
  HeatmapWeights(const TensorView<double>& view)  // NOLINT(google-explicit-constructor)
      : HeatmapWeights(TensorView<const double>(view)) {}
  HeatmapWeights(const Tensor<float>& tensor)  // NOLINT(google-explicit-constructor)
      : HeatmapWeights(tensor.view()) {}
  HeatmapWeights(const Tensor<double>& tensor)  // NOLINT(google-explicit-constructor)
      : HeatmapWeights(tensor.view()) {}

  const Shape& shape() const { return shape_; }
  // The element at a row-major flat index.
  double operator[](Index flat) const {
    return floats_ != nullptr ? static_cast<double>(floats_[flat]) : doubles_[flat];
  }

 private:
  Shape shape_;
  const float* floats_ = nullptr;
  const double* doubles_ = nullptr;
};

namespace detail {

// The panels to draw, their labels and the scale, checked and copied out of the weights.
struct HeatmapData {
  Index rows = 0, cols = 0;                 // L, S
  std::vector<std::vector<double>> panels;  // each [L, S] row-major
  std::vector<std::string> panel_titles;
  std::vector<std::string> query_labels, key_labels;  // L and S of them
  double scale_max = 1;
  std::string title;
};

MHA_FUNCTION std::vector<std::string> numbered_labels(Index count);

MHA_FUNCTION HeatmapData collect_heatmap(const HeatmapWeights& weights,
                                         const std::vector<std::string>& query_labels,
                                         const std::vector<std::string>& key_labels,
                                         const HeatmapOptions& options);

// The number of characters of UTF-8 text (continuation bytes do not count).
MHA_FUNCTION Index utf8_length(const std::string& text);

// At most max_chars characters: longer text keeps its first max_chars - 1 and ends in `ellipsis`.
MHA_FUNCTION std::string shorten(const std::string& text, Index max_chars,
                                 const std::string& ellipsis);

// "0", "0.5", "0.091": a weight for the colour bar, 3 decimals without trailing zeros.
MHA_FUNCTION std::string format_weight(double weight);

// One piece of text of the picture. Horizontal text: its box is [x, x + width] (kStart) or
// [x - width, x] (kEnd) by [y, y + height]. Rotated text reads bottom to top, starting at (x, y):
// its box is [x, x + height] by [y - width, y].
struct TextItem {
  enum Anchor { kStart, kEnd };
  std::string text;
  Index x = 0, y = 0;
  Anchor anchor = kStart;
  bool rotated = false;
  bool bold = false;
};

// Where everything goes, in whole pixels, shared by the SVG and PNG writers so that both draw
// the same picture. text_height and text_width come from the writer's font.
struct HeatmapLayout {
  Index width = 0, height = 0;
  Index cell = 0;
  std::vector<Index> grid_x, grid_y;  // the top-left corner of each panel's grid
  Index bar_x = 0, bar_y = 0, bar_width = 0, bar_height = 0;
  std::vector<Index> tick_y;  // the colour bar's ticks at 0, scale_max / 2, scale_max
  Index tick_length = 0;
  std::vector<double> tick_value;
  std::vector<TextItem> texts;
};

MHA_FUNCTION HeatmapLayout
layout_heatmap(const HeatmapData& data, const HeatmapOptions& options, Index text_height,
               const std::function<Index(const std::string&)>& text_width);

// Text for XML character data and attribute values.
MHA_FUNCTION std::string xml_escape(const std::string& text);

MHA_FUNCTION std::string svg_number(double value);

// Writes a picture already encoded in memory (so that bad arguments leave no file behind) to
// `path`, created or replaced.
MHA_FUNCTION void save_picture(const std::string& path, const std::string& bytes);

}  // namespace detail

// Writes the heatmaps of `weights` as an SVG document. query_labels has L entries and key_labels
// S (either may be empty: numbered 0, 1, ...). Throws mha::ShapeError for a weights tensor of the
// wrong rank, label counts that differ from L and S, a batch or head index out of range, and NaN,
// infinite or negative weights.
MHA_FUNCTION void write_heatmap_svg(std::ostream& out, const HeatmapWeights& weights,
                                    const std::vector<std::string>& query_labels,
                                    const std::vector<std::string>& key_labels,
                                    const HeatmapOptions& options = {});

// The same, into a file (created or replaced). Throws std::runtime_error when it cannot be
// written.
MHA_FUNCTION void save_heatmap_svg(const std::string& path, const HeatmapWeights& weights,
                                   const std::vector<std::string>& query_labels,
                                   const std::vector<std::string>& key_labels,
                                   const HeatmapOptions& options = {});

}  // namespace mha

#if MHA_FUNCTION_DEFINITIONS
#include "mha/heatmap_impl.hpp"
#endif
