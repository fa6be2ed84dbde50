// The message of the rondo::Error a call throws, for tests of what a user is told.
#pragma once

#include <functional>
#include <string>

#include "kernels/error.h"

namespace rondo::test {

// The message of the Error `run` throws; "" when it returns.
inline std::string error_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace rondo::test
