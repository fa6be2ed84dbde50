// Tensors over memory the engine owns: layers are pure functions of (weight views, inputs), and
// the weights are at::Tensor views into host arena or device buffers (docs/architecture.md §10).
// A view never copies and never frees; the caller keeps the memory alive while the tensor is in
// use.
//
//   at::Tensor w = models::tensor_view(buf.data(), DType::kBF16, {C, C});
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "models/dtype.h"

namespace rondo::models {

at::ScalarType to_scalar_type(DType dtype);

// A contiguous view of `data` (host memory) with the given shape. Throws Error for a negative
// dimension.
at::Tensor tensor_view(void* data, DType dtype, const std::vector<std::int64_t>& shape);

// The libtorch version Rondo was built against, e.g. "2.15.0+cu130".
const char* torch_version();

}  // namespace rondo::models
