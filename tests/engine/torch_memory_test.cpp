// What torch allocates while it computes on a simulated device counts against that device's cap
// (Note [Torch's memory on a simulated device], engine/torch_device.cpp), as it would on a card:
// the ledger sees the tensors while they live and lets them go when they are freed (on any
// thread), past the cap an allocation is OutOfMemory, and work outside a device's scope is not
// counted.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>

#include "engine/torch_device.h"
#include "kernels/cpu/sim_device.h"
#include "kernels/error.h"

namespace rondo::engine {
namespace {

TEST(TorchMemory, TensorsComputedOnASimulatedDeviceCountAgainstItsCap) {
  auto dev = kernels::make_sim_device({.name = "sim0", .bytes_cap = 64ull << 20});
  kernels::Stream& stream = dev->create_stream("compute");
  const std::uint64_t before = dev->memory().bytes_in_use;

  // 8 MiB of floats made on the device's stream, kept past the work: counted while alive.
  at::Tensor kept;
  stream.enqueue([&] {
    TorchStreamScope scope(stream);
    kept = at::ones({2 << 20}, at::kFloat);
  });
  stream.synchronize();
  EXPECT_EQ(dev->memory().bytes_in_use - before, 8ull << 20);
  EXPECT_GE(dev->memory().bytes_peak - before, 8ull << 20);
  EXPECT_EQ(dev->memory().allocations, 0u) << "tensors are not the device's buffers";
  kept.reset();  // freed on this thread, not the stream's
  EXPECT_EQ(dev->memory().bytes_in_use, before);

  // A computation whose temporaries pass the cap fails as the device would.
  std::optional<std::string> error;
  stream.enqueue([&] {
    TorchStreamScope scope(stream);
    try {
      const at::Tensor big = at::ones({1 << 13, 1 << 11}, at::kFloat);  // 64 MiB
      (void)(big * 2);
    } catch (const kernels::OutOfMemory& e) {
      error = e.what();
    }
  });
  stream.synchronize();
  ASSERT_TRUE(error.has_value()) << "64 MiB and its double allocated under a 64 MiB cap";
  EXPECT_NE(error->find("sim0"), std::string::npos) << *error;
  EXPECT_EQ(dev->memory().bytes_in_use, before) << "a failed computation leaves nothing counted";

  // Outside a device's scope (here, and after the scope on the stream's thread) nothing counts.
  const at::Tensor elsewhere = at::ones({4 << 20}, at::kFloat);
  at::Tensor after_scope;
  stream.enqueue([&] {
    { TorchStreamScope scope(stream); }
    after_scope = at::ones({4 << 20}, at::kFloat);
  });
  stream.synchronize();
  EXPECT_EQ(dev->memory().bytes_in_use, before) << "tensors made outside the scope were counted";
}

}  // namespace
}  // namespace rondo::engine
