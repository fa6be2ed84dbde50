#include "engine/speed.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <time.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/optimizer.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw8bit.h"
#include "models/layers.h"
#include "models/lora.h"

namespace rondo::engine {
namespace {

namespace fs = std::filesystem;

// Blocks above this many parameters are measured at a narrower width (a 70B model's block would
// take seconds per pass on a desktop CPU and gigabytes for its gradients).
constexpr double kMaxMeasuredParams = 8e6;
constexpr int kRuns = 5;
// ... and for this long at least (up to kMaxRuns passes): a pass of a small model's block takes a
// few milliseconds, and the median of five such passes moved by 10-20% between two `rondo plan`
// calls on a shared machine.
constexpr double kMinMeasuredSeconds = 0.4;
constexpr int kMaxRuns = 400;
// Part of every cache key: figures measured another way are measured again.
constexpr const char* kMethod = "median-0.4s-busy";  // "busy": Note [A probe on a busy machine]

// The median time of `pass`, run kRuns times at least and for kMinMeasuredSeconds at least.
double median_seconds(const std::function<void()>& pass) {
  std::vector<double> seconds;
  double total = 0;
  while (static_cast<int>(seconds.size()) < kRuns ||
         (total < kMinMeasuredSeconds && static_cast<int>(seconds.size()) < kMaxRuns)) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    total += seconds.back();
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return std::max(seconds[seconds.size() / 2], 1e-9);
}
// A pass is measured on the run's own microbatch (rows x sequence length: a block's FLOP/s grows
// with its token count; on this project's machine SmolLM2's block ran at 93 GFLOP/s on 32 tokens
// and 171 on 256) up to this many tokens, and up to this many FLOPs (forward and backward), so
// that six passes take a few seconds at most.
constexpr std::int64_t kMaxMeasuredTokens = 1024;
constexpr double kMaxPassFlops = 10e9;

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  return "unknown CPU";
}

// A one-block configuration of `c`'s first sparse block (else its first), narrowed when large.
models::ModelConfig one_block(const models::ModelConfig& c) {
  std::int64_t b = 0;
  if (c.num_experts > 0)
    while (b + 1 < c.num_layers && !c.sparse(b))
      ++b;
  models::ModelConfig one = c;
  one.num_layers = 1;
  one.sparse_layers =
      c.sparse_layers.empty() ? std::vector<bool>{} : std::vector<bool>{c.sparse(b)};
  one.sliding_layers =
      c.sliding_layers.empty() ? std::vector<bool>{} : std::vector<bool>{c.windowed(b)};
  one.vocab_size = std::min<std::int64_t>(c.vocab_size, 1024);  // the block needs no vocabulary
  const double params = static_cast<double>(models::layer_specs(one)[1].param_count());
  if (params > kMaxMeasuredParams) {
    const double s = std::sqrt(kMaxMeasuredParams / params);
    const std::int64_t group =
        std::max<std::int64_t>(c.num_heads / std::max<std::int64_t>(c.num_kv_heads, 1), 1);
    one.num_kv_heads =
        std::max<std::int64_t>(1, std::llround(static_cast<double>(c.num_kv_heads) * s));
    one.num_heads = one.num_kv_heads * group;
    one.hidden_size =
        std::max<std::int64_t>(64, std::llround(static_cast<double>(c.hidden_size) * s / 64) * 64);
    one.intermediate_size =
        std::max<std::int64_t>(64, std::llround(static_cast<double>(c.intermediate_size) * s));
    if (c.moe_intermediate_size > 0)
      one.moe_intermediate_size = std::max<std::int64_t>(
          64, std::llround(static_cast<double>(c.moe_intermediate_size) * s));
  }
  return one;
}

at::ScalarType scalar_of(const std::string& dtype) {
  return dtype == "bf16" ? at::kBFloat16 : dtype == "fp16" ? at::kHalf : at::kFloat;
}

// The microbatch a pass measures: `rows` rows of T tokens.
struct Batch {
  std::int64_t rows = 1, T = 16;
};

Batch measured_batch(const models::ModelConfig& one, std::int64_t seq_len, std::int64_t rows) {
  const double params = static_cast<double>(models::layer_specs(one)[1].param_count());
  const std::int64_t budget = std::clamp<std::int64_t>(
      static_cast<std::int64_t>(kMaxPassFlops / (6 * std::max(params, 1.0))), 16,
      kMaxMeasuredTokens);
  Batch b;
  b.T = std::clamp<std::int64_t>(seq_len > 0 ? seq_len : 128, 16, budget);
  b.rows = std::clamp<std::int64_t>(rows, 1, std::max<std::int64_t>(budget / b.T, 1));
  return b;
}

// FLOP/s of `one`'s block, forward and backward, on a batch: the median pass (median_seconds).
double measure(const models::ModelConfig& one, Batch batch, at::ScalarType dtype, bool frozen,
               const models::LoraConfig* lora) {
  const std::int64_t T = batch.T;
  const models::LayerSpec spec =
      lora ? models::add_lora(models::layer_specs(one), *lora)[1] : models::layer_specs(one)[1];
  // A generator of its own: the process's default one is not touched.
  at::Generator gen = at::detail::createCPUGenerator(0);
  std::vector<at::Tensor> w;
  for (const models::ParamSpec& p : spec.params) {
    at::Tensor t = p.shape.size() == 1 ? at::ones(p.shape) : 0.02 * at::randn(p.shape, gen);
    w.push_back(t.to(dtype).requires_grad_(!frozen || models::is_lora_param(p.name)));
  }
  const models::BlockWeights bw = models::BlockWeights::bind(spec, w);
  models::AttentionContext ctx = models::make_attention_context(
      one,
      {.tokens =
           at::arange(batch.rows * T, at::kLong).remainder(one.vocab_size).view({batch.rows, T})},
      dtype);
  // LoRA's dropout on the adapters' input, as a training step draws it.
  if (lora && lora->dropout > 0) ctx.dropout_seed = 1;
  const at::Tensor x0 = at::randn({batch.rows, T, one.hidden_size}, gen).to(dtype);
  auto pass = [&] {
    at::Tensor x = x0.detach().requires_grad_(true);
    c10::AutoGradMode grad(true);
    models::block_forward(one, bw, x, ctx).to(at::kFloat).sum().backward();
    for (at::Tensor& t : w)
      t.mutable_grad() = at::Tensor();
  };
  pass();  // warm-up: allocations, kernel selection
  const double seconds = median_seconds(pass);
  // In the planner's units: a frozen weight's backward (input gradients only) counts half.
  const double flops =
      (spec.flops_forward_per_token(T) + spec.flops_backward_per_token(T) * (frozen ? 0.5 : 1.0)) *
      static_cast<double>(batch.rows * T);
  return flops / seconds;
}

}  // namespace

