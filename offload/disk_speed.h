// How fast a folder's drive reads and writes, for the planner (how much offloaded state a step can
// afford to stream) and for bench/offload_bench (the store's GB/s as a ratio of what the drive does
// with the plainest possible loop, measured in the same run).
// Both measurements use an unnamed, preallocated file in the folder (offload_file.h) that is gone
// when they return; data is pseudo-random so that no layer can compress it.
//
//   offload::DiskSpeed d = offload::measure_disk("/mnt/nvme/rondo", 1ull << 30);
//   offload::DiskSpeed raw = offload::measure_disk_raw("/mnt/nvme/rondo", 1ull << 30);
//   std::printf("%.2f GB/s read (%.2fx raw)\n", d.read_bytes_per_s / 1e9,
//               d.read_bytes_per_s / raw.read_bytes_per_s);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "offload/io_backend.h"
#include "offload/io_faults.h"

namespace rondo::offload {

struct DiskSpeed {
  double write_bytes_per_s = 0;  // until the data is on the drive (buffered: incl. fdatasync)
  double read_bytes_per_s = 0;   // from the drive (buffered: after dropping the page cache)
  std::string backend;           // "io_uring" | "threads" | "pread/pwrite" (the raw loop)
  std::string backend_note;      // why not the backend asked for
  bool direct = false;           // O_DIRECT works in this folder
  std::string direct_note;       // why not
  std::uint64_t bytes = 0;       // written and read (rounded up to 4096)
  std::uint64_t request_bytes = 0;
  unsigned queue_depth = 0;  // requests in flight (1 for the raw loop)
};

inline constexpr std::uint64_t kDiskRequestBytes = std::uint64_t{1} << 20;
inline constexpr unsigned kDiskQueueDepth = 32;

// Sequential write then read of `bytes` in requests of `request_bytes`, `queue_depth` of them in
// flight, through the backend `kind` selects. Throws DiskOutOfSpace when the folder cannot hold
// the file, Error when a transfer fails (naming the folder and the error). `faults`: injected
// where the OS answers (io_faults.h; `rondo devices --disk` passes RONDO_FAULT_IO's).
DiskSpeed measure_disk(const std::string& dir, std::uint64_t bytes,
                       BackendKind kind = BackendKind::kAuto,
                       std::uint64_t request_bytes = kDiskRequestBytes,
                       unsigned queue_depth = kDiskQueueDepth,
                       const std::vector<FaultRule>& faults = {});

// The baseline: one thread, a plain O_DIRECT pwrite loop then a pread loop over the same bytes in
// requests of the same size — what any program gets without a queue.
DiskSpeed measure_disk_raw(const std::string& dir, std::uint64_t bytes,
                           std::uint64_t request_bytes = kDiskRequestBytes);

// The NVMe store itself, as the engine uses it: `bytes` in regions of `region_bytes` (layers),
// written then read with 4 transfers in flight from host-arena buffers, checksums computed and
// verified, blocks of `request_bytes`; `faults` go to the store (NvmeStoreOptions::faults).
struct StoreSpeed {
  double write_bytes_per_s = 0, read_bytes_per_s = 0;
  std::string backend;  // "io_uring" | "threads"
  bool direct = false;
  std::string summary;  // NvmeStore::summary()
};
StoreSpeed measure_store(const std::string& dir, std::uint64_t bytes, std::uint64_t request_bytes,
                         std::uint64_t region_bytes, BackendKind kind = BackendKind::kAuto,
                         const std::vector<FaultRule>& faults = {});

}  // namespace rondo::offload
