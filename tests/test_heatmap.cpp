// Attention heatmap pictures (mha/heatmap.hpp, and mha/io/heatmap_png.hpp when built with stb).
// The SVG is read back with a small XML checker and a parser for the cells, so the tests check
// what the picture says (panels, each cell's weight and colour, labels), not that a writer ran.
// The PNG is decoded with stb_image and its pixels are checked where a known cell must be.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "helpers.hpp"
#include "mha/heatmap.hpp"

#ifdef MHA_TEST_PNG
#include "mha/io/heatmap_png.hpp"
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wsign-conversion"
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
// Declarations only: stbi_load comes from libstb, the library mha::png links for stbi_write.
#include <stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

using mha::Index;
using mha::Tensor;
using mha_test::contains;
using mha_test::message_of;

namespace {

const std::string kOutputDir = MHA_TEST_OUTPUT_DIR;

// ---- reading the SVG back ------------------------------------------------------------------

// Whether `svg` is well-formed as far as these pictures need: tags balanced and properly nested,
// attribute values quoted, no raw '<' or stray '&' in text or attributes. Returns "" or what is
// wrong.
std::string xml_problem(const std::string& svg) {
  std::vector<std::string> open;
  std::size_t at = 0;
  const auto check_entities = [](const std::string& text) {
    for (std::size_t k = text.find('&'); k != std::string::npos; k = text.find('&', k + 1)) {
      const std::size_t end = text.find(';', k);
      const std::string name = end == std::string::npos ? "" : text.substr(k + 1, end - k - 1);
      if (name != "amp" && name != "lt" && name != "gt" && name != "quot" && name != "apos") {
        return "stray '&' in \"" + text + "\"";
      }
    }
    return std::string();
  };
  while (at < svg.size()) {
    const std::size_t lt = svg.find('<', at);
    const std::string text = svg.substr(at, lt == std::string::npos ? std::string::npos : lt - at);
    if (!check_entities(text).empty()) return check_entities(text);
    if (text.find('>') != std::string::npos) return "raw '>' in text \"" + text + "\"";
    if (lt == std::string::npos) break;
    if (svg.compare(lt, 5, "<?xml") == 0) {
      at = svg.find("?>", lt) + 2;
      continue;
    }
    // Find the tag's end, skipping quoted attribute values.
    std::size_t k = lt + 1;
    char quote = 0;
    for (; k < svg.size(); ++k) {
      if (quote != 0) {
        if (svg[k] == quote) quote = 0;
        if (svg[k] == '<') return "raw '<' in an attribute value";
      } else if (svg[k] == '"' || svg[k] == '\'') {
        quote = svg[k];
      } else if (svg[k] == '>') {
        break;
      } else if (svg[k] == '<') {
        return "'<' inside a tag";
      }
    }
    if (k >= svg.size()) return "unterminated tag";
    const std::string tag = svg.substr(lt + 1, k - lt - 1);
    if (!check_entities(tag).empty()) return check_entities(tag);
    if (tag.empty()) return "empty tag";
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) {
        return "</" + name + "> closes <" + (open.empty() ? "nothing" : open.back()) + ">";
      }
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n\t")));
    }
    // After the name, attributes: name="value" or name='value', nothing else.
    std::size_t a = tag.find_first_of(" \n\t");
    const std::size_t attributes_end = tag.size() - (tag.back() == '/' ? 1 : 0);
    while (a != std::string::npos && a < attributes_end) {
      a = tag.find_first_not_of(" \n\t", a);
      if (a == std::string::npos || a >= attributes_end) break;
      const std::size_t equals = tag.find('=', a);
      if (equals == std::string::npos || equals + 1 >= tag.size() ||
          (tag[equals + 1] != '"' && tag[equals + 1] != '\'') ||
          tag.find_first_of(" \n\t", a) < equals) {
        return "unquoted attribute in <" + tag + ">";
      }
      const std::size_t value_end = tag.find(tag[equals + 1], equals + 2);
      if (value_end == std::string::npos) return "unterminated attribute in <" + tag + ">";
      a = value_end + 1;
    }
    at = k + 1;
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  return "";
}

