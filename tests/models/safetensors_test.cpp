// safetensors and checkpoint folders: round trip, and one test per malformed-input class, each
// checking that the error names the file and the tensor. Also run under AddressSanitizer.
#include "models/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "kernels/checksum.h"
#include "kernels/error.h"
#include "models/model.h"

namespace rondo::models {
namespace {
namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("rondo-st-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  static inline int counter_ = 0;
};

// A file from a raw JSON header and `data_bytes` bytes of data.
void write_raw(const fs::path& p, const std::string& header, std::size_t data_bytes) {
  std::ofstream out(p, std::ios::binary);
  std::uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header;
  std::string data(data_bytes, '\x01');
  out << data;
}

// Expects Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << msg << "\n  missing: " << p;
  }
}

TEST(Safetensors, RoundTripKeepsValuesDtypesAndShapes) {
  TempDir dir;
  at::Tensor a = at::randn({22, 7});
  at::Tensor b = at::randn({4097}).to(at::kBFloat16);
  at::Tensor c = at::randint(0, 1000, {3, 1, 5}, at::kLong);
  at::Tensor d = at::randn({1}).to(at::kHalf);
  fs::path p = dir / "x.safetensors";
  write_safetensors(p.string(), {{"a", a}, {"b.weight", b}, {"c", c}, {"d", d}},
                    {{"format", "pt"}});
  SafetensorsFile f(p.string());
  EXPECT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_TRUE(at::equal(f.find("a")->view(), a));
  EXPECT_TRUE(at::equal(f.find("b.weight")->view(), b));
  EXPECT_TRUE(at::equal(f.find("c")->view(), c));
  EXPECT_TRUE(at::equal(f.find("d")->view(), d));
  EXPECT_EQ(f.find("b.weight")->dtype, DType::kBF16);
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_FALSE(fs::exists(p.string() + ".tmp." + std::to_string(::getpid())));
}

TEST(Safetensors, TruncatedFileNamesTheTensor) {
  TempDir dir;
  fs::path p = dir / "t.safetensors";
  write_raw(p, R"({"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}})", 40);
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "'w'", "truncated"});
}

TEST(Safetensors, HeaderLongerThanTheFile) {
  TempDir dir;
  fs::path p = dir / "h.safetensors";
  {
    std::ofstream out(p, std::ios::binary);
    std::uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{}";
  }
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "header"});
  fs::path tiny = dir / "tiny.safetensors";
  std::ofstream(tiny, std::ios::binary) << "abc";
  expect_error([&] { SafetensorsFile f(tiny.string()); }, {tiny.string(), "header length"});
}

TEST(Safetensors, OverlappingTensorsAreRejected) {
  TempDir dir;
  fs::path p = dir / "o.safetensors";
  write_raw(p,
            R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
            R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
            24);
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "'a'", "'b'", "overlap"});
}

// JSON parsers keep the last of two equal keys: the file would silently lose a tensor.
TEST(Safetensors, ATensorNamedTwiceIsAnError) {
  TempDir dir;
  fs::path p = dir / "twice.safetensors";
  write_raw(p,
            R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
            16);
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "'w'", "twice"});
  // The same name nested (metadata keys, fields) is fine; only top-level names are tensors.
  fs::path ok = dir / "ok.safetensors";
  write_raw(
      ok, R"({"__metadata__":{"w":"x"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_NO_THROW(SafetensorsFile f(ok.string()));
}

// A number too large for any integer or double is a JSON error of another class (out_of_range,
// not parse_error): still an Error naming the file. Found by fuzz/state_json_fuzz in state.json.
TEST(Safetensors, ANumberTooLargeIsAnErrorNamingTheFile) {
  TempDir dir;
  fs::path p = dir / "huge.safetensors";
  write_raw(
      p,
      R"({"w":{"dtype":"F32","shape":[1)" + std::string(400, '0') + R"(],"data_offsets":[0,4]}})",
      4);
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "not valid JSON"});
}

