// Attention heatmaps as PNG pictures: the layout of mha/heatmap.hpp (panels, labels on both
// axes, the shared colour bar) drawn into pixels, with stb_easy_font for the text and
// stb_image_write for the file.
//
// Needs stb (Debian: apt-get install libstb-dev) and links Debian's compiled libstb rather than
// compiling stb_image_write into this header: a header-only library is included by many
// translation units, and STB_IMAGE_WRITE_IMPLEMENTATION must be defined in exactly one of them,
// which a header cannot arrange (and a static copy per unit would clash with a program that
// includes stb_image_write.h itself). With CMake, link mha::png, which exists when stb was found;
// by hand, add `pkg-config --cflags --libs stb`. stb_easy_font.h is all static functions and
// needs no library.
//
// The text is ASCII only (stb_easy_font's glyphs): other characters of a label are drawn as '?'.
// Shapes, options and the colour scale are as for write_heatmap_svg; every length of the SVG is
// multiplied by HeatmapOptions::png_scale.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mha/heatmap.hpp"

// stb's headers are C, written for their own warning level, not ours.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wsign-conversion"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wcast-align"
#pragma GCC diagnostic ignored "-Wshadow"
#endif
// pkg-config's include directory is .../include/stb; Debian's headers are also reachable as
// <stb/...> without it.
#if __has_include(<stb_image_write.h>)
#include <stb_easy_font.h>
#include <stb_image_write.h>
#else
#include <stb/stb_easy_font.h>
#include <stb/stb_image_write.h>
#endif
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace mha {

// An RGB picture, row-major, 3 bytes a pixel.
struct HeatmapImage {
  Index width = 0, height = 0;
  std::vector<std::uint8_t> rgb;

  Rgb at(Index x, Index y) const {
    const auto i = static_cast<std::size_t>((y * width + x) * 3);
    return Rgb{rgb[i], rgb[i + 1], rgb[i + 2]};
  }
};

namespace detail {

// stb_easy_font's glyphs span 9 units from the top of the text (caps 7, descenders 2 more).
constexpr Index kEasyFontHeight = 9;

// Characters stb_easy_font has a glyph for, one '?' per other UTF-8 character (it indexes its
// table with the byte, so anything outside 32..126 must not reach it).
inline std::string printable_ascii(const std::string& text) {
  std::string out;
  for (char byte : text) {
    const auto c = static_cast<unsigned char>(byte);
    if (c >= 32 && c < 127) {
      out += byte;
    } else if ((c & 0xC0) != 0x80) {
      out += '?';
    }
  }
  return out;
}

inline Index easy_font_width(const std::string& text) {
  std::string copy = text;  // stb_easy_font takes char*
  return stb_easy_font_width(copy.data());
}

class Canvas {
 public:
  explicit Canvas(HeatmapImage& image) : image_(image) {}

  // Fills [x0, x1) x [y0, y1), clipped to the picture.
  void fill(Index x0, Index y0, Index x1, Index y1, Rgb colour) {
    x0 = std::max<Index>(x0, 0);
    y0 = std::max<Index>(y0, 0);
    x1 = std::min(x1, image_.width);
    y1 = std::min(y1, image_.height);
    for (Index y = y0; y < y1; ++y) {
      for (Index x = x0; x < x1; ++x) {
        const auto i = static_cast<std::size_t>((y * image_.width + x) * 3);
        image_.rgb[i] = colour.r;
        image_.rgb[i + 1] = colour.g;
        image_.rgb[i + 2] = colour.b;
      }
    }
  }

  // A one-pixel outline just outside [x0, x1) x [y0, y1).
  void frame(Index x0, Index y0, Index x1, Index y1, Rgb colour) {
    fill(x0 - 1, y0 - 1, x1 + 1, y0, colour);
    fill(x0 - 1, y1, x1 + 1, y1 + 1, colour);
    fill(x0 - 1, y0, x0, y1, colour);
    fill(x1, y0, x1 + 1, y1, colour);
  }

  // Text as TextItem places it, each stb_easy_font quad (an axis-aligned rectangle of font units)
  // scaled by `scale`; bold text is drawn twice, one pixel apart.
  void text(const TextItem& item, Index scale, Index width, Rgb colour) {
    std::string copy = item.text;
    std::vector<char> quads((copy.size() + 1) * 12 * 64);  // a glyph has at most 11 quads
    const int count = stb_easy_font_print(0, 0, copy.data(), nullptr, quads.data(),
                                          static_cast<int>(quads.size()));
    const Index x0 = item.anchor == TextItem::kEnd ? item.x - width : item.x;
    for (Index boldness = 0; boldness < (item.bold ? 2 : 1); ++boldness) {
      for (int q = 0; q < count; ++q) {
        // Vertices 0 and 2 of a quad are opposite corners; 16 bytes a vertex, x and y first.
        float corner[2][2];
        std::memcpy(corner[0], quads.data() + static_cast<std::ptrdiff_t>(q) * 64,
                    sizeof corner[0]);
        std::memcpy(corner[1], quads.data() + static_cast<std::ptrdiff_t>(q) * 64 + 32,
                    sizeof corner[1]);
        const Index u0 = static_cast<Index>(corner[0][0]) * scale;
        const Index v0 = static_cast<Index>(corner[0][1]) * scale;
        const Index u1 = static_cast<Index>(corner[1][0]) * scale;
        const Index v1 = static_cast<Index>(corner[1][1]) * scale;
        if (item.rotated) {  // u runs up from (x, y), v runs right from x
          fill(item.x + v0, item.y - u1 - boldness, item.x + v1, item.y - u0 - boldness, colour);
        } else {
          fill(x0 + u0 + boldness, item.y + v0, x0 + u1 + boldness, item.y + v1, colour);
        }
      }
    }
  }

 private:
  HeatmapImage& image_;
};

}  // namespace detail

// The heatmaps of `weights` as pixels; arguments and checks as write_heatmap_svg.
inline HeatmapImage render_heatmap_image(const HeatmapWeights& weights,
                                         const std::vector<std::string>& query_labels,
                                         const std::vector<std::string>& key_labels,
                                         const HeatmapOptions& options = {}) {
  detail::HeatmapData data = detail::collect_heatmap(weights, query_labels, key_labels, options);
  for (auto* labels : {&data.query_labels, &data.key_labels}) {
    for (std::string& label : *labels) {
      label = detail::printable_ascii(detail::shorten(label, options.max_label_chars, "~"));
    }
  }
  for (std::string& title : data.panel_titles) title = detail::printable_ascii(title);
  data.title = detail::printable_ascii(data.title);

  const Index scale = options.png_scale;
  HeatmapOptions scaled = options;
  scaled.cell_size = options.cell_size * scale;
  const auto text_width = [scale](const std::string& text) {
    return detail::easy_font_width(text) * scale;
  };
  const detail::HeatmapLayout layout =
      detail::layout_heatmap(data, scaled, detail::kEasyFontHeight * scale, text_width);

  HeatmapImage image;
  image.width = layout.width;
  image.height = layout.height;
  image.rgb.assign(static_cast<std::size_t>(image.width * image.height * 3), 255);
  detail::Canvas canvas(image);
  const Rgb frame{0x88, 0x88, 0x88}, ink{0x22, 0x22, 0x22};
  const Index cell = layout.cell;
  for (std::size_t p = 0; p < data.panels.size(); ++p) {
    const Index gx = layout.grid_x[p], gy = layout.grid_y[p];
    for (Index i = 0; i < data.rows; ++i) {
      for (Index j = 0; j < data.cols; ++j) {
        const double w = data.panels[p][static_cast<std::size_t>(i * data.cols + j)];
        canvas.fill(gx + j * cell, gy + i * cell, gx + (j + 1) * cell, gy + (i + 1) * cell,
                    heatmap_colour(options.colour_map, w / data.scale_max));
      }
    }
    canvas.frame(gx, gy, gx + data.cols * cell, gy + data.rows * cell, frame);
  }
  // The colour bar: its bottom row is 0, its top row scale_max.
  for (Index y = 0; y < layout.bar_height; ++y) {
    const double t = layout.bar_height > 1 ? static_cast<double>(layout.bar_height - 1 - y) /
                                                 static_cast<double>(layout.bar_height - 1)
                                           : 1.0;
    canvas.fill(layout.bar_x, layout.bar_y + y, layout.bar_x + layout.bar_width,
                layout.bar_y + y + 1, heatmap_colour(options.colour_map, t));
  }
  canvas.frame(layout.bar_x, layout.bar_y, layout.bar_x + layout.bar_width,
               layout.bar_y + layout.bar_height, frame);
  for (Index y : layout.tick_y) {
    canvas.fill(layout.bar_x + layout.bar_width, y,
                layout.bar_x + layout.bar_width + layout.tick_length, y + 1, ink);
  }
  for (const detail::TextItem& item : layout.texts) {
    canvas.text(item, scale, text_width(item.text), ink);
  }
  return image;
}

// Writes the heatmaps as a PNG file's bytes. Throws as write_heatmap_svg, and std::runtime_error
// when stb cannot encode the picture.
inline void write_heatmap_png(std::ostream& out, const HeatmapWeights& weights,
                              const std::vector<std::string>& query_labels,
                              const std::vector<std::string>& key_labels,
                              const HeatmapOptions& options = {}) {
  const HeatmapImage image = render_heatmap_image(weights, query_labels, key_labels, options);
  const auto write = [](void* context, void* data, int size) {
    static_cast<std::ostream*>(context)->write(static_cast<const char*>(data), size);
  };
  const int ok = stbi_write_png_to_func(write, &out, static_cast<int>(image.width),
                                        static_cast<int>(image.height), 3, image.rgb.data(),
                                        static_cast<int>(image.width * 3));
  if (ok == 0) throw std::runtime_error("heatmap: stb_image_write could not encode the PNG");
}

// The same, into a file (created or replaced). Throws std::runtime_error when it cannot be
// written.
inline void save_heatmap_png(const std::string& path, const HeatmapWeights& weights,
                             const std::vector<std::string>& query_labels,
                             const std::vector<std::string>& key_labels,
                             const HeatmapOptions& options = {}) {
  std::ostringstream png;
  write_heatmap_png(png, weights, query_labels, key_labels, options);
  detail::save_picture(path, png.str());
}

}  // namespace mha
