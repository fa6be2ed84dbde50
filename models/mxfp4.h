// MXFP4 weights as GPT-OSS's official checkpoints store its experts: for a weight W,
// `W_blocks` (E, R, G, 16) uint8 holding 32 FP4 (e2m1) values per row group, low nibble first, and
// `W_scales` (E, R, G) uint8, the group's power of two plus 127. Dequantised as transformers'
// convert_moe_packed_tensors does: (E, R, G*32) values, transposed to the (E, G*32, R) the model's
// fused expert parameter has. The arithmetic is kernels' MXFP4 format (kernels/quant.h), which a
// frozen base can also keep: mxfp4_blob() is the weight in that format.
//
//   for (auto& [name, w] : models::mxfp4_weights(ckpt))          // by the weight's own name
//     tensors[name] = models::dequantize_mxfp4(w, at::kBFloat16);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "models/safetensors.h"

namespace rondo::models {

struct Mxfp4Weight {
  const TensorEntry* blocks = nullptr;
  const TensorEntry* scales = nullptr;
  std::vector<std::int64_t> shape;  // dequantised: (E, G * 32, R)
  std::uint64_t bytes() const { return blocks->bytes + scales->bytes; }
  // The kernels' format of it, as a (E * G*32, R) tensor (kernels::Mxfp4Layout).
  kernels::QuantFormat format() const {
    return {.type = kernels::QuantType::kMXFP4, .experts = shape[0]};
  }
};

// The MXFP4 pairs of a checkpoint, by the name of the weight they stand for. Throws Error naming
// the tensors for a _blocks without its _scales (or the reverse), a dtype other than U8 or shapes
// that do not fit each other.
std::map<std::string, Mxfp4Weight> mxfp4_weights(const Checkpoint& ckpt);

// The blob of kernels' MXFP4 format: the blocks, then the scales. (blocks + scales) uint8, CPU.
at::Tensor mxfp4_blob(const Mxfp4Weight& weight);

// (E, G*32, R) in `dtype` (float32, bfloat16 or float16).
at::Tensor dequantize_mxfp4(const Mxfp4Weight& weight, at::ScalarType dtype);

}  // namespace rondo::models
