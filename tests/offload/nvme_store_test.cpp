// NVMe store: random data round trips over many regions and odd sizes with both backends (io_uring
// on a folder of the build tree, the thread pool on tmpfs), concurrent readers and writers, every
// fault kind giving its named error without hanging, the checksum catching a flipped byte, the
// O_DIRECT and O_TMPFILE fallbacks, preallocation refused up front, stale files of dead processes
// removed, backend selection, registered buffers, and the caller's mistakes. Also runs under
// ThreadSanitizer (scripts/test.sh).
#include "offload/nvme_store.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "offload/host_arena.h"
#include "tests/offload/io_test_util.h"

namespace rondo::offload {
namespace {

namespace fs = std::filesystem;
using namespace test;

constexpr std::uint64_t kSmallBlock = 16 * 1024;  // several blocks per region at test sizes

// ---------------------------------------------------------------------------------------------
// The store on both backends

class NvmeStoreOn : public OnPlace {
 protected:
  NvmeStoreOptions options(const std::string& faults = "",
                           std::uint64_t block = kSmallBlock) const {
    NvmeStoreOptions o;
    o.dir = scratch_->path();
    o.backend = GetParam().kind;
    o.queue_depth = 8;
    o.block_bytes = block;
    if (!faults.empty()) o.faults = rules(faults);
    return o;
  }
  HostBuffer random_buffer(std::uint64_t bytes) {
    HostBuffer b = arena_.allocate(bytes, Purpose::kStaging);
    fill_random(b.data(), bytes, rng_);
    return b;
  }
  HostBuffer empty_buffer(std::uint64_t bytes) {
    HostBuffer b = arena_.allocate(bytes, Purpose::kStaging);
    std::memset(b.data(), 0xEE, bytes);
    return b;
  }
  // Writes `sizes` to fresh regions (all in flight at once), returns regions and sources.
  struct Written {
    std::vector<Region> regions;
    std::vector<HostBuffer> data;
  };
  Written write_all(NvmeStore& store, const std::vector<std::uint64_t>& sizes) {
    Written w;
    std::vector<IoTicket> tickets;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      w.regions.push_back(store.reserve(sizes[i], "layer " + std::to_string(i) + " weights"));
      w.data.push_back(random_buffer(sizes[i]));
      tickets.push_back(store.write(w.regions[i], 0, w.data[i].data(), sizes[i]));
    }
    for (IoTicket& t : tickets)
      store.wait(t);
    return w;
  }
  // Reads every region back (all in flight) and compares.
  void expect_reads_back(NvmeStore& store, const Written& w) {
    std::vector<HostBuffer> back;
    std::vector<IoTicket> tickets;
    for (std::size_t i = 0; i < w.regions.size(); ++i) {
      back.push_back(empty_buffer(w.data[i].bytes()));
      tickets.push_back(store.read(w.regions[i], 0, back[i].data(), w.data[i].bytes()));
    }
    for (std::size_t i = 0; i < tickets.size(); ++i) {
      store.wait(tickets[i]);
      EXPECT_EQ(first_difference(back[i].data(), w.data[i].data(), w.data[i].bytes()), -1)
          << w.regions[i].name << " (" << w.data[i].bytes() << " bytes), seed " << seed_;
    }
  }

