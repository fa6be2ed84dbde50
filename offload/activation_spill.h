// Activation checkpoints on the NVMe tier. With very long sequences the inputs a forward job saves
// for the backward (one per backward stage, or one per block in layer grain) outgrow host memory:
// tokens × hidden × 2 bytes each, for every microbatch of two steps in flight. The planner then
// puts them here (docs/training.md, "Bigger than host memory"): a checkpoint downloaded to host
// staging is written to the store's file in the background and its staging recycled; the backward
// job that needs it reads it back (prefetched one microbatch ahead). What a backward job receives
// is byte for byte what the forward saved.
//
//   offload::ActivationSpill spill(nvme, capacity, take_staging, recycle);
//   offload::Spilled s = spill.write(std::move(host), bytes, std::move(downloaded));  // async
//   ...
//   spill.prefetch(s);                      // starts the read once written
//   offload::HostBuffer back = spill.read(s);  // blocks; the space on the tier is free again
//
// Space: `capacity` bytes of the store, handed out as regions of whole store blocks reserved on
// first need and reused by checkpoints of as many blocks (training's checkpoints repeat their
// sizes every step; capacity_for() sizes it). A checkpoint that finds no space stays in host
// memory (counted in stats().held; the planner sizes the space for two steps, so this happens only
// past that, e.g. a resumed run whose saved plan saves more). A write blocks while `max_queued`
// writes wait for the drive, so that host staging stays bounded. A read of a checkpoint whose write
// has not started takes the host copy back without touching the drive. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "kernels/device.h"
#include "offload/host_arena.h"

namespace rondo::offload {

class NvmeStore;

namespace detail {
struct SpillPool;
struct SpillEntry;
}  // namespace detail

// One checkpoint handed to the tier. Move-only. Dropping it unread frees its space (once a read or
// write of it in flight has ended).
class Spilled {
 public:
  Spilled() = default;
  Spilled(Spilled&&) noexcept = default;
  Spilled& operator=(Spilled&&) noexcept = default;
  Spilled(const Spilled&) = delete;
  Spilled& operator=(const Spilled&) = delete;
  ~Spilled();
  explicit operator bool() const { return entry_ != nullptr; }

 private:
  friend class ActivationSpill;
  std::shared_ptr<detail::SpillEntry> entry_;
};

struct SpillStats {
  std::uint64_t written = 0;   // bytes written to the drive
  std::uint64_t read = 0;      // bytes read back
  std::uint64_t kept = 0;      // bytes taken back before their write started (no I/O)
  std::uint64_t held = 0;      // bytes kept in host memory for want of space on the tier
  std::uint64_t reserved = 0;  // of the capacity, in regions so far
};

class ActivationSpill {
 public:
  using Take = std::function<HostBuffer(std::size_t bytes)>;  // staging for a read
  using Give = std::function<void(HostBuffer)>;               // staging no longer needed
  // `capacity` bytes of `nvme` (not yet reserved there) hold checkpoints. `take` gives host
  // staging for reads back, `give` takes written checkpoints' staging, and the host memory of
  // checkpoints dropped unread (kept for want of space, read back, or waiting when this goes),
  // while this lives. `nvme` must outlive this and every Spilled.
  ActivationSpill(NvmeStore& nvme, std::uint64_t capacity, Take take, Give give,
                  std::size_t max_queued = 4);
  // Writes still waiting are dropped (their reads then fail); the one under way ends first.
  ~ActivationSpill();
  ActivationSpill(const ActivationSpill&) = delete;
  ActivationSpill& operator=(const ActivationSpill&) = delete;

  // The capacity `count` checkpoints of at most `bytes` each take in a store of `block_bytes`.
  static std::uint64_t capacity_for(std::uint64_t bytes, std::uint64_t count,
                                    std::uint64_t block_bytes);

  // Hands `bytes` of `host` to the tier; they are complete once `ready` has (null: now). Returns at
  // once unless max_queued writes wait (then it blocks until the drive takes one).
  Spilled write(HostBuffer host, std::size_t bytes, std::unique_ptr<kernels::Event> ready);
  // Starts reading `s` back into staging if it is written and not yet being read; else nothing.
  void prefetch(Spilled& s);
  // `s` back in host staging (its first `bytes` as written); blocks for the write and the read.
  // Empties `s`. Throws offload::IoError (file, offset, what to do) when its write or read failed.
  HostBuffer read(Spilled& s);

  SpillStats stats() const;

 private:
  std::shared_ptr<detail::SpillPool> pool_;
};

}  // namespace rondo::offload
