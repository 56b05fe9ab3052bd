// The code of the task and the model that examples/specialization_task.hpp declares (what they
// are and why they solve the task: the header's opening comment), compiled once into the library
// both training examples link.
#include "specialization_task.hpp"

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

#ifdef _OPENMP
#include <omp.h>
#endif

namespace specialization {

// ---- the task ----------------------------------------------------------------------------------

namespace {

// A uniform index in [0, n) from the library's seedable generator (the same on every platform).
Index draw(mha::Random& random, Index n) {
  return std::min(n - 1, static_cast<Index>(random.uniform() * static_cast<double>(n)));
}

// The first `count` letters of a random permutation of the alphabet: distinct letters.
std::vector<Index> draw_run(mha::Random& random, Index count) {
  std::vector<Index> letters(static_cast<std::size_t>(kVocab));
  for (Index v = 0; v < kVocab; ++v) letters[static_cast<std::size_t>(v)] = v;
  for (Index k = 0; k < count; ++k) {  // partial Fisher-Yates shuffle
    const Index pick = k + draw(random, kVocab - k);
    std::swap(letters[static_cast<std::size_t>(k)], letters[static_cast<std::size_t>(pick)]);
  }
  letters.resize(static_cast<std::size_t>(count));
  return letters;
}

}  // namespace

Batch make_batch(Index size, mha::Random& random) {
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

Model::Model(const ModelConfig& config)
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
  // fp16 needs loss scaling: the loss's gradient times the scaler's scale, every gradient
  // divided by it before Adam, and a step skipped when one overflowed.
  if (config.precision == mha::Precision::fp16) {
    scaler_ = std::make_unique<mha::GradScaler<float>>(parameters);
  }
}

Scores Model::train_step() {
  const Batch batch = make_batch(config_.batch, random_);
  optimizer_->zero_grad();  // every gradient, the layer's included, back to 0

  embed(batch, x_);
  mha::ForwardOptions<float> options;
  options.is_causal = true;
  options.need_weights = false;  // the flash kernel; backward recomputes the weights
  options.precision = config_.precision;
  const mha::ForwardResult<float> result = layer_.forward_train(x_, options, saved_);
  const mha::Tensor<float>& a = result.output;  // [B, L, E]
  logits_.resize(a.dim(0) * a.dim(1), kOutputs);
  readout(a, logits_);

  // ---- backward, from the loss down to the embeddings -----------------------------------
  // grad_logits = d loss / d z, [B*L, 2V]: softmax minus one-hot, scaled by each term's weight.
  Scores scores;
  grad_logits_.resize(logits_.rows(), logits_.cols());
  cross_entropy(batch, logits_, scores, &grad_logits_, nullptr);
  if (scaler_) grad_logits_ *= scaler_->scale();  // fp16: every gradient below is scaled

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

  if (scaler_) {
    if (!scaler_->step(*optimizer_)) ++skipped_steps_;  // unscaled first; skipped on overflow
    scaler_->update();
  } else {
    optimizer_->step();
  }
  return scores;
}

Evaluation Model::evaluate(const Batch& batch) const {
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

Layer Model::make_layer(const ModelConfig& config) {
  mha::MultiHeadAttentionConfig layer_config(config.embed, config.heads);
  layer_config.seed = config.seed;
  return Layer(layer_config);
}

void Model::embed(const Batch& batch, mha::Tensor<float>& x) const {
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

void Model::readout(const mha::Tensor<float>& a, mha::Matrix<float>& z) const {
  z.noalias() = a.matrix() * readout_weight_.matrix().transpose();
  z.rowwise() += readout_bias_.flat().transpose();
}

void Model::cross_entropy(const Batch& batch, const mha::Matrix<float>& z, Scores& scores,
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

std::vector<HeadMeasure> Model::measure_heads(const Batch& batch,
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

// ---- training ----------------------------------------------------------------------------------

namespace {

// Adam's learning rate at step (1-based) of steps: the full rate for the first half, then down in
// a straight line to 0 at the last step, so that the end of training settles instead of
// bouncing around a loss near 0.
double learning_rate(double base, Index step, Index steps) {
  const double left = 1.0 - static_cast<double>(step - 1) / static_cast<double>(steps);
  return base * std::min(1.0, 2.0 * left);
}

// A positive whole number from the command line, or 0 when `text` is not one.
Index parse_count(const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return end != text && *end == '\0' && value > 0 ? static_cast<Index>(value) : 0;
}

}  // namespace

int choose_threads() {
#ifdef _OPENMP
  if (std::getenv("OMP_NUM_THREADS") == nullptr) omp_set_num_threads(1);
  return omp_get_max_threads();
#else
  return 1;
#endif
}

TrainingRecord train(Model& model, Index steps, Progress& progress) {
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

int parse_arguments(int argc, char** argv, const char* steps_meaning, ModelConfig& config,
                    Index& steps) {
  const auto usage = [&](int code) {
    (void)std::fprintf(
        code == 0 ? stdout : stderr,
        "usage: %s [--seed N] [--steps N] [--precision fp32|bf16|fp16]\n"
        "  --seed N          seed of the initialisation and of the training data (default 1)\n"
        "  --steps N         %s (default %td)\n"
        "  --precision P     the attention layer's training arithmetic: fp32 (default), or\n"
        "                    mixed precision: bf16 or fp16 products (fp16 emulated, with\n"
        "                    mha::GradScaler's loss scaling); sums, softmax, parameters and\n"
        "                    Adam's state in fp32\n",
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
      config.seed = std::strtoull(text, &end, 10);
      if (end == text || *end != '\0') return usage(2);
    } else if (std::strcmp(argv[k], "--precision") == 0 && has_value) {
      const char* text = argv[++k];
      if (std::strcmp(text, "fp32") == 0) {
        config.precision = mha::Precision::fp32;
      } else if (std::strcmp(text, "bf16") == 0) {
        config.precision = mha::Precision::bf16;
      } else if (std::strcmp(text, "fp16") == 0) {
        config.precision = mha::Precision::fp16;
      } else {
        return usage(2);
      }
    } else if (std::strcmp(argv[k], "--steps") == 0 && has_value) {
      steps = parse_count(argv[++k]);
      if (steps == 0) return usage(2);
    } else {
      return usage(2);
    }
  }
  return -1;
}

std::string precision_words(const ModelConfig& config) {
  if (config.precision == mha::Precision::fp16) {
    return "fp16 mixed precision (emulated), with dynamic loss scaling";
  }
  if (config.precision != mha::Precision::bf16) return "fp32";
  return mha::bf16_arithmetic_available()
             ? "bf16 mixed precision"
             : "fp32 (bf16 asked; this CPU lacks AVX512_BF16, so bf16 computes in fp32)";
}

Batch evaluation_batch(std::uint64_t seed, Index size) {
  mha::Random random(seed ^ 0xE7A1BA7C4ull);
  return make_batch(size, random);
}

}  // namespace specialization
