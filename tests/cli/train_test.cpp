// `rondo train`, `plan`, `export` as a user runs them, on a tiny model folder written by the test:
// errors that name the file, line or field; training that learns; exact resume after SIGKILL (at
// a random step, and inside a checkpoint write), after Ctrl-C; export from a checkpoint.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "../support/tiny_model_folder.h"
#include "cli/config_file.h"
#include "kernels/checksum.h"
#include "models/chat_template.h"
#include "train_fixture.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using rondo::test::contains;
using rondo::test::events;
using rondo::test::expect_same_run;
using rondo::test::kQa;
using rondo::test::Result;
using rondo::test::run_rondo;
using rondo::test::slurp;
using rondo::test::spawn;
using rondo::test::step_losses;
using rondo::test::wait_for;
using rondo::test::write;

using TrainCli = rondo::test::TrainFixture;

TEST_F(TrainCli, ConfigProblemsAreListedAllAtOnceWithFileAndLine) {
  const fs::path cfg = dir / "bad.toml";
  write(cfg,
        "[model]\n"  // 1
        "path = \"" +
            model.string() +
            "\"\n"                      // 2
            "[data]\n"                  // 3
            "train = \"x.jsonl\"\n"     // 4
            "seq_lenn = 64\n"           // 5: unknown key, near data.seq_len
            "[training]\n"              // 6
            "steps = \"ten\"\n"         // 7: wrong type
            "lr = -1.0\n"               // 8: bad value (validate)
            "schedule = \"cosin\"\n");  // 9: bad value (validate)
  Result r = run_rondo("train " + cfg.string());
  EXPECT_EQ(r.code, 1) << r.out;
  // Reading: both problems of the file at once, each with its line.
  EXPECT_TRUE(contains(r.out, cfg.string() + ":5: unknown key data.seq_lenn (did you mean "
                                             "data.seq_len?)"))
      << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":7: training.steps: expected an integer")) << r.out;
  // ... and with them the values validate() rejects, each with its line.
  EXPECT_TRUE(contains(r.out, "The config has 4 problems")) << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":8: training.lr: must be in (0, 1)")) << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":9: training.schedule: must be")) << r.out;

  // Values: every problem at once, with the line each field was set on.
  write(cfg, "[model]\npath = \"" + model.string() +
                 "\"\n[data]\ntrain = \"x.jsonl\"\n[training]\nlr = -1.0\nschedule = "
                 "\"cosin\"\n[lora]\nrank = 0\n");
  r = run_rondo("train " + cfg.string() + " --set training.grad_accum=0 --set training.eps=0");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "5 problems")) << r.out;
  // eps 0 was taken, and the run failed at step 2 with a NaN gradient norm.
  EXPECT_TRUE(contains(r.out, "--set training.eps=0: training.eps: must be in (0, 1] (got 0)"))
      << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":6: training.lr: must be in (0, 1)")) << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":7: training.schedule: must be constant, linear "
                                             "or cosine (got 'cosin')"))
      << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":9: lora.rank: LoRA rank must be in 1..4096"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "--set training.grad_accum=0: training.grad_accum: must be in"))
      << r.out;
}

TEST_F(TrainCli, TomlSyntaxErrorNamesLineAndColumn) {
  const fs::path cfg = dir / "broken.toml";
  write(cfg, "[model]\npath = \"m\"\n[data\ntrain = 1\n");
  Result r = run_rondo("train " + cfg.string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":3:")) << r.out;
  // Invalid UTF-8 in a comment (toml++ checks strings only): named with its line and column.
  write(cfg, "[model]\n# caf\xe9 au lait\npath = \"m\"\n");
  r = run_rondo("train " + cfg.string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, cfg.string() + ":2:6: not UTF-8 (byte 0xe9)")) << r.out;
  r = run_rondo("train " + (dir / "missing.toml").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(
      contains(r.out, "cannot read " + (dir / "missing.toml").string() + " (the config file)"))
      << r.out;
}

TEST_F(TrainCli, MissingFilesAreNamed) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --model " + (dir / "nope").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, (dir / "nope").string())) << r.out;
  r = run_rondo("train " + cfg.string() + " --data " + (dir / "nope.jsonl").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, (dir / "nope.jsonl").string())) << r.out;
  EXPECT_FALSE(fs::exists(dir / "run" / "events.jsonl"));  // nothing started
}

TEST_F(TrainCli, BadDataLineNamesFileAndLineOrIsSkippedAndCounted) {
  std::string text = slurp(data);
  write(data, text + "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}\n");  // line 13
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --dry-run");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, data.string() + ":13:")) << r.out;
  r = run_rondo("train " + cfg.string() + " --dry-run --set data.skip_bad_lines=true");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "1 bad line skipped")) << r.out;
  EXPECT_TRUE(contains(r.out, "12 examples (chat)")) << r.out;
}

TEST_F(TrainCli, DatasetEmptyAfterFilteringIsAnError) {
  write(data, "not json\n{\"text\": 3}\n");
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --set data.skip_bad_lines=true");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "no examples")) << r.out;
  EXPECT_TRUE(contains(r.out, data.string())) << r.out;
}

TEST_F(TrainCli, NotEnoughHostMemoryIsFoundBeforeLoading) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --set hardware.host_memory=64KB");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "host memory: the run needs about")) << r.out;
  EXPECT_TRUE(contains(r.out, "64.0 KiB is available")) << r.out;
  EXPECT_FALSE(fs::exists(dir / "run" / "events.jsonl"));
  // `rondo plan` reports the same as a verdict.
  r = run_rondo("plan " + cfg.string() + " --set hardware.host_memory=64KB");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_TRUE(contains(r.out, "Verdict     does not fit")) << r.out;
  r = run_rondo("plan " + cfg.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "Verdict     fits")) << r.out;
  EXPECT_TRUE(contains(r.out, "tokens/s")) << r.out;
}

TEST_F(TrainCli, DryRunPrintsTheResolvedConfigAndThePlanAndTrainsNothing) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --dry-run --lr 0.003 --set lora.targets=q_proj");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "lr = 0.003")) << r.out;
  EXPECT_TRUE(contains(r.out, "targets = [\"q_proj\"]")) << r.out;
  EXPECT_TRUE(contains(r.out, "Plan        ")) << r.out;
  EXPECT_TRUE(contains(r.out, "12 examples (chat)")) << r.out;
  EXPECT_FALSE(fs::exists(dir / "run"));
}

