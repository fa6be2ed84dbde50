#include "engine/run_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "kernels/error.h"

namespace rondo::engine {
namespace {

namespace fs = std::filesystem;

// The PID a "<name>.tmp.<pid>" temporary was written by; 0 for any other name.
pid_t writer_of(const std::string& name) {
  const std::size_t at = name.rfind(".tmp.");
  if (at == std::string::npos) return 0;
  const std::string_view digits = std::string_view(name).substr(at + 5);
  long pid = 0;
  auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
  if (err != std::errc() || end != digits.data() + digits.size() || pid <= 0) return 0;
  return static_cast<pid_t>(pid);
}

// The folders exports write into a run folder (train_config.h's export formats, `rondo export`).
bool is_export_folder(const std::string& name) {
  return name == "adapter" || name == "merged" || name == "gguf" || name == "gguf-adapter" ||
         name.starts_with("export-");
}

bool alive(pid_t pid) {
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

// "process N (rondo train)" from what the holder wrote into the lock file. The holder writes it
// right after it locks: a process that lost the race by an instant waits up to half a second for
// it; "" when it did not come.
std::string holder_of(int fd) {
  std::string holder;
  for (int tries = 0; tries < 50; ++tries) {
    char buf[256];
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    holder.assign(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
    if (holder.ends_with('\n')) break;  // written whole
    ::usleep(10'000);
  }
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' '))
    holder.pop_back();
  if (holder.empty()) return "";
  const std::size_t space = holder.find(' ');
  return "process " + holder.substr(0, space) +
         (space == std::string::npos ? "" : " (" + holder.substr(space + 1) + ")");
}

}  // namespace

RunLock::RunLock(const std::string& run_dir, const std::string& what, bool reader) : dir_(run_dir) {
  const std::string path = (fs::path(run_dir) / kFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0 && reader && (errno == EROFS || errno == EACCES || errno == EPERM)) {
    read_only_ = true;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);  // flock needs no write access
    if (fd_ < 0 && errno == ENOENT) return;            // never written by Rondo: nobody to wait for
  }
  if (fd_ < 0) throw Error("cannot open the run's lock file " + path + ": " + std::strerror(errno));
  int rc;
  do {
    // A reader's descriptor is read-only: a shared lock (an exclusive one needs write access on
    // NFS), which a writer's exclusive lock still excludes.
    rc = ::flock(fd_, (read_only_ ? LOCK_SH : LOCK_EX) | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    // The holder writes "<pid> <what>" right after it locks.
    const std::string who = err == EWOULDBLOCK ? holder_of(fd_) : "";
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw Error("cannot lock the run folder " + run_dir + " (" + path +
                  "): " + std::strerror(err));
    throw Error(run_dir + " is in use by " +
                (who.empty() ? "another process (it holds " + path +
                                   " but its PID, written there once it locks, could not be read)"
                             : who) +
                ": one process at a time trains or exports a run; wait for it to end, or stop it "
                "(Ctrl-C in its terminal) and run this again");
  }
  if (read_only_) return;  // locked; the holder's note cannot be written
  const std::string text = std::to_string(::getpid()) + " " + what + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) < 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw Error("cannot write the run's lock file " + path + ": " + std::strerror(err));
  }
}

std::string RunLock::holder(const std::string& run_dir) {
  const std::string path = (fs::path(run_dir) / kFile).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";  // never locked (or unreadable: nothing to say)
  int rc;
  do {
    rc = ::flock(fd, LOCK_SH | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  std::string who;
  if (rc != 0 && errno == EWOULDBLOCK) {
    who = holder_of(fd);
    if (who.empty()) who = "another process";
  }
  ::close(fd);  // releases the shared lock at once
  return who;
}

RunLock::~RunLock() {
  if (fd_ < 0) return;
  if (read_only_) {
    ::close(fd_);
    return;
  }
  // Emptied, not removed: removing it would let a process that opened the old file lock a file no
  // longer in the folder while a third locks a new one.
  if (::ftruncate(fd_, 0) != 0) {
    // Nothing to do: the lock itself goes with the descriptor.
  }
  ::close(fd_);
}

std::vector<std::string> RunLock::foreign_entries(const std::string& run_dir) {
  std::vector<std::string> foreign;
  std::error_code ec;
  for (fs::directory_iterator it(run_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code ignored;
    const bool dir = it->is_directory(ignored) && !it->is_symlink(ignored);
    const bool ours = name == kFile || name == "config.toml" || name == "config.toml.tmp" ||
                      name == "events.jsonl" ||
                      (dir && (name == "checkpoints" || name == "ranks" || is_export_folder(name)));
    if (!ours) foreign.push_back(name);
  }
  std::sort(foreign.begin(), foreign.end());
  return foreign;
}

std::string RunLock::list_some(const std::vector<std::string>& names) {
  std::string out;
  const std::size_t shown = std::min<std::size_t>(names.size(), 3);
  for (std::size_t i = 0; i < shown; ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

std::vector<std::string> RunLock::remove_stale_temporaries() const {
  std::vector<std::string> removed;
  if (read_only_) return removed;
  // Only names Rondo writes: config.toml.tmp in the run folder, and the temporaries of exports in
  // the export folders (a run folder could be any folder: nothing else in it is ours to remove).
  auto sweep = [&](const fs::path& folder, bool run_folder) {
    std::error_code ec;
    for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const pid_t pid = writer_of(name);
      const bool stale =
          run_folder ? name == "config.toml.tmp"
                     : (pid != 0 && pid != ::getpid() && !alive(pid)) || name.ends_with(".tmp");
      std::error_code ignored;
      if (stale && it->is_regular_file(ignored) && fs::remove(it->path(), ignored))
        removed.push_back(it->path().string());
    }
  };
  sweep(dir_, true);
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code ignored;
    const std::string name = it->path().filename().string();
    if (is_export_folder(name) && it->is_directory(ignored) && !it->is_symlink(ignored))
      sweep(it->path(), false);
  }
  return removed;
}

}  // namespace rondo::engine
