// Generation on the engine's devices (generation.h): the residency choice, and the token loop.
#include "engine/generation.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>

#include "engine/estimate.h"
#include "engine/jobs.h"
#include "engine/step_inputs.h"
#include "engine/torch_device.h"
#include "kernels/error.h"
#include "models/layers.h"

namespace rondo::engine {

std::uint64_t generation_bytes(const models::ModelConfig& config, std::size_t element,
                               std::int64_t rows, std::int64_t prompt, std::int64_t positions,
                               std::int64_t blocks) {
  const auto e = static_cast<std::uint64_t>(element);
  const auto R = static_cast<std::uint64_t>(rows), P = static_cast<std::uint64_t>(prompt),
             S = static_cast<std::uint64_t>(positions);
  const std::uint64_t kv_per_block =
      2 * R * S * static_cast<std::uint64_t>(config.num_kv_heads * config.head_dim) * e;
  // While a block attends: its cache extended beside the old copy, and grouped key and value
  // heads repeated up to the query heads (SDPA's grouped-query path on the CPU).
  const auto groups =
      static_cast<std::uint64_t>(config.num_heads / std::max<std::int64_t>(config.num_kv_heads, 1));
  const std::uint64_t kv =
      static_cast<std::uint64_t>(std::max<std::int64_t>(blocks, 0)) * kv_per_block +
      (1 + (groups > 1 ? groups : 0)) * kv_per_block;
  const std::uint64_t wide = static_cast<std::uint64_t>(
      std::max<std::int64_t>(config.intermediate_size, config.moe_intermediate_size));
  // What torch holds at once in a block's prefill, counted on a simulated device's ledger: the
  // input, its fp32 normed copy, the projections with their rotated and adapted copies (about
  // ten hidden widths), and the MLP's gate, up, silu(gate), their product and an adapter's
  // output (five intermediate widths).
  const std::uint64_t acts =
      R * P * (10 * static_cast<std::uint64_t>(config.hidden_size) + 5 * wide) * e;
  const std::uint64_t scores = R * static_cast<std::uint64_t>(config.num_heads) * P * S * 4;
  return kv + acts + scores + R * static_cast<std::uint64_t>(config.vocab_size) * 4;
}

ResidencyChoice choose_residency(const ResidencyQuery& q) {
  const int L = static_cast<int>(q.layer_bytes.size());
  const std::size_t N = q.room.size();
  RONDO_ASSERT(N > 0 && q.stage_layers.size() == q.forward.size() + 1);
  std::uint64_t weight_bytes = 0;
  for (std::uint64_t b : q.layer_bytes)
    weight_bytes += b;
  ResidencyChoice c;
  c.resident =
      q.residency == Residency::kResident ||
      (q.residency == Residency::kAuto && weight_bytes + q.extra(q.blocks) <= q.first_device_room);
  if (!c.resident)
    for (std::size_t j = 0; j < q.forward.size(); ++j)
      c.stages.push_back({.range = q.forward[j], .layers = q.stage_layers[j]});
  // A plan of one stage (the whole model in the tail) streams nothing either: it stays.
  c.resident = c.stages.empty();
  if (c.resident) {
    std::vector<int> all(static_cast<std::size_t>(L));
    for (int l = 0; l < L; ++l)
      all[static_cast<std::size_t>(l)] = l;
    c.stages.push_back({.range = {0, L}, .layers = std::move(all)});
  } else {
    c.stages.push_back({.range = q.tail, .layers = q.stage_layers.back()});
  }
  // Per device: the weights of its stages and its blocks (their KV caches).
  std::vector<std::uint64_t> stage_bytes, device_bytes(N, 0);
  std::vector<std::int64_t> device_blocks(N, 0);
  for (std::size_t j = 0; j < c.stages.size(); ++j) {
    GenerationStage& st = c.stages[j];
    st.device = static_cast<int>(j % N);
    std::uint64_t b = 0;
    for (int l : st.layers)
      b += q.layer_bytes[static_cast<std::size_t>(l)];
    stage_bytes.push_back(b);
    device_bytes[static_cast<std::size_t>(st.device)] += b;
    for (int l = st.range.begin; l < st.range.end; ++l)
      device_blocks[static_cast<std::size_t>(st.device)] += l > 0 && l < L - 1;
  }
  // Spread: when every device holds all of its stages, their blocks' caches and the prefill's
  // temporaries, the stages stay where they are across tokens, loaded once: a model larger than
  // one device but not than all of them streams nothing.
  bool spread = q.residency == Residency::kSpread;
  if (q.residency == Residency::kAuto && !c.resident && N > 1 && c.stages.size() > 1) {
    spread = true;
    for (std::size_t d = 0; d < N; ++d)
      spread = spread && device_bytes[d] + q.extra(device_blocks[d]) <= q.room[d];
  }
  c.spread = spread && !c.resident;
  // Streamed, the KV caches of every block a device runs pile up on it; when they would not fit
  // beside two stages of weights and the prefill's temporaries, they stay in host memory between
  // tokens instead (each block's cache goes up before the block runs and its new positions come
  // back after).
  std::vector<std::uint64_t> largest = stage_bytes;
  std::sort(largest.rbegin(), largest.rend());
  const std::uint64_t two_stages = largest[0] + (largest.size() > 1 ? largest[1] : 0);
  c.kv_host = q.kv_caches == KvCaches::kHost;
  if (q.kv_caches == KvCaches::kAuto && !c.resident && !c.spread)
    for (std::size_t d = 0; d < N; ++d)
      c.kv_host = c.kv_host || two_stages + q.extra(device_blocks[d]) > q.room[d];
  return c;
}

namespace {

// A group's KV cache of one layer in host memory (kv_host): keys and values each (positions,
// rows, KV, D), position-major, so that the positions so far are one contiguous block that goes
// up in one copy, and the new positions come down into one.
struct HostKv {
  offload::HostBuffer k, v;
};

// A group of prompts that travel through the stages together: its rows of the batch, their
// padding and their KV caches (per layer: on the device that runs it, or kv_host in host memory,
// allocated for every position at the group's first pass).
struct Group {
  std::int64_t row = 0, rows = 0;
  std::vector<std::int64_t> pad;
  std::vector<models::KvCache> caches;  // per layer, on the device that runs it
  std::vector<HostKv> host_kv;          // per layer, kv_host
  at::Tensor h;                         // the hidden state, in compute order on its device
  offload::HostBuffer logits;           // (rows, V) fp32, downloaded by the last stage
  // Where the hidden state is between stages: on device h_on, or (-1) in host staging, the last
  // of its crossings this token (each kept until the token's end).
  int h_on = -1;
  std::vector<offload::Staged> crossings;
};

// One generate() call: the stages and groups, and the token loop over them. Every device's work
// is enqueued from this thread; the token ends with every stream synchronised.
class TokenLoop {
 public:
  TokenLoop(const EngineParts& parts, const std::vector<std::vector<std::int64_t>>& prompts,
            const models::SamplingOptions& options, const GenerateSettings& settings,
            ResidencyChoice choice, std::int64_t prompt_length, Generation& out);
  ~TokenLoop();  // frees what the token loop holds, after every device is idle
  void run(at::Tensor next);

