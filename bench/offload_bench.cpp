// offload_bench: what the NVMe tier and a quantised base cost and save, as ratios measured side by
// side in one run (never absolute targets: these machines are shared).
//
//  (a) drive — per folder: the NVMe store (layer-sized regions, 4 transfers in flight, checksums
//      computed and verified: offload::measure_store) against a plain one-thread O_DIRECT
//      pwrite/pread loop over the same bytes in the same request size (measure_disk_raw), with
//      the backend at queue depth 32 and no checksums (measure_disk) between. Aim: >= 0.9.
//  (b) NVMe-backed training — LoRA on 2 simulated devices whose emulated link is the bottleneck
//      (compute emulated short, test::EngineHooks): step time with every block's frozen
//      weights on the NVMe tier against the same run with them in host memory. Aim: <= 1.1 (the
//      reads overlap the uploads, so the link still decides).
//  (c) quantised base — the same link-bound LoRA run with the frozen base in NF4 (and Q8_0, INT8)
//      against bf16: step time ratio next to the ratio of weight bytes each step uploads (the
//      best a link-bound run can do; dequantising on the device costs the rest).
//
//   offload_bench [--dir D]... [--bytes 1GiB] [--steps 6] [--only a|b|c] [--link 50MB]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/model_store.h"
#include "kernels/cpu/sim_device.h"
#include "kernels/quant.h"
#include "models/lora.h"
#include "offload/disk_speed.h"
#include "offload/nvme_store.h"
#include "tests/support/engine_hooks.h"
#include "tests/support/plain_loop.h"

using namespace rondo;
namespace fs = std::filesystem;

namespace {

struct Model {
  models::ModelConfig config;
  std::vector<models::LayerSpec> specs;
  std::map<std::string, at::Tensor> weights;
};

Model make_lora_model() {
  at::manual_seed(1);
  // 8 blocks of C = 256, I = 640 (4 heads, 2 KV heads): 0.69 M parameters (1.4 MB in bf16) per
  // block.
  models::ModelConfig c = test::tiny_llama(8, 16);
  Model m{c, models::layer_specs(c), test::random_weights(c)};
  m.specs = models::add_lora(m.specs, {.rank = 8, .alpha = 16});
  for (auto& [name, t] : models::init_lora(m.specs, 1))
    m.weights[name] = t;
  return m;
}

struct Setup {
  bool nvme = false;
  kernels::QuantFormat quant;  // of the frozen projections
};

struct Result {
  double step_s = 0;
  double weights_up = 0;  // bytes per step
};

// Link-bound LoRA: at the default 50 MB/s per direction a bf16 block's upload (1.4 MB) takes about
// 28 ms, while its emulated compute takes 2 ms forward and 4 ms backward per microbatch (3 per
// step): the link decides the step time.
Result run(const Model& m, const Setup& s, const std::string& dir, int steps, double link_bps) {
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  std::vector<offload::LayerDesc> d = engine::layer_descs(
      m.specs, [](const models::ParamSpec& p) { return models::is_lora_param(p.name); });
  for (std::size_t l = 0; l < d.size(); ++l) {
    for (std::size_t i = 0; i < d[l].tensors.size(); ++i) {
      offload::TensorDesc& t = d[l].tensors[i];
      if (s.quant.type == kernels::QuantType::kNone || t.trainable ||
          !t.name.ends_with("proj.weight"))
        continue;
      t.quant = s.quant;
      t.rows = m.specs[l].params[i].shape[0];
      t.cols = m.specs[l].params[i].shape[1];
    }
    if (s.nvme && m.specs[l].kind == models::LayerKind::kBlock) d[l].base = offload::Tier::kNvme;
  }
  std::unique_ptr<offload::NvmeStore> nvme;
  if (s.nvme)
    nvme = std::make_unique<offload::NvmeStore>(
        offload::NvmeStoreOptions{.dir = dir},
        offload::LayerStore::nvme_bytes(d, kernels::FloatDType::kBF16));
  offload::LayerStore store(arena, d, kernels::FloatDType::kBF16, kernels::FloatDType::kF32,
                            nvme.get());
  engine::load_weights(store, m.specs, [&](const std::string& n) { return m.weights.at(n); });
  std::vector<std::unique_ptr<kernels::Device>> devs;
  std::vector<kernels::Device*> raw;
  for (int i = 0; i < 2; ++i) {
    devs.push_back(
        kernels::make_sim_device({.name = "sim" + std::to_string(i),
                                  .index = i,
                                  .bytes_cap = 2ull << 30,
                                  .link = {.bytes_per_s = link_bps, .latency_s = 10e-6}}));
    raw.push_back(devs.back().get());
  }
  const int M = 3;
  std::vector<engine::Microbatch> batch = test::random_batch(m.config, 2 * M, 16, M);
  const double tok = static_cast<double>(batch[0].batch.tokens.numel());
  engine::EngineOptions o;
  o.adamw.lr = 1e-4;
  test::EngineHooks emulation;
  for (const models::LayerSpec& l : m.specs) {
    const double w = l.kind == models::LayerKind::kBlock ? 1.0 : 0.25;
    emulation.costs.push_back(
        {.forward_s_per_token = w * 2e-3 / tok, .backward_s_per_token = w * 4e-3 / tok});
  }
  o.probe = &emulation;
  engine::Plan plan;
  const int L = static_cast<int>(m.specs.size());
  plan.microbatches = M;
  plan.forward = {{0, L / 2}};
  plan.tail = {L / 2, L};
  plan.backward = {{0, L / 2}};
  engine::Engine eng(m.config, m.specs, store, arena, raw, plan, o);
  std::vector<engine::StepResult> r = eng.train(steps, [&](std::int64_t) { return batch; });
  Result out;
  const int warmup = 2;
  for (int i = warmup; i < steps; ++i)
    out.step_s += r[i].seconds;
  out.step_s /= steps - warmup;
  // Weights uploaded per step: each job uploads its layers as stored.
  for (const engine::LayerRange& range : {plan.forward[0], plan.tail, plan.backward[0]})
    for (int l = range.begin; l < range.end; ++l)
      out.weights_up += static_cast<double>(store.stream_bytes(l, offload::kBasePart).bytes +
                                            store.stream_bytes(l, offload::kStreamPart).bytes);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> dirs;
  std::uint64_t bytes = 1ull << 30;
  int steps = 6;
  std::string only;
  double link_bps = 50e6;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (i + 1 >= argc) throw Error("option " + a + " needs a value");
      if (a == "--dir")
        dirs.push_back(argv[++i]);
      else if (a == "--bytes")
        bytes = parse_bytes(argv[++i], "--bytes");
      else if (a == "--steps")
        steps = std::max(3, std::atoi(argv[++i]));
      else if (a == "--only")
        only = argv[++i];
      else if (a == "--link")
        link_bps = static_cast<double>(parse_bytes(argv[++i], "--link"));
      else
        throw Error("unknown option " + a + " (known: --dir, --bytes, --steps, --only, --link)");
    }
    if (dirs.empty()) dirs.push_back(fs::temp_directory_path().string());
    at::set_num_threads(1);

