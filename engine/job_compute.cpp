// One microbatch of one job as torch math, and a job's gradient accumulators (job_compute.h).
#include "engine/job_compute.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "engine/model_store.h"
#include "engine/preference.h"
#include "models/attention_masks.h"

namespace rondo::engine {

namespace {

// Whether every trained tensor of layer l gets its gradient written (not added) by a job's first
// microbatch, so that its accumulators need no zeroing first: blocks (BlockRun::overwrite) and a
// head of a norm and an LM head; not the embedding, whose rows are added (index_add_).
bool overwrites_grads(const std::vector<models::LayerSpec>& specs, int l) {
  const models::LayerSpec& spec = specs[static_cast<std::size_t>(l)];
  return spec.kind == models::LayerKind::kBlock ||
         (spec.kind == models::LayerKind::kHead && spec.params.size() <= 2);
}

}  // namespace

std::vector<int> JobGradients::layer_ids() const {
  std::vector<int> ids;
  for (const auto& [l, data] : layers)
    ids.push_back(l);
  return ids;
}

JobGradients job_gradients(const EngineParts& parts, DeviceContext& dc, LayerRange range,
                           std::vector<kernels::DeviceBuffer>& buffers) {
  const offload::LayerStore& store = parts.store;
  JobGradients g;
  g.convert = store.grad_dtype() != kernels::FloatDType::kF32;
  const std::size_t gs = kernels::dtype_size(store.grad_dtype());
  for (int l = range.begin; l < range.end; ++l) {
    const offload::ByteRange gr = store.grad_bytes(static_cast<std::size_t>(l));
    if (gr.bytes == 0) continue;
    // In place (EngineOptions::share_trained_state): the store's gradients are free to be written,
    // since this job's weights waited for the optimizer's pass over these layers (Note [Engine
    // synchronisation], 3, in board.cpp), and are written before it reads them (done_down).
    std::uint8_t* gdata = gr.data;
    if (gr.data == nullptr) {  // on NVMe: a buffer the gradient writer reads after the job
      auto b = std::make_shared<kernels::DeviceBuffer>(dc.dev->allocate(gr.bytes, dc.compute));
      gdata = static_cast<std::uint8_t*>(b->data());
      g.keep[l] = std::move(b);
    } else if (!parts.shares_trained()) {
      buffers.push_back(dc.dev->allocate(gr.bytes, dc.compute));
      gdata = static_cast<std::uint8_t*>(buffers.back().data());
    }
    std::uint8_t* accp = gdata;
    if (g.convert) {
      buffers.push_back(dc.dev->allocate(gr.bytes / gs * 4, dc.compute));
      accp = static_cast<std::uint8_t*>(buffers.back().data());
    }
    // Blocks and the head write each gradient on the first microbatch and add on the next
    // (BlockRun::overwrite, head_grad); the embedding's rows are added into zeros.
    if (!overwrites_grads(parts.specs, l))
      dc.compute->fill(accp, 0, g.convert ? gr.bytes / gs * 4 : gr.bytes);
    const std::vector<offload::TensorState>& ts = store.layer(static_cast<std::size_t>(l));
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const offload::TensorState& t = ts[i];
      if (!t.trainable) {
        g.acc[l].emplace_back();
        g.out[l].emplace_back();
        continue;
      }
      const std::size_t off = t.grad_offset;
      const auto& shape = parts.specs[static_cast<std::size_t>(l)].params[i].shape;
      g.acc[l].push_back(
          tensor_view(accp + off / gs * (g.convert ? 4 : gs), shape, at::kFloat, dc.torch));
      g.out[l].push_back(
          tensor_view(gdata + off, shape, scalar_type(store.grad_dtype()), dc.torch));
    }
    g.layers.push_back({l, gdata});
  }
  return g;
}

void round_gradients(JobGradients& grads) {
  if (!grads.convert) return;
  for (auto& [l, views] : grads.out)
    for (std::size_t i = 0; i < views.size(); ++i)
      if (views[i].defined()) views[i].copy_(grads.acc.at(l)[i]);
}