// The value of attribute `name` in a tag's text, or "" when it has none.
std::string attribute(const std::string& tag, const std::string& name) {
  const std::string key = " " + name + "=\"";
  const std::size_t at = tag.find(key);
  if (at == std::string::npos) return "";
  const std::size_t begin = at + key.size();
  return tag.substr(begin, tag.find('"', begin) - begin);
}

struct Cell {
  Index panel = 0, query = 0, key = 0;
  double weight = 0;
  Index x = 0, y = 0, size = 0;
  std::string fill;
};

struct Picture {
  Index width = 0, height = 0;
  std::vector<std::string> panel_titles;
  std::vector<Cell> cells;
  std::string bar;  // the colour bar's <rect> tag
};

Picture read_svg(const std::string& svg) {
  Picture picture;
  const std::size_t root = svg.find("<svg ");
  const std::string root_tag = svg.substr(root, svg.find('>', root) - root);
  picture.width = std::stol(attribute(root_tag, "width"));
  picture.height = std::stol(attribute(root_tag, "height"));
  Index panel = -1;
  for (std::size_t at = svg.find('<'); at != std::string::npos; at = svg.find('<', at + 1)) {
    const std::string tag = svg.substr(at, svg.find('>', at) - at);
    if (tag.rfind("<g class=\"panel\"", 0) == 0) {
      ++panel;
      picture.panel_titles.push_back(attribute(tag, "data-title"));
    } else if (tag.rfind("<rect class=\"cell\"", 0) == 0) {
      Cell cell;
      cell.panel = panel;
      cell.query = std::stol(attribute(tag, "data-query"));
      cell.key = std::stol(attribute(tag, "data-key"));
      cell.weight = std::stod(attribute(tag, "data-weight"));
      cell.x = std::stol(attribute(tag, "x"));
      cell.y = std::stol(attribute(tag, "y"));
      cell.size = std::stol(attribute(tag, "width"));
      cell.fill = attribute(tag, "fill");
      picture.cells.push_back(cell);
    } else if (contains(tag, "url(#mha-colour-scale)")) {
      picture.bar = tag;
    }
  }
  return picture;
}

std::string svg_of(const mha::HeatmapWeights& weights, const std::vector<std::string>& queries,
                   const std::vector<std::string>& keys, const mha::HeatmapOptions& options = {}) {
  std::ostringstream out;
  mha::write_heatmap_svg(out, weights, queries, keys, options);
  return out.str();
}

double luminance(const mha::Rgb& c) {
  return 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b;
}

mha::Rgb from_hex(const std::string& hex) {
  const unsigned long value = std::stoul(hex.substr(1), nullptr, 16);
  return mha::Rgb{static_cast<std::uint8_t>(value >> 16), static_cast<std::uint8_t>(value >> 8),
                  static_cast<std::uint8_t>(value)};
}

// Softmax rows of seeded random scores: [B, H, L, S], every weight different.
Tensor<float> random_weights(const mha::Shape& shape, std::uint64_t seed) {
  Tensor<float> weights = mha_test::random_tensor<float>(shape, seed, 2.0);
  auto rows = weights.matrix();  // [B*H*L, S]
  for (Index r = 0; r < rows.rows(); ++r) {
    rows.row(r) = rows.row(r).array().exp();
    rows.row(r) /= rows.row(r).sum();
  }
  return weights;
}

std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

bool file_exists(const std::string& path) {
  return std::ifstream(path).good();
}

const std::vector<std::string> kQueries = {"The", "cat", "sat"};
const std::vector<std::string> kKeys = {"The", "cat", "sat", "[bias_k]"};

}  // namespace

