#include "cli/generate_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/config_file.h"
#include "cli/train_command.h"
#include "engine/checkpoint.h"
#include "engine/devices.h"
#include "engine/inference.h"
#include "engine/run_lock.h"
#include "kernels/error.h"
#include "models/generate.h"
#include "models/model.h"
#include "models/model_files.h"
#include "models/peft_adapter.h"

namespace rondo::cli {

namespace fs = std::filesystem;

namespace {

// The options of sampling and of the weights' dtype, as generate and chat take them.
void add_sampling_options(CLI::App& command, long long& max_new_tokens, const char* max_help,
                          double& temperature, double& top_p, unsigned long long& seed,
                          std::string& dtype) {
  command.add_option("--max-new-tokens,-n", max_new_tokens, max_help)
      ->capture_default_str()
      ->check(CLI::Range(1LL, 1LL << 20));
  command.add_option("--temperature,-t", temperature, "Sampling temperature; 0 = greedy")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  command.add_option("--top-p", top_p, "Sample among the most likely tokens holding this mass")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  command.add_option("--seed", seed, "Seed for sampling")->capture_default_str();
  command.add_option("--dtype", dtype, "Weights in memory: f32 or bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
}

void add_device_options(CLI::App& command, GenerationDevices& d) {
  command.add_option("--sim", d.sim,
                     "Generate on N simulated GPUs (CPU-backed, behind an emulated PCIe link)");
  command.add_option("--sim-memory", d.sim_memory, "Memory of each simulated GPU")
      ->capture_default_str();
  command.add_option("--memory-cap", d.memory_cap,
                     "Use at most this much of each GPU's memory, e.g. 24GB (the weights stream "
                     "stage by stage when they do not fit)");
  command.add_flag("--cpu", d.cpu, "Generate on the CPU even when the machine has GPUs");
}

// The model a generate or chat command talks to: on the devices (engine::DeviceGenerator, the
// adapters unmerged) when the machine has GPUs or simulated ones are asked for, else a
// models::Model in host memory (the adapters merged), as before there were devices.
class Generator {
 public:
  // `trained`: a full run's weights, or with `lora` the adapters; they may view a file the caller
  // keeps mapped until this returns (both paths copy them).
  // `gpus_busy`: why the GPUs are better left alone (a run training on them): the CPU then.
  Generator(const std::string& model_path, const models::LoraConfig* lora,
            std::map<std::string, at::Tensor> trained, const std::string& source,
            const std::string& dtype, const GenerationDevices& d,
            const std::string& gpus_busy = "") {
    if (d.cpu && d.sim > 0) throw Error("--cpu and --sim exclude each other");
    std::optional<engine::DevicePlan> plan;
    if (!d.cpu) {
      engine::DeviceSelection s;
      s.sim_devices = d.sim;
      s.sim_bytes = parse_bytes(d.sim_memory, "--sim-memory");
      if (!d.memory_cap.empty()) s.memory_cap = parse_bytes(d.memory_cap, "--memory-cap");
      plan = engine::plan_devices(s);
    }
    const bool busy = plan && plan->mode == engine::DeviceMode::kCuda && !gpus_busy.empty();
    if (plan && !busy &&
        (plan->mode == engine::DeviceMode::kCuda || plan->mode == engine::DeviceMode::kSim)) {
      engine::GeneratorOptions g;
      g.model = model_path;
      if (lora) g.lora = *lora;
      g.trained = std::move(trained);
      g.source = source;
      g.devices = std::move(*plan);
      g.dtype = dtype == "bf16" ? kernels::FloatDType::kBF16 : kernels::FloatDType::kF32;
      device_ = std::make_unique<engine::DeviceGenerator>(std::move(g));
      where_ = device_->where();
      return;
    }
    const models::LoadOptions load{.dtype = dtype == "bf16" ? models::DType::kBF16
                                                            : models::DType::kF32};
    cpu_.emplace(trained.empty() && !lora
                     ? models::Model::load(model_path, load)
                     : models::load_with_trained(model_path, lora, trained, source, load));
    where_ = busy ? "the CPU (" + gpus_busy + ")" : "the CPU";
  }

  const models::ModelConfig& config() const { return device_ ? device_->config() : cpu_->config(); }
  // Where it ran, and on the devices how the weights were held: "2 simulated GPUs (weights
  // streamed stage by stage)".
  std::string where() const {
    if (!device_ || !last_) return where_;
    return where_ + (last_->resident ? " (weights resident)"
                     : last_->spread ? " (weights resident, spread over the devices)"
                     : last_->kv_host
                         ? " (weights streamed stage by stage, KV caches in host memory)"
                         : " (weights streamed stage by stage)");
  }

  // Every prompt's new tokens: one batch on the devices, one prompt after another on the CPU.
  std::vector<std::vector<std::int64_t>> generate_all(
      const std::vector<std::vector<std::int64_t>>& prompts,
      const models::SamplingOptions& sampling) {
    if (device_) {
      last_ = device_->generate(prompts, sampling);
      return last_->tokens;
    }
    std::vector<std::vector<std::int64_t>> out;
    for (const auto& p : prompts)
      out.push_back(models::generate(*cpu_, p, sampling));
    return out;
  }

  void generate(const std::vector<std::int64_t>& prompt, const models::SamplingOptions& sampling,
                const std::function<void(std::int64_t)>& on_token) {
    if (device_) {
      last_ =
          device_->generate({prompt}, sampling, [&](std::size_t, std::int64_t t) { on_token(t); });
    } else {
      models::generate(*cpu_, prompt, sampling, [&](std::int64_t t) {
        on_token(t);
        return true;
      });
    }
  }

 private:
  std::unique_ptr<engine::DeviceGenerator> device_;
  std::optional<models::Model> cpu_;
  std::string where_;
  std::optional<engine::Generation> last_;  // on the devices: how the last generation ran
};

}  // namespace

void add_generate_options(CLI::App& command, GenerateOptions& o) {
  command.add_option("model", o.model, "A Hugging Face model folder or a .gguf file")->required();
  command.add_option("--prompt,-p", o.prompt,
                     "The text to continue, or the user message with --chat");
  command.add_option("--prompts", o.prompts_file,
                     "A file of prompts, one per line (blank lines skipped), generated together "
                     "(batched on the GPUs); prints one JSON object per prompt: prompt, text, "
                     "tokens");
  command.add_flag("--chat", o.chat,
                   "Render the prompt as a user turn with the model's chat template");
  command.add_option(
      "--chat-format", o.chat_format,
      "Chat format instead of the model's own template: chatml, qwen3, llama3, llama3.1, "
      "mistral, mistral-v1");
  command.add_option("--system", o.system, "A system message (with --chat)");
  add_sampling_options(command, o.max_new_tokens, "Most tokens to generate", o.temperature, o.top_p,
                       o.seed, o.dtype);
  command.add_option("--adapter", o.adapter,
                     "A LoRA adapter to use: a PEFT folder (rondo export) or a LoRA run's folder");
  add_device_options(command, o.devices);
}

namespace {

// Sampling as the options say, stopping at the model's and the tokenizer's end tokens (and, for a
// chat, the formats' end-of-turn tokens).
models::SamplingOptions sampling_for(const models::ModelConfig& config,
                                     const models::Tokenizer& tok, bool chat,
                                     long long max_new_tokens, double temperature, double top_p,
                                     unsigned long long seed) {
  models::SamplingOptions sampling;
  sampling.max_new_tokens = max_new_tokens;
  sampling.temperature = temperature;
  sampling.top_p = top_p;
  sampling.seed = seed;
  if (chat)
    for (const char* end : {"<|im_end|>", "<|eot_id|>", "</s>"})
      if (auto id = tok.token_to_id(end)) sampling.stop_tokens.push_back(*id);
  for (std::int64_t e : config.eos_token_ids)
    sampling.stop_tokens.push_back(e);
  if (auto e = tok.eos_id()) sampling.stop_tokens.push_back(*e);
  return sampling;
}

struct Reply {
  std::string text;
  std::size_t tokens = 0;
  double seconds = 0;
};

// Generates from `ids`, printing the text on stdout as it comes; returns it.
// `out` takes each piece of text as it is decoded (default: written to stdout at once).
Reply stream_reply(Generator& model, const models::Tokenizer& tok,
                   const std::vector<std::int32_t>& ids, const models::SamplingOptions& sampling,
                   const std::function<void(const std::string&)>& out = {}) {
  models::TextStreamer streamer(tok);
  Reply r;
  auto print = [&](const std::string& text) {
    r.text += text;
    if (out) {
      if (!text.empty()) out(text);
      return;
    }
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::int64_t> prompt(ids.begin(), ids.end());
  model.generate(prompt, sampling, [&](std::int64_t token) {
    print(streamer.push(static_cast<std::int32_t>(token)));
  });
  print(streamer.finish());
  r.tokens = streamer.ids().size();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

// Appends the conversation to `path` as one line of chat-format JSONL (training data), so that
// saving again adds to the file instead of replacing what it held.
void save_conversation(const std::string& path, const std::vector<models::ChatMessage>& messages) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const models::ChatMessage& m : messages)
    list.push_back({{"role", m.role}, {"content", m.content}});
  const std::string text = nlohmann::ordered_json{{"messages", list}}.dump() + "\n";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("cannot save to " + path + ": " + std::strerror(errno));
  const ssize_t n = ::write(fd, text.data(), text.size());  // one write: a whole line or none
  const int err = errno;
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size()))
    throw Error("cannot save to " + path + ": " +
                (n < 0 ? std::strerror(err) : "the file took part of the line"));
}

}  // namespace