  HostArena arena_{{.pinning = Pinning::kOff}};
};

INSTANTIATE_TEST_SUITE_P(Backends, NvmeStoreOn, testing::ValuesIn(kPlaces),
                         [](const testing::TestParamInfo<Place>& p) { return p.param.label; });

TEST_P(NvmeStoreOn, RoundTripsRandomDataOverManyRegionsAndOddSizes) {
  const std::uint64_t b = kSmallBlock;
  const std::vector<std::uint64_t> sizes = {1, 22,    4095,   4096,          4097,       b - 1,
                                            b, b + 1, 100000, 3 * b + 12345, 262144 + 7, 22 * 4096};
  std::uint64_t total = 0;
  for (std::uint64_t s : sizes)
    total += 2 * ((s + 4095) / 4096 * 4096);
  NvmeStore store(options(), total);
  EXPECT_EQ(store.info().backend,
            GetParam().kind == BackendKind::kIoUring ? "io_uring" : "threads");
  EXPECT_EQ(store.info().backend_note, "");
  std::vector<std::uint64_t> twice = sizes;
  twice.insert(twice.end(), sizes.begin(), sizes.end());
  Written w = write_all(store, twice);
  expect_reads_back(store, w);
  expect_reads_back(store, w);  // reading does not change what is stored
  std::uint64_t logical = 0;
  for (std::uint64_t s : twice)
    logical += s;
  NvmeStoreInfo info = store.info();
  EXPECT_EQ(info.bytes_written, logical);
  EXPECT_EQ(info.bytes_read, 2 * logical);
  EXPECT_EQ(info.reserved, total);
  EXPECT_EQ(info.capacity, total);
}

TEST_P(NvmeStoreOn, TransfersMaySplitARegionAtBlocksAndUseTheDefaultBlockSize) {
  const std::uint64_t block = std::uint64_t{1} << 20;
  const std::uint64_t bytes = 3 * block + 5000;
  NvmeStore store(options("", block), bytes);
  EXPECT_EQ(store.info().block_bytes, block);
  Region r = store.reserve(bytes, "layer 7 master");
  HostBuffer src = random_buffer(bytes);
  // Written in two parts (the first two blocks, then the rest with the partial last block)...
  IoTicket a = store.write(r, 0, src.data(), 2 * block);
  IoTicket b = store.write(r, 2 * block, src.as<char>() + 2 * block, bytes - 2 * block);
  store.wait(a);
  store.wait(b);
  // ...read in one, and again in other parts.
  HostBuffer back = empty_buffer(bytes);
  IoTicket t = store.read(r, 0, back.data(), bytes);
  store.wait(t);
  EXPECT_EQ(first_difference(back.data(), src.data(), bytes), -1) << "seed " << seed_;
  HostBuffer part = empty_buffer(bytes - block);
  t = store.read(r, block, part.data(), bytes - block);
  store.wait(t);
  EXPECT_EQ(first_difference(part.data(), src.as<char>() + block, bytes - block), -1);
}

TEST_P(NvmeStoreOn, ConcurrentReadersAndWritersFromSeveralThreads) {
  constexpr int kThreads = 4, kRegions = 3, kRounds = 4;
  const std::uint64_t sizes[kRegions] = {kSmallBlock * 3 + 100, 4096 * 5, kSmallBlock * 2};
  std::uint64_t per_thread = 0;
  for (std::uint64_t s : sizes)
    per_thread += (s + 4095) / 4096 * 4096;
  NvmeStore store(options(), kThreads * per_thread);
  std::vector<std::vector<Region>> regions(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < kRegions; ++i)
      regions[t].push_back(
          store.reserve(sizes[i], "thread " + std::to_string(t) + " region " + std::to_string(i)));
  std::atomic<int> mismatches{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed_ + t);
      std::vector<HostBuffer> src, back;
      for (int i = 0; i < kRegions; ++i) {
        src.push_back(arena_.allocate(sizes[i], Purpose::kStaging));
        back.push_back(arena_.allocate(sizes[i], Purpose::kStaging));
      }
      try {
        for (int round = 0; round < kRounds; ++round) {
          std::vector<IoTicket> tickets;
          for (int i = 0; i < kRegions; ++i) {
            fill_random(src[i].data(), sizes[i], rng);
            tickets.push_back(store.write(regions[t][i], 0, src[i].data(), sizes[i]));
          }
          for (IoTicket& k : tickets)
            k.wait();
          tickets.clear();
          for (int i = 0; i < kRegions; ++i) {
            std::memset(back[i].data(), 0, sizes[i]);
            tickets.push_back(store.read(regions[t][i], 0, back[i].data(), sizes[i]));
          }
          for (int i = 0; i < kRegions; ++i) {
            tickets[i].wait();
            if (first_difference(back[i].data(), src[i].data(), sizes[i]) != -1) ++mismatches;
          }
        }
      } catch (const std::exception& e) {
        ++errors;
        ADD_FAILURE() << "thread " << t << ": " << e.what();
      }
    });
  for (std::thread& th : threads)
    th.join();
  EXPECT_EQ(mismatches.load(), 0) << "seed " << seed_;
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(store.info().bytes_read, store.info().bytes_written);
}

