// `rondo data <file> --model <m>`: what training would see of a JSONL file — the detected format,
// token statistics, bad lines, and one example as rendered through the chat template with the
// trained and masked parts told apart (the GUI's data page shows the --json form).
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace rondo::cli {

struct DataOptions {
  std::string file;
  std::string model;
  std::string format = "auto";
  std::string chat_format;
  bool train_on_everything = false;
  bool skip_bad_lines = false;
  long long example = 0;    // which example to show (0-based)
  long long max_lines = 0;  // > 0: read only this many lines (a quick preview of a large file)
  std::string max_line = "16MiB";  // the longest line read (data.max_line)
  std::string objective = "sft";   // a preference objective reads pairs (training.objective)
  long long max_length = 512;      // preference pairs: tokens per sequence
  bool json = false;
};

void add_data_options(CLI::App& command, DataOptions& options);
int run_data(const DataOptions& options);

}  // namespace rondo::cli
