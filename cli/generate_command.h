// `rondo generate <model> --prompt ... [--chat]`: text from a model, streamed as it is generated.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace rondo::cli {

// Where generate and chat run: the CUDA GPUs when the machine has any (or simulated ones on
// request), the weights resident on the first when they fit, else streamed stage by stage; the CPU
// when there is no GPU, or with --cpu.
struct GenerationDevices {
  int sim = 0;                      // --sim N
  std::string sim_memory = "24GB";  // --sim-memory
  std::string memory_cap;           // --memory-cap, "" = whole device
  bool cpu = false;                 // --cpu
};

struct GenerateOptions {
  std::string model;
  std::string prompt;
  // One prompt per line of this file, all generated at once (batched on the devices); stdout
  // gets one JSON object per prompt: {"prompt", "text", "tokens"}.
  std::string prompts_file;
  bool chat = false;
  std::string chat_format;  // "" = recognise the model's template
  std::string system;       // system message for --chat
  long long max_new_tokens = 128;
  double temperature = 0;  // 0 = greedy
  double top_p = 1.0;
  unsigned long long seed = 0;
  std::string dtype = "f32";
  std::string adapter;  // a PEFT adapter folder (or a run folder) folded into the model
  GenerationDevices devices;
};

void add_generate_options(CLI::App& command, GenerateOptions& options);
int run_generate(const GenerateOptions& options);

// `rondo chat TARGET`: an interactive chat in the terminal (lines on stdin, the reply streamed on
// stdout), the conversation kept across turns and rendered with the model's chat template.
// TARGET is a run folder (its newest sound checkpoint, or --checkpoint step-N: the trained weights
// as they are there, LoRA or full) or a model (with --adapter, a PEFT folder). Commands: /reset,
// /system TEXT, /save FILE (appends the conversation as one chat-format JSONL line: training data),
// /quit. A command or turn that fails says why and leaves the conversation as it was.
struct ChatOptions {
  std::string target;
  std::string adapter;
  std::string checkpoint;
  std::string system;
  std::string chat_format;
  long long max_new_tokens = 512;
  double temperature = 0;
  double top_p = 1.0;
  unsigned long long seed = 0;
  std::string dtype = "f32";
  // For programs (the GUI's chat tab): each stdin line is a JSON string (a message or a /command),
  // and stdout is one JSON object per line: {"type": "ready"|"token"|"reply"|"info"|"error",
  // "text": ...} (a reply also has "tokens" and "seconds").
  bool jsonl = false;
  GenerationDevices devices;
};

void add_chat_options(CLI::App& command, ChatOptions& options);
int run_chat(const ChatOptions& options);

}  // namespace rondo::cli