// Waits for every ticket; returns the IoErrors they threw (the rest must have succeeded).
std::vector<IoError> wait_all(std::vector<IoTicket>& tickets) {
  std::vector<IoError> errors;
  for (IoTicket& t : tickets) {
    try {
      t.wait();
    } catch (const IoError& e) {
      errors.push_back(e);
    }
  }
  return errors;
}

void expect_names_place(const IoError& e, const std::string& dir) {
  EXPECT_TRUE(contains(e.what(), dir)) << e.what();
  EXPECT_TRUE(contains(e.what(), "at offset " + std::to_string(e.offset) + " of ")) << e.what();
  EXPECT_TRUE(contains(e.what(), "'" + e.region + "'")) << e.what();
  EXPECT_TRUE(contains(e.what(), "hardware.offload_dir") || contains(e.what(), "backend"))
      << e.what();
  EXPECT_TRUE(contains(e.file, dir)) << e.file;
}

TEST_P(NvmeStoreOn, EnospcAtTheThirdWriteFailsThatTransferOnly) {
  NvmeStore store(options("enospc:write:3"), 8 * kSmallBlock);
  std::vector<Region> regions;
  std::vector<HostBuffer> data;
  std::vector<IoTicket> tickets;
  for (int i = 0; i < 6; ++i) {
    regions.push_back(store.reserve(kSmallBlock, "layer " + std::to_string(i) + " m"));
    data.push_back(random_buffer(kSmallBlock));
    tickets.push_back(store.write(regions[i], 0, data[i].data(), kSmallBlock));
  }
  std::vector<IoError> errors = wait_all(tickets);
  ASSERT_EQ(errors.size(), 1u);
  const IoError& e = errors[0];
  EXPECT_EQ(e.kind, IoError::Kind::kOs);
  EXPECT_EQ(e.error, ENOSPC);
  EXPECT_TRUE(contains(e.what(), "No space left on device (ENOSPC)")) << e.what();
  EXPECT_TRUE(contains(e.what(), "writing")) << e.what();
  expect_names_place(e, scratch_->path());
  EXPECT_EQ(e.offset % kSmallBlock, 0u);
  EXPECT_LT(e.offset, 6 * kSmallBlock);
  EXPECT_EQ(store.info().bytes_written, 5 * kSmallBlock);
  // The region whose write failed holds nothing valid: reading it is refused before any I/O...
  std::size_t failed = e.offset / kSmallBlock;
  ASSERT_EQ(regions[failed].name, e.region);
  HostBuffer back = empty_buffer(kSmallBlock);
  try {
    store.read(regions[failed], 0, back.data(), kSmallBlock);
    ADD_FAILURE() << "read of a failed write was accepted";
  } catch (const Error& x) {
    EXPECT_TRUE(contains(x.what(), "its last write failed")) << x.what();
  }
  // ...until it is written again.
  IoTicket t = store.write(regions[failed], 0, data[failed].data(), kSmallBlock);
  store.wait(t);
  t = store.read(regions[failed], 0, back.data(), kSmallBlock);
  store.wait(t);
  EXPECT_EQ(first_difference(back.data(), data[failed].data(), kSmallBlock), -1);
}

TEST_P(NvmeStoreOn, EioAtARead) {
  NvmeStore store(options("eio:read:2"), 4 * kSmallBlock);
  Written w = write_all(store, {kSmallBlock, kSmallBlock, kSmallBlock, kSmallBlock});
  std::vector<HostBuffer> back;
  std::vector<IoTicket> tickets;
  for (int i = 0; i < 4; ++i) {
    back.push_back(empty_buffer(kSmallBlock));
    tickets.push_back(store.read(w.regions[i], 0, back[i].data(), kSmallBlock));
  }
  std::vector<IoError> errors = wait_all(tickets);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].error, EIO);
  EXPECT_TRUE(contains(errors[0].what(), "Input/output error (EIO)")) << errors[0].what();
  EXPECT_TRUE(contains(errors[0].what(), "smartctl")) << errors[0].what();
  expect_names_place(errors[0], scratch_->path());
}