TEST_CASE("the test's XML checker refuses malformed documents", "[heatmap]") {
  CHECK(xml_problem("<svg a=\"1\"><g><text>a &amp; b</text></g><rect x=\"1\"/></svg>").empty());
  CHECK(xml_problem("<svg><g></svg>") == "</svg> closes <g>");
  CHECK(xml_problem("<svg><g></g>") == "<svg> is never closed");
  CHECK(xml_problem("<svg><text>a & b</text></svg>") == "stray '&' in \"a & b\"");
  CHECK(xml_problem("<svg><text>a > b</text></svg>") == "raw '>' in text \"a > b\"");
  CHECK(xml_problem("<svg><rect x=1/></svg>") == "unquoted attribute in <rect x=1/>");
  CHECK(xml_problem("<svg><text a=\"<\">x</text></svg>") == "raw '<' in an attribute value");
}

TEST_CASE("heatmap colours: the map's ends, and darker for larger weights", "[heatmap]") {
  CHECK(mha::to_hex(mha::heatmap_colour(mha::ColourMap::kBlues, 0)) == "#f7fbff");
  CHECK(mha::to_hex(mha::heatmap_colour(mha::ColourMap::kBlues, 1)) == "#08306b");
  CHECK(mha::to_hex(mha::heatmap_colour(mha::ColourMap::kGreys, 1)) == "#000000");
  CHECK(mha::to_hex(mha::heatmap_colour(mha::ColourMap::kViridis, 0)) == "#440154");
  // Out of range and NaN are clamped, never garbage.
  CHECK(mha::heatmap_colour(mha::ColourMap::kBlues, 2) ==
        mha::heatmap_colour(mha::ColourMap::kBlues, 1));
  CHECK(mha::heatmap_colour(mha::ColourMap::kBlues, std::nan("")) ==
        mha::heatmap_colour(mha::ColourMap::kBlues, 0));
  for (int k = 1; k <= 200; ++k) {
    const double t = k / 200.0, before = (k - 1) / 200.0;
    INFO("t = " << t);
    for (auto map : {mha::ColourMap::kBlues, mha::ColourMap::kGreys}) {
      CHECK(luminance(mha::heatmap_colour(map, t)) <= luminance(mha::heatmap_colour(map, before)));
    }
    CHECK(luminance(mha::heatmap_colour(mha::ColourMap::kViridis, t)) >=
          luminance(mha::heatmap_colour(mha::ColourMap::kViridis, before)));
  }
}

