// A serving simulation (issue 19): the same fixed-seed stream of requests served twice by one
// attention layer, once from a paged KV cache, once from a contiguous KVCache whose slots each
// reserve the longest request, in the same bytes of keys and values; both batch continuously.
//
// The workload: prompt lengths log-uniform in [16, 2048] tokens, output lengths log-uniform in
// [16, 512] (each the exponential of a uniform draw between the logarithms, rounded), arrivals a
// Poisson process of --rate requests a second; one seed (--seed) fixes all of it. The token
// vectors are fixed random rows: the cost of a step depends on the counts, not on the values.
//
// One FrozenMultiHeadAttention<float> (E = 2048, H = 16, H_kv = 2, D = 128 by default: the
// attention of a 7B-class model with grouped queries) stands for the model. A real model has
// dozens of such layers and MLPs too, whose weights every step also reads: more weight bytes a
// step, which more concurrency amortizes, so this layer alone understates what paging gains.
//
// Both runs make one decode call a step, packed (ForwardOptions::cu_seqlens): x is [T, E], each
// stepped sequence's new tokens after the previous one's, so no padding row is projected and the
// weights are read once a step however many prompt chunks and one-token sequences it mixes.
// Both follow one scheduling rule: every step decodes one token of every sequence whose prompt
// is done, and spends a budget of --chunk prompt tokens on prompts, those admitted first first.
// What differs is where keys and values live, hence how many sequences each run holds at once:
// the comparison is of the memory layouts, not of what a padded call costs. (An earlier version
// of this program projected padding rows, since decode took only [B, n, E]: the paged run made a
// call per prompt chunk beside one for the one-token sequences, and the contiguous run padded
// every slot to the chunk; bench/RESULTS.md keeps what it measured.)
//
// Paged run: admits waiting requests (FIFO) while the budget lasts and pages_needed says the pool
// holds this step's rows with the new request's whole prompt and 1 % of the pages to spare. A
// step whose decoding sequences need more pages than are free preempts the most recently
// admitted sequence (its pages freed; it waits again at the head of the queue and later
// recomputes its prompt and the tokens it had produced, as vLLM's recompute preemption).
//
// Contiguous run: one KVCache of as many slots as fit in the paged pool's bytes, each slot
// capacity 2048 + 512 rows (the longest request). KVCache::clear(b) resets a slot, so a request
// takes a slot as soon as the previous one finishes (FIFO). The packed call gives every slot a
// count, 0 for a free slot or one the prompt budget did not reach, which the call leaves alone.
//
// Time: each run has a clock of its own that advances by the wall-clock time of its steps
// (scheduling included); arrivals are on that clock. When a run has nothing to do its clock jumps
// to the next arrival (the idle wait is not slept). The runs take turns, the one whose clock is
// behind stepping next, so that all of them meet the same machine: on a shared 2-core host,
// another build can slow a step several times over, and runs made one after the other would
// compare two different machines.
//
//   build/examples/serving_simulation [--requests N] [--rate R] [--seed S] [--embed E]
//       [--heads H] [--kv-heads H_kv] [--page-size P] [--kv-mib M] [--chunk C]
//       [--paged-cap N] [--quick] [--json FILE]
//
// Defaults: 48 requests at 16 a second (more than either run serves: throughput measures
// capacity), seed 19, E = 2048, H = 16, H_kv = 2, pages of 48 rows, 40 MiB of keys and values
// (8 slots), chunks of 256. --quick: E = 256, H = 4, 8 requests at 100 a second, 8 MiB.
//
// --paged-cap N adds a paged run that holds at most N sequences at once: with N = the contiguous
// slots, it shows what the paged run gains from concurrency alone, and should come close to the
// contiguous run, which differs from it only in its admission by slots rather than by pages.
// (--groups, which split the contiguous slots into caches to trade padding rows for calls, is
// gone: a packed call over one cache has neither.)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <mha/mha.hpp>

