// SimDevice: stream order, events across streams and devices, copies of odd and large sizes, the
// emulated link's lower bound, capacity errors, failures inside tasks. Also run under TSan.
#include "kernels/cpu/sim_device.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace rondo::kernels {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::uint8_t> random_bytes(std::size_t n, std::mt19937& rng) {
  std::vector<std::uint8_t> v(n);
  std::uniform_int_distribution<int> dist(0, 255);
  for (auto& b : v)
    b = static_cast<std::uint8_t>(dist(rng));
  return v;
}

std::mt19937 fresh_rng() {
  std::random_device rd;
  auto seed = rd();
  std::printf("seed %u\n", seed);
  return std::mt19937(seed);
}

// A log that tasks on several threads append to.
struct Log {
  std::mutex mutex;
  std::vector<int> order;
  void add(int x) {
    std::lock_guard lock(mutex);
    order.push_back(x);
  }
};

TEST(SimDevice, WorkOnOneStreamRunsInEnqueueOrder) {
  auto dev = make_sim_device({});
  Stream& s = dev->create_stream("compute");
  Log log;
  for (int i = 0; i < 200; ++i)
    s.enqueue([&log, i] { log.add(i); });
  s.synchronize();
  ASSERT_EQ(log.order.size(), 200u);
  for (int i = 0; i < 200; ++i)
    EXPECT_EQ(log.order[i], i);
}

TEST(SimDevice, ComputeSeesAnUploadEnqueuedBeforeIt) {
  auto rng = fresh_rng();
  auto dev = make_sim_device({.link = {.bytes_per_s = 5e9, .latency_s = 1e-4}});
  Stream& s = dev->create_stream("compute");
  auto host = random_bytes(4097, rng);
  DeviceBuffer buf = dev->allocate(host.size(), &s);
  s.upload(buf.data(), host.data(), host.size());
  std::vector<std::uint8_t> seen(host.size());
  s.enqueue([&] { std::memcpy(seen.data(), buf.data(), seen.size()); });
  s.synchronize();
  EXPECT_EQ(seen, host);
}

// Stream A is held by a gate the test controls; B waits on an event recorded on A after the gate.
// Until the gate opens, B must not run its work; afterwards it runs after A's.
void check_cross_stream_wait(Stream& a, Stream& b, Event& event) {
  Log log;
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  a.enqueue([opened, &log] {
    opened.wait();
    log.add(1);
  });
  a.record(event);
  b.wait(event);
  b.enqueue([&log] { log.add(2); });

  EXPECT_FALSE(event.query());
  EXPECT_FALSE(b.query());
  gate.set_value();
  b.synchronize();
  EXPECT_TRUE(event.query());
  ASSERT_EQ(log.order.size(), 2u);
  EXPECT_EQ(log.order[0], 1);
  EXPECT_EQ(log.order[1], 2);
}

TEST(SimDevice, WaitOrdersWorkAcrossStreams) {
  auto dev = make_sim_device({});
  auto event = dev->create_event();
  check_cross_stream_wait(dev->create_stream("a"), dev->create_stream("b"), *event);
}

TEST(SimDevice, WaitOrdersWorkAcrossDevices) {
  auto d0 = make_sim_device({.name = "sim0", .index = 0});
  auto d1 = make_sim_device({.name = "sim1", .index = 1});
  auto event = d0->create_event();
  check_cross_stream_wait(d0->create_stream("a"), d1->create_stream("b"), *event);
}

TEST(SimDevice, EventSynchronizeBlocksUntilRecordedWorkIsDone) {
  auto dev = make_sim_device({});
  Stream& s = dev->create_stream("s");
  auto event = dev->create_event();
  std::atomic<bool> ran{false};
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  s.enqueue([opened, &ran] {
    opened.wait();
    ran = true;
  });
  s.record(*event);
  EXPECT_FALSE(event->query());
  std::thread opener([&] { gate.set_value(); });
  event->synchronize();
  EXPECT_TRUE(ran.load());
  EXPECT_TRUE(event->query());
  opener.join();
}

TEST(SimDevice, EventNeverRecordedIsComplete) {
  auto dev = make_sim_device({});
  auto event = dev->create_event();
  EXPECT_TRUE(event->query());
  event->synchronize();
  Stream& s = dev->create_stream("s");
  s.wait(*event);  // nothing to wait for
  s.synchronize();
}

