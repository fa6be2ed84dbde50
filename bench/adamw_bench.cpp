// adamw_bench: the fused CPU AdamW kernel's memory throughput against what the machine's memory
// can do, as ratios measured side by side in one run (docs/architecture.md §9; issue 4,
// benchmark c).
//
//  - AdamW GB/s: bytes the step must move (gradient read; master, m and v read and written;
//    streaming copy written) per second, per gradient/stream dtype and SIMD path.
//  - Triad GB/s: a[i] = b[i] + s*c[i] over f32 arrays with the same footprint, on the same oneTBB
//    threads and tiles (STREAM's convention: 3 x 4 bytes per element, write-allocate not counted;
//    the AdamW count does not count it either).
//  - AdamW/triad: the aim is >= 0.8 (the kernel is then memory-bound, as it should be).
//  - Same-traffic GB/s: a pass with AdamW's streams and next to no arithmetic (see
//    same_traffic_pass); AdamW/same near 1 says the arithmetic is hidden behind memory. On a
//    machine with few cores the triad's three streams per core may fall short of the memory's
//    bandwidth (seen on a 2-vCPU VM: ~14 GB/s per core for the triad, ~24 for AdamW's 8 streams
//    and for the same-traffic pass), and this is the fairer ceiling.
// bench/adamw_bench.py runs this with --json and adds torch.optim.AdamW on the CPU, measured in
// the same run with the same thread counts.
//
//   adamw_bench [--elements 64M] [--reps 5] [--threads N] [--json]
// Each figure is the best of --reps passes (the least disturbed: these machines are shared), at
// 1 thread and at N (default: all oneTBB sees). Exit code 0 unless something failed.
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/error.h"

using namespace rondo;
using kernels::FloatDType;
using kernels::SimdPath;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kTile = 8192;  // as the kernel's tiles

// Uninitialised storage, first touched by the threads that will use it (NUMA placement).
template <class T>
std::unique_ptr<T[]> alloc_touched(std::size_t n, T value) {
  std::unique_ptr<T[]> p(new T[n]);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, kTile),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      std::fill(p.get() + r.begin(), p.get() + r.end(), value);
                    });
  return p;
}

// Best of `reps` timings of fn(), in seconds.
template <class Fn>
double best_seconds(int reps, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

double triad_gbs(std::size_t footprint_bytes, int reps) {
  const std::size_t n = footprint_bytes / 12;
  auto a = alloc_touched<float>(n, 0.0f);
  auto b = alloc_touched<float>(n, 1.0f);
  auto c = alloc_touched<float>(n, 2.0f);
  const float s = 0.5f;
  const double seconds = best_seconds(reps, [&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, kTile),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        float* __restrict pa = a.get();
                        const float* __restrict pb = b.get();
                        const float* __restrict pc = c.get();
                        for (std::size_t i = r.begin(); i < r.end(); ++i)
                          pa[i] = pb[i] + s * pc[i];
                      });
  });
  if (a[n / 2] != 2.0f) throw InternalError("triad computed the wrong thing");
  return 12.0 * n / seconds / 1e9;
}

// The same streams as an AdamW step with next to no arithmetic: gradient read; master, m and v
// read and written; streaming copy written (bf16/f16 by truncation). Where AdamW keeps up with
// this, its arithmetic is hidden behind memory; on few cores the triad's three streams may not
// reach the memory's bandwidth, and this is the fairer ceiling.
template <class G, class S>
void same_traffic_pass(const G* grad_, float* p_, float* m_, float* v_, S* stream_, std::size_t n) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, kTile),
                    [&](const tbb::blocked_range<std::size_t>& r) {
                      // No aliasing, so the compiler vectorises this loop.
                      const G* __restrict grad = grad_;
                      float* __restrict p = p_;
                      float* __restrict m = m_;
                      float* __restrict v = v_;
                      S* __restrict stream = stream_;
                      for (std::size_t i = r.begin(); i < r.end(); ++i) {
                        const float g = static_cast<float>(grad[i]);
                        p[i] += g;
                        m[i] += g;
                        v[i] += g;
                        if constexpr (sizeof(S) == 2) {
                          std::uint32_t bits;
                          std::memcpy(&bits, &p[i], 4);
                          stream[i] = static_cast<S>(bits >> 16);
                        } else if constexpr (sizeof(S) == 4) {
                          stream[i] = p[i];
                        }
                      }
                    });
}

struct Scenario {
  const char* name;
  FloatDType grad;
  std::optional<FloatDType> stream;
};

std::size_t bytes_per_element(const Scenario& s) {
  return kernels::dtype_size(s.grad) + 24 + (s.stream ? kernels::dtype_size(*s.stream) : 0);
}

struct Figures {
  double adamw_gbs;
  double same_traffic_gbs;
};

