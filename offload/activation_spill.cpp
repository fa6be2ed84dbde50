#include "offload/activation_spill.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "kernels/error.h"
#include "offload/nvme_store.h"

namespace rondo::offload {
namespace detail {

struct SpillEntry {
  // kHeld: no space on the tier, kept in host memory.
  enum class State { kQueued, kHeld, kWriting, kWritten, kReading, kTaken, kFailed };
  std::shared_ptr<SpillPool> pool;
  State state = State::kQueued;
  HostBuffer host;  // kQueued, kWriting: the data; kReading: the read's target
  std::size_t bytes = 0;
  std::unique_ptr<kernels::Event> ready;  // kQueued: the data is complete once it has
  Region region;
  IoTicket reading;  // kReading
  std::exception_ptr error;
  ~SpillEntry();
};

struct SpillPool {
  SpillPool(NvmeStore& nvme, std::uint64_t capacity, ActivationSpill::Take take,
            ActivationSpill::Give give, std::size_t max_queued)
      : nvme(nvme),
        capacity(capacity),
        take(std::move(take)),
        give(std::move(give)),
        max_queued(std::max<std::size_t>(max_queued, 1)) {}

  NvmeStore& nvme;
  const std::uint64_t capacity;
  ActivationSpill::Take take;
  ActivationSpill::Give give;
  const std::size_t max_queued;
  std::uint64_t block = 1;  // the store's block size

  std::mutex mu;
  std::condition_variable cv;
  std::multimap<std::uint64_t, Region> free;  // by size
  std::size_t regions = 0;                    // reserved so far (names them)
  std::deque<std::shared_ptr<SpillEntry>> queue;
  bool stopping = false;
  bool gone = false;  // the ActivationSpill is: `give` may refer to what went with it
  SpillStats stats;
  std::thread writer;

  std::uint64_t region_bytes(std::uint64_t bytes) const {
    return (bytes + block - 1) / block * block;
  }

  // A free region of whole store blocks, as many as `bytes` takes (a transfer must end in its
  // region's last block, so any such checkpoint fits it), or a new one while the capacity lasts;
  // none when the space is taken. Under the lock.
  Region region_for(std::uint64_t bytes) {
    const std::uint64_t need = region_bytes(bytes);
    if (auto it = free.find(need); it != free.end()) {
      Region r = it->second;
      free.erase(it);
      return r;
    }
    if (capacity - stats.reserved < need) return {};
    Region r = nvme.reserve(need, "activation checkpoint " + std::to_string(regions++));
    stats.reserved += r.bytes;
    return r;
  }

  void run_writer() {
    for (;;) {
      std::shared_ptr<SpillEntry> e;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        e = std::move(queue.front());
        queue.pop_front();
        e->state = SpillEntry::State::kWriting;
        cv.notify_all();  // a writer blocked on max_queued
      }
      std::exception_ptr error;
      try {
        if (e->ready) e->ready->synchronize();
        IoTicket t = nvme.write(e->region, 0, e->host.data(), e->bytes);
        t.wait();
      } catch (...) {
        error = std::current_exception();
      }
      HostBuffer done;
      {
        std::lock_guard<std::mutex> lock(mu);
        done = std::move(e->host);
        e->ready.reset();
        if (error) {
          e->state = SpillEntry::State::kFailed;
          e->error = std::move(error);  // the reader's only; nothing of it stays on this thread
        } else {
          e->state = SpillEntry::State::kWritten;
          stats.written += e->bytes;
        }
        cv.notify_all();
      }
      e.reset();  // the region is free once a read has taken the entry, before `done` goes back
      give(std::move(done));
    }
  }

  // Starts the read of a written entry. Under the lock.
  void start_read(SpillEntry& e) {
    e.host = take(e.bytes);
    e.reading = nvme.read(e.region, 0, e.host.data(), e.bytes);
    e.state = SpillEntry::State::kReading;
  }
};

SpillEntry::~SpillEntry() {
  // A download may still be landing in the host copy of a checkpoint dropped unwritten.
  if (ready) {
    try {
      ready->synchronize();
    } catch (const std::exception&) {
      // The device's error is the run's to report.
    }
  }
  if (reading) {
    try {
      reading.wait();
    } catch (const std::exception&) {
      // Nobody asked for the data any more.
    }
  }
  // Host memory a checkpoint dropped unread still holds (kept for want of space, queued when the
  // tier was torn down, or read back) goes back as a written one's does, under the lock, so that
  // the ActivationSpill (and what `give` reaches) cannot go meanwhile (the lock order is the
  // reads' already: pool->mu, then the owner's staging lock through `take`).
  std::lock_guard<std::mutex> lock(pool->mu);
  if (region) pool->free.emplace(region.bytes, region);
  if (host && !pool->gone) {
    try {
      pool->give(std::move(host));
    } catch (const std::exception&) {
      // No room to keep it: the memory is freed with the entry instead.
    }
  }
}

}  // namespace detail

