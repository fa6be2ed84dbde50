#include "engine/estimate.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>

#include "engine/disk_speeds.h"
#include "engine/engine.h"
#include "engine/gpus.h"
#include "engine/model_store.h"
#include "engine/speed.h"
#include "kernels/error.h"
#include "kernels/quant.h"
#include "models/attention_masks.h"
#include "models/lora.h"
#include "offload/activation_spill.h"
#include "offload/nvme_store.h"

namespace fs = std::filesystem;

namespace rondo::engine {
namespace {

std::uint64_t dtype_bytes(const std::string& dtype) {
  return dtype == "fp32" ? 4 : 2;
}

}  // namespace

std::uint64_t host_memory_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

std::uint64_t disk_space_free(const std::string& path) {
  fs::path p = fs::absolute(path.empty() ? fs::path(".") : fs::path(path));
  while (!p.empty() && !fs::exists(p) && p != p.parent_path())
    p = p.parent_path();
  struct statvfs s {};
  if (::statvfs(p.c_str(), &s) != 0) return 0;
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

std::string why_unwritable(const std::string& path) {
  fs::path p = fs::absolute(path.empty() ? fs::path(".") : fs::path(path));
  std::error_code ec;
  while (!p.empty() && !fs::exists(p, ec) && p != p.parent_path())
    p = p.parent_path();
  if (!fs::is_directory(p, ec)) return p.string() + " is not a folder";
  struct statvfs s {};
  if (::statvfs(p.c_str(), &s) != 0) return p.string() + ": " + std::strerror(errno);
  if (s.f_flag & ST_RDONLY) return p.string() + " is on a read-only file system";
  // proc, sysfs and their kind have no blocks: nothing written there is stored.
  if (s.f_blocks == 0) return p.string() + " is on a virtual file system (no disk behind it)";
  if (::access(p.c_str(), W_OK) != 0) return p.string() + ": " + std::strerror(errno);
  return "";
}

double device_flops(const kernels::DeviceInfo& device, DeviceMode mode, const std::string& dtype) {
  if (mode != DeviceMode::kCuda && mode != DeviceMode::kPlanned)
    throw InternalError("device_flops is for GPUs; the CPU's speed is engine::cpu_flops");
  // Dense tensor-core throughput one can reach in training: about half the datasheet's dense
  // bf16 peak (engine/gpus.h), by name, else by compute capability.
  double tf = 0;
  if (const GpuSpec* g = find_gpu(device.name)) {
    tf = g->bf16_dense_tflops / 2;
  } else {
    const int cc = device.compute_major * 10 + device.compute_minor;
    tf = cc >= 120   ? 105  // consumer Blackwell (RTX 5090: 209 dense)
         : cc >= 100 ? 560  // B200
         : cc >= 90  ? 400  // H100 / H200 (PCIe 756, SXM 989 dense)
         : cc == 89  ? 82   // RTX 4090 / L40S class
         : cc >= 86  ? 35   // RTX 3090 / A6000 class
         : cc >= 80  ? 156  // A100
                     : 15;
  }
  if (dtype == "fp32") tf /= 8;
  return tf * 1e12;
}

std::string step_time_warning(double predicted_s, std::vector<double> measured_s,
                              std::int64_t steps) {
  if (!(predicted_s > 0) || measured_s.empty()) return "";
  std::nth_element(measured_s.begin(), measured_s.begin() + measured_s.size() / 2,
                   measured_s.end());
  const double median = measured_s[measured_s.size() / 2];
  const double ratio = median / predicted_s;
  if (ratio <= 1.25 && ratio >= 0.8) return "";
  if (std::max(median, predicted_s) * static_cast<double>(steps) < 60) return "";
  return fmt::format(
      "steps take {:.3g} s, the plan predicted {:.3g} s ({:.2g}x {}); the ETA follows the measured "
      "steps, and `rondo plan`'s figures for this machine are off by as much",
      median, predicted_s, ratio >= 1 ? ratio : 1 / ratio, ratio >= 1 ? "slower" : "faster");
}

// Note [Host budget]
// hardware.host_memory bounds what the run keeps in host memory: the host arena (offload/) holds
// the store (weights, gradients, optimizer state), activation staging and NVMe staging, and
// refuses to pass its limit with a named error (HostOutOfMemory), never an OOM kill. What the
// arena cannot see is the process itself: code and libraries (torch is ~0.3 GB resident), the
// tokenizer and the tokenized data, heaps, and the tensors torch allocates while computing on
// the CPU (and a simulated GPU's memory, which is host memory under the device's own cap). That
// is the stated overhead: host_fixed_overhead() is the process's resident size when the run is
// planned (everything loaded but the weights) plus a margin for compute temporaries. Loading
// holds a slice of a tensor (or a converted tensor) outside the arena (HostNeeds::loading), and on
// the CPU device the device's memory is this machine's (HostNeeds::cpu_device: the plan's peak
// for what the device does not read in place), so the arena's limit is the budget minus those.
// When no budget is given, the budget is what the OS reports available minus the overhead.

std::uint64_t checkpoint_spill_bytes(const Plan& plan, std::uint64_t checkpoint_bytes) {
  return offload::ActivationSpill::capacity_for(
      checkpoint_bytes,
      2 * plan.checkpointed_layers().size() *
          static_cast<std::uint64_t>(std::max(plan.microbatches, 1)),
      offload::NvmeStoreOptions{}.block_bytes);
}

std::uint64_t host_fixed_overhead() {
  std::ifstream f("/proc/self/status");
  std::string key;
  std::uint64_t rss_kib = 0;
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmRSS:", 0) == 0) rss_kib = std::strtoull(line.c_str() + 6, nullptr, 10);
  return rss_kib * 1024 + (256ull << 20);
}

namespace {

// Classes of a layer's state: LayerDesc's parts in this order, then its gradients.
constexpr int kBase = 0, kTrained = 1, kOptimizer = 2, kGrads = 3;
constexpr int kActivations = 4;  // not a layer's: activation checkpoints (Placement)
const char* const kPartNames[4] = {"frozen weights", "trained weights", "optimizer state",
                                   "gradients"};

// The GGUF block types Rondo streams as stored (and dequantises on the device).
std::optional<kernels::QuantType> gguf_kept_type(const std::string& name) {
  static const std::map<std::string, kernels::QuantType> kept = {
      {"Q4_0", kernels::QuantType::kQ4_0},
      {"Q4_1", kernels::QuantType::kQ4_1},
      {"Q8_0", kernels::QuantType::kQ8_0},
      {"Q4_K", kernels::QuantType::kQ4_K},
      {"Q6_K", kernels::QuantType::kQ6_K}};
  auto it = kept.find(name);
  if (it == kept.end()) return std::nullopt;
  return it->second;
}

bool is_projection(const std::string& name) {
  for (const char* p : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                        "gate_proj.weight", "up_proj.weight", "down_proj.weight"})
    if (name.ends_with(p)) return true;
  // Experts (Mixtral's w1/w2/w3 too); routers stay as they are, as bitsandbytes leaves them.
  std::int64_t expert = 0;
  int projection = 0;
  return models::parse_expert_name(name, &expert, &projection);
}

// Tier of class p of a layer's state.
offload::Tier& tier_of(offload::LayerDesc& d, int p) {
  return p == kBase ? d.base : p == kTrained ? d.weights : p == kOptimizer ? d.optimizer : d.grads;
}
offload::Tier tier_of(const offload::LayerDesc& d, int p) {
  return p == kBase ? d.base : p == kTrained ? d.weights : p == kOptimizer ? d.optimizer : d.grads;
}

bool layer_has_ties(const std::vector<offload::LayerDesc>& layers, std::size_t l) {
  for (const offload::TensorDesc& t : layers[l].tensors)
    if (t.tied_to_layer >= 0) return true;
  for (const offload::LayerDesc& o : layers)
    for (const offload::TensorDesc& t : o.tensors)
      if (t.tied_to_layer == static_cast<int>(l)) return true;
  return false;
}

std::string percent_mix(const std::map<std::string, std::uint64_t>& bytes) {
  std::uint64_t total = 0;
  for (auto& [k, b] : bytes)
    total += b;
  std::vector<std::pair<std::uint64_t, std::string>> order;
  for (auto& [k, b] : bytes)
    order.push_back({b, k});
  std::sort(order.rbegin(), order.rend());
  std::string out;
  for (auto& [b, k] : order)
    out += (out.empty() ? "" : ", ") + k + " " +
           std::to_string(total ? static_cast<int>(100.0 * b / total + 0.5) : 0) + "%";
  return out;
}

// Host staging the NVMe tier needs at most during a step (offload::LayerStore, Transfers):
//  - per device, a window of weight pieces being uploaded and as many read ahead (Transfers,
//    nvme_window 2): each a layer's frozen or trained weights, or a piece of the chunk size of
//    them (Note [Weight pieces] in offload/layer_store.cpp);
//  - the optimizer's layer: one chunk of masters and moments updated and the next read ahead
//    (Note [Optimizer chunks] in offload/layer_store.cpp), the chunk's streaming copies rounded
//    into staging and the piece of the trained weights they go to (Note [Streaming copies a
//    chunk at a time] in optimizer.cpp), and up to 4 write-backs in flight, each a chunk or a
//    piece;
//  - gradients on NVMe (Note [Gradients on NVMe] in offload/transfer.cpp): the record the
//    gradient writer fills, and the optimizer's record and the next read ahead (their writes
//    count among the write-backs: a record is smaller than its chunk's masters and moments).
// Loading and checkpoints stage less: a layer's weights and a chunk or two.
std::uint64_t nvme_staging(const std::vector<offload::LayerDesc>& layers,
                           const std::vector<std::array<std::uint64_t, 4>>& parts,
                           std::uint64_t chunk_bytes, std::uint64_t devices,
                           std::uint64_t stream_bytes) {
  const std::uint64_t piece =
      offload::LayerStore::piece_bytes_for(chunk_bytes, offload::NvmeStoreOptions{}.block_bytes);
  std::uint64_t read = 0, trained = 0, rounded = 0, chunk = 0, grads = 0;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    for (int p : {kBase, kTrained})
      if (tier_of(layers[l], p) == offload::Tier::kNvme)
        read = std::max(read, std::min(parts[l][p], piece));
    const bool stream_on_nvme = tier_of(layers[l], kTrained) == offload::Tier::kNvme;
    if (stream_on_nvme) trained = std::max(trained, std::min(parts[l][kTrained], piece));
    const bool opt_on_nvme = tier_of(layers[l], kOptimizer) == offload::Tier::kNvme;
    const bool grads_on_nvme = tier_of(layers[l], kGrads) == offload::Tier::kNvme;
    if (!stream_on_nvme && !opt_on_nvme && !grads_on_nvme) continue;
    for (const auto& c : offload::LayerStore::chunks_of(layers[l], chunk_bytes)) {
      if (grads_on_nvme) {  // f32 gradients
        std::uint64_t record = 0;
        for (const offload::OptimizerPiece& p : c)
          record += p.numel * 4;
        grads = std::max(grads, record);
      }
      if (opt_on_nvme)
        chunk = std::max(chunk, offload::LayerStore::chunk_record_bytes(c, layers[l].moments));
      if (stream_on_nvme)  // staging of one chunk piece's copies, the largest
        for (const offload::OptimizerPiece& p : c)
          rounded = std::max<std::uint64_t>(rounded, p.numel * stream_bytes);
    }
  }
  const std::uint64_t update =
      trained + rounded + 2 * chunk + 3 * grads + 4 * std::max({trained, chunk, grads});
  return 2 * 2 * devices * read + (trained + chunk + grads > 0 ? update : 0);
}

}  // namespace

