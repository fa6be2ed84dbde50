// LayerStore's NVMe regions and the I/O in flight on them (private to layer_store*.cpp): which
// units (a layer's streaming part, a piece of it, an optimizer chunk's record, a gradient record)
// are being read ahead or written back, so that a read never overtakes a write, staging stays
// bounded, and a unit's data is taken from a write in flight rather than read again.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "offload/layer_store.h"
#include "offload/nvme_store.h"

namespace rondo::offload {

// Write-backs kept in flight at most; older ones are waited for (and their staging freed) as new
// ones start, so that staging memory stays bounded (a few layers) whatever the model's size.
inline constexpr std::size_t kMaxPendingWrites = 4;

// NVMe regions of each layer and the I/O in flight on them.
struct LayerStore::Regions {
  // Per layer, by part index; the optimizer part's is unused (see chunk).
  std::vector<std::array<Region, 3>> region;
  std::vector<std::vector<Region>> chunk;  // per layer: NVMe optimizer state, a record per chunk
  std::vector<std::vector<Region>> grad_chunk;  // per layer: NVMe gradients, a record per chunk
  std::mutex mutex;
  // Layer, part, chunk (0 for the streaming parts): a unit of staging and I/O.
  using Key = std::tuple<std::size_t, unsigned, std::size_t>;
  struct Io {
    IoTicket ticket;
    HostBuffer buffer;
  };
  std::map<Key, Io> writes, reads;  // write-backs and prefetches in flight
  std::deque<Key> write_order;      // oldest first
  std::exception_ptr write_error;   // the first failed write-back not yet reported
  // Parts whose write-back some thread has taken out of `writes` and is waiting for: nobody reads
  // them from the drive (or prefetches them) until it is done (a read may not overtake a write).
  std::set<Key> completing;
  std::map<Key, int> reading;  // reads of a part in flight that are not in `reads`
  // Parts a write-back is waiting to submit (for their reads to end): new reads of them wait, so
  // that a stream of readers cannot starve the writer.
  std::map<Key, int> writing;
  std::condition_variable done;

  // A unit's data in a staging buffer of region.bytes (read, taken from a prefetch or a
  // write-back in flight, or zeros for kOverwrite).
  HostBuffer stage(NvmeStore* nvme, HostArena& arena, const Key& key, const Region& region,
                   AccessMode mode);
  // Starts reading a unit ahead (no-op when a read or a write-back of it is in flight).
  void prefetch(NvmeStore* nvme, HostArena& arena, const Key& key, const Region& region);
  // A piece (`key`, bytes at `offset` of the region) of a streaming part (`whole`): read, or
  // taken from a prefetch; a write-back of the whole part in flight is waited for first.
  HostBuffer read_piece(NvmeStore* nvme, HostArena& arena, const Key& whole, const Key& key,
                        const Region& region, std::uint64_t offset, std::uint64_t bytes);
  void prefetch_piece(NvmeStore* nvme, HostArena& arena, const Key& whole, const Key& key,
                      const Region& region, std::uint64_t offset, std::uint64_t bytes);
  // Ends the count of a read of `key` in `reading` (and wakes a write-back waiting for it).
  struct ReadDone {
    Regions& r;
    const Key& key;
    bool counted;
    ~ReadDone() {
      if (!counted) return;
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (--r.reading[key] == 0) r.reading.erase(key);
      }
      r.done.notify_all();
    }
  };
  // Starts writing `buf` to the unit; write-backs beyond kMaxPendingWrites are taken out into
  // `evicted` for the caller to wait for (complete()).
  // (`bytes` at `offset` of the region: a piece of a streaming part being loaded; else the whole
  // region.)
  void submit_write(NvmeStore* nvme, const Key& key, const Region& region, HostBuffer buf,
                    std::vector<std::pair<Key, Io>>& evicted, std::uint64_t offset = 0,
                    std::uint64_t bytes = 0);

  // Under the lock: moves `key`'s write-back in flight from `writes` into `into` (its key in
  // `completing` until complete()); false when there is none.
  bool take_write(const Key& key, std::vector<std::pair<Key, Io>>& into) {
    auto it = writes.find(key);
    if (it == writes.end()) return false;
    into.emplace_back(key, std::move(it->second));
    writes.erase(it);
    write_order.erase(std::find(write_order.begin(), write_order.end(), key));
    completing.insert(key);
    return true;
  }
  // Under the lock: moves the write-backs in flight of pieces of the streaming part `whole`
  // (keys (layer, part, 1...)) into `into`, as take_write.
  void take_piece_writes(const Key& whole, std::vector<std::pair<Key, Io>>& into) {
    const auto [layer, part, zero] = whole;
    std::vector<Key> keys;
    for (auto it = writes.lower_bound({layer, part, 1});
         it != writes.end() && std::get<0>(it->first) == layer && std::get<1>(it->first) == part;
         ++it)
      keys.push_back(it->first);
    for (const Key& k : keys)
      take_write(k, into);
  }
  // Under `lock`: waits until no thread is completing, or waiting to submit, a write-back of `key`.
  void settle(std::unique_lock<std::mutex>& lock, const Key& key) {
    done.wait(lock, [&] { return completing.count(key) == 0 && writing.count(key) == 0; });
  }
  // Waits for write-backs taken out of `writes` (their keys in `completing`), then releases the
  // keys. Returns the first error.
  std::exception_ptr complete(NvmeStore* nvme, std::vector<std::pair<Key, Io>>& ios) {
    std::exception_ptr error;
    if (ios.empty()) return error;
    for (auto& [key, io] : ios) {
      try {
        nvme->wait(io.ticket);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (auto& [key, io] : ios)
        completing.erase(key);
    }
    done.notify_all();
    return error;
  }
};

}  // namespace rondo::offload
