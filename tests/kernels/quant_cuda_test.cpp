// The CUDA dequantisation kernels (kernels/cuda/dequant.cu) on a real GPU (label cuda; every test
// skips itself without one): every format of kernels/quant.h, into F32, BF16 and F16, equals the
// CPU's kernels::dequantize bit for bit, for blobs from the CPU quantisers and for random bytes
// (every code and scale pattern). Bit for bit, not a tolerance: both sides take their arithmetic
// from quant_blocks.h, round each product before any add (-ffp-contract=off, --fmad=false), and
// round float32 to BF16/F16 to nearest even; the only liberty left is a NaN's payload, so NaNs
// match any NaN. The CPU side is checked against references in quant_test.cpp and
// tests/oracle/test_quant.py.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_device.h"
#include "kernels/quant.h"
#include "quant_formats.h"

namespace rondo::kernels {
namespace {

class QuantCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CudaProbe probe = probe_cuda();
    if (probe.devices.empty()) GTEST_SKIP() << "no CUDA device: " << probe.error;
    dev_ = open_cuda_device({.index = 0});
  }
  std::unique_ptr<Device> dev_;
};

std::mt19937_64 fresh_rng() {
  std::random_device rd;
  const std::uint64_t seed = (std::uint64_t{rd()} << 32) ^ rd();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

bool is_nan(const std::uint8_t* p, FloatDType dtype) {
  if (dtype == FloatDType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return std::isnan(f);
  }
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return dtype == FloatDType::kBF16 ? (h & 0x7FFF) > 0x7F80 : (h & 0x7FFF) > 0x7C00;
}

// GPU result == CPU result, element by element; reports the first difference.
void expect_same(const std::vector<std::uint8_t>& gpu, const std::vector<std::uint8_t>& cpu,
                 FloatDType dtype, const QuantFormat& f, std::int64_t rows, std::int64_t cols) {
  const std::size_t size = dtype_size(dtype), n = cpu.size() / size;
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t* g = &gpu[i * size];
    const std::uint8_t* c = &cpu[i * size];
    const bool same = std::memcmp(g, c, size) == 0 || (is_nan(g, dtype) && is_nan(c, dtype));
    if (!same && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << to_string(f) << " (" << rows << ", " << cols << ") to " << to_string(dtype)
                     << ": " << bad << " of " << n << " elements differ from the CPU; first at "
                     << first << " (row " << first / cols << ", column " << first % cols << ")";
}

struct Shape {
  std::int64_t rows, cols;
};

std::vector<Shape> shapes_for(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kQ8_0:
      return {{1, 32}, {67, 288}, {1000, 4096}};
    case QuantType::kQ4_K:
    case QuantType::kQ6_K:
      return {{1, 256}, {67, 512}, {1000, 4096}};
    default:
      return {{1, 1}, {3, 5}, {67, 333}, {1000, 4096 + 22}};
  }
}

void run_on_gpu_and_cpu(Device& dev, const QuantFormat& f, const std::vector<std::uint8_t>& blob,
                        std::int64_t rows, std::int64_t cols) {
  Stream& s = dev.create_stream("dequant");
  for (FloatDType out : {FloatDType::kF32, FloatDType::kBF16, FloatDType::kF16}) {
    const std::size_t bytes = static_cast<std::size_t>(rows * cols) * dtype_size(out);
    std::vector<std::uint8_t> cpu(bytes), gpu(bytes);
    dequantize(f, blob.data(), rows, cols, out, cpu.data());
    DeviceBuffer q = dev.allocate(blob.size(), &s), w = dev.allocate(bytes, &s);
    s.upload(q.data(), blob.data(), blob.size());
    s.fill(w.data(), 0xA5, bytes);  // a pattern no element would keep by chance
    s.dequantize(f, q.data(), rows, cols, out, w.data());
    s.download(gpu.data(), w.data(), bytes);
    s.synchronize();
    expect_same(gpu, cpu, out, f, rows, cols);
  }
}

TEST_F(QuantCudaTest, EqualsTheCpuForQuantisedWeights) {
  auto rng = fresh_rng();
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (const QuantFormat& f : test::all_quant_formats())
    for (Shape sh : shapes_for(f.type)) {
      std::vector<float> x(static_cast<std::size_t>(sh.rows * sh.cols));
      for (float& v : x)
        v = normal(rng);
      std::vector<std::uint8_t> blob(quant_bytes(f, sh.rows, sh.cols));
      quantize(f, x.data(), FloatDType::kF32, sh.rows, sh.cols, blob.data());
      run_on_gpu_and_cpu(*dev_, f, blob, sh.rows, sh.cols);
    }
}

// Random bytes everywhere, scales included: every nibble and code, subnormal, huge, infinite and
// NaN scales. Both sides must still agree (NaN with NaN).
TEST_F(QuantCudaTest, EqualsTheCpuForRandomBytes) {
  auto rng = fresh_rng();
  std::uniform_int_distribution<int> byte(0, 255);
  for (const QuantFormat& f : test::all_quant_formats())
    for (Shape sh : shapes_for(f.type)) {
      std::vector<std::uint8_t> blob(quant_bytes(f, sh.rows, sh.cols));
      for (auto& b : blob)
        b = static_cast<std::uint8_t>(byte(rng));
      run_on_gpu_and_cpu(*dev_, f, blob, sh.rows, sh.cols);
    }
}

// MXFP4 (GPT-OSS's experts, read from checkpoints, never made): random bytes, every code and
// scale, 1 and 3 experts; and ggml's MXFP4 blocks.
TEST_F(QuantCudaTest, EqualsTheCpuForMxfp4) {
  auto rng = fresh_rng();
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto [experts, c, r] : {std::array<std::int64_t, 3>{1, 32, 1}, {3, 64, 7}, {4, 2880, 96}}) {
    const QuantFormat f{.type = QuantType::kMXFP4, .experts = experts};
    std::vector<std::uint8_t> blob(quant_bytes(f, experts * c, r));
    for (auto& b : blob)
      b = static_cast<std::uint8_t>(byte(rng));
    run_on_gpu_and_cpu(*dev_, f, blob, experts * c, r);
  }
  // ggml's block_mxfp4 (GGUF), every scale byte.
  const QuantFormat ggml{.type = QuantType::kGgufMXFP4};
  for (auto [rows, cols] : {std::array<std::int64_t, 2>{1, 32}, {67, 288}, {1000, 4096}}) {
    std::vector<std::uint8_t> blob(quant_bytes(ggml, rows, cols));
    for (auto& b : blob)
      b = static_cast<std::uint8_t>(byte(rng));
    run_on_gpu_and_cpu(*dev_, ggml, blob, rows, cols);
  }
}

