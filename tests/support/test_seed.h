// The random seed of a test run: RONDO_TEST_SEED repeats one; otherwise a fresh one per run,
// printed by each test that draws from it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <random>
#include <string>

namespace rondo::test {

inline std::uint64_t test_seed() {
  static const std::uint64_t seed = []() -> std::uint64_t {
    if (const char* s = std::getenv("RONDO_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    std::random_device device;
    return (std::uint64_t{device()} << 32) ^ device();
  }();
  return seed;
}

// A generator per test, derived from the run's seed and the test's name.
inline std::mt19937_64 rng_for_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  std::cout << "seed " << test_seed() << " (RONDO_TEST_SEED=" << test_seed() << " repeats it)\n";
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

}  // namespace rondo::test