// `rondo generate --adapter` takes the run folder (its adapter/) or the PEFT folder itself, and
// names what is missing; the tokens equal peft's (tests/oracle/test_lora.py).
TEST_F(TrainCli, GenerateUsesARunsAdapter) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --set training.steps=3");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const fs::path& adapter : {dir / "run", dir / "run" / "adapter"}) {
    r = run_rondo("generate " + model.string() + " -p 'hello there' -n 4 --adapter " +
                  adapter.string());
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "generated in")) << r.out;
  }
  r = run_rondo("generate " + model.string() + " -p hi --adapter " + (dir / "nowhere").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "no adapter_config.json")) << r.out;
}

// `rondo chat RUN` talks to the run's trained weights (its newest checkpoint, or --checkpoint):
// a LoRA run's first greedy reply equals `rondo generate --chat` with its exported adapter, a full
// run's equals generate on its merged export; the conversation carries over turns, /system starts
// a new one, /save writes it as a chat-format JSONL line.
TEST_F(TrainCli, ChatTalksToTheRunsWeights) {
  const fs::path cfg = dir / "c.toml";
  for (const std::string method : {"lora", "full"}) {
    SCOPED_TRACE(method);
    const fs::path run = dir / method;
    write(cfg, config(method));
    Result r = run_rondo("train " + cfg.string() + " --set training.steps=3 --set " +
                         "training.method=" + method);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string one_shot =
        method == "lora"
            ? "generate " + model.string() + " --chat -p hello -n 6 --adapter " + run.string()
            : "generate " + (run / "merged").string() + " --chat -p hello -n 6";
    const Result want = run_rondo(one_shot, /*with_stderr=*/false);
    ASSERT_EQ(want.code, 0) << want.out;
    ASSERT_GT(want.out.size(), 2u) << "an empty reply would make the comparison below void";
    const fs::path saved = dir / "conv.jsonl";
    fs::remove(saved);
    write(dir / "in.txt", "hello\nagain\n/system Be brief\nhi\n/save " +
                              (dir / "no" / "such" / "x.jsonl").string() + "\n/save " +
                              saved.string() + "\n/quit\nnever read\n");
    r = run_rondo("chat " + run.string() + " -n 6 < " + (dir / "in.txt").string(),
                  /*with_stderr=*/false);
    ASSERT_EQ(r.code, 0) << r.out;  // the failed /save did not end the chat
    EXPECT_EQ(r.out.substr(0, want.out.size()), want.out) << r.out;
    const json conv = json::parse(slurp(saved));
    ASSERT_EQ(conv["messages"].size(), 3u) << conv.dump();
    EXPECT_EQ(conv["messages"][0], (json{{"role", "system"}, {"content", "Be brief"}}));
    EXPECT_EQ(conv["messages"][1], (json{{"role", "user"}, {"content", "hi"}}));
    EXPECT_EQ(conv["messages"][2]["role"], "assistant");

    // --jsonl (the GUI's chat tab): JSON strings in, one JSON object per line out; the tokens
    // add up to the reply, which is the same reply; a bad line is an error and the chat goes on.
    write(dir / "in.jsonl", "\"hello\"\nnot json\n\"/reset\"\n");
    r = run_rondo("chat " + run.string() + " -n 6 --jsonl < " + (dir / "in.jsonl").string(),
                  /*with_stderr=*/false);
    ASSERT_EQ(r.code, 0) << r.out;
    std::vector<json> lines;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);)
      lines.push_back(json::parse(line));
    ASSERT_GE(lines.size(), 5u) << r.out;
    EXPECT_EQ(lines.front()["type"], "ready");
    std::string tokens;
    std::size_t i = 1;
    for (; i < lines.size() && lines[i]["type"] == "token"; ++i)
      tokens += lines[i]["text"].get<std::string>();
    ASSERT_LT(i + 2, lines.size()) << r.out;
    EXPECT_EQ(lines[i]["type"], "reply");
    EXPECT_EQ(lines[i]["text"], tokens);
    EXPECT_EQ(tokens, want.out.substr(0, want.out.size() - 1)) << r.out;  // generate ends with \n
    EXPECT_EQ(lines[i + 1]["type"], "error");
    EXPECT_EQ(lines[i + 2], (json{{"type", "info"}, {"text", "conversation cleared"}}));
  }
  Result r = run_rondo("chat " + (dir / "lora").string() + " --checkpoint step-99 < /dev/null");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "no checkpoint step-99 (it has: step-3)")) << r.out;
  r = run_rondo("chat " + model.string() + " --checkpoint step-3 < /dev/null");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--checkpoint goes with a run folder")) << r.out;
}

