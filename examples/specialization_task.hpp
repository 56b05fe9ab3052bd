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
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mha/mha.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif
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

// A uniform index in [0, n) from the library's seedable generator (the same on every platform).
inline Index draw(mha::Random& random, Index n) {
  return std::min(n - 1, static_cast<Index>(random.uniform() * static_cast<double>(n)));
}

// The first `count` letters of a random permutation of the alphabet: distinct letters.
inline std::vector<Index> draw_run(mha::Random& random, Index count) {
  std::vector<Index> letters(static_cast<std::size_t>(kVocab));
  for (Index v = 0; v < kVocab; ++v) letters[static_cast<std::size_t>(v)] = v;
  for (Index k = 0; k < count; ++k) {  // partial Fisher-Yates shuffle
    const Index pick = k + draw(random, kVocab - k);
    std::swap(letters[static_cast<std::size_t>(k)], letters[static_cast<std::size_t>(pick)]);
  }
  letters.resize(static_cast<std::size_t>(count));
  return letters;
}

inline Batch make_batch(Index size, mha::Random& random) {
  Batch batch;
  batch.size = size;
  const auto n = static_cast<std::size_t>(size * kLength);
  batch.token.assign(n, kNone);
  batch.previous.assign(n, kNone);
  batch.two_back.assign(n, kNone);
  batch.follower.assign(n, kNone);
  batch.match.assign(n, kNone);
  for (Index b = 0; b < size; ++b) {
    const std::vector<Index> first = draw_run(random, kRun);
    std::vector<Index> second = draw_run(random, kRun);
    // No letter twice in a row across the runs' boundary either: then t_{j-1} = t_i never holds
    // at j = i, so job 2's key matches only the earlier occurrence, never the query itself.
    if (second.front() == first.back()) std::swap(second.front(), second.back());
    for (Index i = 0; i < kLength; ++i) {
      batch.token[Batch::at(b, i)] = i < kRun ? first[static_cast<std::size_t>(i)]
                                              : second[static_cast<std::size_t>(i - kRun)];
    }
    for (Index i = 0; i < kLength; ++i) {
      const std::size_t at = Batch::at(b, i);
      batch.previous[at] = i > 0 ? batch.token[at - 1] : kNoPrevious;
      if (i >= 2) batch.two_back[at] = batch.token[at - 2];
      if (i < kRun) continue;
      for (Index m = 0; m < kRun; ++m) {  // the earlier occurrence, if any (at most one)
        if (batch.token[Batch::at(b, m)] == batch.token[at]) {
          batch.match[at] = m + 1;
          batch.follower[at] = batch.token[Batch::at(b, m + 1)];
        }
      }
    }
  }
  return batch;
}

// ---- the model ---------------------------------------------------------------------------------

struct ModelConfig {
  Index embed = 32;  // E
  Index heads = 4;   // H; D = E / H
  Index batch = 32;  // B, sequences per training step
  double lr = 3e-3;  // Adam's learning rate
  std::uint64_t seed = 1;
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
  explicit Model(const ModelConfig& config)
      : config_(config), layer_(make_layer(config)), random_(config.seed) {
    const Index embed = config.embed;
    tok_ = mha::Tensor<float>({kVocab, embed});
    prev_ = mha::Tensor<float>({kVocab + 1, embed});
    pos_ = mha::Tensor<float>({kLength, embed});
    readout_weight_ = mha::Tensor<float>({kOutputs, embed});
    readout_bias_ = mha::Tensor<float>({kOutputs});
    // nn.Embedding's N(0, 1) for the tables, nn.Linear's U(-1/sqrt(E), 1/sqrt(E)) for the
    // readout; the layer initialised itself as torch does, from the same seed.
    mha::Random init(config.seed ^ 0x5EEDE3B0ull);
    for (mha::Tensor<float>* table : {&tok_, &prev_, &pos_}) {
      for (Index k = 0; k < table->size(); ++k) {
        table->data()[k] = static_cast<float>(init.normal());
      }
    }
    mha::linear_default_uniform(readout_weight_, embed, init);
    mha::linear_default_uniform(readout_bias_, embed, init);
    tok_grad_ = mha::Tensor<float>(tok_.shape());
    prev_grad_ = mha::Tensor<float>(prev_.shape());
    pos_grad_ = mha::Tensor<float>(pos_.shape());
    readout_weight_grad_ = mha::Tensor<float>(readout_weight_.shape());
    readout_bias_grad_ = mha::Tensor<float>(readout_bias_.shape());

    // One list for the optimiser: the layer's parameters under PyTorch's names, then ours.
    mha::ParameterList<float> parameters = layer_.parameters();
    parameters.push_back(mha::make_parameter("tok", tok_, tok_grad_));
    parameters.push_back(mha::make_parameter("prev", prev_, prev_grad_));
    parameters.push_back(mha::make_parameter("pos", pos_, pos_grad_));
    parameters.push_back(
        mha::make_parameter("readout.weight", readout_weight_, readout_weight_grad_));
    parameters.push_back(mha::make_parameter("readout.bias", readout_bias_, readout_bias_grad_));
    mha::AdamOptions adam;
    adam.lr = config.lr;
    optimizer_ = std::make_unique<mha::Adam<float>>(parameters, adam);
  }

