#include "offload/nvme_store.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <new>

#include "kernels/checksum.h"

namespace rondo::offload {

namespace {

constexpr std::uint64_t kPage = 4096;

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) {
  return (n + to - 1) / to * to;
}

enum class BlockState : std::uint8_t { kEmpty, kWritten, kFailed };

struct Block {
  std::uint64_t checksum = 0;
  std::uint32_t length = 0;  // bytes written, rounded up to 4096
  BlockState state = BlockState::kEmpty;
};

struct RegionState {
  std::string name;
  std::uint64_t offset = 0, bytes = 0;
  std::vector<Block> blocks;  // guarded by Impl::mutex
};

}  // namespace

struct NvmeStore::Impl {
  NvmeStoreOptions options;
  std::unique_ptr<FaultInjector> faults;
  IoBackendChoice backend;
  OffloadFile file;
  Preallocation preallocation;
  std::uint64_t capacity = 0;

  mutable std::mutex mutex;  // guards everything below up to the counters
  std::deque<RegionState> regions;
  std::uint64_t next_offset = 0;
  std::string registration_note;

  std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0};

  std::mutex flight_mutex;
  std::condition_variable flight_cv;
  std::uint64_t transfers_in_flight = 0;

  void transfer_started() {
    std::lock_guard lock(flight_mutex);
    ++transfers_in_flight;
  }
  void transfer_ended() {
    std::lock_guard lock(flight_mutex);
    if (--transfers_in_flight == 0) flight_cv.notify_all();
  }
  void mark_failed(std::uint32_t region, std::uint64_t block) {
    std::lock_guard lock(mutex);
    regions[region].blocks[block].state = BlockState::kFailed;
  }
};

namespace detail {

struct BlockIo final : IoRequest {
  Transfer* transfer = nullptr;
  std::uint64_t block = 0;          // index in the region
  std::uint64_t region_offset = 0;  // of the block
  std::uint64_t length = 0;         // bytes the caller asked for in this block
  std::uint64_t expected = 0;       // checksum: computed (write) or recorded (read)
  void* bounce = nullptr;           // a page for the last length % 4096 bytes, when there are some
  void* tail = nullptr;             // read: where the bounced bytes go in the caller's buffer
  std::uint64_t tail_bytes = 0;

  void complete(const IoResult& result) noexcept override;
};

struct Transfer {
  NvmeStore::Impl* store = nullptr;
  IoOp op = IoOp::kRead;
  std::uint32_t region = 0;
  std::string region_name;
  std::size_t count = 0;
  std::unique_ptr<BlockIo[]> blocks;
  std::atomic<std::size_t> outstanding{0};
  std::shared_ptr<Transfer> self;  // keeps the transfer alive until its last block has ended

  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::optional<IoError> error;  // the first failure
  std::size_t failures = 0;

  ~Transfer() {
    for (std::size_t i = 0; i < count; ++i)
      std::free(blocks[i].bounce);
  }