// `rondo generate` and `rondo chat` on the devices (simulated GPUs here; CUDA ones when the
// machine has them): the adapters applied unmerged on the devices give the CPU path's greedy
// tokens, with the weights resident on the first device, spread over two when one holds too
// little for all of them, and streamed stage by stage when two do (the same reply each time). The
// engine's generation is checked against transformers in tests/oracle/test_generate.py.
TEST_F(TrainCli, GenerateAndChatOnTheDevicesEqualTheCpu) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --set training.steps=3");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string gen =
      "generate " + model.string() + " --chat -p hello -n 8 --adapter " + (dir / "run").string();
  const Result cpu = run_rondo(gen + " --cpu", /*with_stderr=*/false);
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  ASSERT_GT(cpu.out.size(), 2u) << "an empty reply would make the comparisons below void";
  const std::vector<std::pair<std::string, std::string>> where = {
      {" --sim 2", "on 2 simulated GPUs (weights resident)"},
      {" --sim 2 --sim-memory 150KB", "on 2 simulated GPUs (weights resident, spread over"},
      {" --sim 2 --sim-memory 120KB", "on 2 simulated GPUs (weights streamed stage by stage"}};
  for (const auto& [flags, said] : where) {
    SCOPED_TRACE(flags);
    r = run_rondo(gen + flags, /*with_stderr=*/false);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out, cpu.out);
    r = run_rondo(gen + flags);
    EXPECT_TRUE(contains(r.out, said)) << r.out;
    // The run's checkpoint through `rondo chat`: its first reply is the same one.
    write(dir / "in.txt", "hello\n");
    r = run_rondo(
        "chat " + (dir / "run").string() + " -n 8" + flags + " < " + (dir / "in.txt").string(),
        /*with_stderr=*/false);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out.substr(0, cpu.out.size()), cpu.out) << r.out;
  }
  // A full run's checkpoint (every weight trained) chats alike on the devices and the CPU.
  r = run_rondo("train " + cfg.string() + " --set training.steps=3 --set training.method=full " +
                "--set output.run_dir=" + (dir / "full").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string chat =
      "chat " + (dir / "full").string() + " -n 8 < " + (dir / "in.txt").string();
  const Result full_cpu = run_rondo(chat + " --cpu", /*with_stderr=*/false);
  ASSERT_EQ(full_cpu.code, 0) << full_cpu.out;
  ASSERT_GT(full_cpu.out.size(), 2u);
  r = run_rondo(chat + " --sim 2", /*with_stderr=*/false);
  EXPECT_EQ(r.out, full_cpu.out);
  // A long generation whose KV caches would not fit beside the streamed weights keeps them in
  // host memory between tokens: the same tokens again.
  const std::string longer =
      "generate " + model.string() + " -p 'hello there' -n 300 --adapter " + (dir / "run").string();
  const Result cpu_long = run_rondo(longer + " --cpu", /*with_stderr=*/false);
  ASSERT_EQ(cpu_long.code, 0) << cpu_long.out;
  r = run_rondo(longer + " --sim 2 --sim-memory 180KB", /*with_stderr=*/false);
  EXPECT_EQ(r.out, cpu_long.out);
  r = run_rondo(longer + " --sim 2 --sim-memory 180KB");
  EXPECT_TRUE(contains(r.out, "KV caches in host memory")) << r.out;
  // Several prompts at once (--prompts): one batch on the devices, streamed, gives each prompt
  // what the CPU gives it alone.
  write(dir / "prompts.txt", "hello there\n\nwhat is up\nhi\n");
  const std::string batch = "generate " + model.string() + " -n 8 --prompts " +
                            (dir / "prompts.txt").string() + " --adapter " + (dir / "run").string();
  r = run_rondo(batch + " --sim 2 --sim-memory 150KB", /*with_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  std::istringstream lines(r.out);
  std::vector<json> got;
  for (std::string line; std::getline(lines, line);)
    got.push_back(json::parse(line));
  ASSERT_EQ(got.size(), 3u) << r.out;
  for (const json& g : got) {
    const Result alone =
        run_rondo("generate " + model.string() + " -n 8 --cpu --adapter " + (dir / "run").string() +
                      " -p '" + g["prompt"].get<std::string>() + "'",
                  /*with_stderr=*/false);
    EXPECT_EQ(g["text"].get<std::string>() + "\n", alone.out) << g.dump();
  }
  EXPECT_EQ(got[1]["prompt"], "what is up");
  r = run_rondo(batch + " --sim 2 --sim-memory 150KB");
  EXPECT_TRUE(contains(r.out, "3 prompts")) << r.out;
  r = run_rondo(gen + " --cpu --sim 2");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--cpu and --sim exclude each other")) << r.out;
  // Devices too small for two layers at once: refused before generating, saying what helps.
  r = run_rondo(gen + " --sim 2 --sim-memory 40KB");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "streaming puts two layers on a device at once")) << r.out;
  EXPECT_TRUE(contains(r.out, "--cpu")) << r.out;
}

// Left out, output.exports follows the method (a full run has no adapter: it used to fail its
// config check on the default); set, it is kept (and 'adapter' on a full run stays an error).
TEST_F(TrainCli, ExportsFollowTheMethodUnlessSet) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run"));
  Result r = run_rondo("train " + cfg.string() + " --dry-run");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "exports = [\"adapter\"]")) << r.out;
  r = run_rondo("train " + cfg.string() + " --dry-run --set training.method=full");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "exports = [\"merged\"]")) << r.out;
  r = run_rondo("train " + cfg.string() + " --dry-run --set training.method=full --set " +
                "'output.exports=[]'");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "exports = []")) << r.out;
  // A full run on a GGUF base is merged into a GGUF in the base's types.
  const rondo::cli::ConfigFile gguf = rondo::cli::read_config_text(
      "[model]\npath = \"base.gguf\"\n[training]\nmethod = \"full\"\n", "gguf.toml", {});
  EXPECT_EQ(gguf.config.output.exports, std::vector<std::string>{"gguf"});
  r = run_rondo("train " + cfg.string() +
                " --dry-run --set training.method=full --set 'output.exports=[\"adapter\"]'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "'adapter' needs training.method = lora")) << r.out;
  r = run_rondo("train " + cfg.string() +
                " --dry-run --set training.method=full --set 'output.exports=[\"gguf-adapter\"]'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "'gguf-adapter' needs training.method = lora")) << r.out;
  // An export the base cannot give is refused before training, not after it: a tokenizer whose
  // pre-tokenizer llama.cpp has no name for cannot go into a GGUF.
  const fs::path odd = dir / "odd-model";
  fs::copy(model, odd, fs::copy_options::recursive);
  json tok = json::parse(slurp(odd / "tokenizer.json"));
  tok["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Digits"}, {"individual_digits", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}}}}};
  write(odd / "tokenizer.json", tok.dump());
  r = run_rondo("train " + cfg.string() + " --dry-run --set model.path=" + odd.string() +
                " --set 'output.exports=[\"gguf\"]'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "convert_hf_to_gguf.py")) << r.out;
  EXPECT_FALSE(contains(r.out, "step 1")) << r.out;
}

}  // namespace

