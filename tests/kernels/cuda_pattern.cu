// A test kernel: writes byte i = (i * 7 + seed) & 0xFF, so a test can tell that it ran, in stream
// order, between two copies.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace {
__global__ void pattern_kernel(std::uint8_t* data, std::size_t n, std::uint8_t seed) {
  std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] = static_cast<std::uint8_t>(i * 7 + seed);
}
}  // namespace

cudaError_t launch_pattern(void* data, std::size_t n, std::uint8_t seed, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  unsigned blocks = static_cast<unsigned>((n + 255) / 256);
  pattern_kernel<<<blocks, 256, 0, stream>>>(static_cast<std::uint8_t*>(data), n, seed);
  return cudaGetLastError();
}