  void block_ended(std::optional<IoError> failure) {
    if (failure) {
      std::lock_guard lock(mutex);
      ++failures;
      if (!error) error = std::move(failure);
    }
    if (outstanding.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::shared_ptr<Transfer> keep = std::move(self);
    NvmeStore::Impl* s = store;
    {
      std::lock_guard lock(mutex);
      done = true;
      cv.notify_all();
    }
    s->transfer_ended();  // after this the store may be destroyed (it joins this thread first)
  }
};

namespace {

std::string where(const Transfer& t, const BlockIo& b) {
  return "'" + t.region_name + "' (bytes " + std::to_string(b.region_offset) + ".." +
         std::to_string(b.region_offset + b.length) + " of the region) at offset " +
         std::to_string(b.offset) + " of " + t.store->file.description;
}

IoError failure(const Transfer& t, const BlockIo& b, const IoResult& r) {
  const NvmeStore::Impl& s = *t.store;
  const bool reading = t.op == IoOp::kRead;
  const std::string what =
      std::string("offload store: ") + (reading ? "reading " : "writing ") + where(t, b);
  std::string text;
  IoError::Kind kind = IoError::Kind::kOs;
  if (r.error == 0 && reading) {
    kind = IoError::Kind::kShort;
    text = what + ": the file ended after " + std::to_string(r.bytes) + " of " +
           std::to_string(b.bytes()) +
           " bytes, so something truncated or replaced the offload "
           "file. Make sure no other program writes in " +
           s.options.dir + ", or choose another hardware.offload_dir";
  } else if (r.error == 0) {
    kind = IoError::Kind::kShort;
    text = what + ": the kernel accepted 0 bytes after " + std::to_string(r.bytes) + " of " +
           std::to_string(b.bytes()) + ", " + std::to_string(r.retries) +
           " times. Check the "
           "drive (dmesg, smartctl -a), or choose another hardware.offload_dir";
  } else {
    text = what + " failed: " + errno_text(r.error) + ". ";
    if (r.error == ENOSPC || r.error == EDQUOT)
      text +=
          "The drive filled up under the preallocated file (a thin-provisioned, "
          "copy-on-write or compressed filesystem, or a quota, can do that): free space in " +
          s.options.dir + ", or choose another hardware.offload_dir";
    else if (r.error == EAGAIN || r.error == EINTR)
      text += "The kernel kept answering this through " + std::to_string(r.retries) +
              " retries: the system is short of I/O resources. Try again, or set the offload "
              "backend to threads";
    else
      text += "Check the drive (dmesg, smartctl -a), or choose another hardware.offload_dir";
  }
  return IoError(text, kind, r.error, s.file.description, t.region_name, b.offset, b.region_offset);
}

}  // namespace

void BlockIo::complete(const IoResult& result) noexcept {
  Transfer& t = *transfer;
  NvmeStore::Impl& s = *t.store;
  std::optional<IoError> error;
  try {
    if (!result.ok()) {
      error = failure(t, *this, result);
    } else if (op == IoOp::kRead) {
      if (kernels::xxh3_segments(iov, iov_count) != expected) {
        error = IoError("offload store: reading " + where(t, *this) +
                            ": the data read back differs from what was written: the drive or "
                            "filesystem returned corrupt data (the block's XXH3 checksum does not "
                            "match); check the drive (SMART: smartctl -a), or choose another "
                            "hardware.offload_dir",
                        IoError::Kind::kChecksum, 0, s.file.description, t.region_name, offset,
                        region_offset);
      } else {
        if (tail_bytes) std::memcpy(tail, bounce, tail_bytes);
        s.bytes_read += length;
      }
    } else {
      s.bytes_written += length;
    }
    if (error && op == IoOp::kWrite) s.mark_failed(t.region, block);
  } catch (const std::exception& e) {  // out of memory for a message: still end the block
    std::fprintf(stderr, "rondo: error: offload store: %s\n", e.what());
    if (!error)
      error = IoError(std::string("offload store: ") + e.what(), IoError::Kind::kOs, ENOMEM,
                      s.file.description, t.region_name, offset, region_offset);
  }
  t.block_ended(std::move(error));
}

}  // namespace detail

IoTicket& IoTicket::operator=(IoTicket&& other) noexcept {
  if (this != &other) {
    IoTicket old(std::move(*this));  // waits for what this ticket held
    transfer_ = std::move(other.transfer_);
  }
  return *this;
}

IoTicket::~IoTicket() {
  if (!transfer_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "rondo: warning: an offload transfer failed and nobody waited for it: %s\n",
                 e.what());
  }
}

bool IoTicket::ready() const {
  if (!transfer_) return true;
  std::lock_guard lock(transfer_->mutex);
  return transfer_->done;
}

