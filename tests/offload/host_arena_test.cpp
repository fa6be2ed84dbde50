// Host arena: page alignment without power-of-two waste, accounting by purpose, the budget error,
// NUMA placement, pinning policy, buffers that outlive the arena, concurrent use (also under TSan).
#include "offload/host_arena.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "kernels/host_memory.h"

namespace rondo::offload {
namespace {

const std::uint64_t kPage = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));

TEST(HostArena, BuffersArePageAlignedWritableAndNotRoundedToPowersOfTwo) {
  HostArena arena({.pinning = Pinning::kOff});
  for (std::uint64_t n :
       {std::uint64_t{1}, std::uint64_t{22}, std::uint64_t{4097}, (std::uint64_t{5} << 20) + 3}) {
    HostBuffer b = arena.allocate(n, Purpose::kWeights);
    ASSERT_TRUE(b);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % kPage, 0u);
    EXPECT_EQ(b.bytes(), n);
    std::memset(b.data(), 0x11, n);  // all of it is ours to write
    EXPECT_EQ(b.as<std::uint8_t>()[n - 1], 0x11);
    // Mapped to the next page only: 5 MiB + 3 bytes costs 5 MiB + one page, not 8 MiB.
    EXPECT_EQ(arena.usage().bytes_mapped, (n + kPage - 1) / kPage * kPage);
  }
  EXPECT_EQ(arena.usage().bytes, 0u);
  EXPECT_EQ(arena.usage().bytes_mapped, 0u);
}

TEST(HostArena, AccountsByPurpose) {
  HostArena arena({.pinning = Pinning::kOff});
  HostBuffer w = arena.allocate(1000, Purpose::kWeights);
  HostBuffer g = arena.allocate(300, Purpose::kGradients);
  HostBuffer m = arena.allocate(4000, Purpose::kOptimizerState);
  HostBuffer m2 = arena.allocate(22, Purpose::kOptimizerState);
  HostUsage u = arena.usage();
  EXPECT_EQ(u[Purpose::kWeights].bytes, 1000u);
  EXPECT_EQ(u[Purpose::kGradients].bytes, 300u);
  EXPECT_EQ(u[Purpose::kOptimizerState].bytes, 4022u);
  EXPECT_EQ(u[Purpose::kOptimizerState].buffers, 2u);
  EXPECT_EQ(u[Purpose::kActivations].bytes, 0u);
  EXPECT_EQ(u.bytes, 5322u);
  m.reset();
  u = arena.usage();
  EXPECT_EQ(u[Purpose::kOptimizerState].bytes, 22u);
  EXPECT_EQ(u[Purpose::kOptimizerState].peak, 4022u);
  EXPECT_EQ(u.peak, 5322u);
  EXPECT_EQ(u.bytes, 1322u);
  // Peaks measured again from here: what is in use now, then what comes.
  arena.reset_peaks();
  u = arena.usage();
  EXPECT_EQ(u.peak, 1322u);
  EXPECT_EQ(u[Purpose::kOptimizerState].peak, 22u);
  HostBuffer s = arena.allocate(500, Purpose::kStaging);
  s.reset();
  u = arena.usage();
  EXPECT_EQ(u.peak, 1822u);
  EXPECT_EQ(u[Purpose::kStaging].peak, 500u);
  EXPECT_EQ(u[Purpose::kWeights].peak, 1000u);
}

TEST(HostArena, MovingABufferKeepsOneOwner) {
  HostArena arena({.pinning = Pinning::kOff});
  HostBuffer a = arena.allocate(100, Purpose::kStaging);
  void* p = a.data();
  HostBuffer b = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_EQ(b.data(), p);
  HostBuffer c;
  c = std::move(b);
  EXPECT_EQ(arena.usage()[Purpose::kStaging].buffers, 1u);
  c.reset();
  EXPECT_EQ(arena.usage()[Purpose::kStaging].buffers, 0u);
}

TEST(HostArena, TheBudgetErrorSaysWhatIsInUse) {
  HostArena arena({.pinning = Pinning::kOff, .bytes_limit = 10000});
  HostBuffer w = arena.allocate(6000, Purpose::kWeights);
  try {
    arena.allocate(5000, Purpose::kOptimizerState);
    FAIL() << "allocation past the budget succeeded";
  } catch (const HostOutOfMemory& e) {
    EXPECT_EQ(e.requested, 5000u);
    EXPECT_EQ(e.used, 6000u);
    EXPECT_EQ(e.limit, 10000u);
    std::string msg = e.what();
    EXPECT_NE(msg.find("optimizer_state"), std::string::npos) << msg;
    EXPECT_NE(msg.find("weights"), std::string::npos) << msg;
    EXPECT_NE(msg.find("budget"), std::string::npos) << msg;
  }
  EXPECT_EQ(arena.usage().bytes, 6000u);  // the failed request left nothing behind
  HostBuffer fits = arena.allocate(4000, Purpose::kOptimizerState);
  EXPECT_TRUE(fits);
}

