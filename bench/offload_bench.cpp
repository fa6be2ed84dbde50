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
//  (d) full fine-tuning with the optimizer state and gradients on NVMe in chunks — link-bound on
//      2 simulated devices, a vocabulary of 8,192 (embedding and head 3x a block): every layer's
//      trained weights, masters, moments and gradients on the NVMe tier, masters, moments and
//      gradients in 1 MiB chunks and weights read in 1 MiB pieces, against the same run in host
//      memory. Step time ratio (aim
//      <= 1.15), and the NVMe run's host staging beyond the in-memory run's against the
//      planner's bound for it (windows of weight pieces, the trained weights rewritten a piece at
//      a time, two chunks, four write-backs: nvme_staging() in engine/estimate.cpp, recomputed
//      here from the store, with the gradient records: the writer's and the optimizer's two).
//
//   offload_bench [--dir D]... [--bytes 1GiB] [--steps 6] [--only a|b|c|d] [--link 50MB]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
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

// Trains `steps` steps on 2 simulated devices whose links carry `link_bps` each way, compute
// emulated at 2 ms forward and 4 ms backward per block and microbatch (times `weight` of the
// layer), 3 microbatches, two stages; the mean step time after 2 warm-up steps, and the plan.
double linkbound_step_s(const models::ModelConfig& c, const std::vector<models::LayerSpec>& specs,
                        offload::LayerStore& store, offload::HostArena& arena, int steps,
                        double link_bps,
                        const std::function<double(const models::LayerSpec&)>& weight,
                        engine::Plan& plan) {
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
  std::vector<engine::Microbatch> batch = test::random_batch(c, 2 * M, 16, M);
  const double tok = static_cast<double>(batch[0].batch.tokens.numel());
  engine::EngineOptions o;
  o.adamw.lr = 1e-4;
  test::EngineHooks emulation;
  for (const models::LayerSpec& l : specs) {
    const double w = weight(l);
    emulation.costs.push_back(
        {.forward_s_per_token = w * 2e-3 / tok, .backward_s_per_token = w * 4e-3 / tok});
  }
  o.probe = &emulation;
  const int L = static_cast<int>(specs.size());
  plan = {};
  plan.microbatches = M;
  plan.forward = {{0, L / 2}};
  plan.tail = {L / 2, L};
  plan.backward = {{0, L / 2}};
  engine::Engine eng(c, specs, store, arena, raw, plan, o);
  std::vector<engine::StepResult> r = eng.train(steps, [&](std::int64_t) { return batch; });
  const int warmup = 2;
  double seconds = 0;
  for (int i = warmup; i < steps; ++i)
    seconds += r[i].seconds;
  return seconds / (steps - warmup);
}

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
  engine::Plan plan;
  Result out;
  out.step_s = linkbound_step_s(
      m.config, m.specs, store, arena, steps, link_bps,
      [](const models::LayerSpec& l) { return l.kind == models::LayerKind::kBlock ? 1.0 : 0.25; },
      plan);
  // Weights uploaded per step: each job uploads its layers as stored.
  for (const engine::LayerRange& range : {plan.forward[0], plan.tail, plan.backward[0]})
    for (int l = range.begin; l < range.end; ++l)
      out.weights_up += static_cast<double>(store.stream_bytes(l, offload::kBasePart).bytes +
                                            store.stream_bytes(l, offload::kStreamPart).bytes);
  return out;
}

struct FullResult {
  double step_s = 0;
  std::uint64_t staging_peak = 0;  // host staging, bytes
  std::uint64_t bound = 0;         // the planner's NVMe staging bound for this store
};