void IoTicket::wait() {
  if (!transfer_) return;
  std::shared_ptr<detail::Transfer> t = std::move(transfer_);
  std::unique_lock lock(t->mutex);
  t->cv.wait(lock, [&] { return t->done; });
  if (!t->error) return;
  // A new message, not a copy of the stored error: std::runtime_error's copies share one
  // reference-counted string, and the I/O thread may drop the Transfer (and its reference) after
  // the caller has read and dropped its own. The count lives in the uninstrumented libstdc++, so
  // ThreadSanitizer sees that as a race on the string (it did, once in ~100 runs). Built under the
  // lock, the caller's error shares nothing with the I/O thread's.
  const IoError& first = *t->error;
  std::string message(first.what());
  if (t->failures > 1)
    message += " (" + std::to_string(t->failures) + " of the " + std::to_string(t->count) +
               " blocks of this transfer failed; this is the first)";
  throw IoError(message, first.kind, first.error, first.file, first.region, first.offset,
                first.region_offset);
}

NvmeStore::NvmeStore(const NvmeStoreOptions& options, std::uint64_t capacity_bytes)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.options = options;
  std::vector<std::string> problems;
  if (options.dir.empty()) problems.push_back("dir: empty; set hardware.offload_dir");
  if (options.block_bytes == 0 || options.block_bytes % kPage != 0 ||
      options.block_bytes > (std::uint64_t{1} << 30))
    problems.push_back("block_bytes: " + std::to_string(options.block_bytes) +
                       " is not a multiple of 4096 between 4096 and 1 GiB");
  if (options.queue_depth == 0 || options.queue_depth > 4096)
    problems.push_back("queue_depth: " + std::to_string(options.queue_depth) +
                       " is not between 1 and 4096");
  if (!problems.empty()) throw Error(join_problems("offload store options:", problems));

  if (!options.faults.empty()) s.faults = std::make_unique<FaultInjector>(options.faults);

  s.backend = make_io_backend(
      {.kind = options.backend, .queue_depth = options.queue_depth, .faults = s.faults.get()});
  s.file = create_offload_file(options.dir, options.direct, s.faults.get());
  s.capacity = round_up(capacity_bytes, kPage);
  s.preallocation = preallocate(s.file, s.capacity, s.faults.get());
}

NvmeStore::~NvmeStore() {
  Impl& s = *impl_;
  {
    std::unique_lock lock(s.flight_mutex);
    s.flight_cv.wait(lock, [&] { return s.transfers_in_flight == 0; });
  }
  s.backend.backend.reset();  // joins its threads: no completion runs after this
}

Region NvmeStore::reserve(std::uint64_t bytes, const std::string& name) {
  Impl& s = *impl_;
  if (bytes == 0) throw Error("offload store: region '" + name + "' of 0 bytes");
  const std::uint64_t rounded = round_up(bytes, kPage);
  std::lock_guard lock(s.mutex);
  if (rounded > s.capacity - s.next_offset)
    throw Error("offload store in " + s.options.dir + " is full: '" + name + "' needs " +
                format_bytes(rounded) + ", and " + format_bytes(s.next_offset) + " of its " +
                format_bytes(s.capacity) +
                " are reserved already (the store's capacity comes from the plan, which should "
                "have counted this region)");
  RONDO_ASSERT(s.regions.size() < UINT32_MAX);
  RegionState r;
  r.name = name;
  r.offset = s.next_offset;
  r.bytes = rounded;
  r.blocks.resize((rounded + s.options.block_bytes - 1) / s.options.block_bytes);
  s.next_offset += rounded;
  s.regions.push_back(std::move(r));
  return Region{static_cast<std::uint32_t>(s.regions.size() - 1), s.regions.back().offset, rounded,
                name};
}

IoTicket NvmeStore::write(const Region& region, std::uint64_t offset, const void* src,
                          std::uint64_t bytes) {
  return start(IoOp::kWrite, region, offset, const_cast<void*>(src), bytes);
}