Figures adamw_gbs(const Scenario& sc, std::size_t n, SimdPath path, int reps) {
  const std::size_t gsize = kernels::dtype_size(sc.grad);
  auto grad = alloc_touched<std::uint8_t>(n * gsize, 0x3C);  // small positive values in any dtype
  auto master = alloc_touched<float>(n, 0.05f);
  auto m = alloc_touched<float>(n, 1e-3f);
  auto v = alloc_touched<float>(n, 1e-6f);
  std::unique_ptr<std::uint8_t[]> stream;
  if (sc.stream) stream = alloc_touched<std::uint8_t>(n * kernels::dtype_size(*sc.stream), 0);
  const kernels::AdamWTensor t{.n = n,
                               .grad = grad.get(),
                               .grad_dtype = sc.grad,
                               .master = master.get(),
                               .m = m.get(),
                               .v = v.get(),
                               .stream = stream.get(),
                               .stream_dtype = sc.stream.value_or(FloatDType::kBF16)};
  std::int64_t step = 0;
  const double seconds = best_seconds(reps, [&] {
    kernels::adamw_step(t, {.lr = 1e-5, .weight_decay = 0.1, .step = ++step}, path);
  });
  // The gradient's bits are reinterpreted as integers of its width: only the traffic matters.
  const double same_seconds = best_seconds(reps, [&] {
    auto* stream16 = reinterpret_cast<std::uint16_t*>(stream.get());
    if (gsize == 4) {
      const auto* g = reinterpret_cast<const float*>(grad.get());
      if (sc.stream)
        same_traffic_pass(g, master.get(), m.get(), v.get(), stream16, n);
      else
        same_traffic_pass(g, master.get(), m.get(), v.get(), static_cast<std::uint8_t*>(nullptr),
                          n);
    } else {
      const auto* g = reinterpret_cast<const std::uint16_t*>(grad.get());
      same_traffic_pass(g, master.get(), m.get(), v.get(), stream16, n);
    }
  });
  const double bytes = static_cast<double>(bytes_per_element(sc)) * n;
  return {bytes / seconds / 1e9, bytes / same_seconds / 1e9};
}

struct Options {
  std::size_t elements = 64ull << 20;
  int reps = 5;
  int threads = 0;  // 0 = all
  bool json = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--elements") {
      o.elements = parse_bytes(value(), "--elements");  // "64M" = 64 Mi elements
    } else if (a == "--reps") {
      o.reps = std::stoi(value());
    } else if (a == "--threads") {
      o.threads = std::stoi(value());
    } else if (a == "--json") {
      o.json = true;
    } else {
      throw Error("unknown argument " + a +
                  " (adamw_bench [--elements 64M] [--reps 5] [--threads N] [--json])");
    }
  }
  if (o.elements < 1 || o.reps < 1 || o.threads < 0) throw Error("bad --elements/--reps/--threads");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  const int all = o.threads > 0 ? o.threads : tbb::info::default_concurrency();
  std::vector<int> thread_counts{1};
  if (all > 1) thread_counts.push_back(all);
  const SimdPath widest = kernels::simd_path_resolve(SimdPath::kAuto);
  std::vector<SimdPath> paths{widest};
  for (SimdPath p : {SimdPath::kAvx2, SimdPath::kScalar})
    if (p != widest && kernels::simd_path_supported(p)) paths.push_back(p);

  const Scenario scenarios[] = {
      {"bf16 grad -> bf16 copy", FloatDType::kBF16, FloatDType::kBF16},
      {"f16 grad -> f16 copy", FloatDType::kF16, FloatDType::kF16},
      {"f32 grad, no copy", FloatDType::kF32, std::nullopt},
  };

  std::printf("adamw_bench: %zu elements, best of %d, SIMD paths here: %s%s%s\n", o.elements,
              o.reps, kernels::to_string(widest), paths.size() > 1 ? " (also " : "",
              paths.size() > 1 ? "avx2/scalar)" : "");
  std::printf("%-24s %-7s %7s %10s %10s %11s %11s %10s\n", "case", "path", "threads", "AdamW GB/s",
              "triad GB/s", "AdamW/triad", "same-traffic", "AdamW/same");
  std::string json = "[";
  bool first = true;
  for (int threads : thread_counts) {
    tbb::task_arena arena(threads);
    arena.execute([&] {
      for (const Scenario& sc : scenarios) {
        const std::size_t footprint = bytes_per_element(sc) * o.elements;
        const double triad = triad_gbs(footprint, o.reps);
        for (SimdPath path : paths) {
          // The scalar path only at one thread: it shows what the SIMD paths buy, not bandwidth.
          if (path == SimdPath::kScalar && threads > 1) continue;
          const Figures f = adamw_gbs(sc, o.elements, path, o.reps);
          std::printf("%-24s %-7s %7d %10.2f %10.2f %11.2f %11.2f %10.2f\n", sc.name,
                      kernels::to_string(path), threads, f.adamw_gbs, triad, f.adamw_gbs / triad,
                      f.same_traffic_gbs, f.adamw_gbs / f.same_traffic_gbs);
          char row[512];
          std::snprintf(row, sizeof row,
                        "%s{\"case\":\"%s\",\"path\":\"%s\",\"threads\":%d,\"elements\":%zu,"
                        "\"bytes_per_element\":%zu,\"adamw_gbs\":%.4f,\"triad_gbs\":%.4f,"
                        "\"same_traffic_gbs\":%.4f}",
                        first ? "" : ",", sc.name, kernels::to_string(path), threads, o.elements,
                        bytes_per_element(sc), f.adamw_gbs, triad, f.same_traffic_gbs);
          json += row;
          first = false;
        }
      }
    });
  }
  json += "]";
  if (o.json) std::printf("JSON %s\n", json.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "adamw_bench: %s\n", e.what());
  return 1;
}
