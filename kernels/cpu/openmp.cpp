#include "kernels/cpu/openmp.h"

#include <dlfcn.h>

namespace rondo::kernels {

// Note [One OpenMP pool while the devices compute]
// torch's CPU kernels run their parallel loops on OpenMP (GNU libgomp in the torch wheel), which
// keeps a pool of worker threads per thread that started a parallel region: the main thread's
// (made while it loaded the model) and each device's compute thread's. libgomp counts every
// pooled thread, and when it counts more than the machine has CPUs it stops spinning between
// regions (100 spins instead of ~3 ms) and puts its threads to sleep on a futex after each one:
// on this project's 2-core machine the CPU device's two compute threads then slept and were woken
// about 2000 times a second each, and 20% of the cores sat idle during a training step (the same
// block, measured on the main thread alone, kept both busy). So:
// - While the engine runs, the calling thread only waits: its pool is released first (OpenMP 5's
//   omp_pause_resource_all: the pool's threads exit), and its own parallel regions run on it
//   alone until the engine returns (it still prepares each step's inputs, whose rotary tables
//   alone would make a new pool).
// - Simulated GPUs compute on the same cores, each on a thread of its own: each releases its pool
//   after every job, so that only devices computing at the same moment hold one.
// The calls are looked up at run time: an OpenMP runtime without them (or none) is left as it is.

namespace {

struct OpenMpApi {
  int (*pause)(int) = reinterpret_cast<int (*)(int)>(::dlsym(RTLD_DEFAULT,
                                                             "omp_pause_resource_all"));
  int (*get_max_threads)() = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT,
                                                                 "omp_get_max_threads"));
  void (*set_num_threads)(int) = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT,
                                                                         "omp_set_num_threads"));
};

const OpenMpApi& openmp() {
  static const OpenMpApi api;
  return api;
}

}  // namespace

void release_openmp_pool() {
  if (openmp().pause) openmp().pause(/*omp_pause_soft: the threads go, the runtime stays*/ 1);
}

QuietCallerOpenMp::QuietCallerOpenMp() {
  release_openmp_pool();
  if (openmp().get_max_threads && openmp().set_num_threads) {
    saved_threads = openmp().get_max_threads();
    openmp().set_num_threads(1);
  }
}

QuietCallerOpenMp::~QuietCallerOpenMp() {
  if (saved_threads > 0) openmp().set_num_threads(saved_threads);
}

}  // namespace rondo::kernels
