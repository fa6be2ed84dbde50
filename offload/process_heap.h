#pragma once
// The C library's heap for a training process (glibc's malloc, which torch's CPU tensors and the
// simulated devices allocate from).
//
// Left at its defaults, glibc gives every thread that allocates its own arena of 64 MiB heaps,
// whose memory goes back to the kernel as soon as a heap empties, and its mmap threshold starts at
// 128 KiB. A training step allocates and frees the same temporaries every step from several
// threads (the devices' streams, the loaders): with the defaults they came back as fresh pages
// that the kernel faulted in and zeroed again, step after step. On the CPU (SmolLM2-135M, 2
// threads) that was a quarter of the step's time, and steps took from 2.4 to 8.7 s.

#include <cstddef>

namespace rondo::offload {

// Blocks up to this size come from the heap once tuned (glibc's largest mmap threshold); larger
// ones are mapped and unmapped each time. The engine keeps a CPU device's big per-step
// temporaries (the head's logit chunks) under it.
inline constexpr std::size_t kHeapBlockLimit = 32u << 20;

// Call first thing in main(), before any thread starts: one arena for all threads, blocks up to
// kHeapBlockLimit from the heap (whatever the dynamic threshold would be), and the heap's top
// returned to the kernel only when about 2 GiB of it are free: the process keeps what a step
// needed for the next one. Larger blocks are still mapped and returned at once (a long data line
// does not stay resident). No effect under sanitizers (their allocator) or without glibc.
// Returns whether the settings took.
bool tune_process_heap();

}  // namespace rondo::offload
