#include "kernels/cpu/sim_device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/memory_ledger.h"

namespace rondo::kernels {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kAlignment = 256;  // like cudaMalloc, so SIMD and casts see aligned rows

// A stream's failure, kept as text, never as the exception object: each thread that reports it
// throws its own fresh Error. A thrown std::runtime_error holds a reference-counted string whose
// count lives in the uninstrumented libstdc++, so one object read by a waiting thread and freed by
// the stream's thread (or the other way round) is a race to ThreadSanitizer (CI saw one in
// ADeviceFaultIsTheErrorTheRunReports); offload/nvme_store.cpp does the same for its transfers.
struct Failure {
  std::string what;

  static std::shared_ptr<const Failure> of(std::exception_ptr error) {
    auto f = std::make_shared<Failure>();
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      f->what = e.what();
    } catch (...) {
      f->what = "an unknown error";
    }
    return f;
  }
  [[noreturn]] void raise() const { throw Error(std::string(what)); }
};

// One completion point. An Event points at the marker of its latest record(); waits capture the
// marker current when they are issued, so a later re-record does not change what they wait for.
struct Marker {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  Clock::time_point at{};  // when it completed
  // The stream had failed before it: a sticky error, as CUDA's (immutable once set).
  std::shared_ptr<const Failure> error;

  void complete(std::shared_ptr<const Failure> failure = nullptr) {
    {
      std::lock_guard lock(mutex);
      done = true;
      at = Clock::now();
      error = std::move(failure);
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return done; });
  }
  void rethrow() {
    std::shared_ptr<const Failure> failure;
    {
      std::lock_guard lock(mutex);
      failure = error;
    }
    if (failure) failure->raise();
  }
  bool query() {
    std::lock_guard lock(mutex);
    return done;
  }
};

class SimEvent final : public Event {
 public:
  explicit SimEvent(bool timing) : timing_(timing) {}
  // Like cudaEventQuery / cudaEventSynchronize: the stream's error, once it had failed before
  // the record, comes back from both.
  bool query() override {
    auto marker = latest();
    if (!marker) return true;
    if (!marker->query()) return false;
    marker->rethrow();
    return true;
  }
  void synchronize() override {
    if (auto marker = latest()) {
      marker->wait();
      marker->rethrow();
    }
  }
  std::shared_ptr<Marker> latest() {
    std::lock_guard lock(mutex_);
    return latest_;
  }
  void set_latest(std::shared_ptr<Marker> marker) {
    std::lock_guard lock(mutex_);
    latest_ = std::move(marker);
  }
  double seconds_since(Event& start) override {
    auto* other = dynamic_cast<SimEvent*>(&start);
    if (other == nullptr || !timing_ || !other->timing_)
      throw Error("seconds_since: both events must be timing events of simulated devices");
    const auto a = other->completed_at(), b = completed_at();
    if (!a || !b) throw Error("seconds_since: an event is not recorded or not complete yet");
    return std::chrono::duration<double>(*b - *a).count();
  }

 private:
  std::optional<Clock::time_point> completed_at() {
    auto marker = latest();
    if (!marker) return std::nullopt;
    std::lock_guard lock(marker->mutex);
    if (!marker->done) return std::nullopt;
    return marker->at;
  }

  bool timing_;
  std::mutex mutex_;
  std::shared_ptr<Marker> latest_;
};

// One direction of a link. Copies in the same direction share its bandwidth: each reserves the
// next free interval of bytes / bandwidth.
struct Channel {
  std::mutex mutex;
  Clock::time_point busy_until{};
};

class SimDevice;

class SimStream final : public Stream {
 public:
  SimStream(SimDevice& device, std::string name);
  ~SimStream() override;

