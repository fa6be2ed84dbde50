// GGUF files are untrusted input: each way a file can be broken ends in a rondo::Error that names
// the file and the key or tensor at fault, never in a crash or a read past the end. The files are
// built byte by byte here (a small valid GGUF, then corrupted), independent of Rondo's reader.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "models/gguf.h"

namespace rondo::models {
namespace {

// Writes GGUF fields little-endian and remembers where things are, so tests can corrupt them.
struct Builder {
  std::vector<std::uint8_t> b;

  std::size_t u32(std::uint32_t v) { return put(&v, 4); }
  std::size_t u64(std::uint64_t v) { return put(&v, 8); }
  std::size_t str(const std::string& s) {
    std::size_t at = u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return at;
  }
  std::size_t put(const void* p, std::size_t n) {
    std::size_t at = b.size();
    const auto* c = static_cast<const std::uint8_t*>(p);
    b.insert(b.end(), c, c + n);
    return at;
  }
  void pad_to(std::size_t alignment) {
    while (b.size() % alignment != 0)
      b.push_back(0);
  }
  void set_u32(std::size_t at, std::uint32_t v) { std::memcpy(&b[at], &v, 4); }
  void set_u64(std::size_t at, std::uint64_t v) { std::memcpy(&b[at], &v, 8); }
};

// A valid file: 3 metadata entries, tensor "tok.weight" F32 ne=[4, 3] (48 bytes at 0) and tensor
// "blk.0.q" Q8_0 ne=[32, 2] (68 bytes at 64), alignment 32.
struct ValidFile {
  Builder g;
  std::size_t kv_count_at, arch_len_at, alignment_at, array_count_at;
  std::size_t tok_ne0_at, tok_type_at, tok_offset_at, tok_name_at;
  std::size_t q_ne0_at, q_type_at, q_offset_at, q_name_at;
  std::size_t data_at;
  std::vector<float> tok_values;
  std::vector<std::int8_t> q_values;

  ValidFile() {
    g.put("GGUF", 4);
    g.u32(3);                // version
    g.u64(2);                // tensor count
    kv_count_at = g.u64(3);  // metadata count
    g.str("general.architecture");
    g.u32(8);  // STRING
    arch_len_at = g.str("llama");
    g.str("general.alignment");
    g.u32(4);  // UINT32
    alignment_at = g.u32(32);
    g.str("tokenizer.ggml.scores");
    g.u32(9);  // ARRAY
    g.u32(6);  // of FLOAT32
    array_count_at = g.u64(3);
    for (float f : {0.5f, -1.0f, 2.0f})
      g.put(&f, 4);

    tok_name_at = g.str("tok.weight");
    g.u32(2);
    tok_ne0_at = g.u64(4);
    g.u64(3);
    tok_type_at = g.u32(0);  // F32
    tok_offset_at = g.u64(0);

    q_name_at = g.str("blk.0.q");
    g.u32(2);
    q_ne0_at = g.u64(32);
    g.u64(2);
    q_type_at = g.u32(8);  // Q8_0
    q_offset_at = g.u64(64);

    g.pad_to(32);
    data_at = g.b.size();
    for (int i = 0; i < 12; ++i) {
      tok_values.push_back(0.25f * static_cast<float>(i) - 1.0f);
      g.put(&tok_values.back(), 4);
    }
    g.pad_to(32);  // 48 -> 64
    for (int block = 0; block < 2; ++block) {
      const std::uint16_t d = 0x3800;  // f16 0.5
      g.put(&d, 2);
      for (int j = 0; j < 32; ++j) {
        q_values.push_back(static_cast<std::int8_t>(j * 7 - 100 + block));
        g.put(&q_values.back(), 1);
      }
    }
  }
};

class GgufMalformed : public ::testing::Test {
 protected:
  std::string write(const std::vector<std::uint8_t>& bytes) {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::path p = std::filesystem::temp_directory_path() /
                              ("rondo_gguf_" + name + "_" + std::to_string(::getpid()) + "_" +
                               std::to_string(counter_++) + ".gguf");
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.close();
    paths_.push_back(p);
    return p.string();
  }
  void TearDown() override {
    for (auto& p : paths_)
      std::filesystem::remove(p);
  }

  // Opens the file, expects Error, returns its message after checking that it names the file.
  std::string open_error(const std::vector<std::uint8_t>& bytes) {
    const std::string path = write(bytes);
    try {
      GgufFile f(path);
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      return msg;
    }
    ADD_FAILURE() << "opening the corrupt file succeeded";
    return {};
  }

