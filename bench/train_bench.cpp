// train_bench: tokens/s of `rondo train` (engine::Session, what the CLI runs: the devices it
// finds, the planner's plan, batching, events) against the plain libtorch training loop
// (tests/support/plain_loop.h) on the same model, the same rows and the same trainable tensors,
// measured in one run — a ratio, not an absolute target. Steady state: the first `warmup` steps
// are left out of both.
//
// On a machine without a GPU both run on the CPU with one torch thread (the engine's own threads
// are not limited), or the session on simulated GPUs (--sim N). Where torch sees a GPU, the session
// trains on it as `rondo train` would (its state in host memory, stages streamed, AdamW on the CPU,
// under --cap) and the plain loop keeps everything on that GPU (weights, AdamW, activations: what a
// GPU that holds the whole model does without Rondo). On a GPU it also reports, against peaks
// measured in the same run:
//   - achieved TFLOP/s against a bf16 8192³ matmul's: model FLOPs 6·P·tokens (P: the parameters
//     that multiply, the LM head included) plus causal attention over the whole row
//     (6·L·T·H·D per token), and for Rondo also with its recompute (another forward);
//   - Rondo's host<->device GB/s (the device events' byte totals) against a pinned copy's;
//   - the devices' idle share, and the GPU memory each took (torch's caching allocator and the
//     engine's pool apart).
//
// --preset qwen3-1.7b is the GPU benchmark of issue 14: Qwen3-1.7B's shape (28 blocks, C = 2048,
// 16/8 heads of 128, FFN 6144, vocabulary 151936, tied) as Llama blocks (no q/k norm), random bf16
// weights, rows of 4096 tokens, LoRA r32 on all linear layers or full fine-tuning.
//
//   train_bench [--preset qwen3-1.7b] [--steps 12] [--method lora|full] [--dtype fp32|bf16]
//               [--cap 24GB] [--host-memory 64GB] [--sim N] [--layers 4 --hidden 256 --ffn 688
//               --heads 4 --kv-heads 2 --vocab 0 --tie 0] [--seq-len 256 --rows 2 --accum 2]
//               [--rank 16] [--doc-words 30] [--nondeterministic]
//
// --nondeterministic also runs rondo with training.deterministic = false: what exactness costs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <fmt/format.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "engine/batching.h"
#include "engine/data.h"
#include "engine/session.h"
#include "engine/torch_device.h"
#include "kernels/error.h"
#include "models/chat_template.h"
#include "models/lora.h"
#include "models/model.h"
#include "models/model_files.h"
#include "tests/support/plain_loop.h"
#include "tests/support/tiny_model_folder.h"

using namespace rondo;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

constexpr int kWarmup = 2;

struct Figures {
  double tokens_per_s = 0;
  double loss_first = 0, loss_last = 0;
  std::uint64_t torch_peak = 0;   // GPU: torch's caching allocator, peak reserved
  std::uint64_t engine_peak = 0;  // GPU: the engine's pool, peak in use
  std::uint64_t engine_cap = 0;   // GPU: the cap the engine ran under
  std::string plan;               // the session's plan, as its first plan event said
  double predicted_step_s = 0;    // and its predicted step time
  double step_s = 0;              // measured, steady state
  double busy = 0;                // device busy fraction, mean over the measured steps
  double link_bytes_per_s = 0;    // host<->device, both directions, over the measured steps
  // Device time per job and step (span events, timed on the device), mean over the measured
  // steps, in plan order.
  std::vector<std::pair<std::string, double>> job_s;
};

struct Options {
  int steps = 12;
  std::string method = "lora";
  std::string dtype = "fp32";
  std::string cap;
  std::string host_memory;  // "" = what the OS reports free
  int sim = 0;              // > 0: the session on this many simulated GPUs
  int layers = 4, hidden = 256, ffn = 688, heads = 4, kv_heads = 2, vocab = 0, tie = 0;
  int seq_len = 256, rows = 2, accum = 2, rank = 16;
  int doc_words = 30;             // documents of doc_words to 2 * doc_words random words
  bool nondeterministic = false;  // also run rondo with training.deterministic = false
};

