#include "offload/host_arena.h"

#include <hwloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

#include "kernels/host_memory.h"

namespace rondo::offload {

const char* to_string(Purpose purpose) {
  switch (purpose) {
    case Purpose::kWeights:
      return "weights";
    case Purpose::kGradients:
      return "gradients";
    case Purpose::kOptimizerState:
      return "optimizer_state";
    case Purpose::kActivations:
      return "activations";
    case Purpose::kStaging:
      return "staging";
  }
  return "?";
}

// Shared by the arena and its buffers, so a buffer may outlive the HostArena object.
struct HostBuffer::State {
  HostArenaOptions options;
  bool pin = false;
  std::size_t page = 4096;
  hwloc_topology_t topology = nullptr;
  int nodes = 1;

  mutable std::mutex mutex;  // guards usage; hwloc calls on a loaded topology are thread-safe
  HostUsage usage;

  ~State() {
    if (topology) hwloc_topology_destroy(topology);
  }

  void release(void* data, std::uint64_t bytes, std::uint64_t mapped, Purpose purpose,
               bool pinned) noexcept {
    if (pinned) kernels::unpin_host_range(data);
    if (munmap(data, mapped) != 0)
      std::fprintf(stderr, "rondo: warning: munmap of %s host buffer failed: %s\n",
                   to_string(purpose), std::strerror(errno));
    std::lock_guard lock(mutex);
    PurposeUsage& u = usage.by_purpose[static_cast<int>(purpose)];
    u.bytes -= bytes;
    --u.buffers;
    usage.bytes -= bytes;
    usage.bytes_mapped -= mapped;
    if (pinned) usage.bytes_pinned -= bytes;
  }
};

HostBuffer::HostBuffer(HostBuffer&& other) noexcept {
  *this = std::move(other);
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    state_ = std::move(other.state_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    purpose_ = other.purpose_;
    pinned_ = std::exchange(other.pinned_, false);
    numa_node_ = std::exchange(other.numa_node_, -1);
  }
  return *this;
}

void HostBuffer::reset() noexcept {
  if (data_ != nullptr) state_->release(data_, bytes_, mapped_, purpose_, pinned_);
  state_.reset();
  data_ = nullptr;
  bytes_ = mapped_ = 0;
  pinned_ = false;
  numa_node_ = -1;
}

HostArena::HostArena(const HostArenaOptions& options)
    : state_(std::make_shared<HostBuffer::State>()) {
  auto& s = *state_;
  s.options = options;
  s.page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  bool can_pin = kernels::host_pinning_available();
  if (options.pinning == Pinning::kOn && !can_pin)
    throw Error(
        "host memory pinning was requested (pinning = on) but no CUDA device is present; "
        "use pinning = auto or off");
  s.pin = options.pinning == Pinning::kOn || (options.pinning == Pinning::kAuto && can_pin);

  if (hwloc_topology_init(&s.topology) != 0) throw Error("hwloc: cannot initialise the topology");
  // Keep PCI devices, so that a GPU's nearest NUMA node can be found.
  hwloc_topology_set_io_types_filter(s.topology, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(s.topology) != 0) throw Error("hwloc: cannot load the machine topology");
  s.nodes = std::max(1, hwloc_get_nbobjs_by_type(s.topology, HWLOC_OBJ_NUMANODE));
  if (options.numa_node >= 0 &&
      hwloc_get_numanode_obj_by_os_index(s.topology, options.numa_node) == nullptr)
    throw Error("host arena: NUMA node " + std::to_string(options.numa_node) +
                " does not exist (this machine has " + std::to_string(s.nodes) +
                " node(s)); use -1 to let the OS place memory");
}

HostArena::~HostArena() = default;

std::string pin_failure_warning(const HostUsage& usage) {
  if (usage.pin_failures == 0) return "";
  return std::to_string(usage.pin_failures) + " host buffer(s) (" +
         format_bytes(usage.pin_failed_bytes) +
         ") could not be page-locked, so copies between them and the GPU go through the driver's "
         "bounce buffers at a fraction of the link's speed and block the thread that makes them; "
         "raise the locked-memory limit (`ulimit -l unlimited`, or memlock in "
         "/etc/security/limits.conf) or lower the host budget (hardware.host_memory)";
}

bool HostArena::pins() const {
  return state_->pin;
}
int HostArena::numa_nodes() const {
  return state_->nodes;
}

HostBuffer HostArena::allocate(std::uint64_t bytes, Purpose purpose, int numa_node) {
  auto& s = *state_;
  if (bytes == 0) return {};
  if (numa_node == kDefaultNode) numa_node = s.options.numa_node;
  hwloc_obj_t node = nullptr;
  if (numa_node >= 0) {
    node = hwloc_get_numanode_obj_by_os_index(s.topology, numa_node);
    if (node == nullptr)
      throw Error("host arena: NUMA node " + std::to_string(numa_node) + " does not exist (" +
                  std::to_string(s.nodes) + " node(s) on this machine)");
  }
  const std::uint64_t mapped = (bytes + s.page - 1) / s.page * s.page;

  // Reserve the bytes against the budget first, so concurrent allocations cannot both pass it.
  {
    std::lock_guard lock(s.mutex);
    std::uint64_t limit = s.options.bytes_limit;
    if (limit != 0 && (bytes > limit || s.usage.bytes > limit - bytes)) {
      std::string by;
      for (int p = 0; p < kPurposeCount; ++p)
        if (s.usage.by_purpose[p].bytes)
          by += std::string(by.empty() ? "" : ", ") + to_string(static_cast<Purpose>(p)) + " " +
                format_bytes(s.usage.by_purpose[p].bytes);
      throw HostOutOfMemory(
          "host memory budget exceeded: " + std::string(to_string(purpose)) + " needs " +
              format_bytes(bytes) + " with " + format_bytes(s.usage.bytes) + " in use (" +
              (by.empty() ? "nothing" : by) + ") of a " + format_bytes(limit) +
              " budget; raise hardware.host_memory, or set hardware.offload_dir so that state "
              "moves to an NVMe drive (rondo plan shows what fits)",
          bytes, s.usage.bytes, limit);
    }
    PurposeUsage& u = s.usage.by_purpose[static_cast<int>(purpose)];
    u.bytes += bytes;
    ++u.buffers;
    u.peak = std::max(u.peak, u.bytes);
    s.usage.bytes += bytes;
    s.usage.peak = std::max(s.usage.peak, s.usage.bytes);
    s.usage.bytes_mapped += mapped;
  }
  auto unreserve = [&] {
    std::lock_guard lock(s.mutex);
    PurposeUsage& u = s.usage.by_purpose[static_cast<int>(purpose)];
    u.bytes -= bytes;
    --u.buffers;
    s.usage.bytes -= bytes;
    s.usage.bytes_mapped -= mapped;
  };

  void* data = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    int err = errno;
    unreserve();
    std::uint64_t used = usage().bytes;
    throw HostOutOfMemory("cannot map " + format_bytes(bytes) + " of host memory for " +
                              to_string(purpose) + ": " + std::strerror(err) + " (" +
                              format_bytes(used) + " already in use by Rondo)",
                          bytes, used, s.options.bytes_limit);
  }
  // Large buffers: transparent huge pages cut TLB misses in the optimizer and pin faster.
  if (mapped >= (2u << 20)) madvise(data, mapped, MADV_HUGEPAGE);
  if (node != nullptr && s.nodes > 1) {
    // Bind before first touch, so the pages are faulted in on that node.
    if (hwloc_set_area_membind(s.topology, data, mapped, node->nodeset, HWLOC_MEMBIND_BIND,
                               HWLOC_MEMBIND_BYNODESET) != 0) {
      int err = errno;
      munmap(data, mapped);
      unreserve();
      throw Error("cannot bind " + format_bytes(bytes) + " of host memory to NUMA node " +
                  std::to_string(numa_node) + ": " + std::strerror(err));
    }
  }
  bool pinned = false;
  if (s.pin) {
    pinned = kernels::pin_host_range(data, mapped);
    if (!pinned) {
      if (s.options.pinning == Pinning::kOn) {
        munmap(data, mapped);
        unreserve();
        throw Error("cannot page-lock " + format_bytes(bytes) + " of host memory for " +
                    to_string(purpose) +
                    " (check `ulimit -l`, which must be unlimited or above the host budget; or "
                    "use pinning = auto)");
      }
      std::lock_guard lock(s.mutex);
      ++s.usage.pin_failures;
      s.usage.pin_failed_bytes += bytes;
    }
  }
  if (pinned) {
    std::lock_guard lock(s.mutex);
    s.usage.bytes_pinned += bytes;
  }