// In each dtype (bf16 and fp16 rebuild the streaming copies from the masters on resume; fp16 also
// carries its loss scale), and with LoRA dropout (its masks are drawn again, from the step).
TEST_F(TrainCli, SigkillAtARandomStepThenResumeIsBitIdentical) {
  std::mt19937 rng(std::random_device{}());
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    const std::string a_dir = std::string("a-") + dtype, b_dir = std::string("b-") + dtype;
    write(dir / "a.toml", config(a_dir, "", dtype));
    Result r = run_rondo("train " + (dir / "a.toml").string() + " --set lora.dropout=0.1");
    ASSERT_EQ(r.code, 0) << r.out;
    ASSERT_EQ(step_losses(dir / a_dir / "events.jsonl").size(), 12u);

    // Killed after a random step past the first checkpoint (step 3): SIGKILL, from inside the
    // process, as the step's event has been written.
    const int kill_at = std::uniform_int_distribution<int>(4, 11)(rng);
    SCOPED_TRACE(std::string(dtype) + ", killed after step " + std::to_string(kill_at));
    write(dir / "b.toml", config(b_dir, "", dtype));
    pid_t pid = spawn({"train", (dir / "b.toml").string(), "--set", "lora.dropout=0.1"},
                      dir / "b.log", {{"RONDO_FAULT_KILL_AFTER_STEP", std::to_string(kill_at)}});
    ASSERT_EQ(wait_for(pid), 128 + SIGKILL) << slurp(dir / "b.log");
    EXPECT_FALSE(fs::exists(dir / b_dir / "adapter"));
    r = run_rondo("train --resume " + (dir / b_dir).string());
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "Resuming from")) << r.out;

    expect_same_run(dir / a_dir, dir / b_dir);
    // The resumed run trained with the checkpoint's plan (the one the uninterrupted run used).
    std::set<std::string> plans;
    for (const fs::path& run : {dir / a_dir, dir / b_dir})
      for (const json& e : events(run / "events.jsonl"))
        if (e["type"] == "plan") plans.insert(e["plan"].get<std::string>());
    EXPECT_EQ(plans.size(), 1u);
  }
}

// training.optimizer = "adamw_8bit": a run killed after a random step and resumed ends bit for bit
// as the one that was not — losses and the last checkpoint, whose moments are 8-bit codes and
// absmax — for LoRA and full fine-tuning.
TEST_F(TrainCli, EightBitAdamWRunsResumeBitIdentically) {
  std::mt19937 rng(std::random_device{}());
  for (const std::string method : {"lora", "full"}) {
    const std::string a_dir = "a8-" + method, b_dir = "b8-" + method;
    const std::vector<std::string> sets = {"--set", "training.optimizer=adamw_8bit", "--set",
                                           "training.method=" + method};
    write(dir / "a.toml", config(a_dir));
    Result r = run_rondo("train " + (dir / "a.toml").string() + " " + sets[0] + " " + sets[1] +
                         " " + sets[2] + " " + sets[3]);
    ASSERT_EQ(r.code, 0) << r.out;
    const int kill_at = std::uniform_int_distribution<int>(4, 11)(rng);
    SCOPED_TRACE(method + ", killed after step " + std::to_string(kill_at));
    write(dir / "b.toml", config(b_dir));
    std::vector<std::string> args = {"train", (dir / "b.toml").string()};
    args.insert(args.end(), sets.begin(), sets.end());
    pid_t pid =
        spawn(args, dir / "b.log", {{"RONDO_FAULT_KILL_AFTER_STEP", std::to_string(kill_at)}});
    ASSERT_EQ(wait_for(pid), 128 + SIGKILL) << slurp(dir / "b.log");
    r = run_rondo("train --resume " + (dir / b_dir).string());
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(step_losses(dir / b_dir / "events.jsonl"), step_losses(dir / a_dir / "events.jsonl"));
    const fs::path last = fs::path("checkpoints") / "step-12" / "state.safetensors";
    const std::string a = slurp(dir / a_dir / last), b = slurp(dir / b_dir / last);
    ASSERT_FALSE(a.empty());
    EXPECT_NE(a.find(".exp_avg.codes"), std::string::npos) << "no 8-bit moments in the checkpoint";
    EXPECT_TRUE(a == b) << "the last checkpoints differ";
  }
}

TEST_F(TrainCli, SigkillInsideACheckpointWriteLeavesThePreviousOneUsable) {
  write(dir / "a.toml", config("a"));
  Result r = run_rondo("train " + (dir / "a.toml").string());
  ASSERT_EQ(r.code, 0) << r.out;
  // Killed while writing the checkpoint of step 6: its files are written under the temporary
  // name, not yet renamed.
  write(dir / "b.toml", config("b"));
  pid_t pid = spawn({"train", (dir / "b.toml").string()}, dir / "b.log",
                    {{"RONDO_FAULT_KILL_IN_CHECKPOINT", "6"}});
  ASSERT_EQ(wait_for(pid), 128 + SIGKILL) << slurp(dir / "b.log");
  EXPECT_TRUE(fs::exists(dir / "b" / "checkpoints" / "step-6.tmp"));
  EXPECT_FALSE(fs::exists(dir / "b" / "checkpoints" / "step-6"));
  r = run_rondo("train --resume " + (dir / "b").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "step-3")) << r.out;  // resumed from the previous one
  expect_same_run(dir / "a", dir / "b");
}

TEST_F(TrainCli, CtrlCFinishesTheStepCheckpointsAndResumesExactly) {
  const std::string extra_steps = "--set training.steps=400 --set checkpoint.every=100";
  write(dir / "a.toml", config("a"));
  Result r = run_rondo("train " + (dir / "a.toml").string() + " " + extra_steps);
  ASSERT_EQ(r.code, 0) << r.out;

  write(dir / "b.toml", config("b"));
  pid_t pid = spawn({"train", (dir / "b.toml").string(), "--set", "training.steps=400", "--set",
                     "checkpoint.every=100"},
                    dir / "b.log");
  // SIGINT once the run is training.
  const auto t0 = std::chrono::steady_clock::now();
  while (step_losses(dir / "b" / "events.jsonl").empty() &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(pid, SIGINT);
  ASSERT_EQ(wait_for(pid), 130) << slurp(dir / "b.log");
  std::vector<json> ev = events(dir / "b" / "events.jsonl");
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back()["type"], "run_end");
  EXPECT_EQ(ev.back()["status"], "stopped");
  const std::int64_t stopped_at = ev.back()["steps"];
  EXPECT_LT(stopped_at, 400);
  EXPECT_TRUE(fs::exists(dir / "b" / "checkpoints" / ("step-" + std::to_string(stopped_at))));
  EXPECT_TRUE(contains(slurp(dir / "b.log"), "rondo train --resume")) << slurp(dir / "b.log");

  r = run_rondo("train --resume " + (dir / "b").string());
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_run(dir / "a", dir / "b");
}

