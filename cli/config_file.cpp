#include "cli/config_file.h"

#include <fmt/format.h>

#include <toml++/toml.h>
#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>
#include <variant>

#include "kernels/error.h"
#include "models/mapped_file.h"
#include "models/unicode.h"

namespace rondo::cli {
namespace {

using Ptr = std::variant<std::string*, std::int64_t*, int*, double*, bool*, std::uint64_t*,
                         std::vector<std::string>*>;

struct Field {
  std::string key;  // "training.lr"
  Ptr ptr;
  const char* help;
};

std::vector<Field> fields(engine::TrainConfig& c) {
  return {
      {"model.path", &c.model.path, "Hugging Face folder or .gguf file"},
      {"model.dtype", &c.model.dtype, "bf16, fp16 (loss scaling) or fp32: weights streamed in"},
      {"model.quantize", &c.model.quantize,
       "frozen LoRA base: auto, none, nf4, int8, gguf, stored"},
      {"model.double_quant", &c.model.double_quant, "nf4: quantise the block scales too"},
      {"data.train", &c.data.train, "JSONL training file"},
      {"data.validation", &c.data.validation, "JSONL validation file"},
      {"data.validation_split", &c.data.validation_split, "share of training held out, 0..0.5"},
      {"data.format", &c.data.format, "auto, text, alpaca, chat, sharegpt"},
      {"data.chat_format", &c.data.chat_format, "\"\" = the model's template; chatml, llama3, ..."},
      {"data.train_on_everything", &c.data.train_on_everything, "loss on prompts too"},
      {"data.skip_bad_lines", &c.data.skip_bad_lines, "skip and count bad lines"},
      {"data.max_line", &c.data.max_line, "longest line read, e.g. \"16MiB\"; longer: a bad line"},
      {"data.seq_len", &c.data.seq_len, "tokens per row; longer examples are truncated"},
      {"data.pack", &c.data.pack, "several examples per row"},
      {"data.shuffle", &c.data.shuffle, "new order each epoch"},
      {"lora.rank", &c.lora.rank, "LoRA rank r"},
      {"lora.alpha", &c.lora.alpha, "LoRA alpha"},
      {"lora.dropout", &c.lora.dropout, "dropout on the adapters' input"},
      {"lora.targets", &c.lora.targets, "q_proj, ..., down_proj or all-linear"},
      {"lora.rslora", &c.lora.rslora, "scaling alpha/sqrt(r)"},
      {"lora.init_adapter", &c.lora.init_adapter, "PEFT adapter folder to start from"},
      {"training.method", &c.training.method, "lora or full"},
      {"training.objective", &c.training.objective,
       "sft (supervised), or pairs of answers: dpo, orpo, simpo"},
      {"training.steps", &c.training.steps, "optimizer steps; 0 = from epochs"},
      {"training.epochs", &c.training.epochs, "when steps = 0"},
      {"training.batch_rows", &c.training.batch_rows, "rows per microbatch"},
      {"training.grad_accum", &c.training.grad_accum, "microbatches per step"},
      {"training.lr", &c.training.lr, "peak learning rate"},
      {"training.optimizer", &c.training.optimizer,
       "adamw, or adamw_8bit (moments in 8 bits: 2 bytes per parameter instead of 8)"},
      {"training.schedule", &c.training.schedule, "constant, linear, cosine"},
      {"training.warmup_steps", &c.training.warmup_steps, "linear warmup steps"},
      {"training.min_lr_ratio", &c.training.min_lr_ratio, "cosine floor, share of lr"},
      {"training.weight_decay", &c.training.weight_decay, "decoupled weight decay"},
      {"training.beta1", &c.training.beta1, "AdamW beta1"},
      {"training.beta2", &c.training.beta2, "AdamW beta2"},
      {"training.eps", &c.training.eps, "AdamW epsilon"},
      {"training.max_grad_norm", &c.training.max_grad_norm, "clipping; <= 0 = off"},
      {"training.seed", &c.training.seed, "initialisation, shuffling, dropout"},
      {"training.one_step_stale", &c.training.one_step_stale, "RoundPipe's asynchronous update"},
      {"training.sequence_tile", &c.training.sequence_tile,
       "tokens per sequence tile; -1 = the planner's choice, 0 = never"},
      {"training.deterministic", &c.training.deterministic,
       "deterministic GPU kernels: exact resume on GPUs"},
      {"preference.beta", &c.preference.beta, "DPO/SimPO beta, ORPO lambda"},
      {"preference.loss", &c.preference.loss, "DPO: sigmoid or ipo"},
      {"preference.label_smoothing", &c.preference.label_smoothing,
       "conservative labels, 0..0.5 (DPO sigmoid: cDPO; SimPO)"},
      {"preference.gamma", &c.preference.gamma, "SimPO target margin"},
      {"preference.sft_weight", &c.preference.sft_weight,
       "SimPO: weight of the chosen NLL (TRL's cpo_alpha, whose default is 1)"},
      {"preference.max_length", &c.preference.max_length,
       "tokens per sequence; 0 = half of data.seq_len"},
      {"checkpoint.every", &c.checkpoint.every, "steps between checkpoints; 0 = at the end"},
      {"checkpoint.keep", &c.checkpoint.keep, "newest checkpoints kept; 0 = all"},
      {"eval.every", &c.eval.every, "steps between validation losses; 0 = never"},
      {"eval.sample_every", &c.eval.sample_every, "steps between samples; 0 = never"},
      {"eval.prompts", &c.eval.prompts, "prompts for samples"},
      {"eval.sample_tokens", &c.eval.sample_tokens, "new tokens per sample"},
      {"hardware.sim_devices", &c.hardware.sim_devices, "simulated GPUs instead of CUDA ones"},
      {"hardware.memory_cap", &c.hardware.memory_cap, "per GPU, e.g. \"24GB\""},
      {"hardware.host_memory", &c.hardware.host_memory, "host memory budget, e.g. \"64GB\""},
      {"hardware.offload_dir", &c.hardware.offload_dir,
       "NVMe folder for what host memory cannot hold"},
      {"hardware.offload_io", &c.hardware.offload_io, "auto, io_uring, threads"},
      {"hardware.disk_speed", &c.hardware.disk_speed, "offload_dir read speed per second, \"3GB\""},
      {"hardware.offload_chunk", &c.hardware.offload_chunk,
       "optimizer state staged at a time per NVMe piece, \"256MB\""},
      {"hardware.disk_space", &c.hardware.disk_space,
       "space the run may use in offload_dir, \"500GB\""},
      {"hardware.gpu", &c.hardware.gpu, "plan for this card: \"RTX 4090\", \"A100\", ..."},
      {"hardware.gpu_count", &c.hardware.gpu_count, "how many of hardware.gpu"},
      {"output.run_dir", &c.output.run_dir, "the run folder"},
      {"output.exports", &c.output.exports,
       "at the end: adapter, merged, gguf, gguf-adapter (left out: adapter for LoRA, merged for "
       "full; gguf for full on a GGUF base)"},
      {"distributed.backend", &c.distributed.backend, "gloo (ranks: torchrun, srun or --nodes)"},
      {"distributed.timeout", &c.distributed.timeout,
       "seconds a rank waits for the others before the run fails"},
      {"distributed.meet_timeout", &c.distributed.meet_timeout,
       "seconds ranks wait for one loading the model or writing a checkpoint alone"},
      {"distributed.link_speed", &c.distributed.link_speed,
       "link between the ranks for rondo plan: \"10Gbit\", \"1.25GB\"; \"\" = 10 Gbit/s"},
      {"distributed.interface", &c.distributed.interface,
       "network interface for Gloo; \"\" = the route to the master"},
      {"distributed.shard_optimizer", &c.distributed.shard_optimizer,
       "each rank holds its share of the optimizer state (ZeRO-1)"},
  };
}

const char* type_name(const Ptr& p) {
  return std::visit(
      [](auto* v) -> const char* {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) return "a string";
        if constexpr (std::is_same_v<T, bool>) return "true or false";
        if constexpr (std::is_same_v<T, double>) return "a number";
        if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a list of strings";
        return "an integer";
      },
      p);
}

std::string node_text(const toml::node& n) {
  std::ostringstream s;
  n.visit([&](auto&& v) { s << v; });
  return s.str();
}

// Sets *ptr from the node; returns "" or what is wrong.
std::string assign(const Ptr& ptr, const toml::node& n) {
  return std::visit(
      [&](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!n.is_string()) return "";  // reported by the caller
          *v = *n.value<std::string>();
          return "ok";
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!n.is_boolean()) return "";
          *v = *n.value<bool>();
          return "ok";
        } else if constexpr (std::is_same_v<T, double>) {
          if (!n.is_number()) return "";
          *v = *n.value<double>();
          return "ok";
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          const toml::array* a = n.as_array();
          if (!a) {
            if (!n.is_string()) return "";
            *v = {*n.value<std::string>()};  // one string for a list of one
            return "ok";
          }
          std::vector<std::string> out;
          for (const toml::node& e : *a) {
            if (!e.is_string()) return "";
            out.push_back(*e.value<std::string>());
          }
          *v = std::move(out);
          return "ok";
        } else {
          if (!n.is_integer()) return "";
          const std::int64_t i = *n.value<std::int64_t>();
          if constexpr (std::is_same_v<T, std::uint64_t>) {
            if (i < 0) return "must not be negative";
          }
          if constexpr (std::is_same_v<T, int>) {
            if (i < std::numeric_limits<int>::min() || i > std::numeric_limits<int>::max())
              return "is out of range";
          }
          *v = static_cast<T>(i);
          return "ok";
        }
      },
      ptr);
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> d(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j)
    d[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t prev = d[0];
    d[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cur = d[j];
      d[j] = std::min({d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
      prev = cur;
    }
  }
  return d[b.size()];
}

std::string nearest(const std::string& key, const std::vector<Field>& fs) {
  std::string best;
  std::size_t best_d = 4;  // suggest only close ones
  const std::string leaf = key.substr(key.rfind('.') + 1);
  for (const Field& f : fs) {
    std::size_t d = edit_distance(key, f.key);
    // The right name in the wrong section ("model.seq_len" for data.seq_len).
    if (f.key.substr(f.key.rfind('.') + 1) == leaf) d = std::min<std::size_t>(d, 1);
    if (d < best_d) {
      best_d = d;
      best = f.key;
    }
  }
  return best.empty() ? "" : " (did you mean " + best + "?)";
}

std::string quote(const std::string& s) {
  std::string o = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        o += "\\\"";
        break;
      case '\\':
        o += "\\\\";
        break;
      case '\n':
        o += "\\n";
        break;
      case '\t':
        o += "\\t";
        break;
      case '\r':
        o += "\\r";
        break;
      default:
        if (ch < 0x20 || ch == 0x7f)
          o += fmt::format("\\u{:04x}", ch);
        else
          o += static_cast<char>(ch);
    }
  }
  return o + "\"";
}

