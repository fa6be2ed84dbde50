// The ThreadSanitizer side of parallel.h: why its annotations are there, and the suppressions for
// oneTBB's own objects. Empty outside a ThreadSanitizer build.
#include "kernels/cpu/parallel.h"

// Note [ThreadSanitizer and oneTBB]
// Debian's libtbb is not instrumented, so ThreadSanitizer does not see the synchronisation inside
// it: neither the hand-off of our chunks to TBB's threads and back, nor that of TBB's own task
// and partitioner objects, which its header code (instrumented) allocates on one thread, uses on
// another and recycles through a pool (or on the caller's stack) after an atomic count drops.
//  - Our chunks: the caller releases one object before parallel_for, which each chunk acquires on
//    entry; each chunk releases another on exit, which the caller acquires after parallel_for.
//    Chunks stay unordered among themselves, so a real race between chunks (two writing one
//    element) or with the caller is still reported (checked by injecting one).
//  - TBB's objects: suppressed below are reports whose innermost frame is in TBB's headers
//    (race_top: our accesses are never innermost there), and reports in which either access comes
//    through one of TBB's task-tree and stealing functions (these catch TBB's objects recycled
//    into memory that our code or the C++ library then touches). Our chunks never run under those
//    frames (their stacks are run_body / work_balance / execute), so none of this can hide a race
//    in our code. Names are those of oneTBB 2021 (Debian 12).
// Nothing of this exists outside a ThreadSanitizer build.
#if defined(__SANITIZE_THREAD__)
extern "C" const char* __tsan_default_suppressions() {
  return "race_top:/oneapi/tbb/\n"
         "race:tbb::detail::d1::fold_tree\n"
         "race:tbb::detail::d1::node::node\n"
         "race:tbb::detail::d1::tree_node\n"
         "race:tbb::detail::d1::wait_node\n"
         "race:tbb::detail::d1::wait_context\n"
         "race:tbb::detail::d1::small_object_allocator\n"
         "race:tbb::detail::d1::task_group_context\n"
         "race:check_being_stolen\n"
         "race:mark_task_stolen\n"
         "race:offer_work\n";
}
namespace rondo::kernels::detail {
void tsan_suppressions_linked() {}
}  // namespace rondo::kernels::detail
#endif
