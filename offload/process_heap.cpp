#include "offload/process_heap.h"

#include <limits>  // also defines __GLIBC__ where glibc is the C library

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace rondo::offload {

bool tune_process_heap() {
#if defined(__GLIBC__)
  bool ok = mallopt(M_ARENA_MAX, 1) == 1;
  ok = mallopt(M_MMAP_THRESHOLD, kHeapBlockLimit) == 1 && ok;
  ok = mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1 && ok;  // ~2 GiB
  return ok;
#else
  return false;
#endif
}

}  // namespace rondo::offload
