#include "tests/support/engine_hooks.h"

#include <chrono>
#include <thread>

#include "kernels/error.h"

namespace rondo::test {

void EngineHooks::gradients_in(std::int64_t step) {
  if (on_gradients) on_gradients(step);
}

void EngineHooks::computed(int device, engine::LayerRange layers, bool forward_only,
                           std::int64_t tokens, double seconds) {
  if (costs.empty()) return;
  double s = 0;
  for (int l = layers.begin; l < layers.end; ++l) {
    RONDO_ASSERT(l >= 0 && static_cast<std::size_t>(l) < costs.size());
    const engine::LayerCosts& c = costs[static_cast<std::size_t>(l)];
    s += forward_only ? c.forward_s_per_token : c.forward_s_per_token + c.backward_s_per_token;
  }
  const double speed = speeds.empty() ? 1.0 : speeds.at(static_cast<std::size_t>(device));
  const double emulate = s * static_cast<double>(tokens) / speed;
  if (emulate > seconds) std::this_thread::sleep_for(std::chrono::duration<double>(emulate - seconds));
}

}  // namespace rondo::test
