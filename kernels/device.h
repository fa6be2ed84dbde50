// The device interface the engine is written against: devices, their streams and events, device
// memory and copies. Two implementations: SimDevice (kernels/cpu/, CPU-backed, with an emulated
// link) and CudaDevice (kernels/cuda/). The engine cannot tell them apart
// (docs/architecture.md §6).
//
// Invariants:
//  - Work on one stream runs in the order it was enqueued; across streams only events order it.
//  - Streams are owned by their device and live as long as it does; device buffers must be released
//    before their device is destroyed (the device checks, and reports a leak).
//  - Nothing here includes torch: raw pointers only.
//
// Usage:
//   auto dev = kernels::make_sim_device({.name = "sim0", .bytes_cap = 1 << 30,
//                                        .link = {.bytes_per_s = 1e9, .latency_s = 10e-6}});
//   kernels::Stream& up = dev->create_stream("upload");
//   kernels::DeviceBuffer buf = dev->allocate(n, &up);
//   up.upload(buf.data(), host, n);
//   auto done = dev->create_event();
//   up.record(*done);
//   compute.wait(*done);          // any stream, of this or another device
//   done->synchronize();          // or block the host
//   auto t0 = dev->create_event(kernels::EventTiming::kOn);  // device-side timing:
//   compute.record(*t0); ...; compute.record(*t1); t1->synchronize(); t1->seconds_since(*t0);
//   up.dequantize(nf4, q.data(), rows, cols, kernels::FloatDType::kBF16, w.data());  // quant.h
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kernels/error.h"
#include "kernels/quant.h"

namespace rondo::kernels {

enum class DeviceKind { kSim, kCuda };
const char* to_string(DeviceKind kind);

// The host link of a device, one direction. PCIe is full duplex: uploads and downloads each get
// this bandwidth; two copies in the same direction share it.
struct LinkSpec {
  double bytes_per_s = 0;  // bytes/s; 0 = unlimited (no emulation)
  double latency_s = 0;    // seconds added to every copy
};

struct DeviceInfo {
  DeviceKind kind = DeviceKind::kSim;
  int index = 0;                  // ordinal among devices of its kind
  std::string name;               // "NVIDIA GeForce RTX 4090", "sim0"
  std::uint64_t bytes_total = 0;  // physical device memory (SimDevice: its capacity)
  std::uint64_t bytes_cap = 0;    // the most Rondo will allocate: min(cap setting, total)
  LinkSpec link;                  // SimDevice: the emulated link; CUDA: 0 (measured, not declared)
  // CUDA only (0 / empty when unknown):
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  std::string pci_bus_id;                    // "0000:01:00.0"
  int pcie_gen = 0, pcie_width = 0;          // current link (it drops when idle)
  int pcie_gen_max = 0, pcie_width_max = 0;  // what the link can do
};

// Device memory in use, as Rondo allocated it (requested bytes).
struct MemoryStats {
  std::uint64_t bytes_in_use = 0;
  std::uint64_t bytes_peak = 0;
  std::uint64_t bytes_cap = 0;
  std::uint64_t allocations = 0;  // live buffers
};

// Bytes enqueued for transfer, per direction, since the device was opened.
struct TrafficStats {
  std::uint64_t bytes_h2d = 0;      // host -> this device
  std::uint64_t bytes_d2h = 0;      // this device -> host
  std::uint64_t bytes_d2d_out = 0;  // this device -> another device
  std::uint64_t bytes_d2d_in = 0;   // another device -> this device
};

// An allocation that does not fit under the device's cap. Expected in planning, so it carries the
// figures as fields as well as in the message.
class OutOfMemory : public Error {
 public:
  OutOfMemory(const std::string& device, std::uint64_t requested, std::uint64_t used,
              std::uint64_t capacity);
  std::uint64_t requested, used, capacity;
};

class Device;
class Stream;

// A point in a stream's work. Like a CUDA event: query/synchronize/wait refer to the most recent
// record() at the time they are called; an event never recorded counts as complete.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool query() = 0;        // has the recorded work finished?
  virtual void synchronize() = 0;  // block the host until it has
  // Seconds from `start`'s latest record to this event's, as the device's streams reached them
  // (device time, not when the host enqueued them). Both must have been created with
  // EventTiming::kOn on this device, recorded and completed (synchronize first); throws Error
  // otherwise.
  virtual double seconds_since(Event& start) = 0;
};

enum class EventTiming { kOff, kOn };  // kOn: the event can be timed (seconds_since)

