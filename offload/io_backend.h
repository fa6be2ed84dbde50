// Asynchronous file I/O behind one interface, chosen at run time: io_uring (fixed queue depth,
// batched submission, optionally registered buffers) or a pool of threads running pread/pwrite.
// Both give the same semantics — a request completes exactly once, with all its bytes or an
// error; short transfers are resubmitted for the remainder; EINTR and EAGAIN are retried (a
// bounded number of times) — because they share the code that decides (detail::advance).
// Used by NvmeStore and measure_disk; fault rules (io_faults.h) act where the OS answers.
//
//   auto choice = offload::make_io_backend({.kind = offload::BackendKind::kAuto});
//   struct Req final : offload::IoRequest {
//     void complete(const offload::IoResult& r) noexcept override { /* r.error, r.bytes */ }
//   } req;
//   req.op = offload::IoOp::kRead; req.fd = fd; req.offset = 0; req.iov[0] = {buf, 1 << 20};
//   offload::IoRequest* batch[] = {&req};
//   choice.backend->submit(batch, 1);
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "offload/io_faults.h"

namespace rondo::offload {

enum class BackendKind { kAuto, kIoUring, kThreads };
const char* to_string(BackendKind kind);  // "auto", "io_uring", "threads"
// "auto" | "io_uring" | "threads"; throws Error naming `what` otherwise.
BackendKind parse_backend_kind(const std::string& text,
                               const std::string& what = "offload backend");

struct IoResult {
  int error = 0;              // 0, or the errno the transfer failed with
  std::uint64_t bytes = 0;    // transferred (all of them when error == 0 and !ended)
  bool ended = false;         // a read met the end of the file (or a write was accepted for 0
                              // bytes, repeatedly) before all bytes were transferred
  std::uint32_t retries = 0;  // EINTR/EAGAIN answers that were retried
  bool ok() const { return error == 0 && !ended; }
};

// One transfer between a file range and up to two buffer segments (the second is how a caller
// adds a bounce page for an unaligned tail). With O_DIRECT, offset, segment addresses and
// lengths must be multiples of 4096. The request must stay alive until complete() is called.
class IoRequest {
 public:
  IoOp op = IoOp::kRead;
  int fd = -1;
  std::uint64_t offset = 0;  // in the file
  iovec iov[2] = {};
  int iov_count = 1;

  std::uint64_t bytes() const;
  // Called exactly once, on a backend thread, when the transfer has ended; that thread's other
  // completions wait meanwhile (io_uring has one). It may submit new requests and may destroy the
  // request: the backend does not touch it after calling complete().
  virtual void complete(const IoResult& result) noexcept = 0;

  // The backend's bookkeeping (reset by submit()).
  struct Progress {
    std::uint64_t done = 0;
    std::uint32_t retries = 0;
    iovec now[2] = {};  // the part still to transfer: io_uring reads it when the SQE is submitted
    int now_count = 0;
    int buffer_index = -1;  // io_uring: registered buffer used, -1 = none
  } progress;

 protected:
  ~IoRequest() = default;
};

// A host range for IoBackend::register_buffers().
struct BufferSpan {
  void* data = nullptr;
  std::uint64_t bytes = 0;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const = 0;  // "io_uring" | "threads"

  // Starts the requests: as many at once as the queue depth allows, the rest queue up in order.
  // Thread-safe. Every request completes exactly once, through IoRequest::complete(), on a
  // backend thread; never inside submit(). The destructor waits for nothing: the owner must have
  // seen every request complete before destroying the backend.
  virtual void submit(IoRequest* const* requests, std::size_t count) = 0;

  // Optional fast path: pins and maps these host ranges once (see the io_uring backend), replacing
  // any earlier set. Returns "" when registered, else why not — the backend then keeps using plain
  // reads and writes, so a failure here costs speed, not correctness. Thread-safe.
  virtual std::string register_buffers(const std::vector<BufferSpan>& buffers) {
    return std::string("the ") + name() + " backend has no registered buffers";
  }
  virtual std::size_t registered_buffers() const { return 0; }
};

struct IoBackendOptions {
  BackendKind kind = BackendKind::kAuto;
  unsigned queue_depth = 32;        // io_uring: requests in flight at once; threads: see below
  unsigned threads = 0;             // thread-pool workers; 0 = min(queue_depth, 4)
  FaultInjector* faults = nullptr;  // rules applied where the OS answers; must outlive the backend
};

struct IoBackendChoice {
  std::unique_ptr<IoBackend> backend;
  std::string note;  // why another backend than asked for runs ("" when it is the one asked for)
};

// kAuto: io_uring unless it cannot be set up here (kernel too old, seccomp in a container, the
// kernel.io_uring_disabled sysctl), then threads with the reason in note. kIoUring: io_uring or
// Error with the reason and what to do. kThreads: threads.
IoBackendChoice make_io_backend(const IoBackendOptions& options);

std::unique_ptr<IoBackend> make_thread_backend(unsigned threads, FaultInjector* faults);
// Throws Error (with the reason: "io_uring_queue_init: Operation not permitted (EPERM)") when
// io_uring cannot be set up.
std::unique_ptr<IoBackend> make_io_uring_backend(unsigned queue_depth, FaultInjector* faults);

// Can io_uring be set up here? When not, *reason says why (for GTEST_SKIP and reports).
bool io_uring_available(std::string* reason = nullptr);

namespace detail {

// How many times EINTR/EAGAIN (or a write that accepts 0 bytes) is retried before the transfer
// fails with that error: a kernel that keeps answering EAGAIN must not spin forever.
inline constexpr std::uint32_t kMaxRetries = 100;

// Resets the request's progress and computes its first segments.
void begin(IoRequest& request);
enum class Step { kDone, kAgain, kFailed };
// What to do after an attempt that returned `result` (bytes, or -errno). kAgain: the progress
// segments now describe the remainder, submit again. kDone/kFailed: *out holds the final result.
Step advance(IoRequest& request, std::int64_t result, IoResult* out);

}  // namespace detail

}  // namespace rondo::offload