TEST_P(NvmeStoreOn, AShortReadThatCannotCompleteIsATruncatedFile) {
  NvmeStore store(options("short:read:1"), 4 * kSmallBlock);
  Written w = write_all(store, {4 * kSmallBlock});
  HostBuffer back = empty_buffer(4 * kSmallBlock);
  IoTicket t = store.read(w.regions[0], 0, back.data(), 4 * kSmallBlock);
  std::vector<IoTicket> one;
  one.push_back(std::move(t));
  std::vector<IoError> errors = wait_all(one);
  ASSERT_GE(errors.size(), 1u);
  const IoError& e = errors[0];
  EXPECT_EQ(e.kind, IoError::Kind::kShort);
  EXPECT_TRUE(contains(e.what(), "the file ended after")) << e.what();
  EXPECT_TRUE(contains(e.what(), "truncated")) << e.what();
  expect_names_place(e, scratch_->path());
  // Persistently: reading it again ends early again (the file stays "truncated").
  one.clear();
  one.push_back(store.read(w.regions[0], 0, back.data(), 4 * kSmallBlock));
  errors = wait_all(one);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].kind, IoError::Kind::kShort);
}

TEST_P(NvmeStoreOn, TheChecksumCatchesACorruptByte) {
  NvmeStore store(options("corrupt:read:1"), 3 * kSmallBlock);
  Written w = write_all(store, {kSmallBlock, kSmallBlock, kSmallBlock - 100});
  std::vector<HostBuffer> back;
  std::vector<IoTicket> tickets;
  for (int i = 0; i < 3; ++i) {
    back.push_back(empty_buffer(w.data[i].bytes()));
    tickets.push_back(store.read(w.regions[i], 0, back[i].data(), w.data[i].bytes()));
  }
  std::vector<IoError> errors = wait_all(tickets);
  ASSERT_EQ(errors.size(), 1u);
  const IoError& e = errors[0];
  EXPECT_EQ(e.kind, IoError::Kind::kChecksum);
  EXPECT_TRUE(contains(e.what(),
                       "the data read back differs from what was written: the drive or "
                       "filesystem returned corrupt data"))
      << e.what();
  EXPECT_TRUE(contains(e.what(), "SMART")) << e.what();
  EXPECT_TRUE(contains(e.what(), "choose another hardware.offload_dir")) << e.what();
  expect_names_place(e, scratch_->path());
  EXPECT_EQ(store.info().bytes_read,
            3 * kSmallBlock - 100 - w.data[e.offset / kSmallBlock].bytes());
  // The flip was in what was read, not on disk: a second read is clean.
  expect_reads_back(store, w);
}

TEST_P(NvmeStoreOn, TransientFaultsAreRetriedAndShortTransfersResubmitted) {
  // Every read and write transfers half of what is left (page-aligned) until under two pages,
  // and the first read and write are interrupted: the data must still round-trip.
  NvmeStore store(options("partial:read:*,partial:write:*,eintr:write:1,eagain:read:1"),
                  8 * kSmallBlock);
  Written w = write_all(store, {3 * kSmallBlock, kSmallBlock + 4097, 1});
  expect_reads_back(store, w);
}

TEST_P(NvmeStoreOn, AKernelThatKeepsAnsweringEagainFailsTheReadInsteadOfSpinning) {
  NvmeStore store(options("eagain:read:*"), 2 * kSmallBlock);
  Written w = write_all(store, {2 * kSmallBlock});
  HostBuffer back = empty_buffer(2 * kSmallBlock);
  std::vector<IoTicket> one;
  one.push_back(store.read(w.regions[0], 0, back.data(), 2 * kSmallBlock));
  std::vector<IoError> errors = wait_all(one);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].error, EAGAIN);
  EXPECT_TRUE(contains(errors[0].what(), std::to_string(detail::kMaxRetries + 1) + " retries"))
      << errors[0].what();
  EXPECT_TRUE(contains(errors[0].what(), "2 of the 2 blocks")) << errors[0].what();
}

