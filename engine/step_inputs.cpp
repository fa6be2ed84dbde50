// A step's inputs checked, prepared and packed on the host (step_inputs.h). Runs on the main
// thread a step or two ahead of the devices; touches no device and no shared state.
#include "engine/step_inputs.h"

#include <ATen/ATen.h>

#include <algorithm>

#include <cstring>
#include <utility>

#include "kernels/error.h"
#include "models/layers.h"

namespace rondo::engine {

PackedLayout pack_layout(const std::vector<at::Tensor>& tensors) {
  PackedLayout layout;
  layout.tensors.resize(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) continue;
    layout.bytes = (layout.bytes + 255) / 256 * 256;
    layout.tensors[i] = {.defined = true,
                         .offset = layout.bytes,
                         .sizes = tensors[i].sizes().vec(),
                         .dtype = tensors[i].scalar_type()};
    layout.bytes += tensors[i].nbytes();
  }
  return layout;
}

void pack_into(void* dst, const PackedLayout& layout, const std::vector<at::Tensor>& tensors) {
  RONDO_ASSERT(tensors.size() == layout.tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!layout.tensors[i].defined) continue;
    const at::Tensor t = tensors[i].contiguous();
    RONDO_ASSERT(t.sizes().vec() == layout.tensors[i].sizes && t.device().is_cpu());
    std::memcpy(static_cast<std::uint8_t*>(dst) + layout.tensors[i].offset, t.data_ptr(),
                t.nbytes());
  }
}

std::vector<at::Tensor> packed_views(void* base, const PackedLayout& layout, c10::Device device) {
  std::vector<at::Tensor> out;
  out.reserve(layout.tensors.size());
  for (const PackedTensor& p : layout.tensors)
    out.push_back(p.defined ? at::from_blob(static_cast<std::uint8_t*>(base) + p.offset, p.sizes,
                                            at::TensorOptions().dtype(p.dtype).device(device))
                            : at::Tensor());
  return out;
}

StepInputs prepare_step_inputs(const models::ModelConfig& config, at::ScalarType act_dtype,
                               const std::string& where, std::vector<Microbatch> microbatches) {
  StepInputs in;
  for (std::size_t m = 0; m < microbatches.size(); ++m) {
    const std::string w = where + ", microbatch " + std::to_string(m);
    Microbatch& b = microbatches[m];
    if (!b.batch.tokens.defined() || b.batch.tokens.dim() != 2 || b.batch.tokens.numel() == 0)
      throw Error(w + ": tokens must be a non-empty (B, T) tensor");
    if (!b.targets.defined() || b.targets.sizes() != b.batch.tokens.sizes())
      throw Error(w + ": targets must have the tokens' shape");
    b.batch.tokens = b.batch.tokens.to(at::kCPU, at::kLong).contiguous();
    b.targets = b.targets.to(at::kCPU, at::kLong).contiguous();
    if (b.batch.doc_ids.defined()) b.batch.doc_ids = b.batch.doc_ids.to(at::kCPU, at::kLong);
    const std::int64_t lo = b.batch.tokens.min().item<std::int64_t>(),
                       hi = b.batch.tokens.max().item<std::int64_t>();
    if (lo < 0 || hi >= config.vocab_size)
      throw Error(w + ": token id " + std::to_string(lo < 0 ? lo : hi) +
                  " is outside the vocabulary (0.." + std::to_string(config.vocab_size - 1) + ")");
    Microbatch::Pairs& p = b.pairs;
    if (p.seq.defined()) {
      if (p.seq.sizes() != b.targets.sizes() || !p.reference.defined() || p.reference.dim() != 1 ||
          p.reference.size(0) % 2 != 0 || (p.nll.defined() && p.nll.sizes() != b.targets.sizes()))
        throw Error(w + ": its pairs' tensors do not match its tokens");
      p.seq = p.seq.to(at::kCPU, at::kLong).contiguous();
      p.reference = p.reference.to(at::kCPU, at::kFloat).contiguous();
      if (p.nll.defined()) p.nll = p.nll.to(at::kCPU, at::kFloat).contiguous();
      in.most_sequences = std::max(in.most_sequences, static_cast<int>(p.reference.size(0)));
    }
    const models::AttentionContext ctx =
        models::attention_context_without_masks(config, b.batch, act_dtype);
    const at::Tensor docs = models::packed_doc_ids(b.batch);
    models::DocSpans& spans = in.spans.emplace_back(models::doc_spans(docs));
    for (const at::Tensor& t : {ctx.positions, ctx.cos, ctx.sin, docs,
                                docs.defined() ? spans.offsets_tensor() : at::Tensor(),
                                b.batch.tokens, b.targets, p.seq, p.nll, p.reference})
      in.tensors.push_back(t.defined() ? t.contiguous() : t);
    in.tokens += b.batch.tokens.numel();
    in.targets += b.targets.ne(-100).sum().item<std::int64_t>();
  }
  in.mb = std::move(microbatches);
  in.layout = pack_layout(in.tensors);
  return in;
}

std::vector<MicrobatchInputs> microbatch_views(void* base, const PackedLayout& layout,
                                               c10::Device device) {
  const std::vector<at::Tensor> views = packed_views(base, layout, device);
  RONDO_ASSERT(views.size() % kInputParts == 0);
  std::vector<MicrobatchInputs> out;
  for (std::size_t at = 0; at < views.size(); at += kInputParts) {
    MicrobatchInputs& mbi = out.emplace_back();
    mbi.ctx.positions = views[at + kPositions];
    mbi.ctx.cos = views[at + kCos];
    mbi.ctx.sin = views[at + kSin];
    mbi.docs = views[at + kDocs];
    mbi.doc_offsets = views[at + kDocOffsets];
    mbi.tokens = views[at + kTokens];
    mbi.targets = views[at + kTargets];
    mbi.pair_seq = views[at + kPairSeq];
    mbi.pair_nll = views[at + kPairNll];
    mbi.pair_reference = views[at + kPairReference];
  }
  return out;
}

}  // namespace rondo::engine
