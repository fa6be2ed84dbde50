// Tensor views over engine-owned memory: no copy (writes through torch land in the buffer), the
// dtype maps as safetensors names it, bf16 bits read as the values they encode.
#include "models/tensor_view.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/error.h"

namespace rondo::models {
namespace {

TEST(DType, NamesAndSizesFollowSafetensors) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_STREQ(to_string(DType::kBF16), "BF16");
  EXPECT_EQ(dtype_from_string("F16"), DType::kF16);
  EXPECT_EQ(dtype_from_string("BOOL"), DType::kBool);
  EXPECT_FALSE(dtype_from_string("f32").has_value());  // safetensors names are upper case
  EXPECT_FALSE(dtype_from_string("Q4_K").has_value());
  for (DType d : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kI64, DType::kI32,
                  DType::kI16, DType::kI8, DType::kU8, DType::kBool})
    EXPECT_EQ(at::elementSize(to_scalar_type(d)), dtype_size(d)) << to_string(d);
}

TEST(TensorView, SharesMemoryWithTheBuffer) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist;
  const std::int64_t rows = 22, cols = 7;
  std::vector<float> buf(rows * cols);
  for (float& x : buf)
    x = dist(rng);
  at::Tensor t = tensor_view(buf.data(), DType::kF32, {rows, cols});
  EXPECT_EQ(t.data_ptr(), buf.data());
  EXPECT_EQ(t.size(0), rows);
  EXPECT_TRUE(t.is_contiguous());
  // Row sums through torch against a float64 sum of the raw buffer.
  at::Tensor sums = t.to(at::kDouble).sum(1);
  for (std::int64_t r = 0; r < rows; ++r) {
    double expect = 0;
    for (std::int64_t c = 0; c < cols; ++c)
      expect += buf[r * cols + c];
    EXPECT_NEAR(sums[r].item<double>(), expect, 1e-12) << "row " << r;
  }
  t.mul_(2.0f);
  at::Tensor again = tensor_view(buf.data(), DType::kF32, {rows * cols});
  EXPECT_TRUE(at::equal(again.view({rows, cols}), t));
}

TEST(TensorView, ReadsBf16Bits) {
  // 1.0, -2.0, 0.15625 and +inf in bfloat16 (the top half of the float32 bit pattern).
  std::vector<std::uint16_t> bits = {0x3F80, 0xC000, 0x3E20, 0x7F80};
  at::Tensor t = tensor_view(bits.data(), DType::kBF16, {4}).to(at::kFloat);
  EXPECT_EQ(t[0].item<float>(), 1.0f);
  EXPECT_EQ(t[1].item<float>(), -2.0f);
  EXPECT_EQ(t[2].item<float>(), 0.15625f);
  EXPECT_TRUE(std::isinf(t[3].item<float>()));
}

TEST(TensorView, RejectsNegativeDimensions) {
  float x = 0;
  EXPECT_THROW(tensor_view(&x, DType::kF32, {1, -1}), Error);
}

}  // namespace
}  // namespace rondo::models