TEST_P(NvmeStoreOn, ODirectRefusedFallsBackToBufferedIoAndSaysSo) {
  NvmeStore store(options("einval_odirect"), 2 * kSmallBlock);
  NvmeStoreInfo info = store.info();
  EXPECT_FALSE(info.direct);
  EXPECT_TRUE(contains(info.direct_note, "O_DIRECT refused")) << info.direct_note;
  EXPECT_TRUE(contains(info.direct_note, "(EINVAL)")) << info.direct_note;
  EXPECT_TRUE(contains(info.direct_note, "buffered")) << info.direct_note;
  EXPECT_TRUE(contains(store.summary(), "buffered")) << store.summary();
  Written w = write_all(store, {kSmallBlock + 22, 4095});
  expect_reads_back(store, w);
}

TEST_P(NvmeStoreOn, RegisteredBuffersAreUsedWhereTheKernelAllowsThem) {
  const std::uint64_t bytes = 2 * kSmallBlock + 300;
  for (const char* faults : {"", "enomem:register"}) {
    SCOPED_TRACE(faults);
    NvmeStore store(options(faults), 2 * ((bytes + 4095) / 4096 * 4096));
    HostBuffer staging = random_buffer(bytes), back = empty_buffer(bytes);
    const bool ok =
        store.register_buffers({{staging.data(), staging.bytes()}, {back.data(), back.bytes()}});
    NvmeStoreInfo info = store.info();
    if (GetParam().kind == BackendKind::kThreads) {
      EXPECT_FALSE(ok);
      EXPECT_TRUE(contains(info.registration_note, "threads backend")) << info.registration_note;
    } else if (*faults) {
      EXPECT_FALSE(ok);
      EXPECT_EQ(info.registered_buffers, 0u);
      EXPECT_TRUE(contains(info.registration_note, "RLIMIT_MEMLOCK")) << info.registration_note;
      EXPECT_TRUE(contains(info.registration_note, "plain reads and writes"))
          << info.registration_note;
    } else if (ok) {
      EXPECT_EQ(info.registered_buffers, 2u);
      EXPECT_EQ(info.registration_note, "");
    } else {
      std::cout << "[ NOTE ] buffers not registered here: " << info.registration_note << "\n";
    }
    // Either way the bytes go through: registered buffers (fixed ops) and an unregistered one.
    Region a = store.reserve(bytes, "registered");
    Region b = store.reserve(bytes, "not registered");
    HostBuffer other = random_buffer(bytes), other_back = empty_buffer(bytes);
    IoTicket ta = store.write(a, 0, staging.data(), bytes);
    IoTicket tb = store.write(b, 0, other.data(), bytes);
    store.wait(ta);
    store.wait(tb);
    ta = store.read(a, 0, back.data(), bytes);
    tb = store.read(b, 0, other_back.data(), bytes);
    store.wait(ta);
    store.wait(tb);
    EXPECT_EQ(first_difference(back.data(), staging.data(), bytes), -1);
    EXPECT_EQ(first_difference(other_back.data(), other.data(), bytes), -1);
    EXPECT_TRUE(store.register_buffers({}) || GetParam().kind == BackendKind::kThreads);
  }
}

