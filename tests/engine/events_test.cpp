// The event stream: every line a whole JSON object with the common fields, under concurrent
// writers; odd values (NaN, invalid UTF-8) do not break a line; open errors name the path.
#include "engine/events.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "kernels/error.h"

namespace rondo::engine {
namespace {
namespace fs = std::filesystem;

std::vector<nlohmann::json> read_lines(const fs::path& p) {
  std::ifstream in(p);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line))
    out.push_back(nlohmann::json::parse(line));  // throws if torn
  return out;
}

TEST(EventSink, ConcurrentWritersProduceWholeLines) {
  fs::path p =
      fs::temp_directory_path() / ("rondo-events-" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(p);
  {
    auto sink = EventSink::open(p.string());
    sink->emit(
        RunStartEvent{.run_dir = "/runs/a", .model = "m", .method = "lora", .steps_total = 3});
    std::vector<std::thread> threads;
    for (int d = 0; d < 4; ++d)
      threads.emplace_back([&, d] {
        for (int i = 0; i < 250; ++i)
          sink->emit(SpanEvent{.device = d,
                               .step = i,
                               .stage = "F" + std::to_string(i % 3),
                               .first_layer = 0,
                               .end_layer = 2,
                               .start = sink->now(),
                               .end = sink->now()});
      });
    for (auto& t : threads)
      t.join();
    sink->emit(StepEvent{.step = 1, .steps_total = 3, .loss = std::nan(""), .lr = 1e-4});
    sink->emit(SampleEvent{.step = 1, .prompt = "hi", .text = "bad \xC3 utf-8"});
    sink->emit(RunEndEvent{.status = "completed", .steps = 3, .seconds = 1.5});
  }
  auto lines = read_lines(p);
  ASSERT_EQ(lines.size(), 1u + 4 * 250 + 3);
  std::map<std::string, int> count;
  std::map<int, int> last_step;
  double last_t = 0;
  for (const auto& j : lines) {
    EXPECT_EQ(j["v"], kEventSchemaVersion);
    ASSERT_TRUE(j["t"].is_number());
    EXPECT_GE(j["t"].get<double>(), last_t);  // written in order under the lock
    last_t = j["t"].get<double>();
    EXPECT_EQ(j["time"].get<std::string>().size(), 24u);  // 2026-12-02T14:00:00.000Z
    ++count[j["type"].get<std::string>()];
    if (j["type"] == "span") {
      int d = j["device"];
      EXPECT_EQ(j["step"].get<int>(), last_step.count(d) ? last_step[d] + 1 : 0);
      last_step[d] = j["step"];
    }
  }
  EXPECT_EQ(count["span"], 1000);
  EXPECT_EQ(count["run_start"], 1);
  EXPECT_TRUE(lines[lines.size() - 3]["loss"].is_null());  // NaN is no JSON number
  EXPECT_NE(lines[lines.size() - 2]["text"].get<std::string>().find("bad"), std::string::npos);
  EXPECT_EQ(lines.back()["status"], "completed");
  fs::remove(p);
}

TEST(EventSink, AnUnwritablePathIsNamed) {
  try {
    EventSink::open("/nonexistent-dir/events.jsonl");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/events.jsonl"), std::string::npos);
  }
}

}  // namespace
}  // namespace rondo::engine
