// The fixture of the `rondo train` CLI tests: a tiny model folder, a small chat dataset and a
// config for a short LoRA run on two simulated devices, in a folder of the test's own; starting
// rondo in the background and comparing two runs.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "../support/tiny_model_folder.h"
#include "run_files.h"
#include "run_rondo.h"

namespace rondo::test {

namespace fs = std::filesystem;

inline void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

// Two runs ended alike: the same loss at every step, and the same final adapter bytes.
inline void expect_same_run(const fs::path& a, const fs::path& b) {
  EXPECT_EQ(step_losses(b / "events.jsonl"), step_losses(a / "events.jsonl"));
  const std::string adapter = slurp(a / "adapter" / "adapter_model.safetensors");
  EXPECT_FALSE(adapter.empty());
  EXPECT_TRUE(adapter == slurp(b / "adapter" / "adapter_model.safetensors"))
      << "the final adapters differ";
}

inline const std::vector<std::pair<std::string, std::string>> kQa = {
    {"hi", "hello there"}, {"2+2?", "four"},      {"sky?", "blue"},   {"grass?", "green"},
    {"cat says?", "meow"}, {"dog says?", "woof"}, {"snow?", "white"}, {"night?", "dark"},
    {"sun?", "hot"},       {"ice?", "cold"},      {"fire?", "warm"},  {"sea?", "salty"},
};

struct TrainFixture : ::testing::Test {
  fs::path dir;
  fs::path model, data;
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("rondo-train-test-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    model = dir / "model";
    rondo::test::write_tiny_model_folder(model.string());
    data = dir / "train.jsonl";
    std::string lines;
    for (auto& [q, a] : kQa)
      lines += nlohmann::json{{"messages",
                               {{{"role", "user"}, {"content", q}},
                                {{"role", "assistant"}, {"content", a}}}}}
                   .dump() +
               "\n";
    write(data, lines);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);
  }
  // A config for a short LoRA run on two simulated devices.
  std::string config(const std::string& run, const std::string& extra = "",
                     const std::string& dtype = "fp32") const {
    return "[model]\npath = \"" + model.string() + "\"\ndtype = \"" + dtype + "\"\n" +
           "[data]\ntrain = \"" + data.string() + "\"\nseq_len = 64\n" +
           "[lora]\nrank = 4\nalpha = 8\n" +
           "[training]\nsteps = 12\nbatch_rows = 2\ngrad_accum = 2\nlr = 1e-2\nseed = 3\n"
           "warmup_steps = 2\n" +
           "[checkpoint]\nevery = 3\nkeep = 0\n" + "[hardware]\nsim_devices = 2\n" +
           "[output]\nrun_dir = \"" + (dir / run).string() + "\"\n" + extra;
  }
};

inline  // Starts rondo in the background, its output to `log`.
    pid_t
    spawn(const std::vector<std::string>& args, const fs::path& log,
          const std::vector<std::pair<std::string, std::string>>& env = {},
          const std::function<void()>& before_exec = {}) {
  pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    if (!f || ::dup2(::fileno(stdout), STDERR_FILENO) < 0) ::_exit(127);
    for (auto& [k, v] : env)
      ::setenv(k.c_str(), v.c_str(), 1);
    if (before_exec) before_exec();
    std::vector<char*> argv;
    std::string bin = RONDO_BIN;
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy)
      argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// Waits for the child; returns its exit code, or 128 + the signal that killed it.
inline int wait_for(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace rondo::test