TEST_F(TrainCli, AResumeBeforeTheFirstCheckpointStartsAgain) {
  write(dir / "a.toml", config("a"));
  Result r = run_rondo("train " + (dir / "a.toml").string());
  ASSERT_EQ(r.code, 0) << r.out;
  write(dir / "b.toml", config("b"));
  pid_t pid = spawn({"train", (dir / "b.toml").string()}, dir / "b.log",
                    {{"RONDO_FAULT_KILL_AFTER_STEP", "2"}});  // the first checkpoint is at 3
  ASSERT_EQ(wait_for(pid), 128 + SIGKILL) << slurp(dir / "b.log");
  r = run_rondo("train --resume " + (dir / "b").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "starting again from step 0")) << r.out;
  expect_same_run(dir / "a", dir / "b");
}

TEST_F(TrainCli, ASecondCtrlCExitsAtOnce) {
  // Long steps (64 rows of 512 tokens), so that the second Ctrl-C lands inside the step the first
  // one lets finish. Two signals sent at once would merge into one: the second waits until the
  // first was handled.
  write(dir / "c.toml", config("run"));
  pid_t pid = spawn({"train", (dir / "c.toml").string(), "--set", "training.steps=100000", "--set",
                     "data.seq_len=512", "--set", "training.batch_rows=64"},
                    dir / "log");
  const auto t0 = std::chrono::steady_clock::now();
  while (step_losses(dir / "run" / "events.jsonl").empty() &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(pid, SIGINT);
  while (!contains(slurp(dir / "log"), "Ctrl-C again to exit at once") &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ::kill(pid, SIGINT);
  ASSERT_EQ(wait_for(pid), 130) << slurp(dir / "log");
  // It did not wait to finish the step and checkpoint; it wrote the run's end, "interrupted" at
  // the last step done (before, there was no run_end at all).
  std::vector<json> ev = events(dir / "run" / "events.jsonl");
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back()["type"], "run_end") << slurp(dir / "log");
  EXPECT_EQ(ev.back()["status"], "interrupted") << slurp(dir / "log");
  const std::map<std::int64_t, double> losses = step_losses(dir / "run" / "events.jsonl");
  ASSERT_FALSE(losses.empty());
  EXPECT_EQ(ev.back()["steps"], losses.rbegin()->first);
  EXPECT_TRUE(contains(slurp(dir / "log"), "exiting at once")) << slurp(dir / "log");
}

// SIGTERM (a service manager, `kill`) stops like Ctrl-C, with the convention's exit code: 128 + 15.
TEST_F(TrainCli, SigtermStopsAfterACheckpointWithExitCode143) {
  write(dir / "c.toml", config("run"));
  pid_t pid =
      spawn({"train", (dir / "c.toml").string(), "--set", "training.steps=400"}, dir / "log");
  const auto t0 = std::chrono::steady_clock::now();
  while (step_losses(dir / "run" / "events.jsonl").empty() &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(pid, SIGTERM);
  ASSERT_EQ(wait_for(pid), 128 + SIGTERM) << slurp(dir / "log");
  std::vector<json> ev = events(dir / "run" / "events.jsonl");
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back()["type"], "run_end");
  EXPECT_EQ(ev.back()["status"], "stopped");
  const std::int64_t stopped_at = ev.back()["steps"];
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / ("step-" + std::to_string(stopped_at))));
}

TEST_F(TrainCli, ResumeAndExportNameWhatIsMissing) {
  Result r = run_rondo("train --resume " + (dir / "nothing").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, (dir / "nothing").string() + ": not a run folder")) << r.out;
  write(dir / "c.toml", config("run"));
  r = run_rondo("train " + (dir / "c.toml").string() + " --set training.steps=4");
  ASSERT_EQ(r.code, 0) << r.out;
  // Starting again into the same folder would mix two runs.
  r = run_rondo("train " + (dir / "c.toml").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "already holds a run")) << r.out;
  r = run_rondo("export " + (dir / "run").string() + " --checkpoint step-99");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "no checkpoint step-99 (it has: step-3, step-4)")) << r.out;
}

// Only a folder Rondo made is a run. A model folder (or $HOME, or an empty folder) given to
// --resume is "not a run folder"; before, the advice was to start a run there, and following it
// wrote checkpoints, an adapter and events beside model.safetensors. A new run into a folder
// holding files Rondo did not make is refused and leaves it as it was.
TEST_F(TrainCli, OnlyAFolderRondoMadeIsARun) {
  const fs::path other = dir / "models-folder";
  fs::create_directories(other);
  write(other / "model.safetensors", "weights");
  write(other / "notes.txt", "mine");
  Result r = run_rondo("train --resume " + other.string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, other.string() + ": not a run folder")) << r.out;
  EXPECT_FALSE(contains(r.out, "never started")) << r.out;
  write(dir / "c.toml", config("run"));
  r = run_rondo("train " + (dir / "c.toml").string() + " --run-dir " + other.string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, other.string() +
                                  ": holds files Rondo did not make (model.safetensors and "
                                  "notes.txt)"))
      << r.out;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(other))
    left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"model.safetensors", "notes.txt"}));
  // An empty folder: not a run to resume (nothing says Rondo made it), but a new run may use it.
  const fs::path empty = dir / "empty";
  fs::create_directories(empty);
  r = run_rondo("train --resume " + empty.string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, empty.string() + ": not a run folder")) << r.out;
  r = run_rondo("train " + (dir / "c.toml").string() + " --run-dir " + empty.string() +
                " --set training.steps=2");
  EXPECT_EQ(r.code, 0) << r.out;
}