std::string speed_cache_dir() {
  if (const char* d = std::getenv("RONDO_SPEED_CACHE"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return (fs::path(x) / "rondo" / "speed").string();
  if (const char* h = std::getenv("HOME"); h && *h)
    return (fs::path(h) / ".cache" / "rondo" / "speed").string();
  return "";
}

namespace {

// Note [A probe on a busy machine]
// A speed measured while other programs kept the cores busy is slow, and cached it would be
// remembered for every later plan (a plan made while both cores of this project's machine were
// busy said 35 s a step for a run that took 1.3 s). So a probe watches the machine: the CPU time
// all processes used while it measured (/proc/stat, steal included), less its own (the process's
// CPU clock), is what others took, as a share of the cores' time. Above kBusyShare the probe is
// repeated once after a pause and the less disturbed of the two kept; a result still disturbed is
// cached marked with that share, and a later probe of the same key measures again when the machine
// is quiet then (a tenth of a second of /proc/stat says so), keeping the cached figure otherwise
// (so that a machine busy for good does not pay a probe per plan). Plans say when they used a
// disturbed figure (speed_probe_caveat). What runs measure corrects the rest: a run on the CPU
// whose steps are far from the plan's forgets this machine's figures (forget_cpu_speeds), and the
// next plan measures them again.
constexpr double kBusyShare = 0.25;

// The CPU time (seconds) all processes have used, and this process, now.
struct CpuClock {
  double all = 0, own = 0;
  std::chrono::steady_clock::time_point at;
};

CpuClock cpu_clock() {
  CpuClock c;
  c.at = std::chrono::steady_clock::now();
  std::ifstream f("/proc/stat");
  std::string name;
  unsigned long long user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0,
                     steal = 0;
  f >> name >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double hz = static_cast<double>(std::max<long>(::sysconf(_SC_CLK_TCK), 1));
  c.all = static_cast<double>(user + nice + system + irq + softirq + steal) / hz;
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  c.own = static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  return c;
}

// The share of the cores' time between `a` and `b` that other processes used (0 when unknown).
double others_share(const CpuClock& a, const CpuClock& b) {
  const double wall = std::chrono::duration<double>(b.at - a.at).count();
  const double capacity =
      wall * static_cast<double>(std::max<long>(::sysconf(_SC_NPROCESSORS_ONLN), 1));
  if (!(capacity > 0) || b.all <= a.all) return 0;
  return std::clamp((b.all - a.all - (b.own - a.own)) / capacity, 0.0, 1.0);
}

// The most disturbed figure this process's plans used (for speed_probe_caveat).
std::atomic<double> g_busiest{0};

void note_disturbed(double share) {
  double seen = g_busiest.load();
  while (share > seen && !g_busiest.compare_exchange_weak(seen, share)) {
  }
}

// The cache files this process's plans read or wrote (forget_cpu_speeds removes them: the thread
// count, part of the key, may have changed since).
std::mutex g_used_mu;
std::set<fs::path> g_used;

// `measure()`'s result for `key`, from the cache when it holds one (see speed.h and Note [A probe
// on a busy machine]).
double cached(const std::string& key, const std::function<double()>& measure) {
  const std::string dir = speed_cache_dir();
  const fs::path file =
      dir.empty() ? fs::path()
                  : fs::path(dir) / fmt::format("{:016x}.json", std::hash<std::string>{}(key));
  if (!file.empty()) {
    std::lock_guard<std::mutex> lock(g_used_mu);
    g_used.insert(file);
  }
  double kept = 0, kept_busy = 1;
  if (!file.empty()) {
    std::ifstream in(file);
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("key", "") == key && j.value("value", 0.0) > 0) {
      kept = j.value("value", 0.0);
      kept_busy = j.value("busy", 0.0);
      if (kept_busy <= kBusyShare) return kept;
      // Measured on a busy machine: again if it is quiet now.
      const CpuClock a = cpu_clock();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (others_share(a, cpu_clock()) > kBusyShare) {
        note_disturbed(kept_busy);
        return kept;
      }
    }
  }
  double value = 0, busy = 1;
  for (int attempt = 0; attempt < 2 && busy > kBusyShare; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const CpuClock a = cpu_clock();
    const double v = measure();
    const double share = others_share(a, cpu_clock());
    if (attempt == 0 || share < busy) {
      busy = share;
      value = v;
    }
  }
  // A figure from a quieter moment than this one's stays.
  if (kept > 0 && kept_busy < busy) {
    note_disturbed(kept_busy);
    return kept;
  }
  if (busy > kBusyShare) note_disturbed(busy);
  if (!file.empty()) {
    // Written whole under a temporary name, then renamed: concurrent runs never read half a file.
    std::error_code ec;
    fs::create_directories(file.parent_path(), ec);
    const fs::path tmp = file.string() + fmt::format(".{}.tmp", static_cast<long>(::getpid()));
    {
      std::ofstream out(tmp);
      out << nlohmann::json{{"key", key}, {"value", value}, {"busy", busy}}.dump() << "\n";
    }
    fs::rename(tmp, file, ec);
    if (ec) fs::remove(tmp, ec);
  }
  return value;
}

// What this machine's figures are keyed on: the CPU and torch's thread count.
std::string machine_key() {
  return fmt::format("|cpu={}|threads={}|", cpu_model(), at::get_num_threads());
}

}  // namespace

double speed_probe_caveat() {
  return g_busiest.load();
}

int forget_cpu_speeds() {
  const std::string dir = speed_cache_dir();
  if (dir.empty()) return 0;
  const std::string machine = machine_key();
  std::set<fs::path> doomed;
  {
    std::lock_guard<std::mutex> lock(g_used_mu);
    doomed.swap(g_used);
  }
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".json") continue;
    std::ifstream in(it->path());
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("key", "").find(machine) != std::string::npos)
      doomed.insert(it->path());
  }
  int forgotten = 0;
  for (const fs::path& f : doomed) {
    std::error_code e2;
    if (f.parent_path() == fs::path(dir) && fs::remove(f, e2)) ++forgotten;
  }
  return forgotten;
}

