#include "engine/train_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "engine/lr_schedule.h"
#include "kernels/error.h"

namespace rondo::engine {
namespace {

template <typename T>
std::string str(const T& v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

bool one_of(const std::string& v, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return v == a; });
}

}  // namespace

double link_bytes_per_s(const std::string& link_speed) {
  if (link_speed.empty()) return 10e9 / 8;
  std::string t;
  for (char ch : link_speed)
    if (ch != ' ') t += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (t.ends_with("bit") || t.ends_with("bit/s") || t.ends_with("bps")) {
    t.resize(t.find('b'));
    double scale = 1;
    if (!t.empty() && (t.back() == 'k' || t.back() == 'm' || t.back() == 'g' || t.back() == 't')) {
      scale = t.back() == 'k' ? 1e3 : t.back() == 'm' ? 1e6 : t.back() == 'g' ? 1e9 : 1e12;
      t.pop_back();
    }
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    if (t.empty() || *end != '\0' || !(v > 0))
      throw Error("distributed.link_speed = \"" + link_speed +
                  "\": expected a speed such as \"10Gbit\" or \"1.25GB\" (per second)");
    return v * scale / 8;
  }
  double bytes = 0;
  try {
    bytes = static_cast<double>(parse_bytes(link_speed, "distributed.link_speed"));
  } catch (const Error&) {
  }
  if (!(bytes > 0))
    throw Error("distributed.link_speed = \"" + link_speed +
                "\": expected a speed such as \"10Gbit\" or \"1.25GB\" (per second)");
  return bytes;
}

models::LoraConfig TrainConfig::lora_config() const {
  return {.rank = lora.rank,
          .alpha = lora.alpha,
          .dropout = lora.dropout,
          .targets = lora.targets,
          .rslora = lora.rslora};
}