  Device& device() override;
  const std::string& name() const override { return name_; }
  void upload(void* dst, const void* src, std::size_t bytes) override;
  void download(void* dst, const void* src, std::size_t bytes) override;
  void copy_to_peer(void* dst, Device& dst_device, const void* src, std::size_t bytes) override;
  void fill(void* dst, std::uint8_t value, std::size_t bytes) override;
  void dequantize(const QuantFormat& format, const void* src, std::int64_t rows, std::int64_t cols,
                  FloatDType out, void* dst) override;
  void enqueue(std::function<void()> work) override { push(std::move(work), false); }
  void record(Event& event) override;
  void wait(Event& event) override;
  void synchronize() override;
  bool query() override;
  void* native_handle() override { return nullptr; }

  // Control tasks (event records and waits, frees) run even after a task failed, so that other
  // streams waiting on this one are not left hanging; work tasks are skipped then, like CUDA's
  // sticky errors.
  void push(std::function<void()> task, bool control);
  [[noreturn]] void throw_fault(std::int64_t copy);

 private:
  struct Task {
    std::function<void()> fn;
    bool control;
  };
  void serve();

  SimDevice& device_;
  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::size_t pending_ = 0;  // queued or running
  bool stopping_ = false;
  // The first failure, reported by synchronize() and by events recorded after it.
  std::shared_ptr<const Failure> error_;
  std::thread thread_;

 public:
  std::shared_ptr<const Failure> error() {
    std::lock_guard lock(mutex_);
    return error_;
  }
};

class LedgerAccount final : public MemoryAccount {
 public:
  LedgerAccount(std::shared_ptr<MemoryLedger> ledger, std::string device)
      : ledger_(std::move(ledger)), device_(std::move(device)) {}
  void reserve(std::uint64_t bytes) override { ledger_->reserve(bytes, device_, false); }
  void release(std::uint64_t bytes) noexcept override { ledger_->unreserve(bytes, false); }

 private:
  std::shared_ptr<MemoryLedger> ledger_;
  std::string device_;
};

class SimDevice final : public Device {
 public:
  explicit SimDevice(const SimDeviceOptions& options)
      : ledger_(std::make_shared<MemoryLedger>(options.bytes_cap)),
        fail_copy_(options.fail_copy),
        cache_freed_(options.cache_freed),
        count_compute_(options.count_compute) {
    if (options.link.bytes_per_s < 0 || options.link.latency_s < 0)
      throw Error("simulated device " + options.name +
                  ": link bandwidth and latency must not be negative");
    info_.kind = DeviceKind::kSim;
    info_.index = options.index;
    info_.name = options.name;
    info_.bytes_total = options.bytes_cap;
    info_.bytes_cap = options.bytes_cap;
    info_.link = options.link;
  }

  ~SimDevice() override {
    {
      std::lock_guard lock(streams_mutex_);
      streams_.clear();  // each stream drains its queue (stream-ordered frees included) and joins
    }
    MemoryStats left = ledger_->stats();
    if (left.allocations != 0)
      std::fprintf(stderr, "rondo: warning: %s destroyed with %llu buffers (%s) still allocated\n",
                   info_.name.c_str(), static_cast<unsigned long long>(left.allocations),
                   format_bytes(left.bytes_in_use).c_str());
    drop_cache();
  }

  const DeviceInfo& info() const override { return info_; }

  Stream& create_stream(const std::string& name, StreamPriority) override {
    std::lock_guard lock(streams_mutex_);
    streams_.push_back(std::make_unique<SimStream>(*this, info_.name + "/" + name));
    return *streams_.back();
  }

  std::unique_ptr<Event> create_event(EventTiming timing) override {
    return std::make_unique<SimEvent>(timing == EventTiming::kOn);
  }

  DeviceBuffer allocate(std::size_t bytes, Stream* stream) override {
    if (bytes == 0) return {};
    check_own(stream);
    ledger_->reserve(bytes, info_.name);
    const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* data = take_cached(rounded);
    if (data == nullptr) data = std::aligned_alloc(kAlignment, rounded);
    if (data == nullptr && drop_cache() > 0) data = std::aligned_alloc(kAlignment, rounded);
    if (data == nullptr) {
      ledger_->unreserve(bytes);
      throw OutOfMemory(info_.name + " (host memory exhausted)", bytes,
                        ledger_->stats().bytes_in_use, info_.bytes_cap);
    }
    return DeviceBuffer(this, data, bytes, stream);
  }