  // The optimiser holds views into the tensors above: the model stays where it was built.
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  const Layer& layer() const { return layer_; }
  const mha::ParameterList<float>& parameters() const { return optimizer_->parameters(); }
  void set_lr(double lr) { optimizer_->set_lr(lr); }

  // One step of training on a fresh batch: forward, loss, backward, Adam. Returns the batch's
  // loss and accuracy (measured before the update).
  Scores train_step() {
    const Batch batch = make_batch(config_.batch, random_);
    optimizer_->zero_grad();  // every gradient, the layer's included, back to 0

    embed(batch, x_);
    mha::ForwardOptions<float> options;
    options.is_causal = true;
    options.need_weights = false;  // the flash kernel; backward recomputes the weights
    const mha::ForwardResult<float> result = layer_.forward_train(x_, options, saved_);
    const mha::Tensor<float>& a = result.output;  // [B, L, E]
    logits_.resize(a.dim(0) * a.dim(1), kOutputs);
    readout(a, logits_);

    // ---- backward, from the loss down to the embeddings -----------------------------------
    // grad_logits = d loss / d z, [B*L, 2V]: softmax minus one-hot, scaled by each term's weight.
    Scores scores;
    grad_logits_.resize(logits_.rows(), logits_.cols());
    cross_entropy(batch, logits_, scores, &grad_logits_, nullptr);

    // The readout z = a W_rᵀ + b_r, differentiated:
    //   d W_r = grad_zᵀ a      [2V, E]    (summed over every row b, i)
    //   d b_r = colsum grad_z  [2V]
    //   d a   = grad_z W_r     [B*L, E]
    readout_weight_grad_.matrix().noalias() += grad_logits_.transpose() * a.matrix();
    readout_bias_grad_.flat() += grad_logits_.colwise().sum().transpose();
    grad_a_.resize(a.shape());
    grad_a_.matrix().noalias() = grad_logits_ * readout_weight_.matrix();

    // The attention layer (a = MultiHeadAttention(x, x, x)): layer_.backward takes d loss / d a
    // and ADDS d loss / d (W_q, W_k, W_v, W_o, biases) into the layer's gradients, which the
    // optimiser's list views. Inside, the gradient goes back through W_o to the heads' outputs
    // side by side, [B, L, E]. Head h gets columns h*D .. (h+1)*D of it, goes back through its
    // own softmax and reaches only its own D rows of W_q, W_k and W_v: each head learns from
    // the error it can do something about, in its own subspace. What a head receives depends
    // on where it already looks, which is how small differences at initialisation grow into
    // different jobs.
    const mha::InputGradients<float> grad_x = layer_.backward(saved_, grad_a_);

    // The embeddings, x_i = tok[t_i] + prev[t_{i-1}] + pos[i]. x was the query, the key and the
    // value, so d loss / d x_i is the sum of the three gradients (where to look from, where to
    // be found, what to pass on). A sum passes its gradient unchanged to each term: the three
    // table rows used at position i each get d x_i added, and a row used at several positions
    // (a letter that occurs in many sequences, pos[i] in every sequence) collects all of them.
    for (Index b = 0; b < batch.size; ++b) {
      for (Index i = 0; i < kLength; ++i) {
        const std::size_t at = Batch::at(b, i);
        const Index row = b * kLength + i;
        const auto dx = grad_x.query.matrix().row(row) + grad_x.key.matrix().row(row) +
                        grad_x.value.matrix().row(row);
        tok_grad_.matrix().row(batch.token[at]) += dx;
        prev_grad_.matrix().row(batch.previous[at]) += dx;
        pos_grad_.matrix().row(i) += dx;
      }
    }

    optimizer_->step();
    return scores;
  }

