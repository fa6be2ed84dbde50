#include "offload/offload_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace rondo::offload {
namespace {

constexpr const char* kPrefix = "rondo-offload-";
constexpr const char* kSuffix = ".tmp";

std::string what_to_do_when_full() {
  return "Choose a larger or emptier drive for hardware.offload_dir, or need less of it: give the "
         "run more host memory (hardware.host_memory) if the machine has it, so that less state "
         "goes to disk; train LoRA adapters instead of the full model, or keep the frozen base "
         "quantised; or pick a smaller model";
}

// open() through the fault rules: an injected errno replaces the call.
int open_checked(const std::string& path, int flags, FaultInjector* faults) {
  if (faults) {
    if (int e = faults->on_call(FaultOp::kOpen, (flags & O_DIRECT) != 0)) {
      errno = e;
      return -1;
    }
  }
  int fd;
  do {
    fd = ::open(path.c_str(), flags, 0600);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Parses "rondo-offload-<pid>-<n>.tmp"; 0 when the name is not one of ours.
pid_t pid_of_offload_name(const std::string& name) {
  const std::string prefix = kPrefix, suffix = kSuffix;
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return 0;
  const std::string mid = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  const std::size_t dash = mid.find('-');
  if (dash == 0 || dash == std::string::npos || dash + 1 == mid.size()) return 0;
  const std::string pid = mid.substr(0, dash), seq = mid.substr(dash + 1);
  if (pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos ||
      seq.find_first_not_of("0123456789") != std::string::npos)
    return 0;
  return static_cast<pid_t>(std::stol(pid));
}

}  // namespace

std::string errno_text(int error) {
  const char* name = strerrorname_np(error);
  const char* desc = strerrordesc_np(error);
  return std::string(desc ? desc : "unknown error") + " (" +
         (name ? name : "errno " + std::to_string(error)) + ")";
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

void UniqueFd::reset() noexcept {
  if (fd_ >= 0 && ::close(fd_) != 0)
    std::fprintf(stderr, "rondo: warning: closing an offload file failed: %s\n",
                 errno_text(errno).c_str());
  fd_ = -1;
}

std::uint64_t disk_free_bytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return UINT64_MAX;
  return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

int remove_stale_offload_files(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;  // the caller reports a folder it cannot use when it creates a file
  int removed = 0;
  while (dirent* e = ::readdir(d)) {
    const pid_t pid = pid_of_offload_name(e->d_name);
    if (pid <= 0) continue;
    // ESRCH: no such process. A live pid (ours or another's, or a reused one) keeps its file;
    // removing a live process's file would be harmless anyway: it is unlinked once open.
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    const std::string path = dir + "/" + e->d_name;
    if (::unlink(path.c_str()) == 0)
      ++removed;
    else if (errno != ENOENT)
      std::fprintf(stderr, "rondo: warning: cannot remove the stale offload file %s: %s\n",
                   path.c_str(), errno_text(errno).c_str());
  }
  ::closedir(d);
  return removed;
}

OffloadFile create_offload_file(const std::string& dir, bool direct, FaultInjector* faults) {
  OffloadFile file;
  file.dir = dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw Error("cannot create the offload folder " + dir + ": " + ec.message() +
                "; set hardware.offload_dir to a writable folder on a local drive");
  file.stale_removed = remove_stale_offload_files(dir);

  auto refused_direct = [&] {
    direct = false;
    file.direct_note = "O_DIRECT refused by the filesystem of " + dir +
                       " (EINVAL): buffered I/O through the page cache instead, which costs host "
                       "memory and a copy";
  };
  // Note [Offload file without a name]: O_TMPFILE makes a file that never has a name, so no crash
  // can leave it behind; its space is freed when the last descriptor closes.
  const int base = O_RDWR | O_CLOEXEC;
  int fd = open_checked(dir, base | O_TMPFILE | (direct ? O_DIRECT : 0), faults);
  if (fd < 0 && errno == EINVAL && direct) {
    refused_direct();
    fd = open_checked(dir, base | O_TMPFILE, faults);
  }
  if (fd >= 0) {
    file.description = "the offload file in " + dir + " (unnamed: O_TMPFILE)";
    file.name_note = "an unnamed file (O_TMPFILE): nothing to remove after a crash";
  } else if (errno == EOPNOTSUPP || errno == EISDIR) {
    // No O_TMPFILE here: a named file, unlinked as soon as it is open.
    static std::atomic<std::uint64_t> seq{0};
    const std::string name =
        std::string(kPrefix) + std::to_string(::getpid()) + "-" + std::to_string(seq++) + kSuffix;
    const std::string path = dir + "/" + name;
    fd = open_checked(path, base | O_CREAT | O_EXCL | (direct ? O_DIRECT : 0), faults);
    if (fd < 0 && errno == EINVAL && direct) {
      // Some filesystems create the file before refusing O_DIRECT.
      if (::unlink(path.c_str()) != 0 && errno != ENOENT)
        throw Error("cannot remove " + path + ": " + errno_text(errno));
      refused_direct();
      fd = open_checked(path, base | O_CREAT | O_EXCL, faults);
    }
    if (fd >= 0) {
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
        const int e = errno;
        ::close(fd);
        throw Error("cannot unlink the offload file " + path +
                    " after creating it: " + errno_text(e) + "; check the permissions of " + dir +
                    " or choose another hardware.offload_dir");
      }
      file.description = "the offload file " + path + " (unlinked once open)";
      file.name_note = "the filesystem has no O_TMPFILE: created as " + name +
                       " and unlinked at once (a crash in between leaves it; the next start "
                       "removes it)";
    }
  }
  if (fd < 0)
    throw Error("cannot create the offload file in " + dir + ": " + errno_text(errno) +
                "; check that the folder is writable, or set hardware.offload_dir to a folder on "
                "a local drive");
  file.fd = UniqueFd(fd);
  file.direct = direct;
  return file;
}

Preallocation preallocate(const OffloadFile& file, std::uint64_t bytes, FaultInjector* faults) {
  Preallocation p;
  if (bytes == 0) {
    p.reserved = true;
    return p;
  }
  auto out_of_space = [&](std::uint64_t free) -> DiskOutOfSpace {
    return DiskOutOfSpace(
        "not enough free space for the offload file in " + file.dir + ": it needs " +
            format_bytes(bytes) +
            " for the training state that "
            "does not fit the host memory budget, and the drive has " +
            (free == UINT64_MAX ? std::string("an unknown amount") : format_bytes(free)) +
            " free. " + what_to_do_when_full() + ".",
        file.dir, bytes, free);
  };
  const std::uint64_t free = disk_free_bytes(file.dir);
  if (free != UINT64_MAX && bytes > free) throw out_of_space(free);

  int err = faults ? faults->on_call(FaultOp::kFallocate) : 0;
  if (err == 0) {
    int r;
    do {
      r = ::fallocate(file.fd.get(), 0, 0, static_cast<off_t>(bytes));
    } while (r != 0 && errno == EINTR);
    err = r == 0 ? 0 : errno;
  }
  if (err == 0) {
    p.reserved = true;
    return p;
  }
  if (err == ENOSPC || err == EDQUOT) throw out_of_space(disk_free_bytes(file.dir));
  if (err == EOPNOTSUPP || err == ENOSYS) {
    int r;
    do {
      r = ::ftruncate(file.fd.get(), static_cast<off_t>(bytes));
    } while (r != 0 && errno == EINTR);
    if (r != 0)
      throw Error("cannot size " + file.description + " to " + format_bytes(bytes) + ": " +
                  errno_text(errno) + ". " + what_to_do_when_full() + ".");
    p.note = "the filesystem of " + file.dir +
             " cannot preallocate (fallocate: " + errno_text(err) + "): the file is sparse; " +
             format_bytes(bytes) + " were checked free (" +
             (free == UINT64_MAX ? std::string("statvfs failed") : format_bytes(free) + " free") +
             ") but not reserved, so a drive that fills up later shows as ENOSPC at a write";
    return p;
  }
  throw Error("cannot preallocate " + format_bytes(bytes) + " for " + file.description + ": " +
              errno_text(err) + "; set hardware.offload_dir to a folder on a local drive");
}

}  // namespace rondo::offload
