// Launches the CUDA dequantisation kernels (dequant.cu) behind CudaStream::dequantize. Internal to
// kernels/cuda/. The caller has checked the arguments (check_dequantize in kernels/quant.h) and
// made the device current; the return value is the launch's error, for RONDO_CUDA_CHECK.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quant.h"

namespace rondo::kernels {

cudaError_t launch_dequantize(const QuantFormat& format, const void* src, std::int64_t rows,
                              std::int64_t cols, FloatDType out, void* dst, cudaStream_t stream);

}  // namespace rondo::kernels
