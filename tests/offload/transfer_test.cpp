// offload::Transfers on simulated devices: a layer's weights arrive on the device byte for byte as
// the store holds them — from host memory, from the NVMe tier, and quantised (dequantised on the
// device to what the CPU dequantisation gives) — whatever the chunk size; activations go down to
// host staging and up to another device unchanged; gradients land in the store's gradient region.
#include "offload/transfer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

#include "kernels/cpu/sim_device.h"
#include "kernels/quant.h"
#include "offload/io_faults.h"
#include "offload/nvme_store.h"

namespace fs = std::filesystem;

namespace rondo::offload {
namespace {

using kernels::FloatDType;

std::vector<std::uint8_t> download_all(kernels::Device& dev, const void* src, std::size_t bytes) {
  std::vector<std::uint8_t> out(bytes);
  kernels::Stream& s = dev.create_stream("test-download");
  s.download(out.data(), src, bytes);
  s.synchronize();
  return out;
}

// Random bf16 bits of finite values (no NaN/Inf patterns), so byte equality is meaningful.
void fill_bf16(void* dst, std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  auto* p = static_cast<std::uint16_t*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    float f = nd(rng);
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    p[i] = static_cast<std::uint16_t>(u >> 16);
  }
}

struct TransfersTest : ::testing::TestWithParam<std::uint64_t> {
  fs::path dir = fs::temp_directory_path() / ("rondo-transfer-test-" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
};

// Layer 0: host (a trained norm and a frozen matrix); layer 1: frozen matrix on NVMe, kept as
// Q8_0; layer 2: frozen NF4 matrix in host memory plus a trained bias on NVMe.
std::vector<LayerDesc> layers() {
  std::vector<LayerDesc> l(3);
  l[0].tensors = {{"l0.norm", 22, true, -1}, {"l0.w", 22 * 67, false, -1}};
  l[1].tensors = {{"l1.w", 67 * 64, false, -1, {.type = kernels::QuantType::kQ8_0}, 67, 64}};
  l[1].base = Tier::kNvme;
  l[2].tensors = {{"l2.w", 33 * 65, false, -1, {.type = kernels::QuantType::kNF4}, 33, 65},
                  {"l2.b", 33, true, -1}};
  l[2].weights = Tier::kNvme;
  l[2].optimizer = Tier::kNvme;
  return l;
}

TEST_P(TransfersTest, WeightsArriveAsStoredFromEverySource) {
  std::mt19937 rng(std::random_device{}());
  HostArena arena({.pinning = Pinning::kOff});
  const std::vector<LayerDesc> desc = layers();
  NvmeStore nvme({.dir = (dir / "nvme").string(), .backend = BackendKind::kThreads},
                 LayerStore::nvme_bytes(desc, FloatDType::kBF16));
  LayerStore store(arena, desc, FloatDType::kBF16, FloatDType::kF32, &nvme);
  // The expected device contents of every tensor, in the streaming dtype.
  std::map<std::pair<int, std::size_t>, std::vector<std::uint8_t>> expect;
  for (std::size_t l = 0; l < store.layers(); ++l) {
    LayerAccess a = store.access(l, kAllParts, AccessMode::kOverwrite);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const TensorState& t = a[i];
      std::vector<std::uint8_t> dense(t.numel * 2);
      if (t.quant.type == kernels::QuantType::kNone) {
        fill_bf16(t.stream, t.numel, rng);
        std::memcpy(dense.data(), t.stream, dense.size());
      } else {
        std::vector<std::uint16_t> src(t.numel);
        fill_bf16(src.data(), t.numel, rng);
        kernels::quantize(t.quant, src.data(), FloatDType::kBF16, t.rows, t.cols, t.stream);
        kernels::dequantize(t.quant, t.stream, t.rows, t.cols, FloatDType::kBF16, dense.data());
      }
      expect[{static_cast<int>(l), i}] = dense;
    }
  }
  store.flush();
  auto dev = kernels::make_sim_device(
      {.name = "sim0", .bytes_cap = 64 << 20, .link = {.bytes_per_s = 2e9, .latency_s = 1e-6}});
  Transfers xfer(store, arena, {dev.get()}, {.max_chunk_bytes = GetParam()});
  std::unique_ptr<DeviceWeights> w = xfer.load_weights(0, {0, 1, 2});
  w->ready()->synchronize();
  for (auto& [key, want] : expect) {
    const std::vector<std::uint8_t> got =
        download_all(*dev, w->tensor(key.first, key.second), want.size());
    ASSERT_EQ(got, want) << "layer " << key.first << " tensor " << key.second;
  }
  const TransferStats st = xfer.stats();
  // Quantised tensors crossed the link at their quantised size.
  const std::uint64_t q8 = kernels::quant_bytes({.type = kernels::QuantType::kQ8_0}, 67, 64);
  EXPECT_LT(st.weights_up, 22 * 2 + 22 * 67 * 2 + 67 * 64 * 2 + 33 * 65 * 2 + 33 * 2);
  EXPECT_GE(st.weights_up, q8);
  EXPECT_EQ(st.weights_dequantised, (67 * 64 + 33 * 65) * 2u);
  EXPECT_GT(st.nvme_read, 0u);
  w.reset();
  dev->synchronize();  // releases are stream-ordered
  EXPECT_EQ(dev->memory().bytes_in_use, 0u);
}

// A layer's NVMe read failing while the layer before it is still being copied up (in small chunks
// over a slow link): load_weights reports the read's error, and the earlier layer's host staging
// outlives its queued copies. It used to be unmapped under them, and the next chunk's copy crashed
// the process (seen as a segfault in `rondo train` under an injected read fault).
TEST_F(TransfersTest, AFailedReadLeavesQueuedUploadsTheirStaging) {
  HostArena arena({.pinning = Pinning::kOff});
  std::vector<LayerDesc> desc(2);
  for (LayerDesc& l : desc) {
    l.tensors = {{"w", 2 << 20, false, -1}};  // 4 MiB of bf16: 4 blocks of 1 MiB
    l.base = Tier::kNvme;
  }
  // Layer 0's four reads succeed; every later one (layer 1's) fails. One request at a time, so
  // that the reads are attempted in the order asked (layer 0's, then layer 1's).
  NvmeStore nvme({.dir = (dir / "nvme").string(),
                  .backend = BackendKind::kThreads,
                  .queue_depth = 1,
                  .block_bytes = 1 << 20,
                  .faults = parse_fault_rules("eio:read:5+", "test")},
                 LayerStore::nvme_bytes(desc, FloatDType::kBF16));
  LayerStore store(arena, desc, FloatDType::kBF16, FloatDType::kF32, &nvme);
  for (std::size_t l = 0; l < store.layers(); ++l) {
    LayerAccess a = store.access(l, kAllParts, AccessMode::kOverwrite);
    std::memset(a[0].stream, 0x3c, a[0].numel * 2);
  }
  store.flush();
  // 64 chunks of 64 KiB at 100 MB/s: about 40 ms of copies queued when layer 1's read fails.
  auto dev = kernels::make_sim_device(
      {.name = "sim0", .bytes_cap = 64 << 20, .link = {.bytes_per_s = 1e8, .latency_s = 1e-6}});
  Transfers xfer(store, arena, {dev.get()}, {.max_chunk_bytes = 64 << 10});
  try {
    xfer.load_weights(0, {0, 1});
    FAIL() << "a failed read loaded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.kind, IoError::Kind::kOs) << e.what();
    EXPECT_EQ(e.error, EIO) << e.what();
    EXPECT_NE(e.region.find("layer 1"), std::string::npos) << "not layer 1's read: " << e.what();
  }
  // Nothing is left on the stream that reads host memory given back.
  EXPECT_TRUE(xfer.weight_upload_stream(0).query());
  dev->synchronize();
  EXPECT_EQ(dev->memory().bytes_in_use, 0u);
}

INSTANTIATE_TEST_SUITE_P(Chunks, TransfersTest, ::testing::Values(256ull << 20, 4096ull, 100ull));

TEST(Transfers, ActivationsGoDownAndUpUnchangedAndGradientsLandInTheStore) {
  std::mt19937 rng(std::random_device{}());
  HostArena arena({.pinning = Pinning::kOff});
  LayerStore store(arena, {{{{"g", 1001, true, -1}}}}, FloatDType::kF32, FloatDType::kF32);
  auto a = kernels::make_sim_device({.name = "a", .bytes_cap = 1 << 20});
  auto b = kernels::make_sim_device({.name = "b", .index = 1, .bytes_cap = 1 << 20});
  Transfers xfer(store, arena, {a.get(), b.get()});
  std::vector<float> x(1001);
  for (float& v : x)
    v = std::uniform_real_distribution<float>(-1, 1)(rng);
  kernels::DeviceBuffer src = a->allocate(x.size() * 4);
  kernels::Stream& s = a->create_stream("compute");
  s.upload(src.data(), x.data(), x.size() * 4);
  auto done = a->create_event();
  s.record(*done);
  Staged st = xfer.download(0, src.data(), x.size() * 4, *done);
  Uploaded up = xfer.upload(1, st, x.size() * 4);
  up.ready->synchronize();
  std::vector<std::uint8_t> got = download_all(*b, up.buffer.data(), x.size() * 4);
  EXPECT_EQ(std::memcmp(got.data(), x.data(), x.size() * 4), 0);
  // The gradient region of layer 0, from device a.
  auto ev = xfer.download_gradients(0, 0, src.data(), *done);
  ev->synchronize();
  EXPECT_EQ(std::memcmp(store.grad_bytes(0).data, x.data(), x.size() * 4), 0);
  xfer.recycle(std::move(st.host));
  up.buffer.reset();
  src.reset();
}

}  // namespace
}  // namespace rondo::offload