TEST_P(NvmeStoreOn, PreallocationBeyondTheFreeSpaceIsRefusedAtConstruction) {
  const std::string dir = scratch_->path();
  auto check = [&](const DiskOutOfSpace& e, std::uint64_t needed) {
    EXPECT_EQ(e.dir, dir);
    EXPECT_EQ(e.needed, needed);
    const std::string m = e.what();
    EXPECT_TRUE(contains(m, dir)) << m;
    EXPECT_TRUE(contains(m, "needs " + format_bytes(needed))) << m;
    EXPECT_TRUE(contains(m, " free")) << m;
    EXPECT_TRUE(contains(m, "hardware.offload_dir")) << m;
    EXPECT_TRUE(contains(m, "hardware.host_memory")) << m;
    EXPECT_TRUE(contains(m, "smaller model")) << m;
    EXPECT_TRUE(scratch_->entries().empty());  // nothing left behind
  };
  // fallocate answering ENOSPC (a drive that is fuller than statvfs said).
  try {
    NvmeStore store(options("enospc:fallocate"), 64 * kSmallBlock);
    ADD_FAILURE() << "constructed";
  } catch (const DiskOutOfSpace& e) {
    check(e, 64 * kSmallBlock);
  }
  // More than statvfs reports free: refused before any allocation.
  const std::uint64_t free = disk_free_bytes(dir);
  ASSERT_NE(free, UINT64_MAX);
  const std::uint64_t huge = (free / 4096 + (std::uint64_t{1} << 18)) * 4096;  // + 1 GiB
  try {
    NvmeStore store(options(), huge);
    ADD_FAILURE() << "constructed";
  } catch (const DiskOutOfSpace& e) {
    check(e, huge);
    EXPECT_LT(e.available, huge);
  }
}

TEST_P(NvmeStoreOn, AFilesystemWithoutFallocateGetsASparseFileAndANote) {
  NvmeStore store(options("eopnotsupp:fallocate"), 4 * kSmallBlock);
  NvmeStoreInfo info = store.info();
  EXPECT_FALSE(info.preallocated);
  EXPECT_TRUE(contains(info.preallocation_note, "sparse")) << info.preallocation_note;
  EXPECT_TRUE(contains(info.preallocation_note, "ENOSPC at a write")) << info.preallocation_note;
  Written w = write_all(store, {4 * kSmallBlock});
  expect_reads_back(store, w);
}

TEST_P(NvmeStoreOn, WithoutOTmpfileTheNamedFileIsUnlinkedAtOnce) {
  for (const char* faults : {"eopnotsupp:open:1", "eopnotsupp:open:1,einval_odirect"}) {
    SCOPED_TRACE(faults);
    NvmeStore store(options(faults), 2 * kSmallBlock);
    NvmeStoreInfo info = store.info();
    EXPECT_TRUE(contains(info.file_note, "no O_TMPFILE")) << info.file_note;
    EXPECT_TRUE(contains(info.file, "rondo-offload-" + std::to_string(::getpid()) + "-"))
        << info.file;
    EXPECT_EQ(info.direct, std::string(faults).find("einval") == std::string::npos);
    EXPECT_TRUE(scratch_->entries().empty());  // unlinked while in use
    Written w = write_all(store, {2 * kSmallBlock - 1});
    expect_reads_back(store, w);
  }
}

// ---------------------------------------------------------------------------------------------
// Not per backend

class NvmeStoreTest : public testing::Test {
 protected:
  NvmeStoreOptions options() const {
    NvmeStoreOptions o;
    o.dir = scratch_.path();
    o.block_bytes = kSmallBlock;
    o.queue_depth = 4;
    return o;
  }
  Scratch scratch_{disk_root()};
  HostArena arena_{{.pinning = Pinning::kOff}};
};

