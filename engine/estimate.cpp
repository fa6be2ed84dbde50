#include "engine/estimate.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/error.h"
#include "models/lora.h"

namespace fs = std::filesystem;

namespace rondo::engine {
namespace {

std::uint64_t dtype_bytes(const std::string& dtype) {
  return dtype == "fp32" ? 4 : 2;
}

std::string duration_text(double s) {
  if (s < 90) return fmt::format("{:.0f} s", s);
  if (s < 5400) return fmt::format("{:.0f} min", s / 60);
  return fmt::format("{:.1f} h", s / 3600);
}

}  // namespace

std::string format_bytes(std::uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string format_count(std::int64_t n) {
  const double v = static_cast<double>(n);
  if (v >= 1e9) return fmt::format("{:.2f} B", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.1f} M", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.1f} K", v / 1e3);
  return std::to_string(n);
}

std::uint64_t host_memory_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::uint64_t disk_space_free(const std::string& path) {
  fs::path p = fs::absolute(path.empty() ? fs::path(".") : fs::path(path));
  while (!p.empty() && !fs::exists(p) && p != p.parent_path())
    p = p.parent_path();
  struct statvfs s {};
  if (::statvfs(p.c_str(), &s) != 0) return 0;
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

double device_flops(const kernels::DeviceInfo& device, DeviceMode mode, const std::string& dtype) {
  if (mode == DeviceMode::kCuda) {
    // Dense tensor-core throughput one can reach in training (about half the datasheet peak).
    const int cc = device.compute_major * 10 + device.compute_minor;
    double tf = cc >= 100  ? 500
                : cc >= 90 ? 400
                : cc == 89 ? 80
                : cc >= 86 ? 35
                : cc >= 80 ? 150
                           : 15;
    if (dtype == "fp32") tf /= 8;
    return tf * 1e12;
  }
  // The CPU (or a simulated GPU on it): measure a matrix multiplication in fp32.
  at::Tensor a = at::rand({384, 384}), b = at::rand({384, 384});
  at::mm(a, b);  // warm up
  const auto t0 = std::chrono::steady_clock::now();
  int reps = 0;
  double s = 0;
  do {
    at::mm(a, b);
    ++reps;
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (s < 0.05);
  double flops = 2.0 * 384 * 384 * 384 * reps / s;
  if (dtype != "fp32") flops /= 2;  // bf16/fp16 matmuls on CPUs are slower than fp32
  return flops;
}

RunEstimate estimate_run(const TrainConfig& config, const models::ModelSummary& model,
                         const DevicePlan& devices, std::int64_t steps,
                         std::int64_t tokens_per_step, std::uint64_t host_free,
                         std::uint64_t disk_free) {
  RunEstimate e;
  e.devices = devices;
  e.steps = steps;
  e.tokens_per_step = tokens_per_step;
  const bool lora = config.training.method == "lora";
  std::vector<models::LayerSpec> specs = models::layer_specs(model.config);
  if (lora) specs = models::add_lora(specs, config.lora_config());
  const std::uint64_t wb = dtype_bytes(config.model.dtype);
  std::vector<std::int64_t> trained_per_layer;
  for (const models::LayerSpec& l : specs) {
    std::int64_t trained = 0;
    for (const models::ParamSpec& p : l.params) {
      if (p.tied) continue;
      e.params += p.numel();
      if (!lora || models::is_lora_param(p.name)) trained += p.numel();
    }
    trained_per_layer.push_back(trained);
    e.trained_params += trained;
  }
  const auto P = static_cast<std::uint64_t>(e.params),
             TP = static_cast<std::uint64_t>(e.trained_params);
  e.host.weights = P * wb;
  e.host.masters = TP * 4;
  e.host.moments = TP * 8;
  e.host.grads = TP * 4;
  const std::string stored = model.dtypes;
  const bool mapped =
      model.format == "safetensors" &&
      ((wb == 2 && (stored == "BF16" || stored == "F16")) || (wb == 4 && stored == "F32"));
  e.host.loading = mapped ? 0 : P * wb;
  const std::uint64_t C = static_cast<std::uint64_t>(model.config.hidden_size);

  // The plan, from FLOP counts and the devices' assumed speeds (speed 1 = 1 TFLOP/s).
  const double ref = 1e12;
  const int M = config.training.grad_accum;
  for (std::size_t l = 0; l < specs.size(); ++l) {
    const double f = specs[l].flops_forward_per_token(config.data.seq_len) / ref;
    // The backward of a frozen weight computes only the input gradient: about one forward.
    const double b =
        specs[l].flops_backward_per_token(config.data.seq_len) / ref * (lora ? 0.5 : 1.0);
    std::uint64_t pb = 0;
    for (const models::ParamSpec& p : specs[l].params)
      if (!p.tied) pb += static_cast<std::uint64_t>(p.numel()) * wb;
    e.inputs.layers.push_back(
        {.forward_s_per_token = f,
         .backward_s_per_token = b,
         .param_bytes = pb,
         .grad_bytes = static_cast<std::uint64_t>(trained_per_layer[l]) * 4,
         .activation_bytes_per_token = specs[l].activation_bytes_per_token(wb),
         .output_bytes_per_token = C * wb});
  }
  // Simulated GPUs and the CPU all compute on this machine's cores: one measurement for all, so
  // that equal devices get equal speeds.
  double cpu_flops = 0;
  for (const kernels::DeviceInfo& d : devices.devices) {
    double flops = 0;
    if (devices.mode == DeviceMode::kCuda) {
      flops = device_flops(d, devices.mode, config.model.dtype);
    } else {
      if (cpu_flops == 0) cpu_flops = device_flops(d, devices.mode, config.model.dtype);
      flops = cpu_flops;
    }
    e.inputs.devices.push_back(
        {.speed = flops / ref,
         .memory_cap = d.bytes_cap,
         .link_bytes_per_s = devices.mode == DeviceMode::kCuda ? 20e9 : d.link.bytes_per_s,
         .link_latency_s = devices.mode == DeviceMode::kCuda ? 10e-6 : d.link.latency_s});
  }
  e.inputs.tokens_per_step = tokens_per_step;
  e.inputs.microbatches = M;
  e.inputs.one_step_stale = config.training.one_step_stale;
  try {
    e.plan = plan_ours(e.inputs);
    e.prediction = predict(e.plan, e.inputs);
    e.tokens_per_s = tokens_per_step / std::max(e.prediction.step_time_s, 1e-12);
    e.seconds = e.prediction.step_time_s * static_cast<double>(steps);
    for (std::size_t d = 0; d < e.prediction.peak_bytes.size(); ++d) {
      const std::uint64_t cap = e.inputs.devices[d].memory_cap;
      if (cap > 0 && e.prediction.peak_bytes[d] > cap * 9 / 10)
        e.warnings.push_back(fmt::format(
            "device {} ({}): the plan's peak {} is within 10% of its {}; a longer sequence or "
            "larger batch may not fit",
            d, devices.devices[d].name, format_bytes(e.prediction.peak_bytes[d]),
            format_bytes(cap)));
    }
  } catch (const Error& err) {
    e.problems.push_back(std::string("device memory: ") + err.what());
  }
  // Host staging: every job's output and checkpoint of a step, two steps in flight.
  e.host.staging = 2 * static_cast<std::uint64_t>(tokens_per_step) * C * wb *
                   static_cast<std::uint64_t>(std::max(e.plan.jobs(), 1));

  e.host_available = host_free;
  if (!config.hardware.host_memory.empty())
    e.host_available = parse_bytes(config.hardware.host_memory, "hardware.host_memory");
  if (e.host_available == 0) e.host_available = host_memory_available();
  const std::uint64_t need = e.host.total();
  const std::string breakdown = fmt::format(
      "weights {}, masters {}, moments {}, gradients {}, loading {}, staging {}",
      format_bytes(e.host.weights), format_bytes(e.host.masters), format_bytes(e.host.moments),
      format_bytes(e.host.grads), format_bytes(e.host.loading), format_bytes(e.host.staging));
  if (need > e.host_available)
    e.problems.push_back(fmt::format(
        "host memory: the run needs about {} ({}) but {} is available; {}", format_bytes(need),
        breakdown, format_bytes(e.host_available),
        lora ? "use model.dtype = bf16, a smaller model, or a machine with more memory"
             : "use training.method = lora (no masters or moments for the base), or a machine "
               "with more memory"));
  else if (need > e.host_available / 100 * 85)
    e.warnings.push_back(fmt::format("host memory: the run needs about {} of the {} available",
                                     format_bytes(need), format_bytes(e.host_available)));

  e.checkpoint_bytes = TP * 12 + (config.training.one_step_stale ? TP * wb : 0) + 4096;
  const std::int64_t every = config.checkpoint.every > 0 ? config.checkpoint.every : steps;
  const std::int64_t written = steps / std::max<std::int64_t>(every, 1) + 1;
  const std::int64_t kept = config.checkpoint.keep > 0
                                ? std::min<std::int64_t>(config.checkpoint.keep + 1, written)
                                : written;
  e.disk_needed = e.checkpoint_bytes * static_cast<std::uint64_t>(kept);
  for (const std::string& x : config.output.exports)
    e.disk_needed += x == "adapter" ? TP * 4 : P * wb;
  e.disk_free = disk_free ? disk_free : disk_space_free(config.output.run_dir);
  if (e.disk_needed > e.disk_free)
    e.problems.push_back(
        fmt::format("disk: checkpoints and exports need about {} but {} is free under {}; set "
                    "output.run_dir on a larger disk or lower checkpoint.keep",
                    format_bytes(e.disk_needed), format_bytes(e.disk_free), config.output.run_dir));
  e.verdict = !e.problems.empty() ? "does not fit" : !e.warnings.empty() ? "tight" : "fits";
  return e;
}

std::string RunEstimate::text() const {
  std::ostringstream o;
  o << fmt::format("Parameters  {}, {} trained\n", format_count(params),
                   format_count(trained_params));
  o << fmt::format("Devices     {} ({})\n", devices.devices.size(), to_string(devices.mode));
  if (!plan.forward.empty() || plan.tail.end > 0) {
    o << fmt::format("Plan        {}\n", plan.describe());
    for (std::size_t d = 0; d < devices.devices.size() && d < prediction.peak_bytes.size(); ++d)
      o << fmt::format("  device {} {:<24} peak {:>10} of {:>10}\n", d, devices.devices[d].name,
                       format_bytes(prediction.peak_bytes[d]),
                       format_bytes(devices.devices[d].bytes_cap));
  }
  o << fmt::format("Host memory {} needed, {} available\n", format_bytes(host.total()),
                   format_bytes(host_available));
  o << fmt::format("Disk        {} needed, {} free\n", format_bytes(disk_needed),
                   format_bytes(disk_free));
  if (tokens_per_s > 0)
    o << fmt::format(
        "Speed       about {:.0f} tokens/s (estimated); {} steps of {} tokens: about {}\n",
        tokens_per_s, steps, tokens_per_step, duration_text(seconds));
  o << fmt::format("Verdict     {}\n", verdict);
  for (const std::string& p : problems)
    o << "  - " << p << "\n";
  for (const std::string& w : warnings)
    o << "  - " << w << "\n";
  return o.str();
}

std::string RunEstimate::json() const {
  nlohmann::json devs = nlohmann::json::array();
  for (std::size_t d = 0; d < devices.devices.size(); ++d)
    devs.push_back(
        {{"name", devices.devices[d].name},
         {"cap_bytes", devices.devices[d].bytes_cap},
         {"peak_bytes", d < prediction.peak_bytes.size() ? prediction.peak_bytes[d] : 0}});
  nlohmann::json j = {{"verdict", verdict},
                      {"problems", problems},
                      {"warnings", warnings},
                      {"params", params},
                      {"trained_params", trained_params},
                      {"mode", to_string(devices.mode)},
                      {"devices", devs},
                      {"plan", plan.forward.empty() && plan.tail.end == 0 ? "" : plan.describe()},
                      {"host",
                       {{"needed_bytes", host.total()},
                        {"available_bytes", host_available},
                        {"weights", host.weights},
                        {"masters", host.masters},
                        {"moments", host.moments},
                        {"grads", host.grads},
                        {"loading", host.loading},
                        {"staging", host.staging}}},
                      {"disk", {{"needed_bytes", disk_needed}, {"free_bytes", disk_free}}},
                      {"checkpoint_bytes", checkpoint_bytes},
                      {"steps", steps},
                      {"tokens_per_step", tokens_per_step},
                      {"tokens_per_s", tokens_per_s},
                      {"seconds", seconds}};
  return j.dump(2);
}

}  // namespace rondo::engine
