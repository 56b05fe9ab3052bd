// The quality side of the head-count trade-off: the task of head_specialization.cpp (see
// specialization_task.hpp), learnt with E = 32 fixed and H = 1, 2, 4, 8, 16 heads, so D = E / H
// goes from 32 down to 2. Every run starts from the same parameters (the layer's shapes do not
// depend on H, and the seed is the same) and sees the same batches: only the split into heads
// differs. Prints, per H, the held-out loss and accuracies and the training time per step.
//
//   build/examples/head_count_tradeoff [--seed N] [--steps N] [--precision fp32|bf16|fp16]
//
// Deterministic for a given seed and step count (the timings aside).
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "specialization_task.hpp"

namespace {

using mha::Index;
using specialization::HeadMeasure;
using specialization::kNone;

constexpr Index kDefaultSteps = 2000;
constexpr std::array<Index, 5> kHeadCounts = {1, 2, 4, 8, 16};

struct Row {
  Index heads = 0;
  specialization::Scores scores;
  double positional = 0;  // the largest mean weight any head puts on one fixed offset
  double matching = 0;    // the largest mean weight any head puts on job 2's key
  Index steps_to_solve = kNone;
  double ms_per_step = 0;
};

}  // namespace

int main(int argc, char** argv) {
  specialization::ModelConfig config;
  Index steps = kDefaultSteps;
  const int exit_code = specialization::parse_arguments(
      argc, argv, "training steps for each head count", config, steps);
  if (exit_code >= 0) return exit_code;

  const int threads = specialization::choose_threads();
  std::printf(
      "Head count trade-off, the quality side: the two-job task of head_specialization\n"
      "(job 1: the letter two back; job 2: the letter that followed the current one's\n"
      "earlier occurrence) with E = %td fixed and H heads of D = E / H dimensions.\n"
      "Same initial parameters and same batches for every H. seed %llu, %td steps each,\n"
      "batches of %td sequences, %d thread%s; the layer in %s.\n"
      "\n",
      config.embed, static_cast<unsigned long long>(config.seed), steps, config.batch, threads,
      threads == 1 ? "" : "s", specialization::precision_words(config).c_str());

  const specialization::Batch held_out = specialization::evaluation_batch(config.seed);
  std::vector<Row> rows;
  for (const Index heads : kHeadCounts) {
    config.heads = heads;
    specialization::Model model(config);
    char label[32];
    std::snprintf(label, sizeof label, "H = %2td  ", heads);
    specialization::Progress progress(steps, std::max<Index>(steps / 4, 1), label);
    const specialization::TrainingRecord record = specialization::train(model, steps, progress);
    const specialization::Evaluation evaluation = model.evaluate(held_out);
    Row row;
    row.heads = heads;
    row.scores = evaluation.scores;
    for (const HeadMeasure& head : evaluation.heads) {
      row.positional = std::max(row.positional, head.offset_weight);
      row.matching = std::max(row.matching, head.match_weight);
    }
    row.steps_to_solve = record.steps_to_solve;
    row.ms_per_step = 1000.0 * record.seconds / static_cast<double>(steps);
    rows.push_back(row);
  }

  std::printf(
      "\nOn %td held-out sequences (chance accuracy %.0f%%). 'best offset' and 'best m+1':\n"
      "the largest mean attention weight any one head puts on a fixed offset i-d, and on\n"
      "job 2's key m+1 (see head_specialization).\n"
      "\n"
      " H   D    loss    job 1 acc  job 2 acc   best offset  best m+1   solved at  ms/step\n",
      held_out.size, 100.0 / static_cast<double>(specialization::kVocab));
  for (const Row& row : rows) {
    const std::string solved_at =
        row.steps_to_solve == kNone ? "never" : std::to_string(row.steps_to_solve);
    std::printf("%2td  %2td  %7.4f   %6.1f%%    %6.1f%%       %4.2f        %4.2f     %6s   %6.3f\n",
                row.heads, config.embed / row.heads, row.scores.loss,
                100.0 * row.scores.accuracy_two_back, 100.0 * row.scores.accuracy_follower,
                row.positional, row.matching, solved_at.c_str(), row.ms_per_step);
  }

  // The reading of the table, from its numbers.
  const Row& one = rows.front();
  const Row& most = rows.back();
  const Row* fastest = nullptr;
  for (const Row& row : rows) {
    if (row.steps_to_solve == kNone) continue;
    if (fastest == nullptr || row.steps_to_solve < fastest->steps_to_solve) fastest = &row;
  }
  std::printf(
      "\n'solved at': the first step at which both jobs' training accuracy, averaged over\n"
      "the last %td steps, was at least %.0f%%.\n",
      specialization::kSolveWindow, 100.0 * specialization::kSolveAccuracy);
  if (fastest == nullptr) {
    std::printf("No head count solved both jobs in %td steps.\n", steps);
  } else {
    std::printf("Fastest: H = %td, at step %td.\n", fastest->heads, fastest->steps_to_solve);
  }
  // H = 1 failing says something only when another head count succeeded.
  const bool one_failed = one.steps_to_solve == kNone && fastest != nullptr;
  if (one_failed) {
    std::printf(
        "H = 1 never solved both: one softmax per row must choose where to look. It ended\n"
        "at %.1f%% on job 1 and %.1f%% on job 2: one relation at the expense of the other.\n",
        100.0 * one.scores.accuracy_two_back, 100.0 * one.scores.accuracy_follower);
  }
  const Index narrow = config.embed / most.heads;
  const bool most_slow =
      fastest != nullptr && fastest != &most &&
      (most.steps_to_solve == kNone || most.steps_to_solve >= 2 * fastest->steps_to_solve);
  if (most_slow) {
    char when[96];
    if (most.steps_to_solve == kNone) {
      std::snprintf(when, sizeof when, "never solved both");
    } else {
      std::snprintf(
          when, sizeof when, "solved both at step %td, %.1fx later", most.steps_to_solve,
          static_cast<double>(most.steps_to_solve) / static_cast<double>(fastest->steps_to_solve));
    }
    std::printf(
        "H = %td (D = %td) %s;\n"
        "its best job-2 head puts %.2f on key m+1 (H = %td: %.2f): %td dimensions of\n"
        "query . key tell %td letters apart only softly.\n",
        most.heads, narrow, when, most.matching, fastest->heads, fastest->matching, narrow,
        specialization::kVocab);
  }
  if (one_failed && most_slow && fastest != &one) {
    std::printf(
        "trade-off: both ends lose. Too few heads cannot attend to two places at once;\n"
        "too many leave each head too few dimensions to match content sharply.\n");
  }
  std::printf(
      "Time per step at H = %td is %.2fx that at H = %td (same E, same FLOPs in the\n"
      "projections; more and smaller per-head products and softmaxes).\n",
      most.heads, most.ms_per_step / one.ms_per_step, one.heads);
  std::printf("\nfinished %zu head counts, %td steps each\n", rows.size(), steps);
  return 0;
}
