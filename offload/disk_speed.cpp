#include "offload/disk_speed.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "kernels/error.h"
#include "offload/host_arena.h"
#include "offload/nvme_store.h"
#include "offload/offload_file.h"

namespace rondo::offload {
namespace {

constexpr std::uint64_t kPage = 4096;
using Clock = std::chrono::steady_clock;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char, FreeDeleter>;

// Page-aligned and filled with xorshift output: nothing on the way can compress or dedupe it.
Buffer random_buffer(std::uint64_t bytes, std::uint64_t seed) {
  Buffer b(static_cast<char*>(std::aligned_alloc(kPage, bytes)));
  if (!b) throw std::bad_alloc();
  auto* words = reinterpret_cast<std::uint64_t*>(b.get());
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::uint64_t i = 0; i < bytes / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    words[i] = x;
  }
  return b;
}

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) {
  return (n + to - 1) / to * to;
}

// Buffered files: the writes are not on the drive until fdatasync, and reads would come from the
// page cache, so flush and drop it (what the measurement then reads is the drive's).
void settle(const OffloadFile& file, DiskSpeed* speed) {
  int r;
  do {
    r = ::fdatasync(file.fd.get());
  } while (r != 0 && errno == EINTR);
  if (r != 0)
    throw Error("measuring the drive of " + file.dir + ": fdatasync failed: " + errno_text(errno));
  if (!file.direct) {
    r = ::posix_fadvise(file.fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    if (r != 0)
      speed->direct_note += "; the page cache could not be dropped (" + errno_text(r) +
                            "): the read figure may be the cache's";
  }
}

double rate(std::uint64_t bytes, Clock::time_point from) {
  const double s = std::chrono::duration<double>(Clock::now() - from).count();
  return s > 0 ? static_cast<double>(bytes) / s : 0;
}

struct SpeedRequest final : IoRequest {
  std::mutex* mutex = nullptr;
  std::condition_variable* cv = nullptr;
  std::size_t* ended = nullptr;
  IoResult result;
  void complete(const IoResult& r) noexcept override {
    std::lock_guard lock(*mutex);
    result = r;
    ++*ended;
    cv->notify_one();
  }
};

// All of the file, in order, handed to the backend at once: its own queue keeps `queue_depth`
// in flight, so what is measured is the backend, not how fast this thread wakes up to resubmit
// (on a busy machine, that alone can cost a third). The data is irrelevant here, so the requests
// share a few buffers round-robin.
void run_pass(IoBackend& backend, const OffloadFile& file, IoOp op, std::uint64_t bytes,
              std::uint64_t request, std::vector<Buffer>& buffers) {
  std::mutex mutex;
  std::condition_variable cv;
  std::size_t ended = 0;
  const std::size_t count = static_cast<std::size_t>((bytes + request - 1) / request);
  std::vector<SpeedRequest> requests(count);
  std::vector<IoRequest*> all;
  for (std::size_t i = 0; i < count; ++i) {
    SpeedRequest& r = requests[i];
    r.mutex = &mutex;
    r.cv = &cv;
    r.ended = &ended;
    r.op = op;
    r.fd = file.fd.get();
    r.offset = i * request;
    r.iov[0] = {buffers[i % buffers.size()].get(), std::min(request, bytes - r.offset)};
    all.push_back(&r);
  }
  backend.submit(all.data(), all.size());
  {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return ended == count; });
  }
  for (const SpeedRequest& r : requests)
    if (!r.result.ok())
      throw Error("measuring the drive of " + file.dir + ": " +
                  (op == IoOp::kRead ? "reading" : "writing") + " at offset " +
                  std::to_string(r.offset) + ": " +
                  (r.result.error ? errno_text(r.result.error) : "the file ended early") +
                  "; check the drive (dmesg) or choose another hardware.offload_dir");
}

}  // namespace

DiskSpeed measure_disk(const std::string& dir, std::uint64_t bytes, BackendKind kind,
                       std::uint64_t request_bytes, unsigned queue_depth,
                       const std::vector<FaultRule>& faults) {
  RONDO_ASSERT(bytes > 0 && request_bytes > 0 && request_bytes % kPage == 0 && queue_depth > 0);
  DiskSpeed speed;
  speed.bytes = round_up(bytes, kPage);
  speed.request_bytes = request_bytes;
  FaultInjector injector(faults);  // outlives the backend
  FaultInjector* const injected = injector.empty() ? nullptr : &injector;
  IoBackendChoice choice =
      make_io_backend({.kind = kind, .queue_depth = queue_depth, .faults = injected});
  speed.backend = choice.backend->name();
  speed.backend_note = choice.note;
  OffloadFile file = create_offload_file(dir, true, injected);
  speed.direct = file.direct;
  speed.direct_note = file.direct_note;
  preallocate(file, speed.bytes, injected);

  // No more buffers than requests in the file.
  const std::uint64_t requests = (speed.bytes + request_bytes - 1) / request_bytes;
  const unsigned depth = static_cast<unsigned>(std::min<std::uint64_t>(queue_depth, requests));
  speed.queue_depth = depth;
  std::vector<Buffer> buffers;
  for (unsigned i = 0; i < depth; ++i)
    buffers.push_back(random_buffer(request_bytes, i + 1));

  Clock::time_point t0 = Clock::now();
  run_pass(*choice.backend, file, IoOp::kWrite, speed.bytes, request_bytes, buffers);
  if (!file.direct) settle(file, &speed);
  speed.write_bytes_per_s = rate(speed.bytes, t0);
  if (file.direct) settle(file, &speed);  // not timed: O_DIRECT writes are on the drive already

  t0 = Clock::now();
  run_pass(*choice.backend, file, IoOp::kRead, speed.bytes, request_bytes, buffers);
  speed.read_bytes_per_s = rate(speed.bytes, t0);
  return speed;
}