  ValidFile v;
  std::vector<std::filesystem::path> paths_;
  int counter_ = 0;
};

#define EXPECT_HAS(msg, text) EXPECT_NE((msg).find(text), std::string::npos) << (msg)

TEST_F(GgufMalformed, TheValidFileReadsBack) {
  GgufFile f(write(v.g.b));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset(), v.data_at);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_floats("tokenizer.ggml.scores"), (std::vector<double>{0.5, -1.0, 2.0}));
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensor("tok.weight").shape(), (std::vector<std::int64_t>{3, 4}));
  EXPECT_EQ(f.tensor("blk.0.q").n_bytes, 68u);
  at::Tensor tok = load_tensor(f, "tok.weight", DType::kF32);
  for (int i = 0; i < 12; ++i)
    EXPECT_EQ(tok.view({-1})[i].item<float>(), v.tok_values[i]) << i;
  at::Tensor q = load_tensor(f, "blk.0.q", DType::kF32);
  ASSERT_EQ(q.sizes().vec(), (std::vector<std::int64_t>{2, 32}));
  for (int i = 0; i < 64; ++i)  // q * 0.5, exact in float64
    EXPECT_EQ(q.view({-1})[i].item<float>(), 0.5 * v.q_values[i]) << i;
}

// tensor_data() also serves infos a caller built: an offset that would wrap data_offset + offset
// around to the file's header is refused, not read.
TEST_F(GgufMalformed, HandMadeInfoCannotWrapAroundTheOffset) {
  const std::string path = write(v.g.b);
  GgufFile f(path);
  GgufTensorInfo info = f.tensor("tok.weight");
  EXPECT_EQ(f.tensor_data(info), f.tensor_data(f.tensor("tok.weight")));
  info.offset = ~std::uint64_t{0} - v.data_at + 1;  // data_at + offset == 2^64, i.e. 0
  try {
    f.tensor_data(info);
    ADD_FAILURE() << "a wrapped offset was read";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_HAS(msg, path);
    EXPECT_HAS(msg, "'tok.weight'");
    EXPECT_HAS(msg, "beyond the end");
  }
  info.offset = v.g.b.size() - v.data_at - 4;  // inside, but 48 bytes do not fit
  EXPECT_THROW(f.tensor_data(info), Error);
}

TEST_F(GgufMalformed, Version2HasTheSameLayout) {
  auto g = v.g;
  g.set_u32(4, 2);
  GgufFile f(write(g.b));
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.tensor("blk.0.q").n_bytes, 68u);
  g.set_u32(4, 1);  // v1 used 32-bit counts: refused, not misread
  EXPECT_HAS(open_error(g.b), "version 1");
}

TEST_F(GgufMalformed, TruncatedHeader) {
  std::vector<std::uint8_t> bytes(v.g.b.begin(), v.g.b.begin() + 10);  // inside the tensor count
  std::string msg = open_error(bytes);
  EXPECT_HAS(msg, "header");
  EXPECT_HAS(msg, "tensor count");
}

TEST_F(GgufMalformed, NotGguf) {
  auto b = v.g.b;
  b[0] = 'X';
  EXPECT_HAS(open_error(b), "not a GGUF file");
  EXPECT_HAS(open_error({}), "not a GGUF file");
}

TEST_F(GgufMalformed, UnsupportedVersion) {
  auto g = v.g;
  g.set_u32(4, 0x03000000);  // a big-endian v3 file, read little-endian
  EXPECT_HAS(open_error(g.b), "version 50331648");
}

TEST_F(GgufMalformed, TruncatedMetadataString) {
  auto g = v.g;
  g.set_u64(v.arch_len_at, 1000);  // "llama" claims 1000 bytes
  std::string msg = open_error(g.b);
  EXPECT_HAS(msg, "'general.architecture'");
  EXPECT_HAS(msg, "1000 bytes");
  // And a file cut in the middle of the string (counts lowered so that they still fit).
  Builder cut;
  cut.b.assign(v.g.b.begin(), v.g.b.begin() + v.arch_len_at + 8 + 2);
  cut.set_u64(8, 0);
  cut.set_u64(v.kv_count_at, 1);
  msg = open_error(cut.b);
  EXPECT_HAS(msg, "'general.architecture'");
  EXPECT_HAS(msg, "truncated");
}

TEST_F(GgufMalformed, AbsurdArrayCount) {
  auto g = v.g;
  g.set_u64(v.array_count_at, std::uint64_t{1} << 61);  // would be 2^63 bytes of floats
  std::string msg = open_error(g.b);
  EXPECT_HAS(msg, "'tokenizer.ggml.scores'");
  EXPECT_HAS(msg, "2305843009213693952");
}

TEST_F(GgufMalformed, AbsurdMetadataAndTensorCounts) {
  auto g = v.g;
  g.set_u64(v.kv_count_at, ~std::uint64_t{0});
  EXPECT_HAS(open_error(g.b), "metadata count 18446744073709551615");
  auto h = v.g;
  h.set_u64(8, std::uint64_t{1} << 40);
  EXPECT_HAS(open_error(h.b), "tensor count 1099511627776");
}

TEST_F(GgufMalformed, TensorOutOfRange) {
  auto g = v.g;
  g.set_u64(v.q_offset_at, 4096);  // aligned, but past the end of the file
  std::string msg = open_error(g.b);
  EXPECT_HAS(msg, "'blk.0.q'");
  EXPECT_HAS(msg, "outside");
  // An offset so large that data offset + offset overflows 64 bits.
  auto h = v.g;
  h.set_u64(v.q_offset_at, ~std::uint64_t{0} - 31);
  EXPECT_HAS(open_error(h.b), "'blk.0.q'");
  // Truncating the data section cuts the last tensor short.
  std::vector<std::uint8_t> cut(v.g.b.begin(), v.g.b.end() - 1);
  EXPECT_HAS(open_error(cut), "'blk.0.q'");
}