double cpu_optimizer_params_per_s(const std::string& stream_dtype, bool eight_bit_moments) {
  // 20 bytes a parameter (gradient, master, m, v, an f32 streaming copy at most).
  const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
  const std::size_t n = std::clamp<std::size_t>(l3 > 0 ? 2 * static_cast<std::size_t>(l3) / 20 : 0,
                                                4u << 20, 64u << 20);
  const std::string key =
      fmt::format("{}|optimizer|cpu={}|threads={}|stream={}|n={}{}", kMethod, cpu_model(),
                  at::get_num_threads(), stream_dtype, n, eight_bit_moments ? "|moments=8bit" : "");
  return cached(key, [&] {
    const kernels::FloatDType sd = stream_dtype == "fp32"   ? kernels::FloatDType::kF32
                                   : stream_dtype == "fp16" ? kernels::FloatDType::kF16
                                                            : kernels::FloatDType::kBF16;
    // A tensor as the store holds it: master and moments in the format asked for.
    const std::size_t blocks = kernels::adamw8bit_blocks(n);
    std::vector<float> grad(n, 1e-3f), master(n, 0.5f), stream(n);
    std::vector<float> moments(eight_bit_moments ? 2 * blocks : 2 * n, 0.f);
    std::vector<std::uint8_t> codes(eight_bit_moments ? 2 * n : 0);
    offload::TensorState tensor{.numel = n, .trainable = true, .master = master.data()};
    if (eight_bit_moments) {
      tensor.m_codes = codes.data();
      tensor.v_codes = codes.data() + n;
      tensor.m_absmax = moments.data();
      tensor.v_absmax = moments.data() + blocks;
    } else {
      tensor.m = moments.data();
      tensor.v = moments.data() + n;
    }
    auto step = [&](std::int64_t k) {
      adamw_update(tensor, grad.data(), kernels::FloatDType::kF32, stream.data(), sd, {.step = k});
    };
    step(1);  // warm-up: pages, threads
    std::int64_t t = 1;
    return static_cast<double>(n) / median_seconds([&] {
             (void)kernels::grad_sum_squares(grad.data(), kernels::FloatDType::kF32, n);
             step(++t);
           });
  });
}

