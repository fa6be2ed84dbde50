// Element types of stored tensors, with the names safetensors uses, and shapes written out for
// error messages. The engine sizes buffers with dtype_size(); models map them to torch with
// tensor_view.h. Quantised GGUF types join later.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace rondo::models {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

std::size_t dtype_size(DType dtype);
const char* to_string(DType dtype);  // "F32", "BF16", ... as in safetensors headers
std::optional<DType> dtype_from_string(std::string_view name);

// A shape for error messages: "[2, 3]" ("[]" for a scalar).
std::string shape_text(const std::vector<std::int64_t>& shape);

}  // namespace rondo::models