TEST_F(GgufMalformed, OverlappingTensors) {
  auto g = v.g;
  g.set_u64(v.q_offset_at, 32);  // tok.weight occupies 0..48
  std::string msg = open_error(g.b);
  EXPECT_HAS(msg, "'blk.0.q'");
  EXPECT_HAS(msg, "'tok.weight'");
  EXPECT_HAS(msg, "overlap");
}

TEST_F(GgufMalformed, UnknownType) {
  auto g = v.g;
  g.set_u32(v.q_type_at, 99);
  std::string msg = open_error(g.b);
  EXPECT_HAS(msg, "'blk.0.q'");
  EXPECT_HAS(msg, "unknown ggml type 99");
}

TEST_F(GgufMalformed, DimsDoNotMatchTheTypesBlockSize) {
  auto g = v.g;
  g.set_u64(v.q_ne0_at, 33);  // a Q8_0 row must be whole blocks of 32
  std::string msg = open_error(g.b);
  EXPECT_HAS(msg, "'blk.0.q'");
  EXPECT_HAS(msg, "33");
  EXPECT_HAS(msg, "block size 32");
  // Dimensions whose product overflows.
  auto h = v.g;
  h.set_u64(v.tok_ne0_at, std::uint64_t{1} << 62);
  EXPECT_HAS(open_error(h.b), "'tok.weight'");
}

TEST_F(GgufMalformed, DuplicateTensorName) {
  Builder x;  // two F32 tensors named "blk.0.q", at different offsets
  x.put("GGUF", 4);
  x.u32(3);
  x.u64(2);
  x.u64(0);
  for (std::uint64_t off : {0, 64}) {
    x.str("blk.0.q");
    x.u32(1);
    x.u64(4);
    x.u32(0);
    x.u64(off);
  }
  x.pad_to(32);
  x.b.resize(x.b.size() + 96, 0);
  std::string msg = open_error(x.b);
  EXPECT_HAS(msg, "'blk.0.q'");
  EXPECT_HAS(msg, "two tensors");
}

TEST_F(GgufMalformed, DuplicateKey) {
  Builder x;
  x.put("GGUF", 4);
  x.u32(3);
  x.u64(0);
  x.u64(2);
  for (int i = 0; i < 2; ++i) {
    x.str("general.name");
    x.u32(4);
    x.u32(7);
  }
  std::string msg = open_error(x.b);
  EXPECT_HAS(msg, "'general.name'");
  EXPECT_HAS(msg, "twice");
}

TEST_F(GgufMalformed, BadAlignmentAndUnalignedOffset) {
  auto g = v.g;
  g.set_u32(v.alignment_at, 48);
  EXPECT_HAS(open_error(g.b), "'general.alignment'");
  auto h = v.g;
  h.set_u64(v.q_offset_at, 60);
  std::string msg = open_error(h.b);
  EXPECT_HAS(msg, "'blk.0.q'");
  EXPECT_HAS(msg, "alignment");
}

TEST_F(GgufMalformed, WrongTypeAndMissingKeyAreNamed) {
  GgufFile f(write(v.g.b));
  try {
    f.get_int("general.architecture");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_HAS(std::string(e.what()), "'general.architecture'");
    EXPECT_HAS(std::string(e.what()), "STRING");
  }
  try {
    f.get_string("llama.block_count");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_HAS(std::string(e.what()), "'llama.block_count'");
    EXPECT_HAS(std::string(e.what()), "missing");
  }
  EXPECT_THROW(load_tensor(f, "nope", DType::kF32), Error);
}

// Every prefix of a valid file is a truncated file: each must fail cleanly (the full file opens).
TEST_F(GgufMalformed, EveryTruncationFailsCleanly) {
  for (std::size_t n = 0; n < v.g.b.size(); ++n) {
    std::vector<std::uint8_t> cut(v.g.b.begin(), v.g.b.begin() + n);
    const std::string path = write(cut);
    EXPECT_THROW(GgufFile f(path), Error) << "prefix of " << n << " bytes";
  }
}

// Random corruption of header and infos: opening either works or throws Error; tensors of a file
// that opens dequantise without touching bytes outside the file.
TEST_F(GgufMalformed, RandomCorruptionNeverCrashes) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 300; ++trial) {
    auto b = v.g.b;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i)
      b[rng() % v.data_at] = static_cast<std::uint8_t>(rng());
    const std::string path = write(b);
    try {
      GgufFile f(path);
      for (const GgufTensorInfo& t : f.tensors())
        if (ggml_type_info(t.type).dequantizable && t.n_elements < (1u << 20))
          (void)load_tensor(f, t.name, DType::kBF16);
    } catch (const Error&) {
    }
    std::filesystem::remove(path);
    paths_.pop_back();
  }
}

}  // namespace
}  // namespace rondo::models
