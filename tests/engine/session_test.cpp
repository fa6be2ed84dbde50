// engine::Session's checks before it allocates: disk and host memory against the estimate, with
// the OS's figures replaced by the test's (SessionOptions::disk_free / host_free); and the
// deterministic-kernels switch of exact runs; the fault points a run reports to its caller; engine
// errors in a run's words (the config keys that change them).
#include "engine/session.h"

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "kernels/error.h"
#include "tests/support/tiny_model_folder.h"

namespace fs = std::filesystem;

namespace rondo::engine {
namespace {

struct SessionChecks : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("rondo-session-test-" + std::to_string(::getpid()));
  TrainConfig c;
  void SetUp() override {
    fs::create_directories(dir);
    test::write_tiny_model_folder((dir / "model").string());
    std::ofstream(dir / "d.jsonl") << "{\"text\": \"one two three\"}\n{\"text\": \"four five\"}\n";
    c.model.path = (dir / "model").string();
    c.model.dtype = "fp32";
    c.data.train = (dir / "d.jsonl").string();
    c.data.seq_len = 32;
    c.training.steps = 4;
    c.output.run_dir = (dir / "run").string();
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string error_of(const SessionOptions& o) {
    try {
      Session s(c, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(SessionChecks, NotEnoughDiskNamesTheFolderAndWhatToChange) {
  const std::string e = error_of({.disk_free = 1000});
  EXPECT_NE(e.find("disk: checkpoints and exports need about"), std::string::npos) << e;
  EXPECT_NE(e.find("1000 B is free under " + c.output.run_dir), std::string::npos) << e;
  EXPECT_NE(e.find("checkpoint.keep"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "run"));
  EXPECT_EQ(error_of({.disk_free = 1ull << 40}), "");
}

// A run folder nothing can be written to is named as such, not as a full disk ("0 B is free ...
// lower checkpoint.keep" before): under /proc (a virtual file system), or under a file.
TEST_F(SessionChecks, ARunFolderThatCannotBeWrittenIsNamed) {
  c.output.run_dir = "/proc/rondo-run";
  std::string e = error_of({});
  EXPECT_NE(e.find("output.run_dir: cannot write the run folder /proc/rondo-run (/proc is on a "
                   "virtual file system"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("checkpoint.keep"), std::string::npos) << e;
  c.output.run_dir = (dir / "d.jsonl" / "run").string();
  e = error_of({.disk_free = 1ull << 40});
  EXPECT_NE(e.find((dir / "d.jsonl").string() + " is not a folder"), std::string::npos) << e;
}

TEST_F(SessionChecks, NotEnoughHostMemorySaysWhatToChangeForFullFineTuning) {
  c.training.method = "full";
  c.output.exports = {"merged"};
  const std::string e = error_of({.host_free = 4096});
  EXPECT_NE(e.find("host memory: the run needs about"), std::string::npos) << e;
  EXPECT_NE(e.find("training.method = lora"), std::string::npos) << e;
  // `rondo plan` reports it instead of throwing.
  Session s(c, {.plan_only = true, .host_free = 4096});
  EXPECT_FALSE(s.fits());
  EXPECT_NE(s.describe().find("Verdict     does not fit"), std::string::npos) << s.describe();
}

// training.deterministic (on by default) turns on torch's deterministic algorithms and cuBLAS's
// fixed workspace for the run, before any GPU work; off, it leaves them off.
TEST_F(SessionChecks, ExactRunsTurnOnDeterministicKernels) {
  c.training.steps = 1;
  c.output.exports = {};
  at::globalContext().setDeterministicAlgorithms(false, false);
  ::unsetenv("CUBLAS_WORKSPACE_CONFIG");
  ASSERT_TRUE(c.training.deterministic);
  Session(c, {}).run();
  EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  // Strict, not warn-only: under warn-only torch's flash and memory-efficient attention
  // backwards keep their non-deterministic algorithms.
  EXPECT_FALSE(at::globalContext().deterministicAlgorithmsWarnOnly());
  ASSERT_NE(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");

  fs::remove_all(dir / "run");
  c.training.deterministic = false;
  Session(c, {}).run();
  EXPECT_FALSE(at::globalContext().deterministicAlgorithms());
}

// The run reports its fault points to SessionOptions::on_fault_point (the CLI's
// RONDO_FAULT_KILL_* kill the process there, cli/test_faults.cpp): after each step's event, and
// inside each checkpoint write once its files are complete under the temporary name.
TEST_F(SessionChecks, FaultPointsComeAfterEachStepAndInsideEachCheckpoint) {
  c.training.steps = 4;
  c.checkpoint.every = 2;
  c.output.exports = {};
  std::vector<std::pair<FaultPoint, std::int64_t>> calls;
  SessionOptions o;
  o.on_fault_point = [&](FaultPoint point, std::int64_t step) {
    calls.emplace_back(point, step);
    if (point != FaultPoint::kInCheckpoint) return;
    const fs::path ckpt =
        fs::path(c.output.run_dir) / "checkpoints" / ("step-" + std::to_string(step));
    EXPECT_TRUE(fs::exists(ckpt.string() + ".tmp/state.json")) << step;
    EXPECT_FALSE(fs::exists(ckpt)) << step;
  };
  Session(c, o).run();
  using P = FaultPoint;
  const std::vector<std::pair<FaultPoint, std::int64_t>> want = {
      {P::kAfterStep, 1}, {P::kAfterStep, 2}, {P::kInCheckpoint, 2},
      {P::kAfterStep, 3}, {P::kAfterStep, 4}, {P::kInCheckpoint, 4}};
  EXPECT_EQ(calls, want);
}

}  // namespace
}  // namespace rondo::engine

namespace rondo::engine {
namespace {

std::string message_of(std::exception_ptr e) {
  try {
    rethrow_with_settings(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return "";
}

// The engine says what ran out in its own terms; the session adds the config keys that change it.
TEST(SessionAdvice, EngineErrorsGetTheSettingsThatChangeThem) {
  const std::string torch = message_of(std::make_exception_ptr(DeviceMemoryError(
      "step 3, job T (layers 4-7) on sim0: out of GPU memory in torch's allocations",
      DeviceMemoryError::Whose::kTorch)));
  EXPECT_EQ(torch.find("step 3, job T (layers 4-7) on sim0: out of GPU memory"), 0u) << torch;
  for (const char* key :
       {"training.batch_rows", "training.grad_accum", "data.seq_len", "hardware.memory_cap"})
    EXPECT_NE(torch.find(key), std::string::npos) << key << ": " << torch;
  const std::string ours = message_of(std::make_exception_ptr(
      DeviceMemoryError("step 1, job F0 (layers 0-1) on sim1: out of memory on sim1",
                        DeviceMemoryError::Whose::kEngineBuffers)));
  EXPECT_NE(ours.find("training.grad_accum"), std::string::npos) << ours;
  EXPECT_NE(ours.find("hardware.memory_cap"), std::string::npos) << ours;
  const std::string exact = message_of(std::make_exception_ptr(
      NondeterministicOpError("step 2, job B1 (layers 0-3) on cuda0: index_add_cuda_ does not have "
                              "a deterministic implementation")));
  EXPECT_NE(exact.find("training.deterministic = false"), std::string::npos) << exact;
  // Anything else goes through as it is.
  EXPECT_EQ(message_of(std::make_exception_ptr(Error("a bad token id"))), "a bad token id");
}

}  // namespace
}  // namespace rondo::engine