int run_generate(const GenerateOptions& o) {
  if (!o.chat && (!o.chat_format.empty() || !o.system.empty()))
    throw Error("--chat-format and --system only apply with --chat");
  if (o.prompt.empty() == o.prompts_file.empty())
    throw Error("give one of --prompt TEXT or --prompts FILE");
  std::vector<std::string> texts;
  std::vector<std::size_t> line_of;  // each prompt's line in the file, for errors
  if (!o.prompts_file.empty()) {
    std::ifstream in(o.prompts_file);
    if (!in) throw Error("cannot read " + o.prompts_file + ": " + std::strerror(errno));
    std::size_t n = 0;
    for (std::string line; std::getline(in, line);) {
      ++n;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      texts.push_back(line);
      line_of.push_back(n);
    }
    if (texts.empty()) throw Error(o.prompts_file + " holds no prompt (one per line)");
  } else {
    texts.push_back(o.prompt);
  }
  models::Tokenizer tok = models::load_tokenizer(o.model);
  std::optional<models::ChatTemplate> tmpl;
  if (o.chat) tmpl = models::load_model_chat_template(o.model, o.chat_format);
  std::vector<std::vector<std::int64_t>> prompts;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    std::vector<std::int32_t> ids;
    if (o.chat) {
      std::vector<models::ChatMessage> messages;
      if (!o.system.empty()) messages.push_back({"system", o.system});
      messages.push_back({"user", texts[i]});
      ids = models::render_chat(tok, *tmpl, messages, /*add_generation_prompt=*/true).ids;
    } else {
      ids = tok.encode(texts[i], /*add_special_tokens=*/true);
    }
    if (ids.empty())
      throw Error(o.prompts_file.empty() ? std::string("the prompt is empty after tokenization")
                                         : fmt::format("{}:{}: the prompt is empty after "
                                                       "tokenization",
                                                       o.prompts_file, line_of[i]));
    prompts.emplace_back(ids.begin(), ids.end());
  }
  const std::vector<std::int32_t> ids(prompts[0].begin(), prompts[0].end());

  std::optional<models::PeftAdapter> adapter;
  if (!o.adapter.empty()) adapter = models::read_peft_adapter(o.adapter);
  Generator model(o.model, adapter ? &adapter->lora : nullptr,
                  adapter ? adapter->tensors : std::map<std::string, at::Tensor>{},
                  adapter ? adapter->source : std::string(), o.dtype, o.devices);
  if (!o.prompts_file.empty()) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<std::vector<std::int64_t>> outs =
        model.generate_all(prompts, sampling_for(model.config(), tok, o.chat, o.max_new_tokens,
                                                 o.temperature, o.top_p, o.seed));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::size_t in_tokens = 0, out_tokens = 0;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      models::TextStreamer streamer(tok);
      std::string text;
      for (std::int64_t t : outs[i])
        text += streamer.push(static_cast<std::int32_t>(t));
      text += streamer.finish();
      in_tokens += prompts[i].size();
      out_tokens += outs[i].size();
      const std::string line =
          nlohmann::ordered_json{{"prompt", texts[i]}, {"text", text}, {"tokens", outs[i].size()}}
              .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
          "\n";
      std::fwrite(line.data(), 1, line.size(), stdout);
    }
    std::fflush(stdout);
    std::fprintf(stderr,
                 "rondo: %zu prompts, %zu prompt tokens, %zu generated in %.2f s (%.1f tokens/s) "
                 "on %s\n",
                 texts.size(), in_tokens, out_tokens, seconds, out_tokens / std::max(seconds, 1e-9),
                 model.where().c_str());
    return 0;
  }
  const Reply r = stream_reply(
      model, tok, ids,
      sampling_for(model.config(), tok, o.chat, o.max_new_tokens, o.temperature, o.top_p, o.seed));
  std::fputc('\n', stdout);
  std::fflush(stdout);
  std::fprintf(stderr, "rondo: %zu prompt tokens, %zu generated in %.2f s (%.1f tokens/s) on %s\n",
               ids.size(), r.tokens, r.seconds, r.tokens / std::max(r.seconds, 1e-9),
               model.where().c_str());
  return 0;
}

