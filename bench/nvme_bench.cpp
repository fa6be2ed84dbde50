// nvme_bench: the NVMe store's GB/s as a ratio of the drive's, measured side by side in one run
// (never absolute targets: these machines are shared).
//
//  - raw:   one thread, a plain O_DIRECT pwrite loop then a pread loop (measure_disk_raw): what any
//           program gets without a queue. The baseline.
//  - probe: measure_disk, the backend at queue depth 32 without checksums: what the queue buys.
//  - store: NvmeStore writes then reads every region (layer-sized, 4 transfers in flight, from
//           host-arena buffers), with checksums computed and verified: what the engine gets.
// Same bytes and request size (the store's block) for all three, in each folder given.
//
//   nvme_bench [--dir /mnt/nvme/x]... [--bytes 1GiB] [--request 1MiB] [--region 64MiB]
//              [--backend auto|io_uring|threads]
// Prints one table; exit code 0 unless something failed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "offload/disk_speed.h"
#include "offload/host_arena.h"
#include "offload/nvme_store.h"

using namespace rondo;
using Clock = std::chrono::steady_clock;

namespace {

struct StoreSpeed {
  double write = 0, read = 0;
  std::string summary;
};

StoreSpeed store_speed(const std::string& dir, std::uint64_t bytes, std::uint64_t request,
                       std::uint64_t region_bytes, offload::BackendKind kind) {
  constexpr int kInFlight = 4;
  offload::NvmeStore store({.dir = dir, .backend = kind, .block_bytes = request}, bytes);
  std::vector<offload::Region> regions;
  for (std::uint64_t at = 0; at < bytes; at += region_bytes)
    regions.push_back(store.reserve(std::min(region_bytes, bytes - at),
                                    "layer " + std::to_string(regions.size())));
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  std::vector<offload::HostBuffer> buffers;
  std::mt19937_64 rng(42);
  for (int i = 0; i < kInFlight; ++i) {
    buffers.push_back(arena.allocate(region_bytes, offload::Purpose::kStaging));
    auto* w = buffers.back().as<std::uint64_t>();
    for (std::uint64_t k = 0; k < region_bytes / 8; ++k)
      w[k] = rng();
  }
  auto pass = [&](bool write) {
    std::vector<offload::IoTicket> tickets(kInFlight);
    auto t0 = Clock::now();
    for (std::size_t i = 0; i < regions.size(); ++i) {
      offload::IoTicket& slot = tickets[i % kInFlight];
      store.wait(slot);  // the buffer is free again
      void* buf = buffers[i % kInFlight].data();
      slot = write ? store.write(regions[i], 0, buf, regions[i].bytes)
                   : store.read(regions[i], 0, buf, regions[i].bytes);
    }
    for (offload::IoTicket& t : tickets)
      store.wait(t);
    return static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - t0).count();
  };
  StoreSpeed s;
  s.write = pass(true);
  s.read = pass(false);
  s.summary = store.summary();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> dirs;
  std::uint64_t bytes = 1ull << 30, request = 1ull << 20, region = 64ull << 20;
  offload::BackendKind kind = offload::BackendKind::kAuto;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (i + 1 >= argc) throw Error("option " + a + " needs a value");
      if (a == "--dir")
        dirs.push_back(argv[++i]);
      else if (a == "--bytes")
        bytes = parse_bytes(argv[++i], "--bytes");
      else if (a == "--request")
        request = parse_bytes(argv[++i], "--request");
      else if (a == "--region")
        region = parse_bytes(argv[++i], "--region");
      else if (a == "--backend")
        kind = offload::parse_backend_kind(argv[++i], "--backend");
      else
        throw Error("unknown option " + a +
                    " (known: --dir, --bytes, --request, --region, --backend)");
    }
    if (dirs.empty()) dirs.push_back(".");
    bytes = (bytes + region - 1) / region * region;
    std::printf(
        "| folder | backend | O_DIRECT | raw write | raw read | probe write | probe read "
        "| store write | store read | store/raw write | store/raw read |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<std::string> notes;
    for (const std::string& dir : dirs) {
      offload::DiskSpeed raw = offload::measure_disk_raw(dir, bytes, request);
      offload::DiskSpeed probe = offload::measure_disk(dir, bytes, kind, request, 32);
      StoreSpeed store = store_speed(dir, bytes, request, region, kind);
      auto g = [](double b) { return b / 1e9; };
      std::printf("| %s | %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
                  dir.c_str(), probe.backend.c_str(), probe.direct ? "yes" : "no",
                  g(raw.write_bytes_per_s), g(raw.read_bytes_per_s), g(probe.write_bytes_per_s),
                  g(probe.read_bytes_per_s), g(store.write), g(store.read),
                  store.write / raw.write_bytes_per_s, store.read / raw.read_bytes_per_s);
      notes.push_back(dir + ": store " + store.summary);
      if (!probe.backend_note.empty()) notes.push_back(dir + ": " + probe.backend_note);
    }
    std::printf("\nGB/s (10^9 bytes/s) over %s in %s requests; store regions of %s, 4 in flight\n",
                format_bytes(bytes).c_str(), format_bytes(request).c_str(),
                format_bytes(region).c_str());
    for (const std::string& n : notes)
      std::printf("%s\n", n.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nvme_bench: %s\n", e.what());
    return 1;
  }
}
