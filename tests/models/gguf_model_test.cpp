// GGUF model metadata units: llama3 rope scaling recovered from rope_freqs.weight refuses factors
// that are not finite or below 1 and a non-positive original context length, each with its own
// message. The files are written byte by byte here, independent of Rondo's reader; the
// comparison of whole models with transformers is tests/oracle/test_gguf.py.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "models/gguf.h"
#include "models/gguf_model.h"

namespace rondo::models {
namespace {

// A llama GGUF with C = 64, H = 2 (head_dim 32), 1 layer, and rope_freqs.weight (F32, 16
// factors, one per rotary pair); no other tensors, which config_from_gguf does not need.
// original_context: llama.rope.scaling.original_context_length, or none when < 0 is not wanted.
std::vector<std::uint8_t> llama_with_rope_freqs(const std::vector<float>& factors,
                                                std::int64_t original_context, bool with_context) {
  std::vector<std::uint8_t> b;
  auto put = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const std::uint8_t*>(p);
    b.insert(b.end(), c, c + n);
  };
  auto u32 = [&](std::uint32_t v) { put(&v, 4); };
  auto u64 = [&](std::uint64_t v) { put(&v, 8); };
  auto str = [&](const std::string& s) {
    u64(s.size());
    put(s.data(), s.size());
  };
  auto kv_u32 = [&](const std::string& key, std::uint32_t v) {
    str(key);
    u32(4);  // UINT32
    u32(v);
  };
  std::vector<std::pair<std::string, std::uint32_t>> ints = {{"llama.embedding_length", 64},
                                                             {"llama.block_count", 1},
                                                             {"llama.feed_forward_length", 128},
                                                             {"llama.attention.head_count", 2},
                                                             {"llama.vocab_size", 10}};
  put("GGUF", 4);
  u32(3);                                         // version
  u64(1);                                         // tensors
  u64(ints.size() + 2 + (with_context ? 1 : 0));  // metadata
  str("general.architecture");
  u32(8);  // STRING
  str("llama");
  for (auto& [k, v] : ints)
    kv_u32(k, v);
  str("llama.attention.layer_norm_rms_epsilon");
  u32(6);  // FLOAT32
  const float eps = 1e-5f;
  put(&eps, 4);
  if (with_context) {
    str("llama.rope.scaling.original_context_length");
    u32(11);  // INT64
    put(&original_context, 8);
  }
  str("rope_freqs.weight");
  u32(1);  // dims
  u64(factors.size());
  u32(0);  // F32
  u64(0);  // offset
  while (b.size() % 32 != 0)
    b.push_back(0);
  put(factors.data(), factors.size() * 4);
  return b;
}

class GgufModel : public ::testing::Test {
 protected:
  // config_from_gguf's error for `bytes`, after checking that it names the file.
  std::string error_of(const std::vector<std::uint8_t>& bytes) {
    const std::string path =
        (std::filesystem::temp_directory_path() /
         ("rondo_gguf_model_" + std::to_string(::getpid()) + "_" + std::to_string(n_++) + ".gguf"))
            .string();
    paths_.push_back(path);
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
    try {
      config_from_gguf(GgufFile(path));
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      return msg;
    }
    return "(no error)";
  }
  void TearDown() override {
    for (auto& p : paths_)
      std::filesystem::remove(p);
  }
  std::vector<std::string> paths_;
  int n_ = 0;
};

#define EXPECT_HAS(msg, text) EXPECT_NE((msg).find(text), std::string::npos) << (msg)

TEST_F(GgufModel, RopeFactorsMustBeFinite) {
  const std::vector<float> ones(16, 1.0f);
  EXPECT_EQ(error_of(llama_with_rope_freqs(ones, 8192, true)), "(no error)");  // no scaling
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    // NaN compares false with everything: max_element and a tolerance check written as
    // `error > tol` would both let it through.
    for (std::size_t at : {0u, 5u, 15u}) {
      std::vector<float> f = ones;
      f[at] = bad;
      const std::string msg = error_of(llama_with_rope_freqs(f, 8192, true));
      EXPECT_HAS(msg, "'rope_freqs.weight'");
      EXPECT_HAS(msg, "factor " + std::to_string(at) + " is ");
      EXPECT_HAS(msg, "not a finite number");
    }
  }
}

TEST_F(GgufModel, RopeFactorsBelowOneAndContextLengthHaveTheirOwnMessages) {
  std::string msg = error_of(llama_with_rope_freqs(std::vector<float>(16, 0.5f), 8192, true));
  EXPECT_HAS(msg, "'rope_freqs.weight'");
  EXPECT_HAS(msg, "the largest factor is 0.5");
  EXPECT_EQ(msg.find("original_context_length"), std::string::npos) << msg;

  for (std::int64_t context : {0, -4096}) {
    msg = error_of(llama_with_rope_freqs(std::vector<float>(16, 1.0f), context, true));
    EXPECT_HAS(
        msg, "metadata 'llama.rope.scaling.original_context_length' is " + std::to_string(context));
    EXPECT_HAS(msg, "positive");
    EXPECT_EQ(msg.find("factor"), std::string::npos) << msg;
  }
  // Without the key, Llama 3's 8192.
  EXPECT_EQ(error_of(llama_with_rope_freqs(std::vector<float>(16, 1.0f), 0, false)), "(no error)");
}

}  // namespace
}  // namespace rondo::models
