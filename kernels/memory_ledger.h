// Bookkeeping shared by the device implementations: bytes in use against a cap, and bytes moved
// per direction. Internal to kernels/. Thread-safe: any stream thread may allocate or free.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/device.h"

namespace rondo::kernels {

class MemoryLedger {
 public:
  explicit MemoryLedger(std::uint64_t cap) : cap_(cap) {}

  // Counts `bytes` as in use, or throws OutOfMemory naming `device` if that would pass the cap.
  // `buffer`: one of the device's buffers (MemoryStats::allocations), not memory its work
  // allocated by itself (MemoryAccount).
  void reserve(std::uint64_t bytes, const std::string& device, bool buffer = true) {
    std::lock_guard lock(mutex_);
    if (bytes > cap_ || in_use_ > cap_ - bytes) throw OutOfMemory(device, bytes, in_use_, cap_);
    in_use_ += bytes;
    if (buffer) ++count_;
    if (in_use_ > peak_) peak_ = in_use_;
  }
  void unreserve(std::uint64_t bytes, bool buffer = true) noexcept {
    std::lock_guard lock(mutex_);
    in_use_ -= bytes;
    if (buffer) --count_;
  }
  void set_cap(std::uint64_t cap) {
    std::lock_guard lock(mutex_);
    cap_ = cap;
  }
  MemoryStats stats() const {
    std::lock_guard lock(mutex_);
    return {in_use_, peak_, cap_, count_};
  }

 private:
  mutable std::mutex mutex_;
  std::uint64_t cap_;
  std::uint64_t in_use_ = 0;
  std::uint64_t peak_ = 0;
  std::uint64_t count_ = 0;
};

struct TrafficCounters {
  std::atomic<std::uint64_t> h2d{0}, d2h{0}, d2d_out{0}, d2d_in{0};
  TrafficStats stats() const { return {h2d.load(), d2h.load(), d2d_out.load(), d2d_in.load()}; }
};

}  // namespace rondo::kernels