// Timing events measure when the stream reached them, not when the host enqueued: the host
// enqueues both records at once (while the stream is held), the stream passes them 30 ms apart.
TEST(SimDevice, TimingEventsMeasureStreamTimeNotEnqueueTime) {
  auto dev = make_sim_device({});
  Stream& s = dev->create_stream("s");
  auto t0 = dev->create_event(EventTiming::kOn), t1 = dev->create_event(EventTiming::kOn);
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  s.enqueue([opened] { opened.wait(); });
  s.record(*t0);
  s.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); });
  s.record(*t1);
  EXPECT_THROW(t1->seconds_since(*t0), Error);  // not complete yet
  gate.set_value();
  t1->synchronize();
  const double seconds = t1->seconds_since(*t0);
  EXPECT_GE(seconds, 0.03);
  EXPECT_LT(seconds, 5.0);
  EXPECT_LE(t0->seconds_since(*t1), -0.03);
  // Events without timing, or never recorded, cannot be timed.
  auto plain = dev->create_event();
  s.record(*plain);
  s.synchronize();
  EXPECT_THROW(plain->seconds_since(*t0), Error);
  EXPECT_THROW(t1->seconds_since(*plain), Error);
  EXPECT_THROW(t1->seconds_since(*dev->create_event(EventTiming::kOn)), Error);
}

TEST(SimDevice, AWaitKeepsTheRecordItWasIssuedAgainst) {
  // Like CUDA: re-recording an event does not change what an earlier wait waits for.
  auto dev = make_sim_device({});
  Stream& a = dev->create_stream("a");
  Stream& b = dev->create_stream("b");
  Stream& c = dev->create_stream("c");
  auto event = dev->create_event();
  a.record(*event);
  a.synchronize();
  c.wait(*event);  // the first record: already complete
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  b.enqueue([opened] { opened.wait(); });
  b.record(*event);  // the event now points at blocked work
  EXPECT_FALSE(event->query());
  c.synchronize();  // would hang if c's wait followed the new record
  gate.set_value();
  event->synchronize();
}

TEST(SimDevice, CopiesOfOddAndLargeSizesAreExact) {
  auto rng = fresh_rng();
  auto d0 = make_sim_device({.name = "sim0", .bytes_cap = 256ull << 20});
  auto d1 = make_sim_device({.name = "sim1", .index = 1, .bytes_cap = 256ull << 20});
  Stream& s0 = d0->create_stream("copy");
  for (std::size_t n : {std::size_t{1}, std::size_t{22}, std::size_t{4097}, std::size_t{64} << 20,
                        (std::size_t{64} << 20) + 3}) {
    SCOPED_TRACE("bytes " + std::to_string(n));
    auto host = random_bytes(n, rng);
    std::vector<std::uint8_t> back(n + 2, 0xAB), peer_back(n + 2, 0xAB);
    DeviceBuffer a = d0->allocate(n, &s0);
    DeviceBuffer b = d1->allocate(n);
    s0.upload(a.data(), host.data(), n);
    s0.download(back.data() + 1, a.data(), n);
    s0.copy_to_peer(b.data(), *d1, a.data(), n);
    s0.synchronize();
    Stream& s1 = d1->create_stream("back" + std::to_string(n));
    s1.download(peer_back.data() + 1, b.data(), n);
    s1.synchronize();
    EXPECT_EQ(0, std::memcmp(back.data() + 1, host.data(), n));
    EXPECT_EQ(0, std::memcmp(peer_back.data() + 1, host.data(), n));
    // Nothing written outside the destination.
    EXPECT_EQ(back.front(), 0xAB);
    EXPECT_EQ(back.back(), 0xAB);
    EXPECT_EQ(peer_back.back(), 0xAB);
  }
}