// The checksum write_safetensors returns is the XXH3-64 of the file's bytes as they lie on disk.
TEST(Safetensors, TheWrittenChecksumIsTheFilesXxh3) {
  TempDir dir;
  const fs::path p = dir / "c.safetensors";
  const at::Tensor t = at::arange(1000, at::kFloat);
  const std::uint64_t sum =
      write_safetensors(p.string(), {{"t", DType::kF32, {1000}}}, {{"k", "v"}},
                        [&](std::size_t, const SafetensorsSink& sink) {
                          sink(t.data_ptr(), 2000);  // in two pieces
                          sink(static_cast<const char*>(t.data_ptr()) + 2000, 2000);
                        });
  std::ifstream in(p, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(sum, kernels::xxh3(bytes.data(), bytes.size()));
  EXPECT_EQ(kernels::file_xxh3(p.string()).xxh3, sum);
  EXPECT_EQ(kernels::file_xxh3(p.string()).bytes, bytes.size());
}

TEST(Safetensors, SizeThatDoesNotMatchTheShape) {
  TempDir dir;
  fs::path p = dir / "s.safetensors";
  write_raw(p, R"({"w":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,16]}})", 16);
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "'w'", "18"});
}

TEST(Safetensors, UnknownDtypeIsNamed) {
  TempDir dir;
  fs::path p = dir / "d.safetensors";
  write_raw(p, R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2);
  expect_error([&] { SafetensorsFile f(p.string()); }, {p.string(), "'w'", "F8_E4M3", "supported"});
}

TEST(Safetensors, MalformedHeaderFields) {
  TempDir dir;
  const char* headers[] = {
      R"(not json)",
      R"([1,2])",
      R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
      R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})",
      R"({"w":{"dtype":"F32","shape":[1]}})",
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})",
      R"({"__metadata__":{"k":1}})",
      R"({"w":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}})",
  };
  int i = 0;
  for (const char* h : headers) {
    fs::path p = dir / ("m" + std::to_string(i++) + ".safetensors");
    write_raw(p, h, 8);
    expect_error([&] { SafetensorsFile f(p.string()); }, {p.string()});
  }
}

TEST(Safetensors, MisalignedTensorsAreCopiedNotViewed) {
  TempDir dir;
  fs::path p = dir / "a.safetensors";
  // "b" starts 3 bytes into the data section: not a multiple of 4 wherever the data begins.
  const std::string header = R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})";
  write_raw(p, header, 11);
  SafetensorsFile f(p.string());
  const TensorEntry& b = *f.find("b");
  at::Tensor t = b.view();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 4, 0u);
  float expect;
  std::memcpy(&expect, b.data, 4);  // bytes 0x01 0x01 0x01 0x01
  EXPECT_EQ(t[0].item<float>(), expect);
  EXPECT_EQ(t[1].item<float>(), expect);
}

TEST(Safetensors, TheMetadataNameIsReserved) {
  TempDir dir;
  expect_error(
      [&] {
        write_safetensors((dir / "m.safetensors").string(), {{"__metadata__", at::ones({1})}});
      },
      {"__metadata__", "reserved"});
}

TEST(Checkpoint, FolderWithoutWeightsSaysWhatIsMissing) {
  TempDir dir;
  expect_error([&] { Checkpoint::open_hf_folder(dir.path().string()); },
               {dir.path().string(), "model.safetensors"});
  expect_error([&] { Checkpoint::open_hf_folder((dir / "nope").string()); }, {"not a folder"});
}

TEST(Checkpoint, ShardedIndexIsChecked) {
  TempDir dir;
  write_safetensors((dir / "part-1.safetensors").string(), {{"a", at::randn({3})}});
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map":{"a":"part-1.safetensors","b":"part-1.safetensors"}})";
  expect_error([&] { Checkpoint::open_hf_folder(dir.path().string()); },
               {"'b'", "part-1.safetensors", "no such tensor"});
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map":{"a":"part-1.safetensors","b":"part-2.safetensors"}})";
  expect_error([&] { Checkpoint::open_hf_folder(dir.path().string()); },
               {"part-2.safetensors", "missing"});
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map":{"a":"part-1.safetensors"}})";
  Checkpoint c = Checkpoint::open_hf_folder(dir.path().string());
  EXPECT_EQ(c.names(), std::vector<std::string>{"a"});
  expect_error([&] { c.get("b"); }, {dir.path().string(), "'b'"});
}

