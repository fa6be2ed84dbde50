// The fault-injection variables of `rondo`, read here and nowhere else: the libraries take faults
// as options (engine::SessionOptions::io_faults and on_fault_point, offload::measure_disk's
// faults) and read no test variable, and the kill happens here, not in the engine. The CLI tests
// (tests/cli) set the variables on the binary; docs/offload.md ("Fault injection") and
// docs/training.md ("Test hooks") describe them.
//
//   const cli::TestFaults faults = cli::test_faults_from_env();
//   session_options.io_faults = faults.io;
//   session_options.on_fault_point = faults.kill_hook();
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/session.h"
#include "offload/io_faults.h"

namespace rondo::cli {

struct TestFaults {
  std::vector<offload::FaultRule> io;    // RONDO_FAULT_IO: the NVMe tier's and --disk's I/O
  std::int64_t kill_after_step = -1;     // RONDO_FAULT_KILL_AFTER_STEP: after step N's event
  std::int64_t kill_in_checkpoint = -1;  // RONDO_FAULT_KILL_IN_CHECKPOINT: in step N's checkpoint
                                         // write (files complete, not yet renamed); -1 = never

  // For SessionOptions::on_fault_point: SIGKILLs this process (stdio flushed first) at the step
  // chosen for that point; empty when no kill is asked for.
  std::function<void(engine::FaultPoint, std::int64_t step)> kill_hook() const;
};

// The variables as they are now; unset or empty ones inject nothing. Throws Error naming the
// variable and the bad value (a rule, a step that is not a count).
TestFaults test_faults_from_env();

}  // namespace rondo::cli