TEST(HostArena, PlacesMemoryOnTheRequestedNumaNode) {
  HostArena arena({.pinning = Pinning::kOff});
  ASSERT_GE(arena.numa_nodes(), 1);
  const int node = arena.numa_nodes() - 1;
  HostBuffer b = arena.allocate(4 << 20, Purpose::kWeights, node);
  std::memset(b.data(), 1, b.bytes());  // first touch
  EXPECT_EQ(b.numa_node(), node);
  std::uint64_t where = arena.numa_nodes_of(b.data(), b.bytes());
  if (where == 0) GTEST_SKIP() << "this kernel does not report page locations";
  EXPECT_EQ(where, std::uint64_t{1} << node);
}

TEST(HostArena, RejectsANodeThatDoesNotExist) {
  HostArena arena({.pinning = Pinning::kOff});
  try {
    arena.allocate(100, Purpose::kWeights, 63);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NUMA node 63"), std::string::npos) << e.what();
  }
  EXPECT_THROW(HostArena({.numa_node = 63}), Error);
  EXPECT_EQ(arena.usage().bytes, 0u);
}

// The warning for buffers the OS would not page-lock says how many and how much, what it costs
// and what to change; none is said when every buffer was locked.
TEST(HostArena, APinFailureWarningSaysWhatToChange) {
  EXPECT_EQ(pin_failure_warning(HostUsage{}), "");
  HostUsage u;
  u.pin_failures = 3;
  u.pin_failed_bytes = 3ull << 30;
  const std::string w = pin_failure_warning(u);
  for (const char* part :
       {"3 host buffer(s)", "3.00 GiB", "page-locked", "ulimit -l", "hardware.host_memory"})
    EXPECT_NE(w.find(part), std::string::npos) << part << " in: " << w;
}

TEST(HostArena, PinsExactlyWhenAGpuIsPresent) {
  HostArena automatic({.pinning = Pinning::kAuto});
  const bool gpu = kernels::host_pinning_available();
  EXPECT_EQ(automatic.pins(), gpu);
  HostBuffer b = automatic.allocate(1 << 20, Purpose::kStaging);
  HostUsage u = automatic.usage();
  if (gpu) {
    EXPECT_EQ(b.pinned() ? u.bytes_pinned : u.pin_failures, b.pinned() ? b.bytes() : 1u);
  } else {
    EXPECT_FALSE(b.pinned());
    EXPECT_EQ(u.bytes_pinned, 0u);
    try {
      HostArena forced({.pinning = Pinning::kOn});
      FAIL() << "pinning = on accepted without a GPU";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("pinning"), std::string::npos) << e.what();
    }
  }
}

TEST(HostArena, BuffersMayOutliveTheArena) {
  HostBuffer b;
  {
    HostArena arena({.pinning = Pinning::kOff});
    b = arena.allocate(4097, Purpose::kActivations);
  }
  std::memset(b.data(), 2, b.bytes());
  b.reset();
}

TEST(HostArena, ConcurrentAllocationsKeepTheBooksStraight) {
  HostArena arena({.pinning = Pinning::kOff, .bytes_limit = 64 << 20});
  constexpr int kThreads = 4, kRounds = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&arena, t] {
      std::vector<HostBuffer> held;
      for (int i = 0; i < kRounds; ++i) {
        auto purpose = static_cast<Purpose>((t + i) % kPurposeCount);
        held.push_back(arena.allocate(1 + (i * 4099) % 65536, purpose));
        held.back().as<std::uint8_t>()[0] = static_cast<std::uint8_t>(i);
        if (held.size() > 8) held.erase(held.begin());
        (void)arena.usage();
      }
    });
  }
  for (auto& th : threads)
    th.join();
  HostUsage u = arena.usage();
  EXPECT_EQ(u.bytes, 0u);
  EXPECT_EQ(u.bytes_mapped, 0u);
  for (int p = 0; p < kPurposeCount; ++p)
    EXPECT_EQ(u.by_purpose[p].buffers, 0u);
  EXPECT_GT(u.peak, 0u);
  EXPECT_LE(u.peak, std::uint64_t{64} << 20);
}

}  // namespace
}  // namespace rondo::offload
