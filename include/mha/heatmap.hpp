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
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

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
inline Rgb heatmap_colour(ColourMap map, double t) {
  // Nine evenly spaced stops of each matplotlib map, linearly interpolated between.
  static const std::uint32_t kBlues[9] = {0xf7fbff, 0xdeebf7, 0xc6dbef, 0x9ecae1, 0x6baed6,
                                          0x4292c6, 0x2171b5, 0x08519c, 0x08306b};
  static const std::uint32_t kGreys[9] = {0xffffff, 0xf0f0f0, 0xd9d9d9, 0xbdbdbd, 0x969696,
                                          0x737373, 0x525252, 0x252525, 0x000000};
  static const std::uint32_t kViridis[9] = {0x440154, 0x472d7b, 0x3b528b, 0x2c728e, 0x21918c,
                                            0x28ae80, 0x5ec962, 0xaddc30, 0xfde725};
  const std::uint32_t* stops = map == ColourMap::kGreys     ? kGreys
                               : map == ColourMap::kViridis ? kViridis
                                                            : kBlues;
  const double clamped = t > 0 ? std::min(t, 1.0) : 0.0;
  const double position = clamped * 8.0;
  const int low = std::min(static_cast<int>(position), 7);
  const double f = position - low;
  const auto channel = [&](int shift) {
    const auto a = static_cast<double>((stops[low] >> shift) & 0xffu);
    const auto b = static_cast<double>((stops[low + 1] >> shift) & 0xffu);
    return static_cast<std::uint8_t>(std::lround(a + (b - a) * f));
  };
  return Rgb{channel(16), channel(8), channel(0)};
}

// "#rrggbb", as SVG writes colours.
inline std::string to_hex(const Rgb& colour) {
  char text[8];  // exactly "#rrggbb" and its terminator: snprintf cannot fail or truncate
  (void)std::snprintf(text, sizeof text, "#%02x%02x%02x", colour.r, colour.g, colour.b);
  return text;
}

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

inline std::vector<std::string> numbered_labels(Index count) {
  std::vector<std::string> labels;
  for (Index i = 0; i < count; ++i) labels.push_back(std::to_string(i));
  return labels;
}

