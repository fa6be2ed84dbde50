#include "kernels/device.h"

#include <utility>

namespace rondo::kernels {

const char* to_string(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kSim:
      return "sim";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "?";
}

OutOfMemory::OutOfMemory(const std::string& device, std::uint64_t requested_bytes,
                         std::uint64_t used_bytes, std::uint64_t capacity_bytes)
    : Error("out of memory on " + device + ": requested " + format_bytes(requested_bytes) + " (" +
            std::to_string(requested_bytes) + " bytes) with " + format_bytes(used_bytes) + " (" +
            std::to_string(used_bytes) + " bytes) in use of a " + format_bytes(capacity_bytes) +
            " (" + std::to_string(capacity_bytes) +
            " bytes) capacity; use more microbatches, shorter sequences, smaller stages or a "
            "larger device memory cap"),
      requested(requested_bytes),
      used(used_bytes),
      capacity(capacity_bytes) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (device_ != nullptr) device_->release(data_, bytes_, stream_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  stream_ = nullptr;
}

}  // namespace rondo::kernels
