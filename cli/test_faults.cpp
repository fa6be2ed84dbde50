#include "cli/test_faults.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels/error.h"

namespace rondo::cli {
namespace {

// A step number, or -1 when the variable is unset or empty.
std::int64_t step_from_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  const std::string text = v;
  if (text.find_first_not_of("0123456789") != std::string::npos || text.size() > 18)
    throw Error(std::string(name) + "='" + text + "' is not a step number (0, 1, 2, ...)");
  return std::stoll(text);
}

}  // namespace

TestFaults test_faults_from_env() {
  TestFaults f;
  if (const char* io = std::getenv("RONDO_FAULT_IO"))
    f.io = offload::parse_fault_rules(io, "RONDO_FAULT_IO");
  f.kill_after_step = step_from_env("RONDO_FAULT_KILL_AFTER_STEP");
  f.kill_in_checkpoint = step_from_env("RONDO_FAULT_KILL_IN_CHECKPOINT");
  return f;
}

std::function<void(engine::FaultPoint, std::int64_t)> TestFaults::kill_hook() const {
  if (kill_after_step < 0 && kill_in_checkpoint < 0) return {};
  return [after = kill_after_step, in_checkpoint = kill_in_checkpoint](engine::FaultPoint point,
                                                                       std::int64_t step) {
    const std::int64_t at = point == engine::FaultPoint::kAfterStep ? after : in_checkpoint;
    if (step != at) return;
    std::fflush(nullptr);  // what was printed so far is what a crash there leaves
    ::raise(SIGKILL);
  };
}

}  // namespace rondo::cli