inline HeatmapData collect_heatmap(const HeatmapWeights& weights,
                                   const std::vector<std::string>& query_labels,
                                   const std::vector<std::string>& key_labels,
                                   const HeatmapOptions& options) {
  const Shape& shape = weights.shape();
  const std::string shape_text = format_shape(shape);
  const auto rank = static_cast<Index>(shape.size());
  if (rank < 2 || rank > 4) {
    throw_shape("weights",
                "[B, H, L, S], [H, L, S], [B, L, S] or [L, S] (the attn_weights of a forward "
                "with need_weights)",
                shape);
  }
  // Which axes are there: a batch axis, a head axis, or neither.
  const bool has_batch = rank == 4 || (rank == 3 && options.rank3 == Rank3Weights::kBatch);
  const bool has_heads = rank == 4 || (rank == 3 && options.rank3 == Rank3Weights::kHeads);
  const Index batches = has_batch ? shape[0] : 1;
  const Index heads = has_heads ? shape[static_cast<std::size_t>(rank - 3)] : 1;
  const Index rows = shape[static_cast<std::size_t>(rank - 2)];
  const Index cols = shape[static_cast<std::size_t>(rank - 1)];
  if (rows == 0 || cols == 0 || batches == 0 || heads == 0) {
    throw_shape("weights", "at least one query, one key and one head", shape);
  }
  if (!has_batch && options.batch != 0) {
    throw_argument("options.batch", "weights " + shape_text +
                                        " have no batch axis, so the batch index must be 0; got " +
                                        std::to_string(options.batch));
  }
  if (options.batch < 0 || options.batch >= batches) {
    throw_argument("options.batch", "batch index " + std::to_string(options.batch) +
                                        " is out of range for weights " + shape_text +
                                        " (B = " + std::to_string(batches) + ")");
  }
  if (!has_heads && !options.heads.empty()) {
    throw_argument("options.heads", "weights " + shape_text +
                                        " are averaged over the heads ([B, L, S] or [L, S]); "
                                        "there are no heads to choose");
  }
  for (Index head : options.heads) {
    if (head < 0 || head >= heads) {
      throw_argument("options.heads", "head " + std::to_string(head) +
                                          " is out of range for weights " + shape_text +
                                          " (H = " + std::to_string(heads) + ")");
    }
  }
  if (!query_labels.empty() && static_cast<Index>(query_labels.size()) != rows) {
    throw_shape("query_labels",
                std::to_string(rows) + " labels, one per query (L of weights " + shape_text + ")",
                {static_cast<Index>(query_labels.size())});
  }
  if (!key_labels.empty() && static_cast<Index>(key_labels.size()) != cols) {
    throw_shape("key_labels",
                std::to_string(cols) + " labels, one per key (S of weights " + shape_text +
                    ", bias_k and zero-attention keys included)",
                {static_cast<Index>(key_labels.size())});
  }
  if (options.cell_size < 1 || options.columns < 1 || options.max_label_chars < 1 ||
      options.font_size < 1 || options.png_scale < 1) {
    throw_argument("options",
                   "cell_size, columns, max_label_chars, font_size and png_scale must be >= 1");
  }
  if (!(options.scale_max >= 0) || !std::isfinite(options.scale_max)) {
    throw_argument("options.scale_max",
                   "must be 0 (the largest weight) or a positive number; got " +
                       std::to_string(options.scale_max));
  }

  std::vector<Index> drawn = options.heads;
  if (drawn.empty()) {
    for (Index h = 0; h < heads; ++h) drawn.push_back(h);
  }
  if (!options.panel_titles.empty() && options.panel_titles.size() != drawn.size()) {
    throw_shape("options.panel_titles",
                std::to_string(drawn.size()) + " titles, one per panel drawn",
                {static_cast<Index>(options.panel_titles.size())});
  }

  HeatmapData data;
  data.rows = rows;
  data.cols = cols;
  data.title = options.title;
  data.query_labels = query_labels.empty() ? numbered_labels(rows) : query_labels;
  data.key_labels = key_labels.empty() ? numbered_labels(cols) : key_labels;
  double largest = 0;
  for (std::size_t p = 0; p < drawn.size(); ++p) {
    const Index head = drawn[p];
    const Index first = (options.batch * heads + head) * rows * cols;
    std::vector<double> panel(static_cast<std::size_t>(rows * cols));
    for (Index k = 0; k < rows * cols; ++k) {
      const double w = weights[first + k];
      if (!std::isfinite(w) || w < 0) {
        Shape index;
        if (has_batch) index.push_back(options.batch);
        if (has_heads) index.push_back(head);
        index.push_back(k / cols);
        index.push_back(k % cols);
        std::ostringstream value;
        value << w;
        throw_argument("weights", "element " + format_shape(index) + " of " + shape_text + " is " +
                                      value.str() +
                                      "; attention weights must be finite and not negative");
      }
      largest = std::max(largest, w);
      panel[static_cast<std::size_t>(k)] = w;
    }
    data.panels.push_back(std::move(panel));
    data.panel_titles.push_back(!options.panel_titles.empty() ? options.panel_titles[p]
                                : has_heads                   ? "head " + std::to_string(head)
                                                              : std::string("mean of heads"));
  }
  data.scale_max = options.scale_max > 0 ? options.scale_max : largest > 0 ? largest : 1.0;
  return data;
}

// The number of characters of UTF-8 text (continuation bytes do not count).
inline Index utf8_length(const std::string& text) {
  Index chars = 0;
  for (char byte : text) chars += (static_cast<unsigned char>(byte) & 0xC0) != 0x80 ? 1 : 0;
  return chars;
}

