// The ranks of a data-parallel run (engine/ranks.h) on loopback, in threads of one process: sums
// and broadcasts across 2 and 3 ranks, a rank that leaves, and the layout of c10d's Gloo process
// group as engine/ranks.cpp compiles it against Debian's gloo headers (Note [Gloo's headers]).
// This file includes ProcessGroupGloo.hpp too, under the same rules: no gloo object made here.
#include "engine/ranks.h"
#include "engine/devices.h"
#include "engine/sharding.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../support/free_port.h"

namespace {

using rondo::engine::Collective;
using rondo::engine::DistributedSettings;
using rondo::engine::RankEnv;
using rondo::engine::Ranks;
using rondo::test::free_port;

// libtorch's process groups share lazily made singletons (c10d's FlightRecorder); several ranks
// made at once in threads of one process (only these tests do that: a run is one rank a process)
// race to make them. One group made first, on this thread, makes them before any rank's thread
// starts. (These tests are not run under ThreadSanitizer: scripts/test.sh says why.)
void make_c10d_singletons() {
  static const bool made = [] {
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                                options);
    return true;
  }();
  (void)made;
}

// Runs body(rank, ranks) for every rank of `world`, each on its own thread with its own connection;
// the first failure is rethrown.
void on_ranks(int world, const std::function<void(int, Ranks&)>& body, double timeout_s = 30) {
  make_c10d_singletons();
  const int port = free_port();
  ASSERT_GT(port, 0);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Ranks> ranks =
            Ranks::connect(RankEnv{.rank = r, .world = world, .master_port = port},
                           DistributedSettings{.timeout_s = timeout_s});
        body(r, *ranks);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

TEST(Ranks, SumAndBroadcastOverTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    on_ranks(world, [world](int rank, Ranks& ranks) {
      EXPECT_EQ(ranks.rank(), rank);
      EXPECT_EQ(ranks.size(), world);
      // Value i of rank r is r + i / 4: every partial sum is exact in fp32 and fp64, so the sum
      // must be world * (world - 1) / 2 + world * i / 4 whatever order Gloo adds in. An odd count,
      // so that no chunk boundary of the ring lines up with a power of two.
      const std::size_t n = 1'000'003;
      std::vector<float> f(n);
      std::vector<double> d(n);
      for (std::size_t i = 0; i < n; ++i) {
        f[i] = static_cast<float>(rank) + static_cast<float>(i % 1024) / 4;
        d[i] = rank + static_cast<double>(i) / 4;
      }
      ranks.gradients().all_reduce_sum(f.data(), n, "test floats");
      ranks.steps().all_reduce_sum(d.data(), n, "test doubles");
      const double base = world * (world - 1) / 2.0;
      std::size_t wrong_f = 0, wrong_d = 0;
      for (std::size_t i = 0; i < n; ++i) {
        wrong_f += f[i] != static_cast<float>(base + world * static_cast<double>(i % 1024) / 4);
        wrong_d += d[i] != base + world * static_cast<double>(i) / 4;
      }
      EXPECT_EQ(wrong_f, 0u) << "rank " << rank;
      EXPECT_EQ(wrong_d, 0u) << "rank " << rank;
      // Broadcasts from the last rank.
      std::string text = rank == world - 1 ? "from the last rank, " + std::string(5000, 'x') : "";
      rondo::engine::broadcast_string(ranks.steps(), text, world - 1, "test text");
      EXPECT_EQ(text, "from the last rank, " + std::string(5000, 'x'));
      std::int64_t step = rank == 0 ? 123456789012345 : -1;
      ranks.steps().broadcast(&step, sizeof step, 0, "test step");
      EXPECT_EQ(step, 123456789012345);
    });
  }
}