  HostBuffer buffer;
  buffer.state_ = state_;
  buffer.data_ = data;
  buffer.bytes_ = bytes;
  buffer.mapped_ = mapped;
  buffer.purpose_ = purpose;
  buffer.pinned_ = pinned;
  buffer.numa_node_ = numa_node;
  return buffer;
}

HostUsage HostArena::usage() const {
  std::lock_guard lock(state_->mutex);
  return state_->usage;
}

void HostArena::reset_peaks() {
  std::lock_guard lock(state_->mutex);
  state_->usage.peak = state_->usage.bytes;
  for (PurposeUsage& u : state_->usage.by_purpose)
    u.peak = u.bytes;
}

int HostArena::numa_node_near(const std::string& pci_bus_id) const {
  hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(state_->topology, pci_bus_id.c_str());
  if (pci == nullptr) return -1;
  hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(state_->topology, pci);
  if (parent == nullptr || parent->nodeset == nullptr) return -1;
  int first = hwloc_bitmap_first(parent->nodeset);
  return first < 0 ? -1 : first;
}

std::uint64_t HostArena::numa_nodes_of(const void* data, std::size_t bytes) const {
  hwloc_nodeset_t set = hwloc_bitmap_alloc();
  std::uint64_t mask = 0;
  if (hwloc_get_area_memlocation(state_->topology, data, bytes, set, HWLOC_MEMBIND_BYNODESET) ==
      0) {
    for (int i = hwloc_bitmap_first(set); i >= 0 && i < 64; i = hwloc_bitmap_next(set, i))
      mask |= std::uint64_t{1} << i;
  }
  hwloc_bitmap_free(set);
  return mask;
}

}  // namespace rondo::offload