// A resume takes --set for settings that do not change the training (where state lives, budgets,
// devices, distributed.*, checkpoint.keep: an NVMe error's advice is "choose another
// hardware.offload_dir"), keeps them in config.toml for later resumes, and trains exactly as
// before; anything else is refused, named (before: every override was refused).
TEST_F(TrainCli, AResumeTakesSettingsThatDoNotChangeTheTraining) {
  write(dir / "a.toml", config("a"));
  Result r = run_rondo("train " + (dir / "a.toml").string());
  ASSERT_EQ(r.code, 0) << r.out;
  write(dir / "b.toml", config("b"));
  pid_t pid = spawn({"train", (dir / "b.toml").string()}, dir / "b.log",
                    {{"RONDO_FAULT_KILL_AFTER_STEP", "7"}});
  ASSERT_EQ(wait_for(pid), 128 + SIGKILL) << slurp(dir / "b.log");
  const std::string b = (dir / "b").string();
  r = run_rondo("train --resume " + b + " --set training.lr=0.1 --set hardware.sim_devices=1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "training.lr changes the training: leave it out")) << r.out;
  EXPECT_TRUE(contains(r.out,
                       "hardware.* (where state lives, memory budgets, devices, I/O), "
                       "distributed.* and checkpoint.keep"))
      << r.out;
  fs::create_directories(dir / "offload");
  r = run_rondo("train --resume " + b + " --set checkpoint.keep=1 --set hardware.offload_dir=" +
                (dir / "offload").string() + " --set distributed.timeout=900");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_run(dir / "a", dir / "b");
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir / "b" / "checkpoints"))
    left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"step-12"});
  const std::string kept = slurp(dir / "b" / "config.toml");
  EXPECT_TRUE(contains(kept, "keep = 1")) << kept;
  EXPECT_TRUE(contains(kept, "offload_dir = \"" + (dir / "offload").string() + "\"")) << kept;
  EXPECT_TRUE(contains(kept, "timeout = 900")) << kept;
}

// What runs measure corrects the speed cache: a figure cached from a bad moment (here: every
// figure made 1000 times slower, as a probe while other jobs kept the cores busy might leave it)
// made the plan far off; the run says so and forgets this machine's figures, and the next plan
// measures them again (before, the bad figures stayed for every later plan).
TEST_F(TrainCli, ARunFarFromItsPlanMakesTheNextPlanMeasureAgain) {
  const fs::path cache = dir / "speed-cache";
  const std::string env = "RONDO_SPEED_CACHE=" + cache.string();
  write(dir / "c.toml", config("run"));
  Result r = run_rondo("plan " + (dir / "c.toml").string() + " --json", false, env);
  ASSERT_EQ(r.code, 0) << r.out;
  const double planned = json::parse(r.out)["step_seconds"];
  int poisoned = 0;
  for (const auto& e : fs::directory_iterator(cache)) {
    if (e.path().extension() != ".json") continue;
    json j = json::parse(slurp(e.path()));
    j["value"] = j["value"].get<double>() / 1000;
    j["busy"] = 0;
    write(e.path(), j.dump());
    ++poisoned;
  }
  ASSERT_GE(poisoned, 2);
  r = run_rondo("plan " + (dir / "c.toml").string() + " --json", false, env);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_GT(json::parse(r.out)["step_seconds"].get<double>(), 100 * planned);
  r = run_rondo("train " + (dir / "c.toml").string(), true, env);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "faster); the ETA follows the measured steps")) << r.out;
  EXPECT_TRUE(contains(r.out, "cached speed figures are forgotten")) << r.out;
  int left = 0;
  for (const auto& e : fs::directory_iterator(cache))
    left += e.path().extension() == ".json";
  EXPECT_EQ(left, 0);
  r = run_rondo("plan " + (dir / "c.toml").string() + " --json", false, env);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_LT(json::parse(r.out)["step_seconds"].get<double>(), 10 * planned);
}

// A write that fails at the end of a run says what is safe and what continues: the training is
// complete and saved in its last checkpoint, and `rondo export` writes the export from there
// (before: only "cannot write ...model.safetensors.tmp.N: File too large"). The failure is a
// real one: the process may write no file larger than 80 KiB (RLIMIT_FSIZE), which the
// checkpoints (60 KB) pass and the merged model (103 KB) does not. And the plan's disk estimate
// rounds up: what the run wrote is at most what it said (before: 224,128 bytes said, 228,042
// written).
TEST_F(TrainCli, AFailedExportSaysTheTrainingIsSavedAndHowToExportIt) {
  write(dir / "c.toml", config("run", "exports = [\"adapter\", \"merged\"]\n"));
  Result plan = run_rondo("plan " + (dir / "c.toml").string() + " --json", false);
  ASSERT_EQ(plan.code, 0) << plan.out;
  const std::uint64_t said = json::parse(plan.out)["disk"]["needed_bytes"];
  pid_t pid = spawn({"train", (dir / "c.toml").string()}, dir / "log", {}, [] {
    const rlimit limit{80 << 10, 80 << 10};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    ::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead
  });
  EXPECT_EQ(wait_for(pid), 1) << slurp(dir / "log");
  const std::string out = slurp(dir / "log");
  const std::string last = (dir / "run" / "checkpoints" / "step-12").string();
  EXPECT_TRUE(contains(out, "exporting merged to " + (dir / "run" / "merged").string() + ": "))
      << out;
  EXPECT_TRUE(contains(out, "The training is complete and saved in " + last +
                                ": once there is room, `rondo export " + (dir / "run").string() +
                                " --format merged` writes it from there"))
      << out;
  // A checkpoint that cannot be written says what a resume does: here none was written before.
  pid = spawn({"train", (dir / "c.toml").string(), "--run-dir", (dir / "run2").string()},
              dir / "log2", {}, [] {
                const rlimit limit{40 << 10, 40 << 10};
                ::setrlimit(RLIMIT_FSIZE, &limit);
                ::signal(SIGXFSZ, SIG_IGN);
              });
  EXPECT_EQ(wait_for(pid), 1) << slurp(dir / "log2");
  EXPECT_TRUE(contains(slurp(dir / "log2"), "saving the checkpoint of step 3: "))
      << slurp(dir / "log2");
  EXPECT_TRUE(contains(slurp(dir / "log2"),
                       "No checkpoint was written before it: once there is room (or the fault is "
                       "fixed), `rondo train --resume " +
                           (dir / "run2").string() + "` starts the run again from step 0"))
      << slurp(dir / "log2");

  Result r = run_rondo("export " + (dir / "run").string() + " --format merged");
  ASSERT_EQ(r.code, 0) << r.out;
  // Checkpoints, the adapter and the merged export (written by `rondo export` into its own
  // folder; the failed one's folder is left out), config.toml.
  std::uint64_t written = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir / "run")) {
    const std::string rel = fs::relative(e.path(), dir / "run").string();
    if (e.is_regular_file() && !rel.starts_with("merged/") && rel != "events.jsonl")
      written += e.file_size();
  }
  EXPECT_GE(said, written);
}

