// LayerStore's I/O in flight (layer_store_regions.h): staging a unit, reading ahead, reading a
// piece, submitting a write-back.
#include <cstring>
#include <optional>

#include "offload/layer_store_regions.h"

namespace rondo::offload {

HostBuffer LayerStore::Regions::stage(NvmeStore* nvme, HostArena& arena, const Key& key,
                                      const Region& region, AccessMode mode) {
  // A unit's staging buffer: its write-back still in flight (the data is that), a prefetch, or
  // a fresh read.
  std::optional<Io> prefetched;
  std::vector<std::pair<Key, Io>> pending;
  const bool fresh_read_needed = mode != AccessMode::kOverwrite;
  bool counted = false;  // counted in `reading` while our read is in flight
  {
    // Pieces of a streaming part written since (the optimizer writes the trained part so) are
    // on the drive before the part is read whole or overwritten.
    std::vector<std::pair<Key, Io>> pieces;
    if (std::get<1>(key) == kBasePart || std::get<1>(key) == kStreamPart) {
      std::unique_lock<std::mutex> lock(mutex);
      take_piece_writes(key, pieces);
    }
    if (std::exception_ptr e = complete(nvme, pieces)) std::rethrow_exception(e);
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    settle(lock, key);
    if (take_write(key, pending)) {
      // The data is that write's buffer (below).
    } else if (auto it = reads.find(key); it != reads.end()) {
      prefetched = std::move(it->second);
      reads.erase(it);
      counted = true;
    } else {
      counted = fresh_read_needed;
    }
    if (counted) ++reading[key];
  }
  // A write-back of this unit waits until our read has ended (a write may not overtake a read:
  // the drive would hand back a mix, and the checksum would be the new one's).
  const ReadDone read_done{*this, key, counted};
  HostBuffer buf;
  if (!pending.empty()) {
    // The data is the buffer being written: wait for the write (the buffer must not change
    // while it is written, and other readers wait for the drive to hold it), then use it.
    if (std::exception_ptr e = complete(nvme, pending)) std::rethrow_exception(e);
    buf = std::move(pending.front().second.buffer);
  } else if (prefetched) {
    nvme->wait(prefetched->ticket);
    buf = std::move(prefetched->buffer);
  } else {
    buf = arena.allocate(region.bytes, Purpose::kStaging);  // fresh pages: zeros
    if (fresh_read_needed) {
      IoTicket t = nvme->read(region, 0, buf.data(), region.bytes);
      nvme->wait(t);
    }
    return buf;
  }
  if (mode == AccessMode::kOverwrite) std::memset(buf.data(), 0, buf.bytes());
  return buf;
}

void LayerStore::Regions::prefetch(NvmeStore* nvme, HostArena& arena, const Key& key,
                                   const Region& region) {
  std::unique_lock<std::mutex> lock(mutex);
  settle(lock, key);
  // A write-back in flight already holds the data; a prefetch is already under way.
  if (writes.count(key) || reads.count(key)) return;
  Io io;
  io.buffer = arena.allocate(region.bytes, Purpose::kStaging);
  io.ticket = nvme->read(region, 0, io.buffer.data(), region.bytes);
  reads.emplace(key, std::move(io));
}

HostBuffer LayerStore::Regions::read_piece(NvmeStore* nvme, HostArena& arena, const Key& whole,
                                           const Key& key, const Region& region,
                                           std::uint64_t offset, std::uint64_t bytes) {
  std::optional<Io> prefetched;
  std::vector<std::pair<Key, Io>> pending;
  {
    std::unique_lock<std::mutex> lock(mutex);
    settle(lock, whole);
    settle(lock, key);
    // A write-back of the whole part must be on the drive before we read (and then no piece of
    // it was read ahead: the write-back dropped those). A write of this piece in flight (the
    // optimizer writes the trained part in pieces) holds the data: we take its buffer once the
    // drive has it.
    const bool wait_for_write = take_write(whole, pending);
    const bool piece_written = !wait_for_write && take_write(key, pending);
    if (auto it = reads.find(key); !wait_for_write && !piece_written && it != reads.end()) {
      prefetched = std::move(it->second);
      reads.erase(it);
    }
    ++reading[whole];  // a write-back of the part waits for this read
  }
  const ReadDone read_done{*this, whole, true};
  if (!pending.empty()) {
    if (std::exception_ptr e = complete(nvme, pending)) std::rethrow_exception(e);
    if (std::get<2>(pending.front().first) != 0) return std::move(pending.front().second.buffer);
  }
  if (prefetched) {
    nvme->wait(prefetched->ticket);
    return std::move(prefetched->buffer);
  }
  HostBuffer buf = arena.allocate(bytes, Purpose::kStaging);
  IoTicket t = nvme->read(region, offset, buf.data(), bytes);
  nvme->wait(t);
  return buf;
}

void LayerStore::Regions::prefetch_piece(NvmeStore* nvme, HostArena& arena, const Key& whole,
                                         const Key& key, const Region& region, std::uint64_t offset,
                                         std::uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex);
  settle(lock, whole);
  settle(lock, key);
  if (writes.count(whole) || writes.count(key) || reads.count(key)) return;
  Io io;
  io.buffer = arena.allocate(bytes, Purpose::kStaging);
  io.ticket = nvme->read(region, offset, io.buffer.data(), bytes);
  reads.emplace(key, std::move(io));
}