std::string value_toml(const Ptr& ptr) {
  return std::visit(
      [](auto* v) -> std::string {
        using T = std::remove_pointer_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return quote(*v);
        } else if constexpr (std::is_same_v<T, bool>) {
          return *v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          std::string s = fmt::format("{}", *v);
          if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stays a float
          return s;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          std::string s = "[";
          for (std::size_t i = 0; i < v->size(); ++i)
            s += (i ? ", " : "") + quote((*v)[i]);
          return s + "]";
        } else {
          return std::to_string(*v);
        }
      },
      ptr);
}

}  // namespace

std::vector<std::string> ConfigFile::locate(const std::vector<std::string>& problems) const {
  std::vector<std::string> out;
  for (const std::string& p : problems) {
    const std::string field = p.substr(0, p.find(':'));
    auto it = where.find(field);
    out.push_back(it == where.end() ? p : it->second + ": " + p);
  }
  return out;
}

ConfigFile read_config_text(const std::string& text, const std::string& source,
                            const std::vector<std::string>& overrides) {
  ConfigFile out;
  std::vector<Field> fs = fields(out.config);
  std::vector<std::string> problems;
  auto find = [&](const std::string& key) -> const Field* {
    for (const Field& f : fs)
      if (f.key == key) return &f;
    return nullptr;
  };
  auto set = [&](const std::string& key, const toml::node& n, const std::string& where) {
    const Field* f = find(key);
    if (!f) {
      problems.push_back(where + ": unknown key " + key + nearest(key, fs));
      return;
    }
    const std::string r = assign(f->ptr, n);
    if (r == "ok") {
      out.where[key] = where;
    } else if (r.empty()) {
      problems.push_back(
          fmt::format("{}: {}: expected {}, got {}", where, key, type_name(f->ptr), node_text(n)));
    } else {
      problems.push_back(fmt::format("{}: {}: {} (got {})", where, key, r, node_text(n)));
    }
  };
  if (!text.empty()) {
    // TOML is UTF-8 throughout; toml++ checks strings and keys, not comments.
    if (const std::size_t bad = models::unicode::find_invalid(text); bad != std::string::npos) {
      const std::size_t line_start = text.rfind('\n', bad == 0 ? 0 : bad - 1);
      const std::size_t column =
          line_start == std::string::npos || bad == 0 ? bad + 1 : bad - line_start;
      throw Error(fmt::format(
          "{}:{}:{}: not UTF-8 (byte 0x{:02x}): a TOML file is UTF-8 text, comments included; "
          "save it as UTF-8",
          source,
          std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(bad), '\n') + 1,
          column, static_cast<unsigned char>(text[bad])));
    }
    toml::table root;
    try {
      root = toml::parse(text, source);
    } catch (const toml::parse_error& e) {
      throw Error(fmt::format("{}:{}:{}: {}", source, e.source().begin.line,
                              e.source().begin.column, e.description()));
    }
    for (auto&& [section, node] : root) {
      const std::string s(section.str());
      const int line = static_cast<int>(node.source().begin.line);
      const toml::table* t = node.as_table();
      if (!t) {
        problems.push_back(fmt::format(
            "{}:{}: {} is not a section; keys go under [model], [data], [lora], [training], "
            "[checkpoint], [eval], [hardware] or [output]{}",
            source, line, s, nearest("x." + s, fs)));
        continue;
      }
      for (auto&& [key, value] : *t) {
        const int vl = static_cast<int>(value.source().begin.line);
        set(s + "." + std::string(key.str()), value, fmt::format("{}:{}", source, vl));
      }
    }
  }
  for (const std::string& o : overrides) {
    const std::size_t eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      problems.push_back("--set " + o + ": expected section.key=value");
      continue;
    }
    const std::string key = o.substr(0, eq), value = o.substr(eq + 1);
    toml::table parsed;
    bool as_toml = true;
    try {
      parsed = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      as_toml = false;
    }
    const Field* f = find(key);
    // A bare word for a string field (a path, "bf16") is the string itself.
    if (!as_toml || (f && std::holds_alternative<std::string*>(f->ptr) && !parsed["v"].is_string()))
      parsed = toml::table{{"v", value}};
    set(key, *parsed.get("v"), "--set " + o);
  }
  // What a run exports follows its method unless set: a full run has no adapter to export, and
  // is merged into a checkpoint of its base's format (a Hugging Face folder, or a Q8_0 GGUF).
  if (!out.where.count("output.exports") && out.config.training.method == "full") {
    const bool gguf = out.config.model.path.ends_with(".gguf");
    out.config.output.exports = {gguf ? "gguf" : "merged"};
  }
  out.problems = std::move(problems);
  return out;
}