  MemoryStats memory() const override { return ledger_->stats(); }

  // Torch's tensors computed on this device live in host memory; engine::TorchStreamScope counts
  // them here, so that the cap bounds what the device's work holds as it would on a card.
  std::shared_ptr<MemoryAccount> memory_account() override {
    if (!count_compute_) return nullptr;
    std::lock_guard lock(account_mutex_);
    if (!account_) account_ = std::make_shared<LedgerAccount>(ledger_, info_.name);
    return account_;
  }
  TrafficStats traffic() const override { return traffic_.stats(); }

  void set_memory_cap(std::uint64_t bytes) override {
    info_.bytes_cap = bytes;
    info_.bytes_total = std::max(info_.bytes_total, bytes);
    ledger_->set_cap(bytes);
  }

  void synchronize() override {
    std::vector<SimStream*> streams;
    {
      std::lock_guard lock(streams_mutex_);
      for (auto& s : streams_)
        streams.push_back(s.get());
    }
    for (auto* s : streams)
      s->synchronize();
  }

  // Runs a copy that crosses the link: at least bytes / bandwidth after the channel frees up, plus
  // the latency. `channels` are the link directions the bytes cross (two for a peer copy).
  static void transfer(std::initializer_list<Channel*> channels, double bytes_per_s,
                       double latency_s, std::size_t bytes, const std::function<void()>& copy) {
    if (bytes_per_s <= 0 && latency_s <= 0) {
      copy();
      return;
    }
    auto duration = [](double seconds) {
      return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    };
    Clock::duration wire = bytes_per_s > 0 ? duration(static_cast<double>(bytes) / bytes_per_s)
                                           : Clock::duration::zero();
    Clock::time_point begin = Clock::now();
    // Reserve the same interval on every channel crossed; lock them in address order.
    std::vector<Channel*> sorted(channels);
    std::sort(sorted.begin(), sorted.end());
    for (Channel* c : sorted)
      c->mutex.lock();
    for (Channel* c : sorted)
      begin = std::max(begin, c->busy_until);
    Clock::time_point end = begin + wire;
    for (Channel* c : sorted)
      c->busy_until = end;
    for (auto it = sorted.rbegin(); it != sorted.rend(); ++it)
      (*it)->mutex.unlock();
    copy();
    // Emulated time, not synchronisation: the copy may not complete before the wire allows.
    std::this_thread::sleep_until(end + duration(latency_s));
  }

  void check_own(Stream* stream) const {
    if (stream != nullptr && &stream->device() != this)
      throw InternalError("stream " + stream->name() + " used with device " + info_.name);
  }

  Channel h2d_, d2h_;
  TrafficCounters traffic_;
  // The injected copy fault (SimDeviceOptions::fail_copy): its number when this copy is it.
  std::optional<std::int64_t> copy_fails() {
    const std::int64_t n = copies_.fetch_add(1);
    if (n == fail_copy_) return n;
    return std::nullopt;
  }

 protected:
  void release(void* data, std::size_t bytes, Stream* stream) noexcept override {
    auto free_now = [this, data, bytes] {
      ledger_->unreserve(bytes);
      keep_or_free(data, (bytes + kAlignment - 1) / kAlignment * kAlignment);
    };
    if (stream != nullptr) {
      static_cast<SimStream*>(stream)->push(free_now, true);
      return;
    }
    // Not stream-ordered: like cudaFree, wait for all work that may still use it. Must not be
    // called from a task of this device's streams.
    try {
      synchronize();
    } catch (const std::exception&) {
      // A failed task is reported by the stream's own synchronize(); the memory is freed anyway.
    }
    free_now();
  }

