// Where generation keeps the weights and the KV caches (engine::choose_residency), as a pure
// function: cases worked out by hand from the rule in engine/generation.h. No threads, no devices.
#include "engine/generation.h"

#include <gtest/gtest.h>

#include <string>

namespace rondo::engine {
namespace {

// Layers: embedding 0, blocks 1-2, head 3, of 50 / 100 / 100 / 50 bytes; the plan F[0,2) T[2,4)
// (or F[0,1) F[1,2) F[2,3) T[3,4)); `extra` is 10 bytes per block plus 5.
ResidencyQuery query(std::vector<std::uint64_t> room, bool four_stages = false) {
  ResidencyQuery q;
  q.layer_bytes = {50, 100, 100, 50};
  if (four_stages) {
    q.forward = {{0, 1}, {1, 2}, {2, 3}};
    q.tail = {3, 4};
    q.stage_layers = {{0}, {1}, {2}, {3}};
  } else {
    q.forward = {{0, 2}};
    q.tail = {2, 4};
    q.stage_layers = {{0, 1}, {2, 3}};
  }
  q.first_device_room = room[0];
  q.room = std::move(room);
  q.extra = [](std::int64_t blocks) { return static_cast<std::uint64_t>(10 * blocks + 5); };
  q.blocks = 2;
  return q;
}

// What a choice keeps where, in words.
std::string kind(const ResidencyChoice& c) {
  const std::string caches = c.kv_host ? ", caches in host memory" : "";
  if (c.resident) return "resident" + caches;
  return (c.spread ? "spread" : "streamed") + caches;
}

TEST(Residency, ResidentWhenEverythingFitsTheFirstDevice) {
  // 300 bytes of weights + 25 = 325.
  ResidencyChoice c = choose_residency(query({325, 0}));
  EXPECT_EQ(kind(c), "resident");
  ASSERT_EQ(c.stages.size(), 1u);
  EXPECT_EQ(c.stages[0].range, (LayerRange{0, 4}));
  EXPECT_EQ(c.stages[0].device, 0);
  EXPECT_EQ(c.stages[0].layers, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_FALSE(choose_residency(query({324, 0})).resident);
}

TEST(Residency, SpreadWhenEveryDeviceHoldsItsStages) {
  // Device 0: F[0,2) = 150 bytes and one block (15); device 1: T[2,4) = 150 and one block.
  ResidencyChoice c = choose_residency(query({165, 165}));
  EXPECT_EQ(kind(c), "spread");
  ASSERT_EQ(c.stages.size(), 2u);
  EXPECT_EQ(c.stages[0].device, 0);
  EXPECT_EQ(c.stages[1].device, 1);
  EXPECT_EQ(c.stages[1].layers, (std::vector<int>{2, 3}));
  EXPECT_FALSE(choose_residency(query({165, 164})).spread);
}

TEST(Residency, StreamedKeepsCachesOnTheDevicesWhileTwoStagesFit) {
  // One device, four stages: streamed. The two largest stages hold 200 bytes; the device runs
  // both blocks (25): 225.
  ResidencyChoice c = choose_residency(query({225}, /*four_stages=*/true));
  EXPECT_EQ(kind(c), "streamed");
  EXPECT_EQ(c.stages.size(), 4u);
  for (const GenerationStage& st : c.stages)
    EXPECT_EQ(st.device, 0);
  EXPECT_EQ(kind(choose_residency(query({224}, true))), "streamed, caches in host memory");
  // Two devices: stage j on device j % 2, each running one block: 150 bytes of stages + 15.
  ResidencyChoice c2 = choose_residency(query({165, 165}, true));
  EXPECT_EQ(kind(c2), "spread");
  EXPECT_EQ(c2.stages[2].device, 0);
  EXPECT_EQ(c2.stages[3].device, 1);
  // Device 0: the two largest stages (200) + 15 > 164.
  EXPECT_EQ(kind(choose_residency(query({164, 215}, true))), "streamed, caches in host memory");
}

TEST(Residency, WhatIsAskedForWins) {
  ResidencyQuery q = query({0, 0});
  q.residency = Residency::kResident;
  EXPECT_EQ(kind(choose_residency(q)), "resident");
  q.residency = Residency::kSpread;
  EXPECT_EQ(kind(choose_residency(q)), "spread");
  q.residency = Residency::kStreamed;
  q.kv_caches = KvCaches::kHost;
  EXPECT_EQ(kind(choose_residency(q)), "streamed, caches in host memory");
  q.kv_caches = KvCaches::kDevice;
  EXPECT_EQ(kind(choose_residency(q)), "streamed");
  // A plan of one stage (the whole model in the tail) is resident whatever the room.
  ResidencyQuery one = query({0, 0});
  one.forward.clear();
  one.tail = {0, 4};
  one.stage_layers = {{0, 1, 2, 3}};
  EXPECT_TRUE(choose_residency(one).resident);
}

}  // namespace
}  // namespace rondo::engine