IoTicket NvmeStore::read(const Region& region, std::uint64_t offset, void* dst,
                         std::uint64_t bytes) {
  return start(IoOp::kRead, region, offset, dst, bytes);
}

IoTicket NvmeStore::start(IoOp op, const Region& region, std::uint64_t offset, void* buffer,
                          std::uint64_t bytes) {
  Impl& s = *impl_;
  const std::uint64_t block = s.options.block_bytes;
  const bool reading = op == IoOp::kRead;
  const std::string call = std::string("offload store: ") + (reading ? "read of '" : "write of '") +
                           region.name + "' at offset " + std::to_string(offset) + " (" +
                           std::to_string(bytes) + " bytes)";
  {
    std::lock_guard lock(s.mutex);
    if (!region || region.id >= s.regions.size() || s.regions[region.id].offset != region.offset ||
        s.regions[region.id].bytes != region.bytes)
      throw Error(call + ": the region does not belong to this store");
  }
  if (bytes == 0) return IoTicket();
  if (reinterpret_cast<std::uintptr_t>(buffer) % kPage != 0)
    throw Error(call +
                ": the host buffer is not 4096-byte aligned, which O_DIRECT needs; "
                "allocate it from the HostArena");
  if (offset % block != 0)
    throw Error(call + ": the offset is not a multiple of the store's block size (" +
                format_bytes(block) + ")");
  if (offset > region.bytes || bytes > region.bytes - offset)
    throw Error(call + ": past the end of the region (" + std::to_string(region.bytes) + " bytes)");
  const std::uint64_t end = offset + bytes;
  const std::uint64_t region_blocks = (region.bytes + block - 1) / block;
  if (end % block != 0 && (end - 1) / block != region_blocks - 1)
    throw Error(call + ": the size is not a multiple of the store's block size (" +
                format_bytes(block) +
                "), which only a transfer ending in the region's last "
                "block may be");

  auto t = std::make_shared<detail::Transfer>();
  t->store = &s;
  t->op = op;
  t->region = region.id;
  t->region_name = region.name;
  t->count = (bytes + block - 1) / block;
  t->blocks = std::make_unique<detail::BlockIo[]>(t->count);
  const int fd = s.file.fd.get();
  for (std::size_t i = 0; i < t->count; ++i) {
    detail::BlockIo& b = t->blocks[i];
    b.transfer = t.get();
    b.op = op;
    b.fd = fd;
    b.region_offset = offset + i * block;
    b.offset = region.offset + b.region_offset;
    b.block = b.region_offset / block;
    b.length = std::min(block, bytes - i * block);
    char* data = static_cast<char*>(buffer) + i * block;
    const std::uint64_t direct = b.length / kPage * kPage;
    b.iov_count = 0;
    if (direct) b.iov[b.iov_count++] = {data, direct};
    b.tail_bytes = b.length - direct;
    if (b.tail_bytes) {
      // O_DIRECT moves whole pages; the caller's buffer may end mid-page, so the last partial
      // page goes through a page of our own.
      b.bounce = std::aligned_alloc(kPage, kPage);
      if (b.bounce == nullptr) throw std::bad_alloc();
      b.tail = data + direct;
      if (!reading) {
        std::memcpy(b.bounce, b.tail, b.tail_bytes);
        std::memset(static_cast<char*>(b.bounce) + b.tail_bytes, 0, kPage - b.tail_bytes);
      }
      b.iov[b.iov_count++] = {b.bounce, kPage};
    }
  }

  // Reads: every block must hold what a completed write put there, in the same shape.
  if (reading) {
    std::lock_guard lock(s.mutex);
    const RegionState& r = s.regions[region.id];
    for (std::size_t i = 0; i < t->count; ++i) {
      detail::BlockIo& b = t->blocks[i];
      const Block& k = r.blocks[b.block];
      const std::string at = call + ": block at region offset " + std::to_string(b.region_offset);
      if (k.state == BlockState::kEmpty) throw Error(at + " was never written");
      if (k.state == BlockState::kFailed)
        throw Error(at +
                    " holds no valid data: its last write failed (that write's wait() "
                    "reported why)");
      if (k.length != b.bytes())
        throw Error(at + " was written with " + std::to_string(k.length) +
                    " bytes (rounded up to 4096) and is read with " + std::to_string(b.bytes()) +
                    ": read blocks as they were written");
      b.expected = k.checksum;
    }
  }

  t->outstanding = t->count;
  t->self = t;
  s.transfer_started();
  // Writes: checksum a few blocks, hand them to the backend, and on, so that the drive starts
  // while later blocks are hashed.
  constexpr std::size_t kBatch = 8;
  std::vector<IoRequest*> batch;
  batch.reserve(kBatch);
  for (std::size_t i = 0; i < t->count; i += kBatch) {
    const std::size_t n = std::min(kBatch, t->count - i);
    batch.clear();
    for (std::size_t j = i; j < i + n; ++j)
      batch.push_back(&t->blocks[j]);
    if (!reading) {
      for (IoRequest* q : batch) {
        auto* b = static_cast<detail::BlockIo*>(q);
        b->expected = kernels::xxh3_segments(b->iov, b->iov_count);
      }
      std::lock_guard lock(s.mutex);
      RegionState& r = s.regions[region.id];
      for (IoRequest* q : batch) {
        auto* b = static_cast<detail::BlockIo*>(q);
        r.blocks[b->block] = {b->expected, static_cast<std::uint32_t>(b->bytes()),
                              BlockState::kWritten};
      }
    }
    s.backend.backend->submit(batch.data(), batch.size());
  }
  return IoTicket(std::move(t));
}