namespace {

using mha::Index;
using Clock = std::chrono::steady_clock;

constexpr Index kMinPrompt = 16, kMaxPrompt = 2048;
constexpr Index kMinOutput = 16, kMaxOutput = 512;

struct Settings {
  Index requests = 48;
  double rate = 16.0;  // requests a second
  std::uint64_t seed = 19;
  Index embed = 2048, heads = 16, kv_heads = 2;
  Index page_size = 48;
  double kv_mib = 40.0;  // bytes of keys and values each run may hold, in MiB
  Index chunk = 256;     // prompt tokens a step spends
  Index paged_cap = 0;   // > 0: also a paged run that holds at most this many sequences
  std::string json;
};

struct Request {
  Index prompt = 0, output = 0;
  double arrival = 0;  // seconds after the first request's clock starts
};

// Each request's prompt and output lengths and arrival: fixed by the seed.
std::vector<Request> make_workload(const Settings& settings) {
  mha::Random random(settings.seed);
  const auto log_uniform = [&](Index low, Index high) {
    const double drawn = std::exp(
        random.uniform(std::log(static_cast<double>(low)), std::log(static_cast<double>(high))));
    return std::clamp(static_cast<Index>(std::lround(drawn)), low, high);
  };
  std::vector<Request> requests(static_cast<std::size_t>(settings.requests));
  double clock = 0;
  for (Request& request : requests) {
    request.prompt = log_uniform(kMinPrompt, kMaxPrompt);
    request.output = log_uniform(kMinOutput, kMaxOutput);
    // Exponential gaps: a Poisson process of `rate` arrivals a second.
    clock += -std::log(1.0 - random.uniform(0.0, 1.0)) / settings.rate;
    request.arrival = clock;
  }
  return requests;
}

// A request's progress in either run.
struct Progress {
  Index produced = 0;  // output tokens emitted
  Index prefill = 0;   // tokens to decode before the next output token (prompt, or recompute)
  Index prefilled = 0;
  double first_token = -1, finished = -1;
};

// Fixed random token vectors, as many rows as the largest step needs (grown on demand).
class TokenRows {
 public:
  explicit TokenRows(Index embed) : embed_(embed) {}
  mha::TensorView<const float> view(Index rows) {
    const auto needed = static_cast<std::size_t>(rows * embed_);
    if (rows_.size() < needed) {
      mha::Random random(7 + rows_.size());
      const std::size_t old = rows_.size();
      rows_.resize(needed);
      for (std::size_t i = old; i < needed; ++i) {
        rows_[i] = static_cast<float>(random.normal());
      }
    }
    return mha::make_view(static_cast<const float*>(rows_.data()), mha::Shape{rows, embed_});
  }

 private:
  Index embed_;
  std::vector<float> rows_;
};

double seconds_since(Clock::time_point begin) {
  return std::chrono::duration<double>(Clock::now() - begin).count();
}

struct RunResult {
  std::string name, scheduling;
  bool paged = false;
  std::size_t kv_bytes = 0;
  Index capacity = 0;  // slots (contiguous) or pages (paged)
  double elapsed = 0, idle = 0;
  Index requests = 0, prompt_tokens = 0, output_tokens = 0;
  std::vector<double> ttft, tpot;
  Index steps = 0, calls = 0, peak_running = 0, preemptions = 0;
  double mean_running = 0;
  // Token rows the steps advanced, and rows the calls projected: equal, since every call is
  // packed (kept as the check that no step projects padding).
  Index rows_computed = 0, rows_projected = 0;
  // Time in calls of steps that carry prompt tokens, and in calls of one-token steps only.
  double prompt_call_seconds = 0, token_call_seconds = 0;
  // Paged only: pages held after each step, and the rows of held pages that hold no token.
  Index peak_pages = 0;
  double mean_pages = 0, wasted_rows_per_sequence = 0;
  Index max_wasted_rows_per_sequence = 0;  // the most, over steps, of the step's mean (ceiling)
};

double percentile(std::vector<double> values, double fraction) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  // Nearest rank.
  const auto rank =
      static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(values.size())));
  return values[std::max<std::size_t>(rank, 1) - 1];
}

