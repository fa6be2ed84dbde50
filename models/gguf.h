// A GGUF file (llama.cpp's checkpoint format, versions 2 and 3): metadata, tensor infos and the
// data section, read through a MappedFile. The input is untrusted: the constructor checks every
// count, length, offset and shape against the file size before use, so that afterwards every
// tensor's bytes lie inside the file, tensors do not overlap, names and keys are unique and types
// are known. Used by gguf_model.h (GGUF -> Hugging Face names) and the tokenizer.
//
//   models::GgufFile f("model.gguf");
//   std::string arch = f.get_string("general.architecture");
//   at::Tensor w = models::load_tensor(f, "blk.0.attn_q.weight", DType::kBF16);  // HF layout
//
// Layout: "GGUF", u32 version, u64 tensor count, u64 metadata count, metadata (key string, u32
// value type, value), tensor infos (name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset),
// padding to `general.alignment` (default 32), the data section. Strings are u64 length + bytes.
// ne[0] is the innermost dimension: a torch shape is ne reversed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "models/dequant.h"
#include "models/dtype.h"
#include "models/mapped_file.h"

namespace rondo::models {

enum class GgufValueType : std::uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* to_string(GgufValueType type);  // "UINT8", ..., as gguf-py names them
// Bytes of one fixed-size value; 0 for strings and arrays.
std::uint64_t gguf_value_size(GgufValueType type);

// One metadata value. Strings and the elements of arrays point into the mapped file: a value
// lives as long as its GgufFile.
class GgufValue {
 public:
  GgufValueType type() const { return type_; }
  bool is_integer() const;  // any of the eight integer types

  // nullopt when the type does not fit: to_int takes any integer that fits int64, to_uint any
  // non-negative integer, to_float F32/F64 (exact) and integers.
  std::optional<std::int64_t> to_int() const;
  std::optional<std::uint64_t> to_uint() const;
  std::optional<double> to_float() const;
  std::optional<bool> to_bool() const;
  std::optional<std::string_view> to_string() const;

  // Arrays: element type and count; at(i) decodes element i (nested arrays included).
  GgufValueType element_type() const { return element_type_; }
  std::uint64_t size() const { return count_; }
  GgufValue at(std::uint64_t i) const;

 private:
  friend class GgufParser;
  GgufValueType type_ = GgufValueType::kU8;
  std::uint64_t bits_ = 0;  // scalars: the little-endian payload, zero-extended
  std::string_view string_;
  // Arrays: fixed-size elements are decoded from raw_ on demand; strings and nested arrays are
  // parsed up front (their positions depend on every length before them).
  GgufValueType element_type_ = GgufValueType::kU8;
  std::uint64_t count_ = 0;
  const std::uint8_t* raw_ = nullptr;
  std::vector<std::string_view> strings_;
  std::vector<GgufValue> arrays_;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> ne;  // GGUF order: ne[0] is the innermost (contiguous) dimension
  GgmlType type = GgmlType::kF32;
  std::uint64_t offset = 0;  // from the start of the data section
  std::uint64_t n_elements = 0;
  std::uint64_t n_bytes = 0;

  std::vector<std::int64_t> shape() const;  // torch / Hugging Face order: ne reversed
};

class GgufFile {
 public:
  // Throws Error naming the file and the key or tensor at fault.
  explicit GgufFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  std::uint64_t data_offset() const { return data_offset_; }  // from the start of the file
  std::uint64_t file_size() const { return file_.size(); }

  // Metadata, in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  const GgufValue* find(std::string_view key) const;  // nullptr when absent
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Typed accessors: throw Error naming the file and key when the key is missing (the forms
  // without a fallback) or holds another type.
  std::string get_string(std::string_view key) const;
  std::string get_string(std::string_view key, const std::string& fallback) const;
  std::int64_t get_int(std::string_view key) const;
  std::int64_t get_int(std::string_view key, std::int64_t fallback) const;
  double get_float(std::string_view key) const;
  double get_float(std::string_view key, double fallback) const;
  bool get_bool(std::string_view key) const;
  bool get_bool(std::string_view key, bool fallback) const;
  std::vector<std::string> get_strings(std::string_view key) const;
  std::vector<std::int64_t> get_ints(std::string_view key) const;
  std::vector<double> get_floats(std::string_view key) const;

  // Tensor infos, in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;  // nullptr when absent
  const GgufTensorInfo& tensor(std::string_view name) const;       // throws Error when absent
  // The tensor's bytes (n_bytes of them), inside the mapped file.
  const std::uint8_t* tensor_data(const GgufTensorInfo& info) const;

 private:
  friend class GgufParser;
  const GgufValue& require(std::string_view key) const;
  [[noreturn]] void wrong_type(std::string_view key, const GgufValue& v, const char* want) const;

  MappedFile file_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::unordered_map<std::string, std::size_t> metadata_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, std::size_t> tensor_index_;
};

// The tensor dequantised into a new contiguous tensor of `target` dtype (F32 or BF16) in torch
// layout (GGUF ne reversed). Throws Error naming the file and tensor for an unknown name, a type
// Rondo cannot dequantise or another target. `index` >= 0: only that slice of the first torch
// dimension (one expert of a GGUF MoE tensor), without dequantising the rest.
at::Tensor load_tensor(const GgufFile& file, std::string_view name, DType target,
                       std::int64_t index = -1);

}  // namespace rondo::models
