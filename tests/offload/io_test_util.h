// Helpers shared by the offload I/O tests: scratch folders (on a real filesystem of the build tree,
// or on tmpfs), fresh random data, byte comparison with the first difference.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "offload/io_backend.h"
#include "offload/io_faults.h"

namespace rondo::offload::test {

// A fresh folder, removed with what is in it.
class Scratch {
 public:
  explicit Scratch(const std::string& root) {
    static std::atomic<int> n{0};
    path_ = root + "/nvme-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_))
      names.push_back(e.path().filename().string());
    return names;
  }

 private:
  std::string path_;
};

inline std::string disk_root() {
  return RONDO_TEST_SCRATCH_DIR;
}

// Where the I/O tests run: io_uring on a folder of the build tree's filesystem, and the
// thread-pool fallback on tmpfs (which refuses O_DIRECT).
struct Place {
  BackendKind kind;
  bool on_tmpfs;
  const char* label;
};
inline const Place kPlaces[] = {{BackendKind::kIoUring, false, "IoUringOnDisk"},
                                {BackendKind::kThreads, true, "ThreadsOnTmpfs"}};
// Why `p` cannot be tested on this machine; "" when it can.
inline std::string unavailable(const Place& p) {
  std::string why;
  if (p.kind == BackendKind::kIoUring && !io_uring_available(&why)) return why;
  if (p.on_tmpfs && !std::filesystem::is_directory("/dev/shm"))
    return "no /dev/shm (tmpfs) on this machine";
  return "";
}
// The folder a place's scratch folders go in.
inline std::string root_of(const Place& p) {
  return p.on_tmpfs ? "/dev/shm" : disk_root();
}

inline std::uint64_t fresh_seed() {
  return (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
}

inline void fill_random(void* data, std::uint64_t bytes, std::mt19937_64& rng) {
  auto* p = static_cast<unsigned char*>(data);
  std::uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < bytes; ++i)
    p[i] = static_cast<unsigned char>(rng());
}

// -1 when equal, else the first differing index (reported by the caller).
inline std::int64_t first_difference(const void* a, const void* b, std::uint64_t bytes) {
  auto* x = static_cast<const unsigned char*>(a);
  auto* y = static_cast<const unsigned char*>(b);
  for (std::uint64_t i = 0; i < bytes; ++i)
    if (x[i] != y[i]) return static_cast<std::int64_t>(i);
  return -1;
}

inline std::vector<FaultRule> rules(const std::string& text) {
  return parse_fault_rules(text, "test rules");
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A test run at each place (instantiate with testing::ValuesIn(kPlaces)): skipped where the place
// is unavailable, else a fresh scratch folder there and a fresh random seed.
class OnPlace : public testing::TestWithParam<Place> {
 protected:
  void SetUp() override {
    if (const std::string why = unavailable(GetParam()); !why.empty()) GTEST_SKIP() << why;
    scratch_ = std::make_unique<Scratch>(root_of(GetParam()));
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  std::unique_ptr<Scratch> scratch_;
  std::uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace rondo::offload::test