// TTFT and TPOT of each finished request, and the totals.
void collect(const std::vector<Request>& requests, const std::vector<Progress>& progress,
             RunResult& result) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Request& request = requests[i];
    const Progress& p = progress[i];
    ++result.requests;
    result.prompt_tokens += request.prompt;
    result.output_tokens += p.produced;
    result.ttft.push_back(p.first_token - request.arrival);
    if (request.output > 1) {
      result.tpot.push_back((p.finished - p.first_token) / static_cast<double>(request.output - 1));
    }
  }
}

// What both servers share: the requests, their progress, and a clock of their own. The clock
// advances by the real duration of each of this server's steps (scheduling included), and jumps
// to the next arrival when the server has nothing to do (the idle wait is not slept, and still
// counts in the elapsed time). main() always steps the server whose clock is behind, so the
// servers take turns on the machine and share its noise (another build on the same 2 cores).
class Server {
 public:
  Server(const mha::FrozenMultiHeadAttention<float>& model, const std::vector<Request>& requests,
         TokenRows& tokens)
      : model_(model), requests_(requests), tokens_(tokens), progress_(requests.size()) {
    for (std::size_t i = 0; i < requests.size(); ++i) progress_[i].prefill = requests[i].prompt;
  }
  virtual ~Server() = default;
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  bool finished() const { return done_ == requests_.size(); }
  double clock() const { return clock_; }

  void step() {
    while (arrived_ < requests_.size() && requests_[arrived_].arrival <= clock_) {
      waiting_.push_back(arrived_++);
    }
    if (idle()) {
      const double next = requests_[arrived_].arrival;
      result_.idle += next - clock_;
      clock_ = next;
      return;
    }
    const auto begin = Clock::now();
    run_step();
    clock_ += seconds_since(begin);
    ++result_.steps;
    emit_tokens();
  }

  RunResult result() const {
    RunResult run = result_;
    run.elapsed = clock_;
    run.mean_running = running_sum_ / static_cast<double>(std::max<Index>(run.steps, 1));
    collect(requests_, progress_, run);
    return run;
  }

 protected:
  // Nothing running nor waiting (the next request has not arrived).
  virtual bool idle() const = 0;
  // Admits, chooses this step's counts (stepped_, counts_), and runs its decode calls.
  virtual void run_step() = 0;
  // A request that has produced its last token gives its rows back.
  virtual void retire(std::size_t request) = 0;
  virtual Index running() const = 0;

  bool prefilling(std::size_t r) const { return progress_[r].prefilled < progress_[r].prefill; }

  // The step's one decode call, packed: x is [T, E], each sequence's new tokens after the
  // previous one's (options.cu_seqlens from `counts`, one per sequence of the call, 0 for one
  // that does not step), so one call projects only real rows and reads the weights once however
  // many prompt chunks and one-token sequences the step mixes. `decode(x, options)` makes it.
  template <class Decode>
  void packed_call(const std::vector<Index>& counts, Decode&& decode) {
    options_.cu_seqlens.assign(1, 0);
    for (const Index count : counts) {
      options_.cu_seqlens.push_back(options_.cu_seqlens.back() + count);
    }
    const Index rows = options_.cu_seqlens.back();
    const bool prompt =
        std::any_of(stepped_.begin(), stepped_.end(), [&](std::size_t r) { return prefilling(r); });
    const auto begin = Clock::now();
    decode(tokens_.view(rows), options_);
    (prompt ? result_.prompt_call_seconds : result_.token_call_seconds) += seconds_since(begin);
    ++result_.calls;
    result_.rows_projected += rows;
  }

  const mha::FrozenMultiHeadAttention<float>& model_;
  mha::ForwardOptions<float> options_ = mha::MultiHeadAttention<float>::decode_options();
  const std::vector<Request>& requests_;
  TokenRows& tokens_;
  std::vector<Progress> progress_;
  std::deque<std::size_t> waiting_;
  std::size_t arrived_ = 0, done_ = 0;
  // This step's requests and their new tokens.
  std::vector<std::size_t> stepped_;
  std::vector<Index> counts_;
  RunResult result_;
  double running_sum_ = 0;