ModelConfig tiny_config() {
  return parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":11,
    "hidden_size":8,"intermediate_size":12,"num_hidden_layers":1,"num_attention_heads":2,
    "num_key_value_heads":1})",
                         "config.json");
}

std::map<std::string, at::Tensor> tiny_weights(const ModelConfig& c) {
  std::map<std::string, at::Tensor> w;
  for (const LayerSpec& l : layer_specs(c))
    for (const ParamSpec& p : l.params)
      w[p.name] = at::randn(p.shape);
  return w;
}

TEST(Model, MissingWrongAndUnexpectedTensorsAreNamed) {
  ModelConfig c = tiny_config();
  auto w = tiny_weights(c);
  EXPECT_NO_THROW(Model::from_tensors(c, w, "ok"));
  auto missing = w;
  missing.erase("model.layers.0.mlp.up_proj.weight");
  expect_error([&] { Model::from_tensors(c, missing, "folderA"); },
               {"folderA", "missing tensor 'model.layers.0.mlp.up_proj.weight'"});
  auto wrong = w;
  wrong["model.layers.0.self_attn.k_proj.weight"] = at::randn({8, 8});
  expect_error([&] { Model::from_tensors(c, wrong, "folderB"); },
               {"folderB", "'model.layers.0.self_attn.k_proj.weight'", "[8, 8]", "[4, 8]"});
  auto extra = w;
  extra["model.layers.1.input_layernorm.weight"] = at::randn({8});
  expect_error([&] { Model::from_tensors(c, extra, "folderC"); },
               {"folderC", "unexpected tensor 'model.layers.1.input_layernorm.weight'"});
}

TEST(Config, ListsEveryProblemAtOnce) {
  expect_error(
      [] {
        parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"hidden_size":"big",
          "num_hidden_layers":2,"num_attention_heads":3,"num_key_value_heads":2})",
                        "cfg.json");
      },
      {"cfg.json", "vocab_size", "hidden_size", "intermediate_size"});
  expect_error(
      [] {
        parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":3,"num_key_value_heads":2})",
                        "cfg.json");
      },
      {"num_attention_heads (3) must be a multiple of num_key_value_heads (2)"});
  expect_error([] { parse_hf_config(R"({"architectures":["GPTNeoXForCausalLM"]})", "c.json"); },
               {"c.json", "GPTNeoXForCausalLM", "not supported", "Qwen3ForCausalLM"});
}

TEST(Config, AbsurdDimensionsAndWrongTypesAreRejected) {
  expect_error(
      [] {
        parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1000000000000,"num_attention_heads":2})",
                        "huge.json");
      },
      {"huge.json", "num_hidden_layers", "at most 4096"});
  // Also where the layer count sizes per-layer lists (experts, windows): an error, no allocation.
  for (const char* arch : {"Qwen3MoeForCausalLM", "GptOssForCausalLM", "Qwen2ForCausalLM"})
    expect_error(
        [&] {
          parse_hf_config(std::string(R"({"architectures":[")") + arch +
                              R"("],"vocab_size":10,"hidden_size":8,"intermediate_size":8,
            "num_hidden_layers":1000000000000,"num_attention_heads":2,"use_sliding_window":true,
            "num_experts":2,"num_local_experts":2,"num_experts_per_tok":1})",
                          "huge.json");
        },
        {"huge.json", "num_hidden_layers", "at most 4096"});
  expect_error(
      [] {
        parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"model_type":null,
          "hidden_act":7,"vocab_size":10,"hidden_size":8,"intermediate_size":8,
          "num_hidden_layers":1,"num_attention_heads":2})",
                        "types.json");
      },
      {"types.json", "\"hidden_act\" must be a string, not 7"});
  // Null is what transformers writes for an unset field (Config.to_dict()): the default.
  const ModelConfig nulls = parse_hf_config(
      R"({"architectures":null,"model_type":"llama","hidden_act":null,"dtype":null,
        "torch_dtype":null,"eos_token_id":null,"bos_token_id":null,"pad_token_id":null,
        "vocab_size":10,"hidden_size":8,"intermediate_size":8,
        "num_hidden_layers":1,"num_attention_heads":2})",
      "nulls.json");
  EXPECT_EQ(nulls.dtype, DType::kF32);
  EXPECT_EQ(nulls.num_layers, 1);
  expect_error(
      [] {
        parse_hf_config(R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,
          "use_sliding_window":true,"sliding_window":4,
          "layer_types":["full_attention","sliding_attention"]})",
                        "qwen.json");
      },
      {"qwen.json", "layer_types", "one type per layer (1)"});
}