  // Evaluation mode (forward, no gradients) with every head's weights, on a fixed batch.
  Evaluation evaluate(const Batch& batch) const {
    mha::Tensor<float> x;
    embed(batch, x);
    mha::ForwardOptions<float> options;
    options.is_causal = true;
    options.need_weights = true;
    options.average_attn_weights = false;  // [B, H, L, L]: one pattern per head
    mha::ForwardResult<float> result = layer_.forward(x, options);
    mha::Matrix<float> logits(batch.size * kLength, kOutputs);
    readout(result.output, logits);

    Evaluation evaluation;
    evaluation.prediction.assign(static_cast<std::size_t>(batch.size * kLength * 2), kNone);
    cross_entropy(batch, logits, evaluation.scores, nullptr, &evaluation.prediction);
    evaluation.weights = std::move(result.attn_weights);
    evaluation.heads = measure_heads(batch, evaluation.weights);
    evaluation.similarity = mha::head_similarity(evaluation.weights);
    return evaluation;
  }

 private:
  static Layer make_layer(const ModelConfig& config) {
    mha::MultiHeadAttentionConfig layer_config(config.embed, config.heads);
    layer_config.seed = config.seed;
    return Layer(layer_config);
  }

  // x [B, L, E]: x_i = tok[t_i] + prev[t_{i-1}] + pos[i].
  void embed(const Batch& batch, mha::Tensor<float>& x) const {
    x.resize({batch.size, kLength, config_.embed});
    auto rows = x.matrix();
    for (Index b = 0; b < batch.size; ++b) {
      for (Index i = 0; i < kLength; ++i) {
        const std::size_t at = Batch::at(b, i);
        rows.row(b * kLength + i) = tok_.matrix().row(batch.token[at]) +
                                    prev_.matrix().row(batch.previous[at]) + pos_.matrix().row(i);
      }
    }
  }

  // z [B*L, 2V] = a W_rᵀ + b_r.
  void readout(const mha::Tensor<float>& a, mha::Matrix<float>& z) const {
    z.noalias() = a.matrix() * readout_weight_.matrix().transpose();
    z.rowwise() += readout_bias_.flat().transpose();
  }