void LayerStore::Regions::submit_write(NvmeStore* nvme, const Key& key, const Region& region,
                                       HostBuffer buf, std::vector<std::pair<Key, Io>>& evicted,
                                       std::uint64_t offset, std::uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mutex);
  // No read of the unit may be in flight when its write starts (see stage()): hold new readers
  // back, wait for those in flight, and drop a prefetch (it read the old data).
  ++writing[key];
  struct Submitted {  // lets new readers go on (under the lock), however this scope ends
    Regions& r;
    const Key& key;
    ~Submitted() {
      if (--r.writing[key] == 0) r.writing.erase(key);
      r.done.notify_all();
    }
  } submitted{*this, key};
  // A prefetch of the unit, or of a piece of a streaming part (Note [Weight pieces]).
  auto stale_read = [&] {
    auto it = reads.find(key);
    // A piece's write drops its own prefetch; a whole part's, any of its pieces'.
    if (it != reads.end() || std::get<1>(key) == kOptimizerPart || std::get<1>(key) == kGradPart ||
        std::get<2>(key) != 0)
      return it;
    it = reads.lower_bound({std::get<0>(key), std::get<1>(key), 1});
    return it != reads.end() && std::get<0>(it->first) == std::get<0>(key) &&
                   std::get<1>(it->first) == std::get<1>(key)
               ? it
               : reads.end();
  };
  for (;;) {
    done.wait(lock, [&] { return reading.count(key) == 0 && completing.count(key) == 0; });
    auto it = stale_read();
    if (it == reads.end()) break;
    std::vector<std::pair<Key, Io>> stale;
    const Key stale_key = it->first;
    stale.emplace_back(stale_key, std::move(it->second));
    reads.erase(it);
    completing.insert(stale_key);
    lock.unlock();
    complete(nvme, stale);  // its data is stale; an error of it does not matter now
    lock.lock();
  }
  Io io;
  io.ticket = nvme->write(region, offset, buf.data(), bytes ? bytes : region.bytes);  // not waited
  io.buffer = std::move(buf);
  writes.emplace(key, std::move(io));
  write_order.push_back(key);
  while (write_order.size() > kMaxPendingWrites) {
    const Key old = write_order.front();
    auto it = writes.find(old);
    evicted.emplace_back(old, std::move(it->second));
    writes.erase(it);
    write_order.pop_front();
    completing.insert(old);
  }
}

}  // namespace rondo::offload