// Move-only device memory. Released on the stream it was allocated on (stream-ordered) or at once
// when allocated without a stream.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, std::size_t bytes, Stream* stream)
      : device_(device), data_(data), bytes_(bytes), stream_(stream) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Device* device() const { return device_; }
  explicit operator bool() const { return device_ != nullptr; }
  void reset() noexcept;

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Stream* stream_ = nullptr;
};

enum class StreamPriority { kNormal, kHigh };

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device& device() = 0;
  virtual const std::string& name() const = 0;

  // Copies, ordered in this stream. `host` memory must stay valid until the copy is done (record
  // an event); on CUDA it should be pinned to overlap. The stream belongs to the device side.
  virtual void upload(void* dst_device, const void* src_host, std::size_t bytes) = 0;
  virtual void download(void* dst_host, const void* src_device, std::size_t bytes) = 0;
  // From this stream's device to `dst_device` (PCIe peer or through the host).
  virtual void copy_to_peer(void* dst, Device& dst_device, const void* src, std::size_t bytes) = 0;
  virtual void fill(void* dst_device, std::uint8_t value, std::size_t bytes) = 0;
  // Dequantises a quantised (rows, cols) tensor (kernels/quant.h) into `out` values, both in this
  // device's memory, ordered in this stream like a copy: a frozen base travels quantised and is
  // expanded here just before use. The result equals kernels::dequantize() on the CPU bit for bit.
  // Bad arguments throw Error at once (check_dequantize), before anything is enqueued.
  virtual void dequantize(const QuantFormat& format, const void* src_device, std::int64_t rows,
                          std::int64_t cols, FloatDType out, void* dst_device) = 0;

  // Issues computation in stream order. SimDevice: `work` runs later on the stream's own thread.
  // CudaDevice: `work` runs now on the caller's thread, with this device current, and must only
  // enqueue GPU work on native_handle(). Either way the work is ordered like a copy would be.
  virtual void enqueue(std::function<void()> work) = 0;

  virtual void record(Event& event) = 0;
  // Later work on this stream waits for `event` (of any device of the same kind).
  virtual void wait(Event& event) = 0;
  // Blocks until all enqueued work is done; rethrows the first failure of a SimDevice task.
  virtual void synchronize() = 0;
  virtual bool query() = 0;
  virtual void* native_handle() = 0;  // cudaStream_t, or nullptr for SimDevice
};

// Memory a device's work allocates other than through Device::allocate, counted against the
// device's cap all the same: what torch allocates while it computes on a simulated device (in host
// memory, standing in for the card's: engine::TorchStreamScope). Thread-safe; stays valid after
// the device is gone (a tensor may outlive it).
class MemoryAccount {
 public:
  virtual ~MemoryAccount() = default;
  // Counts `bytes` as in use, or throws OutOfMemory if that would pass the cap.
  virtual void reserve(std::uint64_t bytes) = 0;
  virtual void release(std::uint64_t bytes) noexcept = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual const DeviceInfo& info() const = 0;

  // A new stream owned by the device. `name` shows in errors and traces.
  virtual Stream& create_stream(const std::string& name,
                                StreamPriority priority = StreamPriority::kNormal) = 0;
  virtual std::unique_ptr<Event> create_event(EventTiming timing = EventTiming::kOff) = 0;

  // Device memory; with a stream, allocation and release are ordered in it; without one, release
  // waits for all of the device's work, like cudaFree. Throws OutOfMemory
  // when it would pass the cap. bytes == 0 gives an empty buffer.
  virtual DeviceBuffer allocate(std::size_t bytes, Stream* stream = nullptr) = 0;

  virtual MemoryStats memory() const = 0;
  virtual TrafficStats traffic() const = 0;
  // Lowers or raises the cap (not above the physical memory); allocations already made stay.
  virtual void set_memory_cap(std::uint64_t bytes) = 0;
  virtual void synchronize() = 0;  // every stream of the device
  // Where the memory that work on this device allocates by itself is counted (MemoryAccount);
  // nullptr where that allocator is the device's own (a CUDA device whose allocator torch's
  // shares, engine::torch_cuda_allocator) or counts nothing.
  virtual std::shared_ptr<MemoryAccount> memory_account() { return nullptr; }

 protected:
  friend class DeviceBuffer;
  virtual void release(void* data, std::size_t bytes, Stream* stream) noexcept = 0;
};

}  // namespace rondo::kernels
