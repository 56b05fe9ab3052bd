// The task and the model shared by examples/head_specialization.cpp and
// examples/head_count_tradeoff.cpp: a synthetic task that needs two kinds of attention at once,
// and the smallest model that can learn it (token embeddings, learned positions, one
// MultiHeadAttention<float> layer, a linear readout), trained from scratch with Adam.
//
// The task. Each sequence is L = 24 letters from an alphabet of V = 20 (A..T): two runs of 12
// letters, each run without a repeated letter, so a letter occurs at most twice, once per run.
// At every position i the model answers two questions:
//   job 1, "two back":  which letter stands at position i - 2?                (i >= 2)
//   job 2, "follower":  the current letter occurred earlier, at position m; which letter came
//                       right after it, at m + 1?      (only where there is such an m: letters
//                                                       of the second run seen in the first)
// Job 1 is positional (the same offset whatever the letters); job 2 is content matching (where
// to look depends on which letter is where).
//
// The model. Position i's input vector is
//   x_i = tok[t_i] + prev[t_{i-1}] + pos[i]                       [B, L, E]
// with three learned tables: tok [V, E], prev [V + 1, E] (row V is "no previous letter", for
// i = 0) and pos [L, E]. Then one causal self-attention layer and a linear readout of its output:
//   a = MultiHeadAttention(x, x, x, is_causal)                    [B, L, E]
//   z = a W_rᵀ + b_r                                              [B, L, 2V]
// z's first V columns are job 1's logits, the last V job 2's; each half has its own softmax
// cross-entropy. The readout sees only a (no residual connection): whatever it needs must come
// through a head.
//
// Why one attention layer can solve both jobs: a head's query at i is compared with the keys of
// earlier positions j, and it copies a mix of their values.
//   job 1: position i - 1 holds t_{i-2} in its "prev" slot. A head whose query and key read
//          only the position rows can learn q_i . k_j to peak at j = i - 1 and copy that slot.
//   job 2: the answer t_{m+1} sits at position j = m + 1, whose "prev" slot holds t_m = t_i. A
//          head whose query reads tok[t_i] and whose key reads prev[t_{j-1}] peaks exactly there
//          (an "induction head") and copies tok[t_j]. Without the prev table this would take two
//          layers: a first-layer head that looks at the previous position and writes down its
//          letter, which the second layer's head then matches. The prev table plays that first
//          layer, so that one layer suffices.
// Each job needs its own softmax, peaked at a different key. One head has one softmax per row,
// so with H = 1 it must split its weight between the two keys and the readout sees both letters
// mixed; with H >= 2 two heads can each take one job.
//
// This header declares them; examples/specialization_task.cpp holds the code (the backward pass
// written out, the loss, the measures of the heads), compiled once for both examples.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mha/mha.hpp>

#ifdef _WIN32
#include <io.h>
#define MHA_EXAMPLE_ISATTY(stream) _isatty(_fileno(stream))
#else
#include <unistd.h>
#define MHA_EXAMPLE_ISATTY(stream) isatty(fileno(stream))
#endif

namespace specialization {

using mha::Index;
using Layer = mha::MultiHeadAttention<float>;

// ---- the task ----------------------------------------------------------------------------------

constexpr Index kVocab = 20;            // V: letters A..T
constexpr Index kRun = 12;              // letters per run, all different
constexpr Index kLength = 2 * kRun;     // L: two runs
constexpr Index kNoPrevious = kVocab;   // prev[V]: the "previous letter" of position 0
constexpr Index kNone = -1;             // no target / no position
constexpr Index kOutputs = 2 * kVocab;  // readout width: job 1's V logits, then job 2's

inline char letter(Index token) {
  return static_cast<char>('A' + token);
}

// A batch of sequences and both jobs' answers, each [B, L] row-major (index b * L + i).
struct Batch {
  Index size = 0;               // B
  std::vector<Index> token;     // t_i
  std::vector<Index> previous;  // t_{i-1}, or kNoPrevious at i = 0
  std::vector<Index> two_back;  // job 1's answer t_{i-2}, or kNone for i < 2
  std::vector<Index> follower;  // job 2's answer t_{m+1}, or kNone when t_i has no earlier m
  std::vector<Index> match;     // m + 1, the position job 2 must look at, or kNone