// Small fills, and large ones spread over threads in 1 MiB tiles (a ragged last one), within the
// buffer only.
TEST(SimDevice, FillSetsEveryByte) {
  auto dev = make_sim_device({});
  Stream& s = dev->create_stream("s");
  for (std::size_t n : {std::size_t{22}, (std::size_t{9} << 20) + 5}) {
    DeviceBuffer buf = dev->allocate(n + 2, &s);
    s.fill(buf.data(), 0xAB, n + 2);
    s.fill(static_cast<std::uint8_t*>(buf.data()) + 1, 0x5A, n);
    std::vector<std::uint8_t> back(n + 2);
    s.download(back.data(), buf.data(), n + 2);
    s.synchronize();
    EXPECT_EQ(back.front(), 0xAB);
    EXPECT_EQ(back.back(), 0xAB);
    EXPECT_EQ(std::count(back.begin() + 1, back.end() - 1, 0x5A), static_cast<long>(n)) << n;
  }
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(SimDevice, ACopyNeverFinishesBeforeBandwidthAndLatencyAllow) {
  const double bw = 200e6, latency = 2e-3;
  const std::size_t n = 1 << 20;
  auto dev =
      make_sim_device({.bytes_cap = 8 << 20, .link = {.bytes_per_s = bw, .latency_s = latency}});
  Stream& s = dev->create_stream("up");
  std::vector<std::uint8_t> host(n, 7), back(n);
  DeviceBuffer buf = dev->allocate(n, &s);

  auto start = Clock::now();
  s.upload(buf.data(), host.data(), n);
  s.synchronize();
  EXPECT_GE(seconds_since(start), n / bw + latency);

  start = Clock::now();
  s.download(back.data(), buf.data(), n);
  s.synchronize();
  EXPECT_GE(seconds_since(start), n / bw + latency);
  EXPECT_EQ(back, host);
}

TEST(SimDevice, CopiesInOneDirectionShareTheLink) {
  const double bw = 200e6, latency = 1e-3;
  const std::size_t n = 1 << 20;
  auto dev =
      make_sim_device({.bytes_cap = 8 << 20, .link = {.bytes_per_s = bw, .latency_s = latency}});
  Stream& s1 = dev->create_stream("up1");
  Stream& s2 = dev->create_stream("up2");
  std::vector<std::uint8_t> host(n, 3);
  DeviceBuffer a = dev->allocate(n), b = dev->allocate(n);
  auto start = Clock::now();
  s1.upload(a.data(), host.data(), n);
  s2.upload(b.data(), host.data(), n);
  s1.synchronize();
  s2.synchronize();
  EXPECT_GE(seconds_since(start), 2 * n / bw + latency);
}

TEST(SimDevice, PeerCopyPaysBothLinks) {
  const std::size_t n = 1 << 20;
  auto d0 = make_sim_device(
      {.name = "sim0", .bytes_cap = 4 << 20, .link = {.bytes_per_s = 400e6, .latency_s = 1e-3}});
  auto d1 = make_sim_device({.name = "sim1",
                             .index = 1,
                             .bytes_cap = 4 << 20,
                             .link = {.bytes_per_s = 200e6, .latency_s = 2e-3}});
  Stream& s = d0->create_stream("peer");
  DeviceBuffer a = d0->allocate(n), b = d1->allocate(n);
  auto start = Clock::now();
  s.copy_to_peer(b.data(), *d1, a.data(), n);
  s.synchronize();
  EXPECT_GE(seconds_since(start), n / 200e6 + 3e-3);
  EXPECT_EQ(d0->traffic().bytes_d2d_out, n);
  EXPECT_EQ(d1->traffic().bytes_d2d_in, n);
}

TEST(SimDevice, TrafficIsCountedPerDirection) {
  auto dev = make_sim_device({});
  Stream& s = dev->create_stream("s");
  std::vector<std::uint8_t> host(4097);
  DeviceBuffer buf = dev->allocate(4097);
  s.upload(buf.data(), host.data(), 4097);
  s.upload(buf.data(), host.data(), 22);
  s.download(host.data(), buf.data(), 1);
  s.synchronize();
  TrafficStats t = dev->traffic();
  EXPECT_EQ(t.bytes_h2d, 4097u + 22u);
  EXPECT_EQ(t.bytes_d2h, 1u);
}

TEST(SimDevice, AllocationBeyondCapacityNamesRequestedUsedAndCapacity) {
  auto dev = make_sim_device({.name = "sim3", .bytes_cap = 1000});
  DeviceBuffer a = dev->allocate(600);
  try {
    dev->allocate(500);
    FAIL() << "allocation past the capacity succeeded";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.requested, 500u);
    EXPECT_EQ(e.used, 600u);
    EXPECT_EQ(e.capacity, 1000u);
    std::string msg = e.what();
    EXPECT_NE(msg.find("sim3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("500 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("600 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1000 bytes"), std::string::npos) << msg;
  }
  EXPECT_EQ(dev->memory().bytes_in_use, 600u);
  a.reset();
  DeviceBuffer c = dev->allocate(1000);  // fits once the first is gone
  EXPECT_EQ(dev->memory().bytes_peak, 1000u);
  EXPECT_EQ(dev->memory().allocations, 1u);
}

TEST(SimDevice, StreamOrderedReleaseWaitsForTheStream) {
  auto dev = make_sim_device({.bytes_cap = 100});
  Stream& s = dev->create_stream("s");
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  DeviceBuffer buf = dev->allocate(100, &s);
  s.enqueue([opened] { opened.wait(); });
  buf.reset();  // freed only when the stream reaches this point
  EXPECT_EQ(dev->memory().bytes_in_use, 100u);
  gate.set_value();
  s.synchronize();
  EXPECT_EQ(dev->memory().bytes_in_use, 0u);
}

TEST(SimDevice, AFailedTaskSkipsLaterWorkButStillCompletesEvents) {
  auto dev = make_sim_device({});
  Stream& a = dev->create_stream("a");
  Stream& b = dev->create_stream("b");
  auto event = dev->create_event();
  bool later_ran = false;
  a.enqueue([] { throw Error("boom"); });
  a.enqueue([&] { later_ran = true; });
  a.record(*event);
  b.wait(*event);
  b.synchronize();  // does not hang: the record still completes
  EXPECT_THROW(a.synchronize(), Error);
  EXPECT_FALSE(later_ran);
  // The record completed, and reports the stream's error, as cudaEventSynchronize does.
  EXPECT_THROW(event->synchronize(), Error);
  EXPECT_THROW(event->query(), Error);
}

// An injected copy fault fails its copy on its stream: later work there is skipped, events
// recorded after it report it, one recorded before does not.
TEST(SimDevice, AnInjectedCopyFaultFailsLikeACudaFault) {
  auto dev = make_sim_device({.fail_copy = 1});
  Stream& s = dev->create_stream("up");
  std::vector<std::uint8_t> host(64, 3);
  DeviceBuffer buf = dev->allocate(64, &s);
  auto before = dev->create_event(), after = dev->create_event();
  s.upload(buf.data(), host.data(), 64);  // copy 0
  s.record(*before);
  s.upload(buf.data(), host.data(), 64);  // copy 1: fails
  s.record(*after);
  before->synchronize();
  try {
    after->synchronize();
    FAIL() << "the fault was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("copy 1 failed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.synchronize(), Error);
}

TEST(SimDevice, NegativeLinkFiguresAreRejected) {
  EXPECT_THROW(make_sim_device({.link = {.bytes_per_s = -1}}), Error);
}

// Page faults of the calling thread so far.
long thread_faults() {
  rusage r{};
  getrusage(RUSAGE_THREAD, &r);
  return r.ru_minflt;
}

// Faults taken while writing a buffer of this device's, freshly allocated.
long faults_writing(Device& d, std::size_t bytes) {
  DeviceBuffer b = d.allocate(bytes);
  const long before = thread_faults();
  std::memset(b.data(), 0x5a, bytes);
  return thread_faults() - before;
}

TEST(SimDevice, ACachingDeviceReusesFreedBuffersWithoutFaultingPagesAgain) {
  // 48 MiB: above glibc's largest mmap threshold, so a plain free returns the pages to the kernel.
  constexpr std::size_t kBytes = 48u << 20;
  const long pages = static_cast<long>(kBytes / static_cast<std::size_t>(sysconf(_SC_PAGESIZE)));
  auto caching = make_sim_device({.bytes_cap = 1ull << 30, .cache_freed = true});
  faults_writing(*caching, kBytes);  // first touch: the pages come in
  EXPECT_LT(faults_writing(*caching, kBytes), pages / 10);
  // Kept bytes are not in use: the cap and the device events see only live buffers.
  EXPECT_EQ(caching->memory().bytes_in_use, 0u);
  EXPECT_EQ(caching->memory().allocations, 0u);
  {
    DeviceBuffer a = caching->allocate(kBytes);
    EXPECT_EQ(caching->memory().bytes_in_use, kBytes);
  }
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // The control: without the cache the same allocation faults every page in again (glibc).
  auto plain = make_sim_device({.bytes_cap = 1ull << 30});
  faults_writing(*plain, kBytes);
  EXPECT_GT(faults_writing(*plain, kBytes), pages / 2);
#endif
}

}  // namespace
}  // namespace rondo::kernels
