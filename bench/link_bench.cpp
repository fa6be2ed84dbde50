// link_bench: what copies between host and device cost, as ratios measured side by side in one
// run (never absolute targets: these machines are shared).
//
//  - sim: the emulated link's achieved bandwidth over the configured one (at most 1 by
//    construction; close to 1 means the emulation does not slow copies further).
//  - cuda (on a GPU machine): host->device and device->host GB/s from a pinned host-arena buffer
//    against a pageable one, on a device capped like a consumer card (--cap, default 24GB).
//
//   link_bench [--bytes 256MiB] [--reps 5] [--cap 24GB]
// Prints one table; exit code 0 unless something failed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/sim_device.h"
#include "kernels/cuda/cuda_device.h"
#include "offload/host_arena.h"

using namespace rondo;
using Clock = std::chrono::steady_clock;

namespace {

struct Row {
  std::string what;
  double measured_gbs;
  double baseline_gbs;
  std::string baseline;
};

// Best of `reps` (the least disturbed run), in GB/s.
double best_gbs(kernels::Stream& s, bool upload, void* dev, void* host, std::size_t bytes,
                int reps) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto start = Clock::now();
    if (upload)
      s.upload(dev, host, bytes);
    else
      s.download(host, dev, bytes);
    s.synchronize();
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, bytes / seconds / 1e9);
  }
  return best;
}

void sim_rows(std::vector<Row>& rows, std::size_t bytes, int reps) {
  for (double gbs : {2.0, 8.0}) {
    kernels::LinkSpec link{.bytes_per_s = gbs * 1e9, .latency_s = 10e-6};
    auto dev = kernels::make_sim_device({.bytes_cap = bytes, .link = link});
    kernels::Stream& s = dev->create_stream("bench");
    kernels::DeviceBuffer buf = dev->allocate(bytes);
    std::vector<std::uint8_t> host(bytes, 1);
    double up = best_gbs(s, true, buf.data(), host.data(), bytes, reps);
    double down = best_gbs(s, false, buf.data(), host.data(), bytes, reps);
    char what[64];
    std::snprintf(what, sizeof what, "sim %.0f GB/s link, upload", gbs);
    rows.push_back({what, up, gbs, "configured"});
    std::snprintf(what, sizeof what, "sim %.0f GB/s link, download", gbs);
    rows.push_back({what, down, gbs, "configured"});
  }
}

void cuda_rows(std::vector<Row>& rows, std::size_t bytes, int reps, std::uint64_t cap) {
  auto gpu = kernels::open_cuda_device({.index = 0, .bytes_cap = cap});
  kernels::Stream& s = gpu->create_stream("bench");
  kernels::DeviceBuffer buf = gpu->allocate(bytes, &s);
  offload::HostArena pinned_arena({.pinning = offload::Pinning::kOn});
  offload::HostArena pageable_arena({.pinning = offload::Pinning::kOff});
  offload::HostBuffer pinned = pinned_arena.allocate(bytes, offload::Purpose::kStaging);
  offload::HostBuffer pageable = pageable_arena.allocate(bytes, offload::Purpose::kStaging);
  std::memset(pinned.data(), 1, bytes);
  std::memset(pageable.data(), 1, bytes);
  for (bool upload : {true, false}) {
    double fast = best_gbs(s, upload, buf.data(), pinned.data(), bytes, reps);
    double slow = best_gbs(s, upload, buf.data(), pageable.data(), bytes, reps);
    rows.push_back({std::string("cuda:0 ") + (upload ? "upload" : "download") + " pinned", fast,
                    slow, "pageable"});
  }
  s.synchronize();
  buf.reset();
  std::printf("cuda:0 %s, capped at %s, peak in use %s\n", gpu->info().name.c_str(),
              format_bytes(gpu->info().bytes_cap).c_str(),
              format_bytes(gpu->memory().bytes_peak).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t bytes = 256ull << 20;
  int reps = 5;
  std::uint64_t cap = 24ull << 30;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (i + 1 >= argc) throw Error("option " + a + " needs a value");
      if (a == "--bytes")
        bytes = parse_bytes(argv[++i], "--bytes");
      else if (a == "--reps")
        reps = std::max(1, std::stoi(argv[++i]));
      else if (a == "--cap")
        cap = parse_bytes(argv[++i], "--cap");
      else
        throw Error("unknown option " + a + " (known: --bytes, --reps, --cap)");
    }
    std::vector<Row> rows;
    sim_rows(rows, bytes, reps);
    kernels::CudaProbe probe = kernels::probe_cuda();
    if (probe.devices.empty())
      std::printf("no CUDA device (%s): CUDA rows skipped\n", probe.error.c_str());
    else
      cuda_rows(rows, bytes, reps, cap);

    std::printf("\n| copy (%s, best of %d) | GB/s | baseline | baseline GB/s | ratio |\n",
                format_bytes(bytes).c_str(), reps);
    std::printf("|---|---|---|---|---|\n");
    for (const Row& r : rows)
      std::printf("| %s | %.2f | %s | %.2f | %.3f |\n", r.what.c_str(), r.measured_gbs,
                  r.baseline.c_str(), r.baseline_gbs, r.measured_gbs / r.baseline_gbs);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "link_bench: %s\n", e.what());
    return 1;
  }
}
