// Rows longer than the model's positions (issue 35 item 3): refused, with the rope scaling its
// family is extended with as the config.json lines to add; once they are there, the run is
// accepted, trains and exports a merged model whose config.json keeps them.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "train_fixture.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using rondo::test::contains;
using rondo::test::Result;
using rondo::test::run_rondo;
using rondo::test::slurp;
using rondo::test::write;

using TrainCli = rondo::test::TrainFixture;

TEST_F(TrainCli, SequenceLengthBeyondTheModelSaysWhichRopeScalingAndTheRunTakesIt) {
  const fs::path cfg = dir / "c.toml";
  write(cfg, config("run", "exports = [\"merged\"]\n"));
  // The tiny model is a Llama of 512 positions.
  Result r = run_rondo("train " + cfg.string() + " --set data.seq_len=2048 --set training.steps=2");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "data.seq_len: 2048 is more than")) << r.out;
  EXPECT_TRUE(contains(r.out, "512 positions")) << r.out;
  EXPECT_TRUE(contains(r.out, "Llama 3's rope scaling")) << r.out;
  // The advice is the lines to set in config.json, as printed on a line of their own.
  const std::string marker = "\n  \"rope_scaling\"";
  const std::size_t at = r.out.find(marker);
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string fragment = r.out.substr(at + 3, r.out.find('\n', at + 1) - (at + 3));
  json advice = json::parse("{" + fragment + "}");
  EXPECT_EQ(advice["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(advice["rope_scaling"]["factor"], 4.0);
  EXPECT_EQ(advice["rope_scaling"]["original_max_position_embeddings"], 512);
  EXPECT_EQ(advice["max_position_embeddings"], 2048);

  // Followed: the run is accepted, trains, and the merged export keeps the scaling.
  json model_config = json::parse(slurp(model / "config.json"));
  for (auto& [key, value] : advice.items())
    model_config[key] = value;
  write(model / "config.json", model_config.dump(2));
  r = run_rondo("train " + cfg.string() + " --set data.seq_len=2048 --set training.steps=2");
  ASSERT_EQ(r.code, 0) << r.out;
  const json merged = json::parse(slurp(dir / "run" / "merged" / "config.json"));
  EXPECT_EQ(merged["rope_scaling"], advice["rope_scaling"]);
  EXPECT_EQ(merged["max_position_embeddings"], 2048);
}

}  // namespace
