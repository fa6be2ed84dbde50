// Runs the real `rondo` binary and checks what a user would read.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdio>
#include <string>

#include "kernels/cuda/cuda_device.h"
#include "run_rondo.h"

namespace {

using rondo::test::contains;
using rondo::test::Result;

Result run(const std::string& args) {
  return rondo::test::run_rondo(args);
}

TEST(Cli, VersionNamesRondoAndTorch) {
  Result r = run("--version");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "rondo 0.")) << r.out;
  EXPECT_TRUE(contains(r.out, "libtorch 2.")) << r.out;
}

TEST(Cli, HelpListsTheSubcommands) {
  Result r = run("--help");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "devices")) << r.out;
}

TEST(Cli, DevicesSaysWhatItWillUse) {
  rondo::kernels::CudaProbe probe = rondo::kernels::probe_cuda();
  Result r = run("devices");
  EXPECT_EQ(r.code, 0) << r.out;
  if (probe.devices.empty()) {
    EXPECT_TRUE(contains(r.out, "No CUDA GPU is present")) << r.out;
    EXPECT_TRUE(contains(r.out, probe.error)) << r.out;  // the reason, as CUDA gave it
    EXPECT_TRUE(contains(r.out, "use the CPU instead")) << r.out;
  } else {
    for (const auto& d : probe.devices)
      EXPECT_TRUE(contains(r.out, d.name)) << r.out;
  }
}

TEST(Cli, DevicesJsonMatchesTheProbe) {
  rondo::kernels::CudaProbe probe = rondo::kernels::probe_cuda();
  Result r = run("devices --json --memory-cap 1GB");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  if (probe.devices.empty()) {
    EXPECT_EQ(j["mode"], "cpu");
    ASSERT_EQ(j["devices"].size(), 1u);
    EXPECT_EQ(j["devices"][0]["name"], "cpu");
  } else {
    EXPECT_EQ(j["mode"], "cuda");
    ASSERT_EQ(j["devices"].size(), probe.devices.size());
    for (const auto& d : j["devices"])
      EXPECT_LE(d["bytes_cap"].get<std::uint64_t>(), 1ull << 30);
  }
}

TEST(Cli, SimulatedDevicesAreListedWithTheirLink) {
  Result r = run("devices --json --sim 3 --sim-memory 8GB --sim-link 12.5");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["mode"], "sim");
  ASSERT_EQ(j["devices"].size(), 3u);
  EXPECT_EQ(j["devices"][2]["name"], "sim2");
  EXPECT_EQ(j["devices"][0]["bytes_total"].get<std::uint64_t>(), 8ull << 30);
  EXPECT_DOUBLE_EQ(j["devices"][1]["link_bytes_per_s"].get<double>(), 12.5e9);
}

TEST(Cli, BadOptionsGiveAReadableErrorAndExitNonZero) {
  Result r = run("devices --memory-cap lots");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--memory-cap")) << r.out;
  EXPECT_TRUE(contains(r.out, "lots")) << r.out;

  r = run("devices --sim -2");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "sim_devices")) << r.out;

  r = run("frobnicate");
  EXPECT_NE(r.code, 0) << r.out;
}

TEST(Cli, GenerateExplainsBadInput) {
  Result r = run("generate /nonexistent/model.gguf -p hi --system 'be brief'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--system")) << r.out;
  EXPECT_TRUE(contains(r.out, "--chat")) << r.out;

  r = run("generate /nonexistent/model.gguf -p hi");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "/nonexistent/model.gguf")) << r.out;

  r = run("generate /nonexistent/model.gguf");  // no prompt
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "--prompt")) << r.out;
}

}  // namespace
