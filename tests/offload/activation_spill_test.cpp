// offload::ActivationSpill: activation checkpoints written to the NVMe tier and read back byte for
// byte — through the drive (io_uring on a disk folder, the thread pool on tmpfs), or taken back
// before their write started; space reused and bounded (past it a checkpoint stays in host
// memory); a failed write or a corrupt read ends in a named IoError at the read.
#include "offload/activation_spill.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <thread>

#include "io_test_util.h"
#include "kernels/cpu/sim_device.h"
#include "offload/nvme_store.h"

namespace fs = std::filesystem;

namespace rondo::offload {
namespace {

using namespace test;
using namespace std::chrono_literals;

constexpr std::uint64_t kBlock = 16 * 1024;

class SpillOn : public OnPlace {
 protected:
  std::unique_ptr<NvmeStore> store(std::uint64_t capacity, const std::string& faults = "") {
    NvmeStoreOptions o{.dir = scratch_->path(),
                       .backend = GetParam().kind,
                       .queue_depth = 8,
                       .block_bytes = kBlock};
    if (!faults.empty()) o.faults = rules(faults);
    return std::make_unique<NvmeStore>(o, capacity);
  }
  std::unique_ptr<ActivationSpill> spill(NvmeStore& nvme, std::uint64_t capacity) {
    return std::make_unique<ActivationSpill>(
        nvme, capacity,
        [this](std::size_t bytes) {
          ++taken_;
          HostBuffer b = arena_.allocate(bytes, Purpose::kStaging);
          std::memset(b.data(), 0xEE, bytes);  // a read that does not land shows
          return b;
        },
        [this](HostBuffer) { ++given_; });
  }
  // A staged checkpoint: random bytes, and a copy to compare with.
  std::pair<HostBuffer, std::vector<unsigned char>> checkpoint(std::size_t bytes) {
    HostBuffer b = arena_.allocate(bytes, Purpose::kActivations);
    fill_random(b.data(), bytes, rng_);
    std::vector<unsigned char> copy(bytes);
    std::memcpy(copy.data(), b.data(), bytes);
    return {std::move(b), std::move(copy)};
  }
  // Waits until the drive has taken `bytes` and the writer has given back `gives` staging buffers
  // in all (it is asynchronous; a written checkpoint's region is free for reuse once it has).
  void wait_written(const ActivationSpill& s, std::uint64_t bytes, int gives = 0) {
    const auto until = std::chrono::steady_clock::now() + 60s;
    while ((s.stats().written < bytes || given_ < gives) &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(1ms);
    ASSERT_EQ(s.stats().written, bytes) << "the writes did not end within a minute";
    ASSERT_GE(given_, gives);
  }

  HostArena arena_{{.pinning = Pinning::kOff}};
  std::atomic<int> taken_{0}, given_{0};
};

INSTANTIATE_TEST_SUITE_P(Backends, SpillOn, testing::ValuesIn(kPlaces),
                         [](const testing::TestParamInfo<Place>& p) { return p.param.label; });

TEST_P(SpillOn, CheckpointsComeBackByteForByteThroughTheDriveAndTheirSpaceIsReused) {
  // Odd sizes (a partial last block and page), two steps' worth: the second step reuses the
  // first's regions.
  const std::vector<std::size_t> sizes = {3 * kBlock + 123, kBlock, 7777, 2 * kBlock + 4096};
  std::uint64_t capacity = 0;
  for (std::size_t b : sizes)
    capacity += ActivationSpill::capacity_for(b, 1, kBlock);
  EXPECT_EQ(capacity, (4 + 1 + 1 + 3) * kBlock);
  auto nvme = store(capacity);
  auto s = spill(*nvme, capacity);
  std::uint64_t written = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<Spilled> handles;
    std::vector<std::vector<unsigned char>> expect;
    for (std::size_t b : sizes) {
      auto [host, copy] = checkpoint(b);
      handles.push_back(s->write(std::move(host), b, nullptr));
      expect.push_back(std::move(copy));
      written += b;
    }
    wait_written(*s, written, (step + 1) * static_cast<int>(sizes.size()));
    // Backward order, the first prefetched.
    s->prefetch(handles.back());
    for (std::size_t i = sizes.size(); i-- > 0;) {
      HostBuffer back = s->read(handles[i]);
      EXPECT_FALSE(handles[i]);
      EXPECT_EQ(first_difference(back.data(), expect[i].data(), sizes[i]), -1)
          << "step " << step << ", checkpoint " << i << ", seed " << seed_;
    }
  }
  const SpillStats st = s->stats();
  EXPECT_EQ(st.read, written);
  EXPECT_EQ(st.kept, 0u);
  EXPECT_EQ(st.reserved, capacity) << "the second step reserved new space";
  EXPECT_EQ(given_, 2 * static_cast<int>(sizes.size())) << "written staging went back";
  EXPECT_EQ(taken_, 2 * static_cast<int>(sizes.size())) << "every read got staging";
}

TEST_P(SpillOn, ACheckpointReadBeforeItsWriteStartedComesBackWithoutTheDrive) {
  auto dev = kernels::make_sim_device({.name = "sim0", .bytes_cap = 1 << 20});
  kernels::Stream& down = dev->create_stream("download");
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  down.enqueue([gate] { gate.wait(); });  // the first download does not end until released
  auto first_done = dev->create_event();
  down.record(*first_done);

  auto nvme = store(1 << 20);
  auto s = spill(*nvme, 1 << 20);
  auto [h1, c1] = checkpoint(5000);
  auto [h2, c2] = checkpoint(kBlock + 1);
  Spilled a = s->write(std::move(h1), 5000, std::move(first_done));
  Spilled b = s->write(std::move(h2), kBlock + 1, nullptr);  // queued behind a
  HostBuffer back_b = s->read(b);
  EXPECT_EQ(first_difference(back_b.data(), c2.data(), kBlock + 1), -1);
  EXPECT_EQ(s->stats().kept, kBlock + 1);
  EXPECT_EQ(s->stats().written, 0u);
  release.set_value();
  HostBuffer back_a = s->read(a);
  EXPECT_EQ(first_difference(back_a.data(), c1.data(), 5000), -1);
  // a was written (its event released the writer) or taken back, never lost.
  const SpillStats st = s->stats();
  EXPECT_EQ(st.written + st.kept, 5000u + kBlock + 1);
  down.synchronize();
}

TEST_P(SpillOn, ACheckpointBeyondTheSpaceStaysInHostMemoryAndFreedSpaceIsReused) {
  const std::size_t bytes = 2 * kBlock;
  auto nvme = store(2 * bytes);
  auto s = spill(*nvme, 2 * bytes);
  auto [h1, c1] = checkpoint(bytes);
  auto [h2, c2] = checkpoint(bytes);
  auto [h3, c3] = checkpoint(bytes);
  auto [h4, c4] = checkpoint(bytes);
  Spilled a = s->write(std::move(h1), bytes, nullptr);
  Spilled b = s->write(std::move(h2), bytes, nullptr);
  Spilled c = s->write(std::move(h3), bytes, nullptr);  // no space left
  EXPECT_EQ(s->stats().held, bytes);
  wait_written(*s, 2 * bytes, 2);
  HostBuffer back_a = s->read(a);
  Spilled d = s->write(std::move(h4), bytes, nullptr);  // a's space
  wait_written(*s, 3 * bytes);
  HostBuffer back_b = s->read(b), back_c = s->read(c), back_d = s->read(d);
  EXPECT_EQ(first_difference(back_a.data(), c1.data(), bytes), -1);
  EXPECT_EQ(first_difference(back_b.data(), c2.data(), bytes), -1);
  EXPECT_EQ(first_difference(back_c.data(), c3.data(), bytes), -1);
  EXPECT_EQ(first_difference(back_d.data(), c4.data(), bytes), -1);
  const SpillStats st = s->stats();
  EXPECT_EQ(st.reserved, 2 * bytes);
  EXPECT_EQ(st.held, bytes);
  EXPECT_EQ(st.read, 3 * bytes);
}

// A run that fails drops its checkpoints unread: the host memory they still hold (kept for want of
// space, read back, or waiting for the drive when the tier goes) comes back through `give` as a
// written one's staging does, so that the staging pool, and the engine's gauge of it, get every
// buffer back.
TEST_P(SpillOn, CheckpointsDroppedUnreadGiveTheirHostMemoryBack) {
  const std::size_t bytes = 2 * kBlock;
  auto nvme = store(2 * bytes);
  auto s = spill(*nvme, 2 * bytes);
  std::vector<Spilled> handles;
  for (int i = 0; i < 3; ++i)  // the third finds no space: held
    handles.push_back(s->write(checkpoint(bytes).first, bytes, nullptr));
  wait_written(*s, 2 * bytes, 2);
  EXPECT_EQ(s->stats().held, bytes);
  s->prefetch(handles[0]);  // read back into staging
  EXPECT_EQ(taken_, 1);
  handles.clear();
  EXPECT_EQ(given_, 2 + 1 + 1) << "the two written, the one read back and the one held";

  // Two more, the first's download held up: the writer waits for it, the second waits in the
  // queue when the tier goes (after the download ends).
  auto dev = kernels::make_sim_device({.name = "sim0", .bytes_cap = 1 << 20});
  kernels::Stream& down = dev->create_stream("download");
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  down.enqueue([gate] { gate.wait(); });
  auto landed = dev->create_event();
  down.record(*landed);
  handles.push_back(s->write(checkpoint(bytes).first, bytes, std::move(landed)));
  handles.push_back(s->write(checkpoint(bytes).first, bytes, nullptr));
  handles.clear();  // the queue keeps them
  std::thread later([&] {
    std::this_thread::sleep_for(50ms);
    release.set_value();
  });
  s.reset();
  later.join();
  down.synchronize();
  EXPECT_EQ(given_, 4 + 2) << "the one written as the tier went and the one it dropped";
  EXPECT_EQ(taken_, 1);
}

TEST_P(SpillOn, AFailedWriteIsANamedErrorAtTheRead) {
  auto nvme = store(1 << 20, "eio:write:1");
  auto s = spill(*nvme, 1 << 20);
  auto [h, c] = checkpoint(3 * kBlock);
  Spilled a = s->write(std::move(h), 3 * kBlock, nullptr);
  for (auto until = std::chrono::steady_clock::now() + 60s;
       s->stats().written == 0 && given_ == 0 && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(1ms);  // the write ends (failed) before the read
  try {
    s->read(a);
    FAIL() << "a failed write read back without an error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.kind, IoError::Kind::kOs);
    EXPECT_TRUE(contains(e.what(), "activation checkpoint")) << e.what();
    EXPECT_TRUE(contains(e.region, "activation checkpoint")) << e.region;
  }
}

TEST_P(SpillOn, ACorruptReadIsAChecksumError) {
  auto nvme = store(1 << 20, "corrupt:read:1");
  auto s = spill(*nvme, 1 << 20);
  auto [h, c] = checkpoint(2 * kBlock + 10);
  Spilled a = s->write(std::move(h), 2 * kBlock + 10, nullptr);
  wait_written(*s, 2 * kBlock + 10);
  try {
    s->read(a);
    FAIL() << "a corrupt block read back without an error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.kind, IoError::Kind::kChecksum) << e.what();
    EXPECT_TRUE(contains(e.what(), "activation checkpoint")) << e.what();
  }
}

}  // namespace
}  // namespace rondo::offload
