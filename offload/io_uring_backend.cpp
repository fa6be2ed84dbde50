// The io_uring backend (liburing). See Note [One thread owns the ring].
#include <liburing.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "kernels/error.h"
#include "offload/io_backend.h"
#include "offload/offload_file.h"

namespace rondo::offload {
namespace {

std::string unavailable(const std::string& call, int error) {
  return "io_uring is not available here (" + call + ": " + errno_text(error) +
         "): the kernel is older than 5.1, a container's seccomp profile blocks it, or the "
         "kernel.io_uring_disabled sysctl is set";
}

// Note [One thread owns the ring]: every submission and every completion happens on one thread
// that the backend owns. Callers hand requests over through a locked queue and wake the thread
// with an eventfd that the ring itself polls. Why not let callers submit directly: io_uring ties
// a request to the task that submitted it — its completion work runs in that task's context, and
// when that thread exits, work the kernel handed to its io-wq workers is cancelled. Device
// loaders and the optimizer are threads that come and go; the ring thread stays. It also makes
// the ring lock-free (no shared SQ) and batches naturally: whatever is queued when the thread
// wakes goes to the kernel in one io_uring_enter.
//
// Note [Registered buffers]: io_uring_register_buffers pins and maps the host ranges once. A
// plain O_DIRECT read or write pins the user pages, builds the scatter list and unpins them again
// on every request (get_user_pages walks the page tables each time); a READ_FIXED/WRITE_FIXED on
// a registered range skips all of that. At 1 MiB requests this saves a few percent of one core
// per GB/s — worth having for the staging buffers that every layer passes through, not worth
// failing for: when the kernel refuses (RLIMIT_MEMLOCK too low for the pinned pages, an old
// kernel), requests use plain READV/WRITEV and only cost a little more CPU.
class UringBackend final : public IoBackend {
 public:
  UringBackend(unsigned queue_depth, FaultInjector* faults)
      : queue_depth_(std::max(1u, queue_depth)), faults_(faults) {
    int err = faults_ ? faults_->on_call(FaultOp::kSetup) : 0;
    // One more entry than the queue depth: the eventfd poll is always armed.
    unsigned entries = 1;
    while (entries < queue_depth_ + 1)
      entries *= 2;
    if (err == 0) {
      const int r = io_uring_queue_init(entries, &ring_, 0);
      err = r < 0 ? -r : 0;
    }
    if (err != 0) throw Error(unavailable("io_uring_queue_init", err));
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) {
      const int e = errno;
      io_uring_queue_exit(&ring_);
      throw Error("io_uring cannot be used: eventfd failed: " + errno_text(e) +
                  " (too many open files? see `ulimit -n`)");
    }
    thread_ = std::thread([this] { run(); });
  }

  ~UringBackend() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake();
    thread_.join();
    io_uring_queue_exit(&ring_);
    if (::close(wake_fd_) != 0)
      std::fprintf(stderr, "rondo: warning: closing the io_uring eventfd failed: %s\n",
                   errno_text(errno).c_str());
  }

  const char* name() const override { return "io_uring"; }

  void submit(IoRequest* const* requests, std::size_t count) override {
    if (count == 0) return;
    {
      std::lock_guard lock(mutex_);
      for (std::size_t i = 0; i < count; ++i) {
        detail::begin(*requests[i]);
        incoming_.push_back(requests[i]);
      }
    }
    wake();
  }

  std::string register_buffers(const std::vector<BufferSpan>& buffers) override {
    Control control;
    control.buffers = buffers;
    {
      std::lock_guard lock(mutex_);
      controls_.push_back(&control);
    }
    wake();
    std::unique_lock lock(control.mutex);
    control.cv.wait(lock, [&] { return control.done; });
    return control.result;
  }

  std::size_t registered_buffers() const override {
    std::lock_guard lock(mutex_);
    return registered_count_;
  }

 private:
  static constexpr std::uint64_t kWakeTag = 1;  // user_data of the eventfd poll (requests: >1)

  struct Control {
    std::vector<BufferSpan> buffers;
    std::string result;
    bool done = false;
    std::mutex mutex;
    std::condition_variable cv;
  };
  struct Finished {
    IoRequest* request;
    IoResult result;
  };
  struct Registered {
    std::uintptr_t begin, end;
    int index;
  };

  void wake() {
    wake_cv_.notify_one();  // only listened to once the ring is broken (see run())
    const std::uint64_t one = 1;
    ssize_t n;
    do {
      n = ::write(wake_fd_, &one, sizeof one);
    } while (n < 0 && errno == EINTR);
    // EAGAIN: the counter is saturated, so the ring thread has a wake-up pending anyway.
    RONDO_ASSERT_MSG(n == sizeof one || (n < 0 && errno == EAGAIN),
                     "writing the io_uring eventfd: " + errno_text(errno));
  }