TEST_CASE("heatmap SVG: well-formed, one panel per head, each cell its weight's colour",
          "[heatmap]") {
  const Index B = 2, H = 3, L = 3, S = 4;
  const Tensor<float> weights = random_weights({B, H, L, S}, 7);
  mha::HeatmapOptions options;
  options.batch = 1;
  options.columns = 2;
  const std::string svg = svg_of(weights, kQueries, kKeys, options);
  INFO(svg.substr(0, 400));
  CHECK(xml_problem(svg).empty());
  const Picture picture = read_svg(svg);

  REQUIRE(picture.panel_titles == std::vector<std::string>{"head 0", "head 1", "head 2"});
  REQUIRE(picture.cells.size() == static_cast<std::size_t>(H * L * S));
  // The shared scale: 0 to the largest weight drawn (batch entry 1 only).
  float largest = 0;
  for (Index h = 0; h < H; ++h) largest = std::max(largest, weights[1][h].matrix().maxCoeff());
  const Cell* darkest = nullptr;
  for (const Cell& cell : picture.cells) {
    INFO("panel " << cell.panel << " cell " << cell.query << ", " << cell.key);
    const double w = static_cast<double>(weights(1, cell.panel, cell.query, cell.key));
    CHECK(std::abs(cell.weight - w) <= 5e-6 * w);  // written with 6 digits
    CHECK(cell.fill == mha::to_hex(mha::heatmap_colour(mha::ColourMap::kBlues,
                                                       w / static_cast<double>(largest))));
    if (darkest == nullptr || luminance(from_hex(cell.fill)) < luminance(from_hex(darkest->fill))) {
      darkest = &cell;
    }
  }
  // The largest weight is the darkest cell, and has the map's last colour.
  REQUIRE(darkest != nullptr);
  CHECK(darkest->weight == Approx(static_cast<double>(largest)));
  CHECK(darkest->fill == "#08306b");
  // Colours never get lighter as the weight grows, across all panels (one shared scale).
  std::vector<Cell> by_weight = picture.cells;
  std::sort(by_weight.begin(), by_weight.end(),
            [](const Cell& a, const Cell& b) { return a.weight < b.weight; });
  for (std::size_t k = 1; k < by_weight.size(); ++k) {
    CHECK(luminance(from_hex(by_weight[k].fill)) <= luminance(from_hex(by_weight[k - 1].fill)));
  }

  // Cells of a panel are a grid of squares; panels do not overlap; the colour bar is right of
  // them all; everything is inside the picture.
  std::map<Index, std::array<Index, 4>> boxes;  // panel -> x0, y0, x1, y1
  for (const Cell& cell : picture.cells) {
    const Cell& first = picture.cells[static_cast<std::size_t>(cell.panel * L * S)];
    CHECK(cell.size == options.cell_size);
    CHECK(cell.x == first.x + cell.key * cell.size);
    CHECK(cell.y == first.y + cell.query * cell.size);
    auto box = boxes.emplace(cell.panel, std::array<Index, 4>{cell.x, cell.y, cell.x, cell.y});
    auto& b = box.first->second;
    b = {std::min(b[0], cell.x), std::min(b[1], cell.y), std::max(b[2], cell.x + cell.size),
         std::max(b[3], cell.y + cell.size)};
  }
  for (const auto& a : boxes) {
    CHECK(a.second[0] >= 0);
    CHECK(a.second[1] >= 0);
    CHECK(a.second[2] <= picture.width);
    CHECK(a.second[3] <= picture.height);
    for (const auto& b : boxes) {
      if (a.first >= b.first) continue;
      const bool apart = a.second[2] <= b.second[0] || b.second[2] <= a.second[0] ||
                         a.second[3] <= b.second[1] || b.second[3] <= a.second[1];
      CHECK(apart);
    }
  }
  // Two columns of panels: head 2 is below head 0.
  CHECK(boxes[2][0] == boxes[0][0]);
  CHECK(boxes[2][1] > boxes[0][3]);
  REQUIRE(!picture.bar.empty());
  const Index bar_x = std::stol(attribute(picture.bar, "x"));
  for (const auto& box : boxes) CHECK(bar_x > box.second[2]);
  CHECK(bar_x + std::stol(attribute(picture.bar, "width")) < picture.width);
  CHECK(contains(svg, "<g class=\"colour-bar\" data-max=\"" +
                          mha::detail::svg_number(static_cast<double>(largest)) + "\">"));
}

TEST_CASE("heatmap SVG: chosen heads, titles, a fixed scale, other colour maps", "[heatmap]") {
  const Tensor<float> weights = random_weights({1, 4, 3, 4}, 11);
  mha::HeatmapOptions options;
  options.heads = {3, 1};
  options.panel_titles = {"head 3: positional", "head 1: <copy>"};
  options.scale_max = 1;  // absolute: a weight w gets colour_map(w)
  options.colour_map = mha::ColourMap::kViridis;
  options.title = "layer 0 & friends";
  const std::string svg = svg_of(weights, kQueries, kKeys, options);
  CHECK(xml_problem(svg).empty());
  const Picture picture = read_svg(svg);
  REQUIRE(picture.panel_titles.size() == 2);
  CHECK(picture.panel_titles[1] == "head 1: &lt;copy&gt;");
  CHECK(contains(svg, ">layer 0 &amp; friends</text>"));
  for (const Cell& cell : picture.cells) {
    const Index head = options.heads[static_cast<std::size_t>(cell.panel)];
    const double w = static_cast<double>(weights(0, head, cell.query, cell.key));
    CHECK(std::abs(cell.weight - w) <= 5e-6 * w);  // written with 6 digits
    CHECK(cell.fill == mha::to_hex(mha::heatmap_colour(mha::ColourMap::kViridis, w)));
  }
}

