// `rondo generate <model> --prompt ... [--chat]`: text from a model, streamed as it is generated.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace rondo::cli {

struct GenerateOptions {
  std::string model;
  std::string prompt;
  bool chat = false;
  std::string chat_format;  // "" = recognise the model's template
  std::string system;       // system message for --chat
  long long max_new_tokens = 128;
  double temperature = 0;  // 0 = greedy
  double top_p = 1.0;
  unsigned long long seed = 0;
  std::string dtype = "f32";
  std::string adapter;  // a PEFT adapter folder (or a run folder) folded into the model
};

void add_generate_options(CLI::App& command, GenerateOptions& options);
int run_generate(const GenerateOptions& options);

}  // namespace rondo::cli