// At most max_chars characters: longer text keeps its first max_chars - 1 and ends in `ellipsis`.
inline std::string shorten(const std::string& text, Index max_chars, const std::string& ellipsis) {
  if (utf8_length(text) <= max_chars) return text;
  std::string out;
  Index chars = 0;
  for (char byte : text) {
    const bool starts_char = (static_cast<unsigned char>(byte) & 0xC0) != 0x80;
    if (starts_char && ++chars > max_chars - 1) break;
    out += byte;
  }
  return out + ellipsis;
}

// "0", "0.5", "0.091": a weight for the colour bar, 3 decimals without trailing zeros.
inline std::string format_weight(double weight) {
  char text[32];  // a weight past 1e27 would be cut short, never overflow: no result to check
  (void)std::snprintf(text, sizeof text, "%.3f", weight);
  std::string out = text;
  out.erase(out.find_last_not_of('0') + 1);
  if (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

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

inline HeatmapLayout layout_heatmap(const HeatmapData& data, const HeatmapOptions& options,
                                    Index text_height,
                                    const std::function<Index(const std::string&)>& text_width) {
  HeatmapLayout layout;
  const Index h = text_height;
  const Index pad = std::max<Index>(3, h / 3);
  const Index margin = h;
  const Index gap = 2 * h;  // between panels
  const Index cell = options.cell_size;
  layout.cell = cell;

  Index query_width = 0, key_width = 0, title_width = 0;
  for (const std::string& label : data.query_labels) {
    query_width = std::max(query_width, text_width(label));
  }
  for (const std::string& label : data.key_labels) {
    key_width = std::max(key_width, text_width(label));
  }
  for (const std::string& title : data.panel_titles) {
    title_width = std::max(title_width, text_width(title));
  }
  const Index grid_width = data.cols * cell, grid_height = data.rows * cell;
  // Panel: title; key labels standing on the grid; query labels left of it.
  const Index left = query_width + pad;
  const Index panel_width = left + std::max(grid_width, title_width);
  const Index grid_top = h + pad + key_width + pad;  // from the panel's top
  const Index panel_height = grid_top + grid_height;

  const auto panels = static_cast<Index>(data.panels.size());
  const Index columns = std::min(options.columns, panels);
  const Index panel_rows = (panels + columns - 1) / columns;
  const Index top = margin + (data.title.empty() ? 0 : h + 2 * pad);
  if (!data.title.empty()) {
    layout.texts.push_back({data.title, margin, margin});
    layout.texts.back().bold = true;
  }

  for (Index p = 0; p < panels; ++p) {
    const Index px = margin + (p % columns) * (panel_width + gap);
    const Index py = top + (p / columns) * (panel_height + gap);
    const Index gx = px + left, gy = py + grid_top;
    layout.grid_x.push_back(gx);
    layout.grid_y.push_back(gy);
    layout.texts.push_back({data.panel_titles[static_cast<std::size_t>(p)], gx, py});
    layout.texts.back().bold = true;
    for (Index i = 0; i < data.rows; ++i) {
      TextItem label{data.query_labels[static_cast<std::size_t>(i)], gx - pad,
                     gy + i * cell + (cell - h) / 2};
      label.anchor = TextItem::kEnd;
      layout.texts.push_back(label);
    }
    for (Index j = 0; j < data.cols; ++j) {
      TextItem label{data.key_labels[static_cast<std::size_t>(j)], gx + j * cell + (cell - h) / 2,
                     gy - pad};
      label.rotated = true;
      layout.texts.push_back(label);
    }
  }

  // The colour bar, right of the panels, level with the first row of grids.
  const Index panels_right = margin + columns * panel_width + (columns - 1) * gap;
  layout.bar_x = panels_right + gap;
  layout.bar_y = top + grid_top;
  layout.bar_width = std::max(cell, h);
  layout.bar_height = std::max(grid_height, 6 * h);
  layout.tick_length = pad;
  // The caption clears the top tick's label, which is centred on the bar's top.
  layout.texts.push_back({"weight", layout.bar_x, layout.bar_y - h / 2 - pad - h});
  Index label_width = text_width("weight");
  for (int k = 0; k <= 2; ++k) {
    const double value = data.scale_max * k / 2.0;
    const Index y = layout.bar_y + layout.bar_height - 1 - (layout.bar_height - 1) * k / 2;
    layout.tick_value.push_back(value);
    layout.tick_y.push_back(y);
    const std::string text = format_weight(value);
    const Index x = layout.bar_width + 2 * pad;  // from the bar's left
    layout.texts.push_back({text, layout.bar_x + x, y - h / 2});
    label_width = std::max(label_width, x + text_width(text));
  }
  layout.width = layout.bar_x + label_width + margin;
  layout.height = std::max(top + panel_rows * panel_height + (panel_rows - 1) * gap,
                           layout.bar_y + layout.bar_height + h) +
                  margin;
  return layout;
}

// Text for XML character data and attribute values.
inline std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 at all.
        out += static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' ? ' ' : c;
    }
  }
  return out;
}