TEST_CASE("heatmap SVG: every layout of attn_weights", "[heatmap]") {
  const Tensor<double> per_head({2, 3, 4}, 0.125);
  SECTION("[H, L, S], unbatched per head") {
    const Picture picture = read_svg(svg_of(per_head, kQueries, kKeys));
    CHECK(picture.panel_titles.size() == 2);
    CHECK(picture.cells.size() == 24);
  }
  SECTION("[B, L, S], batched and averaged: one panel of batch entry b") {
    Tensor<float> averaged = random_weights({3, 3, 4}, 5);
    mha::HeatmapOptions options;
    options.rank3 = mha::Rank3Weights::kBatch;
    options.batch = 2;
    const Picture picture = read_svg(svg_of(averaged, kQueries, kKeys, options));
    REQUIRE(picture.panel_titles == std::vector<std::string>{"mean of heads"});
    for (const Cell& cell : picture.cells) {
      const double w = static_cast<double>(averaged(2, cell.query, cell.key));
      CHECK(std::abs(cell.weight - w) <= 5e-6 * w);  // written with 6 digits
    }
  }
  SECTION("[L, S], unbatched and averaged; labels may be left out") {
    const Tensor<float> averaged = random_weights({3, 4}, 9);
    const std::string svg = svg_of(averaged.view(), {}, {});
    const Picture picture = read_svg(svg);
    CHECK(picture.panel_titles.size() == 1);
    CHECK(picture.cells.size() == 12);
    CHECK(contains(svg, ">3</text>"));  // keys numbered 0..3
  }
  SECTION("float and double weights draw the same picture") {
    const Tensor<float> as_float({2, 3, 4}, 0.125f);
    CHECK(svg_of(as_float, kQueries, kKeys) == svg_of(per_head, kQueries, kKeys));
  }
}

TEST_CASE("heatmap SVG: labels are escaped and long ones shortened", "[heatmap]") {
  const Tensor<float> weights({1, 1, 2, 3}, 0.25f);
  const std::string svg =
      svg_of(weights, {"a<b", "\"q\"&'k'"}, {"x>y", "tok", "an-unusually-long-token"});
  CHECK(xml_problem(svg).empty());
  CHECK(contains(svg, ">a&lt;b</text>"));
  CHECK(contains(svg, ">&quot;q&quot;&amp;&apos;k&apos;</text>"));
  CHECK(contains(svg, ">x&gt;y</text>"));
  CHECK(contains(svg, ">an-unusually-\xE2\x80\xA6</text>"));  // 13 characters and "…"
  CHECK(!contains(svg, "a<b"));
  CHECK(!contains(svg, "an-unusually-long"));
}

