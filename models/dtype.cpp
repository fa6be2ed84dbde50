#include "models/dtype.h"

#include <array>
#include <utility>

namespace rondo::models {
namespace {
struct Entry {
  DType dtype;
  const char* name;
  std::size_t size;
};
constexpr std::array<Entry, 10> kTable{{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};
const Entry& entry(DType dtype) {
  return kTable[static_cast<std::size_t>(dtype)];
}
}  // namespace

std::size_t dtype_size(DType dtype) {
  return entry(dtype).size;
}
const char* to_string(DType dtype) {
  return entry(dtype).name;
}

std::optional<DType> dtype_from_string(std::string_view name) {
  for (const Entry& e : kTable)
    if (name == e.name) return e.dtype;
  return std::nullopt;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace rondo::models
