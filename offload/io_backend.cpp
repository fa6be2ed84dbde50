// The shared retry semantics, the backend choice, and the thread-pool backend.
#include "offload/io_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "kernels/error.h"

namespace rondo::offload {

const char* to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto:
      return "auto";
    case BackendKind::kIoUring:
      return "io_uring";
    case BackendKind::kThreads:
      return "threads";
  }
  return "?";
}

BackendKind parse_backend_kind(const std::string& text, const std::string& what) {
  if (text == "auto") return BackendKind::kAuto;
  if (text == "io_uring") return BackendKind::kIoUring;
  if (text == "threads") return BackendKind::kThreads;
  throw Error("invalid " + what + " '" + text + "': expected auto, io_uring or threads");
}

std::uint64_t IoRequest::bytes() const {
  std::uint64_t n = 0;
  for (int i = 0; i < iov_count; ++i)
    n += iov[i].iov_len;
  return n;
}

namespace detail {

namespace {
// The segments after the first `done` bytes.
void compute_remaining(IoRequest& r) {
  std::uint64_t skip = r.progress.done;
  int n = 0;
  for (int i = 0; i < r.iov_count; ++i) {
    const std::uint64_t len = r.iov[i].iov_len;
    if (skip >= len) {
      skip -= len;
      continue;
    }
    r.progress.now[n].iov_base = static_cast<char*>(r.iov[i].iov_base) + skip;
    r.progress.now[n].iov_len = len - skip;
    skip = 0;
    ++n;
  }
  r.progress.now_count = n;
}
}  // namespace

void begin(IoRequest& request) {
  RONDO_ASSERT(request.iov_count >= 1 && request.iov_count <= 2);
  request.progress.done = 0;
  request.progress.retries = 0;
  request.progress.buffer_index = -1;
  compute_remaining(request);
}

Step advance(IoRequest& r, std::int64_t result, IoResult* out) {
  const std::uint64_t total = r.bytes();
  auto finish = [&](int error, bool ended) {
    out->error = error;
    out->ended = ended;
    out->bytes = r.progress.done;
    out->retries = r.progress.retries;
    return error == 0 && !ended ? Step::kDone : Step::kFailed;
  };
  if (result > 0) {
    r.progress.done +=
        std::min<std::uint64_t>(static_cast<std::uint64_t>(result), total - r.progress.done);
    if (r.progress.done == total) return finish(0, false);
    compute_remaining(r);  // a short transfer: the rest goes again
    return Step::kAgain;
  }
  if (result == 0) {
    if (total == r.progress.done) return finish(0, false);
    if (r.op == IoOp::kRead) return finish(0, true);  // the end of the file
    // A write accepted for 0 bytes: nothing says it will not work when tried again, but bounded.
    if (++r.progress.retries > kMaxRetries) return finish(0, true);
    return Step::kAgain;
  }
  const int error = static_cast<int>(-result);
  if (error == EINTR || error == EAGAIN) {
    if (++r.progress.retries > kMaxRetries) return finish(error, false);
    return Step::kAgain;
  }
  return finish(error, false);
}

}  // namespace detail

namespace {

// Note [Thread-pool backend]: a few threads, each running one request at a time with
// preadv/pwritev to its end (the same detail::advance decisions as io_uring). Enough to keep an
// NVMe drive busy with 1 MiB requests; used where io_uring cannot be set up, and in tests.
class ThreadBackend final : public IoBackend {
 public:
  ThreadBackend(unsigned threads, FaultInjector* faults) : faults_(faults) {
    workers_.reserve(threads);
    for (unsigned i = 0; i < threads; ++i)
      workers_.emplace_back([this] { run(); });
  }
  ~ThreadBackend() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    ready_.notify_all();
    for (std::thread& t : workers_)
      t.join();
  }
  const char* name() const override { return "threads"; }

  void submit(IoRequest* const* requests, std::size_t count) override {
    {
      std::lock_guard lock(mutex_);
      for (std::size_t i = 0; i < count; ++i) {
        detail::begin(*requests[i]);
        queue_.push_back(requests[i]);
      }
    }
    if (count == 1)
      ready_.notify_one();
    else
      ready_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      IoRequest* r;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_, and nothing left
        r = queue_.front();
        queue_.pop_front();
      }
      IoResult result;
      for (;;) {
        IoRequest::Progress& p = r->progress;
        const off_t at = static_cast<off_t>(r->offset + p.done);
        ssize_t n = r->op == IoOp::kRead ? ::preadv(r->fd, p.now, p.now_count, at)
                                         : ::pwritev(r->fd, p.now, p.now_count, at);
        std::int64_t res = n < 0 ? -static_cast<std::int64_t>(errno) : n;
        if (faults_)
          res = faults_->on_transfer(r->op, r->fd, r->offset + p.done, p.now, p.now_count, res);
        if (detail::advance(*r, res, &result) != detail::Step::kAgain) break;
      }
      r->complete(result);
    }
  }

  FaultInjector* faults_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<IoRequest*> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoBackend> make_thread_backend(unsigned threads, FaultInjector* faults) {
  return std::make_unique<ThreadBackend>(std::max(1u, threads), faults);
}

IoBackendChoice make_io_backend(const IoBackendOptions& options) {
  RONDO_ASSERT(options.queue_depth >= 1);
  const unsigned threads = options.threads ? options.threads : std::min(options.queue_depth, 4u);
  IoBackendChoice choice;
  if (options.kind == BackendKind::kThreads) {
    choice.backend = make_thread_backend(threads, options.faults);
    return choice;
  }
  try {
    choice.backend = make_io_uring_backend(options.queue_depth, options.faults);
  } catch (const Error& e) {
    if (options.kind == BackendKind::kIoUring) throw;
    choice.note = std::string(e.what()) + "; using the thread-pool backend instead";
    choice.backend = make_thread_backend(threads, options.faults);
  }
  return choice;
}

}  // namespace rondo::offload