  // The loss, per job the mean cross-entropy over the positions where that job is asked:
  //   loss = (1/2) mean_{job 1} CE + (1/2) mean_{job 2} CE,  CE = log sum_c exp(z_c) - z_answer
  // and, when grad is given, its gradient d loss / d z: for one softmax over V logits
  //   d CE / d z_c = softmax(z)_c - [c == answer]
  // times the term's weight 1 / (2 * number of positions asking that job); 0 on the logits of a
  // job that is not asked at that position. predictions, when given, gets each job's argmax.
  static void cross_entropy(const Batch& batch, const mha::Matrix<float>& z, Scores& scores,
                            mha::Matrix<float>* grad, std::vector<Index>* predictions) {
    Index asked[2] = {0, 0};
    for (std::size_t k = 0; k < batch.token.size(); ++k) {
      asked[0] += batch.two_back[k] != kNone ? 1 : 0;
      asked[1] += batch.follower[k] != kNone ? 1 : 0;
    }
    if (grad != nullptr) grad->setZero();
    double loss[2] = {0, 0};
    Index correct[2] = {0, 0};
    Eigen::VectorXd probabilities(kVocab);
    for (Index row = 0; row < z.rows(); ++row) {
      const auto at = static_cast<std::size_t>(row);
      const Index answers[2] = {batch.two_back[at], batch.follower[at]};
      for (int job = 0; job < 2; ++job) {
        if (answers[job] == kNone) continue;
        // The logits of this job, in double: subtracting the largest keeps exp from overflowing.
        const Eigen::VectorXd logits =
            z.row(row).segment(job * kVocab, kVocab).transpose().cast<double>();
        Index best = 0;
        const double largest = logits.maxCoeff(&best);
        probabilities = (logits.array() - largest).exp().matrix();
        const double sum = probabilities.sum();
        loss[job] += std::log(sum) + largest - logits(answers[job]);
        correct[job] += best == answers[job] ? 1 : 0;
        if (predictions != nullptr) (*predictions)[at * 2 + static_cast<std::size_t>(job)] = best;
        if (grad == nullptr) continue;
        probabilities /= sum;
        probabilities(answers[job]) -= 1.0;
        grad->row(row).segment(job * kVocab, kVocab) =
            (probabilities / (2.0 * static_cast<double>(asked[job]))).cast<float>().transpose();
      }
    }
    const double n1 = static_cast<double>(std::max<Index>(asked[0], 1));
    const double n2 = static_cast<double>(std::max<Index>(asked[1], 1));
    scores.loss_two_back = loss[0] / n1;
    scores.loss_follower = loss[1] / n2;
    scores.loss = (scores.loss_two_back + scores.loss_follower) / 2;
    scores.accuracy_two_back = static_cast<double>(correct[0]) / n1;
    scores.accuracy_follower = static_cast<double>(correct[1]) / n2;
  }

  // For each head, from its weights [B, H, L, L]: the mean weight at each offset i - δ and at
  // job 2's key m + 1, and its entropy (mha/diagnostics.hpp).
  std::vector<HeadMeasure> measure_heads(const Batch& batch,
                                         const mha::Tensor<float>& weights) const {
    const Index heads = config_.heads;
    const mha::Tensor<float> entropy = mha::head_entropy(weights);
    const mha::Tensor<float> normalised = mha::head_entropy_normalised(weights);
    std::vector<HeadMeasure> measures(static_cast<std::size_t>(heads));
    for (Index h = 0; h < heads; ++h) {
      HeadMeasure& measure = measures[static_cast<std::size_t>(h)];
      measure.entropy = static_cast<double>(entropy(h));
      measure.entropy_normalised = static_cast<double>(normalised(h));
      measure.offset_weights.assign(static_cast<std::size_t>(kLength), 0.0);
      measure.offset_weight = -1;
      for (Index offset = 0; offset < kLength; ++offset) {
        double sum = 0;
        for (Index b = 0; b < batch.size; ++b) {
          for (Index i = offset; i < kLength; ++i) {
            sum += static_cast<double>(weights(b, h, i, i - offset));
          }
        }
        const double mean = sum / static_cast<double>(batch.size * (kLength - offset));
        measure.offset_weights[static_cast<std::size_t>(offset)] = mean;
        if (offset >= 1 && mean > measure.offset_weight) {
          measure.offset_weight = mean;
          measure.best_offset = offset;
        }
      }
      double sum = 0;
      Index rows = 0;
      for (Index b = 0; b < batch.size; ++b) {
        for (Index i = 0; i < kLength; ++i) {
          const Index key = batch.match[Batch::at(b, i)];
          if (key == kNone) continue;
          sum += static_cast<double>(weights(b, h, i, key));
          ++rows;
        }
      }
      measure.match_weight = sum / static_cast<double>(std::max<Index>(rows, 1));
    }
    return measures;
  }

  ModelConfig config_;
  Layer layer_;
  mha::Random random_;  // draws the training batches
  mha::Tensor<float> tok_, prev_, pos_, readout_weight_, readout_bias_;
  mha::Tensor<float> tok_grad_, prev_grad_, pos_grad_, readout_weight_grad_, readout_bias_grad_;
  std::unique_ptr<mha::Adam<float>> optimizer_;
  // Buffers reused by every step.
  mha::SavedForward<float> saved_;
  mha::Tensor<float> x_, grad_a_;
  mha::Matrix<float> logits_, grad_logits_;
};

