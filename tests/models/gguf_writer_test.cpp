// GgufWriter's refusals and its all-or-nothing file: a tensor declared twice or with rows that are
// not whole blocks is refused by name; a producer that gives the wrong number of bytes leaves no
// file and no temporary behind. (What the files hold is read by gguf-py in
// tests/oracle/test_gguf_export.py; here Rondo's reader checks a written file's layout.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include "kernels/error.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "models/export.h"
#include "models/gguf.h"
#include "models/gguf_writer.h"

namespace rondo::models {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("rondo-gguf-writer-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d / name;
}

TEST(GgufWriter, RefusesDuplicatesAndPartialBlocks) {
  GgufWriter w;
  w.add_tensor("a", {2, 32}, GgmlType::kQ8_0);
  EXPECT_THROW(w.add_tensor("a", {2, 32}, GgmlType::kF32), Error);
  try {
    w.add_tensor("b", {4, 100}, GgmlType::kQ4_K);
    FAIL() << "rows of 100 are not Q4_K blocks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'b' has rows of 100 elements"), std::string::npos)
        << e.what();
  }
}

TEST(GgufWriter, WrongBytesLeaveNoFile) {
  const fs::path path = scratch("bad.gguf");
  GgufWriter w;
  w.add_tensor("a", {3}, GgmlType::kF32);
  const float x[2] = {1, 2};
  EXPECT_THROW(
      w.write(path.string(), [&](std::size_t, const GgufSink& sink) { sink(x, sizeof(x)); }),
      InternalError);
  EXPECT_FALSE(fs::exists(path));
  for (const auto& e : fs::directory_iterator(path.parent_path()))
    ADD_FAILURE() << "left behind: " << e.path();
}

TEST(GgufWriter, ReadsBackAligned) {
  const fs::path path = scratch("ok.gguf");
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  w.set_u32("general.file_type", 1);
  w.set_u32("general.file_type", 7);  // replaced in place
  w.set_strings("tokenizer.ggml.tokens", {"a", "b", ""});
  w.set_f32s("scores", {0.5f, -1.0f});
  w.add_tensor("odd", {3}, GgmlType::kF32);  // 12 bytes: the next tensor starts at 32
  w.add_tensor("q", {2, 32}, GgmlType::kQ8_0);
  std::vector<std::uint8_t> q(2 * 34, 0x11);
  const float odd[3] = {1, 2, 3};
  w.write(path.string(), [&](std::size_t i, const GgufSink& sink) {
    if (i == 0)
      sink(odd, sizeof(odd));
    else
      sink(q.data(), q.size());
  });
  const GgufFile f(path.string());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("general.file_type"), 7);
  EXPECT_EQ(f.metadata().size(), 4u);
  EXPECT_EQ(f.get_strings("tokenizer.ggml.tokens"), (std::vector<std::string>{"a", "b", ""}));
  EXPECT_EQ(f.get_floats("scores"), (std::vector<double>{0.5, -1.0}));
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensor("odd").offset, 0u);
  EXPECT_EQ(f.tensor("q").offset, 32u);
  EXPECT_EQ(f.tensor("q").shape(), (std::vector<std::int64_t>{2, 32}));
  EXPECT_EQ(f.data_offset() % 32, 0u);
  EXPECT_EQ(f.tensor_data(f.tensor("q"))[67], 0x11);
  fs::remove_all(path.parent_path());
}

// A PEFT adapter of a GGUF base names what peft can load: the Hugging Face repository the file's
// metadata says it came from, else the file.
TEST(GgufWriter, PeftAdapterNamesTheRepositoryOfAGgufBase) {
  const LayerSpec spec{
      .kind = LayerKind::kBlock,
      .block = 0,
      .params = {{"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", {2, 4}},
                 {"base_model.model.model.layers.0.mlp.up_proj.lora_B.weight", {4, 2}}}};
  const std::map<std::string, at::Tensor> tensors = {{spec.params[0].name, at::zeros({2, 4})},
                                                     {spec.params[1].name, at::zeros({4, 2})}};
  auto base_named = [&](const std::string& gguf, const std::string& url) {
    GgufWriter w;
    w.set_string("general.architecture", "llama");
    if (!url.empty()) w.set_string("general.source.url", url);
    w.write(gguf, [](std::size_t, const GgufSink&) {});
    const fs::path dir = scratch("adapter");
    write_peft_adapter(dir.string(), {spec}, tensors, LoraConfig{.rank = 2, .alpha = 4}, gguf);
    std::ifstream in(dir / "adapter_config.json");
    return nlohmann::json::parse(in)["base_model_name_or_path"].get<std::string>();
  };
  const std::string gguf = scratch("base.gguf").string();
  EXPECT_EQ(base_named(gguf, "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"),
            "HuggingFaceTB/SmolLM2-135M-Instruct");
  EXPECT_EQ(base_named(gguf, "https://huggingface.co/org/name/tree/main"), "org/name");
  EXPECT_EQ(base_named(gguf, "https://example.com/model"), gguf);
  EXPECT_EQ(base_named(gguf, ""), gguf);
  fs::remove_all(fs::path(gguf).parent_path());
}

}  // namespace
}  // namespace rondo::models
