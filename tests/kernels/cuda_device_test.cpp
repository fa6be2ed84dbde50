// CudaDevice on a real GPU (label cuda; every test skips itself without one): copies, kernels in
// stream order, events across streams and devices, the memory cap, pinned host memory.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_device.h"
#include "kernels/host_memory.h"

cudaError_t launch_pattern(void* data, std::size_t n, std::uint8_t seed, cudaStream_t stream);

namespace rondo::kernels {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    probe_ = probe_cuda();
    if (probe_.devices.empty()) GTEST_SKIP() << "no CUDA device: " << probe_.error;
  }
  CudaProbe probe_;
};

TEST_F(CudaDeviceTest, CopiesOfOddAndLargeSizesAreExact) {
  auto dev = open_cuda_device({.index = 0});
  Stream& s = dev->create_stream("copy");
  std::mt19937 rng(std::random_device{}());
  for (std::size_t n :
       {std::size_t{1}, std::size_t{22}, std::size_t{4097}, (std::size_t{256} << 20) + 5}) {
    std::vector<std::uint8_t> host(n), back(n);
    for (auto& b : host)
      b = static_cast<std::uint8_t>(rng());
    DeviceBuffer buf = dev->allocate(n, &s);
    s.upload(buf.data(), host.data(), n);
    s.download(back.data(), buf.data(), n);
    s.synchronize();
    EXPECT_EQ(0, std::memcmp(back.data(), host.data(), n)) << n << " bytes";
  }
}

TEST_F(CudaDeviceTest, AKernelRunsInStreamOrderBetweenCopies) {
  auto dev = open_cuda_device({.index = 0});
  Stream& s = dev->create_stream("compute");
  const std::size_t n = 4097;
  std::vector<std::uint8_t> host(n, 0xEE), back(n);
  DeviceBuffer buf = dev->allocate(n, &s);
  s.upload(buf.data(), host.data(), n);
  s.enqueue([&] {
    ASSERT_EQ(launch_pattern(buf.data(), n, 3, static_cast<cudaStream_t>(s.native_handle())),
              cudaSuccess);
  });
  s.download(back.data(), buf.data(), n);
  s.synchronize();
  for (std::size_t i = 0; i < n; ++i)
    ASSERT_EQ(back[i], static_cast<std::uint8_t>(i * 7 + 3)) << "byte " << i;
}

TEST_F(CudaDeviceTest, EventsOrderStreamsAndDevices) {
  auto d0 = open_cuda_device({.index = 0});
  auto d1 = probe_.devices.size() > 1 ? open_cuda_device({.index = 1}) : nullptr;
  Device& other = d1 ? *d1 : *d0;
  Stream& a = d0->create_stream("a");
  Stream& b = other.create_stream("b");
  const std::size_t n = 64 << 20;
  DeviceBuffer src = d0->allocate(n, &a);
  DeviceBuffer dst = other.allocate(n, &b);
  auto written = d0->create_event();
  a.enqueue([&] {
    ASSERT_EQ(launch_pattern(src.data(), n, 9, static_cast<cudaStream_t>(a.native_handle())),
              cudaSuccess);
  });
  a.record(*written);
  b.wait(*written);
  b.fill(dst.data(), 0, n);
  std::vector<std::uint8_t> back(n);
  // b copies only after a's kernel: peer copy ordered by the event.
  auto filled = other.create_event();
  b.record(*filled);
  a.wait(*filled);
  a.copy_to_peer(dst.data(), other, src.data(), n);
  a.synchronize();
  b.download(back.data(), dst.data(), n);
  b.synchronize();
  EXPECT_TRUE(written->query());
  for (std::size_t i = 0; i < n; i += 4099)
    ASSERT_EQ(back[i], static_cast<std::uint8_t>(i * 7 + 9)) << "byte " << i;
}

// Timing events give device time: two records around a kernel and a 256 MiB copy are apart by at
// least the copy's time at any PCIe speed (< 100 GB/s), however fast the host enqueued them.
TEST_F(CudaDeviceTest, TimingEventsMeasureDeviceTime) {
  auto dev = open_cuda_device({.index = 0});
  Stream& s = dev->create_stream("compute");
  const std::size_t n = std::size_t{256} << 20;
  std::vector<std::uint8_t> back(n);
  DeviceBuffer buf = dev->allocate(n, &s);
  auto t0 = dev->create_event(EventTiming::kOn), t1 = dev->create_event(EventTiming::kOn);
  s.record(*t0);
  s.enqueue([&] {
    ASSERT_EQ(launch_pattern(buf.data(), n, 5, static_cast<cudaStream_t>(s.native_handle())),
              cudaSuccess);
  });
  s.download(back.data(), buf.data(), n);
  s.record(*t1);
  t1->synchronize();
  const double seconds = t1->seconds_since(*t0);
  EXPECT_GT(seconds, static_cast<double>(n) / 100e9);
  EXPECT_LT(seconds, 10.0);
  EXPECT_EQ(back[12345], static_cast<std::uint8_t>(12345 * 7 + 5));
  auto plain = dev->create_event();
  s.record(*plain);
  s.synchronize();
  EXPECT_THROW(plain->seconds_since(*t0), Error);
}

TEST_F(CudaDeviceTest, TheMemoryCapMakesABigCardSmall) {
  auto dev = open_cuda_device({.index = 0, .bytes_cap = 1ull << 30});
  EXPECT_EQ(dev->info().bytes_cap, 1ull << 30);
  DeviceBuffer a = dev->allocate(768ull << 20);
  try {
    dev->allocate(512ull << 20);
    FAIL() << "allocation past the cap succeeded";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.capacity, 1ull << 30);
    EXPECT_EQ(e.used, 768ull << 20);
  }
  a.reset();
  DeviceBuffer b = dev->allocate(1ull << 30);
  EXPECT_EQ(dev->memory().bytes_peak, 1ull << 30);
}

TEST_F(CudaDeviceTest, HostMemoryCanBePinned) {
  EXPECT_TRUE(host_pinning_available());
  std::vector<std::uint8_t> host(1 << 20);
  ASSERT_TRUE(pin_host_range(host.data(), host.size()));
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, host.data()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost);
  unpin_host_range(host.data());
}

}  // namespace
}  // namespace rondo::kernels
