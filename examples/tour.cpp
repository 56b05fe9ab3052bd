// A guided tour of multi-head attention with mha, for learners and teachers.
//
// Part 1 runs self-attention over one sentence with 8 heads and prints each head's [L, S]
// attention weights as a text heatmap. Heads 0-3 are built by hand (their rows of W_q, W_k, W_v
// are written so that they show a known pattern); heads 4-7 keep the library's seeded random
// initialisation. Nothing here is trained. Part 2 is the "dimension ledger": what splitting
// d = 768 into h heads costs, with parameters counted on real layers.
//
// Part 1 also writes the heatmaps as pictures, tour_heads.svg (and tour_heads.png when built
// with stb), into the current directory or the one given with --output-dir.
//
// Build and run (plain stdout):
//   g++ -std=c++17 -O2 -I include -isystem /usr/include/eigen3 examples/tour.cpp -o tour
//   ./tour [--output-dir DIR]
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

#include <mha/mha.hpp>

#include "pictures.hpp"

namespace {

using mha::Index;
using Layer = mha::MultiHeadAttention<float>;

// ---- the sentence and the toy model's sizes --------------------------------------------------

constexpr Index kLength = 11;  // L = S: self-attention, the tokens ask and answer
const std::array<const char*, kLength> kTokens = {
    "The", "animal", "didn't", "cross", "the", "street", "because", "it", "was", "too", "tired"};
constexpr Index kAnimal = 1, kStreet = 5, kIt = 7;

constexpr Index kEmbed = 64;                 // E
constexpr Index kHeads = 8;                  // H
constexpr Index kHeadDim = kEmbed / kHeads;  // D = 8

// How the 64 embedding dimensions are used. Real models add the position code to the word vector
// over all dimensions and let training find room for each; here they sit in separate dimensions
// so that a hand-built head can read the word alone or the position alone.
constexpr Index kIdentityDims = 8;  // dims 0-7: the word's identity, a seeded random direction
constexpr Index kPronoun = 8;       // dims 8-15: hand-set word features
constexpr Index kAnimate = 9;
constexpr Index kNoun = 10;
constexpr Index kPositionBegin = 16;  // dims 16-63: the sinusoidal position code
constexpr Index kPositionDims = 48;

// The three blocks of in_proj_weight [3E, E]: rows 0:E are W_q, E:2E W_k, 2E:3E W_v.
enum Projection : Index { kQuery = 0, kKey = 1, kValue = 2 };

// The hand-built heads; heads 4-7 stay as initialised.
constexpr Index kPreviousHead = 0, kSameWordHead = 1, kFirstTokenHead = 2, kCorefHead = 3;
const std::array<const char*, kHeads> kHeadTitles = {
    "head 0: previous token [built]", "head 1: same word [built]", "head 2: first token [built]",
    "head 3: coreference [built]",    "head 4: untrained, random", "head 5: untrained, random",
    "head 6: untrained, random",      "head 7: untrained, random"};

// ---- token embeddings ------------------------------------------------------------------------

std::string lowercase(std::string word) {
  for (char& c : word) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return word;
}

// FNV-1a: a fixed hash, so a word gets the same vector with every compiler and standard library.
std::uint64_t word_seed(const std::string& word) {
  std::uint64_t hash = 14695981039346656037ull;
  for (char c : word) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return hash;
}

// "Attention Is All You Need", section 3.5, with d_model = kPositionDims:
//   PE(pos, 2k) = sin(pos * w_k),  PE(pos, 2k + 1) = cos(pos * w_k),  w_k = 10000^(-2k / d_model)
double frequency(Index pair) {
  return std::pow(10000.0, -2.0 * static_cast<double>(pair) / static_cast<double>(kPositionDims));
}

// x is [B = 1, L, E]: row i = the word's identity and features, plus the position code of i.
mha::Tensor<float> embed_sentence() {
  mha::Tensor<float> x({1, kLength, kEmbed});
  for (Index i = 0; i < kLength; ++i) {
    const std::string word = lowercase(kTokens[static_cast<std::size_t>(i)]);
    // Seeded by the lowercased word, so "The" and "the" share their identity. Every word gets
    // the same length, sqrt(8), so that a dot product of two words compares directions only
    // (real models keep lengths in check with LayerNorm).
    mha::Random random(word_seed(word));
    Eigen::VectorXd identity(kIdentityDims);
    for (Index d = 0; d < kIdentityDims; ++d) identity(d) = random.normal();
    identity *= std::sqrt(static_cast<double>(kIdentityDims)) / identity.norm();
    for (Index d = 0; d < kIdentityDims; ++d) x(0, i, d) = static_cast<float>(identity(d));
    if (word == "it") x(0, i, kPronoun) = 1.0f;
    if (word == "animal") x(0, i, kAnimate) = 1.0f;
    if (word == "animal" || word == "street") x(0, i, kNoun) = 1.0f;
    for (Index pair = 0; pair < kPositionDims / 2; ++pair) {
      const double angle = static_cast<double>(i) * frequency(pair);
      x(0, i, kPositionBegin + 2 * pair) = static_cast<float>(std::sin(angle));
      x(0, i, kPositionBegin + 2 * pair + 1) = static_cast<float>(std::cos(angle));
    }
  }
  return x;
}

// ---- hand-built heads ------------------------------------------------------------------------

// Head h's D rows of W_q, W_k or W_v, a [D, E] block of in_proj_weight: head h owns rows
// which*E + h*D .. which*E + (h+1)*D. The map writes straight into the layer.
Eigen::Map<mha::Matrix<float>> head_rows(Layer& layer, Projection which, Index head) {
  const mha::TensorView<float> in_proj = layer.parameter("in_proj_weight");
  float* first = in_proj.data() + (which * kEmbed + head * kHeadDim) * kEmbed;
  return Eigen::Map<mha::Matrix<float>>(first, kHeadDim, kEmbed);
}

// Clears the head's W_q and W_k rows and makes its value the identity (dims 0-7) of the word it
// attends to: W_q and W_k decide where a head looks, W_v what it passes on.
void start_head(Layer& layer, Index head) {
  head_rows(layer, kQuery, head).setZero();
  head_rows(layer, kKey, head).setZero();
  auto w_v = head_rows(layer, kValue, head);
  w_v.setZero();
  for (Index m = 0; m < kHeadDim; ++m) w_v(m, m) = 1.0f;
}

// Uses that PE(pos + 1) is PE(pos) rotated by w_k in each (sin, cos) pair. The query reads the
// position code of token i; the key is the code of token j rotated one step, i.e. of j + 1.
// So q_i . k_j = gain^2 * sum_k cos((i - j - 1) w_k), largest when j = i - 1.
void build_previous_token_head(Layer& layer, Index head, float gain) {
  start_head(layer, head);
  auto w_q = head_rows(layer, kQuery, head);
  auto w_k = head_rows(layer, kKey, head);
  for (Index pair = 0; pair < kHeadDim / 2; ++pair) {
    const Index sin_dim = kPositionBegin + 2 * pair, cos_dim = sin_dim + 1;
    const float c = gain * static_cast<float>(std::cos(frequency(pair)));
    const float s = gain * static_cast<float>(std::sin(frequency(pair)));
    w_q(2 * pair, sin_dim) = gain;
    w_q(2 * pair + 1, cos_dim) = gain;
    // sin(a + w) = sin a cos w + cos a sin w;  cos(a + w) = cos a cos w - sin a sin w
    w_k(2 * pair, sin_dim) = c;
    w_k(2 * pair, cos_dim) = s;
    w_k(2 * pair + 1, sin_dim) = -s;
    w_k(2 * pair + 1, cos_dim) = c;
  }
}

// Query and key are both the word's identity: q_i . k_j = gain^2 * (cosine of the two words)
// * 8, largest for the same word. Ten random directions in only 8 dimensions cannot all be
// orthogonal, so words that happen to point alike get some weight too.
void build_same_word_head(Layer& layer, Index head, float gain) {
  start_head(layer, head);
  auto w_q = head_rows(layer, kQuery, head);
  auto w_k = head_rows(layer, kKey, head);
  for (Index m = 0; m < kHeadDim; ++m) {
    w_q(m, m) = gain;
    w_k(m, m) = gain;
  }
}

// Every token asks the same question: W_q is zero and the query is the bias alone. The key is
// -sin(j * w_k) for slow frequencies, which is 0 at j = 0 and negative for the next positions,
// so the score is largest at the first token.
void build_first_token_head(Layer& layer, Index head, float query_bias, float key_gain) {
  start_head(layer, head);
  const mha::TensorView<float> in_proj_bias = layer.parameter("in_proj_bias");  // [3E]
  auto w_k = head_rows(layer, kKey, head);
  for (Index m = 0; m < kHeadDim; ++m) {
    const Index pair = m + 1;  // frequencies 0.56 down to 0.01: slow enough not to wrap around
    in_proj_bias(kQuery * kEmbed + head * kHeadDim + m) = query_bias;
    w_k(m, kPositionBegin + 2 * pair) = -key_gain;
  }
}

// The query of a pronoun looks for nouns, animate ones most: q_i = gain * pronoun_i and
// k_j = gain * (animate_j + noun_j). Only "it" has a non-zero query; every other row scores all
// keys 0 and so spreads its attention evenly (softmax of equal scores is uniform).
void build_coreference_head(Layer& layer, Index head, float gain) {
  start_head(layer, head);
  auto w_q = head_rows(layer, kQuery, head);
  auto w_k = head_rows(layer, kKey, head);
  w_q(0, kPronoun) = gain;
  w_k(0, kAnimate) = gain;
  w_k(0, kNoun) = gain;
}

// ---- printing ----------------------------------------------------------------------------------

// Weight bands, as in the tutorial's heatmaps: a darker cell is more attention.
const char* shade(float weight) {
  if (weight < 0.05f) return "  ";
  if (weight < 0.20f) return "░░";
  if (weight < 0.40f) return "▒▒";
  if (weight < 0.70f) return "▓▓";
  return "██";
}

const char* token(Index i) {
  // cppcheck 2.10 takes the std::array of const char* for integers.
  // cppcheck-suppress CastIntegerToAddressAtReturn
  return kTokens[static_cast<std::size_t>(i)];
}

// The number of characters of UTF-8 text, as a terminal shows them: "░░" and "QKᵀ" are 2 and 3,
// not 6 and 5 (bytes).
std::size_t display_width(const std::string& text) {
  std::size_t chars = 0;
  for (char byte : text) chars += (static_cast<unsigned char>(byte) & 0xC0) != 0x80 ? 1 : 0;
  return chars;
}

std::string pad_left(const std::string& text, std::size_t width) {
  const std::size_t chars = display_width(text);
  return std::string(width > chars ? width - chars : 0, ' ') + text;
}

std::string pad_right(const std::string& text, std::size_t width) {
  const std::size_t chars = display_width(text);
  return text + std::string(width > chars ? width - chars : 0, ' ');
}

// Prints a line without its trailing spaces.
void print_trimmed(std::string line) {
  line.erase(line.find_last_not_of(' ') + 1);
  std::printf("%s\n", line.c_str());
}

// weights is [B, H, L, S]; prints heads `left` and `right` side by side, rows = query tokens,
// columns = key tokens numbered as the rows.
void print_heatmap_pair(const mha::Tensor<float>& weights, Index left, Index right) {
  std::printf("\n           %-35s%s\n", kHeadTitles[static_cast<std::size_t>(left)],
              kHeadTitles[static_cast<std::size_t>(right)]);
  std::string header = "query\\key ";
  for (Index grid = 0; grid < 2; ++grid) {
    for (Index j = 0; j < kLength; ++j) header += (j < 10 ? " " : "") + std::to_string(j) + " ";
    header += "  ";
  }
  print_trimmed(header);
  for (Index i = 0; i < kLength; ++i) {
    std::string line = pad_left(std::to_string(i), 2) + " " + pad_right(token(i), 7) + " ";
    for (Index head : {left, right}) {
      for (Index j = 0; j < kLength; ++j) line += std::string(shade(weights(0, head, i, j))) + " ";
      line += "  ";
    }
    print_trimmed(line);
  }
}

// The key with the largest weight in row `query` of `head`.
Index argmax(const mha::Tensor<float>& weights, Index head, Index query) {
  Index best = 0;
  for (Index j = 1; j < kLength; ++j) {
    if (weights(0, head, query, j) > weights(0, head, query, best)) best = j;
  }
  return best;
}

// ---- checks: do the hand-built heads really show their pattern? -----------------------------

void check_previous_token_head(const mha::Tensor<float>& weights) {
  Index hits = 0;
  float total = 0.0f;
  for (Index i = 1; i < kLength; ++i) {
    hits += argmax(weights, kPreviousHead, i) == i - 1 ? 1 : 0;
    total += weights(0, kPreviousHead, i, i - 1);
  }
  std::printf(
      "  head 0: q_i reads the position code of i; k_j is the code of j turned\n"
      "          one step, i.e. the code of j+1. So q_i . k_j peaks at j = i-1.\n"
      "          Rows 1-10 with their largest weight on token i-1: %td/10 (mean %.2f);\n"
      "          token 0 has no previous token and keeps to itself.\n",
      hits, static_cast<double>(total / 10.0f));
}

void check_same_word_head(const mha::Tensor<float>& weights) {
  Index hits = 0;
  for (Index i = 0; i < kLength; ++i) {
    hits += lowercase(token(argmax(weights, kSameWordHead, i))) == lowercase(token(i)) ? 1 : 0;
  }
  std::printf(
      "  head 1: q_i and k_j are both the word vector (dims 0-7), so q_i . k_j\n"
      "          peaks where the words are the same.\n"
      "          Rows with their largest weight on the same word: %td/11\n"
      "          \"the\" (4) -> \"The\" (0): %.2f, -> itself: %.2f (a tie: no position)\n"
      "          \"tired\" (10) -> \"it\" (7): %.2f (their random directions are close)\n",
      hits, static_cast<double>(weights(0, kSameWordHead, 4, 0)),
      static_cast<double>(weights(0, kSameWordHead, 4, 4)),
      static_cast<double>(weights(0, kSameWordHead, 10, kIt)));
}

void check_first_token_head(const mha::Tensor<float>& weights) {
  Index hits = 0;
  float total = 0.0f;
  for (Index i = 0; i < kLength; ++i) {
    hits += argmax(weights, kFirstTokenHead, i) == 0 ? 1 : 0;
    total += weights(0, kFirstTokenHead, i, 0);
  }
  std::printf(
      "  head 2: every query is the same constant (a bias; W_q = 0), so every row\n"
      "          is the same; k_j is -sin of slow position frequencies: 0 at j = 0,\n"
      "          negative after it. Rows with their largest weight on token 0:\n"
      "          %td/11 (mean %.2f). Trained models often have heads like this,\n"
      "          parking attention that is not needed elsewhere on the first token.\n",
      hits, static_cast<double>(total / 11.0f));
}

void check_coreference_head(const mha::Tensor<float>& weights) {
  std::printf(
      "  head 3: q_i is the pronoun feature, k_j the animate + noun features, so\n"
      "          only \"it\" asks, and nouns answer, animate ones louder.\n"
      "          \"it\" -> \"animal\": %.2f, \"it\" -> \"street\": %.2f. Every other row\n"
      "          has a zero query and so gives each key the same weight 1/11 = %.3f.\n",
      static_cast<double>(weights(0, kCorefHead, kIt, kAnimal)),
      static_cast<double>(weights(0, kCorefHead, kIt, kStreet)), 1.0 / 11.0);
}

void check_random_heads(const mha::Tensor<float>& weights) {
  float low = 1.0f, high = 0.0f;
  for (Index head = 4; head < kHeads; ++head) {
    const auto all = weights[0][head].matrix();  // [L, S]
    low = std::min(low, all.minCoeff());
    high = std::max(high, all.maxCoeff());
  }
  std::printf(
      "  heads 4-7: all weights in [%.3f, %.3f], near uniform 1/11 = %.3f:\n"
      "             small random W_q, W_k give small scores, and a softmax of small\n"
      "             scores is nearly flat. Any pattern there is chance, not meaning.\n",
      static_cast<double>(low), static_cast<double>(high), 1.0 / 11.0);
}

// Each row is a softmax, so it sums to 1 (up to float rounding).
void check_row_sums(const mha::Tensor<float>& weights) {
  float worst = 0.0f;
  for (Index head = 0; head < kHeads; ++head) {
    const auto sums = weights[0][head].matrix().rowwise().sum();  // [L, 1]
    worst = std::max(worst, (sums.array() - 1.0f).abs().maxCoeff());
  }
  std::printf("  every row of every head sums to 1: largest |row sum - 1| = %.1e\n",
              static_cast<double>(worst));
}

// ---- part 1 ------------------------------------------------------------------------------------

void print_part_one_intro() {
  std::printf(
      "1. Eight heads reading one sentence\n"
      "\n"
      "Self-attention over the 11 tokens of\n"
      "  \"The animal didn't cross the street because it was too tired\"\n"
      "Input x: [B, L, E] = [1, 11, 64]. Keys are the same tokens, so S = L = 11.\n"
      "Each token is 64 numbers:\n"
      "  dims  0-7   the word: a seeded random direction of length sqrt(8)\n"
      "              (\"The\" and \"the\" get the same one)\n"
      "  dims  8-10  hand-set word features: 8 = pronoun, 9 = animate, 10 = noun\n"
      "  dims 11-15  zero\n"
      "  dims 16-63  the sinusoidal position code of \"Attention Is All You Need\"\n"
      "              (d_model = 48)\n"
      "Real models add the position code over all dimensions. Keeping word and\n"
      "position apart lets a hand-built head read one of them alone.\n"
      "\n"
      "The layer is mha::MultiHeadAttention<float>(64, 8), so D = 64 / 8 = 8.\n"
      "Head h owns columns h*D..(h+1)*D of q, k and v: rows h*D..(h+1)*D of W_q,\n"
      "W_k and W_v, which live in in_proj_weight [3E, E] = [192, 64]. Each head\n"
      "runs softmax(q kᵀ / sqrt(D)) v on its own 8 columns; the 8 results are put\n"
      "side by side into [L, E] again and mixed by W_O (out_proj).\n"
      "  Heads 0-3 are CONSTRUCTED: we wrote their rows of W_q, W_k, W_v by hand\n"
      "    to show patterns the tutorial describes. They learned nothing.\n"
      "  Heads 4-7 keep the library's seeded default (xavier-uniform) weights:\n"
      "    untrained, random.\n"
      "  Training comes in a later part of the library; only then do heads find\n"
      "  roles of their own.\n"
      "\n"
      "forward(x) with need_weights and average_attn_weights = false returns\n"
      "the output [B, L, E] and one [L, S] weight matrix per head: [B, H, L, S].\n"
      "Row i says how query token i spreads its attention over the keys. Each\n"
      "row is a softmax, so it sums to 1.\n");
}

Layer make_tour_layer() {
  mha::MultiHeadAttentionConfig config(kEmbed, kHeads);
  config.seed = 2024;
  Layer layer(config);
  // Gains chosen so that each pattern is clear but not a one-hot: scores are divided by
  // sqrt(D) inside the layer.
  build_previous_token_head(layer, kPreviousHead, 3.0f);
  build_same_word_head(layer, kSameWordHead, 1.2f);
  build_first_token_head(layer, kFirstTokenHead, 2.0f, 2.0f);
  build_coreference_head(layer, kCorefHead, 2.7f);
  return layer;
}

// Part 1's weights as pictures: one panel per head, the tokens on both axes, the scale 0..1 of
// the text heatmaps' shades.
void write_pictures(const mha::Tensor<float>& weights, const std::string& output_dir) {
  const std::vector<std::string> tokens(kTokens.begin(), kTokens.end());
  mha::HeatmapOptions options;
  options.title = "mha tour: 8 heads of self-attention, weights [B, H, L, S] = [1, 8, 11, 11]";
  options.panel_titles.assign(kHeadTitles.begin(), kHeadTitles.end());
  options.scale_max = 1;
  const std::vector<std::string> written =
      example_pictures::write_heatmaps(output_dir, "tour_heads", weights, tokens, tokens, options);
  std::printf("\nThe same eight heatmaps as pictures (rows: queries, columns: keys):\n");
  for (const std::string& path : written) std::printf("  wrote %s\n", path.c_str());
}

void part_one(const std::string& output_dir) {
  print_part_one_intro();
  const Layer layer = make_tour_layer();
  const mha::Tensor<float> x = embed_sentence();
  mha::ForwardOptions<float> options;
  options.need_weights = true;
  options.average_attn_weights = false;  // keep each head's weights
  const mha::ForwardResult<float> result = layer.forward(x, options);
  std::printf("\noutput %s, attn_weights %s\n", mha::to_string(result.output.shape()).c_str(),
              mha::to_string(result.attn_weights.shape()).c_str());
  std::printf(
      "shades: \"  \" < 0.05 <= \"░░\" < 0.20 <= \"▒▒\" < 0.40 <= \"▓▓\" < 0.70 <= \"██\"\n");

  const mha::Tensor<float>& weights = result.attn_weights;
  print_heatmap_pair(weights, 0, 1);
  check_previous_token_head(weights);
  check_same_word_head(weights);
  print_heatmap_pair(weights, 2, 3);
  check_first_token_head(weights);
  check_coreference_head(weights);
  print_heatmap_pair(weights, 4, 5);
  print_heatmap_pair(weights, 6, 7);
  check_random_heads(weights);
  check_row_sums(weights);
  write_pictures(weights, output_dir);
}

// ---- part 2: the dimension ledger -------------------------------------------------------------

// Counted, not computed from a formula: the sizes of the layer's actual parameter tensors.
Index count_parameters(const Layer& layer) {
  Index total = 0;
  for (const std::string& name : layer.parameter_names()) total += layer.parameter(name).size();
  return total;
}

std::string with_commas(std::int64_t n) {
  std::string digits = std::to_string(n);
  for (Index at = static_cast<Index>(digits.size()) - 3; at > 0; at -= 3) {
    digits.insert(static_cast<std::size_t>(at), ",");
  }
  return digits;
}

// Prints cells right-aligned in the ledger's columns.
void print_ledger_row(const std::array<std::string, 7>& cells) {
  constexpr std::array<std::size_t, 7> kWidths = {4, 6, 12, 15, 14, 14, 10};
  std::string line;
  for (std::size_t c = 0; c < cells.size(); ++c) line += pad_left(cells[c], kWidths[c]);
  print_trimmed(line);
}

std::string percent(double value) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(3) << value << '%';
  return out.str();
}

