// Runs the real `rondo` binary and checks what a user would read.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/wait.h>
#include <filesystem>
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

// The GUI builds its Advanced page from the JSON form: the same keys, in the same order, as the
// text a user reads, each with a type the GUI knows and a default of that type.
TEST(Cli, TheConfigReferenceAsJsonHasEveryKeyOfTheText) {
  const Result text = run("train --help-config");
  const Result as_json = run("train --help-config --json");
  ASSERT_EQ(text.code, 0) << text.out;
  ASSERT_EQ(as_json.code, 0) << as_json.out;
  const nlohmann::json keys = nlohmann::json::parse(as_json.out)["keys"];
  std::vector<std::string> listed;  // the text's keys: each line's first word after the title
  for (std::size_t at = text.out.find("\n  "); at != std::string::npos;
       at = text.out.find("\n  ", at + 1))
    listed.push_back(text.out.substr(at + 3, text.out.find(' ', at + 3) - at - 3));
  ASSERT_EQ(keys.size(), listed.size()) << as_json.out;
  ASSERT_GT(keys.size(), 40u);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const nlohmann::json& k = keys[i];
    EXPECT_EQ(k["key"], listed[i]);
    const std::string type = k["type"];
    const nlohmann::json& d = k["default"];
    EXPECT_TRUE((type == "string" && d.is_string()) || (type == "bool" && d.is_boolean()) ||
                (type == "integer" && d.is_number_integer()) ||
                (type == "number" && d.is_number()) || (type == "list" && d.is_array()))
        << k;
    EXPECT_FALSE(k["help"].get<std::string>().empty()) << k;
  }
  EXPECT_EQ(keys[0]["key"], "model.path");
  // --json alone is a mistake, said as one.
  const Result alone = run("train --json");
  EXPECT_NE(alone.code, 0);
  EXPECT_TRUE(contains(alone.out, "--json goes with --help-config")) << alone.out;
}

TEST(Cli, DevicesSaysWhatItWillUse) {
  rondo::kernels::CudaProbe probe = rondo::kernels::probe_cuda();
  Result r = run("devices");
  EXPECT_EQ(r.code, 0) << r.out;
  if (probe.devices.empty()) {
    EXPECT_TRUE(contains(r.out, "No CUDA GPU is present")) << r.out;
    EXPECT_TRUE(contains(r.out, probe.error)) << r.out;  // the reason, as CUDA gave it
    EXPECT_TRUE(contains(r.out, "use the CPU instead")) << r.out;
    // No driver at all (no libcuda to load) is said in those words, not as CUDA's "driver version
    // is insufficient".
    void* libcuda = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (libcuda == nullptr && probe.compiled) {
      EXPECT_TRUE(contains(r.out, "no NVIDIA driver found")) << r.out;
      EXPECT_FALSE(contains(r.out, "insufficient")) << r.out;
    } else if (libcuda != nullptr) {
      ::dlclose(libcuda);
    }
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

// `rondo devices --disk DIR`: the folder's sequential speed and the I/O backend that works there
// (io_uring where the kernel allows it), as text and JSON, remembered for planning (in the speed
// cache: a folder of the test's own here); a folder that cannot be used is named.
TEST(Cli, DevicesMeasuresAnOffloadFolder) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("rondo-disk-" + std::to_string(::getpid())))
          .string();
  const std::string cache = dir + "-cache";
  std::filesystem::create_directories(dir);
  const std::string env = "RONDO_SPEED_CACHE=" + cache;
  Result r =
      rondo::test::run_rondo("devices --json --disk " + dir + " --disk-bytes 64MiB", true, env);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["disk"]["read_bytes_per_s"].get<double>(), 0) << r.out;
  EXPECT_GT(j["disk"]["write_bytes_per_s"].get<double>(), 0) << r.out;
  EXPECT_TRUE(j["disk"]["backend"] == "io_uring" || j["disk"]["backend"] == "threads") << r.out;
  EXPECT_EQ(j["disk"]["bytes"].get<std::uint64_t>(), 64ull << 20);
  EXPECT_TRUE(j["disk"]["remembered"].get<bool>()) << r.out;
  EXPECT_TRUE(std::filesystem::exists(cache + "/disk-speeds.json"));
  r = rondo::test::run_rondo("devices --disk " + dir + " --disk-bytes 64MiB", true, env);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("I/O backend: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hardware.disk_speed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("remembered"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the measurement left a file";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(cache);
  r = run("devices --disk /proc/rondo-no-such-folder --disk-bytes 1MiB");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("/proc/rondo-no-such-folder"), std::string::npos) << r.out;
}

// RONDO_FAULT_IO reaches the disk probe through the CLI (cli/test_faults.cpp; the offload library
// reads no variable): a failing write ends the measurement with the folder and the error named,
// and a bad rule is an error naming the variable before anything is measured.
TEST(Cli, DevicesDiskTakesItsFaultsFromRondoFaultIo) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("rondo-disk-fault-" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(dir);
  const std::string args = "devices --disk " + dir + " --disk-bytes 4MiB";
  Result r = rondo::test::run_rondo(args, true, "RONDO_FAULT_IO=eio:write:2");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "measuring the drive of " + dir + ": writing at offset")) << r.out;
  EXPECT_TRUE(contains(r.out, "Input/output error (EIO)")) << r.out;
  r = rondo::test::run_rondo(args, true, "RONDO_FAULT_IO=eio:wirte:2");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "RONDO_FAULT_IO: bad fault rule 'eio:wirte:2'")) << r.out;
  EXPECT_FALSE(contains(r.out, "Measuring")) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the measurement left a file";
  std::filesystem::remove_all(dir);
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
