// The NVMe store: training state that does not fit the host memory budget (frozen base weights of
// a LoRA run, fp32 masters and AdamW moments of a full run, activation checkpoints) kept in one
// preallocated file in hardware.offload_dir, read into and written from page-aligned host buffers
// asynchronously (io_uring, or a thread pool where io_uring is unavailable).
// Every block (1 MiB by default) carries an XXH3 checksum kept in memory and verified on every
// read; every failure — EIO, ENOSPC, a short read, a checksum mismatch — comes out of wait() as an
// IoError naming the file, the offset, the region and what to do. Thread-safe.
// Used by the engine's loaders (reads before uploads) and optimizer (writes after updates).
//
//   offload::NvmeStore store({.dir = "/mnt/nvme/rondo"}, 64ull << 30);
//   offload::Region w = store.reserve(layer_bytes, "layer 12 weights");
//   offload::HostBuffer buf = arena.allocate(layer_bytes, offload::Purpose::kStaging);
//   offload::IoTicket t = store.write(w, 0, buf.data(), layer_bytes);
//   store.wait(t);                              // throws offload::IoError on failure
//   t = store.read(w, 0, buf.data(), layer_bytes);
//   ...                                         // other work while the read runs
//   store.wait(t);
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "offload/io_backend.h"
#include "offload/io_faults.h"
#include "offload/offload_file.h"

namespace rondo::offload {

struct NvmeStoreOptions {
  std::string dir;  // hardware.offload_dir: created if missing
  BackendKind backend = BackendKind::kAuto;
  unsigned queue_depth = 32;             // requests in flight (io_uring); threads: min(qd, 4)
  std::uint64_t block_bytes = 1u << 20;  // checksum and request granularity; multiple of 4096
  bool direct = true;                    // ask for O_DIRECT (refused by some filesystems)
  // Injected I/O faults (tests; `rondo` builds them from RONDO_FAULT_IO in cli/test_faults.cpp).
  // The store reads no environment variable.
  std::vector<FaultRule> faults;
};

// A byte range of the store, from reserve(). Copyable; only meaningful to the store it came from.
struct Region {
  std::uint32_t id = UINT32_MAX;
  std::uint64_t offset = 0;  // in the store's file; a multiple of 4096
  std::uint64_t bytes = 0;   // as reserved, rounded up to 4096
  std::string name;          // "layer 12 weights": used in errors
  explicit operator bool() const { return id != UINT32_MAX; }
};

// A read or write that failed. The message names the file, the region, the offset, the error and
// what to do; the fields are for code that reacts (the engine reports and stops the run).
class IoError : public Error {
 public:
  enum class Kind {
    kOs,        // the OS returned an error (error: EIO, ENOSPC, ...)
    kShort,     // a read ended early (the file is shorter than it must be), or a write that the
                // kernel kept accepting for 0 bytes
    kChecksum,  // the data read back differs from what was written
  };
  IoError(const std::string& message, Kind kind, int error, std::string file, std::string region,
          std::uint64_t offset, std::uint64_t region_offset)
      : Error(message),
        kind(kind),
        error(error),
        file(std::move(file)),
        region(std::move(region)),
        offset(offset),
        region_offset(region_offset) {}
  Kind kind;
  int error;                    // errno for kOs, else 0
  std::string file;             // the store file's description
  std::string region;           // the region's name
  std::uint64_t offset;         // of the failed block in the file
  std::uint64_t region_offset;  // of the failed block in the region
};

namespace detail {
struct Transfer;
}

// One read or write in flight. Move-only. wait() blocks until every block of it has ended, then
// throws the first IoError, if any. A ticket destroyed without wait() still waits (its buffer is
// in use until then) and reports an error it swallows on stderr.
class IoTicket {
 public:
  IoTicket() = default;
  IoTicket(IoTicket&&) noexcept = default;
  IoTicket& operator=(IoTicket&& other) noexcept;
  IoTicket(const IoTicket&) = delete;
  IoTicket& operator=(const IoTicket&) = delete;
  ~IoTicket();

  bool ready() const;  // wait() would not block
  void wait();         // empties the ticket; waiting on an empty ticket returns at once
  explicit operator bool() const { return transfer_ != nullptr; }

 private:
  friend class NvmeStore;
  explicit IoTicket(std::shared_ptr<detail::Transfer> t) : transfer_(std::move(t)) {}
  std::shared_ptr<detail::Transfer> transfer_;
};

struct NvmeStoreInfo {
  std::string dir;
  std::string file;                    // the file's description, as in error messages
  std::string file_note;               // how it is named (O_TMPFILE or a pid-named unlinked file)
  std::string backend;                 // "io_uring" | "threads"
  std::string backend_note;            // why not the backend asked for ("" = the one asked for)
  bool direct = false;                 // O_DIRECT on
  std::string direct_note;             // why not, when asked for
  bool preallocated = false;           // fallocate reserved the space
  std::string preallocation_note;      // when not: what was done instead
  std::size_t registered_buffers = 0;  // io_uring fixed buffers in use
  std::string registration_note;       // why register_buffers() failed ("" = it did not)
  std::uint64_t capacity = 0, reserved = 0, block_bytes = 0;
  unsigned queue_depth = 0;
  std::uint64_t bytes_read = 0, bytes_written = 0;  // completed without error
};

class NvmeStore {
 public:
  // Creates the file in options.dir and preallocates `capacity_bytes` (rounded up to 4096).
  // Throws DiskOutOfSpace when the drive cannot hold it, Error for bad options, a folder that
  // cannot be used, or forced io_uring that is unavailable.
  NvmeStore(const NvmeStoreOptions& options, std::uint64_t capacity_bytes);
  // Waits for every transfer in flight; the file's space is freed.
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // A new region of `bytes` (> 0) named `name`. Throws Error when the capacity is exhausted.
  Region reserve(std::uint64_t bytes, const std::string& name);

  // Start a transfer of `bytes` at `offset` of the region. The host buffer must be 4096-byte
  // aligned (HostArena buffers are) and stay untouched (write) or unread (read) until wait();
  // `offset` must be a multiple of block_bytes and `bytes` too, except when the transfer ends in
  // the region's last block. A read must cover blocks as they were written (same offsets, same
  // lengths rounded up to 4096), after the write's wait(). Throws Error (before any I/O starts)
  // when these rules are broken or when a block read was never written or its write failed.
  IoTicket write(const Region& region, std::uint64_t offset, const void* src, std::uint64_t bytes);
  IoTicket read(const Region& region, std::uint64_t offset, void* dst, std::uint64_t bytes);
  void wait(IoTicket& ticket) { ticket.wait(); }

  // Optional: registers host buffers (the staging pool) with io_uring (see Note [Registered
  // buffers] in io_uring_backend.cpp), replacing an earlier set. True when registered; else
  // info().registration_note says why, and I/O goes on with plain reads and writes.
  bool register_buffers(const std::vector<BufferSpan>& buffers);

  NvmeStoreInfo info() const;
  // One line for logs: "io_uring, queue depth 32, O_DIRECT, 64.00 GiB preallocated in /mnt/nvme"
  // and any fallback with its reason.
  std::string summary() const;

  struct Impl;

 private:
  IoTicket start(IoOp op, const Region& region, std::uint64_t offset, void* buffer,
                 std::uint64_t bytes);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rondo::offload