std::vector<std::string> TrainConfig::validate(bool planning) const {
  std::vector<std::string> p;
  auto add = [&](const std::string& field, const std::string& what) {
    p.push_back(field + ": " + what);
  };
  if (model.path.empty()) add("model.path", "not set; give a Hugging Face folder or a .gguf file");
  if (!one_of(model.dtype, {"bf16", "fp16", "fp32"}))
    add("model.dtype", "must be bf16, fp16 or fp32 (got '" + model.dtype + "')");
  if (!one_of(model.quantize, {"auto", "none", "nf4", "int8", "gguf", "stored"}))
    add("model.quantize",
        "must be auto, none, nf4, int8, gguf or stored (got '" + model.quantize + "')");
  else if (training.method == "full" && !one_of(model.quantize, {"auto", "none"}))
    add("model.quantize", "'" + model.quantize +
                              "' keeps a frozen base quantised, which needs training.method = "
                              "lora (full fine-tuning trains every weight); use none");
  if (model.double_quant && model.quantize != "nf4")
    add("model.double_quant", "applies to model.quantize = nf4 only");

  if (data.train.empty() && !planning) add("data.train", "not set; give a JSONL file");
  if (!one_of(data.format, {"auto", "text", "alpaca", "chat", "sharegpt"}))
    add("data.format", "must be auto, text, alpaca, chat or sharegpt (got '" + data.format + "')");
  if (!(data.validation_split >= 0 && data.validation_split <= 0.5))
    add("data.validation_split", "must be in [0, 0.5] (got " + str(data.validation_split) + ")");
  if (!data.validation.empty() && data.validation_split > 0)
    add("data.validation_split",
        "set together with data.validation; use one of them (a file, or a share held out)");
  if (data.seq_len < 2 || data.seq_len > (1 << 20))
    add("data.seq_len", "must be in 2..1048576 (got " + str(data.seq_len) + ")");
  try {
    const std::uint64_t max_line = parse_bytes(data.max_line, "data.max_line");
    if (max_line < 1024 || max_line > (1ull << 30))
      add("data.max_line", "must be in 1KiB..1GiB (got " + data.max_line + ")");
  } catch (const Error& e) {
    add("data.max_line", e.what());
  }

  if (!one_of(training.method, {"lora", "full"}))
    add("training.method", "must be lora or full (got '" + training.method + "')");
  if (training.method == "lora")
    for (const std::string& problem : lora_config().problems()) {
      // Each under the field it is about, so that the CLI can name the line.
      const char* field = problem.find("rank") != std::string::npos      ? "lora.rank"
                          : problem.find("alpha") != std::string::npos   ? "lora.alpha"
                          : problem.find("dropout") != std::string::npos ? "lora.dropout"
                                                                         : "lora.targets";
      add(field, problem);
    }
  if (!one_of(training.objective, {"sft", "dpo", "orpo", "simpo"}))
    add("training.objective",
        "must be sft (supervised), dpo, orpo or simpo (preference pairs) (got '" +
            training.objective + "')");
  if (training.objective != "sft") {
    if (!(preference.beta > 0 && preference.beta < 1e4))
      add("preference.beta", "must be positive (got " + str(preference.beta) + ")");
    if (!one_of(preference.loss, {"sigmoid", "ipo"}))
      add("preference.loss", "must be sigmoid or ipo (got '" + preference.loss + "')");
    if (!(preference.label_smoothing >= 0 && preference.label_smoothing < 0.5))
      add("preference.label_smoothing",
          "must be in [0, 0.5) (got " + str(preference.label_smoothing) + ")");
    if (!std::isfinite(preference.gamma))
      add("preference.gamma", "must be a number (got " + str(preference.gamma) + ")");
    // The policy must score pairs as the reference pass does; TRL turns dropout off too (its
    // disable_dropout, on by default).
    if (training.method == "lora" && lora.dropout > 0)
      add("lora.dropout", "must be 0 for a preference objective (got " + str(lora.dropout) +
                              "): pairs are scored without dropout, as TRL does");
    if (!(preference.sft_weight >= 0 && preference.sft_weight < 1e4))
      add("preference.sft_weight", "must be >= 0 (got " + str(preference.sft_weight) + ")");
    const std::int64_t n = preference.sequence_tokens(data.seq_len);
    if (preference.max_length < 0 || n < 2 || 2 * n > data.seq_len)
      add("preference.max_length",
          "a pair's two sequences must fit one row: at least 2 tokens each and at most half of "
          "data.seq_len (" +
              str(data.seq_len) + ") (got " + str(preference.max_length) +
              "; 0 = half of data.seq_len)");
  }
  if (!lora.init_adapter.empty() && training.method != "lora")
    add("lora.init_adapter", "starts LoRA adapters; training.method is '" + training.method + "'");
  if (training.steps < 0) add("training.steps", "must be >= 0 (got " + str(training.steps) + ")");
  if (training.steps == 0 && !(training.epochs > 0 && training.epochs <= 1e6))
    add("training.epochs",
        "must be positive when training.steps is 0 (got " + str(training.epochs) + ")");
  if (training.batch_rows < 1 || training.batch_rows > 65536)
    add("training.batch_rows", "must be in 1..65536 (got " + str(training.batch_rows) + ")");
  if (training.sequence_tile < -1 || training.sequence_tile > (1 << 20))
    add("training.sequence_tile",
        "must be -1 (the planner's choice), 0 (no tiling) or tokens per tile up to 1048576 (got " +
            str(training.sequence_tile) + ")");
  if (training.grad_accum < 1 || training.grad_accum > 65536)
    add("training.grad_accum", "must be in 1..65536 (got " + str(training.grad_accum) + ")");
  if (!(training.lr > 0 && training.lr < 1))
    add("training.lr", "must be in (0, 1) (got " + str(training.lr) + ")");
  if (!one_of(training.optimizer, {"adamw", "adamw_8bit"}))
    add("training.optimizer", "must be adamw or adamw_8bit (got '" + training.optimizer + "')");
  if (!one_of(training.schedule, {"constant", "linear", "cosine"}))
    add("training.schedule",
        "must be constant, linear or cosine (got '" + training.schedule + "')");
  if (training.warmup_steps < 0)
    add("training.warmup_steps", "must be >= 0 (got " + str(training.warmup_steps) + ")");
  if (training.steps > 0 && training.warmup_steps > training.steps)
    add("training.warmup_steps", "is more than training.steps (" + str(training.warmup_steps) +
                                     " > " + str(training.steps) + ")");
  if (!(training.min_lr_ratio >= 0 && training.min_lr_ratio <= 1))
    add("training.min_lr_ratio", "must be in [0, 1] (got " + str(training.min_lr_ratio) + ")");
  else if (training.min_lr_ratio > 0 && training.schedule != "cosine")
    add("training.min_lr_ratio",
        "applies to the cosine schedule only (training.schedule is '" + training.schedule + "')");
  if (!(training.weight_decay >= 0 && training.weight_decay < 10))
    add("training.weight_decay", "must be in [0, 10) (got " + str(training.weight_decay) + ")");
  if (!(training.beta1 >= 0 && training.beta1 < 1))
    add("training.beta1", "must be in [0, 1) (got " + str(training.beta1) + ")");
  if (!(training.beta2 >= 0 && training.beta2 < 1))
    add("training.beta2", "must be in [0, 1) (got " + str(training.beta2) + ")");
  // AdamW divides by sqrt(v) + eps: with eps 0 a weight whose gradient is 0 (LoRA's A at the first
  // step, where B is 0) becomes 0/0 = NaN a step later.
  if (!(training.eps > 0 && training.eps <= 1))
    add("training.eps", "must be in (0, 1] (got " + str(training.eps) +
                            "): AdamW divides by sqrt(v) + eps, so with 0 a weight whose gradient "
                            "is 0 becomes NaN; 1e-8 is the usual value");
  if (!std::isfinite(training.max_grad_norm))
    add("training.max_grad_norm", "must be a number (<= 0 turns clipping off)");

  if (checkpoint.every < 0)
    add("checkpoint.every", "must be >= 0 (got " + str(checkpoint.every) + "); 0 = at the end");
  if (distributed.backend != "gloo")
    add("distributed.backend",
        "must be \"gloo\" (got \"" + distributed.backend +
            "\"): gradients are summed in host memory, where Gloo over TCP is the way");
  try {
    link_bytes_per_s(distributed.link_speed);
  } catch (const Error& e) {
    p.push_back(e.what());
  }
  if (!(distributed.meet_timeout > 0) || distributed.meet_timeout > 1e7)
    add("distributed.meet_timeout",
        "must be a positive number of seconds (got " + str(distributed.meet_timeout) + ")");
  if (distributed.shard_optimizer && training.one_step_stale)
    add("distributed.shard_optimizer",
        "cannot be combined with training.one_step_stale (the stale update publishes masters "
        "that only their owner holds); turn one of them off");
  if (!(distributed.timeout > 0) || distributed.timeout > 1e7)
    add("distributed.timeout",
        "must be a positive number of seconds (got " + str(distributed.timeout) + ")");
  if (checkpoint.keep < 0)
    add("checkpoint.keep", "must be >= 0 (got " + str(checkpoint.keep) + ")");

  if (eval.every < 0) add("eval.every", "must be >= 0 (got " + str(eval.every) + ")");
  if (eval.every > 0 && data.validation.empty() && data.validation_split == 0)
    add("eval.every", "needs validation data: set data.validation or data.validation_split");
  if (eval.sample_every < 0)
    add("eval.sample_every", "must be >= 0 (got " + str(eval.sample_every) + ")");
  if (eval.sample_every > 0 && eval.prompts.empty())
    add("eval.prompts", "empty while eval.sample_every is set; give at least one prompt");
  if (eval.sample_tokens < 1 || eval.sample_tokens > 4096)
    add("eval.sample_tokens", "must be in 1..4096 (got " + str(eval.sample_tokens) + ")");

  if (hardware.sim_devices < 0 || hardware.sim_devices > 64)
    add("hardware.sim_devices", "must be in 0..64 (got " + str(hardware.sim_devices) + ")");
  if (!one_of(hardware.offload_io, {"auto", "io_uring", "threads"}))
    add("hardware.offload_io",
        "must be auto, io_uring or threads (got '" + hardware.offload_io + "')");
  if (hardware.gpu_count < 1 || hardware.gpu_count > 64)
    add("hardware.gpu_count", "must be in 1..64 (got " + str(hardware.gpu_count) + ")");
  if (!hardware.gpu.empty() && hardware.sim_devices > 0)
    add("hardware.gpu", "set together with hardware.sim_devices; use one of them");
  for (auto [field, value] : {std::pair{"hardware.memory_cap", &hardware.memory_cap},
                              std::pair{"hardware.host_memory", &hardware.host_memory},
                              std::pair{"hardware.disk_speed", &hardware.disk_speed},
                              std::pair{"hardware.offload_chunk", &hardware.offload_chunk},
                              std::pair{"hardware.disk_space", &hardware.disk_space}}) {
    if (value->empty()) continue;
    try {
      if (parse_bytes(*value, field) == 0) add(field, "must be more than 0 (or left out)");
    } catch (const Error& e) {
      p.push_back(e.what());
    }
  }

  if (!hardware.disk_space.empty() && hardware.offload_dir.empty())
    add("hardware.disk_space",
        "set without hardware.offload_dir; it is the space the run may use there, so set "
        "offload_dir to that drive's folder or leave disk_space out");

  if (output.run_dir.empty() && !planning)
    add("output.run_dir", "not set; give the folder the run writes");
  for (const std::string& e : output.exports) {
    if (!one_of(e, {"adapter", "merged", "gguf", "gguf-adapter"}))
      add("output.exports", "'" + e + "' is not adapter, merged, gguf or gguf-adapter");
    else if ((e == "adapter" || e == "gguf-adapter") && training.method == "full")
      add("output.exports", "'" + e + "' needs training.method = lora; use merged or gguf");
  }
  return p;
}

}  // namespace rondo::engine