inline std::string svg_number(double value) {
  char text[32];  // "%.6g" is at most 13 characters
  (void)std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

// Writes a picture already encoded in memory (so that bad arguments leave no file behind) to
// `path`, created or replaced.
inline void save_picture(const std::string& path, const std::string& bytes) {
  std::ofstream file(path, std::ios::binary);
  if (!file) {
    // std::strerror may share one buffer between threads; the category's message does not.
    const int error = errno;
    throw std::runtime_error("heatmap: cannot open " + path +
                             " for writing: " + std::generic_category().message(error));
  }
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  if (!file) throw std::runtime_error("heatmap: cannot write " + path);
}

}  // namespace detail

// Writes the heatmaps of `weights` as an SVG document. query_labels has L entries and key_labels
// S (either may be empty: numbered 0, 1, ...). Throws mha::ShapeError for a weights tensor of the
// wrong rank, label counts that differ from L and S, a batch or head index out of range, and NaN,
// infinite or negative weights.
inline void write_heatmap_svg(std::ostream& out, const HeatmapWeights& weights,
                              const std::vector<std::string>& query_labels,
                              const std::vector<std::string>& key_labels,
                              const HeatmapOptions& options = {}) {
  detail::HeatmapData data = detail::collect_heatmap(weights, query_labels, key_labels, options);
  for (auto* labels : {&data.query_labels, &data.key_labels}) {
    for (std::string& label : *labels) {
      label = detail::shorten(label, options.max_label_chars, "\xE2\x80\xA6");  // "…"
    }
  }
  const Index font = options.font_size;
  // A monospace font's advance is about 0.6 em; a generous estimate only wastes some margin.
  const auto text_width = [font](const std::string& text) {
    return (detail::utf8_length(text) * font * 62 + 99) / 100;
  };
  const detail::HeatmapLayout layout = detail::layout_heatmap(data, options, font, text_width);
  const auto number = [](Index value) { return std::to_string(value); };
  const Index ascent = (font * 4 + 4) / 5;  // baseline below the text box's top

  std::string svg;
  svg += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + number(layout.width) +
         "\" height=\"" + number(layout.height) + "\" viewBox=\"0 0 " + number(layout.width) + " " +
         number(layout.height) + "\" font-family=\"DejaVu Sans Mono, Menlo, Consolas, " +
         "monospace\" font-size=\"" + number(font) + "\">\n";
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  // The colour bar's gradient, sampled from the colour map (top = scale_max).
  svg += "<defs><linearGradient id=\"mha-colour-scale\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">\n";
  for (int k = 0; k <= 16; ++k) {
    const double t = k / 16.0;
    svg += "<stop offset=\"" + detail::svg_number(t) + "\" stop-color=\"" +
           to_hex(heatmap_colour(options.colour_map, t)) + "\"/>\n";
  }
  svg += "</linearGradient></defs>\n";

  for (std::size_t p = 0; p < data.panels.size(); ++p) {
    const Index gx = layout.grid_x[p], gy = layout.grid_y[p];
    svg += "<g class=\"panel\" data-title=\"" + detail::xml_escape(data.panel_titles[p]) + "\">\n";
    for (Index i = 0; i < data.rows; ++i) {
      for (Index j = 0; j < data.cols; ++j) {
        const double w = data.panels[p][static_cast<std::size_t>(i * data.cols + j)];
        svg += "<rect class=\"cell\" data-query=\"" + number(i) + "\" data-key=\"" + number(j) +
               "\" data-weight=\"" + detail::svg_number(w) + "\" x=\"" +
               number(gx + j * layout.cell) + "\" y=\"" + number(gy + i * layout.cell) +
               "\" width=\"" + number(layout.cell) + "\" height=\"" + number(layout.cell) +
               "\" fill=\"" + to_hex(heatmap_colour(options.colour_map, w / data.scale_max)) +
               "\"><title>" +
               detail::xml_escape(data.query_labels[static_cast<std::size_t>(i)] + " -> " +
                                  data.key_labels[static_cast<std::size_t>(j)] + ": " +
                                  detail::svg_number(w)) +
               "</title></rect>\n";
      }
    }
    svg += "<rect x=\"" + number(gx) + "\" y=\"" + number(gy) + "\" width=\"" +
           number(data.cols * layout.cell) + "\" height=\"" + number(data.rows * layout.cell) +
           "\" fill=\"none\" stroke=\"#888888\" stroke-width=\"1\"/>\n";
    svg += "</g>\n";
  }

  svg += "<g class=\"colour-bar\" data-max=\"" + detail::svg_number(data.scale_max) + "\">\n";
  svg += "<rect x=\"" + number(layout.bar_x) + "\" y=\"" + number(layout.bar_y) + "\" width=\"" +
         number(layout.bar_width) + "\" height=\"" + number(layout.bar_height) +
         "\" fill=\"url(#mha-colour-scale)\" stroke=\"#888888\" stroke-width=\"1\"/>\n";
  for (Index y : layout.tick_y) {
    svg += "<line x1=\"" + number(layout.bar_x + layout.bar_width) + "\" y1=\"" + number(y) +
           "\" x2=\"" + number(layout.bar_x + layout.bar_width + layout.tick_length) + "\" y2=\"" +
           number(y) + "\" stroke=\"#444444\" stroke-width=\"1\"/>\n";
  }
  svg += "</g>\n";

  for (const detail::TextItem& item : layout.texts) {
    const std::string weight = item.bold ? " font-weight=\"bold\"" : "";
    if (item.rotated) {
      svg += "<text transform=\"translate(" + number(item.x + ascent) + " " + number(item.y) +
             ") rotate(-90)\"" + weight + ">" + detail::xml_escape(item.text) + "</text>\n";
    } else {
      const std::string anchor =
          item.anchor == detail::TextItem::kEnd ? " text-anchor=\"end\"" : "";
      svg += "<text x=\"" + number(item.x) + "\" y=\"" + number(item.y + ascent) + "\"";
      svg += anchor;
      svg += weight;
      svg += ">" + detail::xml_escape(item.text) + "</text>\n";
    }
  }
  svg += "</svg>\n";
  out.write(svg.data(), static_cast<std::streamsize>(svg.size()));
}

// The same, into a file (created or replaced). Throws std::runtime_error when it cannot be
// written.
inline void save_heatmap_svg(const std::string& path, const HeatmapWeights& weights,
                             const std::vector<std::string>& query_labels,
                             const std::vector<std::string>& key_labels,
                             const HeatmapOptions& options = {}) {
  std::ostringstream svg;
  write_heatmap_svg(svg, weights, query_labels, key_labels, options);
  detail::save_picture(path, svg.str());
}

}  // namespace mha