  static std::size_t at(Index b, Index i) { return static_cast<std::size_t>(b * kLength + i); }
};

// `size` sequences of the task with both jobs' answers, drawn from `random`.
Batch make_batch(Index size, mha::Random& random);

// ---- the model ---------------------------------------------------------------------------------

struct ModelConfig {
  Index embed = 32;  // E
  Index heads = 4;   // H; D = E / H
  Index batch = 32;  // B, sequences per training step
  double lr = 3e-3;  // Adam's learning rate
  std::uint64_t seed = 1;
  // The layer's arithmetic in training: fp32, or bf16 or fp16 mixed precision (its projections'
  // products with operands rounded to 16 bits and fp32 sums, forward and backward; its attention
  // core, parameters and Adam's state in fp32; fp16 with loss scaling). The embeddings and the
  // readout stay fp32.
  mha::Precision precision = mha::Precision::fp32;
};

// Loss and accuracy of both jobs over the positions where each is asked.
struct Scores {
  double loss = 0;  // (mean cross-entropy of job 1 + that of job 2) / 2
  double loss_two_back = 0, loss_follower = 0;
  double accuracy_two_back = 0, accuracy_follower = 0;
  double accuracy() const { return (accuracy_two_back + accuracy_follower) / 2; }
};

// What each head does, measured from its attention weights over a batch.
struct HeadMeasure {
  std::vector<double> offset_weights;  // [L]: at δ, the mean weight on key i - δ over rows i >= δ
  Index best_offset = 1;               // the δ >= 1 with the largest of them
  double offset_weight = 0;            // offset_weights[best_offset]
  double match_weight = 0;             // mean weight on job 2's key m + 1, over the rows with one
  double entropy = 0;                  // mha::head_entropy, nats
  double entropy_normalised = 0;  // mha::head_entropy_normalised: 1 = uniform over visible keys
};

struct Evaluation {
  Scores scores;
  std::vector<HeadMeasure> heads;
  mha::Tensor<float> weights;     // per-head attention weights [B, H, L, L]
  mha::Tensor<float> similarity;  // mha::head_similarity of the weights, [H, H]
  std::vector<Index> prediction;  // [B, L, 2]: job 1's and job 2's argmax
};

class Model {
 public:
  explicit Model(const ModelConfig& config);

  // The optimiser holds views into the tensors above: the model stays where it was built.
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const Layer& layer() const { return layer_; }
  const mha::ParameterList<float>& parameters() const { return optimizer_->parameters(); }
  void set_lr(double lr) { optimizer_->set_lr(lr); }

  // One step of training on a fresh batch: forward, loss, backward, Adam. Returns the batch's
  // loss and accuracy (measured before the update).
  Scores train_step();

  // fp16's loss scaling so far: the steps skipped for an overflowing gradient, and the scale.
  Index skipped_steps() const { return skipped_steps_; }
  float loss_scale() const { return scaler_ ? scaler_->scale() : 1.0F; }

  // Evaluation mode (forward, no gradients) with every head's weights, on a fixed batch.
  Evaluation evaluate(const Batch& batch) const;

 private:
  static Layer make_layer(const ModelConfig& config);

  // x [B, L, E]: x_i = tok[t_i] + prev[t_{i-1}] + pos[i].
  void embed(const Batch& batch, mha::Tensor<float>& x) const;

  // z [B*L, 2V] = a W_rᵀ + b_r.
  void readout(const mha::Tensor<float>& a, mha::Matrix<float>& z) const;

  // The loss, per job the mean cross-entropy over the positions where that job is asked:
  //   loss = (1/2) mean_{job 1} CE + (1/2) mean_{job 2} CE,  CE = log sum_c exp(z_c) - z_answer
  // and, when grad is given, its gradient d loss / d z: for one softmax over V logits
  //   d CE / d z_c = softmax(z)_c - [c == answer]
  // times the term's weight 1 / (2 * number of positions asking that job); 0 on the logits of a
  // job that is not asked at that position. predictions, when given, gets each job's argmax.
  static void cross_entropy(const Batch& batch, const mha::Matrix<float>& z, Scores& scores,
                            mha::Matrix<float>* grad, std::vector<Index>* predictions);

  // For each head, from its weights [B, H, L, L]: the mean weight at each offset i - δ and at
  // job 2's key m + 1, and its entropy (mha/diagnostics.hpp).
  std::vector<HeadMeasure> measure_heads(const Batch& batch,
                                         const mha::Tensor<float>& weights) const;

