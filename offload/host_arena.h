// The host arena: large host buffers for weights, gradients, optimizer state, activations and
// staging. Page-aligned (mmap, rounded to the page only: no power-of-two waste), placed on a NUMA
// node through hwloc, and page-locked when a GPU is present so copies run at full PCIe speed.
// Every byte is accounted by purpose; the engine reports usage() in `device` events.
//
// Buffers keep the arena's state alive, so they may outlive the HostArena object. Thread-safe.
//
//   offload::HostArena arena({.bytes_limit = parse_bytes("96GB")});
//   offload::HostBuffer w = arena.allocate(layer_bytes, offload::Purpose::kWeights);
//   float* p = w.as<float>();
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/error.h"

namespace rondo::offload {

enum class Purpose { kWeights, kGradients, kOptimizerState, kActivations, kStaging };
inline constexpr int kPurposeCount = 5;
const char* to_string(Purpose purpose);  // "weights", "gradients", "optimizer_state", ...

enum class Pinning {
  kAuto,  // pin when a CUDA device is present; if the OS refuses (RLIMIT_MEMLOCK), count and go on
  kOn,    // pin or fail
  kOff,   // never pin (pageable memory: copies to a GPU go through the driver's bounce buffers)
};

struct HostArenaOptions {
  Pinning pinning = Pinning::kAuto;
  int numa_node = -1;             // node for allocate() without a node; -1 = the OS's first touch
  std::uint64_t bytes_limit = 0;  // host memory budget in bytes; 0 = no limit
};

struct PurposeUsage {
  std::uint64_t bytes = 0;    // in use now (requested bytes)
  std::uint64_t peak = 0;     // most in use at once
  std::uint64_t buffers = 0;  // live buffers
};

struct HostUsage {
  std::array<PurposeUsage, kPurposeCount> by_purpose{};  // indexed by Purpose
  std::uint64_t bytes = 0;                               // all purposes
  std::uint64_t peak = 0;
  std::uint64_t bytes_pinned = 0;      // of `bytes`, page-locked
  std::uint64_t bytes_mapped = 0;      // what the OS was asked for (page-rounded)
  std::uint64_t pin_failures = 0;      // kAuto buffers left pageable because pinning failed
  std::uint64_t pin_failed_bytes = 0;  // their bytes (both counts only grow)
  const PurposeUsage& operator[](Purpose p) const { return by_purpose[static_cast<int>(p)]; }
};

// What a user needs to hear when pinning = auto left buffers pageable (the OS refused to lock
// them): how much, what it costs, what to change. "" when none failed.
std::string pin_failure_warning(const HostUsage& usage);

// A request the budget or the OS cannot meet. Carries the figures for the planner.
class HostOutOfMemory : public Error {
 public:
  HostOutOfMemory(const std::string& message, std::uint64_t requested, std::uint64_t used,
                  std::uint64_t limit)
      : Error(message), requested(requested), used(used), limit(limit) {}
  std::uint64_t requested, used, limit;
};

class HostArena;

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { reset(); }

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::uint64_t bytes() const { return bytes_; }
  Purpose purpose() const { return purpose_; }
  bool pinned() const { return pinned_; }
  int numa_node() const { return numa_node_; }  // -1 = not bound
  explicit operator bool() const { return data_ != nullptr; }
  void reset() noexcept;

 private:
  friend class HostArena;
  struct State;
  std::shared_ptr<State> state_;
  void* data_ = nullptr;
  std::uint64_t bytes_ = 0;
  std::uint64_t mapped_ = 0;
  Purpose purpose_ = Purpose::kStaging;
  bool pinned_ = false;
  int numa_node_ = -1;
};

class HostArena {
 public:
  static constexpr int kDefaultNode = -2;  // allocate(): use HostArenaOptions::numa_node

  explicit HostArena(const HostArenaOptions& options = {});
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // Throws HostOutOfMemory past the budget or when the OS refuses, Error for a node that does
  // not exist or for Pinning::kOn that cannot pin. bytes == 0 gives an empty buffer.
  HostBuffer allocate(std::uint64_t bytes, Purpose purpose, int numa_node = kDefaultNode);

  HostUsage usage() const;
  // Starts the peaks (overall and by purpose) again from what is in use now: for measuring one
  // phase of a run (an export, a step).
  void reset_peaks();
  bool pins() const;       // are new buffers page-locked?
  int numa_nodes() const;  // NUMA nodes hwloc sees (1 on most desktops)
  // The NUMA node closest to a PCI device ("0000:01:00.0"), for placing a GPU's staging buffers;
  // -1 when unknown.
  int numa_node_near(const std::string& pci_bus_id) const;
  // The NUMA node(s) that hold [data, data+bytes) now, as a bit mask of OS node numbers (bit n =
  // node n); 0 when unknown or not yet touched.
  std::uint64_t numa_nodes_of(const void* data, std::size_t bytes) const;

 private:
  std::shared_ptr<HostBuffer::State> state_;
};

}  // namespace rondo::offload