std::string Placement::lines() const {
  std::string out;
  for (int p = 0; p < 4; ++p) {
    if (host_part[p] + nvme_part[p] == 0) continue;
    out += fmt::format("  {:<16} {}", kPartNames[p],
                       nvme_part[p] == 0 ? fmt::format("host {}", format_bytes(host_part[p]))
                       : host_part[p] == 0
                           ? fmt::format("NVMe {}", format_bytes(nvme_part[p]))
                           : fmt::format("host {}, NVMe {} ({} layers)", format_bytes(host_part[p]),
                                         format_bytes(nvme_part[p]), nvme_layers[p]));
    if (p == kBase && !formats.empty()) out += " as " + formats;
    if (p == kOptimizer && !layers.empty() &&
        layers.front().moments == offload::MomentFormat::kBlockwise8)
      out += " (AdamW moments in 8 bits)";
    if (p == kOptimizer && !optimizer_owners.empty())
      out += fmt::format(", rank {}'s share of {} (distributed.shard_optimizer)", rank, ranks);
    if (p == kOptimizer && nvme_part[p] > 0)
      out += fmt::format(", staged in chunks of {} at most (hardware.offload_chunk)",
                         format_bytes(chunk_bytes));
    if (p == kGrads && nvme_part[p] > 0) out += ", written as they come down, read once";
    out += "\n";
  }
  if (host_activations > 0)
    out += fmt::format("  {:<16} {}\n", "activations",
                       activations == offload::Tier::kNvme
                           ? fmt::format("NVMe {} (checkpoints; {} in host memory without it)",
                                         format_bytes(spill_bytes), format_bytes(host_activations))
                           : fmt::format("host {} (checkpoints)", format_bytes(host_activations)));
  return out;
}

