// Heads specialise by themselves: one attention layer with 4 heads is trained from scratch on a
// task that needs two different relations at once, and we watch which head took which job.
//
// The task, the model and the hand-written backward are in specialization_task.hpp and .cpp
// (shared with head_count_tradeoff.cpp). This program trains, then prints each head's attention on
// a held-out sequence as a text heatmap with its entropy (mha/diagnostics.hpp), and a verdict
// measured from the weights: which head looks at the previous position, which at the earlier
// occurrence.
//
// The heatmaps are also written as pictures, head_specialization_heads.svg (and .png when built
// with stb), into the current directory or the one given with --output-dir.
//
//   build/examples/head_specialization [--seed N] [--steps N] [--precision fp32|bf16|fp16]
//                                      [--output-dir DIR]
//
// Deterministic for a given seed and step count (the timings aside).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "pictures.hpp"
#include "specialization_task.hpp"

namespace {

using mha::Index;
using specialization::Batch;
using specialization::Evaluation;
using specialization::HeadMeasure;
using specialization::kLength;
using specialization::kNone;
using specialization::kRun;
using specialization::kVocab;

constexpr Index kDefaultSteps = 2000;
constexpr double kClearWeight = 0.5;  // a head "does" a job when its mean weight is at least this

// ---- printing ----------------------------------------------------------------------------------

// Ten shades by weight: " " below 0.1, "." from 0.1, ":" from 0.2, ... "@" from 0.9.
char shade(float weight) {
  static const char kShades[] = " .:-=+*#%@";
  const int band = static_cast<int>(weight * 10.0f);
  return kShades[std::min(std::max(band, 0), 9)];
}

// What the measurements say a head does, in a few words.
std::string job_of(const HeadMeasure& head) {
  if (head.match_weight >= kClearWeight) return "earlier occurrence";
  if (head.offset_weight >= kClearWeight) {
    return head.best_offset == 1 ? "previous position"
                                 : "position i-" + std::to_string(head.best_offset);
  }
  return "no single job";
}

std::string job_number(const HeadMeasure& head) {
  if (head.match_weight >= kClearWeight) return " (job 2)";
  if (head.offset_weight >= kClearWeight) return " (job 1)";
  return "";
}

void print_intro(const specialization::ModelConfig& config, Index steps, int threads) {
  std::printf(
      "Head specialisation: one attention layer, two jobs, %td heads\n"
      "\n"
      "The task. Each sequence is %td letters from A..%c: two runs of %td, no letter\n"
      "twice within a run. At every position i the model answers two questions:\n"
      "  job 1 (positional): which letter stands at position i-2?\n"
      "  job 2 (content):    the letter at i occurred earlier, at m; which letter\n"
      "                      came right after it, at m+1? (asked where there is an m)\n"
      "\n"
      "The model. x_i = tok[t_i] + prev[t_(i-1)] + pos[i], three learned tables\n"
      "(E = %td); one mha::MultiHeadAttention<float>(%td, %td), causal, D = %td; a linear\n"
      "readout of the layer's output to %td + %td logits, one softmax per job. The\n"
      "readout sees only the attention output: what it needs must come through a head.\n"
      "Trained from scratch with mha::Adam on fresh batches of %td sequences.\n"
      "\n"
      "Why one layer is enough. Job 1: position i-1 holds t_(i-2) in its prev slot,\n"
      "so a head whose query and key read only the positions can look there. Job 2: the\n"
      "answer t_(m+1) sits at position m+1, whose prev slot holds t_m, the current\n"
      "letter; a head whose query reads tok and whose key reads prev finds it (an\n"
      "induction head). Without the prev table that would take two layers, the first\n"
      "copying each letter one position on; the table plays that first layer. The jobs\n"
      "need their softmax peaked at different keys, and each head has one softmax per\n"
      "row: two jobs, two heads. Nothing tells a head which job to take.\n"
      "\n"
      "seed %llu, %td steps, Adam lr %g (linear decay over the second half), %d thread%s;\n"
      "the layer trains in %s\n",
      config.heads, kLength, static_cast<char>('A' + kVocab - 1), kRun, config.embed, config.embed,
      config.heads, config.embed / config.heads, kVocab, kVocab, config.batch,
      static_cast<unsigned long long>(config.seed), steps, config.lr, threads,
      threads == 1 ? "" : "s", specialization::precision_words(config).c_str());
}

// The mean row entropy of uniform causal attention: row i spreads over i + 1 keys.
double uniform_entropy() {
  double sum = 0;
  for (Index i = 0; i < kLength; ++i) sum += std::log(static_cast<double>(i + 1));
  return sum / static_cast<double>(kLength);
}

void print_head_table(const Evaluation& evaluation) {
  std::printf(
      "\nWhat each head does, measured on the held-out sequences:\n"
      "  offset  = the key i-d the head weights most on average (over rows i >= d)\n"
      "  m+1     = its mean weight on job 2's key, over the rows that ask job 2\n"
      "  entropy = mha::head_entropy, the mean over rows of -sum p log p (nats; %.2f if\n"
      "            every row were uniform over the keys it can see), and\n"
      "            mha::head_entropy_normalised (1 = uniform over the visible keys)\n"
      "\n"
      "head   offset        m+1    entropy (norm.)   job\n",
      uniform_entropy());
  for (std::size_t h = 0; h < evaluation.heads.size(); ++h) {
    const HeadMeasure& head = evaluation.heads[h];
    std::printf("%4zu   i-%-2td %5.2f   %5.2f   %5.2f  (%4.2f)     %s\n", h, head.best_offset,
                head.offset_weight, head.match_weight, head.entropy, head.entropy_normalised,
                (job_of(head) + job_number(head)).c_str());
  }
  std::printf(
      "\nHow alike the heads attend (mha::head_similarity: the cosine between two heads'\n"
      "weights over all rows; near 1 = the same pattern, a redundant pair):\n"
      "head  ");
  const Index heads = evaluation.similarity.dim(0);
  for (Index g = 0; g < heads; ++g) std::printf("%6td", g);
  std::printf("\n");
  for (Index h = 0; h < heads; ++h) {
    std::printf("%4td  ", h);
    for (Index g = 0; g < heads; ++g) std::printf("%6.2f", evaluation.similarity(h, g));
    std::printf("\n");
  }
  if (heads < 2) return;
  Index a = 0, b = 1;  // the most alike pair
  for (Index h = 0; h < heads; ++h) {
    for (Index g = h + 1; g < heads; ++g) {
      if (evaluation.similarity(h, g) > evaluation.similarity(a, b)) {
        a = h;
        b = g;
      }
    }
  }
  std::printf("Most alike: heads %td and %td (%.2f).\n", a, b,
              static_cast<double>(evaluation.similarity(a, b)));
}

// Heads `left` and `right` (or only `left` when right < 0) of sequence `b`, side by side: rows
// are queries, columns keys, both labelled with the sequence's letters.
void print_heatmaps(const Evaluation& evaluation, const Batch& batch, Index b, Index left,
                    Index right) {
  const auto letters = [&]() {
    std::string line;
    for (Index j = 0; j < kLength; ++j) {
      line += specialization::letter(batch.token[Batch::at(b, j)]);
    }
    return line;
  }();
  const auto title = [&](Index h) {
    const HeadMeasure& head = evaluation.heads[static_cast<std::size_t>(h)];
    char text[64];  // a longer title is cut short, which a picture's label can be
    (void)std::snprintf(text, sizeof text, "head %td: %s, %.2f nats", h, job_of(head).c_str(),
                        head.entropy);
    return std::string(text);
  };
  const auto pad = [](std::string text, std::size_t width) {
    if (text.size() < width) text += std::string(width - text.size(), ' ');
    return text;
  };
  constexpr std::size_t kGap = 16;  // between the two grids
  std::printf("\n       %s", pad(title(left), static_cast<std::size_t>(kLength) + kGap).c_str());
  if (right >= 0) std::printf("%s", title(right).c_str());
  std::printf("\n       %s%s%s\n", letters.c_str(), std::string(kGap, ' ').c_str(),
              right >= 0 ? letters.c_str() : "");
  for (Index i = 0; i < kLength; ++i) {
    std::string line = (i < 10 ? " " : "") + std::to_string(i) + " " +
                       letters[static_cast<std::size_t>(i)] + "   ";
    for (Index h : {left, right}) {
      if (h < 0) continue;
      for (Index j = 0; j < kLength; ++j) line += shade(evaluation.weights(b, h, i, j));
      line += std::string(kGap, ' ');
    }
    line.erase(line.find_last_not_of(' ') + 1);
    std::printf("%s\n", line.c_str());
  }
}

// The heatmaps of sequence `b` as pictures, all heads, with the text heatmaps' titles and their
// absolute scale (0..1). Both axes are labelled "position letter".
void write_pictures(const Evaluation& evaluation, const Batch& batch, Index b,
                    const std::string& output_dir) {
  std::vector<std::string> labels, titles;
  for (Index i = 0; i < kLength; ++i) {
    labels.push_back(std::to_string(i) + " " +
                     specialization::letter(batch.token[Batch::at(b, i)]));
  }
  for (std::size_t h = 0; h < evaluation.heads.size(); ++h) {
    char text[64];  // a longer title is cut short, which a picture's label can be
    (void)std::snprintf(text, sizeof text, "head %zu: %s, %.2f nats", h,
                        job_of(evaluation.heads[h]).c_str(), evaluation.heads[h].entropy);
    titles.emplace_back(text);
  }
  mha::HeatmapOptions options;
  options.title =
      "head specialisation: held-out sequence " + std::to_string(b) + ", causal self-attention";
  options.batch = b;
  options.panel_titles = titles;
  options.columns = 2;
  options.scale_max = 1;
  const std::vector<std::string> written = example_pictures::write_heatmaps(
      output_dir, "head_specialization_heads", evaluation.weights, labels, labels, options);
  std::printf("\nThe same heatmaps as pictures:\n");
  for (const std::string& path : written) std::printf("  wrote %s\n", path.c_str());
}

// The sample's letters, both jobs' answers and the model's outputs, one column per position.
void print_predictions(const Evaluation& evaluation, const Batch& batch, Index b) {
  std::string letters, answers[2], outputs[2];
  for (Index i = 0; i < kLength; ++i) {
    const std::size_t at = Batch::at(b, i);
    letters += specialization::letter(batch.token[at]);
    const Index asked[2] = {batch.two_back[at], batch.follower[at]};
    for (std::size_t job = 0; job < 2; ++job) {
      const Index output = evaluation.prediction[at * 2 + job];
      answers[job] += asked[job] == kNone ? '.' : specialization::letter(asked[job]);
      outputs[job] += asked[job] == kNone ? '.' : specialization::letter(output);
    }
  }
  std::printf(
      "\nThe same sequence, answered ('.' = not asked there):\n"
      "  letters          %s\n"
      "  job 1 answer     %s\n"
      "  job 1 model      %s\n"
      "  job 2 answer     %s\n"
      "  job 2 model      %s\n",
      letters.c_str(), answers[0].c_str(), outputs[0].c_str(), answers[1].c_str(),
      outputs[1].c_str());
}

// The verdict, from the measurements only: the head with the largest mean weight at a fixed
// offset, the head with the largest mean weight on job 2's key; specialised when they are two
// different heads and each clearly does its job.
bool print_verdict(const Evaluation& evaluation) {
  const std::vector<HeadMeasure>& heads = evaluation.heads;
  std::size_t positional = 0, matching = 0;
  for (std::size_t h = 1; h < heads.size(); ++h) {
    if (heads[h].offset_weight > heads[positional].offset_weight) positional = h;
    if (heads[h].match_weight > heads[matching].match_weight) matching = h;
  }
  const HeadMeasure& p = heads[positional];
  const HeadMeasure& m = heads[matching];
  const std::string where =
      p.best_offset == 1 ? "the previous position" : "position i-" + std::to_string(p.best_offset);
  const bool specialised =
      positional != matching && p.offset_weight >= kClearWeight && m.match_weight >= kClearWeight;
  if (specialised) {
    std::printf(
        "\nverdict: heads specialised. Head %zu attends to %s\n"
        "  (mean weight %.2f on key i-%td, %.2f on job 2's key m+1); head %zu attends to\n"
        "  the position after the earlier occurrence of the current letter (mean weight\n"
        "  %.2f on key m+1, %.2f on key i-1). No one told them which job to take.\n",
        positional, where.c_str(), p.offset_weight, p.best_offset, p.match_weight, matching,
        m.match_weight, m.offset_weights[1]);
  } else {
    std::printf(
        "\nverdict: heads did not specialise. Most positional: head %zu, mean weight %.2f\n"
        "  on key i-%td; most matching: head %zu, mean weight %.2f on key m+1 (a clear job\n"
        "  needs %.2f, and two different heads).\n",
        positional, p.offset_weight, p.best_offset, matching, m.match_weight, kClearWeight);
  }
  return specialised;
}

}  // namespace