void print_ledger_intro() {
  std::printf(
      "\n2. The dimension ledger: does splitting d = 768 into h heads cost more?\n"
      "\n"
      "For each h, a real mha::MultiHeadAttention<float>(768, h) is built and the\n"
      "sizes of its parameters (W_Q, W_K, W_V, W_O and biases) are added up.\n"
      "FLOPs are for n = 512 tokens (one multiply-add = 2 FLOPs), summed over the\n"
      "heads from what one head costs in its own D = d / h dimensions.\n"
      "\n");
  print_ledger_row(
      {"h", "D", "parameters", "projections", "QKᵀ and PV", "softmax exps", "exps/all"});
  print_ledger_row({"", "", "(counted)", "h·8·n·d·D", "h·4·n²·D", "h·n²", ""});
  print_ledger_row({"", "", "", "= 8·n·d²", "= 4·n²·d", "", ""});
}

void part_two() {
  constexpr std::int64_t d = 768, n = 512;
  print_ledger_intro();
  double exp_share = 0.0;  // of the last (largest) h
  for (const std::int64_t h : {1, 2, 4, 8, 12, 16, 24}) {
    const Layer layer(d, h);
    const std::int64_t head_dim = layer.head_dim();
    // One head: its rows of W_Q, W_K, W_V and its D columns of W_O, each an n x d x D product;
    // then QKᵀ (n x D times D x n) and PV (n x n times n x D); one exp per score.
    const std::int64_t projections = h * 4 * 2 * n * d * head_dim;
    const std::int64_t core = h * (2 * n * n * head_dim + 2 * n * n * head_dim);
    const std::int64_t exps = h * n * n;
    exp_share = 100.0 * static_cast<double>(exps) / static_cast<double>(projections + core + exps);
    print_ledger_row({std::to_string(h), std::to_string(head_dim),
                      with_commas(count_parameters(layer)), with_commas(projections),
                      with_commas(core), with_commas(exps), percent(exp_share)});
  }
  std::printf(
      "\nh · D = d, so the parameters and both matmul columns are the same for\n"
      "every h: the heads share out one d x d budget rather than each taking a\n"
      "new one (h = 12, D = 64 is GPT-2 small's choice). Only the softmax grows:\n"
      "each head has its own n x n scores, so h heads take h·n² exponentials,\n"
      "and even at h = 24 that is %.3f%% of the FLOPs. (torch's layer has W_O\n"
      "even at h = 1, so the parameter count does not move at all.)\n"
      "\n"
      "Conclusion: splitting d into h heads costs almost nothing extra, and buys\n"
      "h separate softmaxes, h patterns of attention like those in part 1.\n",
      exp_share);
}

}  // namespace

int main(int argc, char** argv) {
  std::string output_dir;
  if (!example_pictures::take_output_dir(argc, argv, output_dir) || argc > 1) {
    const bool help =
        argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h");
    std::fprintf(help ? stdout : stderr, "usage: %s [--output-dir DIR]\n%s", argv[0],
                 example_pictures::kUsage);
    return help ? 0 : 2;
  }
  std::printf(
      "A tour of multi-head attention with mha (torch.nn.MultiheadAttention, on Eigen)\n"
      "\n"
      "Shape letters used below and in the library:\n"
      "  B  batch size           E  embedding width (embed_dim)\n"
      "  L  query length         H  number of heads (num_heads)\n"
      "  S  key/value length     D  head width, D = E / H\n"
      "\n");
  try {
    part_one(output_dir);
  } catch (const std::exception& error) {  // a picture that cannot be written
    std::fprintf(stderr, "tour: %s\n", error.what());
    return 1;
  }
  part_two();
  return 0;
}