 private:
  // After a step, at its end time: a prompt whose last chunk ran gives its first (next) output
  // token, a one-token step one more.
  void emit_tokens() {
    result_.peak_running = std::max(result_.peak_running, running());
    running_sum_ += static_cast<double>(running());
    for (std::size_t b = 0; b < stepped_.size(); ++b) {
      const std::size_t r = stepped_[b];
      Progress& p = progress_[r];
      result_.rows_computed += counts_[b];
      if (prefilling(r)) {
        p.prefilled += counts_[b];
        if (prefilling(r)) continue;
      }
      ++p.produced;
      if (p.first_token < 0) p.first_token = clock_;
      if (p.produced == requests_[r].output) {
        p.finished = clock_;
        retire(r);
        ++done_;
      }
    }
  }

  double clock_ = 0;
};

// ---- The paged run ----

class PagedServer : public Server {
 public:
  // max_running > 0 caps the sequences held at once (a control: the contiguous run's
  // concurrency without its padding).
  PagedServer(const mha::FrozenMultiHeadAttention<float>& model,
              const std::vector<Request>& requests, const Settings& settings, Index num_pages,
              Index max_running, TokenRows& tokens)
      : Server(model, requests, tokens),
        chunk_(settings.chunk),
        max_running_(max_running),
        pool_(model.layer().make_paged_kv_cache(settings.page_size, num_pages)),
        id_of_(requests.size(), -1) {
    result_.name =
        max_running > 0 ? "paged, at most " + std::to_string(max_running) + " sequences" : "paged";
    result_.scheduling =
        "continuous batching: every step decodes each running sequence one token and spends " +
        std::to_string(chunk_) +
        " prompt tokens, in one packed call; admits FIFO while the pool holds the step's pages and "
        "the new prompt; preempts the newest on a shortage (recompute)";
    result_.paged = true;
    result_.kv_bytes = pool_.storage_bytes();
    result_.capacity = num_pages;
  }

  RunResult paged_result() const {
    RunResult run = result();
    run.mean_pages = pages_sum_ / static_cast<double>(std::max<Index>(run.steps, 1));
    run.wasted_rows_per_sequence = static_cast<double>(wasted_rows_) /
                                   static_cast<double>(std::max<Index>(sequence_steps_, 1));
    return run;
  }

 protected:
  bool idle() const override { return running_.empty() && waiting_.empty(); }
  Index running() const override { return static_cast<Index>(running_.size()); }

  void run_step() override {
    // One token for each sequence past its prompt, then prompt chunks from the budget.
    std::vector<Index> ids;
    stepped_.clear();
    counts_.clear();
    Index budget = chunk_;
    for (const std::size_t r : running_) {
      const Progress& p = progress_[r];
      const Index count = prefilling(r) ? std::min(budget, p.prefill - p.prefilled) : 1;
      if (prefilling(r)) budget -= count;
      if (count == 0) continue;
      ids.push_back(id_of_[r]);
      counts_.push_back(count);
      stepped_.push_back(r);
    }
    // A shortage (decoding sequences crossing into new pages): preempt the newest.
    while (pool_.pages_needed(ids, counts_) > pool_.free_pages()) {
      const std::size_t victim = running_.back();
      running_.pop_back();
      const auto at = static_cast<std::size_t>(std::find(stepped_.begin(), stepped_.end(), victim) -
                                               stepped_.begin());
      if (at < stepped_.size()) {
        if (prefilling(victim)) budget += counts_[at];
        ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(at));
        counts_.erase(counts_.begin() + static_cast<std::ptrdiff_t>(at));
        stepped_.erase(stepped_.begin() + static_cast<std::ptrdiff_t>(at));
      }
      pool_.remove_sequence(id_of_[victim]);
      id_of_[victim] = -1;
      Progress& p = progress_[victim];
      // Recompute: the prompt and the tokens produced so far, whose keys and values are lost.
      p.prefill = requests_[victim].prompt + p.produced;
      p.prefilled = 0;
      waiting_.push_front(victim);
      ++result_.preemptions;
    }
    // Admission, while the budget lasts and the pool holds the step's rows with the new
    // request's whole prompt, and a watermark of 1 % of the pages for the running sequences'
    // next tokens (vLLM's rule): admitting on the next chunk alone lets prompts in that are
    // preempted, and recomputed, as soon as the sequences already running need a page.
    const Index watermark = std::max<Index>(1, pool_.num_pages() / 100);
    while (budget > 0 && !waiting_.empty() &&
           (max_running_ == 0 || static_cast<Index>(running_.size()) < max_running_)) {
      const std::size_t r = waiting_.front();
      const Index id = pool_.add_sequence();
      ids.push_back(id);
      counts_.push_back(progress_[r].prefill);
      const bool fits = pool_.pages_needed(ids, counts_) + watermark <= pool_.free_pages();
      counts_.back() = std::min(budget, progress_[r].prefill);
      if (!fits) {
        ids.pop_back();
        counts_.pop_back();
        pool_.remove_sequence(id);
        break;
      }
      waiting_.pop_front();
      id_of_[r] = id;
      running_.push_back(r);
      stepped_.push_back(r);
      budget -= counts_.back();
    }
    if (ids.empty()) {
      // Nothing fits: only when one prompt needs more pages than the pool has.
      std::fprintf(stderr, "the pool of %td pages cannot hold a prompt of %td tokens\n",
                   pool_.num_pages(), progress_[waiting_.front()].prefill);
      std::exit(1);
    }