void ConfigFile::check(bool planning) const {
  std::vector<std::string> all = problems;
  for (std::string& p : locate(config.validate(planning)))
    all.push_back(std::move(p));
  if (!all.empty())
    throw Error(join_problems(
        fmt::format("The config has {} problem{}:", all.size(), all.size() == 1 ? "" : "s"), all));
}

ConfigFile read_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  if (!path.empty()) {
    // Bounded, and a folder or a device is said to be one (/dev/zero never ends).
    text = models::read_text_file(path, "the config file");
    if (text.empty()) text = "\n";
  }
  return read_config_text(text, path, overrides);
}

std::string to_toml(const engine::TrainConfig& config) {
  engine::TrainConfig c = config;
  std::string out = "# Resolved by rondo: every setting of this run.\n";
  std::string section;
  for (const Field& f : fields(c)) {
    const std::string s = f.key.substr(0, f.key.find('.'));
    if (s != section) {
      out += "\n[" + s + "]\n";
      section = s;
    }
    out += f.key.substr(s.size() + 1) + " = " + value_toml(f.ptr) + "\n";
  }
  return out;
}

std::string config_reference() {
  engine::TrainConfig c;
  std::string out;
  for (const Field& f : fields(c))
    out += fmt::format("  {:<28} {:<18} default {:<14} {}\n", f.key, type_name(f.ptr),
                       value_toml(f.ptr), f.help);
  return out;
}

std::string config_reference_json() {
  engine::TrainConfig c;
  nlohmann::json keys = nlohmann::json::array();
  for (const Field& f : fields(c)) {
    nlohmann::json key = {{"key", f.key}, {"help", f.help}};
    std::visit(
        [&](auto* v) {
          using T = std::remove_pointer_t<decltype(v)>;
          key["type"] = std::is_same_v<T, std::string>                ? "string"
                        : std::is_same_v<T, bool>                     ? "bool"
                        : std::is_same_v<T, double>                   ? "number"
                        : std::is_same_v<T, std::vector<std::string>> ? "list"
                                                                      : "integer";
          key["default"] = *v;
        },
        f.ptr);
    keys.push_back(std::move(key));
  }
  return nlohmann::json{{"keys", keys}}.dump(2) + "\n";
}

}  // namespace rondo::cli