 private:
  // The freed-buffer cache (SimDeviceOptions::cache_freed), keyed by rounded size.
  void* take_cached(std::size_t rounded) {
    if (!cache_freed_) return nullptr;
    std::lock_guard lock(cache_mutex_);
    auto it = cache_.find(rounded);
    if (it == cache_.end()) return nullptr;
    void* data = it->second;
    cache_.erase(it);
    cached_bytes_ -= rounded;
    return data;
  }

  void keep_or_free(void* data, std::size_t rounded) {
    if (cache_freed_) {
      std::lock_guard lock(cache_mutex_);
      // Kept and in-use bytes together stay under the most ever in use at once (rounding aside):
      // a run whose buffer sizes change does not hold a second copy of its peak. The largest
      // kept buffers go first.
      const MemoryStats now = ledger_->stats();
      const std::uint64_t room = now.bytes_peak - std::min(now.bytes_peak, now.bytes_in_use);
      while (!cache_.empty() && cached_bytes_ + rounded > room) {
        auto largest = std::prev(cache_.end());
        cached_bytes_ -= largest->first;
        std::free(largest->second);
        cache_.erase(largest);
      }
      if (cached_bytes_ + rounded <= room) {
        cache_.emplace(rounded, data);
        cached_bytes_ += rounded;
        return;
      }
    }
    std::free(data);
  }

  std::size_t drop_cache() {
    std::lock_guard lock(cache_mutex_);
    const std::size_t dropped = cached_bytes_;
    for (auto& [rounded, data] : cache_)
      std::free(data);
    cache_.clear();
    cached_bytes_ = 0;
    return dropped;
  }

  DeviceInfo info_;
  std::shared_ptr<MemoryLedger> ledger_;  // shared with memory_account()'s
  std::mutex account_mutex_;
  std::shared_ptr<MemoryAccount> account_;
  std::int64_t fail_copy_;
  const bool cache_freed_;
  const bool count_compute_;
  std::mutex cache_mutex_;
  std::multimap<std::size_t, void*> cache_;
  std::size_t cached_bytes_ = 0;
  std::atomic<std::int64_t> copies_{0};
  std::mutex streams_mutex_;
  std::vector<std::unique_ptr<SimStream>> streams_;
};

SimStream::SimStream(SimDevice& device, std::string name)
    : device_(device), name_(std::move(name)), thread_([this] { serve(); }) {}

SimStream::~SimStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Device& SimStream::device() {
  return device_;
}

void SimStream::push(std::function<void()> task, bool control) {
  {
    std::lock_guard lock(mutex_);
    RONDO_ASSERT_MSG(!stopping_, "work enqueued on " + name_ + " while it is being destroyed");
    queue_.push_back({std::move(task), control});
    ++pending_;
  }
  cv_.notify_all();
}

