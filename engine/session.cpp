#include "engine/session.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "engine/batching.h"
#include "engine/checkpoint.h"
#include "engine/data.h"
#include "engine/devices.h"
#include "engine/engine.h"
#include "engine/estimate.h"
#include "engine/export.h"
#include "engine/lr_schedule.h"
#include "engine/model_store.h"
#include "engine/preference_run.h"
#include "engine/run_errors.h"
#include "engine/run_lock.h"
#include "engine/sharding.h"
#include "engine/speed.h"
#include "engine/torch_device.h"
#include "kernels/checksum.h"
#include "kernels/error.h"
#include "models/chat_template.h"
#include "models/export.h"
#include "models/generate.h"
#include "models/gguf_export.h"
#include "models/inspect.h"
#include "models/lora.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/model_files.h"
#include "models/peft_adapter.h"
#include "models/tokenizer.h"
#include "models/weight_reader.h"
#include "offload/nvme_store.h"

namespace fs = std::filesystem;

namespace rondo::engine {
namespace {

// `slot` = `value` under `mu` for the scope's life, nullptr again after: what another thread
// reaches through it while run() works (request_stop, end_interrupted).
template <typename T>
class Published {
 public:
  Published(std::mutex& mu, T*& slot, T* value) : mu_(mu), slot_(slot) {
    std::lock_guard<std::mutex> lock(mu_);
    slot_ = value;
  }
  ~Published() {
    std::lock_guard<std::mutex> lock(mu_);
    slot_ = nullptr;
  }
  Published(const Published&) = delete;
  Published& operator=(const Published&) = delete;

 private:
  std::mutex& mu_;
  T*& slot_;
};

// The process's peak resident size so far (VmHWM), 0 when /proc says nothing.
std::uint64_t host_peak_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  return 0;
}

}  // namespace