TEST_F(NvmeStoreTest, AutoChoosesIoUringWhereItWorksAndSaysWhyNotElsewhere) {
  std::string why;
  {
    NvmeStore store(options(), kSmallBlock);
    if (io_uring_available(&why)) {
      EXPECT_EQ(store.info().backend, "io_uring");
      EXPECT_EQ(store.info().backend_note, "");
    } else {
      EXPECT_EQ(store.info().backend, "threads");
      EXPECT_TRUE(contains(store.info().backend_note, "io_uring is not available"));
    }
    EXPECT_TRUE(contains(store.summary(), store.info().backend + ", queue depth 4"))
        << store.summary();
  }
  NvmeStoreOptions o = options();
  o.faults = rules("enosys:setup");
  NvmeStore store(o, kSmallBlock);
  EXPECT_EQ(store.info().backend, "threads");
  EXPECT_TRUE(contains(store.info().backend_note,
                       "io_uring is not available here "
                       "(io_uring_queue_init: Function not implemented"))
      << store.info().backend_note;
  EXPECT_TRUE(contains(store.info().backend_note, "seccomp")) << store.info().backend_note;
  EXPECT_TRUE(contains(store.summary(), "thread-pool backend")) << store.summary();
  // Forced io_uring that cannot start is an error, not a silent fallback.
  o.backend = BackendKind::kIoUring;
  o.faults = rules("eperm:setup");
  try {
    NvmeStore forced(o, kSmallBlock);
    ADD_FAILURE() << "constructed";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "Operation not permitted (EPERM)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "io_uring_disabled")) << e.what();
  }
  EXPECT_EQ(parse_backend_kind("threads"), BackendKind::kThreads);
  EXPECT_EQ(parse_backend_kind("io_uring"), BackendKind::kIoUring);
  EXPECT_EQ(parse_backend_kind("auto"), BackendKind::kAuto);
  EXPECT_THROW(parse_backend_kind("uring"), Error);
}

// Faults come in through the options only: the library reads no test variable, so a
// RONDO_FAULT_IO in the environment of a program that links it changes nothing (`rondo` turns the
// variable into options itself, cli/test_faults.cpp); the same rule given as an option applies.
TEST_F(NvmeStoreTest, FaultsComeFromTheOptionsNotTheEnvironment) {
  HostBuffer b = arena_.allocate(kSmallBlock, Purpose::kStaging);
  std::memset(b.data(), 7, kSmallBlock);
  auto write_then_read = [&](NvmeStore& store) {
    Region r = store.reserve(kSmallBlock, "activations 3");
    IoTicket t = store.write(r, 0, b.data(), kSmallBlock);
    store.wait(t);
    t = store.read(r, 0, b.data(), kSmallBlock);
    store.wait(t);
  };
  ASSERT_EQ(::setenv("RONDO_FAULT_IO", "eio:read:1", 1), 0);
  {
    NvmeStore store(options(), kSmallBlock);
    EXPECT_NO_THROW(write_then_read(store));
  }
  ASSERT_EQ(::unsetenv("RONDO_FAULT_IO"), 0);
  NvmeStoreOptions o = options();
  o.faults = rules("eio:read:1");
  NvmeStore store(o, kSmallBlock);
  EXPECT_THROW(write_then_read(store), IoError);
}

TEST_F(NvmeStoreTest, StaleFilesOfDeadProcessesAreRemovedAtStart) {
  std::fflush(nullptr);  // or the child's copy of unwritten output could be written twice
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);  // now a pid with no process
  const std::string dir = scratch_.path();
  const std::string dead = "rondo-offload-" + std::to_string(child) + "-0.tmp";
  const std::string live = "rondo-offload-" + std::to_string(::getpid()) + "-99.tmp";
  for (const std::string& name : {dead, live, std::string("rondo-offload-notes.txt")})
    std::ofstream(dir + "/" + name) << "x";
  NvmeStore store(options(), kSmallBlock);
  EXPECT_FALSE(fs::exists(dir + "/" + dead));
  EXPECT_TRUE(fs::exists(dir + "/" + live));
  EXPECT_TRUE(fs::exists(dir + "/rondo-offload-notes.txt"));
}