using detail::SpillEntry;

Spilled::~Spilled() = default;

ActivationSpill::ActivationSpill(NvmeStore& nvme, std::uint64_t capacity, Take take, Give give,
                                 std::size_t max_queued)
    : pool_(std::make_shared<detail::SpillPool>(nvme, capacity, std::move(take), std::move(give),
                                                max_queued)) {
  RONDO_ASSERT(pool_->take && pool_->give);
  pool_->block = std::max<std::uint64_t>(nvme.info().block_bytes, 4096);
  pool_->writer = std::thread([p = pool_.get()] { p->run_writer(); });
}

ActivationSpill::~ActivationSpill() {
  std::deque<std::shared_ptr<SpillEntry>> dropped;
  {
    std::lock_guard<std::mutex> lock(pool_->mu);
    pool_->stopping = true;
    for (auto& e : pool_->queue) {
      e->state = SpillEntry::State::kFailed;
      e->error = std::make_exception_ptr(
          InternalError("activation checkpoint dropped: the run's transfers were torn down"));
    }
    dropped.swap(pool_->queue);
    pool_->cv.notify_all();
  }
  pool_->writer.join();
  dropped.clear();  // their staging goes back
  // Entries still held elsewhere keep the pool (and its free list) alive until they go; their
  // host memory is then simply freed.
  std::lock_guard<std::mutex> lock(pool_->mu);
  pool_->gone = true;
}

Spilled ActivationSpill::write(HostBuffer host, std::size_t bytes,
                               std::unique_ptr<kernels::Event> ready) {
  RONDO_ASSERT(host && bytes > 0 && bytes <= host.bytes());
  auto e = std::make_shared<SpillEntry>();
  e->pool = pool_;
  e->bytes = bytes;
  e->host = std::move(host);
  e->ready = std::move(ready);
  std::unique_lock<std::mutex> lock(pool_->mu);
  try {
    e->region = pool_->region_for(bytes);
  } catch (const Error&) {
    // The store has less room than it was sized for: the checkpoint stays in host memory.
    e->region = {};
  }
  if (e->region) {
    pool_->cv.wait(lock, [&] { return pool_->queue.size() < pool_->max_queued; });
    pool_->queue.push_back(e);
    pool_->cv.notify_all();
  } else {
    e->state = SpillEntry::State::kHeld;
    pool_->stats.held += bytes;
  }
  Spilled s;
  s.entry_ = std::move(e);
  return s;
}

void ActivationSpill::prefetch(Spilled& s) {
  if (!s) return;
  std::lock_guard<std::mutex> lock(pool_->mu);
  if (s.entry_->state == SpillEntry::State::kWritten) pool_->start_read(*s.entry_);
}

HostBuffer ActivationSpill::read(Spilled& s) {
  RONDO_ASSERT(s);
  std::shared_ptr<SpillEntry> e = std::move(s.entry_);
  std::unique_lock<std::mutex> lock(pool_->mu);
  pool_->cv.wait(lock, [&] { return e->state != SpillEntry::State::kWriting; });
  switch (e->state) {
    case SpillEntry::State::kQueued:
    case SpillEntry::State::kHeld: {
      // Not written (yet): the host copy comes back, no I/O.
      if (e->state == SpillEntry::State::kQueued) {
        auto& q = pool_->queue;
        q.erase(std::find(q.begin(), q.end(), e));
        pool_->stats.kept += e->bytes;
        pool_->cv.notify_all();
      }
      e->state = SpillEntry::State::kTaken;
      HostBuffer h = std::move(e->host);
      std::unique_ptr<kernels::Event> ready = std::move(e->ready);
      lock.unlock();
      if (ready) ready->synchronize();
      return h;
    }
    case SpillEntry::State::kWritten:
      pool_->start_read(*e);
      [[fallthrough]];
    case SpillEntry::State::kReading: {
      IoTicket t = std::move(e->reading);
      HostBuffer h = std::move(e->host);
      e->state = SpillEntry::State::kTaken;
      lock.unlock();
      t.wait();
      std::lock_guard<std::mutex> again(pool_->mu);
      pool_->stats.read += e->bytes;
      return h;
    }
    case SpillEntry::State::kFailed:
      std::rethrow_exception(e->error);
    default:
      throw InternalError("activation checkpoint read twice");
  }
}

std::uint64_t ActivationSpill::capacity_for(std::uint64_t bytes, std::uint64_t count,
                                            std::uint64_t block_bytes) {
  const std::uint64_t block = std::max<std::uint64_t>(block_bytes, 4096);
  return (bytes + block - 1) / block * block * count;
}

SpillStats ActivationSpill::stats() const {
  std::lock_guard<std::mutex> lock(pool_->mu);
  return pool_->stats;
}

}  // namespace rondo::offload