// ---- training ----------------------------------------------------------------------------------

// Adam's learning rate at step (1-based) of steps: the full rate for the first half, then down in
// a straight line to 0 at the last step, so that the end of training settles instead of
// bouncing around a loss near 0.
inline double learning_rate(double base, Index step, Index steps) {
  const double left = 1.0 - static_cast<double>(step - 1) / static_cast<double>(steps);
  return base * std::min(1.0, 2.0 * left);
}

// The kernels split (batch, head) tasks over OpenMP threads. Here a step has 32 sequences of 24
// positions: each task is a few microseconds of work, and waking a second thread costs more
// than it saves (several times slower on a busy two-core machine). One thread, unless
// OMP_NUM_THREADS asks otherwise. Returns the number of threads used.
inline int choose_threads() {
#ifdef _OPENMP
  if (std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(1);
  return omp_get_max_threads();
#else
  return 1;
#endif
}

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
inline TrainingRecord train(Model& model, Index steps, Progress& progress) {
  TrainingRecord record;
  std::vector<Scores> window(static_cast<std::size_t>(kSolveWindow));
  double sums[2] = {0, 0};  // of the window's accuracies, job 1 and job 2
  const auto start = std::chrono::steady_clock::now();
  for (Index step = 1; step <= steps; ++step) {
    model.set_lr(learning_rate(model.config().lr, step, steps));
    const Scores scores = model.train_step();
    if (!std::isfinite(scores.loss)) {
      throw mha::NonFiniteError("training loss is " + std::to_string(scores.loss) + " at step " +
                                std::to_string(step));
    }
    Scores& slot = window[static_cast<std::size_t>(step % kSolveWindow)];
    sums[0] += scores.accuracy_two_back - slot.accuracy_two_back;
    sums[1] += scores.accuracy_follower - slot.accuracy_follower;
    slot = scores;
    const double needed = kSolveAccuracy * static_cast<double>(kSolveWindow);
    if (record.steps_to_solve == kNone && step >= kSolveWindow && sums[0] >= needed &&
        sums[1] >= needed) {
      record.steps_to_solve = step;
    }
    progress.update(step, scores);
  }
  record.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return record;
}

// A positive whole number from the command line, or 0 when `text` is not one.
inline Index parse_count(const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return end != text && *end == '\0' && value > 0 ? static_cast<Index>(value) : 0;
}

// The command line both examples take: --seed N, --steps N, --help. Fills seed and steps and
// returns -1 to go on; otherwise prints the usage (steps_meaning says what a step counts) and
// returns the exit code: 0 after --help, 2 for a bad argument.
inline int parse_arguments(int argc, char** argv, const char* steps_meaning, std::uint64_t& seed,
                           Index& steps) {
  const auto usage = [&](int code) {
    (void)std::fprintf(
        code == 0 ? stdout : stderr,
        "usage: %s [--seed N] [--steps N]\n"
        "  --seed N   seed of the initialisation and of the training data (default 1)\n"
        "  --steps N  %s (default %td)\n",
        argv[0], steps_meaning, steps);
    return code;
  };
  for (int k = 1; k < argc; ++k) {
    const bool has_value = k + 1 < argc;
    if (std::strcmp(argv[k], "--help") == 0 || std::strcmp(argv[k], "-h") == 0) {
      return usage(0);
    }
    if (std::strcmp(argv[k], "--seed") == 0 && has_value) {
      const char* text = argv[++k];
      char* end = nullptr;
      seed = std::strtoull(text, &end, 10);
      if (end == text || *end != '\0') return usage(2);
    } else if (std::strcmp(argv[k], "--steps") == 0 && has_value) {
      steps = parse_count(argv[++k]);
      if (steps == 0) return usage(2);
    } else {
      return usage(2);
    }
  }
  return -1;
}

// The held-out batch every evaluation uses: drawn from its own seed, never trained on.
inline Batch evaluation_batch(std::uint64_t seed, Index size = 512) {
  mha::Random random(seed ^ 0xE7A1BA7C4ull);
  return make_batch(size, random);
}

}  // namespace specialization