engine::TrainConfig config_for(const fs::path& dir, const Options& o) {
  engine::TrainConfig c;
  c.model.path = (dir / "model").string();
  c.model.dtype = o.dtype;
  c.data.train = (dir / "text.jsonl").string();
  c.data.seq_len = o.seq_len;
  c.training.method = o.method;
  c.training.steps = o.steps;
  c.training.batch_rows = o.rows;
  c.training.grad_accum = o.accum;
  c.training.lr = 1e-3;
  c.training.schedule = "constant";
  c.training.max_grad_norm = 1.0;
  c.lora.rank = o.rank;
  c.lora.alpha = 2.0 * o.rank;
  c.checkpoint.keep = 1;
  c.hardware.memory_cap = o.cap;
  c.hardware.host_memory = o.host_memory;
  c.hardware.sim_devices = o.sim;
  c.output.run_dir = (dir / ("run-" + o.method)).string();
  c.output.exports = {};
  return c;
}

Figures run_session(const engine::TrainConfig& c) {
  std::vector<std::pair<double, std::int64_t>> marks;  // (time, tokens) after each step
  std::vector<double> losses;
  const auto t0 = Clock::now();
  engine::SessionOptions so;
  so.config_toml = "# train_bench\n";
  so.events = (fs::path(c.output.run_dir).parent_path() / "events.jsonl").string();
  so.on_step = [&](const engine::StepEvent& e) {
    marks.emplace_back(
        std::chrono::duration<double>(Clock::now() - t0).count(),
        static_cast<std::int64_t>(c.data.seq_len * c.training.batch_rows * c.training.grad_accum));
    losses.push_back(e.loss);
  };
  if (at::hasCUDA()) engine::reset_torch_cuda_memory(0);
  engine::Session s(c, so);
  s.run();
  Figures f;
  if (auto m = engine::torch_cuda_memory(0)) f.torch_peak = m->peak_reserved;
  f.step_s =
      (marks.back().first - marks[kWarmup].first) / static_cast<double>(marks.size() - 1 - kWarmup);
  // Device events come once per step per device, their busy share covering that step and their
  // byte counts totals since the start: the measured steps are those after step kWarmup + 1.
  std::map<int, std::vector<std::pair<double, double>>> per_device;  // (busy, bytes moved)
  std::map<std::string, std::pair<double, int>> jobs;                // stage: (seconds, spans)
  std::vector<std::string> job_order;
  std::ifstream events(so.events);
  for (std::string line; std::getline(events, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object()) continue;
    if (j.value("type", "") == "plan" && f.plan.empty()) {
      f.plan = j.value("plan", "");
      f.predicted_step_s = j.value("predicted_step_s", 0.0);
    }
    if (j.value("type", "") == "span" && j.value("step", 0) > kWarmup) {
      const std::string stage = j.value("stage", "");
      if (!jobs.count(stage)) job_order.push_back(stage);
      jobs[stage].first += j.value("end", 0.0) - j.value("start", 0.0);
      jobs[stage].second += 1;
    }
    if (j.value("type", "") != "device") continue;
    per_device[j.value("device", 0)].emplace_back(
        j.value("busy_fraction", 0.0), static_cast<double>(j.value("bytes_h2d", std::uint64_t{0}) +
                                                           j.value("bytes_d2h", std::uint64_t{0})));
    f.engine_peak = std::max(f.engine_peak, j.value("bytes_peak", std::uint64_t{0}));
    f.engine_cap = j.value("bytes_cap", std::uint64_t{0});
  }
  double busy = 0, bytes = 0;
  int n = 0;
  for (auto& [d, v] : per_device) {
    if (v.size() <= kWarmup + 1) continue;
    for (std::size_t i = kWarmup + 1; i < v.size(); ++i, ++n)
      busy += v[i].first;
    bytes += v.back().second - v[kWarmup].second;
  }
  f.busy = n ? busy / n : 0;
  f.link_bytes_per_s = bytes / (marks.back().first - marks[kWarmup].first);
  double tokens = 0;
  for (std::size_t i = kWarmup + 1; i < marks.size(); ++i)
    tokens += static_cast<double>(marks[i].second);
  f.tokens_per_s = tokens / (marks.back().first - marks[kWarmup].first);
  f.loss_first = losses.front();
  f.loss_last = losses.back();
  for (const std::string& stage : job_order)
    f.job_s.emplace_back(stage, jobs[stage].first / jobs[stage].second);
  return f;
}

