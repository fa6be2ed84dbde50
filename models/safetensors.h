// safetensors files and Hugging Face checkpoint folders: read (memory-mapped, zero-copy, every
// header field checked against the file) and write (for export; temp name, fsync, rename).
// Errors name the file and the tensor. Used by the model loader and, later, export.
//
//   models::Checkpoint ckpt = models::Checkpoint::open_hf_folder("~/models/Llama-3.2-1B");
//   const models::TensorEntry& e = ckpt.get("model.norm.weight");  // or Error naming both
//   at::Tensor t = models::tensor_view(const_cast<std::uint8_t*>(e.data), e.dtype, e.shape);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/dtype.h"
#include "models/mapped_file.h"

namespace rondo::models {

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  const std::uint8_t* data = nullptr;  // inside the file's mapping (read-only)
  std::uint64_t bytes = 0;
  std::string file;  // path, for errors

  std::int64_t numel() const;
  // A read-only view without copying (the mapping must outlive it).
  at::Tensor view() const;
};

class SafetensorsFile {
 public:
  // Parses and validates the header: length, JSON, dtypes, shapes, offsets inside the data
  // section, sizes matching shapes, no overlaps. Throws Error naming the file and tensor.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_->path(); }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  const TensorEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::shared_ptr<MappedFile> file_;
  std::vector<TensorEntry> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a Hugging Face folder: model.safetensors, or the shards listed in
// model.safetensors.index.json.
class Checkpoint {
 public:
  static Checkpoint open_hf_folder(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const TensorEntry* find(const std::string& name) const;
  // Throws Error naming the folder and the tensor, and saying which file should hold it.
  const TensorEntry& get(const std::string& name) const;
  std::vector<std::string> names() const;
  std::uint64_t total_bytes() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorEntry*> by_name_;
};

// Writes tensors (any CPU tensors; made contiguous) to `path` atomically: a temporary name in the
// same folder, fsync, rename. Names must be unique.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The same, for data that is produced while the file is written (state that does not all fit in
// memory at once): the header comes from `entries`, then `produce(i, sink)` is called for each
// entry in order and must pass exactly that entry's bytes to `sink` (in one piece or several).
// Returns the XXH3-64 of every byte written (kernels/checksum.h), computed as the bytes go out.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
};
using SafetensorsSink = std::function<void(const void* data, std::size_t bytes)>;
std::uint64_t write_safetensors(
    const std::string& path, const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata,
    const std::function<void(std::size_t, const SafetensorsSink&)>& produce);

// DType of a torch scalar type; throws Error for types safetensors cannot hold.
DType dtype_of(const at::Tensor& t);

}  // namespace rondo::models