  void run() {
    std::vector<Finished> finished;
    for (;;) {
      bool stopping;
      std::vector<Control*> controls;
      {
        std::lock_guard lock(mutex_);
        for (IoRequest* r : incoming_) {
          if (broken_)
            failed_now_.push_back(r);
          else
            ready_.push_back(r);
        }
        incoming_.clear();
        controls.swap(controls_);
        stopping = stop_;
      }
      for (Control* c : controls)
        apply(*c);
      if (!poll_armed_) arm_poll();
      fill_and_submit();
      for (IoRequest* r : failed_now_)
        finished.push_back({r, IoResult{broken_, r->progress.done}});
      failed_now_.clear();
      if (finished.empty()) {
        if (stopping && in_flight_ == 0 && ready_.empty()) return;
        if (broken_ && in_flight_ == 0) {
          // No poll in the kernel any more: wait for work or the end here instead.
          std::unique_lock lock(mutex_);
          wake_cv_.wait(lock, [&] { return stop_ || !incoming_.empty() || !controls_.empty(); });
          continue;
        }
        reap(&finished);
        fill_and_submit();  // keep the drive busy while the completions below run
      }
      for (const Finished& f : finished)
        f.request->complete(f.result);
      finished.clear();
    }
  }

  void arm_poll() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    RONDO_ASSERT(sqe != nullptr);  // the ring has one entry more than the queue depth
    io_uring_prep_poll_add(sqe, wake_fd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    poll_armed_ = true;
  }

  int find_registered(const iovec& v) const {
    const auto addr = reinterpret_cast<std::uintptr_t>(v.iov_base);
    auto it = std::upper_bound(registered_.begin(), registered_.end(), addr,
                               [](std::uintptr_t a, const Registered& r) { return a < r.begin; });
    if (it == registered_.begin()) return -1;
    --it;
    return addr + v.iov_len <= it->end ? it->index : -1;
  }