Figures run_plain(const engine::TrainConfig& c) {
  const at::Device device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType dtype = c.model.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  if (at::hasCUDA()) engine::reset_torch_cuda_memory(0);
  models::Model model = models::Model::load(c.model.path, {.dtype = models::DType::kF32});
  models::Tokenizer tok = models::load_tokenizer(c.model.path);
  models::ChatTemplate tmpl = models::chat_template_from_name("chatml");
  engine::Dataset d = engine::load_data(c.data.train, tok, tmpl, {});
  engine::Batcher batcher(d, {.seq_len = c.data.seq_len,
                              .rows = c.training.batch_rows,
                              .microbatches = c.training.grad_accum,
                              .seed = c.training.seed});
  const bool lora = c.training.method == "lora";
  std::vector<models::LayerSpec> specs = model.layers();
  std::map<std::string, at::Tensor> weights;
  for (const models::LayerSpec& l : specs)
    for (const models::ParamSpec& p : l.params)
      if (!p.tied) weights[p.name] = model.tensor(p.name);
  if (lora) {
    specs = models::add_lora(specs, c.lora_config());
    for (auto& [name, t] : models::init_lora(specs, c.training.seed))
      weights[name] = t;
  }
  test::PlainLoop loop(
      model.config(), weights, {.lr = c.training.lr, .weight_decay = c.training.weight_decay},
      c.training.max_grad_norm, dtype, &specs,
      [&](const std::string& n) { return !lora || models::is_lora_param(n); }, device);
  weights.clear();
  Figures f;
  Clock::time_point start;
  double tokens = 0;
  for (std::int64_t s = 1; s <= c.training.steps; ++s) {
    if (s == kWarmup + 1) start = Clock::now();
    std::vector<engine::Microbatch> mbs = batcher.step(s);
    const double loss = loop.step(mbs, nullptr, s, c.training.seed);
    if (s == 1) f.loss_first = loss;
    f.loss_last = loss;
    if (s > kWarmup)
      for (const auto& mb : mbs)
        tokens += static_cast<double>(mb.batch.tokens.numel());
  }
  f.tokens_per_s = tokens / std::chrono::duration<double>(Clock::now() - start).count();
  if (auto m = engine::torch_cuda_memory(0)) f.torch_peak = m->peak_reserved;
  return f;
}

// Peaks measured in the same run, on GPU 0: a bf16 matmul's TFLOP/s, and a pinned host buffer's
// copy rate to the device and back (GB/s, both directions averaged).
struct Peaks {
  double tflops = 0, copy_bytes_per_s = 0;
};

