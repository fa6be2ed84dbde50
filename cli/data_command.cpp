#include "cli/data_command.h"

#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include "engine/data.h"
#include "kernels/error.h"
#include "models/model_files.h"

namespace rondo::cli {

void add_data_options(CLI::App& cmd, DataOptions& o) {
  cmd.add_option("file", o.file, "Training data: JSONL, or a JSON file holding a list")->required();
  cmd.add_option("--model", o.model, "The model whose tokenizer and chat template to use")
      ->required();
  cmd.add_option("--format", o.format, "auto, text, alpaca, chat, sharegpt or preference")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "text", "alpaca", "chat", "sharegpt", "preference"}));
  cmd.add_option("--objective", o.objective,
                 "sft, or dpo, orpo, simpo: read preference pairs as that objective tokenises them")
      ->capture_default_str()
      ->check(CLI::IsMember({"sft", "dpo", "orpo", "simpo"}));
  cmd.add_option("--max-length", o.max_length,
                 "Preference pairs: tokens per sequence (preference.max_length)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd.add_option("--chat-format", o.chat_format, "Instead of the model's own chat template");
  cmd.add_flag("--train-on-everything", o.train_on_everything, "Loss on prompts too");
  cmd.add_flag("--skip-bad-lines", o.skip_bad_lines, "Skip and count bad lines");
  cmd.add_option("--max-line", o.max_line, "The longest line read, as data.max_line")
      ->capture_default_str();
  cmd.add_option("--example", o.example, "Which example to show (from 0)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--max-lines", o.max_lines,
                 "Read only the first N lines (a quick look at a large file)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_flag("--json", o.json, "Print JSON (one object) instead of text");
}

int run_data(const DataOptions& o) {
  const engine::DataFormat format = engine::data_format_from(o.format);
  models::Tokenizer tok = models::load_tokenizer(o.model);
  models::ChatTemplate tmpl = engine::training_chat_template(o.model, o.chat_format, format);
  engine::Dataset d = engine::load_data(o.file, tok, tmpl,
                                        {.format = format,
                                         .skip_bad_lines = o.skip_bad_lines,
                                         .train_on_everything = o.train_on_everything,
                                         .max_lines = o.max_lines,
                                         .objective = engine::objective_from(o.objective),
                                         .max_length = o.max_length,
                                         .max_line_bytes = parse_bytes(o.max_line, "--max-line")});
  if (o.example >= static_cast<long long>(d.examples.size()))
    throw Error(
        fmt::format("--example {}: {} has {} examples", o.example, o.file, d.examples.size()));
  const engine::Example& e = d.examples[static_cast<std::size_t>(o.example)];
  // Runs of tokens with the same mask, as text, up to kShownBytes of it (an example of a 200 MB
  // line would flood the terminal or the wizard's preview): decoded a few tokens at a time, so a
  // long example is not decoded whole either.
  constexpr std::size_t kShownBytes = 8192;
  nlohmann::json pieces = nlohmann::json::array();
  std::size_t shown_bytes = 0, shown_tokens = 0;
  bool truncated = false;
  for (std::size_t i = 0; i < e.ids.size() && shown_bytes < kShownBytes;) {
    std::size_t j = i;
    // A pair's rejected sequence starts a run of its own.
    const std::size_t split = static_cast<std::size_t>(e.second);
    while (j < e.ids.size() && e.loss_mask[j] == e.loss_mask[i] &&
           (split == 0 || j != split || j == i))
      ++j;
    // The run's first n tokens, n doubling until they make enough text (decoded from the run's
    // start each time: a decoder treats a sequence's first token apart).
    std::string text;
    std::size_t k = i;
    for (std::size_t n = 64;; n *= 2) {
      k = std::min(j, i + n);
      text = tok.decode({e.ids.begin() + static_cast<std::ptrdiff_t>(i),
                         e.ids.begin() + static_cast<std::ptrdiff_t>(k)});
      if (k == j || shown_bytes + text.size() >= kShownBytes) break;
    }
    if (shown_bytes + text.size() > kShownBytes) {
      // Cut at a character's start.
      std::size_t at = kShownBytes - shown_bytes;
      while (at > 0 && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80)
        --at;
      text.resize(at);
      truncated = true;
    }
    shown_bytes += text.size();
    shown_tokens += k - i;
    pieces.push_back({{"text", text},
                      {"trained", (e.loss_mask[i] & 1) != 0},
                      {"tokens", k - i},
                      {"rejected", e.second != 0 && i >= split}});
    i = k;
  }
  const bool cut = truncated || shown_tokens < e.ids.size();
  if (o.json) {
    nlohmann::json j = {{"path", d.path},
                        {"format", engine::to_string(d.format)},
                        {"examples", d.examples.size()},
                        {"lines", d.lines},
                        {"skipped", d.skipped},
                        {"skipped_reasons", d.skipped_reasons},
                        {"tokens", d.tokens()},
                        {"trained_tokens", d.trained_tokens()},
                        {"stats", d.stats_text()},
                        {"partial", d.partial},
                        {"first_prompt", d.first_prompt},
                        {"example",
                         {{"index", o.example},
                          {"pieces", pieces},
                          {"tokens", e.ids.size()},
                          {"chosen_tokens", e.second != 0 ? e.second : 0},
                          {"cut", cut}}}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("{}{}\n\nExample {} (trained text {}):\n", d.stats_text(),
             d.partial ? fmt::format(" (the first {} lines only)", o.max_lines) : "", o.example,
             ::isatty(STDOUT_FILENO) ? "in green" : "between [[ and ]]");
  if (e.second != 0) fmt::print("Chosen ({} tokens):\n", e.second);
  bool rejected = false;
  for (const auto& p : pieces) {
    const std::string text = p["text"];
    if (p["rejected"].get<bool>() && !rejected) {
      rejected = true;
      fmt::print("\nRejected ({} tokens):\n", e.ids.size() - static_cast<std::size_t>(e.second));
    }
    if (!p["trained"].get<bool>())
      fmt::print("{}", text);
    else if (::isatty(STDOUT_FILENO))
      fmt::print("\x1b[32m{}\x1b[0m", text);
    else
      fmt::print("[[{}]]", text);
  }
  fmt::print("\n");
  if (cut)
    fmt::print("... (cut: the example has {} tokens; its first {} KiB of text are shown)\n",
               e.ids.size(), kShownBytes / 1024);
  return 0;
}

}  // namespace rondo::cli