// An exception other than a picture's ends the example through std::terminate, which prints it.
int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape)
  specialization::ModelConfig config;
  config.heads = 4;
  Index steps = kDefaultSteps;
  std::string output_dir;
  const bool has_dir = example_pictures::take_output_dir(argc, argv, output_dir);
  const int exit_code =
      has_dir ? specialization::parse_arguments(argc, argv, "training steps", config, steps) : 2;
  if (exit_code >= 0) {
    if (!has_dir) (void)std::fprintf(stderr, "%s: --output-dir needs a directory\n", argv[0]);
    (void)std::fprintf(exit_code == 0 ? stdout : stderr, "%s", example_pictures::kUsage);
    return exit_code;
  }

  const int threads = specialization::choose_threads();
  print_intro(config, steps, threads);
  std::printf("\n");
  specialization::Model model(config);
  const Batch held_out = specialization::evaluation_batch(config.seed);
  specialization::Progress progress(steps, std::max<Index>(steps / 10, 1), "");
  const double seconds = specialization::train(model, steps, progress).seconds;

  const Evaluation evaluation = model.evaluate(held_out);
  const specialization::Scores& scores = evaluation.scores;
  std::printf(
      "\nHeld out (%td sequences never trained on): loss %.4f; job 1 accuracy %.1f%%,\n"
      "job 2 accuracy %.1f%% (chance: %.0f%%).\n",
      held_out.size, scores.loss, 100.0 * scores.accuracy_two_back,
      100.0 * scores.accuracy_follower, 100.0 / static_cast<double>(kVocab));

  print_head_table(evaluation);
  std::printf(
      "\nEach head's attention on a held-out sequence. Rows: the query at position i\n"
      "(its letter); columns: the keys, labelled by their letters. Shades by weight:\n"
      "' ' < 0.1 <= '.' < 0.2 <= ':' < 0.3 <= '-' < 0.4 <= '=' < 0.5 <= '+' < 0.6 <= '*'\n"
      "< 0.7 <= '#' < 0.8 <= '%%' < 0.9 <= '@'. Right of the diagonal is the causal mask.\n"
      "Rows %td..%td are the second run: there job 2 looks for the letter after the\n"
      "row's letter in the first run.\n",
      kRun, kLength - 1);
  const Index heads = config.heads;
  for (Index h = 0; h < heads; h += 2) {
    print_heatmaps(evaluation, held_out, 0, h, h + 1 < heads ? h + 1 : -1);
  }
  try {
    write_pictures(evaluation, held_out, 0, output_dir);
  } catch (const std::exception& error) {  // a picture that cannot be written
    (void)std::fprintf(stderr, "head_specialization: %s\n", error.what());
    return 1;
  }
  print_predictions(evaluation, held_out, 0);
  print_verdict(evaluation);
  std::printf("\ntrained %td steps in %.1f s (%.0f steps/s)\n", steps, seconds,
              static_cast<double>(steps) / seconds);
  if (config.precision == mha::Precision::fp16) {
    std::printf("loss scaling: %td of %td steps skipped for an overflowing gradient; scale %g\n",
                model.skipped_steps(), steps, static_cast<double>(model.loss_scale()));
  }
  return 0;
}