  ModelConfig config_;
  Layer layer_;
  mha::Random random_;  // draws the training batches
  mha::Tensor<float> tok_, prev_, pos_, readout_weight_, readout_bias_;
  mha::Tensor<float> tok_grad_, prev_grad_, pos_grad_, readout_weight_grad_, readout_bias_grad_;
  std::unique_ptr<mha::Adam<float>> optimizer_;
  std::unique_ptr<mha::GradScaler<float>> scaler_;  // fp16 only
  Index skipped_steps_ = 0;
  // Buffers reused by every step.
  mha::SavedForward<float> saved_;
  mha::Tensor<float> x_, grad_a_;
  mha::Matrix<float> logits_, grad_logits_;
};

// ---- training ----------------------------------------------------------------------------------

// The kernels split (batch, head) tasks over OpenMP threads. Here a step has 32 sequences of 24
// positions: each task is a few microseconds of work, and waking a second thread costs more
// than it saves (several times slower on a busy two-core machine). One thread, unless
// OMP_NUM_THREADS asks otherwise. Returns the number of threads used.
int choose_threads();

// Reports training as it goes: on a terminal, one line rewritten in place (step, loss, accuracy,
// steps/s, time left); otherwise, as in a log or a pipe, a plain line every `every` steps. The
// loss and accuracy shown are the means over the steps since the previous report, so the plain
// lines are the same on every run with the same seed.
class Progress {
 public:
  Progress(Index steps, Index every, std::string label)
      : steps_(steps),
        every_(std::max<Index>(every, 1)),
        label_(std::move(label)),
        width_(static_cast<int>(std::to_string(steps).size())),
        terminal_(MHA_EXAMPLE_ISATTY(stdout) != 0),
        start_(Clock::now()),
        last_draw_(start_) {}

  void update(Index step, const Scores& scores) {
    loss_sum_ += scores.loss;
    accuracy_sum_ += scores.accuracy();
    ++count_;
    if (terminal_) {
      const Clock::time_point now = Clock::now();
      if (step < steps_ && seconds(last_draw_, now) < 0.1) return;
      const double elapsed = seconds(start_, now);
      const double rate = static_cast<double>(step) / std::max(elapsed, 1e-9);
      std::printf("\r%sstep %*td/%td  loss %.4f  acc %5.1f%%  %4.0f steps/s  %5.1f s left ",
                  label_.c_str(), width_, step, steps_, mean(loss_sum_),
                  100.0 * mean(accuracy_sum_), rate, static_cast<double>(steps_ - step) / rate);
      if (step == steps_) std::printf("\n");
      (void)std::fflush(stdout);
      last_draw_ = now;
    } else if (step % every_ == 0 || step == steps_) {
      std::printf("%sstep %*td/%td  loss %.4f  acc %5.1f%%\n", label_.c_str(), width_, step, steps_,
                  mean(loss_sum_), 100.0 * mean(accuracy_sum_));
    } else {
      return;
    }
    loss_sum_ = accuracy_sum_ = 0;
    count_ = 0;
  }

  // Seconds since construction.
  double elapsed() const { return seconds(start_, Clock::now()); }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
  }
  double mean(double sum) const { return sum / static_cast<double>(std::max<Index>(count_, 1)); }

  Index steps_, every_;
  std::string label_;
  int width_;  // of the step number: as many digits as `steps`
  bool terminal_;
  Clock::time_point start_, last_draw_;
  double loss_sum_ = 0, accuracy_sum_ = 0;
  Index count_ = 0;
};

// What train() measured besides the final model.
struct TrainingRecord {
  double seconds = 0;            // the steps alone: no evaluation, no printing but the progress
  Index steps_to_solve = kNone;  // the first step at which both jobs' training accuracy, averaged
                                 // over the last kSolveWindow steps, reached kSolveAccuracy
};
constexpr Index kSolveWindow = 50;
constexpr double kSolveAccuracy = 0.99;

// Trains `model` for `steps` steps, reporting through `progress`. Throws mha::NonFiniteError if
// the loss stops being a number.
TrainingRecord train(Model& model, Index steps, Progress& progress);

// The command line both examples take: --seed N, --steps N, --precision fp32|bf16|fp16, --help.
// Fills config's seed and precision and steps and returns -1 to go on; otherwise prints the usage
// (steps_meaning says what a step counts) and returns the exit code: 0 after --help, 2 for a bad
// argument.
int parse_arguments(int argc, char** argv, const char* steps_meaning, ModelConfig& config,
                    Index& steps);

// How the layer trains, in words: "fp32", "bf16 mixed precision", or that this CPU lacks the
// bf16 instructions and bf16 runs as fp32.
std::string precision_words(const ModelConfig& config);

// The held-out batch every evaluation uses: drawn from its own seed, never trained on.
Batch evaluation_batch(std::uint64_t seed, Index size = 512);

}  // namespace specialization