DiskSpeed measure_disk_raw(const std::string& dir, std::uint64_t bytes,
                           std::uint64_t request_bytes) {
  RONDO_ASSERT(bytes > 0 && request_bytes > 0 && request_bytes % kPage == 0);
  DiskSpeed speed;
  speed.bytes = round_up(bytes, kPage);
  speed.request_bytes = request_bytes;
  speed.queue_depth = 1;
  speed.backend = "pread/pwrite";
  OffloadFile file = create_offload_file(dir, true, nullptr);
  speed.direct = file.direct;
  speed.direct_note = file.direct_note;
  preallocate(file, speed.bytes, nullptr);
  Buffer buffer = random_buffer(request_bytes, 1);

  auto pass = [&](IoOp op) {
    for (std::uint64_t at = 0; at < speed.bytes; at += request_bytes) {
      const std::uint64_t n = std::min(request_bytes, speed.bytes - at);
      for (std::uint64_t done = 0; done < n;) {  // a short transfer goes on where it stopped
        char* p = buffer.get() + done;
        const auto off = static_cast<off_t>(at + done);
        ssize_t r = op == IoOp::kRead ? ::pread(file.fd.get(), p, n - done, off)
                                      : ::pwrite(file.fd.get(), p, n - done, off);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r <= 0)
          throw Error("measuring the drive of " + dir + ": " +
                      (op == IoOp::kRead ? "pread" : "pwrite") + " at offset " +
                      std::to_string(at + done) + ": " +
                      (r < 0 ? errno_text(errno) : std::string("the file ended early")));
        done += static_cast<std::uint64_t>(r);
      }
    }
  };
  Clock::time_point t0 = Clock::now();
  pass(IoOp::kWrite);
  if (!file.direct) settle(file, &speed);
  speed.write_bytes_per_s = rate(speed.bytes, t0);
  if (file.direct) settle(file, &speed);
  t0 = Clock::now();
  pass(IoOp::kRead);
  speed.read_bytes_per_s = rate(speed.bytes, t0);
  return speed;
}

StoreSpeed measure_store(const std::string& dir, std::uint64_t bytes, std::uint64_t request,
                         std::uint64_t region_bytes, BackendKind kind,
                         const std::vector<FaultRule>& faults) {
  constexpr int kInFlight = 4;
  NvmeStore store({.dir = dir, .backend = kind, .block_bytes = request, .faults = faults}, bytes);
  std::vector<Region> regions;
  for (std::uint64_t at = 0; at < bytes; at += region_bytes)
    regions.push_back(store.reserve(std::min(region_bytes, bytes - at),
                                    "layer " + std::to_string(regions.size())));
  HostArena arena({.pinning = Pinning::kOff});
  std::vector<HostBuffer> buffers;
  std::mt19937_64 rng(42);
  for (int i = 0; i < kInFlight; ++i) {
    buffers.push_back(arena.allocate(region_bytes, Purpose::kStaging));
    auto* w = buffers.back().as<std::uint64_t>();
    for (std::uint64_t k = 0; k < region_bytes / 8; ++k)
      w[k] = rng();
  }
  auto pass = [&](bool write) {
    std::vector<IoTicket> tickets(kInFlight);
    auto t0 = Clock::now();
    for (std::size_t i = 0; i < regions.size(); ++i) {
      IoTicket& slot = tickets[i % kInFlight];
      store.wait(slot);  // the buffer is free again
      void* buf = buffers[i % kInFlight].data();
      slot = write ? store.write(regions[i], 0, buf, regions[i].bytes)
                   : store.read(regions[i], 0, buf, regions[i].bytes);
    }
    for (IoTicket& t : tickets)
      store.wait(t);
    return static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - t0).count();
  };
  StoreSpeed s;
  s.write_bytes_per_s = pass(true);
  s.read_bytes_per_s = pass(false);
  s.summary = store.summary();
  const NvmeStoreInfo info = store.info();
  s.backend = info.backend;
  s.direct = info.direct;
  return s;
}

}  // namespace rondo::offload