    packed_call(counts_, [&](mha::TensorView<const float> x, const auto& options) {
      model_.decode(x, pool_, ids, options);
    });
    // The pool as the step left it (before retiring): what it held while it ran.
    const auto usage = pool_.usage();
    result_.peak_pages = std::max(result_.peak_pages, usage.used_pages);
    pages_sum_ += static_cast<double>(usage.used_pages);
    wasted_rows_ += usage.unused_rows;
    sequence_steps_ += usage.sequences;
  }

  void retire(std::size_t request) override {
    pool_.remove_sequence(id_of_[request]);
    id_of_[request] = -1;
    running_.erase(std::find(running_.begin(), running_.end(), request));
  }

 private:
  Index chunk_, max_running_;
  mha::PagedKVCache<float> pool_;
  std::vector<std::size_t> running_;  // in admission order
  std::vector<Index> id_of_;          // each request's sequence in the pool (-1: none)
  double pages_sum_ = 0;
  Index wasted_rows_ = 0, sequence_steps_ = 0;
};

// ---- The contiguous run ----

class ContiguousServer : public Server {
 public:
  ContiguousServer(const mha::FrozenMultiHeadAttention<float>& model,
                   const std::vector<Request>& requests, const Settings& settings, Index slots,
                   TokenRows& tokens)
      : Server(model, requests, tokens),
        chunk_(settings.chunk),
        cache_(model.layer().make_kv_cache(slots, kMaxPrompt + kMaxOutput)),
        holder_(static_cast<std::size_t>(slots), -1) {
    result_.name = "contiguous";
    result_.scheduling =
        "continuous batching with slot reuse (KVCache::clear): a finished request's slot takes "
        "the next waiting one (FIFO); every step decodes each slot past its prompt one token and "
        "spends " +
        std::to_string(chunk_) + " prompt tokens, in one packed call over the " +
        std::to_string(slots) + " slots";
    result_.capacity = slots;
    result_.kv_bytes = cache_.storage_bytes();
  }

 protected:
  bool idle() const override { return running() == 0 && waiting_.empty(); }
  Index running() const override {
    return static_cast<Index>(
        std::count_if(holder_.begin(), holder_.end(), [](std::ptrdiff_t h) { return h >= 0; }));
  }

