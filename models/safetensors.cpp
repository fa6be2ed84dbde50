#include "models/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kernels/checksum.h"
#include "kernels/error.h"
#include "models/mapped_file.h"
#include "models/tensor_view.h"

namespace rondo::models {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
constexpr std::uint64_t kMaxHeader = 100ull << 20;  // the format's own limit is 100 MB
constexpr std::uint64_t kMaxElements = 1ull << 48;

std::string supported_dtypes() {
  return "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL";
}
}  // namespace

std::int64_t TensorEntry::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape)
    n *= d;
  return n;
}

at::Tensor TensorEntry::view() const {
  at::TensorOptions options = at::TensorOptions().dtype(to_scalar_type(dtype));
  // Writers align every tensor to its element size; a file that does not gets a copy, since
  // kernels may assume aligned elements.
  if (reinterpret_cast<std::uintptr_t>(data) % dtype_size(dtype) != 0) {
    at::Tensor copy = at::empty(shape, options);
    std::memcpy(copy.data_ptr(), data, bytes);
    return copy;
  }
  return at::from_blob(const_cast<std::uint8_t*>(data), shape, options);
}

SafetensorsFile::SafetensorsFile(const std::string& path)
    : file_(std::make_shared<MappedFile>(path)) {
  const MappedFile& f = *file_;
  std::uint64_t n = 0;
  std::memcpy(&n, f.bytes(0, 8, "the header length"), 8);  // little-endian, like the format
  if (n > kMaxHeader)
    throw Error(path + ": header length " + std::to_string(n) +
                " is larger than the 100 MB the format allows; not a safetensors file?");
  const char* header = reinterpret_cast<const char*>(f.bytes(8, n, "the JSON header"));
  const std::uint64_t data_start = 8 + n;
  const std::uint64_t data_size = f.size() - data_start;

  json j;
  // A name given twice would silently keep one of the two (JSON parsers keep the last): the
  // header's top-level keys are collected as they are read.
  std::set<std::string> names;
  std::string twice;
  try {
    j = json::parse(header, header + n, [&](int depth, json::parse_event_t event, json& key) {
      if (depth == 1 && event == json::parse_event_t::key && key.is_string() &&
          !names.insert(key.get<std::string>()).second && twice.empty())
        twice = key.get<std::string>();
      return true;
    });
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw Error(path + ": the header is not valid JSON (" + e.what() + ")");
  }
  if (!twice.empty())
    throw Error(path + ": the header names tensor '" + twice +
                "' twice; the file is corrupt or was written by a broken tool");
  if (!j.is_object()) throw Error(path + ": the header is not a JSON object");

  for (auto& item : j.items()) {
    // Named, not a structured binding: the lambda below captures it (clang 14, which builds the
    // fuzz harnesses, cannot capture structured bindings).
    const std::string name = item.key();
    json& value = item.value();
    if (name == "__metadata__") {
      if (!value.is_object()) throw Error(path + ": __metadata__ must be an object of strings");
      for (auto& [k, v] : value.items()) {
        if (!v.is_string())
          throw Error(path + ": __metadata__ value of '" + k + "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return Error(path + ": tensor '" + name + "': " + what);
    };
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets"))
      throw bad("needs dtype, shape and data_offsets");
    TensorEntry e;
    e.name = name;
    e.file = path;
    if (!value["dtype"].is_string()) throw bad("dtype is not a string");
    std::string dt = value["dtype"].get<std::string>();
    auto dtype = dtype_from_string(dt);
    if (!dtype) throw bad("unknown dtype '" + dt + "' (supported: " + supported_dtypes() + ")");
    e.dtype = *dtype;
    const json& shape = value["shape"];
    if (!shape.is_array() || shape.size() > 8) throw bad("shape must be a list of at most 8 sizes");
    std::uint64_t elements = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned())
        throw bad("shape " + shape.dump() + " has a negative or non-integer size");
      std::uint64_t v = d.get<std::uint64_t>();
      // Each size on its own too: after a zero size the product no longer catches a huge one.
      if (v > kMaxElements || (v != 0 && elements > kMaxElements / v))
        throw bad("shape " + shape.dump() + " is absurdly large");
      elements *= v;
      e.shape.push_back(static_cast<std::int64_t>(v));
    }
    const json& off = value["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      throw bad("data_offsets must be two non-negative integers");
    std::uint64_t begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (begin > end) throw bad("data_offsets " + off.dump() + " end before they begin");
    if (end > data_size)
      throw bad("data_offsets " + off.dump() + " reach past the end of the file (data section of " +
                std::to_string(data_size) + " bytes); the file is truncated or corrupt");
    e.bytes = end - begin;
    if (e.bytes != elements * dtype_size(e.dtype))
      throw bad("holds " + std::to_string(e.bytes) + " bytes but shape " + shape.dump() + " of " +
                dt + " needs " + std::to_string(elements * dtype_size(e.dtype)));
    e.data = f.data() + data_start + begin;
    tensors_.push_back(std::move(e));
  }

  // No two tensors may share bytes.
  std::vector<const TensorEntry*> order;
  for (const auto& e : tensors_)
    order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->data < b->data; });
  for (std::size_t i = 1; i < order.size(); ++i)
    if (order[i - 1]->bytes > 0 && order[i]->bytes > 0 &&
        order[i - 1]->data + order[i - 1]->bytes > order[i]->data)
      throw Error(path + ": tensors '" + order[i - 1]->name + "' and '" + order[i]->name +
                  "' overlap; the file is corrupt");
  for (std::size_t i = 0; i < tensors_.size(); ++i)
    index_[tensors_[i].name] = i;
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Checkpoint Checkpoint::open_hf_folder(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  if (!fs::is_directory(dir))
    throw Error(dir + " is not a folder (expected a Hugging Face model folder)");
  fs::path index = fs::path(dir) / "model.safetensors.index.json";
  fs::path single = fs::path(dir) / "model.safetensors";
  auto add = [&](const std::shared_ptr<SafetensorsFile>& f) {
    for (const TensorEntry& e : f->tensors()) {
      auto [it, fresh] = c.by_name_.emplace(e.name, &e);
      if (!fresh)
        throw Error(dir + ": tensor '" + e.name + "' is in both " + it->second->file + " and " +
                    e.file);
    }
    c.files_.push_back(f);
  };
  if (fs::exists(index)) {
    json j;
    try {
      j = json::parse(read_text_file(index.string(), "the index of a sharded checkpoint"));
    } catch (const json::exception& e) {
      throw Error(index.string() + ": not valid JSON (" + e.what() + ")");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(index.string() + ": missing the weight_map object");
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        throw Error(index.string() + ": weight_map['" + name + "'] is not a file name");
      std::string shard = file.get<std::string>();
      if (shard.find('/') != std::string::npos || shard == "..")
        throw Error(index.string() + ": shard name '" + shard + "' must be a file in the folder");
      by_file[shard].push_back(name);
    }
    for (auto& [shard, names] : by_file) {
      fs::path p = fs::path(dir) / shard;
      if (!fs::exists(p))
        throw Error(index.string() + " lists shard " + shard + " (for '" + names.front() +
                    "' and " + std::to_string(names.size() - 1) + " more), which is missing");
      auto f = std::make_shared<SafetensorsFile>(p.string());
      for (const std::string& name : names)
        if (f->find(name) == nullptr)
          throw Error(index.string() + " says tensor '" + name + "' is in " + p.string() +
                      ", which has no such tensor");
      add(f);
    }
  } else if (fs::exists(single)) {
    add(std::make_shared<SafetensorsFile>(single.string()));
  } else {
    throw Error(dir +
                " has neither model.safetensors nor model.safetensors.index.json "
                "(PyTorch .bin checkpoints are not supported: re-save the model with "
                "save_pretrained(..., safe_serialization=True))");
  }
  return c;
}