 private:
  struct Stage {
    GenerationStage where;
    std::unique_ptr<offload::DeviceWeights> weights;
  };

  // Runs `allocate` (anything that takes device memory on dc); when dc is out of memory, waits for
  // the work already queued on it and tries once more. This thread enqueues ahead of the devices,
  // and buffers it has let go of return to a device only as its streams reach their release: a
  // stage's weights loaded ahead can find the memory still held by work that has not run yet.
  template <typename F>
  auto with_room(DeviceContext& dc, F&& allocate) {
    try {
      return allocate();
    } catch (const kernels::OutOfMemory&) {
      dc.dev->synchronize();
      return allocate();
    }
  }
  std::int64_t groups_for(std::int64_t tokens) const;
  void regroup(std::int64_t groups);
  std::vector<at::Tensor> gathered(const Group& grp, int l, bool keys) const;
  void regather_host(std::int64_t filled);
  void load(std::size_t j);
  // Runs `body` in dc's compute order for stage j's group g, recording a failure; when it computes
  // layer `layer`, the probe hears how long it took.
  void enqueue(DeviceContext& dc, std::size_t j, std::size_t g, std::optional<int> layer,
               std::function<void()> body);
  // The token: every stage for every group, then the next tokens chosen. False once every prompt
  // has stopped.
  bool token(at::Tensor& next);
  void pack_inputs(const at::Tensor& next);
  const std::vector<at::Tensor>& inputs(DeviceContext& dc, std::size_t g);
  void run_stage(std::size_t j);
  void run_block(DeviceContext& dc, std::size_t j, std::size_t g, int l,
                 const models::BlockWeights& bw, const models::AttentionContext& ctx);
  void run_block_host_kv(DeviceContext& dc, std::size_t j, std::size_t g, int l,
                         const models::BlockWeights& bw, const models::AttentionContext& ctx);
  void enqueue_block_host_kv(DeviceContext& dc, std::size_t j, std::size_t g, int l,
                             const models::BlockWeights& bw, const models::AttentionContext& ctx);
  void end_token();
  void rethrow_first() const;

