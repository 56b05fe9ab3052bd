// The definitions of mha/heatmap.hpp's functions: included by it header-only, and compiled once
// into mha::compiled by src/functions.cpp (see MHA_FUNCTION in mha/compiled.hpp).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "mha/heatmap.hpp"

namespace mha {
MHA_FUNCTION Rgb heatmap_colour(ColourMap map, double t) {
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

MHA_FUNCTION std::string to_hex(const Rgb& colour) {
  char text[8];  // exactly "#rrggbb" and its terminator: snprintf cannot fail or truncate
  (void)std::snprintf(text, sizeof text, "#%02x%02x%02x", colour.r, colour.g, colour.b);
  return text;
}

namespace detail {
MHA_FUNCTION std::vector<std::string> numbered_labels(Index count) {
  std::vector<std::string> labels;
  for (Index i = 0; i < count; ++i) labels.push_back(std::to_string(i));
  return labels;
}

MHA_FUNCTION HeatmapData collect_heatmap(const HeatmapWeights& weights,
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

MHA_FUNCTION Index utf8_length(const std::string& text) {
  Index chars = 0;
  for (char byte : text) chars += (static_cast<unsigned char>(byte) & 0xC0) != 0x80 ? 1 : 0;
  return chars;
}

MHA_FUNCTION std::string shorten(const std::string& text, Index max_chars,
                                 const std::string& ellipsis) {
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

MHA_FUNCTION std::string format_weight(double weight) {
  char text[32];  // a weight past 1e27 would be cut short, never overflow: no result to check
  (void)std::snprintf(text, sizeof text, "%.3f", weight);
  std::string out = text;
  out.erase(out.find_last_not_of('0') + 1);
  if (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

MHA_FUNCTION HeatmapLayout
layout_heatmap(const HeatmapData& data, const HeatmapOptions& options, Index text_height,
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

MHA_FUNCTION std::string xml_escape(const std::string& text) {
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

MHA_FUNCTION std::string svg_number(double value) {
  char text[32];  // "%.6g" is at most 13 characters
  (void)std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

MHA_FUNCTION void save_picture(const std::string& path, const std::string& bytes) {
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
MHA_FUNCTION void write_heatmap_svg(std::ostream& out, const HeatmapWeights& weights,
                                    const std::vector<std::string>& query_labels,
                                    const std::vector<std::string>& key_labels,
                                    const HeatmapOptions& options) {
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

MHA_FUNCTION void save_heatmap_svg(const std::string& path, const HeatmapWeights& weights,
                                   const std::vector<std::string>& query_labels,
                                   const std::vector<std::string>& key_labels,
                                   const HeatmapOptions& options) {
  std::ostringstream svg;
  write_heatmap_svg(svg, weights, query_labels, key_labels, options);
  detail::save_picture(path, svg.str());
}

}  // namespace mha