// 0 is not "no limit": a config that states it is broken, and the error says what to do.
TEST(Config, ZeroMaxPositionEmbeddingsIsRejected) {
  expect_error(
      [] {
        parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,
          "max_position_embeddings":0})",
                        "zero.json");
      },
      {"zero.json", "max_position_embeddings", "is 0"});
  const ModelConfig left_out = parse_hf_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2})",
      "default.json");
  EXPECT_EQ(left_out.max_position_embeddings, 4096);
}

TEST(Config, ReadsOldAndNewRopeFields) {
  ModelConfig old_style = parse_hf_config(R"({"architectures":["LlamaForCausalLM"],
    "vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
    "num_attention_heads":2,"rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3",
    "factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
    "original_max_position_embeddings":8192}})",
                                          "a");
  EXPECT_EQ(old_style.rope.theta, 500000.0);
  EXPECT_EQ(old_style.rope.type, "llama3");
  EXPECT_EQ(old_style.rope.factor, 32.0);
  EXPECT_EQ(old_style.head_dim, 4);
  ModelConfig qwen3 = parse_hf_config(R"({"architectures":["Qwen3ForCausalLM"],
    "vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
    "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,
    "rope_parameters":{"rope_type":"default","rope_theta":1000000.0}})",
                                      "b");
  EXPECT_EQ(qwen3.rope.theta, 1000000.0);
  EXPECT_EQ(qwen3.head_dim, 16);
  EXPECT_TRUE(qwen3.qk_norm);
}

