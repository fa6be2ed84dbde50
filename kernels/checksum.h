// Checksums, in one place below offload/ and models/: XXH3-64 for the bytes Rondo writes and reads
// back (the NVMe store's blocks, a checkpoint's files and its state.json), and FNV-1a 64 for the
// one fingerprint stored before XXH3 was used (a checkpoint's data_fingerprint). Both must keep
// giving the same values across versions: they are compared with values older binaries wrote.
//
//   kernels::Xxh3 h;  h.update(p, n);  std::string hex = kernels::hex64(h.digest());
//   kernels::FileDigest d = kernels::file_xxh3("run/checkpoints/step-40/state.safetensors");
//   std::uint64_t f = kernels::fnv1a64(kernels::kFnv1a64Basis, p, n);
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace rondo::kernels {

// Streaming XXH3-64: the same value however the bytes are split into update() calls.
class Xxh3 {
 public:
  Xxh3();
  ~Xxh3();
  Xxh3(const Xxh3&) = delete;
  Xxh3& operator=(const Xxh3&) = delete;
  void update(const void* data, std::size_t bytes);
  std::uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

std::uint64_t xxh3(const void* data, std::size_t bytes);

// XXH3-64 of `count` segments read as one byte string (equal to xxh3 of their concatenation).
// Allocates nothing: the NVMe store calls it for every block on its I/O threads.
std::uint64_t xxh3_segments(const iovec* segments, int count);

// 16 lowercase hex digits.
std::string hex64(std::uint64_t v);

struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
};

// Reads the whole file once (in 4 MiB pieces). Throws Error naming the file and the failed call.
FileDigest file_xxh3(const std::string& path);

// FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3), continued from `h` over
// `bytes` bytes: fnv1a64(fnv1a64(kFnv1a64Basis, a, n), b, m) hashes a then b. Kept for the data
// fingerprint a checkpoint stores and a resume compares (engine/session.cpp): a different
// function would make every run an older binary started refuse to resume. Use XXH3 for anything
// new.
inline constexpr std::uint64_t kFnv1a64Basis = 0xcbf29ce484222325ull;
std::uint64_t fnv1a64(std::uint64_t h, const void* data, std::size_t bytes);

}  // namespace rondo::kernels
