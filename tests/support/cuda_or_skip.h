// For the torch-using `cuda` tests: skip where this machine has no GPU, and fail — never skip —
// where the driver sees a GPU but torch does not (libtorch_cuda not linked or not loaded, a
// runtime that does not match the driver): such a test would otherwise pass without running.
//
//   TEST(EngineCuda, X) { RONDO_CUDA_OR_SKIP(); ... }
#pragma once

#include <ATen/Context.h>
#include <gtest/gtest.h>

#include "kernels/cuda/cuda_device.h"

#define RONDO_CUDA_OR_SKIP()                                                                  \
  do {                                                                                        \
    if (!at::hasCUDA()) {                                                                     \
      const ::rondo::kernels::CudaProbe probe = ::rondo::kernels::probe_cuda();               \
      if (!probe.devices.empty())                                                             \
        FAIL() << "the CUDA driver sees " << probe.devices.size()                             \
               << " GPU(s) but torch sees none: libtorch_cuda is not loaded (check that the " \
                  "binary needs libtorch_cuda.so) or its runtime does not match the driver";  \
      GTEST_SKIP() << "no CUDA device: " << probe.error;                                      \
    }                                                                                         \
  } while (0)