TEST(Ranks, BuffersSummedTogetherInPlaceOrCopied) {
  on_ranks(3, [](int rank, Ranks& ranks) {
    // Two buffers back to back (summed as one) and one elsewhere (summed with them through c10d's
    // coalesced all-reduce), all started before any is waited for.
    std::vector<float> a(3000), c(777);
    for (std::size_t i = 0; i < a.size(); ++i)
      a[i] = static_cast<float>(rank * 1000 + static_cast<int>(i));
    for (std::size_t i = 0; i < c.size(); ++i)
      c[i] = static_cast<float>(rank) - static_cast<float>(i);
    auto first = ranks.gradients().start_sum(
        {{a.data() + 1000, 2000}, {a.data(), 1000}, {c.data(), 777}}, "three buffers");
    std::vector<float> d(7, static_cast<float>(rank + 1));
    auto second = ranks.gradients().start_sum({{d.data(), 7}}, "after them");
    second->wait();  // in order of starting or not, both finish
    first->wait();
    EXPECT_TRUE(first->done());
    for (std::size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(a[i], 3000.0f + 3.0f * static_cast<float>(i)) << i;
    for (std::size_t i = 0; i < c.size(); ++i)
      ASSERT_EQ(c[i], 3.0f - 3.0f * static_cast<float>(i)) << i;
    for (float x : d)
      ASSERT_EQ(x, 6.0f);
  });
}

TEST(Ranks, GradientBucketsRunFromTheLastLayerAndCloseAtTheirSize) {
  const std::size_t big = rondo::engine::kGradientBucketBytes;
  const std::size_t small = big / 4 + 1;
  using B = std::vector<std::vector<int>>;
  // Layer 0 (an embedding without gradients) is in no bucket; four small layers reach the size.
  EXPECT_EQ(rondo::engine::gradient_buckets({0, small, small, small, small, small, small}),
            (B{{6, 5, 4, 3}, {2, 1}}));
  EXPECT_EQ(rondo::engine::gradient_buckets({big, small, big, 0, small}), (B{{4, 2}, {1, 0}}));
  EXPECT_EQ(rondo::engine::gradient_buckets({0, 0}), B{});
}

TEST(Ranks, BroadcastsStartedTogetherAndMessagesBetweenTwoRanks) {
  on_ranks(3, [](int rank, Ranks& ranks) {
    Collective& c = ranks.gradients();
    // Each rank owns one buffer: the owners' broadcasts started in buffer order on every rank,
    // before any is waited for (as sharded updates start them).
    std::vector<std::vector<std::uint8_t>> bufs(3, std::vector<std::uint8_t>(100'003));
    std::vector<std::unique_ptr<Collective::Pending>> started;
    for (int owner = 0; owner < 3; ++owner) {
      auto& b = bufs[static_cast<std::size_t>(owner)];
      for (std::size_t i = 0; i < b.size(); ++i)
        b[i] = owner == rank ? static_cast<std::uint8_t>(i * 7 + owner) : 0;
      started.push_back(c.start_broadcast(b.data(), b.size(), owner, "buffer of its owner"));
    }
    for (auto& s : started)
      s->wait();
    for (int owner = 0; owner < 3; ++owner)
      for (std::size_t i = 0; i < bufs[static_cast<std::size_t>(owner)].size(); ++i)
        ASSERT_EQ(bufs[static_cast<std::size_t>(owner)][i],
                  static_cast<std::uint8_t>(i * 7 + owner))
            << "rank " << rank << ", owner " << owner << ", byte " << i;
    // Rank 0 asks rank 2 twice; rank 1 stays out of it. In order, each answer its question's.
    Collective& m = ranks.steps();
    if (rank == 0)
      for (std::int64_t q : {5, 9}) {
        m.send(&q, sizeof q, 2, "a question");
        std::vector<double> a(1000);
        m.recv(a.data(), a.size() * sizeof(double), 2, "its answer");
        for (std::size_t i = 0; i < a.size(); ++i)
          ASSERT_EQ(a[i], static_cast<double>(q) * static_cast<double>(i));
      }
    if (rank == 2)
      for (int k = 0; k < 2; ++k) {
        std::int64_t q = 0;
        m.recv(&q, sizeof q, 0, "a question");
        std::vector<double> a(1000);
        for (std::size_t i = 0; i < a.size(); ++i)
          a[i] = static_cast<double>(q) * static_cast<double>(i);
        m.send(a.data(), a.size() * sizeof(double), 0, "its answer");
      }
  });
}

TEST(Ranks, OptimizerStateIsOwnedByRunsOfLayersOfAboutEqualBytes) {
  using rondo::engine::optimizer_owners;
  using V = std::vector<int>;
  // Layer 0 (nothing trained) has no owner; eight equal layers on 2 and 3 ranks (3 + 3 + 2:
  // squares 9 + 9 + 4 as for 3 + 2 + 3, the earlier ranks taking the longer runs).
  EXPECT_EQ(optimizer_owners({0, 10, 10, 10, 10, 10, 10, 10, 10}, 2),
            (V{-1, 0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(optimizer_owners({0, 10, 10, 10, 10, 10, 10, 10, 10}, 3),
            (V{-1, 0, 0, 0, 1, 1, 1, 2, 2}));
  // A large embedding first: alone on rank 0 (60² + 40² < 70² + 30²), and on 3 ranks the rest
  // shared by the other two (60² + 20² + 20²).
  EXPECT_EQ(optimizer_owners({60, 10, 10, 10, 10}, 2), (V{0, 1, 1, 1, 1}));
  EXPECT_EQ(optimizer_owners({60, 10, 10, 10, 10}, 3), (V{0, 1, 1, 2, 2}));
  // More ranks than layers: the first ranks own them; one rank: every trained layer.
  EXPECT_EQ(optimizer_owners({10, 10}, 4), (V{0, 1}));
  EXPECT_EQ(optimizer_owners({10, 0, 10}, 1), (V{0, -1, 0}));
}

TEST(Ranks, RanksOnOneNodeShareItsGpus) {
  using rondo::engine::gpu_share;
  using P = std::pair<int, int>;
  // 4 GPUs for 2 ranks: two each; 3 for 2: the first rank takes the extra one; 8 for 3: 3, 3, 2.
  EXPECT_EQ(gpu_share(4, 0, 2), P(0, 2));
  EXPECT_EQ(gpu_share(4, 1, 2), P(2, 4));
  EXPECT_EQ(gpu_share(3, 0, 2), P(0, 2));
  EXPECT_EQ(gpu_share(3, 1, 2), P(2, 3));
  EXPECT_EQ(gpu_share(8, 0, 3), P(0, 3));
  EXPECT_EQ(gpu_share(8, 1, 3), P(3, 6));
  EXPECT_EQ(gpu_share(8, 2, 3), P(6, 8));
  EXPECT_EQ(gpu_share(5, 0, 1), P(0, 5));
  // Fewer GPUs than ranks: the last ones get none (plan_devices then refuses, naming both).
  EXPECT_EQ(gpu_share(1, 1, 2), P(1, 1));
  // A share that does not exist is refused by the selection.
  rondo::engine::DeviceSelection beyond;
  beyond.share_index = 2;
  beyond.share_count = 2;
  EXPECT_FALSE(beyond.validate().empty());
}

TEST(Ranks, ARankThatLeavesEndsTheOthersCollectiveWithANamedError) {
  std::string said;
  const auto t0 = std::chrono::steady_clock::now();
  on_ranks(
      2,
      [&](int rank, Ranks& ranks) {
        std::vector<float> x(1000, 1.0f);
        ranks.gradients().all_reduce_sum(x.data(), x.size(), "the first sum");
        if (rank == 1) return;  // leaves: its connections close when its Ranks is destroyed
        try {
          ranks.gradients().all_reduce_sum(x.data(), x.size(), "layer 7's gradients");
          ADD_FAILURE() << "the sum went through without rank 1";
        } catch (const rondo::engine::RankError& e) {
          said = e.what();
        }
      },
      /*timeout_s=*/10);
  EXPECT_NE(said.find("rank 0 of 2: the all-reduce of layer 7's gradients (gradients group) "
                      "failed"),
            std::string::npos)
      << said;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Ranks, TheGlooProcessGroupIsLaidOutAsTheWheelLaysItOut) {
  // Made with this file's view of the class (Debian's gloo headers), initialised by libtorch's
  // constructor (the wheel's gloo): the fields read back through this file's inline accessors
  // must be the ones the constructor wrote. A layout that differed would read other bytes.
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(4321));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  options->threads = 3;
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, options);
  EXPECT_EQ(group->getRank(), 0);
  EXPECT_EQ(group->getSize(), 1);
  EXPECT_EQ(group->getOptions().get(), options.get());
  EXPECT_EQ(group->getNumThreads(), 3);
  EXPECT_EQ(group->getBackendName(), "gloo");
  EXPECT_EQ(group->getOptions()->timeout, std::chrono::milliseconds(4321));
  // And it works: a sum over one rank, a broadcast.
  std::vector<at::Tensor> t{at::arange(10, at::kFloat)};
  group->allreduce(t)->wait();
  EXPECT_TRUE(t[0].equal(at::arange(10, at::kFloat)));
  group->broadcast(t)->wait();
  EXPECT_TRUE(t[0].equal(at::arange(10, at::kFloat)));
}

}  // namespace