// Which blocks are sparse, as transformers decides it (every decoder_sparse_step-th, except
// mlp_only_layers), both spellings of the expert count, and what a broken MoE config says.
TEST(Config, ReadsMixturesOfExperts) {
  const std::string dims = R"("vocab_size":10,"hidden_size":8,"intermediate_size":12,
    "num_hidden_layers":4,"num_attention_heads":2,)";
  ModelConfig q = parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],)" + dims +
                                      R"("num_experts":6,"num_experts_per_tok":2,
    "moe_intermediate_size":5,"decoder_sparse_step":2,"mlp_only_layers":[3],
    "norm_topk_prob":true,"output_router_logits":true,"router_aux_loss_coef":0.02})",
                                  "q");
  EXPECT_EQ(q.family, Family::kQwen3Moe);
  EXPECT_EQ(q.num_experts, 6);
  EXPECT_EQ(q.experts_per_token, 2);
  EXPECT_EQ(q.moe_intermediate_size, 5);
  EXPECT_TRUE(q.norm_topk_prob && q.output_router_logits && q.qk_norm);
  EXPECT_EQ(q.router_aux_loss_coef, 0.02);
  // Sparse: (layer + 1) % 2 == 0 and not in mlp_only_layers: block 1 only.
  EXPECT_EQ(q.sparse_layer_count(), 1);
  EXPECT_TRUE(q.sparse(1));
  EXPECT_FALSE(q.sparse(0) || q.sparse(2) || q.sparse(3));
  const std::vector<LayerSpec> specs = layer_specs(q);
  EXPECT_EQ(specs[2].params.back().name, "model.layers.1.mlp.experts.5.down_proj.weight");
  EXPECT_EQ(specs[1].params.back().name, "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(specs[1].params.back().shape, (std::vector<std::int64_t>{8, 12}));
  // A token uses 2 of 6 experts: the block's active parameters count a third of them.
  const double experts = 6.0 * 3 * 5 * 8;
  EXPECT_DOUBLE_EQ(specs[2].param_count() - specs[2].active_param_count(), experts * 2 / 3);
  // Round trip through the config.json Rondo writes.
  const ModelConfig back = parse_hf_config(hf_config_json(q, DType::kF32), "written");
  EXPECT_EQ(back.sparse_layers, q.sparse_layers);
  EXPECT_EQ(back.num_experts, 6);
  EXPECT_EQ(back.router_aux_loss_coef, 0.02);

  // transformers 5 writes num_local_experts; Mixtral always has it, and every block sparse.
  ModelConfig local = parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],)" + dims +
                                          R"("num_local_experts":3,"num_experts_per_tok":1})",
                                      "l");
  EXPECT_EQ(local.num_experts, 3);
  ModelConfig m = parse_hf_config(R"({"architectures":["MixtralForCausalLM"],)" + dims +
                                      R"("num_local_experts":4,"num_experts_per_tok":2})",
                                  "m");
  EXPECT_EQ(m.sparse_layer_count(), 4);
  EXPECT_EQ(m.moe_intermediate_size, 12);
  EXPECT_TRUE(m.norm_topk_prob);
  EXPECT_EQ(layer_specs(m)[1].params[6].name, "model.layers.0.block_sparse_moe.gate.weight");
  // GPT-OSS: sinks, biases, every other layer windowed without layer_types, fused experts.
  ModelConfig g = parse_hf_config(R"({"architectures":["GptOssForCausalLM"],)" + dims +
                                      R"("num_local_experts":4,"num_experts_per_tok":2,
    "sliding_window":16,"swiglu_limit":5.0})",
                                  "g");
  EXPECT_TRUE(g.attention_sinks && g.attention_bias && g.attention_out_bias);
  EXPECT_EQ(g.sparse_layer_count(), 4);
  EXPECT_TRUE(g.windowed(0) && !g.windowed(1) && g.windowed(2) && !g.windowed(3));
  EXPECT_EQ(g.swiglu_limit, 5.0);
  EXPECT_EQ(g.swiglu_alpha, 1.702);
  const std::vector<LayerSpec> gs = layer_specs(g);
  EXPECT_EQ(gs[1].params.back().name, "model.layers.0.mlp.experts.down_proj_bias");
  const auto fused = std::find_if(gs[1].params.begin(), gs[1].params.end(), [](const auto& p) {
    return p.name == "model.layers.0.mlp.experts.gate_up_proj";
  });
  ASSERT_NE(fused, gs[1].params.end());
  EXPECT_EQ(fused->shape, (std::vector<std::int64_t>{4, 8, 24}));
  const ModelConfig g_back = parse_hf_config(hf_config_json(g, DType::kF32), "written");
  EXPECT_EQ(g_back.sliding_layers, g.sliding_layers);
  EXPECT_EQ(g_back.swiglu_limit, 5.0);

  expect_error(
      [&] {
        parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],)" + dims +
                            R"("num_experts":4,"num_experts_per_tok":5})",
                        "bad.json");
      },
      {"bad.json", "num_experts_per_tok (5) must be between 1 and the number of experts (4)"});
  expect_error(
      [&] {
        parse_hf_config(R"({"architectures":["Qwen3MoeForCausalLM"],)" + dims +
                            R"("num_experts":4,"mlp_only_layers":[1,7]})",
                        "bad.json");
      },
      {"bad.json", "mlp_only_layers holds 7, not a layer index (0..3)"});
}

}  // namespace
}  // namespace rondo::models