// `rondo export` from the last checkpoint equals the run's own exports, byte for byte, in each
// dtype (the merged base is the one the run streamed); a merged one says, a tenth at a time, how
// much it has written (the GUI's export dialog draws its bar from it).
TEST_F(TrainCli, ExportOfTheLastCheckpointIsTheRunsAdapter) {
  for (const char* dtype : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(dtype);
    const std::string run = std::string("run-") + dtype;
    write(dir / "c.toml", config(run, "", dtype));
    Result r = run_rondo("train " + (dir / "c.toml").string() +
                         " --set 'output.exports=[\"adapter\",\"merged\"]'");
    ASSERT_EQ(r.code, 0) << r.out;
    r = run_rondo("export " + (dir / run).string() + " --out " + (dir / (run + "-x")).string());
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(slurp(dir / run / "adapter" / "adapter_model.safetensors") ==
                slurp(dir / (run + "-x") / "adapter_model.safetensors"));
    r = run_rondo("export " + (dir / run).string() +
                  " --format merged --checkpoint step-12 --out " + (dir / (run + "-m")).string());
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string merged = slurp(dir / run / "merged" / "model.safetensors");
    ASSERT_FALSE(merged.empty());
    EXPECT_TRUE(merged == slurp(dir / (run + "-m") / "model.safetensors"));
    // A line per tenth reached as each of the model's layers (embedding, blocks, head) is asked
    // for, then 100% once the file is written.
    const std::string writing =
        "rondo: writing " + (dir / (run + "-m") / "model.safetensors").string() + ": ";
    const int layers =
        json::parse(slurp(model / "config.json"))["num_hidden_layers"].get<int>() + 2;
    std::string lines;
    for (int l = 0, shown = -1; l < layers; ++l)
      if (l * 10 / layers != shown) {
        shown = l * 10 / layers;
        lines += writing + std::to_string(shown * 10) + "%\n";
      }
    EXPECT_TRUE(contains(r.out, lines + writing + "100%\nrondo: exported ")) << r.out;
    EXPECT_TRUE(fs::exists(dir / (run + "-m") / "tokenizer.json"));
  }
}

// LoRA on the tiny model memorises the 12 replies: the training loss ends far below the entropy
// of the trained tokens' unigram distribution — the least loss any model that ignores context can
// reach — computed here from the data through the same chat template and tokenizer.
// Validation loss and samples run through the engine on the run's devices: on two simulated
// devices they equal the CPU device's before training (the same weights: the loss within 1e-6,
// the same greedy samples, several prompts generated together), and again after training.
TEST_F(TrainCli, ValidationAndSamplesOnTheDevicesMatchTheCpu) {
  write(dir / "c.toml", config("run"));
  const std::string common =
      " --set training.steps=2 --set checkpoint.every=0 --set eval.every=2"
      " --set eval.sample_every=2 --set data.validation_split=0.25 --set eval.sample_tokens=6"
      " --set 'eval.prompts=[\"sky?\", \"2+2?\", \"what does the cat say?\"]'";
  struct Seen {
    std::map<std::int64_t, double> eval;
    std::map<std::int64_t, std::vector<std::string>> samples;
  };
  auto run = [&](const std::string& name, int sim_devices) {
    Result r = run_rondo("train " + (dir / "c.toml").string() + common +
                         " --set output.run_dir='\"" + (dir / name).string() + "\"'" +
                         " --set hardware.sim_devices=" + std::to_string(sim_devices));
    EXPECT_EQ(r.code, 0) << r.out;
    Seen seen;
    for (const json& e : events(dir / name / "events.jsonl")) {
      if (e["type"] == "eval") seen.eval[e["step"]] = e["loss"];
      if (e["type"] == "sample") seen.samples[e["step"]].push_back(e["text"]);
    }
    return seen;
  };
  const Seen devices = run("devices", 2), cpu = run("cpu", 0);
  for (const Seen* s : {&devices, &cpu}) {
    ASSERT_EQ(s->eval.size(), 2u);
    ASSERT_EQ(s->samples.size(), 2u);
    EXPECT_EQ(s->samples.at(0).size(), 3u);
  }
  EXPECT_NEAR(devices.eval.at(0), cpu.eval.at(0), 1e-6 * cpu.eval.at(0));
  EXPECT_EQ(devices.samples.at(0), cpu.samples.at(0));
  // After two steps the plans' roundings differ a little; the samples and loss hardly.
  EXPECT_NEAR(devices.eval.at(2), cpu.eval.at(2), 1e-4 * cpu.eval.at(2));
  EXPECT_NE(devices.eval.at(2), devices.eval.at(0)) << "training did not change the loss";
  std::string all;
  for (const std::string& t : devices.samples.at(0))
    all += t;
  EXPECT_FALSE(all.empty()) << "every sample was empty: the comparison says little";
}

TEST_F(TrainCli, LoraMemorisesASmallDataset) {
  rondo::models::Tokenizer tok = rondo::test::tiny_tokenizer();
  rondo::models::ChatTemplate tmpl = rondo::models::chat_template_from_name("chatml");
  std::map<std::int32_t, double> counts;
  double n = 0;
  for (auto& [q, a] : kQa) {
    rondo::models::RenderedChat rc =
        rondo::models::render_chat(tok, tmpl, {{"user", q}, {"assistant", a}});
    for (std::size_t t = 1; t < rc.ids.size(); ++t)  // the first token is never a target
      if (rc.loss_mask[t]) {
        counts[rc.ids[t]] += 1;
        n += 1;
      }
  }
  double entropy = 0;
  for (auto& [id, c] : counts)
    entropy -= c / n * std::log(c / n);
  ASSERT_GT(entropy, 1.5);

  write(dir / "c.toml", config("run"));
  Result r = run_rondo("train " + (dir / "c.toml").string() +
                       " --set training.steps=150 --set lora.rank=8 --set training.grad_accum=1 "
                       "--set checkpoint.every=0 --set training.lr=0.02");
  ASSERT_EQ(r.code, 0) << r.out;
  std::map<std::int64_t, double> losses = step_losses(dir / "run" / "events.jsonl");
  ASSERT_EQ(losses.size(), 150u);
  double last = 0;
  for (std::int64_t s = 146; s <= 150; ++s)
    last += losses.at(s) / 5;
  EXPECT_GT(losses.at(1), entropy) << "an untrained model should do worse than the unigrams";
  EXPECT_LT(last, entropy / 4) << "first loss " << losses.at(1) << ", unigram entropy " << entropy;
}

