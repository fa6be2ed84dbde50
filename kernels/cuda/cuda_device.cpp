#include "kernels/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dequant.h"
#include "kernels/host_memory.h"
#include "kernels/memory_ledger.h"
#include "kernels/pci.h"

namespace rondo::kernels {
namespace {

// Makes `device` current on this thread for a scope (CUDA's current device is per thread).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    RONDO_CUDA_CHECK(cudaGetDevice(&previous_), device);
    if (previous_ != device) RONDO_CUDA_CHECK(cudaSetDevice(device), device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

void warn_cuda(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    cudaGetLastError();
    std::fprintf(stderr, "rondo: warning: %s failed: %s\n", what, cudaGetErrorString(code));
  }
}

// Never returns a count written by a failed call: cudaGetDeviceCount leaves its argument alone
// when there is no driver.
int device_count(std::string* why) {
  int count = 0;
  cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) {
    cudaGetLastError();
    if (why) {
      // The runtime reports a missing driver as "insufficient": a driver version of 0 says which.
      int driver = 0;
      if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
      cudaGetLastError();
      if ((code == cudaErrorInsufficientDriver || code == cudaErrorNoDevice) && driver == 0)
        *why = "no NVIDIA driver found (libcuda is not installed or cannot be loaded)";
      else if (code == cudaErrorInsufficientDriver)
        *why = "the NVIDIA driver (CUDA " + std::to_string(driver / 1000) + "." +
               std::to_string(driver % 1000 / 10) +
               ") is older than this build's CUDA runtime needs; update the driver";
      else
        *why = std::string(cudaGetErrorName(code)) + ": " + cudaGetErrorString(code);
    }
    return 0;
  }
  if (count == 0 && why) *why = "the CUDA driver reports no devices";
  return count;
}

DeviceInfo describe(int index) {
  cudaDeviceProp prop{};
  RONDO_CUDA_CHECK(cudaGetDeviceProperties(&prop, index), index);
  DeviceInfo info;
  info.kind = DeviceKind::kCuda;
  info.index = index;
  info.name = prop.name;
  info.bytes_total = prop.totalGlobalMem;
  info.bytes_cap = prop.totalGlobalMem;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, index) == cudaSuccess) {
    info.pci_bus_id = bus;
    PciLink link = read_pci_link(info.pci_bus_id);
    info.pcie_gen = link.gen;
    info.pcie_width = link.width;
    info.pcie_gen_max = link.gen_max;
    info.pcie_width_max = link.width_max;
  } else {
    cudaGetLastError();
  }
  return info;
}