FullResult run_full(bool nvme_tier, const std::string& dir, int steps, double link_bps) {
  at::manual_seed(2);
  const models::ModelConfig c = models::parse_hf_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":8192,"hidden_size":256,
          "intermediate_size":640,"num_hidden_layers":4,"num_attention_heads":4,
          "num_key_value_heads":2,"tie_word_embeddings":false,"rms_norm_eps":1e-5,
          "rope_theta":10000})",
      "offload_bench full");
  const std::vector<models::LayerSpec> specs = models::layer_specs(c);
  const std::map<std::string, at::Tensor> weights = test::random_weights(c);
  const std::uint64_t chunk = 1ull << 20;
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  std::vector<offload::LayerDesc> d =
      engine::layer_descs(specs, [](const models::ParamSpec&) { return true; });
  if (nvme_tier)
    for (offload::LayerDesc& l : d)
      l.weights = l.optimizer = l.grads = offload::Tier::kNvme;
  std::unique_ptr<offload::NvmeStore> nvme;
  if (nvme_tier)
    nvme = std::make_unique<offload::NvmeStore>(
        offload::NvmeStoreOptions{.dir = dir},
        offload::LayerStore::nvme_bytes(d, kernels::FloatDType::kBF16, chunk));
  offload::LayerStore store(arena, d, kernels::FloatDType::kBF16, kernels::FloatDType::kF32,
                            nvme.get(), chunk);
  engine::load_weights(store, specs, [&](const std::string& n) { return weights.at(n); });
  engine::Plan plan;
  FullResult out;
  out.step_s = linkbound_step_s(
      c, specs, store, arena, steps, link_bps, [](const models::LayerSpec&) { return 1.0; }, plan);
  out.staging_peak = arena.usage()[offload::Purpose::kStaging].peak;
  // The planner's bound, from the store's own sizes.
  std::uint64_t read = 0, trained = 0, rounded = 0, grads = 0;
  for (std::size_t l = 0; l < store.layers(); ++l) {
    for (unsigned part : {offload::kBasePart, offload::kStreamPart})
      if (store.tier(l, part) == offload::Tier::kNvme)
        read = std::max<std::uint64_t>(
            read, std::min<std::uint64_t>(store.stream_bytes(l, part).bytes, store.piece_bytes()));
    if (store.tier(l, offload::kStreamPart) != offload::Tier::kNvme) continue;
    trained = std::max<std::uint64_t>(
        trained, std::min<std::uint64_t>(store.stream_bytes(l, offload::kStreamPart).bytes,
                                         store.piece_bytes()));
    for (std::size_t k = 0; k < store.optimizer_chunks(l); ++k) {
      for (const offload::OptimizerPiece& p : store.optimizer_chunk(l, k))
        rounded =
            std::max<std::uint64_t>(rounded, p.numel * kernels::dtype_size(store.stream_dtype()));
      if (store.grad_tier(l) == offload::Tier::kNvme)
        grads = std::max<std::uint64_t>(grads, store.grad_record_bytes(l, k));
    }
  }
  const std::uint64_t C = nvme_tier ? store.max_chunk_bytes() : 0;
  const std::uint64_t devices = 2;
  out.bound = 2 * 2 * devices * read +
              (trained + C + grads > 0
                   ? trained + rounded + 2 * C + 3 * grads + 4 * std::max({trained, C, grads})
                   : 0);
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
    if (only.empty() || only == "d") {
      const std::string nvme_dir = dirs.front() + "/rondo-offload-bench";
      const FullResult host = run_full(false, nvme_dir, steps, link_bps);
      const FullResult nv = run_full(true, nvme_dir, steps, link_bps);
      const double extra =
          static_cast<double>(nv.staging_peak) - static_cast<double>(host.staging_peak);
      std::printf(
          "(d) link-bound full fine-tuning step (2 simulated devices, %.0f MB/s links): trained "
          "weights, masters, moments and gradients on NVMe (%s), in 1 MiB chunks, against "
          "host memory\n",
          link_bps / 1e6, nvme_dir.c_str());
      std::printf(
          "| state in | step s | ratio | host staging peak | NVMe staging (beyond host run) | "
          "planner's bound |\n|---|---|---|---|---|---|\n");
      std::printf("| host memory | %.4f | 1.00 | %s | — | — |\n", host.step_s,
                  format_bytes(host.staging_peak).c_str());
      std::printf("| NVMe tier | %.4f | %.3f | %s | %s | %s |\n\n", nv.step_s,
                  nv.step_s / host.step_s, format_bytes(nv.staging_peak).c_str(),
                  format_bytes(static_cast<std::uint64_t>(std::max(0.0, extra))).c_str(),
                  format_bytes(nv.bound).c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_bench: %s\n", e.what());
    return 1;
  }
}