void add_chat_options(CLI::App& command, ChatOptions& o) {
  command
      .add_option("target", o.target, "A run folder, a Hugging Face model folder or a .gguf file")
      ->required();
  command.add_option("--adapter", o.adapter, "With a model: a LoRA adapter (PEFT folder) to use");
  command.add_option("--checkpoint", o.checkpoint,
                     "With a run folder: this checkpoint (step-N) instead of the newest");
  command.add_option("--system", o.system, "A system message to start with");
  command.add_option(
      "--chat-format", o.chat_format,
      "Chat format instead of the model's own template: chatml, qwen3, llama3, llama3.1, "
      "mistral, mistral-v1");
  add_sampling_options(command, o.max_new_tokens, "Most tokens of a reply", o.temperature, o.top_p,
                       o.seed, o.dtype);
  command.add_flag("--jsonl", o.jsonl,
                   "For programs: stdin lines are JSON strings, stdout is one JSON object per line "
                   "(ready, token, reply, info, error)");
  add_device_options(command, o.devices);
}

int run_chat(const ChatOptions& o) {
  std::error_code ec;
  const bool run = fs::exists(fs::path(o.target) / "config.toml", ec);
  std::string model_path = o.target, chat_format = o.chat_format, what = o.target;
  std::optional<Generator> model;
  if (run) {
    if (!o.adapter.empty())
      throw Error("--adapter goes with a model; " + o.target +
                  " is a run folder, whose own weights are used");
    const ConfigFile f = read_config((fs::path(o.target) / "config.toml").string(), {});
    f.check();
    const engine::TrainConfig& c = f.config;
    model_path = c.model.path;
    if (chat_format.empty()) chat_format = c.data.chat_format;
    const ChosenCheckpoint chosen =
        checkpoint_for(o.target, o.checkpoint, "to chat with", /*fall_back=*/true);
    const models::SafetensorsFile state((fs::path(chosen.path) / "state.safetensors").string());
    const models::LoraConfig lora = c.lora_config();
    // A run still training holds the GPUs' memory under its own plan: chat beside it on the CPU.
    // (An export holds the lock too, on the CPU.)
    const std::string holder = engine::RunLock::holder(o.target);
    const bool training = holder.find("(rondo train") != std::string::npos;
    model.emplace(model_path, c.training.method == "lora" ? &lora : nullptr,
                  engine::checkpoint_weights(state), chosen.path, o.dtype, o.devices,
                  training ? "the run is training in " + holder +
                                 " on the GPUs; chat after it ends to use them"
                           : "");
    what = chosen.path;
  } else {
    if (!o.checkpoint.empty())
      throw Error("--checkpoint goes with a run folder; " + o.target + " has no config.toml");
    std::optional<models::PeftAdapter> adapter;
    if (!o.adapter.empty()) adapter = models::read_peft_adapter(o.adapter);
    model.emplace(o.target, adapter ? &adapter->lora : nullptr,
                  adapter ? adapter->tensors : std::map<std::string, at::Tensor>{},
                  adapter ? adapter->source : std::string(), o.dtype, o.devices);
    if (!o.adapter.empty()) what = o.target + " with " + o.adapter;
  }
  const models::Tokenizer tok = models::load_tokenizer(model_path);
  const models::ChatTemplate tmpl = models::load_model_chat_template(model_path, chat_format);

  std::string system = o.system;
  std::vector<models::ChatMessage> conversation;
  auto reset = [&] {
    conversation.clear();
    if (!system.empty()) conversation.push_back({"system", system});
  };
  reset();
  const bool tty = !o.jsonl && ::isatty(STDIN_FILENO) == 1 && ::isatty(STDOUT_FILENO) == 1;
  auto emit = [](const nlohmann::ordered_json& j) {
    const std::string line =
        j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    std::fwrite(line.data(), 1, line.size(), stdout);
    std::fflush(stdout);
  };
  // What the chat says besides replies: on stderr for people, as a JSON line for programs.
  auto say = [&](const char* type, const std::string& text) {
    if (o.jsonl)
      emit({{"type", type}, {"text", text}});
    else
      std::fprintf(stderr, "rondo: %s%s\n", std::string(type) == "error" ? "error: " : "",
                   text.c_str());
  };
  if (o.jsonl)
    emit({{"type", "ready"}, {"text", what}});
  else
    std::fprintf(stderr,
                 "rondo: chatting with %s on %s. Commands: /reset, /system TEXT, /save FILE, "
                 "/quit (or Ctrl-D).\n",
                 what.c_str(), model->where().c_str());
  std::string line;
  for (;;) {
    if (tty) {
      std::fputs("> ", stdout);
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (o.jsonl && line.find_first_not_of(" \t") != std::string::npos) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_string()) {
        say("error", "each input line must be one JSON string (--jsonl)");
        continue;
      }
      line = j.get<std::string>();
    }
    if (line.find_first_not_of(" \t\n") == std::string::npos) continue;
    // A command or a turn that fails says why and leaves the conversation as it was.
    try {
      if (line[0] == '/') {
        const std::size_t space = line.find(' ');
        const std::string command = line.substr(0, space);
        const std::string rest = space == std::string::npos ? "" : line.substr(space + 1);
        if (command == "/quit" || command == "/exit") break;
        if (command == "/reset") {
          reset();
          say("info", "conversation cleared");
        } else if (command == "/system") {
          system = rest;
          reset();
          say("info", std::string(system.empty() ? "no system message" : "new system message") +
                          "; conversation cleared");
        } else if (command == "/save" && !rest.empty()) {
          save_conversation(rest, conversation);
          say("info", std::to_string(conversation.size()) + " messages appended to " + rest +
                          " (one chat-format JSONL line)");
        } else {
          say("info", "the commands are /reset, /system TEXT, /save FILE and /quit");
        }
        continue;
      }
      std::vector<models::ChatMessage> next = conversation;
      next.push_back({"user", line});
      const std::vector<std::int32_t> ids =
          models::render_chat(tok, tmpl, next, /*add_generation_prompt=*/true).ids;
      const models::SamplingOptions sampling = sampling_for(
          model->config(), tok, true, o.max_new_tokens, o.temperature, o.top_p, o.seed);
      std::function<void(const std::string&)> out;
      if (o.jsonl) out = [&](const std::string& t) { emit({{"type", "token"}, {"text", t}}); };
      const Reply r = stream_reply(*model, tok, ids, sampling, out);
      if (o.jsonl) {
        emit({{"type", "reply"}, {"text", r.text}, {"tokens", r.tokens}, {"seconds", r.seconds}});
      } else {
        std::fputc('\n', stdout);
        std::fflush(stdout);
      }
      next.push_back({"assistant", r.text});
      conversation = std::move(next);
    } catch (const Error& e) {
      say("error", e.what());
    }
  }
  return 0;
}

}  // namespace rondo::cli