TEST_F(NvmeStoreTest, TheCallersMistakesAreErrorsBeforeAnyIo) {
  NvmeStore store(options(), 8 * kSmallBlock);
  Region r = store.reserve(3 * kSmallBlock + 10, "layer 2 v");
  EXPECT_EQ(r.bytes, 3 * kSmallBlock + 4096);
  EXPECT_EQ(r.offset, 0u);
  Region s = store.reserve(kSmallBlock, "layer 3 v");
  EXPECT_EQ(s.offset, r.bytes);
  HostBuffer b = arena_.allocate(4 * kSmallBlock, Purpose::kStaging);
  std::memset(b.data(), 1, 4 * kSmallBlock);
  auto error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const IoError& e) {
      return std::string("IoError: ") + e.what();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  std::string m = error_of([&] { store.write(r, 0, b.as<char>() + 64, kSmallBlock); });
  EXPECT_TRUE(contains(m, "not 4096-byte aligned")) << m;
  EXPECT_TRUE(contains(m, "'layer 2 v'")) << m;
  m = error_of([&] { store.write(r, 4096, b.data(), kSmallBlock); });
  EXPECT_TRUE(contains(m, "offset is not a multiple")) << m;
  m = error_of([&] { store.write(r, 0, b.data(), kSmallBlock + 1); });
  EXPECT_TRUE(contains(m, "size is not a multiple")) << m;
  m = error_of([&] { store.write(r, 0, b.data(), 4 * kSmallBlock); });
  EXPECT_TRUE(contains(m, "past the end of the region")) << m;
  m = error_of([&] { store.read(s, 0, b.data(), kSmallBlock); });
  EXPECT_TRUE(contains(m, "was never written")) << m;
  m = error_of([&] { store.reserve(0, "empty"); });
  EXPECT_TRUE(contains(m, "0 bytes")) << m;
  Region stranger{7, 0, kSmallBlock, "from elsewhere"};
  m = error_of([&] { store.write(stranger, 0, b.data(), kSmallBlock); });
  EXPECT_TRUE(contains(m, "does not belong to this store")) << m;
  // A read of another shape than the write: the last block was written as one page (100 bytes)
  // and is read as two.
  Region q = store.reserve(2 * kSmallBlock + 8192, "layer 5 v");
  IoTicket t = store.write(q, 0, b.data(), 2 * kSmallBlock + 100);
  store.wait(t);
  m = error_of([&] { store.read(q, 0, b.data(), 2 * kSmallBlock + 8192); });
  EXPECT_TRUE(contains(m, "read blocks as they were written")) << m;
  // Within the same page, another length of the last block is fine.
  t = store.read(q, kSmallBlock, b.data(), kSmallBlock + 4000);
  EXPECT_NO_THROW(store.wait(t));
  m = error_of([&] { store.reserve(5 * kSmallBlock, "layer 4 v"); });
  EXPECT_TRUE(contains(m, "is full: 'layer 4 v' needs")) << m;
  // Empty transfers and tickets.
  IoTicket empty = store.write(r, 0, b.data(), 0);
  EXPECT_FALSE(empty);
  EXPECT_TRUE(empty.ready());
  EXPECT_NO_THROW(store.wait(empty));
  NvmeStoreOptions bad = options();
  bad.block_bytes = 5000;
  bad.queue_depth = 0;
  m = error_of([&] { NvmeStore x(bad, kSmallBlock); });
  EXPECT_TRUE(contains(m, "block_bytes: 5000")) << m;
  EXPECT_TRUE(contains(m, "queue_depth: 0")) << m;
}

TEST_F(NvmeStoreTest, ATicketIsReadyOnlyOnceItsTransferHasEnded) {
  NvmeStore store(options(), 64 * kSmallBlock);
  Region r = store.reserve(64 * kSmallBlock, "big");
  HostBuffer b = arena_.allocate(64 * kSmallBlock, Purpose::kStaging);
  std::memset(b.data(), 3, 64 * kSmallBlock);
  IoTicket t = store.write(r, 0, b.data(), 64 * kSmallBlock);
  EXPECT_TRUE(t);
  store.wait(t);
  EXPECT_FALSE(t);  // waited: empty
  EXPECT_EQ(store.info().bytes_written, 64 * kSmallBlock);
  // A ticket dropped without wait() waits in its destructor: the counters are complete after it.
  { IoTicket dropped = store.read(r, 0, b.data(), 64 * kSmallBlock); }
  EXPECT_EQ(store.info().bytes_read, 64 * kSmallBlock);
}

}  // namespace
}  // namespace rondo::offload