  void prep(IoRequest* r) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    RONDO_ASSERT(sqe != nullptr);  // in_flight_ < queue_depth_ and the ring has room for one more
    IoRequest::Progress& p = r->progress;
    const std::uint64_t at = r->offset + p.done;
    p.buffer_index = -1;
    if (p.now_count == 1 && p.now[0].iov_len <= UINT32_MAX)
      p.buffer_index = find_registered(p.now[0]);
    if (p.buffer_index >= 0) {
      const auto len = static_cast<unsigned>(p.now[0].iov_len);
      if (r->op == IoOp::kRead)
        io_uring_prep_read_fixed(sqe, r->fd, p.now[0].iov_base, len, at, p.buffer_index);
      else
        io_uring_prep_write_fixed(sqe, r->fd, p.now[0].iov_base, len, at, p.buffer_index);
    } else if (r->op == IoOp::kRead) {
      io_uring_prep_readv(sqe, r->fd, p.now, static_cast<unsigned>(p.now_count), at);
    } else {
      io_uring_prep_writev(sqe, r->fd, p.now, static_cast<unsigned>(p.now_count), at);
    }
    io_uring_sqe_set_data(sqe, r);
    prepped_.push_back(r);
    ++in_flight_;
  }

  void fill_and_submit() {
    if (broken_) return;
    while (in_flight_ < queue_depth_ && !ready_.empty()) {
      prep(ready_.front());
      ready_.pop_front();
    }
    if (io_uring_sq_ready(&ring_) == 0) return;
    for (;;) {
      const int r = io_uring_submit(&ring_);
      if (r >= 0) {
        // The kernel took the first r entries (the poll may be among them; it is not in prepped_).
        const std::size_t left = io_uring_sq_ready(&ring_);
        if (left == 0) {
          prepped_.clear();
          return;
        }
        prepped_.erase(prepped_.begin(), prepped_.end() - static_cast<std::ptrdiff_t>(
                                                              std::min(left, prepped_.size())));
        if (in_flight_ > left) return;  // completions will come; submit the rest after them
        continue;
      }
      if (r == -EINTR) continue;
      if (r == -EAGAIN || r == -EBUSY) {
        // The kernel is short of memory for requests, or completions wait to be reaped.
        if (in_flight_ > prepped_.size()) return;  // reap first, then submit again
        sched_yield();
        continue;
      }
      // The ring refuses submissions (a bug, or a kernel in trouble): fail what it did not take
      // and everything after, so that nothing waits forever.
      broken_ = -r;
      std::fprintf(stderr, "rondo: error: io_uring_submit: %s; failing the queued requests\n",
                   errno_text(-r).c_str());
      for (IoRequest* q : prepped_)
        failed_now_.push_back(q);
      in_flight_ -= static_cast<unsigned>(prepped_.size());
      prepped_.clear();
      for (IoRequest* q : ready_)
        failed_now_.push_back(q);
      ready_.clear();
      return;
    }
  }

  // Waits for one completion, then takes every other one that is there (liburing's pattern).
  void reap(std::vector<Finished>* finished) {
    io_uring_cqe* cqe = nullptr;
    int r;
    do {
      r = io_uring_wait_cqe(&ring_, &cqe);
    } while (r == -EINTR || r == -EAGAIN);
    // Requests are in flight in the kernel: giving up would let their buffers be freed under DMA.
    RONDO_ASSERT_MSG(r == 0, "io_uring_wait_cqe: " + errno_text(-r));
    unsigned seen = 0;
    unsigned head;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        std::uint64_t value;
        ssize_t n;
        do {
          n = ::read(wake_fd_, &value, sizeof value);
        } while (n < 0 && errno == EINTR);
        RONDO_ASSERT_MSG(n == sizeof value || (n < 0 && errno == EAGAIN),
                         "reading the io_uring eventfd: " + errno_text(errno));
        poll_armed_ = false;
        continue;
      }
      auto* req = reinterpret_cast<IoRequest*>(static_cast<std::uintptr_t>(tag));
      --in_flight_;
      std::int64_t res = cqe->res;
      IoRequest::Progress& p = req->progress;
      if (faults_)
        res = faults_->on_transfer(req->op, req->fd, req->offset + p.done, p.now, p.now_count, res);
      IoResult result;
      if (detail::advance(*req, res, &result) == detail::Step::kAgain)
        ready_.push_front(req);  // the remainder goes first
      else
        finished->push_back({req, result});
    }
    io_uring_cq_advance(&ring_, seen);
  }

  void apply(Control& c) {
    std::string why;
    if (!registered_.empty()) {
      const int r = io_uring_unregister_buffers(&ring_);
      if (r < 0) why = "io_uring_unregister_buffers: " + errno_text(-r);
      registered_.clear();
    }
    if (why.empty() && !c.buffers.empty()) {
      int err = faults_ ? faults_->on_call(FaultOp::kRegister) : 0;
      // The kernel takes at most 1 GiB per registered buffer: larger spans go in pieces.
      constexpr std::uint64_t kMaxPiece = std::uint64_t{1} << 30;
      std::vector<iovec> iov;
      for (const BufferSpan& b : c.buffers)
        for (std::uint64_t at = 0; at < b.bytes; at += kMaxPiece)
          iov.push_back({static_cast<char*>(b.data) + at, std::min(kMaxPiece, b.bytes - at)});
      if (err == 0) {
        const int r =
            io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
        err = r < 0 ? -r : 0;
      }
      if (err != 0) {
        why = "io_uring_register_buffers: " + errno_text(err);
        if (err == ENOMEM)
          why +=
              " (registered pages are locked in memory; RLIMIT_MEMLOCK, see `ulimit -l`, is "
              "too low for them)";
      } else {
        for (std::size_t i = 0; i < iov.size(); ++i) {
          const auto b = reinterpret_cast<std::uintptr_t>(iov[i].iov_base);
          registered_.push_back({b, b + iov[i].iov_len, static_cast<int>(i)});
        }
        std::sort(registered_.begin(), registered_.end(),
                  [](const Registered& a, const Registered& b) { return a.begin < b.begin; });
      }
    }
    if (!why.empty()) why += "; plain reads and writes are used instead";
    {
      std::lock_guard lock(mutex_);
      registered_count_ = registered_.size();
    }
    std::lock_guard lock(c.mutex);
    c.result = why;
    c.done = true;
    c.cv.notify_all();
  }

  const unsigned queue_depth_;
  FaultInjector* const faults_;
  io_uring ring_{};
  int wake_fd_ = -1;

  mutable std::mutex mutex_;  // guards the hand-over fields below
  std::deque<IoRequest*> incoming_;
  std::vector<Control*> controls_;
  std::condition_variable wake_cv_;
  bool stop_ = false;
  std::size_t registered_count_ = 0;

  // The ring thread's own.
  std::deque<IoRequest*> ready_;     // to prep, in order (resubmitted remainders first)
  std::vector<IoRequest*> prepped_;  // prepared, not yet taken by the kernel
  std::vector<IoRequest*> failed_now_;
  std::vector<Registered> registered_;  // sorted by begin
  unsigned in_flight_ = 0;              // requests prepared and not completed (the poll excluded)
  bool poll_armed_ = false;
  int broken_ = 0;  // errno of a failed io_uring_submit: no submissions after it

  std::thread thread_;
};

}  // namespace

std::unique_ptr<IoBackend> make_io_uring_backend(unsigned queue_depth, FaultInjector* faults) {
  return std::make_unique<UringBackend>(queue_depth, faults);
}

bool io_uring_available(std::string* reason) {
  io_uring ring{};
  const int r = io_uring_queue_init(2, &ring, 0);
  if (r < 0) {
    if (reason) *reason = unavailable("io_uring_queue_init", -r);
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
}

}  // namespace rondo::offload
