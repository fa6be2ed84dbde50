// Page-locking ("pinning") host memory for DMA, and probing CUDA devices. The host arena
// (offload/) pins through these functions so that it never talks to CUDA itself. Without CUDA
// support compiled in, or without a driver or GPU, pinning is unavailable and returns false.
#pragma once

#include <cstddef>

namespace rondo::kernels {

// True when a CUDA driver and at least one device are present (page-locking can work).
bool host_pinning_available();
// Page-locks [data, data + bytes) for every device. False when it cannot (no GPU, RLIMIT_MEMLOCK,
// out of lockable memory): the memory stays usable, only unpinned. Never throws.
bool pin_host_range(void* data, std::size_t bytes) noexcept;
// Undoes pin_host_range. Warns on failure, never throws.
void unpin_host_range(void* data) noexcept;

}  // namespace rondo::kernels
