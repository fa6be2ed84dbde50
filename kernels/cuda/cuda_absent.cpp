// Built instead of cuda_device.cpp when Rondo is compiled without CUDA.
#include "kernels/cuda/cuda_device.h"
#include "kernels/host_memory.h"

namespace rondo::kernels {

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.compiled = false;
  probe.error =
      "this build of Rondo has no CUDA support (configured with RONDO_CUDA=OFF or "
      "without nvcc)";
  return probe;
}

std::unique_ptr<Device> open_cuda_device(const CudaDeviceOptions& options) {
  throw Error("cannot open cuda:" + std::to_string(options.index) +
              ": this build of Rondo has no CUDA support; rebuild with the CUDA toolkit installed");
}

bool host_pinning_available() {
  return false;
}
bool pin_host_range(void*, std::size_t) noexcept {
  return false;
}
void unpin_host_range(void*) noexcept {}

}  // namespace rondo::kernels
