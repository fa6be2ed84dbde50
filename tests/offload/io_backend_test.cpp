// The I/O layer under the NVMe store: the fault rule syntax and counting, and both backends
// resubmitting short transfers (two-segment requests included) and reporting the end of a file.
#include "offload/io_backend.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "offload/offload_file.h"
#include "tests/offload/io_test_util.h"

namespace rondo::offload {
namespace {

using namespace test;

// ---------------------------------------------------------------------------------------------
// Fault rule syntax

TEST(FaultRules, ParseKindsOpsAndCounts) {
  std::vector<FaultRule> r = rules(
      " enospc:write:3, eio:read , short, corrupt:read:2+, einval_odirect,"
      "partial:write:*,enomem:register,enosys:setup,eopnotsupp:fallocate:1");
  ASSERT_EQ(r.size(), 9u);
  EXPECT_EQ(r[0].kind, FaultKind::kErrno);
  EXPECT_EQ(r[0].error, ENOSPC);
  EXPECT_EQ(r[0].op, FaultOp::kWrite);
  EXPECT_EQ(r[0].nth, 3u);
  EXPECT_FALSE(r[0].and_later);
  EXPECT_EQ(r[1].error, EIO);
  EXPECT_EQ(r[1].op, FaultOp::kRead);
  EXPECT_EQ(r[1].nth, 1u);
  EXPECT_EQ(r[2].kind, FaultKind::kShort);
  EXPECT_EQ(r[2].op, FaultOp::kRead);
  EXPECT_EQ(r[3].kind, FaultKind::kCorrupt);
  EXPECT_EQ(r[3].nth, 2u);
  EXPECT_TRUE(r[3].and_later);
  EXPECT_EQ(r[4].kind, FaultKind::kEinvalODirect);
  EXPECT_EQ(r[4].op, FaultOp::kOpen);
  EXPECT_EQ(r[4].nth, 0u);  // every O_DIRECT open
  EXPECT_EQ(r[5].kind, FaultKind::kPartial);
  EXPECT_EQ(r[5].op, FaultOp::kWrite);
  EXPECT_EQ(r[5].nth, 0u);
  EXPECT_EQ(r[6].op, FaultOp::kRegister);
  EXPECT_EQ(r[7].op, FaultOp::kSetup);
  EXPECT_EQ(r[8].error, EOPNOTSUPP);
  EXPECT_TRUE(rules("").empty());
}

TEST(FaultRules, BadSyntaxNamesTheSourceAndTheRule) {
  for (const char* bad :
       {"enospc", "bogus:write", "eio:reed", "eio:read:0", "eio:read:x", "short:write",
        "corrupt:write:1", "partial:open", "eio:read:1:2", "einval_odirect:read"}) {
    try {
      parse_fault_rules(std::string("eio:read:1,") + bad, "RONDO_FAULT_IO");
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "RONDO_FAULT_IO: bad fault rule")) << e.what();
      EXPECT_TRUE(contains(e.what(), std::string("'") + bad + "'")) << e.what();
      EXPECT_TRUE(contains(e.what(), "kind[:op[:nth]]")) << e.what();
    }
  }
}

TEST(FaultRules, CountAttemptsPerOpAndApplyTheFirstMatch) {
  FaultInjector f(rules("eio:write:2,enospc:write:2+,partial:read:1"));
  char page[8192] = {};
  iovec v{page, sizeof page};
  EXPECT_EQ(f.on_transfer(IoOp::kWrite, -1, 0, &v, 1, 8192), 8192);
  EXPECT_EQ(f.on_transfer(IoOp::kWrite, -1, 0, &v, 1, 8192), -EIO);     // 2nd: the first rule
  EXPECT_EQ(f.on_transfer(IoOp::kWrite, -1, 0, &v, 1, 8192), -ENOSPC);  // 3rd: 2+
  EXPECT_EQ(f.on_transfer(IoOp::kRead, -1, 0, &v, 1, 8192), 4096);      // half, page-aligned
  EXPECT_EQ(f.on_transfer(IoOp::kRead, -1, 4096, &v, 1, 4096), 4096);
  EXPECT_EQ(f.attempts(FaultOp::kWrite), 3u);
  EXPECT_EQ(f.attempts(FaultOp::kRead), 2u);
}

