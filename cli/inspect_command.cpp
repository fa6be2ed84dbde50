#include "cli/inspect_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "models/inspect.h"

namespace rondo::cli {

void add_inspect_options(CLI::App& command, InspectOptions& options) {
  command.add_option("model", options.model, "A Hugging Face model folder or a .gguf file")
      ->required();
  command.add_flag("--json", options.json, "Print JSON instead of text");
  command.add_option("--seq-len", options.seq_len, "Sequence length the FLOP figures assume")
      ->capture_default_str()
      ->check(CLI::Range(1LL, 1LL << 24));
}

namespace {

std::string millions(std::int64_t n) {
  if (n >= 1000000000) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1000000) return fmt::format("{:.1f} M", n / 1e6);
  return fmt::format("{}", n);
}

std::string layer_name(const models::LayerSummary& l) {
  return l.kind == models::LayerKind::kBlock ? fmt::format("block {}", l.block)
                                             : models::to_string(l.kind);
}

nlohmann::json to_json(const models::ModelSummary& s) {
  const models::ModelConfig& c = s.config;
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : s.layers)
    layers.push_back({{"kind", models::to_string(l.kind)},
                      {"block", l.block},
                      {"params", l.params},
                      {"bytes_stored", l.bytes_stored},
                      {"flops_forward_per_token", l.flops_forward_per_token},
                      {"activation_bytes_per_token_bf16", l.activation_bytes_per_token}});
  return {{"path", s.path},
          {"format", s.format},
          {"architecture", c.architecture},
          {"family", models::to_string(c.family)},
          {"params", s.params},
          {"active_params", s.active_params},
          {"num_experts", c.num_experts},
          {"experts_per_token", c.experts_per_token},
          {"bytes_stored", s.bytes_stored},
          {"dtypes", s.dtypes},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_layers", c.num_layers},
          {"num_heads", c.num_heads},
          {"num_kv_heads", c.num_kv_heads},
          {"head_dim", c.head_dim},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rope", {{"type", c.rope.type}, {"theta", c.rope.theta}, {"factor", c.rope.factor}}},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"attention_bias", c.attention_bias},
          {"qk_norm", c.qk_norm},
          {"sliding_window", c.sliding_window},
          {"seq_len", s.seq_len},
          {"layers", layers}};
}

void print_text(const models::ModelSummary& s) {
  const models::ModelConfig& c = s.config;
  fmt::print("{} ({}) from {}\n", c.architecture, models::to_string(c.family), s.path);
  fmt::print("  parameters    {} ({} stored as {}, {})\n", millions(s.params),
             format_bytes(s.bytes_stored), s.format, s.dtypes);
  if (c.num_experts > 0)
    fmt::print(
        "  experts       {} per sparse block ({} of {} blocks), {} per token, width {}: {} "
        "parameters active per token of {} (every expert still streams)\n",
        c.num_experts, c.sparse_layer_count(), c.num_layers, c.experts_per_token,
        c.moe_intermediate_size, millions(static_cast<std::int64_t>(s.active_params)),
        millions(s.params));
  fmt::print("  layers        embedding + {} blocks + head\n", c.num_layers);
  fmt::print("  dimensions    hidden {}, MLP {}, heads {} (kv {}, head dim {}), vocab {}\n",
             c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
             c.vocab_size);
  fmt::print(
      "  positions     {} max, rope theta {:g}{}\n",
      c.positions() == c.max_position_embeddings
          ? std::to_string(c.max_position_embeddings)
          : fmt::format("{} ({} with its YaRN factor)", c.max_position_embeddings, c.positions()),
      c.rope.theta,
      c.rope.type != "default" ? fmt::format(", {} scaling x{:g}", c.rope.type, c.rope.factor)
                               : "");
  std::string features;
  auto add = [&](bool on, const char* what) {
    if (on) features += (features.empty() ? "" : ", ") + std::string(what);
  };
  add(c.num_kv_heads < c.num_heads, "grouped-query attention");
  add(c.attention_bias, "QKV bias");
  add(c.qk_norm, "q/k norm");
  add(c.tie_word_embeddings, "tied embeddings");
  add(c.sliding_window > 0,
      c.sliding_layers.empty() ? "sliding window" : "sliding window on some layers");
  add(c.attention_sinks, "attention sinks");
  if (!features.empty()) fmt::print("  features      {}\n", features);
  fmt::print(
      "  per layer     (stored bytes, parameters, forward GFLOP per token at {} tokens, "
      "bf16 activations per token)\n",
      s.seq_len);
  auto row = [&](const std::string& name, const models::LayerSummary& l) {
    fmt::print("    {:<14} {:>12}  {:>10}  {:>8.3f}  {:>10}\n", name, format_bytes(l.bytes_stored),
               millions(l.params), l.flops_forward_per_token / 1e9,
               format_bytes(l.activation_bytes_per_token));
  };
  // Blocks of one model are alike: one line for them unless their sizes differ.
  const auto& L = s.layers;
  row(layer_name(L.front()), L.front());
  bool alike = true;
  for (std::size_t i = 2; i + 1 < L.size(); ++i)
    alike = alike && L[i].bytes_stored == L[1].bytes_stored && L[i].params == L[1].params;
  if (L.size() > 2) {
    if (alike)
      row(fmt::format("blocks 0-{}", c.num_layers - 1) + (c.num_layers > 1 ? " each" : ""), L[1]);
    else
      for (std::size_t i = 1; i + 1 < L.size(); ++i)
        row(layer_name(L[i]), L[i]);
  }
  row(layer_name(L.back()), L.back());
}

}  // namespace

int run_inspect(const InspectOptions& options) {
  models::ModelSummary s = models::inspect_model(options.model, options.seq_len);
  if (options.json)
    fmt::print("{}\n", to_json(s).dump(2));
  else
    print_text(s);
  return 0;
}

}  // namespace rondo::cli
