// Enumeration must work on every machine: with no GPU, no driver, or a build without CUDA it
// returns no devices and says why, and never crashes.
#include <gtest/gtest.h>

#include "kernels/cuda/cuda_device.h"
#include "kernels/host_memory.h"

namespace rondo::kernels {
namespace {

TEST(CudaProbe, EitherListsDevicesOrSaysWhyNot) {
  CudaProbe probe = probe_cuda();
#ifdef RONDO_WITH_CUDA
  EXPECT_TRUE(probe.compiled);
#else
  EXPECT_FALSE(probe.compiled);
#endif
  if (probe.devices.empty()) {
    EXPECT_FALSE(probe.error.empty());
    EXPECT_FALSE(host_pinning_available());
    int x = 0;
    EXPECT_FALSE(pin_host_range(&x, sizeof x));
    EXPECT_THROW(open_cuda_device({.index = 0}), Error);
  } else {
    for (const DeviceInfo& d : probe.devices) {
      EXPECT_EQ(d.kind, DeviceKind::kCuda);
      EXPECT_FALSE(d.name.empty());
      EXPECT_GT(d.bytes_total, 0u);
    }
  }
  // Probing twice is harmless (no state left behind by a failed first call).
  EXPECT_EQ(probe_cuda().devices.size(), probe.devices.size());
}

}  // namespace
}  // namespace rondo::kernels
