#include "models/mxfp4.h"

#include <ATen/ATen.h>

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

at::Tensor dequantize_mxfp4(const Mxfp4Weight& w, at::ScalarType dtype) {
  static const float kFp4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const at::Tensor lut = at::from_blob(const_cast<float*>(kFp4), {16}, at::kFloat);
  const at::Tensor blocks = w.blocks->view().to(at::kLong);         // (E, R, G, 16)
  const at::Tensor exponent = w.scales->view().to(at::kInt) - 127;  // (E, R, G)
  // Byte j of a group holds values 2j (low nibble) and 2j + 1 (high nibble).
  const at::Tensor index = at::stack({blocks.bitwise_and(15), blocks.bitwise_right_shift(4)}, -1)
                               .flatten(-2);  // (E, R, G, 32)
  at::Tensor values =
      at::ldexp(lut.index_select(0, index.flatten()).view(index.sizes()), exponent.unsqueeze(-1));
  const std::int64_t E = w.shape[0], cols = w.shape[1], rows = w.shape[2];
  return values.view({E, rows, cols}).transpose(1, 2).contiguous().to(dtype);
}

}  // namespace rondo::models