  void run_step() override {
    for (std::size_t s = 0; s < holder_.size() && !waiting_.empty(); ++s) {
      if (holder_[s] >= 0) continue;
      holder_[s] = static_cast<std::ptrdiff_t>(waiting_.front());
      waiting_.pop_front();
      cache_.clear(static_cast<Index>(s));
    }
    // Each slot's count, as the paged run's: one token past the prompt, else its share of the
    // prompt budget (slots in order), 0 for a free slot or one the budget did not reach. A
    // packed call leaves a slot of count 0 alone, so the two runs differ only in where keys and
    // values live, hence in how many sequences they hold.
    std::vector<Index> slot_counts(holder_.size(), 0);
    stepped_.clear();
    counts_.clear();
    Index budget = chunk_;
    for (std::size_t s = 0; s < holder_.size(); ++s) {
      if (holder_[s] < 0) continue;
      const auto r = static_cast<std::size_t>(holder_[s]);
      const Progress& p = progress_[r];
      Index count = 1;
      if (prefilling(r)) {
        count = std::min(budget, p.prefill - p.prefilled);
        budget -= count;
      }
      if (count == 0) continue;
      slot_counts[s] = count;
      stepped_.push_back(r);
      counts_.push_back(count);
    }
    packed_call(slot_counts, [&](mha::TensorView<const float> x, const auto& options) {
      model_.decode(x, cache_, options);
    });
  }

  void retire(std::size_t request) override {
    *std::find(holder_.begin(), holder_.end(), static_cast<std::ptrdiff_t>(request)) = -1;
  }

 private:
  Index chunk_;
  mha::KVCache<float> cache_;
  std::vector<std::ptrdiff_t> holder_;  // the request in each slot (-1: free)
};

// ---- Reporting ----

double output_rate(const RunResult& r) {
  return static_cast<double>(r.output_tokens) / r.elapsed;
}

void print(const RunResult& r, const Settings& settings) {
  std::printf("\n%s\n  scheduling: %s\n", r.name.c_str(), r.scheduling.c_str());
  std::printf("  keys and values: %.2f MiB (%td %s)\n",
              static_cast<double>(r.kv_bytes) / (1024.0 * 1024.0), r.capacity,
              r.paged ? "pages" : "slots");
  std::printf("  requests %td, prompt tokens %td, output tokens %td\n", r.requests, r.prompt_tokens,
              r.output_tokens);
  std::printf("  elapsed %.2f s (idle gaps jumped: %.2f s), %td steps, %td calls\n", r.elapsed,
              r.idle, r.steps, r.calls);
  std::printf("  throughput: %.1f output tokens/s, %.1f tokens/s (prompt + output)\n",
              output_rate(r), static_cast<double>(r.prompt_tokens + r.output_tokens) / r.elapsed);
  std::printf("  TTFT p50 %.3f s, p99 %.3f s; TPOT p50 %.2f ms, p99 %.2f ms\n",
              percentile(r.ttft, 0.5), percentile(r.ttft, 0.99), 1e3 * percentile(r.tpot, 0.5),
              1e3 * percentile(r.tpot, 0.99));
  std::printf("  concurrency: peak %td, mean %.1f sequences a step\n", r.peak_running,
              r.mean_running);
  std::printf("  in calls: %.2f s with prompt chunks, %.2f s of one-token steps only\n",
              r.prompt_call_seconds, r.token_call_seconds);
  std::printf("  rows projected %td, of which padding %td (%.1f%%)\n", r.rows_projected,
              r.rows_projected - r.rows_computed,
              100.0 * static_cast<double>(r.rows_projected - r.rows_computed) /
                  static_cast<double>(std::max<Index>(r.rows_projected, 1)));
  if (r.paged) {
    std::printf("  pages used: peak %td, mean %.1f of %td; preemptions %td\n", r.peak_pages,
                r.mean_pages, r.capacity, r.preemptions);
    std::printf("  unused rows of held pages: %.1f per sequence on average (a page is %td rows)\n",
                r.wasted_rows_per_sequence, settings.page_size);
  } else {
    const double mean_rows =
        static_cast<double>(r.prompt_tokens + r.output_tokens) / static_cast<double>(r.requests);
    std::printf("  each slot reserves %td rows; a request fills %.0f on average at its end\n",
                kMaxPrompt + kMaxOutput, mean_rows);
  }
}

