#include "cli/generate_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>

#include "kernels/error.h"
#include "models/generate.h"
#include "models/model.h"
#include "models/model_files.h"
#include "models/peft_adapter.h"

namespace rondo::cli {

void add_generate_options(CLI::App& command, GenerateOptions& o) {
  command.add_option("model", o.model, "A Hugging Face model folder or a .gguf file")->required();
  command
      .add_option("--prompt,-p", o.prompt, "The text to continue, or the user message with --chat")
      ->required();
  command.add_flag("--chat", o.chat,
                   "Render the prompt as a user turn with the model's chat template");
  command.add_option("--chat-format", o.chat_format,
                     "Chat format instead of the model's own template: chatml, qwen3, llama3, "
                     "mistral, mistral-v1");
  command.add_option("--system", o.system, "A system message (with --chat)");
  command.add_option("--max-new-tokens,-n", o.max_new_tokens, "Most tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(1LL, 1LL << 20));
  command.add_option("--temperature,-t", o.temperature, "Sampling temperature; 0 = greedy")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  command.add_option("--top-p", o.top_p, "Sample among the most likely tokens holding this mass")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  command.add_option("--seed", o.seed, "Seed for sampling")->capture_default_str();
  command.add_option("--adapter", o.adapter,
                     "A LoRA adapter to use: a PEFT folder (rondo export) or a LoRA run's folder");
  command.add_option("--dtype", o.dtype, "Weights in memory: f32 or bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
}

int run_generate(const GenerateOptions& o) {
  if (!o.chat && (!o.chat_format.empty() || !o.system.empty()))
    throw Error("--chat-format and --system only apply with --chat");
  models::Tokenizer tok = models::load_tokenizer(o.model);
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> stops;
  if (o.chat) {
    models::ChatTemplate tmpl = models::load_model_chat_template(o.model, o.chat_format);
    std::vector<models::ChatMessage> messages;
    if (!o.system.empty()) messages.push_back({"system", o.system});
    messages.push_back({"user", o.prompt});
    ids = models::render_chat(tok, tmpl, messages, /*add_generation_prompt=*/true).ids;
    // A reply ends with the format's end-of-turn token.
    for (const char* end : {"<|im_end|>", "<|eot_id|>", "</s>"})
      if (auto id = tok.token_to_id(end)) stops.push_back(*id);
  } else {
    ids = tok.encode(o.prompt, /*add_special_tokens=*/true);
  }
  if (ids.empty()) throw Error("the prompt is empty after tokenization");

  const models::LoadOptions load{.dtype = o.dtype == "bf16" ? models::DType::kBF16
                                                            : models::DType::kF32};
  models::Model model = o.adapter.empty() ? models::Model::load(o.model, load)
                                          : models::load_with_adapter(o.model, o.adapter, load);
  for (std::int64_t e : model.config().eos_token_ids)
    stops.push_back(e);
  if (auto e = tok.eos_id()) stops.push_back(*e);

  models::SamplingOptions sampling;
  sampling.max_new_tokens = o.max_new_tokens;
  sampling.temperature = o.temperature;
  sampling.top_p = o.top_p;
  sampling.seed = o.seed;
  sampling.stop_tokens = stops;

  models::TextStreamer streamer(tok);
  auto print = [](const std::string& text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  auto start = std::chrono::steady_clock::now();
  std::vector<std::int64_t> prompt(ids.begin(), ids.end());
  models::generate(model, prompt, sampling, [&](std::int64_t token) {
    print(streamer.push(static_cast<std::int32_t>(token)));
    return true;
  });
  print(streamer.finish());
  std::fputc('\n', stdout);
  std::fflush(stdout);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "rondo: %zu prompt tokens, %zu generated in %.2f s (%.1f tokens/s)\n",
               ids.size(), streamer.ids().size(), seconds,
               streamer.ids().size() / std::max(seconds, 1e-9));
  return 0;
}

}  // namespace rondo::cli
