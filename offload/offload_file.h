// The file that holds offloaded state in hardware.offload_dir: created so that it cannot outlive
// the process (an unnamed O_TMPFILE file; where the filesystem has none, a file named with the pid
// and unlinked at once, and such files of dead processes removed at the next start), opened
// O_DIRECT where the filesystem allows it, and preallocated so that a full drive is found at start,
// not in the middle of a run. Used by NvmeStore and measure_disk.
//
//   offload::OffloadFile f = offload::create_offload_file("/mnt/nvme/rondo", true, nullptr);
//   offload::Preallocation p = offload::preallocate(f, 64ull << 30, nullptr);  // or DiskOutOfSpace
#pragma once

#include <cstdint>
#include <string>

#include "kernels/error.h"
#include "offload/io_faults.h"

namespace rondo::offload {

// The drive cannot hold what the run must put there. Carries the figures for the planner.
class DiskOutOfSpace : public Error {
 public:
  DiskOutOfSpace(const std::string& message, std::string dir, std::uint64_t needed,
                 std::uint64_t available)
      : Error(message), dir(std::move(dir)), needed(needed), available(available) {}
  std::string dir;
  std::uint64_t needed, available;  // bytes; available = what statvfs reports free to us
};

// A file descriptor, closed on destruction (a failed close is reported on stderr, never thrown).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() noexcept;

 private:
  int fd_ = -1;
};

struct OffloadFile {
  UniqueFd fd;
  std::string dir;
  std::string description;  // for messages: "the offload file in /mnt/nvme (unnamed: O_TMPFILE)"
  bool direct = false;      // opened O_DIRECT
  std::string direct_note;  // why not, when asked for and refused
  std::string name_note;    // how the file is named and why
  int stale_removed = 0;    // files of dead processes removed from dir
};

// Creates dir if needed, removes stale files of dead processes, creates the file. With
// `direct`, O_DIRECT is asked for; a filesystem that refuses it (EINVAL) gets buffered I/O and
// direct_note says so. Throws Error naming the folder and what to do when no file can be made.
OffloadFile create_offload_file(const std::string& dir, bool direct, FaultInjector* faults);

// Files named rondo-offload-<pid>-<n>.tmp in dir whose process no longer exists are removed
// (they were left by a crash between creating and unlinking one). Returns how many.
int remove_stale_offload_files(const std::string& dir);

// Free bytes for us in the filesystem of `dir` (statvfs f_bavail * f_frsize); nullopt-like
// UINT64_MAX when statvfs fails.
std::uint64_t disk_free_bytes(const std::string& dir);

struct Preallocation {
  bool reserved = false;  // fallocate reserved the blocks
  std::string note;       // when not: what was done instead
};

// Extends the file to `bytes` with its blocks reserved (fallocate). Throws DiskOutOfSpace when the
// filesystem has less free space (checked with statvfs first, then by fallocate's ENOSPC/EDQUOT).
// A filesystem without fallocate (EOPNOTSUPP): the file is extended sparse after the statvfs
// check, and the note says that a full drive will then show up as ENOSPC at a later write.
Preallocation preallocate(const OffloadFile& file, std::uint64_t bytes, FaultInjector* faults);

// "No space left on device (ENOSPC)".
std::string errno_text(int error);

}  // namespace rondo::offload
