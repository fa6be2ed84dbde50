// `rondo train`, `rondo plan`, `rondo export` and `rondo demo`: a run from a TOML config plus flag
// overrides (cli/config_file.h), through engine::Session. On a terminal a live status line,
// plain lines otherwise; Ctrl-C finishes the steps under way, checkpoints and exits (130), a
// second Ctrl-C exits at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace rondo::cli {

struct TrainOptions {
  std::string config;                  // TOML file ("" = flags only)
  std::vector<std::string> overrides;  // --set section.key=value, and the shorthand flags
  std::string resume;                  // run folder to continue
  std::string checkpoint;              // with resume: "step-N" ("" = the newest that passes)
  std::string events;                  // "" = <run>/events.jsonl, "-" = stdout
  bool dry_run = false;
  bool help_config = false;
  bool json = false;         // rondo plan --json
  bool max_seq_len = false;  // rondo plan --max-seq-len
  // Data parallel without a launcher: --nodes N --node-rank R --master HOST:PORT (0/-1/"": not
  // given; torchrun's or Slurm's variables are read instead).
  int nodes = 0, node_rank = -1;
  std::string master;
  // Shorthands, turned into overrides.
  std::string model, data, run_dir;
  long long steps = -1;
  double lr = -1;
};

struct ExportOptions {
  std::string run;                 // run folder
  std::string checkpoint;          // "" = the newest; "step-40" or a path
  std::string format = "adapter";  // adapter, merged, gguf, gguf-adapter
  std::string type;                // gguf: models::GgufExportType ("" = q8_0)
  std::string out;                 // "" = <run>/export-<format>-step-N
};

struct DemoOptions {
  std::string model;    // "" = the bundled SmolLM2-135M-Instruct GGUF
  std::string run_dir;  // "" = a new folder under runs/
  long long steps = 0;  // 0 = the demo's own: 30 (supervised), 20 (--dpo)
  std::string events;
  // A finished demo run: continue it with DPO on data/demo/rondo_prefers.jsonl, from its adapter.
  std::string dpo;
};

void add_train_options(CLI::App& command, TrainOptions& options);
void add_plan_options(CLI::App& command, TrainOptions& options);
void add_export_options(CLI::App& command, ExportOptions& options);
void add_demo_options(CLI::App& command, DemoOptions& options);
int run_train(const TrainOptions& options);
int run_plan(const TrainOptions& options);
int run_export(const ExportOptions& options);

// The checkpoint of run folder `run` that `rondo export` or `rondo chat` reads: the one `name`
// names, else the newest that passes its checks, each newer one that fails named on stderr, when
// `fall_back` (chat); without it (export), a newer one that fails is an error that names it and
// the --checkpoint that would take the older one. Throws Error when there is none (`purpose`:
// "to export", "to chat with").
struct ChosenCheckpoint {
  std::string path;
  std::int64_t step = 0;
};
ChosenCheckpoint checkpoint_for(const std::string& run, const std::string& name,
                                const std::string& purpose, bool fall_back);
int run_demo(const DemoOptions& options);

}  // namespace rondo::cli
