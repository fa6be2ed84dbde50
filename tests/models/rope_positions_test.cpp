// The positions a run may use (ModelConfig::positions) and the rope scaling advised for rows past
// them (rope_scaling_advice): the advice, added to the config.json, is read back as that scaling
// and gives the model the positions asked for.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "models/config.h"

namespace rondo::models {
namespace {

using nlohmann::json;

json qwen3(std::int64_t positions) {
  return {{"architectures", {"Qwen3ForCausalLM"}},
          {"model_type", "qwen3"},
          {"vocab_size", 64},
          {"hidden_size", 32},
          {"intermediate_size", 64},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 8},
          {"max_position_embeddings", positions},
          {"rope_theta", 10000.0}};
}

// The advice is a fragment of config.json: its keys set into the file.
json with_advice(json config, const std::string& fragment) {
  const json lines = json::parse("{" + fragment + "}");
  for (auto& [key, value] : lines.items())
    config[key] = value;
  return config;
}

TEST(RopePositions, YarnStretchesThePositionsItsFactorSays) {
  const ModelConfig plain = parse_hf_config(qwen3(40).dump(), "plain");
  EXPECT_EQ(plain.positions(), 40);
  // Qwen's recipe: YaRN in config.json, max_position_embeddings left as it was.
  json yarn = qwen3(40);
  yarn["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32}};
  EXPECT_EQ(parse_hf_config(yarn.dump(), "yarn").positions(), 128);
  // A factor that stretches less than max_position_embeddings already says: that one.
  yarn["rope_scaling"]["factor"] = 1.0;
  EXPECT_EQ(parse_hf_config(yarn.dump(), "yarn").positions(), 40);
}

TEST(RopePositions, TheAdviceGivesThePositionsAsked) {
  // Qwen3: YaRN over the context it has, the least power-of-two factor that reaches the rows.
  const ModelConfig q = parse_hf_config(qwen3(40).dump(), "qwen3");
  const RopeAdvice a = rope_scaling_advice(q, 100);
  EXPECT_NE(a.name.find("YaRN"), std::string::npos);
  const ModelConfig qa = parse_hf_config(with_advice(qwen3(40), a.json).dump(), "advised");
  EXPECT_EQ(qa.rope.type, "yarn");
  EXPECT_EQ(qa.rope.factor, 4.0);
  EXPECT_EQ(qa.rope.original_max_position_embeddings, 40);
  EXPECT_EQ(qa.positions(), 160);
  // Past a YaRN the config has already: a larger factor over the same original context.
  const RopeAdvice more = rope_scaling_advice(qa, 500);
  EXPECT_EQ(parse_hf_config(with_advice(qwen3(40), more.json).dump(), "more").positions(), 640);

  // Llama: Llama 3's own scaling, and the positions it gives set in max_position_embeddings (as
  // Llama 3.1's config.json does).
  json llama = qwen3(64);
  llama["architectures"] = {"LlamaForCausalLM"};
  llama["model_type"] = "llama";
  llama.erase("head_dim");
  const ModelConfig l = parse_hf_config(llama.dump(), "llama");
  const RopeAdvice b = rope_scaling_advice(l, 200);
  const ModelConfig la = parse_hf_config(with_advice(llama, b.json).dump(), "advised");
  EXPECT_EQ(la.rope.type, "llama3");
  EXPECT_EQ(la.rope.factor, 4.0);
  EXPECT_EQ(la.rope.original_max_position_embeddings, 64);
  EXPECT_EQ(la.positions(), 256);
}

}  // namespace
}  // namespace rondo::models
