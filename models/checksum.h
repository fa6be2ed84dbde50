// XXH3-64 checksums of byte strings and files, for the files a checkpoint records (state.json
// holds each file's size and checksum; a resume verifies them before it trusts the folder).
//
//   models::Xxh3 h;  h.update(p, n);  std::string hex = models::hex64(h.digest());
//   models::FileDigest d = models::file_xxh3("run/checkpoints/step-40/state.safetensors");
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace rondo::models {

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

// 16 lowercase hex digits.
std::string hex64(std::uint64_t v);

struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint64_t xxh3 = 0;
};

// Reads the whole file once (in 4 MiB pieces). Throws Error naming the file and the failed call.
FileDigest file_xxh3(const std::string& path);

}  // namespace rondo::models
