#include "models/gguf_writer.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "kernels/error.h"
#include "models/mapped_file.h"

namespace rondo::models {
namespace {

template <typename T>
void put(std::string& out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, std::string_view s) {
  put<std::uint64_t>(out, s.size());
  out.append(s);
}

// A value's payload (without its type), re-encoded from what the reader decoded.
void put_value(std::string& out, const GgufValue& v) {
  const GgufValueType t = v.type();
  if (t == GgufValueType::kString) return put_string(out, *v.to_string());
  if (t == GgufValueType::kArray) {
    put<std::uint32_t>(out, static_cast<std::uint32_t>(v.element_type()));
    put<std::uint64_t>(out, v.size());
    for (std::uint64_t i = 0; i < v.size(); ++i)
      put_value(out, v.at(i));
    return;
  }
  if (t == GgufValueType::kF32) return put<float>(out, static_cast<float>(*v.to_float()));
  if (t == GgufValueType::kF64) return put<double>(out, *v.to_float());
  if (t == GgufValueType::kBool) return put<std::uint8_t>(out, *v.to_bool() ? 1 : 0);
  // Integers: the two's-complement payload, low bytes first, of the value's own width.
  const std::uint64_t bits = v.to_int() ? static_cast<std::uint64_t>(*v.to_int()) : *v.to_uint();
  char bytes[8];
  std::memcpy(bytes, &bits, 8);
  out.append(bytes, gguf_value_size(t));
}

}  // namespace

void GgufWriter::set(const std::string& key, GgufValueType type, std::string payload) {
  std::string encoded;
  put<std::uint32_t>(encoded, static_cast<std::uint32_t>(type));
  encoded += payload;
  for (auto& [k, v] : metadata_)
    if (k == key) {
      v = std::move(encoded);
      return;
    }
  metadata_.emplace_back(key, std::move(encoded));
}

void GgufWriter::set_string(const std::string& key, std::string_view value) {
  std::string p;
  put_string(p, value);
  set(key, GgufValueType::kString, std::move(p));
}

void GgufWriter::set_bool(const std::string& key, bool value) {
  set(key, GgufValueType::kBool, std::string(1, value ? '\1' : '\0'));
}

void GgufWriter::set_u32(const std::string& key, std::uint32_t value) {
  std::string p;
  put(p, value);
  set(key, GgufValueType::kU32, std::move(p));
}

void GgufWriter::set_i32(const std::string& key, std::int32_t value) {
  std::string p;
  put(p, value);
  set(key, GgufValueType::kI32, std::move(p));
}

void GgufWriter::set_f32(const std::string& key, float value) {
  std::string p;
  put(p, value);
  set(key, GgufValueType::kF32, std::move(p));
}

void GgufWriter::set_strings(const std::string& key, const std::vector<std::string>& values) {
  std::string p;
  put<std::uint32_t>(p, static_cast<std::uint32_t>(GgufValueType::kString));
  put<std::uint64_t>(p, values.size());
  for (const std::string& s : values)
    put_string(p, s);
  set(key, GgufValueType::kArray, std::move(p));
}

void GgufWriter::set_i32s(const std::string& key, const std::vector<std::int32_t>& values) {
  std::string p;
  put<std::uint32_t>(p, static_cast<std::uint32_t>(GgufValueType::kI32));
  put<std::uint64_t>(p, values.size());
  for (std::int32_t x : values)
    put(p, x);
  set(key, GgufValueType::kArray, std::move(p));
}

void GgufWriter::set_f32s(const std::string& key, const std::vector<float>& values) {
  std::string p;
  put<std::uint32_t>(p, static_cast<std::uint32_t>(GgufValueType::kF32));
  put<std::uint64_t>(p, values.size());
  for (float x : values)
    put(p, x);
  set(key, GgufValueType::kArray, std::move(p));
}

void GgufWriter::copy(const std::string& key, const GgufValue& value) {
  std::string p;
  put_value(p, value);
  set(key, value.type(), std::move(p));
}

void GgufWriter::erase(const std::string& key) {
  std::erase_if(metadata_, [&](const auto& kv) { return kv.first == key; });
}

bool GgufWriter::has(const std::string& key) const {
  return std::any_of(metadata_.begin(), metadata_.end(),
                     [&](const auto& kv) { return kv.first == key; });
}

std::uint64_t GgufWriter::add_tensor(const std::string& name,
                                     const std::vector<std::int64_t>& shape, GgmlType type) {
  for (const Tensor& t : tensors_)
    if (t.name == name) throw Error("GGUF writer: tensor '" + name + "' is declared twice");
  const GgmlTypeInfo& info = ggml_type_info(type);
  RONDO_ASSERT(!shape.empty());
  std::vector<std::int64_t> ne(shape.rbegin(), shape.rend());
  std::uint64_t n = 1;
  for (std::int64_t d : ne) {
    RONDO_ASSERT(d > 0);
    n *= static_cast<std::uint64_t>(d);
  }
  if (ne[0] % info.block_size != 0)
    throw Error("GGUF writer: tensor '" + name + "' has rows of " + std::to_string(ne[0]) +
                " elements, not a whole number of " + info.name + " blocks (" +
                std::to_string(info.block_size) + ")");
  const std::uint64_t bytes = n / info.block_size * info.type_size;
  tensors_.push_back({name, std::move(ne), type, bytes});
  return bytes;
}

void GgufWriter::write(const std::string& path,
                       const std::function<void(std::size_t, const GgufSink&)>& produce) const {
  std::uint64_t alignment = 32;
  for (const auto& [k, v] : metadata_)
    if (k == "general.alignment") {
      std::uint32_t a = 0;
      RONDO_ASSERT(v.size() == 8);  // type + u32
      std::memcpy(&a, v.data() + 4, 4);
      alignment = a;
    }
  RONDO_ASSERT(alignment > 0 && alignment % 8 == 0);
  auto padding = [&](std::uint64_t offset) { return (alignment - offset % alignment) % alignment; };

  std::string header = "GGUF";
  put<std::uint32_t>(header, 3);
  put<std::uint64_t>(header, tensors_.size());
  put<std::uint64_t>(header, metadata_.size());
  for (const auto& [k, v] : metadata_) {
    put_string(header, k);
    header += v;
  }
  std::uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(header, t.name);
    put<std::uint32_t>(header, static_cast<std::uint32_t>(t.ne.size()));
    for (std::int64_t d : t.ne)
      put<std::uint64_t>(header, static_cast<std::uint64_t>(d));
    put<std::uint32_t>(header, static_cast<std::uint32_t>(t.type));
    put<std::uint64_t>(header, offset);
    offset += t.bytes + padding(t.bytes);
  }
  header.append(padding(header.size()), '\0');

  DurableFile file(path);
  file.write(header.data(), header.size());
  const std::string zeros(alignment, '\0');
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    std::uint64_t written = 0;
    produce(i, [&](const void* data, std::size_t bytes) {
      file.write(data, bytes);
      written += bytes;
    });
    if (written != tensors_[i].bytes)
      throw InternalError("GGUF writer: " + std::to_string(written) + " bytes given for '" +
                          tensors_[i].name + "', which has " + std::to_string(tensors_[i].bytes));
    file.write(zeros.data(), padding(written));
  }
  file.commit();
}

}  // namespace rondo::models