// The kernels read the blob byte by byte: a blob at an odd address (inside a larger buffer)
// decodes the same.
TEST_F(QuantCudaTest, ABlobNeedsNoAlignment) {
  auto rng = fresh_rng();
  std::uniform_int_distribution<int> byte(0, 255);
  Stream& s = dev_->create_stream("dequant");
  for (const QuantFormat& f : test::all_quant_formats()) {
    const std::int64_t rows = 3, cols = 256;
    std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols));
    for (auto& b : blob)
      b = static_cast<std::uint8_t>(byte(rng));
    std::vector<std::uint8_t> cpu(rows * cols * 4), gpu(rows * cols * 4);
    dequantize(f, blob.data(), rows, cols, FloatDType::kF32, cpu.data());
    DeviceBuffer q = dev_->allocate(blob.size() + 1, &s), w = dev_->allocate(cpu.size(), &s);
    auto* odd = static_cast<std::uint8_t*>(q.data()) + 1;
    s.upload(odd, blob.data(), blob.size());
    s.dequantize(f, odd, rows, cols, FloatDType::kF32, w.data());
    s.download(gpu.data(), w.data(), gpu.size());
    s.synchronize();
    expect_same(gpu, cpu, FloatDType::kF32, f, rows, cols);
  }
}

}  // namespace
}  // namespace rondo::kernels
