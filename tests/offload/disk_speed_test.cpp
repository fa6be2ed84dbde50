// The disk speed probes: no timing is asserted (nothing times itself in a unit test), only that
// they run on both kinds of folder, say what they used, and leave no file behind.
#include "offload/disk_speed.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "kernels/error.h"
#include "tests/offload/io_test_util.h"

namespace rondo::offload {
namespace {

namespace fs = std::filesystem;
using namespace test;

TEST(DiskSpeed, MeasuresBothPlacesAndLeavesNoFile) {
  for (const std::string& root : {disk_root(), std::string("/dev/shm")}) {
    if (!fs::is_directory(root)) continue;
    Scratch scratch(root);
    SCOPED_TRACE(root);
    for (BackendKind kind : {BackendKind::kAuto, BackendKind::kThreads}) {
      DiskSpeed d = measure_disk(scratch.path(), 4 << 20, kind, 1 << 20, 4);
      EXPECT_GT(d.read_bytes_per_s, 0);
      EXPECT_GT(d.write_bytes_per_s, 0);
      EXPECT_EQ(d.bytes, 4u << 20);
      EXPECT_EQ(d.queue_depth, 4u);
      if (kind == BackendKind::kThreads) {
        EXPECT_EQ(d.backend, "threads");
      } else {
        EXPECT_EQ(d.backend, io_uring_available() ? "io_uring" : "threads");
      }
      EXPECT_TRUE(d.direct || !d.direct_note.empty());
    }
    DiskSpeed raw = measure_disk_raw(scratch.path(), (4 << 20) + 100, 1 << 20);
    EXPECT_GT(raw.read_bytes_per_s, 0);
    EXPECT_EQ(raw.bytes, (4u << 20) + 4096);
    EXPECT_EQ(raw.backend, "pread/pwrite");
    EXPECT_TRUE(scratch.entries().empty());
  }
  try {
    measure_disk("/proc/rondo-cannot-be-here", 4096);
    ADD_FAILURE() << "measured a folder that cannot exist";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "/proc/rondo-cannot-be-here")) << e.what();
    EXPECT_TRUE(contains(e.what(), "hardware.offload_dir")) << e.what();
  }
}

}  // namespace
}  // namespace rondo::offload
