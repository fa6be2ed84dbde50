// LayerStore: per-layer regions laid out as documented, tied tensors shared but with their own
// gradient, accounting by purpose, and errors for inconsistent descriptions.
#include "offload/layer_store.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

namespace rondo::offload {
namespace {

using kernels::FloatDType;

std::vector<LayerDesc> model(bool train_embedding) {
  return {
      {{{"embed", 22 * 7, train_embedding, -1}}},
      {{{"norm", 7, true, -1}, {"q", 7 * 7, true, -1}, {"frozen", 4097, false, -1}}},
      {{{"final_norm", 7, true, -1}, {"embed", 22 * 7, train_embedding, 0}}},
  };
}

std::size_t up64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

TEST(LayerStore, RegionsAreAlignedDisjointAndAccounted) {
  HostArena arena({.pinning = Pinning::kOff});
  LayerStore store(arena, model(true), FloatDType::kBF16, FloatDType::kF32);
  ASSERT_EQ(store.layers(), 3u);
  // Fill every streaming copy and gradient with its own byte, then check none was overwritten.
  std::set<const void*> streams, grads;
  int tag = 1;
  for (std::size_t l = 0; l < store.layers(); ++l)
    for (const TensorState& t : store.layer(l)) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.stream) % 64, 0u) << t.name;
      if (!t.tied) {
        EXPECT_TRUE(streams.insert(t.stream).second);
        std::memset(t.stream, tag, t.numel * 2);
      }
      if (t.trainable) {
        ASSERT_NE(t.grad, nullptr);
        EXPECT_TRUE(grads.insert(t.grad).second) << t.name;  // tied ones too: their own
        std::memset(t.grad, tag + 100, t.numel * 4);
        ASSERT_NE(t.master, nullptr);
        if (!t.tied) {  // a tied tensor's master is its owner's
          t.master[t.numel - 1] = static_cast<float>(tag);
          t.v[0] = static_cast<float>(-tag);
        }
      }
      ++tag;
    }
  tag = 1;
  for (std::size_t l = 0; l < store.layers(); ++l)
    for (const TensorState& t : store.layer(l)) {
      auto* s = static_cast<const std::uint8_t*>(t.stream);
      if (!t.tied) {
        EXPECT_EQ(s[t.numel * 2 - 1], tag) << t.name;
      }
      if (t.trainable) {
        EXPECT_EQ(static_cast<const std::uint8_t*>(t.grad)[t.numel * 4 - 1], tag + 100) << t.name;
        if (!t.tied) {
          EXPECT_EQ(t.master[t.numel - 1], static_cast<float>(tag)) << t.name;
        }
      }
      ++tag;
    }
  // The head's embedding is the prefix's: same streaming copy and master.
  const TensorState& owner = store.tensor(0, "embed");
  const TensorState& tied = store.tensor(2, "embed");
  EXPECT_TRUE(tied.tied);
  EXPECT_EQ(tied.stream, owner.stream);
  EXPECT_EQ(tied.master, owner.master);
  EXPECT_NE(tied.grad, owner.grad);

  // Bytes by purpose, from the layout rule: 64-byte aligned tensors.
  const std::size_t e = 22 * 7;
  HostUsage u = arena.usage();
  EXPECT_EQ(u[Purpose::kWeights].bytes,
            up64(e * 2) + up64(7 * 2) + up64(49 * 2) + up64(4097 * 2) + up64(7 * 2));
  EXPECT_EQ(u[Purpose::kGradients].bytes,
            up64(e * 4) + up64(7 * 4) + up64(49 * 4) + up64(7 * 4) + up64(e * 4));
  EXPECT_EQ(u[Purpose::kOptimizerState].bytes,
            3 * (up64(e * 4) + up64(7 * 4) + up64(49 * 4) + up64(7 * 4)));
  // A layer's streaming region covers exactly its own tensors.
  EXPECT_EQ(store.stream_bytes(1).bytes, up64(7 * 2) + up64(49 * 2) + up64(4097 * 2));
  EXPECT_EQ(store.stream_bytes(1).data, store.layer(1)[0].stream);
  EXPECT_EQ(store.stream_bytes(2).bytes, up64(7 * 2));  // the tied embedding is the prefix's
}

TEST(LayerStore, FrozenTensorsHaveNoOptimizerState) {
  HostArena arena({.pinning = Pinning::kOff});
  LayerStore store(arena, model(false), FloatDType::kBF16, FloatDType::kBF16);
  const TensorState& f = store.tensor(1, "frozen");
  EXPECT_EQ(f.master, nullptr);
  EXPECT_EQ(f.grad, nullptr);
  EXPECT_EQ(store.tensor(2, "embed").grad, nullptr);
  EXPECT_EQ(store.grad_bytes(0).bytes, 0u);
}

TEST(LayerStore, InconsistentDescriptionsAreRefused) {
  HostArena arena({.pinning = Pinning::kOff});
  auto later = model(true);
  later[0].tensors[0].tied_to_layer = 2;
  EXPECT_THROW(LayerStore(arena, later, FloatDType::kBF16, FloatDType::kF32), Error);
  auto missing = model(true);
  missing[2].tensors[1].name = "nope";
  try {
    LayerStore(arena, missing, FloatDType::kBF16, FloatDType::kF32);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
  }
  auto twice = model(true);
  twice[1].tensors[1].name = "norm";
  EXPECT_THROW(LayerStore(arena, twice, FloatDType::kBF16, FloatDType::kF32), Error);
}

}  // namespace
}  // namespace rondo::offload
