// The OpenMP thread pools of torch's CPU kernels, kept from sleeping: the caller's pool released
// while devices compute, a device's pool released between its jobs. The engine calls these; they
// touch nothing but the OpenMP runtime, looked up at run time (none, or one without the calls, is
// left as it is). See Note [One OpenMP pool while the devices compute] in openmp.cpp.
//
//   {
//     const kernels::QuietCallerOpenMp quiet;  // the calling thread only waits from here
//     ...                                       // devices compute on their own threads
//   }
#pragma once

namespace rondo::kernels {

// Releases the calling thread's OpenMP pool, if it has one (call outside any parallel region).
void release_openmp_pool();

// For its scope: the calling thread's OpenMP pool released, and its parallel regions on it alone
// (its thread count back afterwards). Neither copied nor moved.
struct QuietCallerOpenMp {
  QuietCallerOpenMp();
  ~QuietCallerOpenMp();
  QuietCallerOpenMp(QuietCallerOpenMp&&) = delete;
  int saved_threads = 0;  // 0: the runtime has no such calls
};

}  // namespace rondo::kernels