class CudaDevice;

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, bool timing) : device_(device), timing_(timing) {
    DeviceGuard guard(device);
    // Blocking sync: a host waiting on an event sleeps instead of spinning a core the optimizer
    // needs. Timing costs a little on every record, so only the events asked for have it.
    RONDO_CUDA_CHECK(cudaEventCreateWithFlags(
                         &event_, cudaEventBlockingSync | (timing ? 0u : cudaEventDisableTiming)),
                     device);
  }
  ~CudaEvent() override { warn_cuda(cudaEventDestroy(event_), "cudaEventDestroy"); }
  bool query() override {
    cudaError_t code = cudaEventQuery(event_);
    if (code == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    RONDO_CUDA_CHECK(code, device_);
    return true;
  }
  void synchronize() override { RONDO_CUDA_CHECK(cudaEventSynchronize(event_), device_); }
  double seconds_since(Event& start) override {
    auto* other = dynamic_cast<CudaEvent*>(&start);
    if (other == nullptr || !timing_ || !other->timing_ || other->device_ != device_)
      throw Error("seconds_since: both events must be timing events of cuda:" +
                  std::to_string(device_));
    float ms = 0;
    RONDO_CUDA_CHECK(cudaEventElapsedTime(&ms, other->event_, event_), device_);
    return ms / 1e3;
  }

  cudaEvent_t handle() const { return event_; }
  int device() const { return device_; }

 private:
  int device_;
  bool timing_;
  cudaEvent_t event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice& device, int index, std::string name, StreamPriority priority)
      : device_(device), index_(index), name_(std::move(name)) {
    DeviceGuard guard(index);
    int least = 0, greatest = 0;  // greatest is the highest priority (numerically lowest)
    RONDO_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest), index);
    int value = priority == StreamPriority::kHigh ? greatest : least;
    RONDO_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, value), index);
  }
  ~CudaStream() override {
    warn_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    warn_cuda(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }

  Device& device() override;
  const std::string& name() const override { return name_; }
  void upload(void* dst, const void* src, std::size_t bytes) override;
  void download(void* dst, const void* src, std::size_t bytes) override;
  void copy_to_peer(void* dst, Device& dst_device, const void* src, std::size_t bytes) override;
  void fill(void* dst, std::uint8_t value, std::size_t bytes) override {
    if (bytes == 0) return;
    DeviceGuard guard(index_);
    RONDO_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_), index_);
  }
  void dequantize(const QuantFormat& format, const void* src, std::int64_t rows, std::int64_t cols,
                  FloatDType out, void* dst) override {
    check_dequantize(format, rows, cols, out, dst);
    DeviceGuard guard(index_);
    RONDO_CUDA_CHECK(launch_dequantize(format, src, rows, cols, out, dst, stream_), index_);
  }
  void enqueue(std::function<void()> work) override {
    DeviceGuard guard(index_);
    work();
  }
  void record(Event& event) override {
    auto* cuda = dynamic_cast<CudaEvent*>(&event);
    if (cuda == nullptr) throw Error("stream " + name_ + " can only record CUDA events");
    if (cuda->device() != index_)
      throw Error("stream " + name_ + " cannot record an event created on cuda:" +
                  std::to_string(cuda->device()) + " (record on the event's own device)");
    RONDO_CUDA_CHECK(cudaEventRecord(cuda->handle(), stream_), index_);
  }
  void wait(Event& event) override {
    auto* cuda = dynamic_cast<CudaEvent*>(&event);
    if (cuda == nullptr) throw Error("stream " + name_ + " can only wait on CUDA events");
    RONDO_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda->handle(), 0), index_);
  }
  void synchronize() override { RONDO_CUDA_CHECK(cudaStreamSynchronize(stream_), index_); }
  bool query() override {
    cudaError_t code = cudaStreamQuery(stream_);
    if (code == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    RONDO_CUDA_CHECK(code, index_);
    return true;
  }
  void* native_handle() override { return stream_; }
  cudaStream_t handle() const { return stream_; }

 private:
  CudaDevice& device_;
  int index_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const CudaDeviceOptions& options)
      : index_(options.index),
        info_(describe(options.index)),
        ledger_(0),
        allocator_(options.allocator) {
    info_.bytes_cap =
        options.bytes_cap == 0 ? info_.bytes_total : std::min(options.bytes_cap, info_.bytes_total);
    ledger_.set_cap(info_.bytes_cap);
    DeviceGuard guard(index_);
    RONDO_CUDA_CHECK(cudaStreamCreateWithFlags(&internal_, cudaStreamNonBlocking), index_);
    if (allocator_) {
      allocator_->set_cap(info_.bytes_cap);
      return;
    }
    // A pool of our own, so that its release threshold (keep up to the cap cached between stage
    // jobs) does not change torch's or anyone else's allocations.
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = index_;
    RONDO_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props), index_);
    std::uint64_t threshold = info_.bytes_cap;
    RONDO_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
                     index_);
  }

  ~CudaDevice() override {
    try {
      DeviceGuard guard(index_);
      warn_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      streams_.clear();
      MemoryStats left = ledger_.stats();
      if (left.allocations != 0)
        std::fprintf(stderr, "rondo: warning: cuda:%d closed with %llu buffers (%s) allocated\n",
                     index_, static_cast<unsigned long long>(left.allocations),
                     format_bytes(left.bytes_in_use).c_str());
      warn_cuda(cudaStreamDestroy(internal_), "cudaStreamDestroy");
      if (pool_) warn_cuda(cudaMemPoolDestroy(pool_), "cudaMemPoolDestroy");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rondo: warning: closing cuda:%d: %s\n", index_, e.what());
    }
  }

  const DeviceInfo& info() const override { return info_; }

  Stream& create_stream(const std::string& name, StreamPriority priority) override {
    std::lock_guard lock(mutex_);
    streams_.push_back(std::make_unique<CudaStream>(
        *this, index_, "cuda:" + std::to_string(index_) + "/" + name, priority));
    return *streams_.back();
  }

  std::unique_ptr<Event> create_event(EventTiming timing) override {
    return std::make_unique<CudaEvent>(index_, timing == EventTiming::kOn);
  }

  DeviceBuffer allocate(std::size_t bytes, Stream* stream) override {
    if (bytes == 0) return {};
    if (stream != nullptr && &stream->device() != this)
      throw InternalError("stream " + stream->name() + " used with cuda:" + std::to_string(index_));
    std::string name = "cuda:" + std::to_string(index_) + " (" + info_.name + ")";
    ledger_.reserve(bytes, name);
    DeviceGuard guard(index_);
    cudaStream_t s = stream ? static_cast<cudaStream_t>(stream->native_handle()) : internal_;
    void* data = nullptr;
    cudaError_t code = cudaSuccess;
    if (allocator_) {
      try {
        data = allocator_->allocate(bytes, s);
      } catch (...) {
        ledger_.unreserve(bytes);
        throw;
      }
      if (data == nullptr) code = cudaErrorMemoryAllocation;
    } else {
      code = cudaMallocFromPoolAsync(&data, bytes, pool_, s);
    }
    if (code == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      ledger_.unreserve(bytes);
      // The card itself is full (other processes, torch's cache), or with a shared allocator the
      // cap is, by the engine's buffers and torch's tensors together: what the driver says.
      std::size_t free_bytes = 0, total = 0;
      cudaMemGetInfo(&free_bytes, &total);
      if (allocator_)
        throw OutOfMemory(name + " (the engine's buffers and torch's tensors together)", bytes,
                          total - free_bytes, info_.bytes_cap);
      throw OutOfMemory(name + " (device full)", bytes, total - free_bytes, total);
    }
    if (code != cudaSuccess) ledger_.unreserve(bytes);
    RONDO_CUDA_CHECK(code, index_);
    if (stream == nullptr) RONDO_CUDA_CHECK(cudaStreamSynchronize(internal_), index_);
    return DeviceBuffer(this, data, bytes, stream);
  }

  MemoryStats memory() const override { return ledger_.stats(); }
  TrafficStats traffic() const override { return traffic_.stats(); }
  void set_memory_cap(std::uint64_t bytes) override {
    info_.bytes_cap = std::min(bytes, info_.bytes_total);
    ledger_.set_cap(info_.bytes_cap);
    if (allocator_) {
      allocator_->set_cap(info_.bytes_cap);
      return;
    }
    std::uint64_t threshold = info_.bytes_cap;
    RONDO_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
                     index_);
  }
  void synchronize() override {
    DeviceGuard guard(index_);
    RONDO_CUDA_CHECK(cudaDeviceSynchronize(), index_);
  }

  int index() const { return index_; }
  TrafficCounters traffic_;

 protected:
  void release(void* data, std::size_t bytes, Stream* stream) noexcept override {
    try {
      DeviceGuard guard(index_);
      if (allocator_) {
        // Reusable in the order of the stream it was allocated on, as with cudaFreeAsync there;
        // without a stream, only once all the device's work is done.
        if (stream == nullptr) warn_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        allocator_->release(data);
      } else if (stream != nullptr) {
        warn_cuda(cudaFreeAsync(data, static_cast<cudaStream_t>(stream->native_handle())),
                  "cudaFreeAsync");
      } else {
        // Not stream-ordered: like cudaFree, wait for all work that may still use it.
        warn_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        warn_cuda(cudaFreeAsync(data, internal_), "cudaFreeAsync");
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rondo: warning: freeing on cuda:%d: %s\n", index_, e.what());
    }
    ledger_.unreserve(bytes);
  }

 private:
  int index_;
  DeviceInfo info_;
  MemoryLedger ledger_;
  std::shared_ptr<const ExternalAllocator> allocator_;
  cudaMemPool_t pool_ = nullptr;
  cudaStream_t internal_ = nullptr;
  std::mutex mutex_;
  std::vector<std::unique_ptr<CudaStream>> streams_;
};

