#include "models/checksum.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

// Header-only XXH3, compiled with our flags (as offload/nvme_store.cpp does).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kernels/error.h"

namespace rondo::models {

struct Xxh3::State {
  XXH3_state_t s;
};

Xxh3::Xxh3() : state_(std::make_unique<State>()) {
  XXH3_64bits_reset(&state_->s);
}
Xxh3::~Xxh3() = default;

void Xxh3::update(const void* data, std::size_t bytes) {
  XXH3_64bits_update(&state_->s, data, bytes);
}

std::uint64_t Xxh3::digest() const {
  return XXH3_64bits_digest(&state_->s);
}

std::uint64_t xxh3(const void* data, std::size_t bytes) {
  return XXH3_64bits(data, bytes);
}

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

FileDigest file_xxh3(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
  Xxh3 h;
  FileDigest out;
  std::vector<char> buf(4u << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw Error("cannot read " + path + ": " + std::strerror(err));
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<std::size_t>(n));
    out.bytes += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  out.xxh3 = h.digest();
  return out;
}

}  // namespace rondo::models
