// Writing a GGUF file (version 3, little-endian; the layout is in gguf.h): metadata set by key,
// tensor infos declared up front, then each tensor's bytes produced in order while the file is
// written, so that a model larger than memory is written holding one tensor. The file is written
// under a temporary name, fsynced and renamed (mapped_file.h's DurableFile).
//
//   models::GgufWriter w;
//   w.set_string("general.architecture", "llama");
//   w.set_f32("adapter.lora.alpha", 32.0f);
//   w.add_tensor("blk.0.attn_q.weight.lora_a", {16, 576}, GgmlType::kF32);  // torch shape
//   w.write(path, [&](std::size_t i, const GgufSink& sink) { sink(data[i], bytes[i]); });
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "models/dequant.h"
#include "models/gguf.h"

namespace rondo::models {

using GgufSink = std::function<void(const void* data, std::size_t bytes)>;

class GgufWriter {
 public:
  // Metadata, in the order first set; setting a key again replaces its value in place.
  void set_string(const std::string& key, std::string_view value);
  void set_bool(const std::string& key, bool value);
  void set_u32(const std::string& key, std::uint32_t value);
  void set_i32(const std::string& key, std::int32_t value);
  void set_f32(const std::string& key, float value);
  void set_strings(const std::string& key, const std::vector<std::string>& values);
  void set_i32s(const std::string& key, const std::vector<std::int32_t>& values);
  void set_f32s(const std::string& key, const std::vector<float>& values);
  // A value read from another GGUF file, with its type (arrays and nested arrays included).
  void copy(const std::string& key, const GgufValue& value);
  void erase(const std::string& key);
  bool has(const std::string& key) const;

  // Declares the next tensor: `shape` in torch order (GGUF's ne reversed). Throws Error for a
  // name used twice or an innermost dimension that is not a whole number of the type's blocks.
  // Returns its bytes.
  std::uint64_t add_tensor(const std::string& name, const std::vector<std::int64_t>& shape,
                           GgmlType type);
  std::size_t tensor_count() const { return tensors_.size(); }

  // Writes the file: `produce(i, sink)` is called for each tensor in the order declared and must
  // pass exactly its bytes to `sink`. Alignment: `general.alignment` if set, else 32.
  void write(const std::string& path,
             const std::function<void(std::size_t, const GgufSink&)>& produce) const;

 private:
  void set(const std::string& key, GgufValueType type, std::string payload);

  struct Tensor {
    std::string name;
    std::vector<std::int64_t> ne;  // GGUF order
    GgmlType type;
    std::uint64_t bytes;
  };
  std::vector<std::pair<std::string, std::string>> metadata_;  // key, encoded type and value
  std::vector<Tensor> tensors_;
};

}  // namespace rondo::models