Peaks measure_peaks() {
  Peaks p;
  const at::Device gpu(at::kCUDA, 0);
  at::Tensor a = at::randn({8192, 8192}, at::TensorOptions(gpu).dtype(at::kBFloat16));
  at::Tensor b = at::randn({8192, 8192}, at::TensorOptions(gpu).dtype(at::kBFloat16));
  for (int i = 0; i < 3; ++i)
    at::matmul(a, b);
  torch::cuda::synchronize();
  auto t0 = Clock::now();
  const int reps = 10;
  for (int i = 0; i < reps; ++i)
    at::matmul(a, b);
  torch::cuda::synchronize();
  p.tflops = 2.0 * 8192.0 * 8192.0 * 8192.0 * reps /
             std::chrono::duration<double>(Clock::now() - t0).count() / 1e12;
  const std::int64_t bytes = 1ll << 30;
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  host.fill_(1);
  at::Tensor dev = at::empty({bytes}, at::TensorOptions(gpu).dtype(at::kByte));
  dev.copy_(host, true);
  host.copy_(dev, true);
  torch::cuda::synchronize();
  t0 = Clock::now();
  for (int i = 0; i < 4; ++i) {
    dev.copy_(host, true);
    host.copy_(dev, true);
  }
  torch::cuda::synchronize();
  p.copy_bytes_per_s =
      8.0 * static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - t0).count();
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const std::map<std::string, int*> ints = {
      {"--steps", &o.steps},     {"--layers", &o.layers},
      {"--hidden", &o.hidden},   {"--ffn", &o.ffn},
      {"--heads", &o.heads},     {"--kv-heads", &o.kv_heads},
      {"--vocab", &o.vocab},     {"--tie", &o.tie},
      {"--seq-len", &o.seq_len}, {"--rows", &o.rows},
      {"--accum", &o.accum},     {"--rank", &o.rank},
      {"--sim", &o.sim},         {"--doc-words", &o.doc_words}};
  const std::map<std::string, std::string*> strings = {{"--method", &o.method},
                                                       {"--dtype", &o.dtype},
                                                       {"--cap", &o.cap},
                                                       {"--host-memory", &o.host_memory}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--preset" && i + 1 < argc && std::string(argv[i + 1]) == "qwen3-1.7b") {
      ++i;  // later options still override
      o.layers = 28, o.hidden = 2048, o.ffn = 6144, o.heads = 16, o.kv_heads = 8;
      o.vocab = 151936, o.tie = 1, o.dtype = "bf16", o.seq_len = 4096, o.rows = 1, o.accum = 8;
      o.rank = 32, o.doc_words = 400, o.steps = 6;
    } else if (a == "--nondeterministic") {
      o.nondeterministic = true;
    } else if (ints.count(a) && i + 1 < argc) {
      *ints.at(a) = std::atoi(argv[++i]);
    } else if (strings.count(a) && i + 1 < argc) {
      *strings.at(a) = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: train_bench [--preset qwen3-1.7b] [--steps 12] [--method lora|full] "
                   "[--dtype fp32|bf16] [--cap 24GB] [--host-memory 64GB] [--sim N] [--layers 4] "
                   "[--hidden 256] [--ffn 688] [--heads 4] [--kv-heads 2] [--vocab 0] [--tie 0] "
                   "[--seq-len 256] [--rows 2] [--accum 2] [--rank 16] [--doc-words 30] "
                   "[--nondeterministic]\n");
      return 2;
    }
  }
  if (o.steps < kWarmup + 2) o.steps = kWarmup + 2;
  const bool gpu = at::hasCUDA();
  if (!gpu) at::set_num_threads(1);
  const fs::path dir =
      fs::temp_directory_path() / ("rondo-train-bench-" + std::to_string(::getpid()));
  try {
    fs::create_directories(dir);
    // A Llama of the shape asked for (the tiny byte-level tokenizer's vocabulary, or a larger
    // one padded as real models do) and documents of random words, enough for every step.
    const models::ModelConfig mc =
        test::write_model_folder((dir / "model").string(), 1,
                                 {.layers = o.layers,
                                  .max_positions = std::max(512, o.seq_len),
                                  .hidden = o.hidden,
                                  .intermediate = o.ffn,
                                  .heads = o.heads,
                                  .kv_heads = o.kv_heads,
                                  .vocab = o.vocab,
                                  .tie = o.tie != 0,
                                  .dtype = o.dtype == "bf16" ? at::kBFloat16 : at::kFloat});
    std::mt19937 rng(5);
    std::ofstream data(dir / "text.jsonl");
    const char* words[] = {"round", "pipe",  "stage", "host",   "memory", "stream",
                           "adam",  "token", "layer", "device", "link",   "batch"};
    const std::int64_t want_chars = std::int64_t{o.seq_len} * o.rows * o.accum * (o.steps + 1) * 2;
    std::int64_t chars = 0;
    for (int doc = 0; doc < 200 || chars < want_chars; ++doc) {
      std::string text;
      const int n = o.doc_words + static_cast<int>(rng() % (o.doc_words + 10));
      for (int w = 0; w < n; ++w)
        text += std::string(w ? " " : "") + words[rng() % 12];
      chars += static_cast<std::int64_t>(text.size());
      data << nlohmann::json{{"text", text}}.dump() << "\n";
    }
    data.close();
    const engine::TrainConfig c = config_for(dir, o);
    const Peaks peaks = gpu ? measure_peaks() : Peaks{};
    const Figures plain = run_plain(c);
    const Figures ours = run_session(c);
    Figures loose;  // deterministic kernels off
    if (o.nondeterministic) {
      engine::TrainConfig cn = c;
      cn.training.deterministic = false;
      cn.output.run_dir += "-nondeterministic";
      loose = run_session(cn);
    }
    // Parameters, and those that multiply (every matrix in the blocks and the LM head; the input
    // embedding is a lookup unless tied, when it is the head).
    std::int64_t params = 0, matmul_params = 0;
    for (const models::LayerSpec& l : models::layer_specs(mc))
      for (const models::ParamSpec& p : l.params) {
        if (p.tied) continue;
        std::int64_t k = 1;
        for (auto d : p.shape)
          k *= d;
        params += k;
        const bool lookup = l.kind == models::LayerKind::kPrefix && !mc.tie_word_embeddings;
        if (p.shape.size() == 2 && !lookup) matmul_params += k;
      }
    const std::int64_t step_tokens =
        std::int64_t{c.data.seq_len} * c.training.batch_rows * c.training.grad_accum;
    const double attn_fwd = 2.0 * static_cast<double>(mc.num_layers) * c.data.seq_len *
                            static_cast<double>(mc.num_heads * mc.head_dim);
    const double fwd_per_token = 2.0 * static_cast<double>(matmul_params) + attn_fwd;
    std::printf(
        "train_bench: %s %s, %d steps of %lld tokens (%lld blocks, C = %lld, vocabulary %lld, "
        "%.2fB parameters), %s, first %d steps left out\n",
        o.method.c_str(), o.dtype.c_str(), o.steps, static_cast<long long>(step_tokens),
        static_cast<long long>(mc.num_layers), static_cast<long long>(mc.hidden_size),
        static_cast<long long>(mc.vocab_size), static_cast<double>(params) / 1e9,
        gpu     ? "GPU 0 (the plain loop holds everything on it)"
        : o.sim ? "session on simulated GPUs, plain loop on 1 CPU thread"
                : "1 torch thread",
        kWarmup);
    if (gpu)
      std::printf("  peaks measured now: bf16 matmul %.0f TFLOP/s, pinned copy %.1f GB/s\n",
                  peaks.tflops, peaks.copy_bytes_per_s / 1e9);
    auto gpu_memory = [&](const Figures& f) {
      if (!gpu) return std::string();
      // Rondo's buffers come from torch's caching allocator too (engine::torch_cuda_allocator):
      // its peak covers both.
      std::string m = "; GPU memory: torch " + format_bytes(f.torch_peak);
      if (f.engine_cap)
        m += " (the engine's buffers included, at most " + format_bytes(f.engine_peak) + "; cap " +
             format_bytes(f.engine_cap) + ")";
      return m;
    };
    auto tflops = [&](const Figures& f, bool recompute) {
      if (!gpu) return std::string();
      // Model FLOPs: forward and backward (3 forwards' worth); with Rondo's recompute one more.
      const double model = 3 * fwd_per_token * f.tokens_per_s / 1e12;
      std::string t =
          fmt::format("; {:.0f} TFLOP/s ({:.2f} of the matmul peak)", model, model / peaks.tflops);
      if (recompute)
        t += fmt::format(", {:.0f} with the recompute", 4 * fwd_per_token * f.tokens_per_s / 1e12);
      return t;
    };
    std::printf("  %-30s %9.0f tokens/s (loss %.3f -> %.3f)%s%s\n", "plain libtorch loop",
                plain.tokens_per_s, plain.loss_first, plain.loss_last, tflops(plain, false).c_str(),
                gpu_memory(plain).c_str());
    std::printf("  %-30s %9.0f tokens/s (loss %.3f -> %.3f)%s%s\n",
                gpu     ? "rondo train (1 GPU)"
                : o.sim ? "rondo train (simulated GPUs)"
                        : "rondo train (1 CPU device)",
                ours.tokens_per_s, ours.loss_first, ours.loss_last, tflops(ours, true).c_str(),
                gpu_memory(ours).c_str());
    std::printf(
        "  rondo's plan %s: step %.3f s measured, %.3f s predicted; devices idle %.2f; "
        "host<->device %.2f GB/s%s\n",
        ours.plan.c_str(), ours.step_s, ours.predicted_step_s, 1 - ours.busy,
        ours.link_bytes_per_s / 1e9,
        gpu ? fmt::format(" ({:.2f} of the pinned copy's)",
                          ours.link_bytes_per_s / peaks.copy_bytes_per_s)
                  .c_str()
            : "");
    std::string jobs;
    double job_sum = 0;
    for (const auto& [stage, s] : ours.job_s) {
      jobs += fmt::format("{}{} {:.3f} s", jobs.empty() ? "" : ", ", stage, s);
      job_sum += s;
    }
    std::printf("  rondo's jobs, device time per step: %s (sum %.3f s of the %.3f s step)\n",
                jobs.c_str(), job_sum, ours.step_s);
    if (o.nondeterministic)
      std::printf("  %-30s %9.0f tokens/s (loss %.3f -> %.3f): deterministic kernels cost %.1f%%\n",
                  "rondo, deterministic off", loose.tokens_per_s, loose.loss_first, loose.loss_last,
                  100 * (1 - ours.tokens_per_s / loose.tokens_per_s));
    std::printf("  ratio rondo / plain: %.3f\n", ours.tokens_per_s / plain.tokens_per_s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    fs::remove_all(dir);
    return 1;
  }
  fs::remove_all(dir);
  return 0;
}