void compute_microbatch(const EngineParts& parts, c10::Device dev, const MicrobatchWork& work) {
  const models::ModelConfig& config = parts.config;
  const std::vector<models::LayerSpec>& specs = parts.specs;
  const JobSpec& js = *work.job;
  const StepData& step = *work.step;
  const MicrobatchInputs& mbi = *work.inputs;
  const std::map<int, std::vector<at::Tensor>>& w = *work.weights;
  const int m = work.m;
  models::AttentionContext ctx = mbi.ctx;
  // How this microbatch's attention is limited, set here from its documents
  // (models/attention_masks.h): per document, or masks of the running microbatch only.
  models::limit_attention(ctx, config, mbi.docs, step.in.spans[static_cast<std::size_t>(m)], dev,
                          parts.act_dtype, mbi.doc_offsets);
  if (!ctx.doc_offsets.empty())
    ++step.per_document_passes;
  else if (ctx.mask.defined() || ctx.window_mask.defined())
    ++step.masked_passes;
  // Training: attention and LoRA dropout (when the model has them) draw from this seed;
  // evaluation has none.
  if (!work.evaluating)
    ctx.dropout_seed = dropout_seed(parts.options.seed, step.step_no, step.first_microbatch + m);
  ctx.mlp_tile_tokens = js.mlp_tile_tokens;
  // MoE: the first forward of a block records its routing, the backward's recompute replays it;
  // the router load-balancing loss (when the model asks for it) counts each microbatch with
  // weight 1 / M (M over every rank).
  if (!step.routing.empty()) {
    ctx.routing = step.routing[static_cast<std::size_t>(m)];
    ctx.record_routing = js.kind != JobKind::kBackward;
    // loss_scale is the fp16 scale over the step's targets; the aux loss has the fp16 scale alone.
    if (config.output_router_logits && js.kind != JobKind::kForward)
      ctx.aux_loss_weight = work.loss_scale * step.loss_denominator * config.router_aux_loss_coef /
                            step.all_microbatches;
  }
  const at::Tensor& tokens = mbi.tokens;
  const int head = static_cast<int>(specs.size()) - 1;
  auto grads_of = [&](int l) -> std::vector<at::Tensor>* {
    if (!work.grads) return nullptr;
    auto it = work.grads->find(l);
    return it == work.grads->end() ? nullptr : const_cast<std::vector<at::Tensor>*>(&it->second);
  };
  auto block_runs = [&](int begin, int end) {
    std::vector<models::BlockRun> runs;
    for (int l = std::max(begin, 1); l < std::min(end, head); ++l)
      runs.push_back(
          {.spec = &specs[l], .weights = w.at(l), .grads = grads_of(l), .overwrite = m == 0});
    return runs;
  };
  // The head's gradients: written by the first microbatch, added by the next.
  auto head_grad = [m](at::Tensor& into, const at::Tensor& g) {
    m == 0 ? into.copy_(g) : into.add_(g);
  };
  auto embed_grad = [&](const at::Tensor& grad_x) {
    std::vector<at::Tensor>* g = grads_of(0);
    if (g && (*g)[0].defined()) models::embed_backward(tokens, grad_x, (*g)[0]);
  };
  auto add_loss = [&](const at::Tensor& loss) {
    at::from_blob(work.loss_dev, {}, at::TensorOptions().dtype(at::kFloat).device(dev)).add_(loss);
  };
  // A preference microbatch (Microbatch::pairs): the loss and metrics added, its sequences'
  // log-probabilities written where an evaluation asks for them.
  const bool pairs = mbi.pair_seq.defined();
  auto preference = [&](const at::Tensor& ce, bool with_grad) {
    PreferenceTerms t = preference_terms(parts.options.preference, ce, mbi.pair_seq, mbi.pair_nll,
                                         mbi.pair_reference, with_grad);
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
    at::Tensor values =
        at::from_blob(work.loss_dev, {static_cast<std::int64_t>(StepData::kStepValues)}, f32);
    values[0].add_(t.loss);
    values.narrow(0, 1, kPreferenceMetrics).add_(t.metrics);
    if (step.sequence_slots > 0)
      at::from_blob(work.loss_dev + StepData::kStepValues +
                        static_cast<std::size_t>(m) * static_cast<std::size_t>(step.sequence_slots),
                    {t.sequence_logps.size(0)}, f32)
          .copy_(t.sequence_logps);
    return t.token_coef;
  };
  auto head_chunk = [&](const at::Tensor& lm_head) {
    return head_chunk_tokens(parts.options.head_chunk_tokens, lm_head.size(0), dev.is_cpu());
  };
  const LayerRange range = js.range;
  // Without autograd: the job's input (embedded tokens for the first), through its blocks before
  // `end`, each checkpointed input saved on the way.
  auto forward = [&](int end) {
    c10::AutoGradMode no_grad(false);
    at::Tensor x = range.begin == 0 ? models::embed(w.at(0)[0], tokens) : work.in;
    for (int l = std::max(range.begin, 1); l < end; ++l) {
      auto it = work.ckpt.find(l);
      if (it != work.ckpt.end()) it->second.copy_(x);
      x = models::block_forward(config, models::BlockWeights::bind(specs[l], w.at(l)), x, ctx);
    }
    return x;
  };
  // The gradient of the job's input: into the embedding's gradient, or on to the next job.
  auto hand_back = [&](const at::Tensor& grad_x) {
    c10::AutoGradMode no_grad(false);
    if (range.begin == 0)
      embed_grad(grad_x);
    else
      work.out.copy_(grad_x);
  };
  switch (js.kind) {
    case JobKind::kForward: {
      const at::Tensor x = forward(range.end);
      c10::AutoGradMode no_grad(false);
      work.out.copy_(x);
      break;
    }
    case JobKind::kTail: {
      at::Tensor x;
      {
        c10::AutoGradMode no_grad(false);
        x = range.begin == 0 ? models::embed(w.at(0)[0], tokens) : work.in;
      }
      const at::Tensor& targets = mbi.targets;
      const std::vector<at::Tensor>& hw = w.at(head);
      std::vector<at::Tensor>* hg = grads_of(head);
      const bool lm_trainable = hg && (*hg)[1].defined();
      const std::int64_t chunk_tokens = head_chunk(hw[1]);
      at::Tensor gx = models::blocks_forward_backward(
          config, block_runs(range.begin, range.end), x, ctx, [&](const at::Tensor& h) {
            // A preference objective: a forward of the head first, for the pairs' log-probabilities
            // that weigh each target in the backward.
            at::Tensor weights;
            if (pairs) {
              at::Tensor ce;
              {
                c10::AutoGradMode no_grad(false);
                ce = models::head_token_losses(config, hw[0], hw[1], h.detach(), targets,
                                               chunk_tokens);
              }
              weights = preference(ce, true);
            }
            models::HeadGrads r =
                models::head_forward_backward(config, hw[0], hw[1], h, targets, work.loss_scale,
                                              lm_trainable, chunk_tokens, weights);
            if (!pairs) add_loss(r.loss_sum);
            if (hg && (*hg)[0].defined()) head_grad((*hg)[0], r.grad_norm.to(at::kFloat));
            if (lm_trainable) head_grad((*hg)[1], r.grad_lm_head);
            return r.grad_x;
          });
      hand_back(gx);
      break;
    }
    case JobKind::kEval: {
      const at::Tensor x = forward(head);
      c10::AutoGradMode no_grad(false);
      const std::vector<at::Tensor>& hw = w.at(head);
      if (pairs)
        preference(
            models::head_token_losses(config, hw[0], hw[1], x, mbi.targets, head_chunk(hw[1])),
            false);
      else
        add_loss(models::head_loss_sum(config, hw[0], hw[1], x, mbi.targets, head_chunk(hw[1])));
      break;
    }
    case JobKind::kBackward: {
      std::vector<at::Tensor> inputs;
      for (auto& [l, t] : work.saved)
        inputs.push_back(t);  // ascending layers
      at::Tensor g = work.in;
      std::vector<models::BlockRun> runs = block_runs(range.begin, range.end);
      if (!runs.empty()) g = models::blocks_backward(config, runs, inputs, ctx, g);
      hand_back(g);
      break;
    }
  }
}

}  // namespace rondo::engine