double cpu_flops(const models::ModelConfig& config, std::int64_t seq_len, std::int64_t rows,
                 const std::string& dtype, bool frozen_weights, const models::LoraConfig* lora) {
  frozen_weights = frozen_weights || lora;
  std::string adapters = "none";
  if (lora) {
    adapters = fmt::format("r{},dropout{}", lora->rank, lora->dropout);
    for (const std::string& t : lora->targets)
      adapters += "," + t;
  }
  const models::ModelConfig one = one_block(config);
  const Batch batch = measured_batch(one, seq_len, rows);
  const std::string key = fmt::format(
      "{}|cpu={}|threads={}|C={}|I={}|H={}|KV={}|D={}|E={}/"
      "{}x{}|qk_norm={}|window={}|sinks={}|T={}|"
      "rows={}|dtype={}|frozen={}|lora={}",
      kMethod, cpu_model(), at::get_num_threads(), one.hidden_size, one.intermediate_size,
      one.num_heads, one.num_kv_heads, one.head_dim, one.sparse(0) ? one.num_experts : 0,
      one.experts_per_token, one.moe_intermediate_size, one.qk_norm,
      one.windowed(0) ? one.sliding_window : 0, one.attention_sinks, batch.T, batch.rows, dtype,
      frozen_weights, adapters);
  return cached(key, [&] { return measure(one, batch, scalar_of(dtype), frozen_weights, lora); });
}

double cpu_head_flops(const models::ModelConfig& config, std::int64_t seq_len, std::int64_t rows,
                      const std::string& dtype, bool trained_head) {
  // The engine's chunk for the model's own vocabulary (the matmuls' row count, what sets their
  // speed); a large head measured on fewer vocabulary rows, as many as kMaxMeasuredParams allows.
  const std::int64_t C = config.hidden_size;
  const std::int64_t chunk =
      head_chunk_tokens(EngineOptions{}.head_chunk_tokens, config.vocab_size, /*cpu_backed=*/true);
  const std::int64_t V = std::clamp<std::int64_t>(
      static_cast<std::int64_t>(kMaxMeasuredParams /
                                static_cast<double>(std::max<std::int64_t>(C, 1))),
      std::min<std::int64_t>(config.vocab_size, 1024), config.vocab_size);
  const std::int64_t T =
      std::clamp<std::int64_t>(seq_len > 0 ? seq_len : 128, 16, kMaxMeasuredTokens);
  const std::int64_t R =
      std::clamp<std::int64_t>(rows, 1, std::max<std::int64_t>(kMaxMeasuredTokens / T, 1));
  const std::string key = fmt::format(
      "{}|head|cpu={}|threads={}|C={}|V={}|chunk={}|T={}|rows={}|dtype={}|trained={}", kMethod,
      cpu_model(), at::get_num_threads(), C, V, chunk, T, R, dtype, trained_head);
  return cached(key, [&] {
    models::ModelConfig c = config;
    c.vocab_size = V;
    const at::ScalarType st = scalar_of(dtype);
    at::Generator gen = at::detail::createCPUGenerator(0);
    const at::Tensor norm = at::ones({C}).to(st);
    const at::Tensor lm_head = (0.02 * at::randn({V, C}, gen)).to(st);
    const at::Tensor x = at::randn({R, T, C}, gen).to(st);
    const at::Tensor targets = at::randint(0, V, {R, T}, gen, at::kLong);
    auto pass = [&] {
      models::head_forward_backward(c, norm, lm_head, x, targets, 1.0, trained_head, chunk);
    };
    pass();  // warm-up
    const double seconds = median_seconds(pass);
    // In the planner's units (LayerSpec::flops_*_per_token; a frozen head's backward counts half).
    const double forward = 2.0 * static_cast<double>(V) * static_cast<double>(C);
    return forward * (trained_head ? 3.0 : 2.0) * static_cast<double>(R * T) / seconds;
  });
}

}  // namespace rondo::engine
