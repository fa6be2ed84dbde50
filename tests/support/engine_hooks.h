// The engine's test and benchmark seams (engine::EngineProbe) for tests and benchmarks: a hook on
// each step's gradients, and cost emulation — each microbatch's compute lasts at least what
// per-layer costs give (seconds per token on a device of speed 1, divided by the device's speed),
// so that simulated devices sharing a few CPU cores behave like separate GPUs. Lives here, not in
// the engine, so that the engine library never sleeps for a benchmark.
//
//   test::EngineHooks hooks;
//   hooks.costs = plan_inputs.layers;        // one per layer; empty = no emulation
//   hooks.on_gradients = [&](std::int64_t step) { ... };
//   options.probe = &hooks;
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/engine.h"
#include "engine/plan.h"

namespace rondo::test {

class EngineHooks : public engine::EngineProbe {
 public:
  std::function<void(std::int64_t step)> on_gradients;  // optimizer thread, before the update
  std::vector<engine::LayerCosts> costs;                 // per layer; empty = no emulation
  std::vector<double> speeds;                            // per device; empty = all 1

  void gradients_in(std::int64_t step) override;
  // Sleeps for what the costs of `layers` give `tokens` on `device`, less the `seconds` it took.
  void computed(int device, engine::LayerRange layers, bool forward_only, std::int64_t tokens,
                double seconds) override;
};

}  // namespace rondo::test