TEST_F(TrainCli, DataShowsWhatTrainingSees) {
  Result r = run_rondo("data " + data.string() + " --model " + model.string() + " --example 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "12 examples (chat)")) << r.out;
  // The reply (and its end-of-turn marker) is trained; the prompt is not.
  EXPECT_TRUE(contains(r.out, "2+2?<|im_end|>")) << r.out;
  EXPECT_TRUE(contains(r.out, "[[four<|im_end|>]]")) << r.out;
  r = run_rondo("data " + data.string() + " --model " + model.string() + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["format"], "chat");
  EXPECT_EQ(j["examples"], 12);
  std::string trained;
  for (const json& p : j["example"]["pieces"])
    if (p["trained"]) trained += p["text"].get<std::string>();
  EXPECT_EQ(trained, "hello there<|im_end|>");
  EXPECT_EQ(j["example"]["cut"], false);
  // A long example is cut, saying so (before: printed whole, 16 MB for a long line).
  std::string words;
  for (int k = 0; k < 4000; ++k)
    words += "word" + std::to_string(k) + " ";
  write(dir / "long.jsonl", json{{"text", words}}.dump() + "\n");
  r = run_rondo("data " + (dir / "long.jsonl").string() + " --model " + model.string() +
                " --format text");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_LT(r.out.size(), 12000u);
  EXPECT_TRUE(contains(r.out, "... (cut: the example has ")) << r.out;
  EXPECT_TRUE(contains(r.out, "its first 8 KiB of text are shown")) << r.out;
  r = run_rondo("data " + (dir / "long.jsonl").string() + " --model " + model.string() +
                " --format text --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out)["example"]["cut"], true);
  r = run_rondo("data " + data.string() + " --model " + model.string() + " --example 12");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--example 12: " + data.string() + " has 12 examples")) << r.out;
}

TEST_F(TrainCli, PlanJsonGivesTheVerdictAndTheFigures) {
  write(dir / "c.toml", config("run"));
  Result r = run_rondo("plan " + (dir / "c.toml").string() + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  json j = json::parse(r.out);
  EXPECT_EQ(j["verdict"], "fits");
  EXPECT_EQ(j["devices"].size(), 2u);
  EXPECT_EQ(j["steps"], 12);
  EXPECT_EQ(j["tokens_per_step"], 64 * 2 * 2);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
  r = run_rondo("plan " + (dir / "c.toml").string() + " --json --set hardware.host_memory=64KB");
  ASSERT_EQ(r.code, 3) << r.out;
  j = json::parse(r.out);
  EXPECT_EQ(j["verdict"], "does not fit");
  ASSERT_EQ(j["problems"].size(), 1u);
  EXPECT_TRUE(contains(j["problems"][0], "host memory")) << r.out;
}

TEST_F(TrainCli, EventsGoToStdoutWithEventsDash) {
  write(dir / "c.toml", config("run"));
  const Result r =
      run_rondo("train " + (dir / "c.toml").string() + " --set training.steps=3 --events -",
                /*with_stderr=*/false);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string out = r.out;
  std::istringstream lines(out);
  std::string line;
  std::vector<std::string> types;
  json last_load;
  while (std::getline(lines, line)) {
    const json e = json::parse(line);  // every stdout line is an event
    types.push_back(e["type"]);
    if (e["type"] == "load") {
      EXPECT_TRUE(std::count(types.begin(), types.end(), "step") == 0) << "load after a step";
      last_load = e;
    }
  }
  ASSERT_FALSE(types.empty());
  EXPECT_EQ(types.front(), "run_start");
  // Loading ends with every layer in (the tiny model: embedding, 2 blocks, head).
  EXPECT_EQ(last_load, (json{{"v", 1},
                             {"type", "load"},
                             {"t", last_load["t"]},
                             {"time", last_load["time"]},
                             {"layers_done", 4},
                             {"layers_total", 4}}))
      << last_load.dump();
  EXPECT_EQ(std::count(types.begin(), types.end(), "step"), 3);
  EXPECT_EQ(types.back(), "run_end");
  EXPECT_FALSE(fs::exists(dir / "run" / "events.jsonl"));
}

// A resume trains with the plan its checkpoint holds, not one the planner makes again (which
// could differ and round differently): here the checkpoint's plan is replaced by another valid
// one — the whole model in the fused tail — and the resumed run uses it.
TEST_F(TrainCli, AResumeUsesTheCheckpointsPlan) {
  write(dir / "c.toml", config("run"));
  pid_t pid = spawn({"train", (dir / "c.toml").string()}, dir / "log",
                    {{"RONDO_FAULT_KILL_AFTER_STEP", "4"}});
  ASSERT_EQ(wait_for(pid), 128 + SIGKILL) << slurp(dir / "log");
  const fs::path state = dir / "run" / "checkpoints" / "step-3" / "state.json";
  json j = json::parse(slurp(state));
  ASSERT_TRUE(j["meta"].contains("plan")) << j.dump();
  const std::string planned = j["meta"]["plan"]["describe"];
  j["meta"]["plan"]["forward"] = json::array();
  j["meta"]["plan"]["backward"] = json::array();
  j["meta"]["plan"]["tail"] = {0, 4};
  ASSERT_NE(planned, "T[0,4) M=2 stage");
  // Sealed again as write_checkpoint seals it (XXH3-64 of meta's compact JSON), so that the edit
  // passes the checks a resume makes and the plan is what differs.
  const std::string text = j["meta"].dump();
  j["meta_xxh3_64"] = rondo::kernels::hex64(rondo::kernels::xxh3(text.data(), text.size()));
  write(state, j.dump());
  Result r = run_rondo("train --resume " + (dir / "run").string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<std::string> plans;
  for (const json& e : events(dir / "run" / "events.jsonl"))
    if (e["type"] == "plan") plans.push_back(e["plan"]);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0], planned);
  EXPECT_EQ(plans[1], "T[0,4) M=2 stage");
}
