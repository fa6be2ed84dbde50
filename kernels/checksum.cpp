#include "kernels/checksum.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

// Header-only XXH3, so that it is compiled with our -march (AVX2) instead of the library's
// baseline SSE2: the NVMe store's I/O threads verify every block read at memory speed.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kernels/error.h"

namespace rondo::kernels {

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

std::uint64_t xxh3_segments(const iovec* segments, int count) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (int i = 0; i < count; ++i)
    XXH3_64bits_update(&state, segments[i].iov_base, segments[i].iov_len);
  return XXH3_64bits_digest(&state);
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

std::uint64_t fnv1a64(std::uint64_t h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace rondo::kernels
