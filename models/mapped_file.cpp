#include "models/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "kernels/error.h"

namespace rondo::models {

void release_mapped_pages(const void* data, std::size_t bytes) noexcept {
  static const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t first = (begin + page - 1) / page * page;
  const std::uintptr_t last = (begin + bytes) / page * page;
  // Only whole pages inside the range: a neighbouring tensor may share the edge pages.
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

DurableFile::DurableFile(std::string path, std::string tmp_suffix)
    : path_(std::move(path)),
      tmp_(path_ + (tmp_suffix.empty() ? ".tmp." + std::to_string(::getpid()) : tmp_suffix)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error("cannot create " + tmp_ + ": " + std::strerror(errno));
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void DurableFile::write(const void* data, std::size_t bytes) {
  RONDO_ASSERT(fd_ >= 0);
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error("cannot write " + tmp_ + ": " + std::strerror(errno));
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

void DurableFile::commit() {
  RONDO_ASSERT(fd_ >= 0);
  if (::fsync(fd_) != 0) throw Error("cannot write " + tmp_ + ": fsync: " + std::strerror(errno));
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) throw Error("cannot write " + tmp_ + ": close: " + std::strerror(errno));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw Error("cannot rename " + tmp_ + " to " + path_ + ": " + std::strerror(errno));
  tmp_.clear();  // nothing left to remove
  // Make the rename itself durable.
  const std::size_t slash = path_.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path_.substr(0, slash);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::fsync(dfd) != 0) {
    const int e = errno;
    if (dfd >= 0) ::close(dfd);
    throw Error("cannot sync the folder " + dir + ": " + std::strerror(e));
  }
  ::close(dfd);
}

void write_file_durably(const std::string& path, const std::string& text) {
  DurableFile f(path, ".tmp");
  f.write(text.data(), text.size());
  f.commit();
}

std::string read_text_file(const std::string& path, const std::string& what, std::uint64_t limit) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot read " + path + " (" + what + "): " + std::strerror(errno));
  std::string text;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0)
      throw Error("cannot read " + path + " (" + what + "): " + std::strerror(errno));
    // A pipe (`rondo train <(...)`) is read up to the limit like a file; a folder or a device
    // (/dev/zero, a terminal) is not one.
    if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
      throw Error(path + " is " + (S_ISDIR(st.st_mode) ? "a folder" : "not a regular file") + " (" +
                  what + "): give the path of the file itself");
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error("error reading " + path + " (" + what + "): " + std::strerror(errno));
      if (n == 0) break;
      text.append(buf, static_cast<std::size_t>(n));
      if (text.size() > limit)
        throw Error(path + " (" + what + ") is larger than " + format_bytes(limit) +
                    ", the most Rondo reads of such a file: is it the right file?");
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw Error("cannot stat " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + " is not a regular file");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw Error("cannot map " + path + ": " + std::strerror(err));
    }
    data_ = static_cast<const std::uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

const std::uint8_t* MappedFile::bytes(std::uint64_t offset, std::uint64_t length,
                                      const std::string& what) const {
  if (!contains(offset, length))
    throw Error(path_ + ": " + what + " lies outside the file (bytes " + std::to_string(offset) +
                ".." + std::to_string(offset + length) + " of a " + std::to_string(size_) +
                "-byte file); the file is truncated or corrupt");
  return data_ + offset;
}

}  // namespace rondo::models
