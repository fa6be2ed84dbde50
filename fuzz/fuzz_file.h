// For harnesses whose reader takes a path (they map or stream the file): the input written to a
// file of this process's own under /dev/shm (or TMPDIR), rewritten for each input.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace rondo::fuzz {

inline const std::string& input_path(const char* suffix) {
  static const std::string path = [&] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir && *dir ? dir : "/dev/shm") + "/rondo-fuzz-" +
           std::to_string(::getpid()) + suffix;
  }();
  return path;
}

inline const std::string& write_input(const std::uint8_t* data, std::size_t size,
                                      const char* suffix) {
  const std::string& path = input_path(suffix);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size != 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace rondo::fuzz
