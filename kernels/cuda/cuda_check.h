// RONDO_CUDA_CHECK: every CUDA runtime call in kernels/cuda/ goes through it, so a failure throws
// with the expression, file, line and device instead of being dropped. Internal to kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/error.h"

namespace rondo::kernels {

class CudaError : public Error {
 public:
  CudaError(cudaError_t code, const char* expr, const char* file, int line, int device)
      : Error(std::string("CUDA error ") + cudaGetErrorName(code) + " (" +
              cudaGetErrorString(code) + ") in " + expr + " at " + file + ":" +
              std::to_string(line) + (device >= 0 ? " on cuda:" + std::to_string(device) : "")),
        code(code) {}
  cudaError_t code;
};

inline void cuda_check(cudaError_t code, const char* expr, const char* file, int line, int device) {
  if (code != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
    throw CudaError(code, expr, file, line, device);
  }
}

}  // namespace rondo::kernels

#define RONDO_CUDA_CHECK(expr, device) \
  ::rondo::kernels::cuda_check((expr), #expr, __FILE__, __LINE__, (device))
