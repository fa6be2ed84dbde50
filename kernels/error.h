// Errors shared by every library: rondo::Error for input a user can fix, RONDO_ASSERT for bugs.
// Error messages say what went wrong, where (file, line, tensor, field) and what to do.
// Used everywhere; lives on the lowest floor so that every library can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace rondo {

// Bad input or configuration: the message is for the user.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A broken internal invariant (a bug in Rondo, not in the input).
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);

// "1.50 GiB", "22 B": binary units, as memory is sized.
std::string format_bytes(std::uint64_t bytes);

// "head:\n  - p1\n  - p2" — how every validate() reports all its problems at once.
std::string join_problems(const std::string& head, const std::vector<std::string>& problems);

// Parses "24GB", "24 GiB", "512M", "4096": K/M/G/T (with or without B or iB) are binary
// multiples (1 GB = 2^30 bytes, so "24GB" is an RTX 4090's 24 GiB). Throws Error naming `what`.
std::uint64_t parse_bytes(const std::string& text, const std::string& what = "size");

}  // namespace rondo

// On in release builds too: a failed invariant must never turn into silent wrong numbers.
#define RONDO_ASSERT(cond)                                                       \
  do {                                                                           \
    if (!(cond)) ::rondo::assert_fail(#cond, __FILE__, __LINE__, std::string()); \
  } while (0)
#define RONDO_ASSERT_MSG(cond, msg)                                      \
  do {                                                                   \
    if (!(cond)) ::rondo::assert_fail(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)