TEST_CASE("heatmap SVG: bad input is refused with the shapes", "[heatmap]") {
  const Tensor<float> weights = random_weights({2, 2, 3, 4}, 1);
  const auto refusal = [&](const mha::HeatmapWeights& w, const std::vector<std::string>& queries,
                           const std::vector<std::string>& keys,
                           const mha::HeatmapOptions& options = {}) {
    return message_of<mha::ShapeError>([&] { svg_of(w, queries, keys, options); });
  };
  CHECK(refusal(Tensor<float>({5}, 0.2f), {}, {}) ==
        "weights: expected [B, H, L, S], [H, L, S], [B, L, S] or [L, S] (the attn_weights of a "
        "forward with need_weights), got [5]");
  CHECK(refusal(Tensor<float>({1, 1, 1, 2, 2}, 0.5f), {}, {}) ==
        "weights: expected [B, H, L, S], [H, L, S], [B, L, S] or [L, S] (the attn_weights of a "
        "forward with need_weights), got [1, 1, 1, 2, 2]");
  CHECK(refusal(weights, kQueries, {"The", "cat", "sat"}) ==
        "key_labels: expected 4 labels, one per key (S of weights [2, 2, 3, 4], bias_k and "
        "zero-attention keys included), got [3]");
  CHECK(refusal(weights, {"The", "cat"}, kKeys) ==
        "query_labels: expected 3 labels, one per query (L of weights [2, 2, 3, 4]), got [2]");
  mha::HeatmapOptions options;
  options.batch = 2;
  CHECK(refusal(weights, kQueries, kKeys, options) ==
        "options.batch: batch index 2 is out of range for weights [2, 2, 3, 4] (B = 2)");
  options.batch = -1;
  CHECK(refusal(weights, kQueries, kKeys, options) ==
        "options.batch: batch index -1 is out of range for weights [2, 2, 3, 4] (B = 2)");
  options.batch = 1;
  CHECK(refusal(weights[0], kQueries, kKeys, options) ==
        "options.batch: weights [2, 3, 4] have no batch axis, so the batch index must be 0; got 1");
  options = {};
  options.heads = {0, 2};
  CHECK(refusal(weights, kQueries, kKeys, options) ==
        "options.heads: head 2 is out of range for weights [2, 2, 3, 4] (H = 2)");
  CHECK(refusal(weights[0][0], kQueries, kKeys, options) ==
        "options.heads: weights [3, 4] are averaged over the heads ([B, L, S] or [L, S]); there "
        "are no heads to choose");
  options = {};
  options.panel_titles = {"only one"};
  CHECK(refusal(weights, kQueries, kKeys, options) ==
        "options.panel_titles: expected 2 titles, one per panel drawn, got [1]");
  options = {};
  options.cell_size = 0;
  CHECK(refusal(weights, kQueries, kKeys, options) ==
        "options: cell_size, columns, max_label_chars, font_size and png_scale must be >= 1");

  Tensor<float> bad = weights;
  bad(1, 1, 2, 3) = std::numeric_limits<float>::quiet_NaN();
  options = {};
  options.batch = 1;
  CHECK(refusal(bad, kQueries, kKeys, options) ==
        "weights: element [1, 1, 2, 3] of [2, 2, 3, 4] is nan; attention weights must be finite "
        "and not negative");
  // Batch entry 0 is fine: only the weights drawn are checked.
  CHECK(refusal(bad, kQueries, kKeys) == "(nothing thrown)");
  bad(1, 1, 2, 3) = -0.5f;
  CHECK(refusal(bad, kQueries, kKeys, options) ==
        "weights: element [1, 1, 2, 3] of [2, 2, 3, 4] is -0.5; attention weights must be finite "
        "and not negative");
  CHECK(refusal(Tensor<float>({2, 0, 4}), {}, {}) ==
        "weights: expected at least one query, one key and one head, got [2, 0, 4]");
}

TEST_CASE("heatmap SVG files: the stream's document; nothing written for bad input", "[heatmap]") {
  const Tensor<float> weights = random_weights({1, 2, 3, 4}, 2);
  const std::string path = kOutputDir + "/test_heatmap.svg";
  std::remove(path.c_str());
  mha::save_heatmap_svg(path, weights, kQueries, kKeys);
  CHECK(read_file(path) == svg_of(weights, kQueries, kKeys));

  const std::string refused = kOutputDir + "/test_heatmap_refused.svg";
  std::remove(refused.c_str());
  CHECK_THROWS_AS(mha::save_heatmap_svg(refused, weights, {"one"}, kKeys), mha::ShapeError);
  CHECK(!file_exists(refused));
  CHECK(message_of<std::runtime_error>([&] {
          mha::save_heatmap_svg(kOutputDir + "/no/such/dir/x.svg", weights, kQueries, kKeys);
        }) == "heatmap: cannot open " + kOutputDir +
                  "/no/such/dir/x.svg for writing: No such file or directory");
}