  const EngineParts& parts_;
  const models::ModelConfig& config_;
  offload::Transfers& transfers_;
  const models::SamplingOptions& options_;
  const GenerateSettings& settings_;
  Generation& out_;
  const at::ScalarType act_;
  const std::size_t e_;           // bytes per activation element
  const std::int64_t B_, L_;      // prompts, layers
  const std::int64_t positions_;  // what every cache may hold: the prompt and the new tokens
  const std::int64_t kv_row_elems_;
  const bool kv_host_, streaming_;
  std::vector<Stage> stages_;
  std::vector<std::int64_t> pad_;
  std::vector<std::int64_t> stops_;
  std::vector<std::uint64_t> rng_;
  std::vector<bool> finished_;
  std::int64_t most_groups_ = 1;
  std::vector<Group> groups_, previous_;
  std::int64_t offset_ = 0, count_ = 0;  // the token's first position, its positions
  // Per token: each (stage, group)'s failure; the packed inputs; the device memory and download
  // events the token's copies use until its end.
  std::vector<std::vector<std::exception_ptr>> errors_;
  std::atomic<bool> failing_{false};
  std::vector<PackedLayout> layouts_;
  std::vector<offload::HostBuffer> packs_;
  std::map<std::pair<int, std::size_t>, std::vector<at::Tensor>> inputs_on_;
  std::vector<kernels::DeviceBuffer> token_buffers_;
  std::vector<std::unique_ptr<kernels::Event>> token_events_;
  // Streamed: a device holds the weights of at most two stages (the one running and the next);
  // held_ lists them oldest first, pending_ marks the loaded ones that have not run yet; done_ is
  // each stage's last work on its compute stream.
  std::vector<std::deque<std::size_t>> held_;
  std::vector<bool> pending_;
  std::vector<std::unique_ptr<kernels::Event>> done_;
  // kv_host, per device: events behind the layers whose cache buffers are on their way out. This
  // thread runs ahead of the devices; without a bound it would allocate every queued layer's
  // cache at once.
  std::vector<std::deque<std::unique_ptr<kernels::Event>>> kv_in_flight_;
};

TokenLoop::TokenLoop(const EngineParts& parts,
                     const std::vector<std::vector<std::int64_t>>& prompts,
                     const models::SamplingOptions& options, const GenerateSettings& settings,
                     ResidencyChoice choice, std::int64_t prompt_length, Generation& out)
    : parts_(parts),
      config_(parts.config),
      transfers_(*parts.transfers),
      options_(options),
      settings_(settings),
      out_(out),
      act_(parts.act_dtype),
      e_(c10::elementSize(parts.act_dtype)),
      B_(static_cast<std::int64_t>(prompts.size())),
      L_(static_cast<std::int64_t>(parts.specs.size())),
      positions_(prompt_length + options.max_new_tokens),
      kv_row_elems_(parts.config.num_kv_heads * parts.config.head_dim),
      kv_host_(choice.kv_host),
      streaming_(!choice.resident && !choice.spread),
      held_(parts.devices()),
      pending_(choice.stages.size(), false),
      done_(choice.stages.size()),
      kv_in_flight_(parts.devices()) {
  for (GenerationStage& st : choice.stages)
    stages_.push_back({.where = std::move(st)});
  for (const auto& p : prompts)
    pad_.push_back(prompt_length - static_cast<std::int64_t>(p.size()));
  stops_ = options.stop_tokens.empty() ? config_.eos_token_ids : options.stop_tokens;
  rng_.assign(prompts.size(), options.seed);
  finished_.assign(prompts.size(), false);
  // Prompt groups: with the stages on several devices the prompts split into groups (at most one
  // per device that runs a stage, and per prompt) that follow each other through the stages, as
  // training's microbatches do: while a device runs a stage for group g + 1, the next device runs
  // the next stage for group g, and the devices work together instead of one at a time. A stage's
  // weights serve every group before they go. A pass splits only when each group keeps
  // settings.min_group_tokens rows of tokens: below that a device's time goes to reading the
  // stage's weights, which each group would read again (a decoding pass of a few prompts stays
  // whole; their prefill splits). Resident (one stage): one group.
  // Not on CUDA yet: there every group's work is enqueued from this one thread, and a group's
  // hand-over to the next device goes down and up through host staging behind the work already
  // queued on both devices' streams, which serialises the groups (correct, but no faster than one
  // group; docs/engine.md).
  const std::size_t N = parts.devices(), S = stages_.size();
  const bool cuda = parts.devs[0]->dev->info().kind == kernels::DeviceKind::kCuda;
  most_groups_ = static_cast<std::int64_t>(
      !choice.resident && !cuda && N > 1 && S > 1 ? std::min({N, S, prompts.size()}) : 1);
}

TokenLoop::~TokenLoop() {
  // Work still queued refers to what this holds: on the way out with an error, it ends first.
  for (auto& dc : parts_.devs)
    try {
      dc->dev->synchronize();
    } catch (...) {  // its error is the one being thrown, or follows from it
    }
  for (Stage& st : stages_)
    st.weights.reset();  // the resident weights, or the next token's prefetched stages
  token_buffers_.clear();
  for (auto& dc : parts_.devs)
    try {
      dc->dev->synchronize();  // their stream-ordered release done
    } catch (...) {
    }
  auto give_back = [&](offload::HostBuffer& b) { transfers_.recycle(std::move(b)); };
  for (offload::HostBuffer& hb : packs_)
    give_back(hb);
  for (std::vector<Group>* list : {&groups_, &previous_})
    for (Group& grp : *list) {
      give_back(grp.logits);
      for (offload::Staged& s : grp.crossings)
        give_back(s.host);
      for (HostKv& kv : grp.host_kv) {
        give_back(kv.k);
        give_back(kv.v);
      }
    }
}

std::int64_t TokenLoop::groups_for(std::int64_t tokens) const {
  if (settings_.groups > 0) return std::min<std::int64_t>(settings_.groups, B_);
  return std::clamp<std::int64_t>(tokens / std::max<std::int64_t>(settings_.min_group_tokens, 1), 1,
                                  most_groups_);
}

// When a pass groups the prompts otherwise than the one before (the decoding after a split
// prefill), each layer's caches are gathered for the new groups from the previous ones: on the
// device in the layer's first run (caches on the devices), or on the host before the pass
// (kv_host).
void TokenLoop::regroup(std::int64_t G) {
  previous_.clear();
  if (static_cast<std::int64_t>(groups_.size()) == G) return;
  previous_ = std::move(groups_);
  groups_ = std::vector<Group>(static_cast<std::size_t>(G));
  for (std::int64_t g = 0; g < G; ++g) {
    Group& grp = groups_[static_cast<std::size_t>(g)];
    grp.row = g * B_ / G;
    grp.rows = (g + 1) * B_ / G - grp.row;
    grp.pad.assign(pad_.begin() + grp.row, pad_.begin() + grp.row + grp.rows);
    grp.caches.resize(static_cast<std::size_t>(L_));
    grp.host_kv.resize(static_cast<std::size_t>(L_));
  }
  out_.groups = std::max(out_.groups, G);
}

// Layer l's keys or values for the rows of `grp` from the previous groups' device caches (rows
// along dim 0).
std::vector<at::Tensor> TokenLoop::gathered(const Group& grp, int l, bool keys) const {
  std::vector<at::Tensor> parts;
  for (const Group& o : previous_) {
    const std::int64_t a = std::max(o.row, grp.row),
                       b = std::min(o.row + o.rows, grp.row + grp.rows);
    const models::KvCache& c = o.caches[static_cast<std::size_t>(l)];
    if (a < b && c.k.defined()) parts.push_back((keys ? c.k : c.v).narrow(0, a - o.row, b - a));
  }
  return parts;
}

// kv_host: the previous groups' host caches regathered for the new groups' rows (the first
// `filled` positions), layer by layer, each previous layer's given back once gathered.
void TokenLoop::regather_host(std::int64_t filled) {
  if (previous_.empty() || filled == 0) return;
  auto as_tensor = [&](offload::HostBuffer& hb, std::int64_t rows) {
    return at::from_blob(hb.data(), {positions_, rows, config_.num_kv_heads, config_.head_dim},
                         at::TensorOptions().dtype(act_));
  };
  for (std::size_t l = 0; l < static_cast<std::size_t>(L_); ++l) {
    if (!previous_[0].host_kv[l].k) continue;
    for (Group& grp : groups_) {
      const auto bytes = static_cast<std::size_t>(positions_ * grp.rows * kv_row_elems_) * e_;
      HostKv& kv = grp.host_kv[l];
      kv.k = transfers_.take_staging(bytes);
      kv.v = transfers_.take_staging(bytes);
      for (bool keys : {true, false}) {
        std::vector<at::Tensor> parts;
        for (Group& o : previous_) {
          const std::int64_t a = std::max(o.row, grp.row),
                             b = std::min(o.row + o.rows, grp.row + grp.rows);
          HostKv& okv = o.host_kv[l];
          if (a < b)
            parts.push_back(as_tensor(keys ? okv.k : okv.v, o.rows)
                                .narrow(0, 0, filled)
                                .narrow(1, a - o.row, b - a));
        }
        at::Tensor into = as_tensor(keys ? kv.k : kv.v, grp.rows).narrow(0, 0, filled);
        at::cat_out(into, parts, 1);
      }
    }
    for (Group& o : previous_) {
      transfers_.recycle(std::move(o.host_kv[l].k));
      transfers_.recycle(std::move(o.host_kv[l].v));
    }
  }
}

void TokenLoop::load(std::size_t j) {
  Stage& st = stages_[j];
  if (st.weights) return;
  auto& on = held_[static_cast<std::size_t>(st.where.device)];
  if (streaming_ && on.size() >= 2) {
    // Free the oldest stage that has run (waiting for its last group), if any has.
    for (auto it = on.begin(); it != on.end(); ++it)
      if (!pending_[*it]) {
        if (done_[*it]) done_[*it]->synchronize();
        stages_[*it].weights.reset();
        on.erase(it);
        break;
      }
  }
  st.weights = with_room(*parts_.devs[static_cast<std::size_t>(st.where.device)],
                         [&] { return transfers_.load_weights(st.where.device, st.where.layers); });
  on.push_back(j);
  pending_[j] = true;
}

void TokenLoop::enqueue(DeviceContext& dc, std::size_t j, std::size_t g, std::optional<int> layer,
                        std::function<void()> body) {
  EngineProbe* probe = layer ? parts_.options.probe : nullptr;
  const std::int64_t tokens = groups_[g].rows * count_;
  dc.compute->enqueue([this, &dc, j, g, layer, tokens, probe, body = std::move(body)] {
    if (failing_) return;  // a group before this one failed: the token is lost anyway
    const auto t0 = std::chrono::steady_clock::now();
    try {
      TorchStreamScope scope(*dc.compute);
      c10::InferenceMode inference;
      body();
      if (probe)
        probe->computed(
            dc.index, {*layer, *layer + 1}, /*forward_only=*/true, tokens,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    } catch (...) {
      errors_[j][g] = std::current_exception();
      failing_ = true;
    }
  });
}

void TokenLoop::run(at::Tensor next) {
  for (std::int64_t produced = 0; produced < options_.max_new_tokens; ++produced)
    if (!token(next)) break;
}

// Per group: its tokens and attention context (the same for every stage), packed on the host; up
// once per device that runs a stage for it (inputs()).
void TokenLoop::pack_inputs(const at::Tensor& next) {
  layouts_.clear();
  for (Group& grp : groups_) {
    const models::AttentionContext ctx =
        models::make_decode_context(config_, offset_, count_, act_, at::kCPU, grp.pad);
    const std::vector<at::Tensor> tensors = {next.narrow(0, grp.row, grp.rows).contiguous(),
                                             ctx.positions,
                                             ctx.cos,
                                             ctx.sin,
                                             ctx.mask,
                                             ctx.window_mask};
    layouts_.push_back(pack_layout(tensors));
    packs_.push_back(transfers_.take_staging(layouts_.back().bytes));
    pack_into(packs_.back().data(), layouts_.back(), tensors);
  }
}

const std::vector<at::Tensor>& TokenLoop::inputs(DeviceContext& dc, std::size_t g) {
  auto [it, fresh] = inputs_on_.try_emplace({dc.index, g});
  if (fresh) {
    offload::Uploaded up = with_room(dc, [&] {
      return transfers_.upload_for(dc.index, *dc.compute, packs_[g].data(), layouts_[g].bytes,
                                   offload::Cargo::kInputs);
    });
    dc.compute->wait(*up.ready);
    it->second = packed_views(up.buffer.data(), layouts_[g], dc.torch);
    token_buffers_.push_back(std::move(up.buffer));
  }
  return it->second;
}

bool TokenLoop::token(at::Tensor& next) {
  count_ = next.size(1);
  regroup(groups_for(B_ * count_));
  if (kv_host_) regather_host(offset_);
  errors_.assign(stages_.size(), std::vector<std::exception_ptr>(groups_.size()));
  pack_inputs(next);
  for (std::size_t j = 0; j < stages_.size(); ++j)
    run_stage(j);
  end_token();
  // The next token of every prompt, chosen as models::generate chooses it.
  std::vector<at::Tensor> parts;
  for (Group& grp : groups_)
    parts.push_back(at::from_blob(grp.logits.data(), {grp.rows, config_.vocab_size},
                                  at::TensorOptions().dtype(at::kFloat)));
  const at::Tensor logits = parts.size() == 1 ? parts[0] : at::cat(parts);
  at::Tensor chosen = at::zeros({B_, 1}, at::kLong);
  for (std::size_t b = 0; b < static_cast<std::size_t>(B_); ++b) {
    if (finished_[b]) continue;
    const std::int64_t t =
        models::sample_token(logits[static_cast<std::int64_t>(b)], options_, rng_[b]);
    out_.tokens[b].push_back(t);
    if (settings_.on_token) settings_.on_token(b, t);
    chosen[static_cast<std::int64_t>(b)][0] = t;
    finished_[b] = std::find(stops_.begin(), stops_.end(), t) != stops_.end();
  }
  for (Group& grp : groups_)
    transfers_.recycle(std::move(grp.logits));
  if (std::all_of(finished_.begin(), finished_.end(), [](bool f) { return f; })) return false;
  offset_ += count_;
  next = chosen;
  return true;
}

void TokenLoop::run_stage(std::size_t j) {
  Stage& st = stages_[j];
  const LayerRange range = st.where.range;
  const int head = static_cast<int>(L_) - 1;
  DeviceContext& dc = *parts_.devs[static_cast<std::size_t>(st.where.device)];
  load(j);
  dc.compute->wait(*st.weights->ready());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& grp = groups_[g];
    // Device memory the group's stage uses, released in compute order once its work is enqueued
    // (so that it goes as soon as the device is past it, not at the token's end).
    std::vector<kernels::DeviceBuffer> held;
    const std::vector<at::Tensor>& in = inputs(dc, g);
    models::AttentionContext ctx;
    ctx.positions = in[1];
    ctx.cos = in[2];
    ctx.sin = in[3];
    ctx.mask = in[4];
    ctx.window_mask = in[5];
    const std::vector<std::int64_t> act_sizes = {grp.rows, count_, config_.hidden_size};
    const std::size_t act_bytes = dense_bytes(act_sizes, act_);
    // The hidden state from the previous stage's device, when another: up from host staging.
    if (range.begin > 0 && grp.h_on != dc.index) {
      const offload::Staged& staged = grp.crossings.back();
      offload::Uploaded up = with_room(dc, [&] {
        return transfers_.upload_for(dc.index, *dc.compute, staged.host.data(), act_bytes,
                                     offload::Cargo::kActivations, staged.done.get());
      });
      dc.compute->wait(*up.ready);
      const at::Tensor h = tensor_view(up.buffer.data(), act_sizes, act_, dc.torch);
      held.push_back(std::move(up.buffer));
      enqueue(dc, j, g, std::nullopt, [&grp, h] { grp.h = h; });
    }
    for (int l = range.begin; l < range.end; ++l) {
      const std::vector<at::Tensor> w = parts_.layer_weights(*st.weights, l, dc.torch);
      if (l == 0) {
        const at::Tensor tokens = in[0];
        enqueue(dc, j, g, l, [&grp, w, tokens] { grp.h = models::embed(w[0], tokens); });
      } else if (l == head) {
        // The last position's logits (fp32), down into host staging.
        const std::size_t bytes = static_cast<std::size_t>(grp.rows * config_.vocab_size) * 4;
        kernels::DeviceBuffer buf =
            with_room(dc, [&] { return dc.dev->allocate(bytes, dc.compute); });
        const at::Tensor logits =
            tensor_view(buf.data(), {grp.rows, config_.vocab_size}, at::kFloat, dc.torch);
        const std::int64_t count = count_;
        enqueue(dc, j, g, l, [this, &grp, w, logits, count] {
          logits.copy_(
              models::head_logits(config_, w[0], w[1], grp.h.narrow(1, count - 1, 1)).squeeze(1));
        });
        auto ev = dc.dev->create_event();
        dc.compute->record(*ev);
        grp.logits = transfers_.take_staging(bytes);
        token_events_.push_back(
            transfers_.download_value(dc.index, grp.logits.data(), buf.data(), bytes, *ev));
        dc.compute->wait(*token_events_.back());
        held.push_back(std::move(buf));
      } else {
        const models::BlockWeights bw =
            models::BlockWeights::bind(parts_.specs[static_cast<std::size_t>(l)], w);
        kv_host_ ? run_block_host_kv(dc, j, g, l, bw, ctx) : run_block(dc, j, g, l, bw, ctx);
      }
    }
    // The hidden state for the next stage: kept on this device, or down to host staging.
    if (range.end < L_) {
      if (stages_[(j + 1) % stages_.size()].where.device == dc.index) {
        grp.h_on = dc.index;
      } else {
        kernels::DeviceBuffer buf =
            with_room(dc, [&] { return dc.dev->allocate(act_bytes, dc.compute); });
        const at::Tensor h = tensor_view(buf.data(), act_sizes, act_, dc.torch);
        enqueue(dc, j, g, std::nullopt, [&grp, h] { h.copy_(grp.h); });
        auto ev = dc.dev->create_event();
        dc.compute->record(*ev);
        grp.crossings.push_back(transfers_.download(dc.index, buf.data(), act_bytes, *ev));
        grp.h_on = -1;
        dc.compute->wait(*grp.crossings.back().done);
        held.push_back(std::move(buf));
      }
    }
  }
  done_[j] = dc.dev->create_event();
  dc.compute->record(*done_[j]);
  pending_[j] = false;
  // Streamed: the next stages' uploads (the next token's first, after the last) overlap the
  // compute, one stage ahead on each other device (so every device's link works, and no device
  // holds more than its running stage and one more).
  const std::size_t S = stages_.size();
  if (!out_.resident && S > 1)
    for (std::size_t k = 1; k < std::max<std::size_t>(2, parts_.devices()) && k < S; ++k)
      load((j + k) % S);
}

// A block with its KV cache on the device (gathered from the previous groups' at its first run
// after a regroup).
void TokenLoop::run_block(DeviceContext& dc, std::size_t j, std::size_t g, int l,
                          const models::BlockWeights& bw, const models::AttentionContext& ctx) {
  Group& grp = groups_[g];
  const auto li = static_cast<std::size_t>(l);
  const bool gather = !grp.caches[li].k.defined() && !previous_.empty();
  const bool last_reader = groups_.size() == 1;
  enqueue(dc, j, g, l, [this, &grp, li, l, bw, ctx, gather, last_reader] {
    models::KvCache& kept = grp.caches[li];
    if (gather) {
      kept.k = at::cat(gathered(grp, l, true), 0);
      kept.v = at::cat(gathered(grp, l, false), 0);
      // (Of one group, the previous caches of the layer go once gathered: this layer's stage
      // alone reads them, on this stream.)
      if (last_reader)
        for (Group& o : previous_)
          o.caches[li] = {};
    }
    grp.h = models::block_forward(config_, bw, grp.h, ctx, &kept);
  });
}

// A block with its KV cache in host memory: the positions so far go up before it runs, the new
// ones come down after, and the compute stream moves on once they are down, so that their buffers
// go at once; at most two layers' caches are on a device at a time (kv_in_flight_).
void TokenLoop::run_block_host_kv(DeviceContext& dc, std::size_t j, std::size_t g, int l,
                                  const models::BlockWeights& bw,
                                  const models::AttentionContext& ctx) {
  auto& in_flight = kv_in_flight_[static_cast<std::size_t>(dc.index)];
  while (in_flight.size() >= 2) {
    in_flight.front()->synchronize();
    in_flight.pop_front();
  }
  enqueue_block_host_kv(dc, j, g, l, bw, ctx);  // its buffers' releases queued behind it
  in_flight.push_back(dc.dev->create_event());
  dc.compute->record(*in_flight.back());
}

void TokenLoop::enqueue_block_host_kv(DeviceContext& dc, std::size_t j, std::size_t g, int l,
                                      const models::BlockWeights& bw,
                                      const models::AttentionContext& ctx) {
  Group& grp = groups_[g];
  HostKv& kv = grp.host_kv[static_cast<std::size_t>(l)];
  const auto position_bytes = static_cast<std::size_t>(grp.rows * kv_row_elems_) * e_;
  if (!kv.k) {
    kv.k = transfers_.take_staging(static_cast<std::size_t>(positions_) * position_bytes);
    kv.v = transfers_.take_staging(static_cast<std::size_t>(positions_) * position_bytes);
  }
  const std::int64_t had = offset_, count = count_;
  at::Tensor past_k, past_v;
  std::vector<kernels::DeviceBuffer> past;  // released in compute order once the block has run
  if (had > 0) {
    const std::vector<std::int64_t> sizes = {had, grp.rows, config_.num_kv_heads, config_.head_dim};
    for (bool keys : {true, false}) {
      offload::Uploaded up = with_room(dc, [&] {
        return transfers_.upload_for(dc.index, *dc.compute, (keys ? kv.k : kv.v).data(),
                                     static_cast<std::size_t>(had) * position_bytes,
                                     offload::Cargo::kKvCache);
      });
      dc.compute->wait(*up.ready);
      (keys ? past_k : past_v) = tensor_view(up.buffer.data(), sizes, act_, dc.torch);
      past.push_back(std::move(up.buffer));
    }
  }
  const std::vector<std::int64_t> new_sizes = {count, grp.rows, config_.num_kv_heads,
                                               config_.head_dim};
  const std::size_t new_bytes = static_cast<std::size_t>(count) * position_bytes;
  kernels::DeviceBuffer new_k =
      with_room(dc, [&] { return dc.dev->allocate(new_bytes, dc.compute); });
  kernels::DeviceBuffer new_v =
      with_room(dc, [&] { return dc.dev->allocate(new_bytes, dc.compute); });
  const at::Tensor added_k = tensor_view(new_k.data(), new_sizes, act_, dc.torch),
                   added_v = tensor_view(new_v.data(), new_sizes, act_, dc.torch);
  enqueue(dc, j, g, l, [this, &grp, bw, ctx, past_k, past_v, added_k, added_v, had, count] {
    models::KvCache cache;
    if (past_k.defined()) {  // (rows, KV, positions, D), as the block reads them
      cache.k = past_k.permute({1, 2, 0, 3}).contiguous();
      cache.v = past_v.permute({1, 2, 0, 3}).contiguous();
    }
    grp.h = models::block_forward(config_, bw, grp.h, ctx, &cache);
    added_k.copy_(cache.k.narrow(2, had, count).permute({2, 0, 1, 3}));
    added_v.copy_(cache.v.narrow(2, had, count).permute({2, 0, 1, 3}));
  });
  auto ev = dc.dev->create_event();
  dc.compute->record(*ev);
  const std::size_t at_byte = static_cast<std::size_t>(had) * position_bytes;
  for (bool keys : {true, false}) {
    auto down = transfers_.download_value(
        dc.index, static_cast<std::uint8_t*>((keys ? kv.k : kv.v).data()) + at_byte,
        (keys ? new_k : new_v).data(), new_bytes, *ev, offload::Cargo::kKvCache);
    dc.compute->wait(*down);
  }
}

// The token's work done on every device, its copies landed; its failure rethrown; what it held
// for its copies given back.
void TokenLoop::end_token() {
  for (auto& dc : parts_.devs)
    dc->compute->synchronize();
  for (auto& ev : token_events_)
    ev->synchronize();
  for (Group& grp : groups_)
    for (offload::Staged& s : grp.crossings)
      if (s.done) s.done->synchronize();
  rethrow_first();
  token_buffers_.clear();
  token_events_.clear();
  inputs_on_.clear();
  for (offload::HostBuffer& hb : packs_)
    transfers_.recycle(std::move(hb));
  packs_.clear();
  for (Group& grp : groups_) {
    for (offload::Staged& s : grp.crossings)
      transfers_.recycle(std::move(s.host));
    grp.crossings.clear();
  }
}

void TokenLoop::rethrow_first() const {
  for (std::size_t j = 0; j < stages_.size(); ++j)
    for (const std::exception_ptr& error : errors_[j]) {
      if (!error) continue;
      const GenerationStage& st = stages_[j].where;
      const std::string where = "generating, layers " + std::to_string(st.range.begin) + "-" +
                                std::to_string(st.range.end - 1) + " on " +
                                parts_.devs[static_cast<std::size_t>(st.device)]->dev->info().name +
                                ": ";
      try {
        std::rethrow_exception(error);
      } catch (const Error& err) {
        throw Error(where + err.what());
      } catch (const std::exception& err) {
        const std::string what = err.what();
        throw Error(where + what.substr(0, what.find('\n')));
      }
    }
}

}  // namespace

Generation Generator::run(const std::vector<std::vector<std::int64_t>>& prompts,
                          const models::SamplingOptions& options,
                          const GenerateSettings& settings) {
  const models::ModelConfig& config = parts_.config;
  const std::size_t e = c10::elementSize(parts_.act_dtype);
  Generation out;
  out.tokens.assign(prompts.size(), {});
  if (prompts.empty() || options.max_new_tokens <= 0) return out;
  const auto B = static_cast<std::int64_t>(prompts.size());
  std::int64_t P = 0;
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    if (prompts[b].empty())
      throw Error("generate: prompt " + std::to_string(b + 1) + " of " + std::to_string(B) +
                  " is empty");
    for (std::int64_t t : prompts[b])
      if (t < 0 || t >= config.vocab_size)
        throw Error("generate: prompt " + std::to_string(b + 1) + ": token id " +
                    std::to_string(t) + " is outside the vocabulary (" +
                    std::to_string(config.vocab_size) + ")");
    P = std::max<std::int64_t>(P, static_cast<std::int64_t>(prompts[b].size()));
  }
  // Left-padded rows: every prompt ends at position P - 1.
  at::Tensor next = at::zeros({B, P}, at::kLong);
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& p = prompts[static_cast<std::size_t>(b)];
    next[b]
        .narrow(0, P - static_cast<std::int64_t>(p.size()), static_cast<std::int64_t>(p.size()))
        .copy_(at::tensor(p, at::kLong));
  }

  // Where the weights and caches live.
  const int L = static_cast<int>(parts_.specs.size());
  const std::size_t N = parts_.devices();
  const std::int64_t positions = P + options.max_new_tokens;
  ResidencyQuery query{
      .residency = settings.residency,
      .kv_caches = settings.kv_caches,
      .forward = plan_.forward,
      .tail = plan_.tail,
      .extra =
          [&](std::int64_t blocks) { return generation_bytes(config, e, B, P, positions, blocks); },
      .blocks = config.num_layers};
  for (int l = 0; l < L; ++l)
    query.layer_bytes.push_back(static_cast<std::uint64_t>(parts_.specs[l].param_count()) * e);
  for (const LayerRange& r : plan_.forward)
    query.stage_layers.push_back(streamed_layers(parts_.store, r));
  query.stage_layers.push_back(streamed_layers(parts_.store, plan_.tail));
  // A simulated device's (and the CPU device's) memory is host memory, whose cap may be all of
  // it: then at most half of what the OS has free (shared among the simulated devices).
  for (std::size_t d = 0; d < N; ++d) {
    const kernels::MemoryStats m = parts_.devs[d]->dev->memory();
    const std::uint64_t free = m.bytes_cap > m.bytes_in_use ? m.bytes_cap - m.bytes_in_use : 0;
    const bool sim = parts_.devs[d]->dev->info().kind == kernels::DeviceKind::kSim;
    if (d == 0) query.first_device_room = sim ? std::min(free, host_memory_available() / 2) : free;
    query.room.push_back(sim ? std::min(free, host_memory_available() / 2 / N) : free);
  }
  ResidencyChoice choice = choose_residency(query);
  out.resident = choice.resident;
  out.spread = choice.spread;
  out.kv_host = choice.kv_host;
  const offload::TransferStats before = parts_.transfers->stats();
  {
    TokenLoop loop(parts_, prompts, options, settings, std::move(choice), P, out);
    loop.run(next);
  }
  const offload::TransferStats after = parts_.transfers->stats();
  out.kv_bytes_up = after.kv_up - before.kv_up;
  out.kv_bytes_down = after.kv_down - before.kv_down;
  return out;
}

}  // namespace rondo::engine
