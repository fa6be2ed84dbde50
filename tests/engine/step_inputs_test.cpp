// A step's inputs as a pure function (engine/step_inputs.h): the checks a bad microbatch meets,
// what is counted, and the packing into one buffer (offsets at 256-byte boundaries, every tensor
// back bit for bit from a copy of the buffer). No threads, no devices.
#include "engine/step_inputs.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/error.h"
#include "tests/support/error_of.h"
#include "tests/support/plain_loop.h"

namespace rondo::engine {
namespace {

using test::error_of;

TEST(StepInputs, PackingPlacesEachTensorAtA256ByteBoundary) {
  const std::vector<at::Tensor> tensors = {
      at::arange(6, at::kLong).view({2, 3}),                // 48 bytes at 0
      at::Tensor(),                                         // no bytes
      at::rand({5}),                                        // 20 bytes at 256
      at::rand({3, 3}).gt(0.5).view({1, 1, 3, 3}),          // 9 bytes at 512
      at::rand({4, 2}).t()};                                // not contiguous: 32 bytes at 768
  const PackedLayout layout = pack_layout(tensors);
  ASSERT_EQ(layout.tensors.size(), tensors.size());
  EXPECT_FALSE(layout.tensors[1].defined);
  EXPECT_EQ(layout.tensors[0].offset, 0u);
  EXPECT_EQ(layout.tensors[2].offset, 256u);
  EXPECT_EQ(layout.tensors[3].offset, 512u);
  EXPECT_EQ(layout.tensors[4].offset, 768u);
  EXPECT_EQ(layout.bytes, 768u + 32u);
  std::vector<std::uint8_t> buffer(layout.bytes, 0xA5);
  pack_into(buffer.data(), layout, tensors);
  // A copy of the buffer (as on a device) gives every tensor back.
  std::vector<std::uint8_t> copy = buffer;
  const std::vector<at::Tensor> views = packed_views(copy.data(), layout, at::kCPU);
  ASSERT_EQ(views.size(), tensors.size());
  EXPECT_FALSE(views[1].defined());
  for (std::size_t i : {0u, 2u, 3u, 4u}) {
    EXPECT_EQ(views[i].sizes(), tensors[i].sizes()) << i;
    EXPECT_EQ(views[i].scalar_type(), tensors[i].scalar_type()) << i;
    EXPECT_TRUE(at::equal(views[i], tensors[i])) << i;
  }
  // Nothing written between the tensors.
  for (std::size_t at = 48; at < 256; ++at)
    ASSERT_EQ(buffer[at], 0xA5) << at;
}

TEST(StepInputs, BadMicrobatchesAreNamed) {
  const models::ModelConfig config = test::tiny_llama(2);
  auto mb = [&](at::Tensor tokens, at::Tensor targets) {
    return Microbatch{.batch = {.tokens = tokens}, .targets = targets};
  };
  const at::Tensor ok = at::randint(config.vocab_size, {2, 5}, at::kLong);
  EXPECT_NE(error_of([&] {
              prepare_step_inputs(config, at::kFloat, "step 3", {mb(ok, ok), mb(at::zeros({0, 5}, at::kLong), ok)});
            }).find("step 3, microbatch 1: tokens must be a non-empty (B, T) tensor"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              prepare_step_inputs(config, at::kFloat, "step 3", {mb(ok, ok.narrow(1, 0, 4))});
            }).find("step 3, microbatch 0: targets must have the tokens' shape"),
            std::string::npos);
  at::Tensor bad = ok.clone();
  bad[1][3] = config.vocab_size;
  const std::string e =
      error_of([&] { prepare_step_inputs(config, at::kFloat, "step 3", {mb(bad, ok)}); });
  EXPECT_NE(e.find("token id " + std::to_string(config.vocab_size) + " is outside the vocabulary"),
            std::string::npos)
      << e;
}

TEST(StepInputs, CountsTokensAndTargetsAndPacksDocuments) {
  const models::ModelConfig config = test::tiny_llama(2);
  // Microbatch 0: one document per row; microbatch 1: its first row packs two documents.
  at::Tensor t0 = at::randint(config.vocab_size, {2, 6}, at::kLong);
  at::Tensor y0 = at::randint(config.vocab_size, {2, 6}, at::kLong);
  y0[0][0] = -100;
  y0[1][5] = -100;
  at::Tensor t1 = at::randint(config.vocab_size, {2, 6}, at::kLong);
  at::Tensor y1 = at::full({2, 6}, -100, at::kLong);
  y1[0][2] = 7;
  at::Tensor docs = at::tensor({0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0}, at::kLong).view({2, 6});
  std::vector<Microbatch> mbs = {{.batch = {.tokens = t0}, .targets = y0},
                                 {.batch = {.tokens = t1, .doc_ids = docs}, .targets = y1}};
  const StepInputs in = prepare_step_inputs(config, at::kBFloat16, "step 1", std::move(mbs));
  EXPECT_EQ(in.tokens, 24);
  EXPECT_EQ(in.targets, 10 + 1);
  ASSERT_EQ(in.tensors.size(), 2u * kInputParts);
  EXPECT_FALSE(in.tensors[kDocs].defined());
  ASSERT_TRUE(in.tensors[kInputParts + kDocs].defined());
  EXPECT_TRUE(in.tensors[kInputParts + kDocOffsets].defined());
  EXPECT_EQ(in.tensors[kCos].scalar_type(), at::kBFloat16);
  // Three documents in microbatch 1 (two in its first row, one in its second).
  EXPECT_EQ(in.spans[1].offsets, (std::vector<std::int64_t>{0, 3, 6, 12}));
  std::vector<std::uint8_t> buffer(in.layout.bytes);
  pack_into(buffer.data(), in.layout, in.tensors);
  const std::vector<MicrobatchInputs> views = microbatch_views(buffer.data(), in.layout, at::kCPU);
  ASSERT_EQ(views.size(), 2u);
  EXPECT_TRUE(at::equal(views[0].tokens, t0));
  EXPECT_TRUE(at::equal(views[0].targets, y0));
  EXPECT_TRUE(at::equal(views[1].tokens, t1));
  EXPECT_TRUE(at::equal(views[1].docs, in.tensors[kInputParts + kDocs]));
  EXPECT_FALSE(views[0].docs.defined());
  EXPECT_TRUE(at::equal(views[1].ctx.cos, in.tensors[kInputParts + kCos]));
}

}  // namespace
}  // namespace rondo::engine