struct Session::Impl {
  TrainConfig c;
  SessionOptions o;
  models::ModelSummary summary;
  std::optional<models::Tokenizer> tok;
  std::optional<models::ChatTemplate> tmpl;
  Dataset train, val;
  BatchingOptions batching;
  std::unique_ptr<Batcher> batcher, val_batcher;
  std::int64_t steps = 0;
  DevicePlan devices;
  RunEstimate est;
  std::string fingerprint;
  std::atomic<bool> stop{false};
  std::mutex engine_mu;
  Engine* engine = nullptr;        // while run() trains
  std::optional<RunLock> lock;     // held from the first look at the run folder
  std::string from_checkpoint;     // resuming: the checkpoint it continues from
  std::int64_t resumed_from = 0;   // its step
  bool checkpoint_checked = true;  // its hashes were checked when chosen (not by ranks > 0)
  std::vector<std::string> resume_warnings;  // newer checkpoints skipped (emitted at the start)
  // The last step trained (run_end reports it, even on failure); read by end_interrupted().
  std::atomic<std::int64_t> steps_done{0};
  // run_end, written once: by run(), or by end_interrupted() while `live_sink` is run()'s sink.
  std::mutex end_mu;
  EventSink* live_sink = nullptr;
  bool ended = false;
  std::chrono::steady_clock::time_point run_t0;
  std::uint64_t arena_peak = 0;      // the most the host arena held (set when it closes)
  offload::NvmeStoreInfo nvme_info;  // the NVMe tier's, when it closes

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }

  // Data parallel (SessionOptions::ranks): this process's rank and how many there are.
  int rank() const { return o.ranks ? o.ranks->rank() : 0; }
  int world() const { return o.ranks ? o.ranks->size() : std::max(o.plan_ranks, 1); }
  // Where this rank writes: the run folder for rank 0, <run_dir>/ranks/rank-r for the others.
  fs::path rank_dir() const {
    return rank() == 0 ? run_dir() : run_dir() / "ranks" / ("rank-" + std::to_string(rank()));
  }
  // Rank 0 runs `f`; the other ranks wait for it and fail with it (rank 0's own error says why),
  // so that none goes on into a run folder rank 0 refused. One process: `f`.
  template <typename F>
  void led_by_rank_0(const std::string& what, F f) {
    if (!o.ranks || world() == 1) return f();
    if (rank() == 0) {
      try {
        f();
      } catch (...) {
        try {
          o.ranks->rank_0_says(what, false);
        } catch (...) {  // rank 0's own error is the one to report
        }
        throw;
      }
    }
    if (!o.ranks->rank_0_says(what, true))
      throw Error("rank 0 failed while " + what + "; its output says why");
  }
  // Several ranks: every one arrives here before any goes on (Ranks::meet). One process: nothing.
  void meet(const std::string& what) const {
    if (o.ranks && world() > 1) o.ranks->meet(what);
  }
  fs::path run_dir() const { return fs::path(c.output.run_dir); }

  void prepare() {
    // `rondo plan` answers "does it fit" without data or a run folder (steps then come from
    // training.steps, or the answer is per step).
    std::vector<std::string> problems = c.validate(/*planning=*/o.plan_only);
    if (!c.hardware.gpu.empty() && !o.plan_only)
      problems.push_back(
          "hardware.gpu: plans for a card this machine need not have (rondo plan "
          "answers for it); rondo train runs on this machine's devices: remove "
          "hardware.gpu");
    if (world() > 1 && c.training.grad_accum % world() != 0) {
      const int up = (c.training.grad_accum / world() + 1) * world();
      problems.push_back(fmt::format(
          "training.grad_accum: the {} microbatches of a step are shared by the {} ranks, so it "
          "must be a multiple of {} (got {}); {} gives each rank {}",
          c.training.grad_accum, world(), world(), c.training.grad_accum, up, up / world()));
    }
    if (!problems.empty())
      throw Error(join_problems(fmt::format("The config has {} problem{}:", problems.size(),
                                            problems.size() == 1 ? "" : "s"),
                                problems));
    // Exports that cannot be written from this base are refused now, not after the training.
    if (!o.plan_only)
      for (const std::string& e : c.output.exports) {
        if (e == "merged") models::check_mergeable(c.model.path);
        if (e == "gguf") models::check_gguf_mergeable(c.model.path, models::GgufExportType::kQ8_0);
      }
    summary = models::inspect_model(c.model.path, c.data.seq_len);
    const bool gguf_adapter = std::find(c.output.exports.begin(), c.output.exports.end(),
                                        "gguf-adapter") != c.output.exports.end();
    if (!o.plan_only && gguf_adapter && summary.config.family == models::Family::kGptOss)
      throw Error(
          "output.exports: a GGUF adapter of GPT-OSS is not supported yet; export a PEFT adapter "
          "(adapter) or a merged model (merged)");
    if (!o.plan_only && c.training.method == "lora" && summary.config.num_experts > 0 &&
        gguf_adapter)
      for (const std::string& t : c.lora_config().targets)
        if (t == "all-linear" || t == "gate_proj" || t == "up_proj" || t == "down_proj" ||
            t == "gate")
          throw Error(
              "output.exports: a GGUF adapter of LoRA on experts is not supported yet (lora "
              "targets " +
              t + " of " + summary.config.architecture +
              "); export a PEFT adapter or a merged model, or target only q_proj, k_proj, "
              "v_proj, o_proj");
    if (const std::int64_t max_pos = summary.config.positions();
        max_pos > 0 && c.data.seq_len > max_pos)
      throw Error(positions_error(c.data.seq_len, c.model.path, summary, max_pos));
    if (summary.format == "config only" && !o.plan_only)
      throw Error(c.model.path +
                  " holds config.json but no weights (no *.safetensors); download them first "
                  "(`rondo plan` works without them)");
    const bool with_data = !c.data.train.empty() && summary.format != "config only";
    const std::int64_t tokens_per_step =
        c.data.seq_len * c.training.batch_rows * c.training.grad_accum;
    if (with_data)
      load_data();
    else
      steps = c.training.steps;  // planning only: no data to count epochs in

    DeviceSelection sel;
    sel.sim_devices = c.hardware.sim_devices;
    sel.gpu = c.hardware.gpu;
    sel.gpu_count = c.hardware.gpu_count;
    sel.share_index = c.distributed.gpu_share;
    sel.share_count = c.distributed.gpu_shares;
    if (!c.hardware.memory_cap.empty())
      sel.memory_cap = parse_bytes(c.hardware.memory_cap, "hardware.memory_cap");
    devices = plan_devices(sel);
    std::optional<ResumePoint> resume_point;
    if (o.resume && !o.plan_only) {
      led_by_rank_0("choosing the checkpoint to resume from", [&] {
        // The lock first: the checkpoints are looked at only once no other process writes them.
        if (!o.dry_run) {
          lock.emplace(run_dir().string(), "rondo train --resume");
          for (const std::string& f : lock->remove_stale_temporaries())
            log("Removed " + f + ", left by a process that was stopped while writing it");
        }
        choose_checkpoint();
      });
      if (world() > 1) {  // every rank continues from rank 0's choice
        std::string chosen = from_checkpoint;
        broadcast_string(o.ranks->steps(), chosen, 0, "the checkpoint to resume from");
        std::int64_t step = resumed_from;
        o.ranks->steps().broadcast(&step, sizeof step, 0, "the checkpoint to resume from");
        if (rank() > 0) {
          from_checkpoint = chosen;
          resumed_from = step;
          checkpoint_checked = false;
        }
      }
      resume_point = ResumePoint{.step = resumed_from,
                                 .checkpoints = list_checkpoints(run_dir().string()).size()};
    }
    // Each rank plans its share of a step: grad_accum / ranks microbatches.
    TrainConfig per_rank = c;
    per_rank.training.grad_accum = c.training.grad_accum / world();
    per_rank.distributed.ranks = world();
    per_rank.distributed.rank = rank();
    est = estimate_run(per_rank, summary, devices, steps, tokens_per_step / world(), o.host_free,
                       o.disk_free, resume_point);
    if (world() > 1 &&
        std::any_of(est.placement.layers.begin(), est.placement.layers.end(),
                    [](const offload::LayerDesc& l) { return l.grads == offload::Tier::kNvme; }))
      est.problems.push_back(fmt::format(
          "gradients: host memory is short, so the plan keeps some layers' gradients on the NVMe "
          "tier; the {} ranks sum gradients in host memory. Give each rank more host memory "
          "(hardware.host_memory), or train on one rank",
          world()));
    if (!est.problems.empty()) est.verdict = "does not fit";
    if (world() > 1)
      add_ranks(est, world(), link_bytes_per_s(c.distributed.link_speed),
                c.distributed.link_speed.empty() ? "assumed: 10 Gbit/s Ethernet; set "
                                                   "distributed.link_speed"
                                                 : "distributed.link_speed");
    if (batcher) est.steps_per_epoch = batcher->steps_per_epoch();
    if (!resume_point || resume_point->step == 0)  // else read back
      add_reference_pass(est, reference_tokens(c, batcher.get(), val_batcher.get()));
    // A plan that does not fit says what would, each change planned (an NVMe folder proposed
    // beside the run folder, on its drive).
    if (o.plan_only)
      find_fixes(est, per_rank, summary, devices, steps, o.host_free, o.disk_free, resume_point,
                 c.output.run_dir.empty() ? "" : c.output.run_dir + "-offload");
    if (o.plan_only && o.find_longest)
      find_longest_seq_len(est, per_rank, summary, devices, steps, o.host_free, o.disk_free,
                           resume_point);
    if (!est.problems.empty() && !o.plan_only)
      throw Error(join_problems("This run does not fit:", est.problems));
  }

  // The checkpoint a resume continues from: the one --checkpoint names, else the newest that passes
  // its checks, each newer one that fails skipped with a warning and set aside.
  void choose_checkpoint() {
    const fs::path dir = run_dir();
    const CheckpointChoice choice = engine::choose_checkpoint(dir.string(), o.checkpoint);
    auto why = [](const std::vector<std::string>& bad) {
      std::string w;
      for (const std::string& b : bad)
        w += (w.empty() ? "" : "; ") + b;
      return w;
    };
    if (!choice.chosen) {
      if (choice.skipped.empty()) return;  // no checkpoint yet: the run starts from step 0
      std::vector<std::string> all;
      for (const SkippedCheckpoint& k : choice.skipped)
        all.push_back(k.path + " fails its checks: " + why(k.problems));
      throw Error(join_problems(
          dir.string() +
              ": no checkpoint passes its checks, so this run cannot be resumed; start it again "
              "in a new folder (rondo train " +
              (dir / "config.toml").string() + " --run-dir NEW):",
          all));
    }
    from_checkpoint = choice.chosen->path;
    resumed_from = choice.chosen->step;
    // A damaged one goes out of the list, so that checkpoint.keep counts good checkpoints only
    // and no later resume meets it again; one that may be sound (unreadable now, or a newer
    // Rondo's) stays where it is.
    for (const SkippedCheckpoint& k : choice.skipped) {
      if (o.dry_run) {
        log(fmt::format("Warning: {} fails its checks; a resume skips it: {}", k.path,
                        why(k.problems)));
        continue;
      }
      std::string where = "left in place";
      if (k.damaged) {
        try {
          where = "moved to " + set_aside_checkpoint(k.path);
        } catch (const Error& e) {
          where = std::string("left in place: ") + e.what();
        }
      }
      resume_warnings.push_back(fmt::format("{} fails its checks and is skipped ({}): {}", k.path,
                                            where, why(k.problems)));
      log("Warning: " + resume_warnings.back());
    }
  }

  void load_data() {
    tok.emplace(models::load_tokenizer(c.model.path));
    tmpl.emplace(
        training_chat_template(c.model.path, c.data.chat_format, data_format_from(c.data.format)));
    DataOptions d{.format = data_format_from(c.data.format),
                  .skip_bad_lines = c.data.skip_bad_lines,
                  .train_on_everything = c.data.train_on_everything,
                  .objective = objective_from(c.training.objective),
                  .max_length = c.preference.sequence_tokens(c.data.seq_len),
                  .max_line_bytes = parse_bytes(c.data.max_line, "data.max_line")};
    train = engine::load_data(c.data.train, *tok, *tmpl, d);
    if (!c.data.validation.empty())
      val = engine::load_data(c.data.validation, *tok, *tmpl, d);
    else if (c.data.validation_split > 0)
      val = split_validation(train, c.data.validation_split, c.training.seed);
    if (train.trained_tokens() == 0)
      throw Error(c.data.train +
                  ": no token is trained on (every loss mask is empty); check "
                  "that the examples have assistant replies, or set "
                  "data.train_on_everything");
    batching = {.seq_len = c.data.seq_len,
                .rows = c.training.batch_rows,
                .microbatches = c.training.grad_accum,
                .pack = c.data.pack,
                .shuffle = c.data.shuffle,
                .seed = c.training.seed};
    batcher = std::make_unique<Batcher>(train, batching);
    if (!val.examples.empty()) {
      BatchingOptions vb = batching;
      vb.shuffle = false;
      val_batcher = std::make_unique<Batcher>(val, vb);
    }
    steps = c.training.steps > 0
                ? c.training.steps
                : std::max<std::int64_t>(
                      1, static_cast<std::int64_t>(std::ceil(
                             c.training.epochs * static_cast<double>(batcher->steps_per_epoch()))));
    if (c.training.warmup_steps > steps)
      throw Error(
          fmt::format("training.warmup_steps: {} is more than the run's {} steps (from "
                      "training.epochs = {}); lower it",
                      c.training.warmup_steps, steps, c.training.epochs));
    fingerprint = data_fingerprint(train, batching);
    std::int64_t tokens = 0;
    for (const Example& e : train.examples)
      tokens += std::min(static_cast<std::int64_t>(e.ids.size()), c.data.seq_len);
    c.data.mean_example_tokens =
        tokens / std::max<std::int64_t>(static_cast<std::int64_t>(train.examples.size()), 1);
  }

  std::string describe() const {
    std::ostringstream s;
    s << "Model       " << c.model.path << " (" << summary.config.architecture << ", "
      << fmt::format("{} parameters, {})\n", format_count(summary.params), summary.dtypes);
    if (batcher) {
      s << "Training    " << train.stats_text() << "\n";
      if (batcher->truncated() > 0)
        s << fmt::format("            {} examples truncated to {} tokens\n", batcher->truncated(),
                         c.data.seq_len);
      if (!val.examples.empty()) s << "Validation  " << val.stats_text() << "\n";
      s << fmt::format(
          "Steps       {} ({} rows of {} tokens per step; {} rows per epoch, {:.2f} "
          "epochs)\n",
          steps, c.training.batch_rows * c.training.grad_accum, c.data.seq_len, batcher->rows(),
          batcher->epoch_progress(steps));
    } else {
      s << fmt::format("Training    no data read ({}); {} rows of {} tokens per step\n",
                       summary.format == "config only" ? "the model has no weights or tokenizer yet"
                                                       : "data.train not set",
                       c.training.batch_rows * c.training.grad_accum, c.data.seq_len);
    }
    if (world() > 1)
      s << fmt::format(
          "Ranks       {} processes share each step ({} microbatch{} each); this is rank {}\n",
          world(), c.training.grad_accum / world(),
          c.training.grad_accum / world() == 1 ? "" : "es", rank());
    s << est.text();
    return s.str();
  }

  // ---- samples, from the weights in training (the streaming copies), on the devices ----

  std::vector<std::pair<std::string, std::string>> samples(Engine& eng) {
    std::vector<std::int64_t> stops(summary.config.eos_token_ids.begin(),
                                    summary.config.eos_token_ids.end());
    if (auto e = tok->eos_id()) stops.push_back(*e);
    for (const char* end : {"<|im_end|>", "<|eot_id|>", "</s>"})
      if (auto id = tok->token_to_id(end)) stops.push_back(*id);
    const bool chat = train.format != DataFormat::kText;
    std::vector<std::vector<std::int64_t>> prompts;
    for (const std::string& prompt : c.eval.prompts) {
      std::vector<std::int32_t> ids =
          chat ? models::render_chat(*tok, *tmpl, {{"user", prompt}}, true).ids
               : tok->encode(prompt, /*add_special_tokens=*/true);
      prompts.emplace_back(ids.begin(), ids.end());
    }
    const Generation gen = with_settings_advice([&] {
      return eng.generate(prompts, {.max_new_tokens = c.eval.sample_tokens, .stop_tokens = stops});
    });
    std::vector<std::pair<std::string, std::string>> out;
    for (std::size_t k = 0; k < prompts.size(); ++k) {
      std::vector<std::int32_t> g(gen.tokens[k].begin(), gen.tokens[k].end());
      out.emplace_back(c.eval.prompts[k], tok->decode(g, /*skip_special_tokens=*/true));
    }
    return out;
  }

  // ---- the run ----

  // This rank's microbatches of a step (all of them for one process): rank r's share of the step's
  // R * M is the r-th run of M (EngineOptions::data_parallel).
  std::vector<Microbatch> rank_share(std::vector<Microbatch> all) const {
    if (world() == 1) return all;
    const std::size_t m = all.size() / static_cast<std::size_t>(world());
    RONDO_ASSERT(m * static_cast<std::size_t>(world()) == all.size());
    std::vector<Microbatch> mine;
    for (std::size_t i = 0; i < m; ++i)
      mine.push_back(std::move(all[static_cast<std::size_t>(rank()) * m + i]));
    return mine;
  }

  // Rank 0 (or the one process), before the run's events: the run folder checked (a new run: a new
  // or empty folder, locked; a resume: prepare() locked it and chose the checkpoint), config.toml
  // written.
  void prepare_run_dir() {
    const fs::path dir = run_dir();
    std::error_code ec;
    if (o.resume) {
      // prepare() took the lock and chose the checkpoint.
      if (!fs::exists(dir / "config.toml"))
        throw Error(dir.string() + ": not a run folder (no config.toml); nothing to resume");
      if (from_checkpoint.empty())
        log("No complete checkpoint in " + (dir / "checkpoints").string() +
            " (the run stopped before its first one): starting again from step 0");
    } else {
      // A run folder is Rondo's: a new run never writes beside files it did not make (a model
      // folder, $HOME), where it would mix its checkpoints and exports with them.
      if (const std::vector<std::string> foreign = RunLock::foreign_entries(dir.string());
          !foreign.empty())
        throw Error(dir.string() + ": holds files Rondo did not make (" +
                    RunLock::list_some(foreign) +
                    "); a new run goes into a new or empty folder: choose another output.run_dir "
                    "(--run-dir)");
      fs::create_directories(dir, ec);
      if (ec) throw Error(dir.string() + ": cannot create the run folder: " + ec.message());
      lock.emplace(dir.string(), "rondo train");
      for (const std::string& f : lock->remove_stale_temporaries())
        log("Removed " + f + ", left by a process that was stopped while writing it");
      // A folder with a config.toml or a checkpoint holds a run. One with neither was stopped
      // while being created (before its config.toml was in place): it never started, and a new
      // run takes it over.
      if (fs::exists(dir / "config.toml") || !list_checkpoints(dir.string()).empty())
        throw Error(dir.string() +
                    ": already holds a run; continue it with `rondo train --resume " +
                    dir.string() + "`, or choose another output.run_dir");
      if (fs::exists(dir / "events.jsonl")) {
        fs::remove(dir / "events.jsonl", ec);
        if (ec)
          throw Error("cannot remove " + (dir / "events.jsonl").string() + ": " + ec.message());
      }
    }
    fs::create_directories(dir / "checkpoints", ec);
    if (ec) throw Error(dir.string() + ": cannot create the run folder: " + ec.message());
    if (!o.resume || o.resume_settings_changed)
      models::write_file_durably((dir / "config.toml").string(), o.config_toml);
  }

  SessionResult run() {
    RONDO_ASSERT(!o.dry_run && !o.plan_only);  // a dry run or a plan only looks
    const fs::path dir = run_dir();
    std::error_code ec;
    led_by_rank_0("preparing the run folder " + dir.string(), [&] { prepare_run_dir(); });
    if (rank() > 0) {
      fs::create_directories(rank_dir(), ec);
      if (ec)
        throw Error(rank_dir().string() + ": cannot create this rank's folder: " + ec.message());
      lock.emplace(rank_dir().string(), "rondo train, rank " + std::to_string(rank()));
    }
    steps_done = resumed_from;
    std::unique_ptr<EventSink> sink =
        EventSink::open(o.events.empty() ? (rank_dir() / "events.jsonl").string() : o.events);
    sink->emit(RunStartEvent{.run_dir = dir.string(),
                             .model = c.model.path,
                             .method = c.training.method,
                             .steps_total = steps,
                             .config_toml = o.config_toml,
                             .resumed_from = resumed_from,
                             .rank = rank(),
                             .ranks = world()});
    for (const std::string& w : resume_warnings)
      sink->warning(w);
    run_t0 = std::chrono::steady_clock::now();
    const Published<EventSink> published_sink(end_mu, live_sink, sink.get());
    auto emit_end = [&](const RunEndEvent& e) {
      std::lock_guard<std::mutex> lock(end_mu);
      if (!ended) sink->emit(e);
      ended = true;
    };
    // The run's end, with what it used of the host and the NVMe tier.
    auto end_event = [&](std::string status) {
      return RunEndEvent{.status = std::move(status),
                         .steps = steps_done,
                         .seconds = seconds_running(),
                         .host_peak_bytes = host_peak_bytes(),
                         .host_budget_bytes = est.host_available,
                         .host_arena_peak_bytes = arena_peak,
                         .host_overhead_bytes = est.host_overhead,
                         .nvme_backend = nvme_info.backend,
                         .nvme_read_bytes = nvme_info.bytes_read,
                         .nvme_written_bytes = nvme_info.bytes_written};
    };
    try {
      SessionResult r = train_loop(*sink);
      RunEndEvent end = end_event(r.status);
      end.steps = r.steps;
      end.export_path = r.export_path;
      emit_end(end);
      return r;
    } catch (const std::exception& e) {
      sink->error(e.what());
      emit_end(end_event("failed"));
      throw;
    }
  }

  double seconds_running() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - run_t0).count();
  }

  void end_interrupted() {
    std::lock_guard<std::mutex> lock(end_mu);
    if (!live_sink || ended) return;
    live_sink->emit(RunEndEvent{.status = "interrupted",
                                .steps = steps_done,
                                .seconds = seconds_running(),
                                .host_peak_bytes = host_peak_bytes(),
                                .host_budget_bytes = est.host_available,
                                .host_overhead_bytes = est.host_overhead});
    ended = true;
  }

  SessionResult train_loop(EventSink& sink) {
    // Before any GPU work: cuBLAS reads its workspace setting once (Note [Exact resume]).
    use_deterministic_torch(c.training.deterministic);
    const bool lora = c.training.method == "lora";
    const kernels::FloatDType sd = stream_dtype(c.model.dtype);
    log("Loading " + c.model.path);
    models::WeightReader reader(c.model.path);
    std::vector<models::LayerSpec> specs = reader.layers();
    models::LoraConfig lc = c.lora_config();
    std::map<std::string, at::Tensor> adapters;
    if (lora) {
      specs = models::add_lora(specs, lc);
      adapters = models::init_lora(specs, c.training.seed);
      // A resume's adapters come from its checkpoint (the starting one may be gone by then).
      if (!c.lora.init_adapter.empty() && from_checkpoint.empty())
        models::start_from_adapter(c.lora.init_adapter, lc, specs, adapters);
    }
    // Host memory under the budget (Note [Host budget], estimate.cpp): the arena refuses more.
    const std::uint64_t outside_arena = est.host.loading + est.host.cpu_device;
    offload::HostArena arena(offload::HostArenaOptions{
        .bytes_limit = est.host_available > outside_arena ? est.host_available - outside_arena
                                                          : est.host_available});
    struct ArenaPeak {  // recorded however the run ends
      offload::HostArena& arena;
      std::uint64_t& out;
      ~ArenaPeak() { out = arena.usage().peak; }
    } arena_peak_guard{arena, arena_peak};
    std::unique_ptr<offload::NvmeStore> nvme;
    if (est.placement.nvme_bytes > 0) {
      offload::NvmeStoreOptions no{
          .dir = c.hardware.offload_dir,
          .backend = offload::parse_backend_kind(c.hardware.offload_io, "hardware.offload_io"),
          .faults = o.io_faults};
      nvme = std::make_unique<offload::NvmeStore>(no, est.placement.nvme_bytes);
      log("NVMe tier: " + nvme->summary());
    }
    struct NvmeInfo {  // recorded however the run ends
      std::unique_ptr<offload::NvmeStore>& nvme;
      offload::NvmeStoreInfo& out;
      ~NvmeInfo() {
        if (nvme) out = nvme->info();
      }
    } nvme_info_guard{nvme, nvme_info};
    // The store as planned: each part of each layer in host memory or on NVMe, the frozen base
    // kept in the format chosen (est.placement).
    offload::LayerStore store(arena, est.placement.layers, sd, kernels::FloatDType::kF32,
                              nvme.get(), est.placement.chunk_bytes);
    // Progress while loading (a large model takes minutes): at most about twice a second, and the
    // last layer always.
    double last_load_event = -1;
    naming_io_errors("loading the model into the offload store", [&] {
      load_weights(store, specs, reader, adapters, [&](std::size_t done, std::size_t total) {
        const double now = sink.now();
        if (done < total && now - last_load_event < 0.5) return;
        last_load_event = now;
        sink.emit(LoadEvent{.layers_done = static_cast<std::int64_t>(done),
                            .layers_total = static_cast<std::int64_t>(total)});
      });
    });
    adapters.clear();
    // Buffers the OS would not page-lock (pinning = auto goes on without): said once when they
    // first appear, and again if more do while training (staging).
    std::uint64_t pin_failures_said = 0;
    auto say_pin_failures = [&] {
      const offload::HostUsage u = arena.usage();
      if (u.pin_failures <= pin_failures_said) return;
      pin_failures_said = u.pin_failures;
      const std::string w = offload::pin_failure_warning(u);
      log("Warning: " + w);
      sink.warning(w);
    };
    say_pin_failures();

    EngineCounters state;
    SessionResult result;
    std::optional<Plan> resume_plan;
    if (!from_checkpoint.empty()) {
      const std::string& path = from_checkpoint;
      // choose_checkpoint checked it (under the run lock): not hashed a second time.
      nlohmann::json meta = naming_io_errors("resuming from " + path, [&] {
        return read_checkpoint(path, store, specs, /*verified=*/checkpoint_checked);
      });
      const std::string where = path + "/state.json";
      try {
        if (meta.value("data_fingerprint", "") != fingerprint)
          throw Error(path + ": the training data or its batching changed since this checkpoint (" +
                      c.data.train + "); an exact resume needs the same data and settings");
        state = {.steps_done = meta.at("step").get<std::int64_t>(),
                 .optimizer_step = meta.at("optimizer_step").get<std::int64_t>(),
                 .loss_scale = meta.at("loss_scale").get<double>(),
                 .good_steps = meta.at("good_steps").get<int>()};
        // What the run had reached, for a resume that has nothing left to train.
        result.steps = state.steps_done;
        if (meta.contains("loss") && meta.at("loss").is_number())
          result.last_loss = meta.at("loss").get<double>();
        // The plan it was trained with: another partition or recompute grain would round
        // differently (Note [Exact resume]).
        if (meta.contains("plan")) {
          Plan saved = plan_from_json(meta.at("plan"));
          const auto devices_then = meta.at("plan").at("devices").get<std::size_t>();
          if (devices_then != devices.devices.size() ||
              !saved.problems(static_cast<int>(specs.size())).empty() ||
              saved.microbatches != est.plan.microbatches) {
            const std::string why = fmt::format(
                "{} was trained on {} devices with the plan {}; this machine has {} devices{}, so "
                "the run goes on with a new plan ({}) and will not be bit-identical to an "
                "uninterrupted one",
                path, devices_then, saved.describe(), devices.devices.size(),
                saved.microbatches != est.plan.microbatches
                    ? fmt::format(" and runs {} microbatches a step on each of {} ranks",
                                  est.plan.microbatches, world())
                    : "",
                est.plan.describe());
            log("Warning: " + why);
            sink.warning(why);
          } else {
            resume_plan = saved;
          }
        }
      } catch (const nlohmann::json::exception& e) {
        throw Error(where + ": " + e.what() + " — not a checkpoint this version of rondo wrote");
      }
      result.checkpoint = path;
      log(fmt::format("Resuming from {} (step {} of {})", path, state.steps_done, steps));
    }

    // As planned: the CPU device capped where the plan made it share the budget with the arena.
    std::vector<std::unique_ptr<kernels::Device>> devs = open_devices(est.devices);
    std::vector<kernels::Device*> raw;
    for (auto& d : devs)
      raw.push_back(d.get());
    const LrSchedule schedule{.kind = schedule_kind(c.training.schedule),
                              .lr = c.training.lr,
                              .warmup_steps = c.training.warmup_steps,
                              .total_steps = steps,
                              .min_lr_ratio = c.training.min_lr_ratio};
    EngineOptions eo;
    eo.adamw = {.lr = c.training.lr,
                .beta1 = c.training.beta1,
                .beta2 = c.training.beta2,
                .eps = c.training.eps,
                .weight_decay = c.training.weight_decay};
    eo.max_grad_norm = c.training.max_grad_norm;
    eo.lr = [schedule](std::int64_t s) { return schedule.at(s); };
    eo.loss_scaling.enabled = sd == kernels::FloatDType::kF16;
    eo.one_step_stale = c.training.one_step_stale;
    eo.seed = c.training.seed;
    eo.preference = preference_options(c);
    eo.events = &sink;
    eo.plan_inputs = &est.inputs;
    eo.placement_json = placement_json(est, nvme.get());
    // Activation checkpoints on the NVMe tier: the space the planner set aside in the store's file
    // (for est.plan; a resumed plan that saves more keeps the rest in host memory).
    eo.spill_checkpoint_bytes = est.placement.spill_bytes;
    eo.share_frozen_weights = eo.share_trained_state = devices.mode == DeviceMode::kCpu;
    if (o.ranks && world() > 1)
      eo.data_parallel = {.steps = &o.ranks->steps(),
                          .gradients = &o.ranks->gradients(),
                          .optimizer_owners = est.placement.optimizer_owners};
    Engine eng(summary.config, specs, store, arena, raw, resume_plan ? *resume_plan : est.plan, eo);
    if (!from_checkpoint.empty()) eng.restore(state);
    const Published<Engine> published_engine(engine_mu, engine, &eng);
    if (stop) eng.request_stop();

    // Rank 0 runs `work` reading the whole optimizer state: sharded, the others serve it the
    // layers they own meanwhile (engine/sharding.h). Every rank calls it.
    auto gathered = [&](const std::function<void()>& work) {
      if (eo.data_parallel.optimizer_owners.empty()) return work();
      with_gathered_state(o.ranks->steps(), store, eo.data_parallel.optimizer_owners, work);
    };
    // Every rank holds the same state after a step (sharded: gathered by rank 0): rank 0 writes
    // it for all.
    auto checkpoint = [&](std::int64_t step) {
      const std::string path =
          (run_dir() / "checkpoints" / ("step-" + std::to_string(step))).string();
      if (rank() > 0) {
        result.checkpoint = path;
        return;
      }
      const EngineCounters st = eng.counters();
      const Batcher::Position pos = batcher->position(step + 1);
      nlohmann::json meta = {
          {"step", st.steps_done},
          {"optimizer_step", st.optimizer_step},
          {"loss_scale", st.loss_scale},
          {"good_steps", st.good_steps},
          {"loss",
           std::isfinite(result.last_loss) ? nlohmann::json(result.last_loss) : nlohmann::json()},
          {"steps_total", steps},
          {"plan", plan_to_json(eng.plan(), devices.devices.size())},
          {"ranks", world()},  // data parallel: how many processes shared each step
          {"data_fingerprint", fingerprint},
          {"data_position", {{"epoch", pos.epoch}, {"row", pos.row}}},
          {"lr_next", step < steps ? schedule.at(step + 1) : 0.0},
          {"rng",
           {{"seed", c.training.seed},
            {"dropout", "counter-based: (seed, step, microbatch)"},
            {"shuffle", "per epoch: (seed, epoch)"},
            {"lora_init", "(seed)"}}},
      };
      // What a failed write leaves: the last checkpoint (this run's, or the one it resumed from).
      const std::string last = !result.checkpoint.empty() ? result.checkpoint : from_checkpoint;
      const std::string resume = "`rondo train --resume " + run_dir().string() + "`";
      const std::uint64_t bytes = naming_write_errors(
          "saving the checkpoint of step " + std::to_string(step),
          [&] {
            return write_checkpoint(path, store, specs, meta, c.training.one_step_stale, [&] {
              if (o.on_fault_point) o.on_fault_point(FaultPoint::kInCheckpoint, step);
            });
          },
          last.empty() ? ". No checkpoint was written before it: once there is room (or the "
                         "fault is fixed), " +
                             resume + " starts the run again from step 0"
                       : ". The last checkpoint, " + last +
                             ", is intact: once there is room (or "
                             "the fault is fixed), " +
                             resume + " continues from it");
      prune_checkpoints(run_dir().string(), c.checkpoint.keep, step);
      sink.emit(CheckpointEvent{.step = step, .path = path, .bytes = bytes});
      log(fmt::format("Checkpoint {} ({})", path, format_bytes(bytes)));
      result.checkpoint = path;
    };
    // The others wait for it (its write may take longer than a collective's timeout).
    auto checkpoint_all = [&](std::int64_t step) {
      gathered([&] { checkpoint(step); });
      meet("rank 0's checkpoint of step " + std::to_string(step));
    };
    // Validation: forward-only jobs through the engine, on the run's devices.
    // Several ranks: each evaluates its share of the rows (every rank's weights are the same), and
    // the sums are added.
    auto evaluate = [&](std::int64_t step) {
      std::vector<Microbatch> rows = val_batcher->all_rows();
      if (world() > 1) {
        std::vector<Microbatch> mine;
        for (std::size_t i = static_cast<std::size_t>(rank()); i < rows.size();
             i += static_cast<std::size_t>(world()))
          mine.push_back(std::move(rows[i]));
        rows = std::move(mine);
      }
      EvalResult v = with_settings_advice([&] { return eng.evaluate(std::move(rows)); });
      if (world() > 1) {
        const std::string what = "the validation loss at step " + std::to_string(step);
        meet(what);
        double sums[2 + kPreferenceMetrics] = {v.loss_sum, static_cast<double>(v.targets)};
        std::copy(v.preference.begin(), v.preference.end(), sums + 2);
        o.ranks->steps().all_reduce_sum(sums, std::size(sums), what);
        v = {.loss_sum = sums[0], .targets = static_cast<std::int64_t>(sums[1])};
        std::copy(sums + 2, sums + 2 + kPreferenceMetrics, v.preference.begin());
      }
      if (rank() > 0) return;
      const double loss = v.loss();
      const std::int64_t n = v.targets;
      const auto metrics = preference_metrics(eo.preference.objective, v.preference,
                                              static_cast<double>(std::max<std::int64_t>(n, 1)));
      sink.emit(EvalEvent{.step = step, .loss = loss, .tokens = n, .metrics = metrics});
      log(fmt::format("Validation loss {:.4f} at step {} ({})", loss, step,
                      metrics.empty() ? fmt::format("{} tokens", n)
                                      : fmt::format("{} pairs; {}", val.examples.size(),
                                                    preference_status(metrics))));
    };
    // Samples: every prompt at once on the devices (Engine::generate).
    auto sample = [&](std::int64_t step) {
      if (c.eval.prompts.empty()) return;
      if (rank() == 0)
        for (auto& [prompt, text] : samples(eng)) {
          sink.emit(SampleEvent{.step = step, .prompt = prompt, .text = text});
          log(fmt::format("Sample at step {}:\n  > {}\n  {}", step, prompt, text));
        }
      meet("rank 0's samples at step " + std::to_string(step));
    };

    // Every rank has loaded the model (some may take longer than a collective's timeout).
    meet("loading the model");

    std::int64_t s = state.steps_done;
    if (eo.preference.needs_reference())
      prepare_reference(
          run_dir(), fingerprint + (val_batcher ? "+" + data_fingerprint(val, batching) : ""),
          s == 0, rank() == 0, *batcher, val_batcher.get(), c.data.seq_len,
          [&](std::vector<Microbatch> mb) { return eng.evaluate(std::move(mb)); },
          [&](const std::string& m) { log(m); });
    if (s == 0 && c.eval.sample_every > 0) sample(0);
    if (s == 0 && c.eval.every > 0 && val_batcher) evaluate(0);
    double mean_step_s = 0;
    std::int64_t timed = 0;
    // The plan's step time against the measured steps (after the first: warm-up), said once.
    const double predicted_step_s = predict(eng.plan(), est.inputs).step_time_s;
    std::vector<double> judged;
    auto on_step = [&](const StepResult& r) {
      mean_step_s = timed == 0 ? r.seconds : 0.9 * mean_step_s + 0.1 * r.seconds;
      if (timed > 0 && static_cast<int>(judged.size()) < kStepsToJudge) {
        judged.push_back(r.seconds);
        if (static_cast<int>(judged.size()) == kStepsToJudge)
          if (std::string w = step_time_warning(predicted_step_s, judged, steps); !w.empty()) {
            // On the CPU (simulated GPUs compute on it too) the plan's speeds are this machine's
            // cached figures: wrong by this much, they are measured again by the next plan
            // (Note [A probe on a busy machine] in speed.cpp).
            if ((devices.mode == DeviceMode::kCpu || devices.mode == DeviceMode::kSim) &&
                forget_cpu_speeds() > 0)
              w += "; this machine's cached speed figures are forgotten, so that the next plan "
                   "measures them again";
            log("Warning: " + w);
            sink.warning(w);
          }
      }
      ++timed;
      StepEvent e{.step = r.step,
                  .steps_total = steps,
                  .loss = r.loss,
                  .lr = schedule.at(r.step),
                  .grad_norm = r.grad_norm,
                  .tokens_per_s = static_cast<double>(r.tokens) / std::max(r.seconds, 1e-9),
                  .eta_s = mean_step_s * static_cast<double>(steps - r.step),
                  .tokens = r.targets,
                  .metrics = preference_metrics(eo.preference.objective, r.preference)};
      sink.emit(e);
      if (o.on_fault_point) o.on_fault_point(FaultPoint::kAfterStep, r.step);
      if (o.on_step) o.on_step(e);
      result.last_loss = r.loss;
      steps_done = r.step;
    };
    auto due = [](std::int64_t step, std::int64_t every) { return every > 0 && step % every == 0; };
    bool stopped = false;
    while (s < steps) {
      std::int64_t next = steps;
      for (std::int64_t every : {c.checkpoint.every, c.eval.every, c.eval.sample_every})
        if (every > 0) next = std::min(next, (s / every + 1) * every);
      std::vector<StepResult> done = with_settings_advice([&] {
        return eng.train(
            next - s, [&](std::int64_t step) { return rank_share(batcher->step(step)); }, on_step);
      });
      s += static_cast<std::int64_t>(done.size());
      say_pin_failures();
      stopped = s < next;
      if (stopped) break;
      if (due(s, c.eval.every) && val_batcher) evaluate(s);
      if (due(s, c.eval.sample_every)) sample(s);
      if (due(s, c.checkpoint.every) || s == steps) checkpoint_all(s);
    }
    if (s < steps) {
      // Several ranks stop after the same step (Engine::request_stop).
      if (result.checkpoint.empty() || !result.checkpoint.ends_with("step-" + std::to_string(s)))
        checkpoint_all(s);
      result.status = "stopped";
      result.steps = s;
      log(fmt::format("Stopped at step {} of {}; continue with `rondo train --resume {}`", s, steps,
                      run_dir().string()));
      return result;
    }
    result.status = "completed";
    result.steps = s;
    // Sharded: the others serve rank 0 the masters they hold while it exports.
    gathered([&] {
      for (const std::string& x : c.output.exports) {
        if (rank() > 0) break;  // rank 0 exports what every rank holds
        const std::string path = (run_dir() / x).string();
        std::string written = path;
        // The run's last checkpoint holds what the export would have: `rondo export` writes it.
        naming_write_errors(
            "exporting " + x + " to " + path,
            [&] {
              if (x == "adapter") {
                export_peft_adapter(path, store, specs, lc, c.model.path);
              } else if (x == "merged") {
                export_merged(
                    path, store, specs, c.model.path,
                    sd == kernels::FloatDType::kF32 ? models::DType::kF32 : models::DType::kBF16);
              } else if (x == "gguf-adapter") {
                written = path + "/adapter.gguf";
                export_gguf_adapter(written, store, specs, summary.config, lc);
              } else {
                written = path + "/model-q8_0.gguf";
                export_gguf_merged(written, store, specs, summary.config, c.model.path,
                                   models::GgufExportType::kQ8_0);
              }
            },
            result.checkpoint.empty()
                ? std::string()
                : ". The training is complete and saved in " + result.checkpoint +
                      ": once there is room, `rondo export " + run_dir().string() + " --format " +
                      x + "` writes it from there");
        log("Exported " + written);
        if (result.export_path.empty()) result.export_path = written;
      }
    });
    return result;
  }
};

Session::Session(const TrainConfig& config, SessionOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->c = config;
  impl_->o = std::move(options);
  impl_->prepare();
}

Session::~Session() = default;

std::string Session::describe() const {
  return impl_->describe();
}

const RunEstimate& Session::estimate() const {
  return impl_->est;
}

bool Session::fits() const {
  return impl_->est.problems.empty();
}

std::int64_t Session::steps_total() const {
  return impl_->steps;
}

SessionResult Session::run() {
  return impl_->run();
}

void Session::end_interrupted() {
  impl_->end_interrupted();
}

void Session::request_stop() {
  impl_->stop = true;
  std::lock_guard<std::mutex> lock(impl_->engine_mu);
  if (impl_->engine) impl_->engine->request_stop();
}

}  // namespace rondo::engine
