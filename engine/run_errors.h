// Errors in a run's words (engine/session.cpp): an engine error with the config settings that
// change it, an NVMe or write error with what the run was doing and what is safe, rows longer
// than the model's positions with the rope scaling that would stretch them.
//
//   auto results = with_settings_advice([&] { return eng.train(n, batches); });
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include "kernels/error.h"
#include "models/inspect.h"
#include "offload/nvme_store.h"

namespace rondo::engine {

// Rethrows an engine error in a run's words: a DeviceMemoryError or NondeterministicOpError (which
// say what ran out or could not run exactly, in the engine's terms) with the config settings that
// change it; any other error as it is.
[[noreturn]] void rethrow_with_settings(std::exception_ptr error);

// Runs `body` (engine work), its errors in the run's words (rethrow_with_settings).
template <typename F>
auto with_settings_advice(F&& body) {
  try {
    return body();
  } catch (...) {
    rethrow_with_settings(std::current_exception());
  }
}

// Runs `body`; an NVMe tier error from it (whose message names the file, the region and what to
// do, but not what the run was doing) gets `doing` in front and `then` after it.
template <typename F>
auto naming_io_errors(const std::string& doing, F&& body, const std::string& then = "") {
  try {
    return body();
  } catch (const offload::IoError& e) {
    throw Error(doing + ": " + e.what() + then);
  }
}

// Runs `body`, which writes a checkpoint or an export; any error from it (a full disk, an NVMe
// tier fault) gets `doing` in front and `then` after it: what is safe, and the command that
// continues once the cause is gone.
template <typename F>
auto naming_write_errors(const std::string& doing, F&& body, const std::string& then) {
  try {
    return body();
  } catch (const Error& e) {
    throw Error(doing + ": " + e.what() + then);
  }
}

// data.seq_len longer than the model's `positions`: what to add to its config.json for them (the
// rope scaling its family is extended with), or for a GGUF file, that its metadata holds it.
std::string positions_error(std::int64_t seq_len, const std::string& path,
                            const models::ModelSummary& model, std::int64_t positions);

}  // namespace rondo::engine