Device& CudaStream::device() {
  return device_;
}

void CudaStream::upload(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(index_);
  RONDO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), index_);
  device_.traffic_.h2d += bytes;
}

void CudaStream::download(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(index_);
  RONDO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), index_);
  device_.traffic_.d2h += bytes;
}

void CudaStream::copy_to_peer(void* dst, Device& dst_device, const void* src, std::size_t bytes) {
  auto* peer = dynamic_cast<CudaDevice*>(&dst_device);
  if (peer == nullptr)
    throw Error("cannot copy from " + name_ + " to " + dst_device.info().name +
                ": devices of different kinds");
  if (bytes == 0) return;
  DeviceGuard guard(index_);
  RONDO_CUDA_CHECK(cudaMemcpyPeerAsync(dst, peer->index(), src, index_, bytes, stream_), index_);
  device_.traffic_.d2d_out += bytes;
  peer->traffic_.d2d_in += bytes;
}

bool has_device() {
  static const bool present = device_count(nullptr) > 0;
  return present;
}

}  // namespace

CudaProbe probe_cuda() {
  CudaProbe probe;
  probe.compiled = true;
  if (cudaDriverGetVersion(&probe.driver_version) != cudaSuccess) probe.driver_version = 0;
  if (cudaRuntimeGetVersion(&probe.runtime_version) != cudaSuccess) probe.runtime_version = 0;
  cudaGetLastError();
  int count = device_count(&probe.error);
  for (int i = 0; i < count; ++i) {
    try {
      probe.devices.push_back(describe(i));
    } catch (const std::exception& e) {
      probe.error += std::string(probe.error.empty() ? "" : "; ") + e.what();
    }
  }
  return probe;
}

std::unique_ptr<Device> open_cuda_device(const CudaDeviceOptions& options) {
  std::string why;
  int count = device_count(&why);
  if (options.index < 0 || options.index >= count)
    throw Error("cannot open cuda:" + std::to_string(options.index) + ": " +
                (count == 0 ? "no CUDA device (" + why + ")"
                            : std::to_string(count) + " CUDA device(s) present"));
  return std::make_unique<CudaDevice>(options);
}

bool host_pinning_available() {
  return has_device();
}

bool pin_host_range(void* data, std::size_t bytes) noexcept {
  if (!has_device() || bytes == 0) return false;
  // Portable: pinned for every device, since any device may run any stage.
  if (cudaHostRegister(data, bytes, cudaHostRegisterPortable) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

void unpin_host_range(void* data) noexcept {
  warn_cuda(cudaHostUnregister(data), "cudaHostUnregister");
}

}  // namespace rondo::kernels