bool NvmeStore::register_buffers(const std::vector<BufferSpan>& buffers) {
  Impl& s = *impl_;
  for (const BufferSpan& b : buffers)
    if (reinterpret_cast<std::uintptr_t>(b.data) % kPage != 0)
      throw Error(
          "offload store: register_buffers: a buffer is not 4096-byte aligned; "
          "allocate it from the HostArena");
  std::string why = s.backend.backend->register_buffers(buffers);
  std::lock_guard lock(s.mutex);
  s.registration_note = why;
  return why.empty();
}

NvmeStoreInfo NvmeStore::info() const {
  const Impl& s = *impl_;
  NvmeStoreInfo i;
  i.dir = s.options.dir;
  i.file = s.file.description;
  i.file_note = s.file.name_note;
  i.backend = s.backend.backend->name();
  i.backend_note = s.backend.note;
  i.direct = s.file.direct;
  i.direct_note = s.file.direct_note;
  i.preallocated = s.preallocation.reserved;
  i.preallocation_note = s.preallocation.note;
  i.registered_buffers = s.backend.backend->registered_buffers();
  i.capacity = s.capacity;
  i.block_bytes = s.options.block_bytes;
  i.queue_depth = s.options.queue_depth;
  i.bytes_read = s.bytes_read.load();
  i.bytes_written = s.bytes_written.load();
  std::lock_guard lock(s.mutex);
  i.reserved = s.next_offset;
  i.registration_note = s.registration_note;
  return i;
}

std::string NvmeStore::summary() const {
  const NvmeStoreInfo i = info();
  std::string text = i.backend + ", queue depth " + std::to_string(i.queue_depth) + ", " +
                     (i.direct ? "O_DIRECT" : "buffered") + ", " + format_bytes(i.capacity) +
                     (i.preallocated ? " preallocated" : " (not preallocated)") + " in " + i.dir;
  for (const std::string* note :
       {&i.backend_note, &i.direct_note, &i.preallocation_note, &i.registration_note})
    if (!note->empty()) text += "; " + *note;
  return text;
}

}  // namespace rondo::offload