// ---------------------------------------------------------------------------------------------
// The backends directly

struct CountedRequest final : IoRequest {
  std::mutex* mutex = nullptr;
  std::condition_variable* cv = nullptr;
  int* ended = nullptr;
  IoResult result;
  void complete(const IoResult& r) noexcept override {
    std::lock_guard lock(*mutex);
    result = r;
    ++*ended;
    cv->notify_all();
  }
};

TEST(IoBackend, ResubmitsShortTransfersAndReportsTheEndOfTheFile) {
  Scratch scratch(disk_root());
  for (BackendKind kind : {BackendKind::kIoUring, BackendKind::kThreads}) {
    std::string why;
    if (kind == BackendKind::kIoUring && !io_uring_available(&why)) {
      std::cout << "[ SKIP ] io_uring part: " << why << "\n";
      continue;
    }
    SCOPED_TRACE(to_string(kind));
    FaultInjector faults(rules("partial:write:1,partial:read:2"));
    IoBackendChoice choice = make_io_backend({.kind = kind, .queue_depth = 4, .faults = &faults});
    OffloadFile file = create_offload_file(scratch.path(), true, nullptr);
    preallocate(file, 64 * 1024, nullptr);
    void* raw = std::aligned_alloc(4096, 3 * 65536);
    ASSERT_NE(raw, nullptr);
    char* src = static_cast<char*>(raw);
    char* dst = src + 65536;
    char* page = dst + 65536;
    std::mt19937_64 rng(fresh_seed());
    fill_random(src, 65536, rng);
    std::memset(dst, 0, 65536);
    std::mutex mutex;
    std::condition_variable cv;
    int ended = 0;
    auto run = [&](CountedRequest& r) {
      r.mutex = &mutex;
      r.cv = &cv;
      r.ended = &ended;
      const int before = ended;
      IoRequest* one = &r;
      choice.backend->submit(&one, 1);
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return ended > before; });
    };
    // Two segments: 60 KiB from src and a 4 KiB page; the first attempt is cut in half.
    std::memcpy(page, src + 61440, 4096);
    CountedRequest w;
    w.op = IoOp::kWrite;
    w.fd = file.fd.get();
    w.iov[0] = {src, 61440};
    w.iov[1] = {page, 4096};
    w.iov_count = 2;
    run(w);
    EXPECT_TRUE(w.result.ok());
    EXPECT_EQ(w.result.bytes, 65536u);
    EXPECT_EQ(faults.attempts(FaultOp::kWrite), 2u);  // the half, then the rest
    CountedRequest r1;                                // read 1: whole
    r1.fd = file.fd.get();
    r1.iov[0] = {dst, 65536};
    run(r1);
    EXPECT_TRUE(r1.result.ok());
    EXPECT_EQ(first_difference(dst, src, 65536), -1);
    std::memset(dst, 0, 65536);
    CountedRequest r2;  // read 2: cut in half, resubmitted
    r2.fd = file.fd.get();
    r2.iov[0] = {dst, 65536};
    run(r2);
    EXPECT_TRUE(r2.result.ok());
    EXPECT_EQ(faults.attempts(FaultOp::kRead), 3u);
    EXPECT_EQ(first_difference(dst, src, 65536), -1);
    // Past the end of the file: the read ends early and says so.
    CountedRequest r3;
    r3.fd = file.fd.get();
    r3.offset = 32768;
    r3.iov[0] = {dst, 65536};
    run(r3);
    EXPECT_FALSE(r3.result.ok());
    EXPECT_TRUE(r3.result.ended);
    EXPECT_EQ(r3.result.error, 0);
    EXPECT_EQ(r3.result.bytes, 32768u);
    std::free(raw);
  }
}

}  // namespace
}  // namespace rondo::offload
