// The gradient path's sums across ranks against a plain c10d all-reduce of the same bytes, in one
// run: the path is engine/ranks.h's Collective, started once per bucket of layers as the optimizer
// thread starts them (gradient_buckets, OptimizerDriver::start_bucket: the layers' fp32
// gradients, from the last layer to the first, a bucket's layers back to back in one buffer summed
// in place; all in flight at once, then waited for); the baseline is one
// ProcessGroupGloo::allreduce of one tensor holding all of them, made here with c10d alone. Rounds
// alternate (baseline, path, baseline, ...) and the figure is the ratio of the median times (aim >=
// 0.9, issue 36). Started once per rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT); bench/distributed_bench.py starts them.
//
//   allreduce_bench --layers 30 --layer-mb 16 --rounds 7
//
// This file includes ProcessGroupGloo.hpp under Note [Gloo's headers] (engine/ranks.cpp): no gloo
// object is made here.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cli/rank_env.h"
#include "engine/ranks.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 30, rounds = 7;
  double layer_mb = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--layers")
      layers = std::atoi(argv[i + 1]);
    else if (a == "--layer-mb")
      layer_mb = std::atof(argv[i + 1]);
    else if (a == "--rounds")
      rounds = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  try {
    auto env = rondo::cli::rank_env([](const char* n) { return std::getenv(n); });
    if (!env || env->world < 2) {
      std::fprintf(stderr, "start it as 2 or more ranks (bench/distributed_bench.py)\n");
      return 2;
    }
    // The path: Rondo's ranks, as `rondo train` connects them.
    auto ranks = rondo::engine::Ranks::connect(*env, {});
    // The baseline: a process group of c10d's own, on its own port.
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(env->master_port + 1);
    so.isServer = env->rank == 0;
    so.numWorkers = static_cast<std::size_t>(env->world);
    auto store = c10::make_intrusive<c10d::TCPStore>(env->master_addr, so);
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    options->threads = 2;
    auto plain = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("plain", store), env->rank, env->world, options);

    const auto per_layer = static_cast<std::int64_t>(layer_mb * (1 << 20) / sizeof(float));
    const std::int64_t total = per_layer * layers;
    // One buffer: the layers' gradients back to back, as the store keeps a layer's.
    at::Tensor grads = at::rand({total}, at::kFloat);
    const auto buckets = rondo::engine::gradient_buckets(
        std::vector<std::size_t>(static_cast<std::size_t>(layers), per_layer * sizeof(float)));
    std::vector<double> path_s, plain_s;
    for (int r = 0; r < rounds; ++r) {
      std::vector<at::Tensor> whole{grads};
      double t0 = now_s();
      plain->allreduce(whole)->wait();
      plain_s.push_back(now_s() - t0);
      t0 = now_s();
      std::vector<std::unique_ptr<rondo::engine::Collective::Pending>> started;
      for (const std::vector<int>& bucket : buckets) {
        // Back to back, as a store keeps them: one buffer from the lowest layer's first value.
        started.push_back(
            ranks->gradients().start_sum({{grads.data_ptr<float>() + bucket.back() * per_layer,
                                           static_cast<std::size_t>(per_layer) * bucket.size()}},
                                         "a bucket"));
      }
      for (auto& p : started)
        p->wait();
      path_s.push_back(now_s() - t0);
      grads.mul_(1.0f / static_cast<float>(env->world) / static_cast<float>(env->world));
    }
    const double bytes = static_cast<double>(total) * sizeof(float);
    if (env->rank == 0)
      std::printf(
          "{\"ranks\": %d, \"layers\": %d, \"layer_mb\": %.3f, \"rounds\": %d, "
          "\"plain_s\": %.6f, \"path_s\": %.6f, \"plain_gb_s\": %.3f, \"path_gb_s\": %.3f, "
          "\"ratio\": %.3f}\n",
          env->world, layers, layer_mb, rounds, median(plain_s), median(path_s),
          bytes / median(plain_s) / 1e9, bytes / median(path_s) / 1e9,
          median(plain_s) / median(path_s));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