const TensorEntry* Checkpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorEntry& Checkpoint::get(const std::string& name) const {
  if (const TensorEntry* e = find(name)) return *e;
  throw Error(dir_ + ": the checkpoint has no tensor '" + name +
              "', which the model config requires; is the folder complete and config.json the "
              "right one?");
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (auto& [name, e] : by_name_)
    out.push_back(name);
  return out;
}

std::uint64_t Checkpoint::total_bytes() const {
  std::uint64_t total = 0;
  for (auto& [name, e] : by_name_)
    total += e->bytes;
  return total;
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble:
      return DType::kF64;
    case at::kFloat:
      return DType::kF32;
    case at::kHalf:
      return DType::kF16;
    case at::kBFloat16:
      return DType::kBF16;
    case at::kLong:
      return DType::kI64;
    case at::kInt:
      return DType::kI32;
    case at::kShort:
      return DType::kI16;
    case at::kChar:
      return DType::kI8;
    case at::kByte:
      return DType::kU8;
    case at::kBool:
      return DType::kBool;
    default:
      throw Error(std::string("cannot store a tensor of type ") + c10::toString(t.scalar_type()) +
                  " in safetensors");
  }
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  std::vector<at::Tensor> data;
  for (const auto& [name, tensor] : tensors) {
    at::Tensor t = tensor.to(at::kCPU).contiguous();
    entries.push_back({name, dtype_of(t), t.sizes().vec()});
    data.push_back(t);
  }
  write_safetensors(path, entries, metadata, [&](std::size_t i, const SafetensorsSink& sink) {
    sink(data[i].data_ptr(), data[i].nbytes());
  });
}

std::uint64_t write_safetensors(
    const std::string& path, const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata,
    const std::function<void(std::size_t, const SafetensorsSink&)>& produce) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> seen;
  std::uint64_t offset = 0;
  std::vector<std::uint64_t> sizes;
  for (const SafetensorsEntry& e : entries) {
    if (e.name == "__metadata__" || !seen.insert(e.name).second)
      throw Error("write_safetensors: tensor name '" + e.name + "' is " +
                  (e.name == "__metadata__" ? "reserved" : "used twice"));
    std::uint64_t bytes = dtype_size(e.dtype);
    for (std::int64_t d : e.shape)
      bytes *= static_cast<std::uint64_t>(d);
    header[e.name] = {{"dtype", to_string(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    sizes.push_back(bytes);
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0)
    text.push_back(' ');

  DurableFile file(path);
  kernels::Xxh3 checksum;
  std::uint64_t n = text.size();
  file.write(&n, 8);
  file.write(text.data(), text.size());
  checksum.update(&n, 8);
  checksum.update(text.data(), text.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::uint64_t written = 0;
    produce(i, [&](const void* data, std::size_t bytes) {
      file.write(data, bytes);
      checksum.update(data, bytes);
      written += bytes;
    });
    if (written != sizes[i])
      throw InternalError("write_safetensors: " + std::to_string(written) + " bytes given for '" +
                          entries[i].name + "', which has " + std::to_string(sizes[i]));
  }
  file.commit();
  return checksum.digest();
}

}  // namespace rondo::models