    if (only.empty() || only == "a") {
      // The same bytes and request size for all three: the raw loop (the baseline), the backend
      // at queue depth 32 without checksums (what the queue buys), and the store.
      std::printf("(a) the NVMe store against a plain one-thread O_DIRECT loop\n");
      std::printf(
          "| folder | backend | O_DIRECT | raw write | raw read | queue write | queue read "
          "| store write | store read | store/raw write | store/raw read |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|\n");
      std::vector<std::string> notes;
      for (const std::string& dir : dirs) {
        const offload::DiskSpeed raw = offload::measure_disk_raw(dir, bytes, 1 << 20);
        const offload::DiskSpeed probe = offload::measure_disk(dir, bytes);
        const offload::StoreSpeed st = offload::measure_store(dir, bytes, 1 << 20, 64 << 20);
        std::printf("| %s | %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
                    dir.c_str(), st.backend.c_str(), st.direct ? "yes" : "no",
                    raw.write_bytes_per_s / 1e9, raw.read_bytes_per_s / 1e9,
                    probe.write_bytes_per_s / 1e9, probe.read_bytes_per_s / 1e9,
                    st.write_bytes_per_s / 1e9, st.read_bytes_per_s / 1e9,
                    st.write_bytes_per_s / raw.write_bytes_per_s,
                    st.read_bytes_per_s / raw.read_bytes_per_s);
        notes.push_back(dir + ": store " + st.summary);
        if (!probe.backend_note.empty()) notes.push_back(dir + ": " + probe.backend_note);
      }
      std::printf(
          "GB/s (10^9 bytes/s) over %s in 1 MiB requests; store regions of 64 MiB, 4 in "
          "flight, checksums on\n",
          format_bytes(bytes).c_str());
      for (const std::string& n : notes)
        std::printf("%s\n", n.c_str());
      std::printf("\n");
    }
    if (only.empty() || only == "b" || only == "c") {
      const Model m = make_lora_model();
      const std::string nvme_dir = dirs.front() + "/rondo-offload-bench";
      const Result host = run(m, {}, nvme_dir, steps, link_bps);
      if (only.empty() || only == "b") {
        const Result nv = run(m, {.nvme = true}, nvme_dir, steps, link_bps);
        std::printf(
            "(b) link-bound LoRA step (2 simulated devices, %.0f MB/s links): frozen "
            "blocks on NVMe (%s) against host memory\n",
            link_bps / 1e6, nvme_dir.c_str());
        std::printf("| base in | step s | ratio |\n|---|---|---|\n");
        std::printf("| host memory | %.4f | 1.00 |\n| NVMe tier | %.4f | %.3f |\n\n", host.step_s,
                    nv.step_s, nv.step_s / host.step_s);
      }
      if (only.empty() || only == "c") {
        std::printf("(c) link-bound LoRA step: the frozen base quantised against bf16\n");
        std::printf(
            "| base | weight bytes / step | byte ratio | step s | step ratio |\n"
            "|---|---|---|---|---|\n");
        std::printf("| bf16 | %.0f | 1.000 | %.4f | 1.000 |\n", host.weights_up, host.step_s);
        for (kernels::QuantFormat f : {kernels::QuantFormat{.type = kernels::QuantType::kNF4},
                                       kernels::QuantFormat{.type = kernels::QuantType::kQ8_0},
                                       kernels::QuantFormat{.type = kernels::QuantType::kInt8}}) {
          const Result q = run(m, {.quant = f}, nvme_dir, steps, link_bps);
          std::printf("| %s | %.0f | %.3f | %.4f | %.3f |\n", kernels::to_string(f).c_str(),
                      q.weights_up, q.weights_up / host.weights_up, q.step_s,
                      q.step_s / host.step_s);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_bench: %s\n", e.what());
    return 1;
  }
}
