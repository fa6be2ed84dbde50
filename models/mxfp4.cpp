#include "models/mxfp4.h"

#include <ATen/ATen.h>

#include <cstring>

#include "kernels/error.h"
#include "models/tensor_view.h"

namespace rondo::models {

std::map<std::string, Mxfp4Weight> mxfp4_weights(const Checkpoint& ckpt) {
  static const std::string kBlocks = "_blocks", kScales = "_scales";
  std::map<std::string, Mxfp4Weight> out;
  for (const std::string& name : ckpt.names()) {
    const bool blocks = name.ends_with(kBlocks), scales = name.ends_with(kScales);
    if (!blocks && !scales) continue;
    const std::string base = name.substr(0, name.size() - (blocks ? kBlocks : kScales).size());
    const std::string other = base + (blocks ? kScales : kBlocks);
    const TensorEntry* pair = ckpt.find(other);
    if (pair == nullptr)
      throw Error(ckpt.dir() + ": tensor '" + name + "' (MXFP4) has no '" + other + "' beside it");
    if (!blocks) continue;  // the pair is taken from its _blocks
    const TensorEntry& b = ckpt.get(name);
    const TensorEntry& s = *pair;
    std::vector<std::int64_t> prefix(b.shape.begin(), b.shape.end() - (b.shape.empty() ? 0 : 1));
    if (b.dtype != DType::kU8 || s.dtype != DType::kU8 || b.shape.size() != 4 ||
        b.shape.back() != 16 || s.shape != prefix)
      throw Error(b.file + ": MXFP4 tensors '" + name + "' " + shape_text(b.shape) + " and '" +
                  other + "' " + shape_text(s.shape) +
                  " do not fit: expected U8 (E, R, G, 16) blocks and U8 (E, R, G) scales");
    out[base] = {.blocks = &b, .scales = &s, .shape = {b.shape[0], b.shape[2] * 32, b.shape[1]}};
  }
  return out;
}

at::Tensor mxfp4_blob(const Mxfp4Weight& w) {
  at::Tensor blob = at::empty({static_cast<std::int64_t>(w.bytes())}, at::kByte);
  std::memcpy(blob.data_ptr(), w.blocks->data, w.blocks->bytes);
  std::memcpy(static_cast<std::uint8_t*>(blob.data_ptr()) + w.blocks->bytes, w.scales->data,
              w.scales->bytes);
  return blob;
}

at::Tensor dequantize_mxfp4(const Mxfp4Weight& w, at::ScalarType dtype) {
  const kernels::FloatDType out = dtype == at::kFloat      ? kernels::FloatDType::kF32
                                  : dtype == at::kBFloat16 ? kernels::FloatDType::kBF16
                                  : dtype == at::kHalf     ? kernels::FloatDType::kF16
                                                           : throw Error(
                                                                 "MXFP4 dequantises to float32, "
                                                                     "bfloat16 or float16");
  at::Tensor t = at::empty(w.shape, at::TensorOptions().dtype(dtype));
  kernels::dequantize(w.format(), mxfp4_blob(w).data_ptr(), w.shape[0] * w.shape[1], w.shape[2],
                      out, t.data_ptr());
  return t;
}

}  // namespace rondo::models
