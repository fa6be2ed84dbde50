// Reading a model's weights one tensor at a time, for loading into a store that may be larger
// than the host memory budget: nothing is kept between calls, and each tensor's file pages can be
// dropped from the process once it has been copied out (release()). Checks on opening, from the
// headers only, what Model::load checks (every tensor the config needs, right shapes, nothing
// unexpected). Hugging Face folders (safetensors) and GGUF files, under Hugging Face names.
//
//   models::WeightReader r("~/models/Qwen3-0.6B");
//   for (const models::LayerSpec& l : r.layers())
//     for (const models::ParamSpec& p : l.params) {
//       at::Tensor t = r.read(p.name, models::DType::kBF16);   // a view or a fresh tensor
//       copy_somewhere(t);
//       r.release(p.name);
//     }
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/quant.h"
#include "models/config.h"
#include "models/dequant.h"
#include "models/dtype.h"
#include "models/layers.h"

namespace rondo::models {

// A GGUF tensor kept in its block type: rows of blocks, in Hugging Face row order (llama.cpp's
// q/k row permutation undone on whole rows of blocks — blocks run along a row, so the
// permutation, which moves rows, never splits one).
struct GgufBlocks {
  GgmlType type = GgmlType::kF32;
  std::int64_t rows = 0, cols = 0;  // the Hugging Face (out, in) shape
  at::Tensor bytes;                 // (rows, cols / block_size * type_size) uint8, CPU
};

class WeightReader {
 public:
  // A Hugging Face folder or a .gguf file. Throws Error naming the file and tensor at fault.
  explicit WeightReader(const std::string& path);
  ~WeightReader();
  WeightReader(WeightReader&&) noexcept;
  WeightReader& operator=(WeightReader&&) noexcept;

  const std::string& path() const;
  bool is_gguf() const;
  const ModelConfig& config() const;
  const std::vector<LayerSpec>& layers() const;

  // The tensor in `dtype` (F32, BF16 or F16; GGUF: F32 or BF16), CPU, contiguous: a zero-copy
  // view of the file when the stored dtype matches, else fresh memory.
  at::Tensor read(const std::string& name, DType dtype) const;
  // GGUF: the tensor's blocks as stored, when its type is a block type (Q8_0, Q4_K, ...);
  // nullopt for plain types (F32, F16, BF16) and for Hugging Face folders.
  std::optional<GgufBlocks> read_blocks(const std::string& name) const;
  // Hugging Face: an MXFP4 weight (GPT-OSS's experts) as kernels' MXFP4 blob (mxfp4_blob), with
  // its format; nullopt for every other tensor.
  std::optional<std::pair<kernels::QuantFormat, at::Tensor>> read_mxfp4(
      const std::string& name) const;
  // Drops the tensor's file pages from this process (see release_mapped_pages).
  void release(const std::string& name) const;
  // The same for elements [first, first + count) of a Hugging Face tensor stored as it is read
  // (a loader that has copied that much drops its pages as it goes); a no-op for the rest.
  void release_range(const std::string& name, std::int64_t first, std::int64_t count) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rondo::models