#ifdef MHA_TEST_PNG
TEST_CASE("heatmap PNG: decodes to the rendered picture; a known cell has its colour",
          "[heatmap][png]") {
  // One weight of 1 (head 1, query 1, key 2) and zeros elsewhere: that cell alone is the map's
  // last colour, every other cell its first.
  Tensor<float> weights({1, 2, 3, 4}, 0.0f);
  weights(0, 1, 1, 2) = 1.0f;
  mha::HeatmapOptions options;
  options.title = "one-hot";
  const std::string path = kOutputDir + "/test_heatmap.png";
  std::remove(path.c_str());
  mha::save_heatmap_png(path, weights, kQueries, kKeys, options);
  const mha::HeatmapImage rendered = mha::render_heatmap_image(weights, kQueries, kKeys, options);

  int width = 0, height = 0, channels = 0;
  unsigned char* pixels = stbi_load(path.c_str(), &width, &height, &channels, 3);
  REQUIRE(pixels != nullptr);
  const std::vector<std::uint8_t> decoded(pixels, pixels + width * height * 3);
  stbi_image_free(pixels);
  REQUIRE(width == rendered.width);
  REQUIRE(height == rendered.height);
  CHECK(channels == 3);
  CHECK(decoded == rendered.rgb);  // PNG is lossless
  std::ostringstream stream;
  mha::write_heatmap_png(stream, weights, kQueries, kKeys, options);
  CHECK(stream.str() == read_file(path));

  // The dark cell: the largest block of the map's last colour that is a square of side
  // cell_size * png_scale (the colour bar's top row has that colour too, one row high).
  const mha::Rgb dark = mha::heatmap_colour(options.colour_map, 1);
  const mha::Rgb light = mha::heatmap_colour(options.colour_map, 0);
  const Index side = options.cell_size * options.png_scale;
  const auto pixel = [&](Index x, Index y) {
    const std::size_t i = static_cast<std::size_t>((y * width + x) * 3);
    return mha::Rgb{decoded[i], decoded[i + 1], decoded[i + 2]};
  };
  Index x0 = -1, y0 = -1;
  for (Index y = 0; y + side <= height && x0 < 0; ++y) {
    for (Index x = 0; x + side <= width; ++x) {
      if (pixel(x, y) == dark && pixel(x + side - 1, y + side - 1) == dark &&
          pixel(x, y + side - 1) == dark) {
        x0 = x;
        y0 = y;
        break;
      }
    }
  }
  REQUIRE(x0 >= 0);
  Index dark_pixels = 0;
  for (Index y = y0; y < y0 + side; ++y) {
    for (Index x = x0; x < x0 + side; ++x) dark_pixels += pixel(x, y) == dark ? 1 : 0;
  }
  CHECK(dark_pixels == side * side);
  // It sits at key 2, query 1 of its grid: the rest of the 3 x 4 grid around it is light, and
  // the grid's frame is just outside.
  const Index gx = x0 - 2 * side, gy = y0 - side;
  for (Index i = 0; i < 3; ++i) {
    for (Index j = 0; j < 4; ++j) {
      if (i == 1 && j == 2) continue;
      INFO("cell " << i << ", " << j);
      CHECK(pixel(gx + j * side + side / 2, gy + i * side + side / 2) == light);
    }
  }
  const mha::Rgb frame{0x88, 0x88, 0x88};
  CHECK(pixel(gx - 1, gy + side / 2) == frame);
  CHECK(pixel(gx + 4 * side, gy + side / 2) == frame);
  CHECK(pixel(gx + side / 2, gy + 3 * side) == frame);
}

TEST_CASE("heatmap PNG: bad input is refused as for the SVG, and leaves no file",
          "[heatmap][png]") {
  const Tensor<float> weights({1, 2, 3, 4}, 0.25f);
  const std::string path = kOutputDir + "/test_heatmap_refused.png";
  std::remove(path.c_str());
  CHECK(
      message_of<mha::ShapeError>([&] { mha::save_heatmap_png(path, weights, kQueries, {"a"}); }) ==
      "key_labels: expected 4 labels, one per key (S of weights [1, 2, 3, 4], bias_k and "
      "zero-attention keys included), got [1]");
  CHECK(!file_exists(path));
  // Labels outside ASCII are drawn, as '?', not passed to stb_easy_font's table.
  const mha::HeatmapImage image =
      mha::render_heatmap_image(weights, {"\xC3\xA9t\xC3\xA9", "b", "c"}, kKeys);
  CHECK(image.width > 0);
  CHECK(mha::detail::printable_ascii("\xC3\xA9t\xC3\xA9\x01") == "?t??");
}
#endif
