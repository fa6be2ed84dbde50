#include "models/tensor_view.h"

#include <ATen/ATen.h>

#include "kernels/error.h"

namespace rondo::models {

at::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return at::kDouble;
    case DType::kF32:
      return at::kFloat;
    case DType::kF16:
      return at::kHalf;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kI64:
      return at::kLong;
    case DType::kI32:
      return at::kInt;
    case DType::kI16:
      return at::kShort;
    case DType::kI8:
      return at::kChar;
    case DType::kU8:
      return at::kByte;
    case DType::kBool:
      return at::kBool;
  }
  RONDO_ASSERT_MSG(false, "unknown dtype");
}

at::Tensor tensor_view(void* data, DType dtype, const std::vector<std::int64_t>& shape) {
  for (std::int64_t d : shape)
    if (d < 0) throw Error("tensor view with a negative dimension (" + std::to_string(d) + ")");
  return at::from_blob(data, shape, at::TensorOptions().dtype(to_scalar_type(dtype)));
}

const char* torch_version() {
  return RONDO_TORCH_VERSION;
}

}  // namespace rondo::models
