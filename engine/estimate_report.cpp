// What `rondo plan` prints and the GUI reads of a RunEstimate: the report (text) and the same
// as one JSON object (estimate.h).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/estimate.h"
#include "engine/ranks.h"
#include "offload/nvme_store.h"

namespace rondo::engine {
namespace {

std::string duration_text(double s) {
  if (s < 90) return fmt::format("{:.0f} s", s);
  if (s < 5400) return fmt::format("{:.0f} min", s / 60);
  return fmt::format("{:.1f} h", s / 3600);
}

// A drive's speed as a person reads it: "3.0 GB/s", "20 MB/s".
std::string rate_text(double bytes_per_s) {
  return bytes_per_s >= 1e9 ? fmt::format("{:.1f} GB/s", bytes_per_s / 1e9)
                            : fmt::format("{:.0f} MB/s", bytes_per_s / 1e6);
}

}  // namespace

std::string format_bytes(std::uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string format_count(std::int64_t n) {
  const double v = static_cast<double>(n);
  if (v >= 1e9) return fmt::format("{:.2f} B", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.1f} M", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.1f} K", v / 1e3);
  return std::to_string(n);
}

std::string RunEstimate::text() const {
  std::ostringstream o;
  o << fmt::format("Parameters  {}, {} trained\n", format_count(params),
                   format_count(trained_params));
  if (experts > 0)
    o << fmt::format(
        "Experts     {} per sparse block, {} per token: {} parameters active per token of {} "
        "(compute counts the active ones; every expert's weights stream)\n",
        experts, experts_per_token, format_count(static_cast<std::int64_t>(active_params)),
        format_count(params));
  o << fmt::format("Devices     {} ({}{})\n", devices.devices.size(), to_string(devices.mode),
                   devices.mode == DeviceMode::kPlanned ? ": " + devices.why_no_gpu : "");
  if (!plan.forward.empty() || plan.tail.end > 0) {
    o << fmt::format("Plan        {}\n", plan.describe());
    for (std::size_t d = 0; d < devices.devices.size() && d < prediction.peak_bytes.size(); ++d)
      o << fmt::format("  device {} {:<24} peak {:>10} of {:>10}\n", d, devices.devices[d].name,
                       format_bytes(prediction.peak_bytes[d]),
                       format_bytes(devices.devices[d].bytes_cap));
  }
  o << fmt::format("Host memory {} needed{}, {} available (plus {} for the process itself)\n",
                   format_bytes(host.total()),
                   host.cpu_device ? fmt::format(" ({} of it what the CPU device computes on)",
                                                 format_bytes(host.cpu_device))
                                   : "",
                   format_bytes(host_available), format_bytes(host_overhead));
  o << placement.lines();
  if (placement.nvme_bytes > 0)
    o << fmt::format("NVMe tier   {} in the offload folder ({} to use), read at {} ({})\n",
                     format_bytes(placement.nvme_bytes), format_bytes(placement.offload_free),
                     rate_text(placement.disk_bytes_per_s), placement.disk_speed_source);
  o << fmt::format("Disk        {} needed, {} free\n", format_bytes(disk_needed),
                   format_bytes(disk_free));
  if (prediction.step_time_s > 0) {
    o << fmt::format("Per step    {:.3g} s; links {} up ({} of it weights", prediction.step_time_s,
                     format_bytes(static_cast<std::uint64_t>(prediction.bytes_up)),
                     format_bytes(static_cast<std::uint64_t>(prediction.bytes_weights_up)));
    if (weights_up_unquantised > prediction.bytes_weights_up)
      o << fmt::format(", {} unquantised",
                       format_bytes(static_cast<std::uint64_t>(weights_up_unquantised)));
    o << fmt::format("), {} down", format_bytes(static_cast<std::uint64_t>(prediction.bytes_down)));
    if (prediction.bytes_nvme_read + prediction.bytes_nvme_write > 0)
      o << fmt::format("; NVMe {} read, {} written",
                       format_bytes(static_cast<std::uint64_t>(prediction.bytes_nvme_read)),
                       format_bytes(static_cast<std::uint64_t>(prediction.bytes_nvme_write)));
    o << "\n";
  }
  if (tokens_per_step_to_hide_drive > 0)
    o << fmt::format(
        "Drive       sets the step time: {:.3g} s a step, {:.3g} s with the drive free (NVMe {} "
        "read and {} written per step at {}); about {} tokens per step "
        "(training.grad_accum = {}) would hide it behind compute\n",
        prediction.step_time_s, step_time_without_drive_s,
        format_bytes(static_cast<std::uint64_t>(prediction.bytes_nvme_read)),
        format_bytes(static_cast<std::uint64_t>(prediction.bytes_nvme_write)),
        rate_text(placement.disk_bytes_per_s), tokens_per_step_to_hide_drive,
        grad_accum_to_hide_drive);
  if (ranks > 1 && allreduce_s > 0)
    o << fmt::format(
        "Ranks       {} ranks, each the step above on its share; {} of gradients summed across "
        "them "
        "a step over a {} link ({}): {:.3g} s, overlapped with the backward but the last {}{}; a "
        "step of the run about {:.3g} s\n",
        ranks, format_bytes(static_cast<std::uint64_t>(gradient_bytes)),
        rate_text(link_bytes_per_s), link_speed_source, allreduce_s,
        format_bytes(std::min<std::uint64_t>(static_cast<std::uint64_t>(gradient_bytes),
                                             kGradientBucketBytes)),
        broadcast_s > 0
            ? fmt::format("; optimizer state sharded, {} of new weights broadcast from their "
                          "owners: {:.3g} s",
                          format_bytes(static_cast<std::uint64_t>(broadcast_bytes)), broadcast_s)
            : std::string(),
        step_time_ranks_s);
  if (tokens_per_s > 0) {
    if (steps > 0)
      o << fmt::format(
          "Speed       about {:.0f} tokens/s (estimated; tokens here are row positions, padding "
          "included); {} steps of {} tokens: about {}\n",
          tokens_per_s, steps, tokens_per_step, duration_text(seconds));
    else
      o << fmt::format(
          "Speed       about {:.0f} tokens/s (estimated; row positions, padding included), {} "
          "tokens per step\n",
          tokens_per_s, tokens_per_step);
  }
  if (reference_s > 0)
    o << fmt::format(
        "            DPO's reference: every pair scored once with the starting weights before "
        "step 1, {} tokens: about {}{}\n",
        reference_tokens, duration_text(reference_s), steps > 0 ? " (in the time above)" : "");
  if (speed_probe_busy > 0)
    o << fmt::format(
        "            measured while other programs kept {:.0f}% of the CPU busy: the speed may be "
        "low; plan again when the machine is quiet (runs correct it)\n",
        100 * speed_probe_busy);
  o << fmt::format("Verdict     {}\n", verdict);
  for (const std::string& p : problems)
    o << "  - " << p << "\n";
  for (const std::string& w : warnings)
    o << "  - " << w << "\n";
  for (const Fix& f : fixes) {  // each planned: it fits with this change
    std::string set;
    for (const auto& [key, value] : f.set)
      set += (set.empty() ? "" : " ") + fmt::format("--set {}={}", key, value);
    o << fmt::format("To fit      {} ({})\n", set, f.why);
  }
  if (longest_seq_len == 0)
    o << fmt::format("Longest     no sequence of {} tokens or more fits\n", kSeqLenStep);
  else if (longest_seq_len > 0)
    o << fmt::format(
        "Longest     {} tokens per row fit (data.seq_len; rows, microbatches and "
        "the rest as set){}\n",
        longest_seq_len,
        longest_is_positions ? "; the model's positions end there (max_position_embeddings)" : "");
  return o.str();
}

std::string RunEstimate::json() const {
  // Where one class of state lives (Placement's index: frozen, trained, optimizer, gradients).
  auto part = [&](int i) {
    return nlohmann::json{{"host_bytes", placement.host_part[i]},
                          {"nvme_bytes", placement.nvme_part[i]},
                          {"nvme_layers", placement.nvme_layers[i]}};
  };
  nlohmann::json devs = nlohmann::json::array();
  for (std::size_t d = 0; d < devices.devices.size(); ++d)
    devs.push_back(
        {{"name", devices.devices[d].name},
         {"cap_bytes", devices.devices[d].bytes_cap},
         {"peak_bytes", d < prediction.peak_bytes.size() ? prediction.peak_bytes[d] : 0}});
  nlohmann::json fix_list = nlohmann::json::array();
  for (const Fix& f : fixes) {
    nlohmann::json set = nlohmann::json::object();
    for (const auto& [key, value] : f.set)
      set[key] = value;
    fix_list.push_back({{"set", set}, {"why", f.why}});
  }
  nlohmann::json j = {{"verdict", verdict},
                      {"fixes", fix_list},
                      {"longest_seq_len",
                       longest_seq_len >= 0 ? nlohmann::json(longest_seq_len) : nlohmann::json()},
                      {"longest_is_positions", longest_is_positions},
                      {"problems", problems},
                      {"warnings", warnings},
                      {"params", params},
                      {"trained_params", trained_params},
                      {"active_params", active_params},
                      {"experts", experts},
                      {"experts_per_token", experts_per_token},
                      {"mode", to_string(devices.mode)},
                      {"devices", devs},
                      {"plan", plan.forward.empty() && plan.tail.end == 0 ? "" : plan.describe()},
                      {"sequence_tile", plan.mlp_tile_tokens},
                      {"host",
                       {{"needed_bytes", host.total()},
                        {"available_bytes", host_available},
                        {"weights", host.weights},
                        {"masters", host.masters},
                        {"moments", host.moments},
                        {"grads", host.grads},
                        {"loading", host.loading},
                        {"staging", host.staging},
                        {"checkpoints", host.checkpoints},
                        {"nvme_staging", host.nvme_staging},
                        {"cpu_device", host.cpu_device}}},
                      {"disk", {{"needed_bytes", disk_needed}, {"free_bytes", disk_free}}},
                      {"placement",
                       {{"quantize", placement.quantize},
                        {"formats", placement.formats},
                        {"nvme_bytes", placement.nvme_bytes},
                        {"offload_free_bytes", placement.offload_free},
                        {"disk_bytes_per_s", placement.disk_bytes_per_s},
                        {"disk_speed_source", placement.disk_speed_source},
                        {"frozen_weights", part(0)},
                        {"trained_weights", part(1)},
                        {"optimizer_state", part(2)},
                        {"gradients", part(3)},
                        {"optimizer_owners", placement.optimizer_owners},
                        {"activation_checkpoints",
                         {{"tier", offload::to_string(placement.activations)},
                          {"host_bytes", placement.host_activations},
                          {"nvme_bytes", placement.spill_bytes},
                          {"checkpoint_bytes", placement.activation_checkpoint_bytes}}}}},
                      {"traffic_per_step",
                       {{"up_bytes", prediction.bytes_up},
                        {"weights_up_bytes", prediction.bytes_weights_up},
                        {"weights_up_unquantised_bytes", weights_up_unquantised},
                        {"down_bytes", prediction.bytes_down},
                        {"nvme_read_bytes", prediction.bytes_nvme_read},
                        {"nvme_write_bytes", prediction.bytes_nvme_write}}},
                      {"step_seconds", prediction.step_time_s},
                      {"drive",
                       {{"bound", tokens_per_step_to_hide_drive > 0},
                        {"step_seconds_without_drive", step_time_without_drive_s},
                        {"tokens_per_step_to_hide", tokens_per_step_to_hide_drive},
                        {"grad_accum_to_hide", grad_accum_to_hide_drive}}},
                      {"host_overhead_bytes", host_overhead},
                      {"checkpoint_bytes", checkpoint_bytes},
                      {"steps", steps},
                      {"steps_per_epoch", steps_per_epoch},
                      {"tokens_per_step", tokens_per_step},
                      {"tokens_per_s", tokens_per_s},
                      {"speed_probe_busy", speed_probe_busy},
                      {"distributed",
                       {{"ranks", ranks},
                        {"link_bytes_per_s", link_bytes_per_s},
                        {"link_speed_source", link_speed_source},
                        {"gradient_bytes", gradient_bytes},
                        {"allreduce_seconds", allreduce_s},
                        {"step_seconds_one_rank", step_time_one_rank_s},
                        {"optimizer_sharded", !placement.optimizer_owners.empty()},
                        {"broadcast_bytes", broadcast_bytes},
                        {"broadcast_seconds", broadcast_s},
                        {"step_seconds", step_time_ranks_s}}},
                      {"reference", {{"tokens", reference_tokens}, {"seconds", reference_s}}},
                      {"seconds", seconds}};
  return j.dump(2);
}

std::string placement_json(const RunEstimate& est, const offload::NvmeStore* nvme) {
  nlohmann::json j = nlohmann::json::parse(est.json()).at("placement");
  if (nvme) {
    const offload::NvmeStoreInfo i = nvme->info();
    j["backend"] = i.backend;
    j["backend_note"] = i.backend_note;
    j["direct"] = i.direct;
    j["direct_note"] = i.direct_note;
  }
  j["host_budget_bytes"] = est.host_available;
  return j.dump();
}

}  // namespace rondo::engine