RunEstimate estimate_run(const TrainConfig& config, const models::ModelSummary& model,
                         const DevicePlan& devices, std::int64_t steps,
                         std::int64_t tokens_per_step, std::uint64_t host_free,
                         std::uint64_t disk_free, const std::optional<ResumePoint>& resume) {
  RunEstimate e;
  e.devices = devices;
  e.steps = steps;
  e.tokens_per_step = tokens_per_step;
  const bool lora = config.training.method == "lora";
  const bool pairs = config.training.objective != "sft";  // a preference objective
  const bool gguf = model.format == "gguf";
  bool mxfp4 = false;  // GPT-OSS's experts as its official checkpoints store them
  for (const auto& [name, type] : model.stored_types)
    mxfp4 = mxfp4 || (!gguf && type == "MXFP4");
  std::vector<models::LayerSpec> specs = models::layer_specs(model.config);
  if (lora) specs = models::add_lora(specs, config.lora_config());
  const std::uint64_t wb = dtype_bytes(config.model.dtype);
  const kernels::FloatDType sd = config.model.dtype == "fp32"   ? kernels::FloatDType::kF32
                                 : config.model.dtype == "fp16" ? kernels::FloatDType::kF16
                                                                : kernels::FloatDType::kBF16;
  auto trainable = [&](const models::ParamSpec& p) {
    return !lora || models::is_lora_param(p.name);
  };

  // --- What the frozen base is kept as ---------------------------------------------------------
  Placement& pl = e.placement;
  e.host_overhead = host_fixed_overhead();
  e.host_available = host_free;
  if (!config.hardware.host_memory.empty())
    e.host_available = parse_bytes(config.hardware.host_memory, "hardware.host_memory");
  if (e.host_available == 0) {
    const std::uint64_t avail = host_memory_available();
    e.host_available = avail > e.host_overhead ? avail - e.host_overhead : 0;
  }
  // Optimizer chunks: as set, else the default unless the budget is small — the NVMe tier stages
  // about six chunks at once, kept to a fifth of the budget (a power of two of 4 MiB at least).
  if (!config.hardware.offload_chunk.empty()) {
    pl.chunk_bytes = parse_bytes(config.hardware.offload_chunk, "hardware.offload_chunk");
  } else {
    pl.chunk_bytes = offload::kDefaultChunkBytes;
    while (pl.chunk_bytes > (4ull << 20) && 6 * pl.chunk_bytes > e.host_available / 5)
      pl.chunk_bytes /= 2;
  }
  pl.quantize = config.model.quantize;
  if (pl.quantize == "auto") {
    // A GGUF base keeps its block types where they pay: over a GPU's link, and wherever memory is
    // short. On the CPU there is no link to save, and dequantising every layer for every job
    // costs compute, so a base that fits easily is dequantised once, at load.
    const bool roomy = devices.mode == DeviceMode::kCpu &&
                       static_cast<std::uint64_t>(model.params) * wb <= e.host_available / 2;
    pl.quantize = lora && (gguf || mxfp4) && !roomy ? (gguf ? "gguf" : "stored") : "none";
  }
  if (pl.quantize == "gguf" && !gguf) {
    e.problems.push_back("model.quantize: 'gguf' keeps a GGUF file's own block types; " +
                         config.model.path +
                         " is a Hugging Face folder: use nf4 or int8 to quantise it at load");
    pl.quantize = "none";
  }
  pl.layers = layer_descs(specs, trainable);
  const bool eight_bit = config.training.optimizer == "adamw_8bit";
  for (offload::LayerDesc& d : pl.layers)
    d.moments = eight_bit ? offload::MomentFormat::kBlockwise8 : offload::MomentFormat::kF32;
  shard_placement(pl, config.distributed);
  std::map<std::string, std::uint64_t> format_bytes_of;  // frozen base bytes by kept format
  std::uint64_t largest_tensor = 0;
  e.experts = model.config.num_experts;
  e.experts_per_token = model.config.experts_per_token;
  for (const models::LayerSpec& s : specs)
    e.active_params += s.active_param_count();
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
      const models::ParamSpec& p = specs[l].params[i];
      offload::TensorDesc& t = pl.layers[l].tensors[i];
      if (p.tied) continue;
      e.params += p.numel();
      if (t.trainable) e.trained_params += p.numel();
      largest_tensor = std::max<std::uint64_t>(largest_tensor, p.numel());
      if (t.trainable) continue;
      auto stored = model.stored_types.find(p.name);
      if (!gguf && pl.quantize != "none" && stored != model.stored_types.end() &&
          stored->second == "MXFP4" && p.shape.size() == 3) {
        // GPT-OSS's experts as the checkpoint stores them, whenever the base is kept quantised
        // (a GGUF stores them in other tensors and is dequantised at load).
        t.quant = {.type = kernels::QuantType::kMXFP4, .experts = p.shape[0]};
        t.rows = p.shape[0] * p.shape[1];
        t.cols = p.shape[2];
      } else if (p.shape.size() == 2) {
        kernels::QuantFormat f;
        if (pl.quantize == "nf4" && is_projection(p.name))
          f = {.type = kernels::QuantType::kNF4, .double_quant = config.model.double_quant};
        else if (pl.quantize == "int8" && is_projection(p.name))
          f = {.type = kernels::QuantType::kInt8};
        else if (pl.quantize == "gguf" || pl.quantize == "stored")
          if (stored != model.stored_types.end())
            if (auto q = gguf_kept_type(stored->second)) f = {.type = *q};
        if (f.type != kernels::QuantType::kNone) {
          t.quant = f;
          t.rows = p.shape[0];
          t.cols = p.shape[1];
        }
      }
      const std::string name = t.quant.type == kernels::QuantType::kNone
                                   ? std::string(config.model.dtype == "fp32"   ? "F32"
                                                 : config.model.dtype == "fp16" ? "F16"
                                                                                : "BF16")
                                   : std::string(kernels::to_string(t.quant.type));
      format_bytes_of[name] += t.quant.type == kernels::QuantType::kNone
                                   ? static_cast<std::uint64_t>(p.numel()) * wb
                                   : kernels::quant_bytes(t.quant, t.rows, t.cols);
    }
  if (lora && pl.quantize != "none") {
    pl.formats = percent_mix(format_bytes_of);
    if (pl.quantize == "nf4")
      pl.formats +=
          config.model.double_quant ? " (NF4: block 64, double quant)" : " (NF4: block 64)";
  }
  // Loading holds outside the store, where the file holds the streaming dtype, the file pages of
  // a slice of a tensor (a weight piece at most: Note [Loading in slices] in model_store.cpp);
  // else a whole tensor at a time: its file pages while it is read (dropped after,
  // models::WeightReader::release) and the converted (or dequantised) copy.
  {
    std::uint64_t stored_bytes = wb;
    for (const auto& [name, type] : model.stored_types)
      if (type == "F32") stored_bytes = 4;
    const bool same = !gguf && stored_bytes == wb;
    e.host.loading = same ? std::min(largest_tensor * stored_bytes,
                                     offload::LayerStore::piece_bytes_for(
                                         pl.chunk_bytes, offload::NvmeStoreOptions{}.block_bytes))
                          : largest_tensor * (stored_bytes + wb);
  }
  const std::uint64_t C = static_cast<std::uint64_t>(model.config.hidden_size);

  // --- Costs and the plan (speed 1 = 1 TFLOP/s) -----------------------------------------------
  const double ref = 1e12;
  const int M = config.training.grad_accum;
  std::vector<std::array<std::uint64_t, 4>> parts;  // by class, f32 gradients last
  for (std::size_t l = 0; l < specs.size(); ++l) {
    const std::array<std::uint64_t, 3> p = offload::LayerStore::part_bytes(pl.layers, l, sd);
    parts.push_back({p[0], p[1], p[2], 0});
    // A preference objective's tail runs the head forward twice (engine/preference.h).
    const double f = specs[l].flops_forward_per_token(config.data.seq_len) / ref *
                     (specs[l].kind == models::LayerKind::kHead && pairs ? 2.0 : 1.0);
    // The backward of a frozen weight computes only the input gradient: about one forward.
    const double b =
        specs[l].flops_backward_per_token(config.data.seq_len) / ref * (lora ? 0.5 : 1.0);
    std::uint64_t stored = 0, dequantised = 0, trained = 0;
    bool norms_trained = false;  // their products keep the normalised inputs
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      norms_trained |= pl.layers[l].tensors[i].trainable &&
                       specs[l].params[i].name.find("norm") != std::string::npos;
    // The head's backward (models::head_forward_backward), one chunk of logits at a time: the
    // chunk's logits in the streaming dtype and in fp32, their fp32 gradient and its copy in the
    // streaming dtype; with a trained LM head, its fp32 gradient (V x C) before it joins the
    // accumulator.
    std::uint64_t transient = 0;
    if (specs[l].kind == models::LayerKind::kHead) {
      const auto V = static_cast<std::uint64_t>(model.config.vocab_size);
      // The CPU and simulated GPUs compute in host memory, in smaller chunks.
      const bool cpu_backed = devices.mode == DeviceMode::kCpu || devices.mode == DeviceMode::kSim;
      const std::uint64_t chunk = std::min<std::uint64_t>(
          static_cast<std::uint64_t>(head_chunk_tokens(EngineOptions{}.head_chunk_tokens,
                                                       model.config.vocab_size, cpu_backed)),
          std::max<std::uint64_t>(static_cast<std::uint64_t>(tokens_per_step / std::max(M, 1)), 1));
      transient = chunk * V * (2 * wb + 2 * 4);
      for (std::size_t i = 1; i < specs[l].params.size(); ++i)
        if (pl.layers[l].tensors[i].trainable)
          transient += static_cast<std::uint64_t>(specs[l].params[i].numel()) * 4;
    }
    for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
      const offload::TensorDesc& t = pl.layers[l].tensors[i];
      if (t.tied_to_layer >= 0) continue;
      const auto n = static_cast<std::uint64_t>(t.numel);
      dequantised += n * wb;
      stored += t.quant.type == kernels::QuantType::kNone
                    ? n * wb
                    : kernels::quant_bytes(t.quant, t.rows, t.cols);
      if (t.trainable) trained += n;
    }
    parts.back()[kGrads] = trained * 4;
    e.inputs.layers.push_back(
        {.forward_s_per_token = f,
         .backward_s_per_token = b,
         .tiled_recompute_s_per_token = specs[l].flops_tiled_recompute_per_token() / ref,
         .param_bytes = stored,
         .device_param_bytes = stored != dequantised ? dequantised : 0,
         .grad_bytes = trained * 4,
         .activation_bytes_per_token =
             specs[l].activation_bytes_per_token(wb, config.data.seq_len, norms_trained),
         .tiled_activation_bytes_per_token =
             specs[l].tiled_activation_bytes_per_token(wb, config.data.seq_len, norms_trained),
         .tileable_bytes_per_token = specs[l].tileable_bytes_per_token(wb),
         .backward_bytes_per_token = specs[l].backward_bytes_per_token(wb, false),
         .backward_tiled_bytes_per_token = specs[l].backward_bytes_per_token(wb, true),
         .forward_bytes_per_token = specs[l].forward_bytes_per_token(wb),
         .output_bytes_per_token = C * wb,
         .transient_bytes = transient});
  }
  // Simulated GPUs and the CPU all compute on this machine's cores: one measurement for all, so
  // that equal devices get equal speeds, and one compute at a time (PlanInputs::shared_compute).
  double host_flops = 0;
  for (const kernels::DeviceInfo& d : devices.devices) {
    double flops = 0;
    double link = d.link.bytes_per_s, latency = d.link.latency_s;
    if (devices.mode == DeviceMode::kCuda || devices.mode == DeviceMode::kPlanned) {
      flops = device_flops(d, devices.mode, config.model.dtype);
      // The link the card can run at (it drops to a lower generation when idle).
      link = pcie_bytes_per_s(d.pcie_gen_max ? d.pcie_gen_max : d.pcie_gen,
                              d.pcie_width_max ? d.pcie_width_max : d.pcie_width);
      if (link == 0) link = 20e9;  // unknown: a PCIe 4.0 x16 slot
      latency = 10e-6;
    } else {
      if (host_flops == 0) {
        const models::LoraConfig adapters = config.lora_config();
        host_flops = cpu_flops(model.config, config.data.seq_len, config.training.batch_rows,
                               config.model.dtype, lora, lora ? &adapters : nullptr);
      }
      flops = host_flops;
    }
    e.inputs.devices.push_back({.speed = flops / ref,
                                .memory_cap = d.bytes_cap,
                                .link_bytes_per_s = link,
                                .link_latency_s = latency});
  }
  e.inputs.shared_compute =
      devices.mode != DeviceMode::kCuda && devices.mode != DeviceMode::kPlanned;
  // The head computes in host memory in short chunks of logits, at a speed of its own (measured
  // like the block's): its costs are scaled so that host_flops gives its time.
  if (host_flops > 0)
    for (std::size_t l = 0; l < specs.size(); ++l)
      if (specs[l].kind == models::LayerKind::kHead) {
        bool trained = false;
        for (const offload::TensorDesc& t : pl.layers[l].tensors)
          trained = trained || (t.trainable && t.numel > model.config.hidden_size);
        const double head_flops =
            cpu_head_flops(model.config, config.data.seq_len, config.training.batch_rows,
                           config.model.dtype, trained);
        e.inputs.layers[l].forward_s_per_token *= host_flops / head_flops;
        e.inputs.layers[l].backward_s_per_token *= host_flops / head_flops;
      }
  // The optimizer runs on this machine's CPU (for a card planned from the table too: its host is
  // taken to be like this one), on f32 gradients (grad_bytes above).
  if (e.trained_params > 0)
    e.inputs.optimizer_s_per_grad_byte =
        1.0 / (4.0 * cpu_optimizer_params_per_s(config.model.dtype, eight_bit));
  e.speed_probe_busy = speed_probe_caveat();
  e.inputs.tokens_per_step = tokens_per_step;
  // Per token of a step, on each device (the engine uploads a step's inputs once per device):
  // token id, target, position, document id (int64 each), the rotary cos and sin rows (the
  // documents' int32 offsets, a few per row, are left out). Built there for the microbatch a job
  // runs (models::limit_attention): a row of one mask (one bool per key) for packed rows or rows
  // longer than the sliding window, and of a second where both and the window is only some
  // layers'; none where packed rows attend per document, which a GPU does where flash attention
  // takes the model and every card is Ampere or newer (models::attend_per_document; flash's
  // backward for head sizes above 192 runs on some cards only, so those are counted with masks),
  // the CPU where its documents are long (known once the data is read, else counted). A packed
  // microbatch whose rows each hold one document has no documents to attend to
  // (models::packed_doc_ids): rows longer than the window still get the window's mask, so that one
  // is counted in any case.
  const std::uint64_t uploaded_bytes_per_token =
      4 * 8 + 2 * static_cast<std::uint64_t>(model.config.head_dim) * wb;
  {
    const std::int64_t seq = std::max<std::int64_t>(config.data.seq_len, 0);
    const auto T = static_cast<std::uint64_t>(seq);
    const bool gpus = devices.mode == DeviceMode::kCuda || devices.mode == DeviceMode::kPlanned;
    const at::ScalarType dtype = config.model.dtype == "bf16"   ? at::kBFloat16
                                 : config.model.dtype == "fp16" ? at::kHalf
                                                                : at::kFloat;
    bool per_document = gpus && config.data.pack && model.config.head_dim <= 192 &&
                        models::flash_may_attend_per_document(model.config, dtype);
    for (const kernels::DeviceInfo& d : devices.devices)
      per_document = per_document && d.compute_major >= 8;
    // The CPU and simulated devices attend per document where a microbatch's documents are 32
    // tokens long on average (and none is cut by a window): known once the data is read.
    const std::int64_t mean_doc = config.data.mean_example_tokens;
    if ((devices.mode == DeviceMode::kCpu || devices.mode == DeviceMode::kSim) && mean_doc >= 32)
      per_document = config.data.pack &&
                     (model.config.sliding_window == 0 || mean_doc <= model.config.sliding_window);
    const bool windowed = model.config.sliding_window > 0 && seq > model.config.sliding_window;
    e.inputs.input_bytes_per_token = uploaded_bytes_per_token;
    const bool pack = config.data.pack;
    e.inputs.mask_bytes_per_token =
        per_document ? (windowed ? T : 0)
                     : (pack || windowed ? T : 0) +
                           (pack && windowed && !model.config.sliding_layers.empty() ? T : 0);
  }
  e.inputs.microbatches = M;
  e.inputs.one_step_stale = config.training.one_step_stale;
  e.inputs.mlp_tile_tokens = config.training.sequence_tile;
  bool planned = false;
  try {
    e.plan = plan_ours(e.inputs);
    planned = true;
  } catch (const Error& err) {
    e.problems.push_back(std::string("device memory: ") + err.what());
  }
  const std::size_t N = std::max<std::size_t>(devices.devices.size(), 1);
  // Host staging for activations, two steps in flight: the outputs handed between jobs on
  // different devices (two per device at most: one being written, one being read) and each step's
  // packed inputs (the main thread prepares up to two steps ahead of the one running). The
  // checkpoints each backward stage (or, in layer grain, each block) waits for are counted apart
  // (HostNeeds::checkpoints, in needs() below).
  const auto T = static_cast<std::uint64_t>(tokens_per_step);
  e.host.staging = (2 * N + 2) * T * C * wb + 3 * T * uploaded_bytes_per_token;
  // The checkpoints of e.plan (sized again if the plan changes below). On the NVMe tier instead,
  // host memory holds per device the read-back checkpoints of three microbatches' worth of a
  // backward job (one being uploaded, whose staging goes back to the pool once it has landed; the
  // next one, read ahead; and the next job's first, read ahead by its loader), and overall those
  // waiting for the drive (offload/activation_spill.h: 4 queued, one being written, one per device
  // downloaded).
  std::uint64_t spill_window = 0;
  auto size_checkpoints = [&] {
    const std::set<int> saved = planned ? e.plan.checkpointed_layers() : std::set<int>{};
    const auto M_plan = static_cast<std::uint64_t>(std::max(planned ? e.plan.microbatches : 1, 1));
    pl.activation_checkpoint_bytes = (T + M_plan - 1) / M_plan * C * wb;  // one microbatch's
    pl.host_activations = 2 * saved.size() * T * C * wb;
    std::uint64_t per_job = 0;
    if (planned)
      for (const LayerRange& r : e.plan.backward)
        per_job = std::max<std::uint64_t>(
            per_job, std::distance(saved.lower_bound(r.begin), saved.lower_bound(r.end)));
    spill_window = ((4 + 1 + N) + 3 * N * per_job) * pl.activation_checkpoint_bytes;
  };
  size_checkpoints();

  // --- Host memory and the NVMe tier ----------------------------------------------------------
  // The drive's read speed: as set, else as `rondo devices --disk` measured it, else assumed.
  if (!config.hardware.disk_speed.empty()) {
    pl.disk_bytes_per_s =
        static_cast<double>(parse_bytes(config.hardware.disk_speed, "hardware.disk_speed"));
    pl.disk_speed_source = "hardware.disk_speed";
  } else if (const std::optional<RememberedDiskSpeed> r =
                 config.hardware.offload_dir.empty()
                     ? std::nullopt
                     : remembered_disk_speed(config.hardware.offload_dir)) {
    pl.disk_bytes_per_s = r->read_bytes_per_s;
    pl.disk_speed_source =
        fmt::format("measured {} by rondo devices --disk {}", r->measured_at, r->dir);
  } else {
    pl.disk_bytes_per_s = 3e9;
    pl.disk_speed_source =
        "assumed; `rondo devices --disk DIR` measures the drive and plans remember it";
  }
  // On the CPU device the device's memory is host memory: the budget holds it too (Note [Host
  // budget]). What it computes on beyond the store: weights copied from the NVMe tier (those in
  // host memory are read in place, EngineOptions::share_frozen_weights; quantised ones are
  // dequantised, counted as planned), gradient accumulators unless they are the store's own
  // (share_trained_state, exact training, gradients in host memory), and activations: the plan's
  // peak for those.
  const bool cpu_device = devices.mode == DeviceMode::kCpu;
  auto cpu_device_peak = [&](const std::vector<offload::LayerDesc>& layers) -> std::uint64_t {
    if (!planned || !cpu_device) return 0;
    PlanInputs cpu = e.inputs;
    for (std::size_t l = 0; l < cpu.layers.size(); ++l) {
      LayerCosts& c = cpu.layers[l];
      if (c.device_param_bytes == 0) {
        c.param_bytes = 0;
        for (int p : {kBase, kTrained})
          if (tier_of(layers[l], p) == offload::Tier::kNvme) c.param_bytes += parts[l][p];
      }
      if (!config.training.one_step_stale && tier_of(layers[l], kGrads) == offload::Tier::kHost)
        c.grad_bytes = 0;
    }
    const PlanPrediction on_cpu = predict(e.plan, cpu);
    return on_cpu.peak_bytes.empty() ? 0 : on_cpu.peak_bytes[0];
  };
  auto needs = [&](const std::vector<offload::LayerDesc>& layers) {
    HostNeeds h = e.host;
    h.cpu_device = cpu_device_peak(layers);
    h.checkpoints = pl.activations == offload::Tier::kNvme
                        ? std::min(spill_window, pl.host_activations)
                        : pl.host_activations;
    const offload::LayerStore::HostBytes hb =
        offload::LayerStore::host_bytes(layers, sd, kernels::FloatDType::kF32);
    h.weights = hb.weights;
    h.masters = hb.masters;
    h.moments = hb.optimizer - hb.masters;
    h.grads = hb.gradients;
    h.nvme_staging = nvme_staging(layers, parts, pl.chunk_bytes, N, wb);
    return h;
  };
  e.host = needs(pl.layers);
  // After e.plan changed: the plan that runs may save other checkpoints (what they take, here and
  // on the tier), and the CPU device holds other stages.
  auto needs_for_plan = [&] {
    size_checkpoints();
    if (pl.activations == offload::Tier::kNvme) {
      pl.nvme_bytes -= pl.spill_bytes;
      pl.spill_bytes = checkpoint_spill_bytes(e.plan, pl.activation_checkpoint_bytes);
      pl.nvme_bytes += pl.spill_bytes;
    }
    e.host = needs(pl.layers);
  };
  const std::string& offload_dir = config.hardware.offload_dir;
  // With an NVMe tier, state moves there until the host keeps 15% headroom (a run at the edge of
  // its budget fails on the first allocation the plan did not foresee; "tight" starts there).
  const std::uint64_t target = e.host_available / 100 * 85;
  // State of these classes back from the tier, class by class in this order and the first layers
  // first, while the host keeps that headroom; whether any came back.
  auto bring_back = [&](std::initializer_list<int> classes) {
    bool any = false;
    for (int p : classes)
      for (std::size_t l = 0; l < pl.layers.size(); ++l) {
        if (tier_of(pl.layers[l], p) != offload::Tier::kNvme) continue;
        tier_of(pl.layers[l], p) = offload::Tier::kHost;
        const HostNeeds back = needs(pl.layers);
        if (back.total() > target) {
          tier_of(pl.layers[l], p) = offload::Tier::kNvme;
          break;
        }
        e.host = back;
        any = true;
      }
    return any;
  };
  if (e.host.total() > target && !offload_dir.empty()) {
    // Move state to NVMe, the cheapest per byte first: optimizer state (touched once per step),
    // then gradients (written once as they come down, read once by the optimizer), then the
    // frozen base (read by two jobs per step), then activation checkpoints (written and read once
    // per step, but on the backward's path: read one microbatch ahead of it), then trained
    // weights (written and read every step); the last layers first (the first stage's layers are
    // needed first after an update). Layers with tied tensors stay (their owner and the tying
    // layer share a copy), and so do gradients that several ranks sum (in host memory).
    const bool summed = config.distributed.ranks > 1;
    for (int p : {kOptimizer, kGrads, kBase, kActivations, kTrained}) {
      if (p == kActivations) {
        if (e.host.total() > target && spill_window < pl.host_activations) {
          pl.activations = offload::Tier::kNvme;
          e.host = needs(pl.layers);
        }
        continue;
      }
      for (std::size_t l = pl.layers.size(); l-- > 0;) {
        if (e.host.total() <= target) break;
        if (parts[l][p] == 0 || layer_has_ties(pl.layers, l) || (p == kGrads && summed)) continue;
        tier_of(pl.layers[l], p) = offload::Tier::kNvme;
        e.host = needs(pl.layers);
      }
    }
    // The checkpoints move all at once, and may free more than was missing: layers moved before
    // them come back while the host keeps its headroom (the last moved first).
    if (pl.activations == offload::Tier::kNvme) bring_back({kBase, kGrads, kOptimizer});
  }
  // Bytes by class and tier, the tier's size, and its traffic in the plan's inputs (reads before
  // uploads, and the optimizer's read-modify-writes), for the placement as it stands.
  auto account = [&] {
    for (int p = 0; p < 4; ++p) {
      pl.host_part[p] = pl.nvme_part[p] = 0;
      pl.nvme_layers[p] = 0;
    }
    for (std::size_t l = 0; l < pl.layers.size(); ++l)
      for (int p = 0; p < 4; ++p) {
        if (tier_of(pl.layers[l], p) == offload::Tier::kNvme) {
          pl.nvme_part[p] += parts[l][p];
          ++pl.nvme_layers[p];
        } else {
          pl.host_part[p] += parts[l][p];
        }
      }
    pl.nvme_bytes = offload::LayerStore::nvme_bytes(pl.layers, sd, pl.chunk_bytes);
    if (pl.activations == offload::Tier::kNvme) {
      pl.spill_bytes = checkpoint_spill_bytes(e.plan, pl.activation_checkpoint_bytes);
      pl.nvme_bytes += pl.spill_bytes;
      e.inputs.checkpoints_on_nvme = true;
    }
    for (std::size_t l = 0; l < pl.layers.size(); ++l) {
      LayerCosts& c = e.inputs.layers[l];
      c.nvme_read_bytes = 0;
      c.nvme_update_bytes = 0;
      for (int p : {kBase, kTrained})
        if (tier_of(pl.layers[l], p) == offload::Tier::kNvme) c.nvme_read_bytes += parts[l][p];
      for (int p : {kTrained, kOptimizer, kGrads})
        if (tier_of(pl.layers[l], p) == offload::Tier::kNvme) c.nvme_update_bytes += parts[l][p];
    }
  };
  account();
  if (pl.nvme_bytes > 0) {
    // Plan again with the tier's traffic.
    e.inputs.nvme_bytes_per_s = pl.disk_bytes_per_s;
    if (planned) {
      try {
        e.plan = plan_ours(e.inputs);
      } catch (const Error&) {
        // Unchanged device memory: the earlier plan stands.
      }
      needs_for_plan();
      // On the CPU device the placement judged the device under the first plan, whose stages
      // (larger, with no NVMe traffic to hide) held more copies than this one's: state comes back
      // from the tier while the host keeps its headroom, the most costly on the drive first
      // (trained weights, then the frozen base, gradients, optimizer state), the first layers
      // first, and the plan stands (its stages only get cheaper).
      if (cpu_device && bring_back({kTrained, kBase, kGrads, kOptimizer})) account();
    }
    // hardware.disk_space, when given, is the space the run may use there (a cap on a shared
    // drive, or the drive a plan is for); what is free now is checked against the same need.
    const std::uint64_t free_now = disk_space_free(offload_dir);
    const std::string& space = config.hardware.disk_space;
    pl.offload_free = space.empty() ? free_now : parse_bytes(space, "hardware.disk_space");
    if (pl.nvme_bytes > pl.offload_free)
      e.problems.push_back(
          space.empty()
              ? fmt::format("hardware.offload_dir: {} must go to the NVMe tier but {} is free in "
                            "{}; free space there or choose a larger drive",
                            format_bytes(pl.nvme_bytes), format_bytes(pl.offload_free), offload_dir)
              : fmt::format("hardware.disk_space: {} must go to the NVMe tier but the run may use "
                            "{} of {}; a larger hardware.disk_space or more host memory",
                            format_bytes(pl.nvme_bytes), format_bytes(pl.offload_free),
                            offload_dir));
    else if (pl.nvme_bytes > free_now)
      e.warnings.push_back(fmt::format(
          "hardware.disk_space: {} must go to the NVMe tier but only {} is free in {} now; a run "
          "here fails at its start (the store reserves its file) unless there is room by then",
          format_bytes(pl.nvme_bytes), format_bytes(free_now), offload_dir));
  }

  // The CPU device and the arena share the budget: when together they pass it, plan again with
  // the device capped at what the arena leaves of the budget's 85% (smaller stages hold fewer
  // layers' copies and gradients at once), and the CPU device opens with that cap.
  if (planned && cpu_device && e.host.total() > target && !e.inputs.devices.empty()) {
    const std::uint64_t arena = e.host.total() - e.host.cpu_device;
    if (target > arena) {
      PlanInputs capped = e.inputs;
      capped.devices[0].memory_cap = std::min<std::uint64_t>(
          capped.devices[0].memory_cap ? capped.devices[0].memory_cap : target - arena,
          target - arena);
      try {
        e.plan = plan_ours(capped);
        e.inputs = capped;
        e.devices.devices[0].bytes_cap = capped.devices[0].memory_cap;
        needs_for_plan();
        // Its smaller stages hold fewer copies: what the host now has room for comes back from
        // the tier, as after the plan above (the device's cap stands: the budget check counts
        // its predicted peak, which bringing state back only lowers).
        if (bring_back({kTrained, kBase, kGrads, kOptimizer})) account();
      } catch (const Error&) {
        // No plan fits the device under it: the host memory problem below says what to change.
      }
    }
  }

  if (planned) {
    e.prediction = predict(e.plan, e.inputs);
    e.tokens_per_s = tokens_per_step / std::max(e.prediction.step_time_s, 1e-12);
    e.seconds = e.prediction.step_time_s * static_cast<double>(steps);
    // Whether the drive sets the step time: the same step with the NVMe tier free. Its traffic is
    // mostly per step (weights read, optimizer state read and written) while compute grows with
    // the tokens, so about `ratio` times the tokens per step would hide it behind compute.
    if (e.inputs.nvme_bytes_per_s > 0) {
      PlanInputs free_drive = e.inputs;
      free_drive.nvme_bytes_per_s = 0;
      e.step_time_without_drive_s = predict(e.plan, free_drive).step_time_s;
      if (e.prediction.step_time_s > 1.1 * e.step_time_without_drive_s &&
          e.step_time_without_drive_s > 0) {
        const double ratio = e.prediction.step_time_s / e.step_time_without_drive_s;
        e.tokens_per_step_to_hide_drive =
            static_cast<std::int64_t>(std::ceil(static_cast<double>(tokens_per_step) * ratio));
        e.grad_accum_to_hide_drive = static_cast<int>(
            std::ceil(static_cast<double>(std::max(config.training.grad_accum, 1)) * ratio));
      }
    }
    // The same step's weights at full width (no quantisation).
    e.weights_up_unquantised = e.prediction.bytes_weights_up;
    for (std::size_t l = 0; l < e.inputs.layers.size(); ++l) {
      const LayerCosts& c = e.inputs.layers[l];
      if (c.device_param_bytes == 0) continue;
      int jobs_with_l = 0;
      for (const LayerRange& r : e.plan.forward)
        jobs_with_l += r.begin <= static_cast<int>(l) && static_cast<int>(l) < r.end;
      for (const LayerRange& r : e.plan.backward)
        jobs_with_l += r.begin <= static_cast<int>(l) && static_cast<int>(l) < r.end;
      jobs_with_l += e.plan.tail.begin <= static_cast<int>(l);
      e.weights_up_unquantised +=
          jobs_with_l * (static_cast<double>(c.device_param_bytes) - c.param_bytes);
    }
    for (std::size_t d = 0; d < e.prediction.peak_bytes.size(); ++d) {
      const std::uint64_t cap = e.inputs.devices[d].memory_cap;
      if (cap > 0 && e.prediction.peak_bytes[d] > cap * 9 / 10)
        e.warnings.push_back(fmt::format(
            "device {} ({}): the plan's peak {} is within 10% of its {}; a longer sequence or "
            "larger batch may not fit",
            d, devices.devices[d].name, format_bytes(e.prediction.peak_bytes[d]),
            format_bytes(cap)));
    }
  }

  const std::uint64_t need = e.host.total();
  const std::string breakdown = fmt::format(
      "weights {}, masters {}, moments {}, gradients {}, loading {}, staging {}, activation "
      "checkpoints {}{}{}",
      format_bytes(e.host.weights), format_bytes(e.host.masters), format_bytes(e.host.moments),
      format_bytes(e.host.grads), format_bytes(e.host.loading), format_bytes(e.host.staging),
      format_bytes(e.host.checkpoints),
      e.host.nvme_staging ? ", NVMe staging " + format_bytes(e.host.nvme_staging) : "",
      e.host.cpu_device ? ", what the CPU device computes on " + format_bytes(e.host.cpu_device)
                        : "");
  if (need > e.host_available) {
    // What would make it fit, only what applies to this run.
    std::vector<std::string> fixes;
    if (offload_dir.empty()) {
      TrainConfig with = config;
      with.hardware.offload_dir = "/nonexistent-offload-probe";
      const RunEstimate probe = estimate_run(with, model, devices, steps, tokens_per_step,
                                             e.host_available, disk_free ? disk_free : 1);
      fixes.push_back(probe.host.total() <= e.host_available
                          ? fmt::format("set hardware.offload_dir to a folder on an NVMe drive ({} "
                                        "would go there)",
                                        format_bytes(probe.placement.nvme_bytes))
                          : "set hardware.offload_dir to a folder on an NVMe drive (not enough "
                            "alone)");
    }
    if (lora && pl.quantize == "none")
      fixes.push_back(gguf ? "model.quantize = gguf (keep the file's block types)"
                           : "model.quantize = nf4 (the frozen base in about 0.56 bytes per "
                             "parameter)");
    if (lora && config.model.dtype == "fp32") fixes.push_back("model.dtype = bf16");
    // (8-bit moments take host memory only where the moments are there.)
    if (!lora && !eight_bit && (offload_dir.empty() || pl.host_part[kOptimizer] > 0))
      fixes.push_back(
          "training.optimizer = adamw_8bit (AdamW moments in 2 bytes per parameter, not 8)");
    if (!lora) fixes.push_back("training.method = lora (no masters or moments for the base)");
    if (!config.hardware.host_memory.empty())
      fixes.push_back("a larger hardware.host_memory, if the machine has it");
    else
      fixes.push_back("a machine with more memory");
    std::string what;
    for (std::size_t i = 0; i < fixes.size(); ++i)
      what += (i == 0 ? "" : i + 1 == fixes.size() ? ", or " : ", ") + fixes[i];
    e.problems.push_back(
        fmt::format("host memory: the run needs about {} ({}) but {} is "
                    "available; {}",
                    format_bytes(need), breakdown, format_bytes(e.host_available), what));
  } else if (need > e.host_available / 100 * 85) {
    e.warnings.push_back(fmt::format("host memory: the run needs about {} of the {} available",
                                     format_bytes(need), format_bytes(e.host_available)));
  }

  const auto TP = static_cast<std::uint64_t>(e.trained_params);
  const auto P = static_cast<std::uint64_t>(e.params);
  // Masters and moments (f32, or 8-bit codes with an absmax per 256), and the streaming copies of
  // a one-step-stale run.
  e.checkpoint_bytes = TP * 4 + (eight_bit ? TP * 2 + (TP + 255) / 256 * 8 : TP * 8) +
                       (config.training.one_step_stale ? TP * wb : 0) + 4096;
  const std::int64_t every =
      std::max<std::int64_t>(config.checkpoint.every > 0 ? config.checkpoint.every : steps, 1);
  // Checkpoints at every multiple of `every` and at the last step; with checkpoint.keep = K a new
  // one is written before the oldest goes, so K + 1 are on disk at the peak.
  const std::int64_t from = resume ? resume->step : 0;
  const std::int64_t to_write =
      steps <= from ? 0 : steps / every - from / every + (steps % every != 0 ? 1 : 0);
  const auto on_disk = resume ? static_cast<std::int64_t>(resume->checkpoints) : 0;
  const std::int64_t peak =
      config.checkpoint.keep > 0
          ? std::min<std::int64_t>(config.checkpoint.keep + 1, on_disk + to_write)
          : on_disk + to_write;
  e.disk_needed = e.checkpoint_bytes * static_cast<std::uint64_t>(std::max<std::int64_t>(
                                           peak - on_disk, to_write > 0 ? 1 : 0));
  // Exports: their tensors, rounded up (headers, adapter_config.json; 1 MiB each), and for a
  // merged one the model folder's other files it copies (config, tokenizer).
  std::uint64_t side_files = 0;
  std::error_code ec;
  if (fs::is_directory(config.model.path, ec))
    for (fs::directory_iterator it(config.model.path, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string ext = it->path().extension().string();
      std::error_code e2;
      if (it->is_regular_file(e2) && ext != ".safetensors" && ext != ".bin" && ext != ".gguf" &&
          ext != ".pt" && ext != ".pth") {
        const std::uintmax_t n = it->file_size(e2);
        if (!e2) side_files += n;
      }
    }
  for (const std::string& x : config.output.exports)
    e.disk_needed +=
        (x == "adapter" ? TP * 4 : P * wb) + (x == "merged" ? side_files : 0) + (1u << 20);
  e.disk_free = disk_free ? disk_free : disk_space_free(config.output.run_dir);
  if (const std::string why = why_unwritable(config.output.run_dir); !why.empty()) {
    e.problems.push_back(fmt::format(
        "output.run_dir: cannot write the run folder {} ({}); choose a folder on a disk you can "
        "write to",
        config.output.run_dir, why));
  } else if (e.disk_needed > e.disk_free) {
    if (resume)
      e.problems.push_back(fmt::format(
          "disk: what is left of this run ({} more checkpoint{} and the exports) needs about {} "
          "but {} is free under {}; free space on that disk, or move the run folder to a "
          "larger disk and resume it there",
          to_write, to_write == 1 ? "" : "s", format_bytes(e.disk_needed),
          format_bytes(e.disk_free), config.output.run_dir));
    else
      e.problems.push_back(fmt::format(
          "disk: checkpoints and exports need about {} but {} is free under {}; set "
          "output.run_dir on a larger disk or lower checkpoint.keep",
          format_bytes(e.disk_needed), format_bytes(e.disk_free), config.output.run_dir));
  }
  e.verdict = !e.problems.empty() ? "does not fit" : !e.warnings.empty() ? "tight" : "fits";
  return e;
}

}  // namespace rondo::engine