void write_json(const std::string& path, const Settings& settings,
                const std::vector<RunResult>& runs, double ratio) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(file,
               "{\n  \"workload\": {\"requests\": %td, \"rate\": %g, \"seed\": %llu, "
               "\"prompt\": \"log-uniform [%td, %td]\", \"output\": \"log-uniform [%td, %td]\"},\n",
               settings.requests, settings.rate, static_cast<unsigned long long>(settings.seed),
               kMinPrompt, kMaxPrompt, kMinOutput, kMaxOutput);
  std::fprintf(file,
               "  \"model\": {\"embed\": %td, \"heads\": %td, \"kv_heads\": %td, \"page_size\": "
               "%td, \"kv_mib\": %g, \"chunk\": %td},\n  \"runs\": [\n",
               settings.embed, settings.heads, settings.kv_heads, settings.page_size,
               settings.kv_mib, settings.chunk);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = runs[i];
    std::fprintf(file,
                 "    {\"name\": \"%s\", \"paged\": %s, \"kv_bytes\": %zu, \"elapsed_s\": %.4f, "
                 "\"idle_s\": %.4f, "
                 "\"requests\": %td, \"prompt_tokens\": %td, \"output_tokens\": %td, "
                 "\"output_tokens_per_s\": %.2f, \"tokens_per_s\": %.2f, "
                 "\"ttft_p50_s\": %.4f, \"ttft_p99_s\": %.4f, \"tpot_p50_ms\": %.3f, "
                 "\"tpot_p99_ms\": %.3f, \"peak_running\": %td, \"mean_running\": %.2f, "
                 "\"steps\": %td, \"calls\": %td, \"rows_projected\": %td, \"rows_computed\": %td, "
                 "\"peak_pages\": %td, \"mean_pages\": %.2f, \"wasted_rows_per_sequence\": %.2f, "
                 "\"preemptions\": %td, \"prompt_call_s\": %.4f, \"token_call_s\": %.4f}%s\n",
                 r.name.c_str(), r.paged ? "true" : "false", r.kv_bytes, r.elapsed, r.idle,
                 r.requests, r.prompt_tokens, r.output_tokens, output_rate(r),
                 static_cast<double>(r.prompt_tokens + r.output_tokens) / r.elapsed,
                 percentile(r.ttft, 0.5), percentile(r.ttft, 0.99), 1e3 * percentile(r.tpot, 0.5),
                 1e3 * percentile(r.tpot, 0.99), r.peak_running, r.mean_running, r.steps, r.calls,
                 r.rows_projected, r.rows_computed, r.peak_pages, r.mean_pages,
                 r.wasted_rows_per_sequence, r.preemptions, r.prompt_call_seconds,
                 r.token_call_seconds, i + 1 < runs.size() ? "," : "");
  }
  std::fprintf(file, "  ],\n  \"throughput_ratio_paged_over_contiguous\": %.3f\n}\n", ratio);
  std::fclose(file);
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", flag.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (flag == "--requests") {
      settings.requests = std::stol(value());
    } else if (flag == "--rate") {
      settings.rate = std::stod(value());
    } else if (flag == "--seed") {
      settings.seed = std::stoull(value());
    } else if (flag == "--embed") {
      settings.embed = std::stol(value());
    } else if (flag == "--heads") {
      settings.heads = std::stol(value());
    } else if (flag == "--kv-heads") {
      settings.kv_heads = std::stol(value());
    } else if (flag == "--page-size") {
      settings.page_size = std::stol(value());
    } else if (flag == "--kv-mib") {
      settings.kv_mib = std::stod(value());
    } else if (flag == "--chunk") {
      settings.chunk = std::stol(value());
    } else if (flag == "--paged-cap") {
      settings.paged_cap = std::stol(value());
    } else if (flag == "--json") {
      settings.json = value();
    } else if (flag == "--quick") {
      // For CI: a small layer, few requests, the same distribution and scheduling.
      settings.requests = 8;
      settings.embed = 256;
      settings.heads = 4;
      settings.kv_heads = 2;
      settings.kv_mib = 8;
      settings.rate = 100;
    } else {
      std::fprintf(stderr, "unknown flag %s (see the top of serving_simulation.cpp)\n",
                   flag.c_str());
      return 2;
    }
  }

  mha::MultiHeadAttentionConfig config(settings.embed, settings.heads);
  config.num_kv_heads = settings.kv_heads;
  config.seed = 1;
  const mha::FrozenMultiHeadAttention<float> model{mha::MultiHeadAttention<float>(config)};
  const Index head_dim = settings.embed / settings.heads;

  // The budget in token rows of keys and values (float, H_kv·D each): whole slots for the
  // contiguous run, whole pages (at most the same bytes) for the paged one.
  const double row_bytes = 2.0 * static_cast<double>(settings.kv_heads * head_dim) * sizeof(float);
  const auto budget_rows = static_cast<Index>(settings.kv_mib * 1024 * 1024 / row_bytes);
  const Index slots = budget_rows / (kMaxPrompt + kMaxOutput);
  const Index num_pages = budget_rows / settings.page_size;
  if (slots < 1) {
    std::fprintf(stderr, "--kv-mib %g holds no slot of %td rows\n", settings.kv_mib,
                 kMaxPrompt + kMaxOutput);
    return 2;
  }
  const Index contiguous_rows = slots * (kMaxPrompt + kMaxOutput);
  const Index pages = std::min(num_pages, contiguous_rows / settings.page_size);

  const std::vector<Request> requests = make_workload(settings);
  std::printf(
      "serving simulation: %td requests, seed %llu; prompts log-uniform in [%td, %td], "
      "outputs log-uniform in [%td, %td], Poisson arrivals at %g/s\n",
      settings.requests, static_cast<unsigned long long>(settings.seed), kMinPrompt, kMaxPrompt,
      kMinOutput, kMaxOutput, settings.rate);
  std::printf(
      "layer: E = %td, H = %td, H_kv = %td, D = %td, frozen (weights packed: %s); "
      "prompt chunk %td; page %td rows\n",
      settings.embed, settings.heads, settings.kv_heads, head_dim,
      model.weights_packed() ? "yes" : "no", settings.chunk, settings.page_size);
  std::printf(
      "memory: %td contiguous slots of %td rows = %td rows; %td pages of %td = %td rows "
      "(%.1f KiB a row of keys and values)\n",
      slots, kMaxPrompt + kMaxOutput, contiguous_rows, pages, settings.page_size,
      pages * settings.page_size, row_bytes / 1024.0);

  TokenRows tokens(settings.embed);
  PagedServer paged(model, requests, settings, pages, 0, tokens);
  std::unique_ptr<PagedServer> capped;
  if (settings.paged_cap > 0) {
    capped =
        std::make_unique<PagedServer>(model, requests, settings, pages, settings.paged_cap, tokens);
  }
  ContiguousServer contiguous(model, requests, settings, slots, tokens);
  // Interleaved: the server whose clock is behind steps next.
  std::vector<Server*> servers{&paged};
  if (capped) servers.push_back(capped.get());
  servers.push_back(&contiguous);
  for (;;) {
    Server* next = nullptr;
    for (Server* server : servers) {
      if (!server->finished() && (next == nullptr || server->clock() < next->clock())) {
        next = server;
      }
    }
    if (next == nullptr) break;
    next->step();
  }
  std::vector<RunResult> runs{paged.paged_result()};
  if (capped) runs.push_back(capped->paged_result());
  runs.push_back(contiguous.result());
  for (const RunResult& run : runs) print(run, settings);
  const double ratio = output_rate(runs[0]) / output_rate(runs.back());
  std::printf("\nthroughput, paged over contiguous: %.2fx\n", ratio);
  if (capped) {
    std::printf("throughput, paged over paged at most %td sequences: %.2fx\n", settings.paged_cap,
                output_rate(runs[0]) / output_rate(runs[1]));
  }
  if (!settings.json.empty()) write_json(settings.json, settings, runs, ratio);
  return 0;
}