void SimStream::serve() {
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything enqueued has run
    Task task = std::move(queue_.front());
    queue_.pop_front();
    bool skip = error_ && !task.control;
    lock.unlock();
    std::exception_ptr failure;
    if (!skip) {
      try {
        task.fn();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    task.fn = nullptr;  // destroy captures outside the lock
    lock.lock();
    if (failure && !error_) error_ = Failure::of(failure);
    --pending_;
    cv_.notify_all();
  }
}

[[noreturn]] void SimStream::throw_fault(std::int64_t copy) {
  throw Error(name_ + ": copy " + std::to_string(copy) +
              " failed (injected fault: SimDeviceOptions::fail_copy)");
}

void SimStream::upload(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  device_.traffic_.h2d += bytes;
  LinkSpec link = device_.info().link;
  push(
      [this, dst, src, bytes, link, fault = device_.copy_fails()] {
        if (fault) throw_fault(*fault);
        SimDevice::transfer({&device_.h2d_}, link.bytes_per_s, link.latency_s, bytes,
                            [=] { std::memcpy(dst, src, bytes); });
      },
      false);
}

void SimStream::download(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  device_.traffic_.d2h += bytes;
  LinkSpec link = device_.info().link;
  push(
      [this, dst, src, bytes, link, fault = device_.copy_fails()] {
        if (fault) throw_fault(*fault);
        SimDevice::transfer({&device_.d2h_}, link.bytes_per_s, link.latency_s, bytes,
                            [=] { std::memcpy(dst, src, bytes); });
      },
      false);
}

void SimStream::copy_to_peer(void* dst, Device& dst_device, const void* src, std::size_t bytes) {
  auto* peer = dynamic_cast<SimDevice*>(&dst_device);
  if (peer == nullptr)
    throw Error("cannot copy from simulated device " + device_.info().name + " to " +
                dst_device.info().name + ": devices of different kinds");
  if (bytes == 0) return;
  device_.traffic_.d2d_out += bytes;
  peer->traffic_.d2d_in += bytes;
  // No NVLink: a peer copy crosses this device's download link and the peer's upload link.
  LinkSpec a = device_.info().link, b = peer->info().link;
  double bw = a.bytes_per_s <= 0   ? b.bytes_per_s
              : b.bytes_per_s <= 0 ? a.bytes_per_s
                                   : std::min(a.bytes_per_s, b.bytes_per_s);
  double latency = a.latency_s + b.latency_s;
  Channel* out = &device_.d2h_;
  Channel* in = &peer->h2d_;
  push(
      [=] {
        SimDevice::transfer({out, in}, bw, latency, bytes, [=] { std::memcpy(dst, src, bytes); });
      },
      false);
}

void SimStream::fill(void* dst, std::uint8_t value, std::size_t bytes) {
  if (bytes == 0) return;
  // Spread over oneTBB's threads in 1 MiB tiles, as a GPU's memset over its cores (a full
  // fine-tuning's gradients, cleared at each step's backward, are hundreds of MB: one thread took
  // 65 ms for 0.5 GB on this project's machine, serial between two steps).
  push(
      [=] {
        constexpr std::size_t kTile = 1u << 20;
        auto* p = static_cast<std::uint8_t*>(dst);
        if (bytes <= 4 * kTile) {
          std::memset(p, value, bytes);
          return;
        }
        detail::parallel_for_tiles((bytes + kTile - 1) / kTile, [&](std::size_t a, std::size_t b) {
          std::memset(p + a * kTile, value, std::min(bytes, b * kTile) - a * kTile);
        });
      },
      false);
}

void SimStream::dequantize(const QuantFormat& format, const void* src, std::int64_t rows,
                           std::int64_t cols, FloatDType out, void* dst) {
  check_dequantize(format, rows, cols, out, dst);
  // The CPU kernel itself: it spreads over oneTBB's threads, as a GPU would over its cores.
  push([=] { kernels::dequantize(format, src, rows, cols, out, dst); }, false);
}

void SimStream::record(Event& event) {
  auto* sim = dynamic_cast<SimEvent*>(&event);
  if (sim == nullptr)
    throw Error("stream " + name_ + " can only record events of simulated devices");
  auto marker = std::make_shared<Marker>();
  sim->set_latest(marker);
  push([this, marker] { marker->complete(error()); }, true);
}

void SimStream::wait(Event& event) {
  auto* sim = dynamic_cast<SimEvent*>(&event);
  if (sim == nullptr)
    throw Error("stream " + name_ + " can only wait on events of simulated devices");
  auto marker = sim->latest();
  if (!marker) return;  // never recorded: nothing to wait for
  push([marker] { marker->wait(); }, true);
}

void SimStream::synchronize() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  if (error_) {
    const std::shared_ptr<const Failure> failure = error_;
    lock.unlock();
    failure->raise();
  }
}

bool SimStream::query() {
  std::lock_guard lock(mutex_);
  return pending_ == 0;
}

}  // namespace

std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options) {
  return std::make_unique<SimDevice>(options);
}

}  // namespace rondo::kernels
