// Loops over oneTBB threads for the CPU kernels (adamw.cpp, quant.cpp), annotated so that
// ThreadSanitizer sees the hand-off of each chunk to a TBB thread and back (Note [ThreadSanitizer
// and oneTBB] in parallel.cpp). Chunks are unordered among themselves; the caller's task arena
// decides how many threads join. Internal to kernels/cpu/; baseline code only (see simd.h).
//
//   parallel_for_tiles(tiles, [&](std::size_t first, std::size_t last) { /* tiles [first, last) */
//   });
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cstddef>

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define RONDO_TSAN_ACQUIRE(addr) __tsan_acquire(addr)
#define RONDO_TSAN_RELEASE(addr) __tsan_release(addr)
#else
#define RONDO_TSAN_ACQUIRE(addr) ((void)(addr))
#define RONDO_TSAN_RELEASE(addr) ((void)(addr))
#endif

namespace rondo::kernels::detail {

#if defined(__SANITIZE_THREAD__)
// Defined next to the suppressions in parallel.cpp: calling it pulls that object file, and with it
// __tsan_default_suppressions, into every binary that runs a parallel loop.
void tsan_suppressions_linked();
#endif

// body(first, last) over tiles [0, tiles), spread over oneTBB threads.
template <class Body>
void parallel_for_tiles(std::size_t tiles, const Body& body) {
#if defined(__SANITIZE_THREAD__)
  tsan_suppressions_linked();
#endif
  // Only their addresses matter: the synchronisation objects TSan tracks. Two of them, so that
  // no chunk acquires what another released: chunks stay unordered among themselves.
  int start = 0, done = 0;
  RONDO_TSAN_RELEASE(&start);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, tiles),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      RONDO_TSAN_ACQUIRE(&start);
                      body(r.begin(), r.end());
                      RONDO_TSAN_RELEASE(&done);
                    });
  RONDO_TSAN_ACQUIRE(&done);
}

}  // namespace rondo::kernels::detail
