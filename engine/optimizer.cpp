#include "engine/optimizer.h"

#include <cmath>
#include <cstring>
#include <optional>

#include "kernels/cpu/adamw8bit.h"
#include "kernels/error.h"

namespace rondo::engine {

// Note [Exact clipping with per-layer updates]
// Global-norm clipping scales every gradient by min(1, max_norm / ||g||), where ||g|| covers all
// layers, so no layer can be updated before the last gradient of the step has landed. That costs
// less than it seems: the backward produces layer 0's gradient last, and the next forward needs
// layer 0 first — whatever the clipping, the next step waits for the end of this backward. So the
// driver computes the norm once everything is in (a sum-of-squares pass, read-only), then updates
// layers in forward order, and the next step's first stage starts as soon as its own layers are
// done while later layers are still being updated. The update is exactly torch's
// clip_grad_norm_ followed by AdamW: the coefficient is passed to the kernel as grad_scale.

Optimizer::Optimizer(offload::LayerStore& store, const kernels::AdamWParams& params,
                     double max_grad_norm)
    : store_(store), params_(params), max_norm_(max_grad_norm) {
  for (std::size_t l = 0; l < store_.layers(); ++l) {
    const auto& tensors = store_.layer(l);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].tied || !tensors[i].trainable) continue;
      RONDO_ASSERT_MSG(tensors[i].owner_layer >= 0,
                       "tied tensor " + tensors[i].name + " has no owner");
      ties_.push_back({static_cast<std::size_t>(tensors[i].owner_layer),
                       static_cast<std::size_t>(tensors[i].owner_index), l, i});
    }
  }
}

const void* Optimizer::gradient(std::size_t layer, std::size_t index,
                                kernels::FloatDType& dtype) const {
  dtype = store_.grad_dtype();
  const auto it = tied_sums_.find({layer, index});
  if (it == tied_sums_.end()) return store_.layer(layer)[index].grad;
  dtype = kernels::FloatDType::kF32;
  return it->second.data();
}

void Optimizer::sum_tied(std::size_t layer, std::size_t index) {
  // In f32: the owner's gradient and every tied copy's, from 0 (as 0 + x, which turns a -0 into
  // +0), in parallel (a tied embedding has tens of millions of elements: serial, this pass was a
  // tenth of a small model's CPU step).
  const offload::TensorState& t = store_.layer(layer)[index];
  std::vector<float>& sum = tied_sums_[{layer, index}];
  sum.resize(t.numel);
  kernels::grad_accumulate(sum.data(), t.grad, store_.grad_dtype(), t.numel, /*first=*/true);
  for (const Tie& tie : ties_)
    if (tie.owner_layer == layer && tie.owner_index == index)
      kernels::grad_accumulate(sum.data(), store_.layer(tie.layer)[tie.index].grad,
                               store_.grad_dtype(), t.numel, /*first=*/false);
}

bool Optimizer::has_ties(std::size_t layer, std::size_t index) const {
  for (const Tie& tie : ties_)
    if (tie.owner_layer == layer && tie.owner_index == index) return true;
  return false;
}

double Optimizer::partial_sum_squares(std::size_t layer) const {
  RONDO_ASSERT_MSG(store_.grad_tier(layer) == offload::Tier::kHost,
                   "partial_sum_squares of gradients on NVMe: the gradient writer sums them");
  double sum = 0;
  const auto& tensors = store_.layer(layer);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    // A tie is counted with its owner, and an owner with ties in begin_step.
    if (!tensors[i].trainable || tensors[i].tied || has_ties(layer, i)) continue;
    sum += kernels::grad_sum_squares(tensors[i].grad, store_.grad_dtype(), tensors[i].numel);
  }
  return sum;
}

double Optimizer::begin_step(const std::vector<double>* partial) {
  RONDO_ASSERT(!partial || partial->size() == store_.layers());
  ++step_;
  double sum = 0;
  for (std::size_t l = 0; l < store_.layers(); ++l) {
    sum += partial ? (*partial)[l] : partial_sum_squares(l);
    const auto& tensors = store_.layer(l);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].trainable || tensors[i].tied || !has_ties(l, i)) continue;
      sum_tied(l, i);
      kernels::FloatDType dtype;
      const void* g = gradient(l, i, dtype);
      sum += kernels::grad_sum_squares(g, dtype, tensors[i].numel);
    }
  }
  const double norm = std::sqrt(sum) * unscale_;
  // torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1.
  clip_ = max_norm_ > 0 ? std::min(1.0, max_norm_ / (norm + 1e-6)) : 1.0;
  return norm;
}

// Note [Streaming copies a chunk at a time]
// Every trained tensor's streaming copy is rewritten by an update (or a publish): nothing to read
// first. In host memory it is written in place. On the NVMe tier the optimizer writes it as it
// goes, chunk by chunk, into the part's pieces (offload::PieceWriter): each chunk's copies are
// rounded into staging of the chunk's size and put at their offsets, and a piece goes to the
// drive as soon as the optimizer has moved past it, so the update stages a chunk and a piece,
// never the layer's whole trained part (an untied LM head of a large vocabulary is hundreds of
// MB). Pieces a chunk leaves out (alignment padding between tensors) are written as zeros, as
// loading wrote them.
class Optimizer::StreamOut {
 public:
  StreamOut(offload::LayerStore& store, std::size_t layer) : store_(store), layer_(layer) {
    if (store.tier(layer, offload::kStreamPart) == offload::Tier::kNvme)
      writer_.emplace(store, layer, offload::kStreamPart);
    else
      host_ = store.access(layer, offload::kStreamPart, offload::AccessMode::kOverwrite);
  }
  // Where to round chunk piece `i` of `opt` to (valid until the next call).
  void* target(const offload::LayerAccess& opt, std::size_t i) {
    const offload::OptimizerPiece& piece = opt.piece(i);
    const std::size_t ss = kernels::dtype_size(store_.stream_dtype());
    if (!writer_) return static_cast<std::uint8_t*>(host_[piece.tensor].stream) + piece.begin * ss;
    const std::size_t bytes = opt[i].numel * ss;
    if (staging_.bytes() < bytes) {
      staging_.reset();
      staging_ = store_.piece_staging(bytes);
    }
    pending_ = {store_.layer(layer_)[piece.tensor].stream_offset + piece.begin * ss, bytes};
    return staging_.data();
  }
  // The bytes target() handed out are final.
  void done() {
    if (writer_ && pending_.second) writer_->put(pending_.first, staging_.data(), pending_.second);
    pending_ = {0, 0};
  }
  void finish() {
    if (writer_) writer_->finish();
  }

 private:
  offload::LayerStore& store_;
  std::size_t layer_;
  offload::LayerAccess host_;
  std::optional<offload::PieceWriter> writer_;
  offload::HostBuffer staging_;
  std::pair<std::size_t, std::size_t> pending_{0, 0};  // offset, bytes in staging_
};

void Optimizer::publish_layer(std::size_t layer) {
  // The masters are read a chunk at a time (Note [Optimizer chunks] in offload/layer_store.cpp),
  // the streaming copies written so (Note [Streaming copies a chunk at a time]).
  StreamOut out(store_, layer);
  for (std::size_t k = 0; k < store_.optimizer_chunks(layer); ++k) {
    if (k + 1 < store_.optimizer_chunks(layer)) store_.prefetch_chunk(layer, k + 1);
    const offload::LayerAccess opt = store_.access_chunk(layer, k, offload::AccessMode::kRead);
    for (std::size_t i = 0; i < opt.size(); ++i) {
      kernels::cast_from_f32(opt[i].master, out.target(opt, i), store_.stream_dtype(),
                             opt[i].numel);
      out.done();
    }
  }
  out.finish();
}

void Optimizer::update_layer(std::size_t layer, bool write_stream) {
  RONDO_ASSERT_MSG(step_ > 0, "update_layer() before begin_step()");
  kernels::AdamWParams p = params_;
  p.step = step_;
  p.grad_scale = clip_ * unscale_;
  // Masters and moments wherever they live, a chunk at a time (on NVMe: read, the next chunk —
  // or the next layer's first — read ahead, and written back); the streaming copies are all
  // rewritten, so not read first (Note [Streaming copies a chunk at a time]).
  std::optional<StreamOut> out;
  if (write_stream) out.emplace(store_, layer);
  const std::size_t chunks = store_.optimizer_chunks(layer);
  for (std::size_t k = 0; k < chunks; ++k) {
    if (k + 1 < chunks)
      store_.prefetch_chunk(layer, k + 1, /*grads=*/true);
    else if (layer + 1 < store_.layers() && store_.optimizer_chunks(layer + 1) > 0)
      store_.prefetch_chunk(layer + 1, 0, /*grads=*/true);
    const offload::LayerAccess opt =
        store_.access_chunk(layer, k, offload::AccessMode::kReadWrite, /*grads=*/true);
    for (std::size_t i = 0; i < opt.size(); ++i) {
      const offload::OptimizerPiece& piece = opt.piece(i);
      // The piece's gradient as the chunk access has it (in host memory or read from NVMe), or,
      // for an owner of tied copies, their sum.
      kernels::FloatDType dtype = store_.grad_dtype();
      const void* g = opt[i].grad;
      if (tied_sums_.count({layer, piece.tensor}))
        g = static_cast<const std::uint8_t*>(gradient(layer, piece.tensor, dtype)) +
            piece.begin * kernels::dtype_size(dtype);
      adamw_update(opt[i], g, dtype, out ? out->target(opt, i) : nullptr, store_.stream_dtype(), p);
      if (out) out->done();
    }
  }
  if (out) out->finish();
  // The layer's gradients (tied copies included) start the next step at zero. A tied copy in a
  // later layer is zeroed when that layer is updated, after its owner has read it.
  const offload::ByteRange grads = store_.grad_bytes(layer);
  if (zero_grads_ && grads.data) std::memset(grads.data, 0, grads.bytes);
}

void adamw_update(const offload::TensorState& t, const void* grad, kernels::FloatDType grad_dtype,
                  void* stream, kernels::FloatDType stream_dtype, const kernels::AdamWParams& p) {
  if (t.m_codes) {  // 8-bit moments (offload::MomentFormat::kBlockwise8)
    kernels::adamw8bit_step({.n = t.numel,
                             .grad = grad,
                             .grad_dtype = grad_dtype,
                             .master = t.master,
                             .m_codes = t.m_codes,
                             .m_absmax = t.m_absmax,
                             .v_codes = t.v_codes,
                             .v_absmax = t.v_absmax,
                             .stream = stream,
                             .stream_dtype = stream_dtype},
                            p);
    return;
  }
  kernels::adamw_step({.n = t.numel,
                       .grad = grad,
                       .grad_dtype = grad_dtype,
                       .master = t.master,
                       .m = t.m,
                       .v = t.v,
                       .stream = stream,
                       .stream_dtype = stream_dtype},
                      p);
}

void Optimizer::discard_step() {
  RONDO_ASSERT_MSG(step_ > 0, "discard_step() before begin_step()");
  --step_;
  for (std::size_t l = 0; l < store_.layers(); ++l) {
    const offload::ByteRange grads = store_.grad_bytes(l);
    if (grads.data) std::memset(grads.data, 0, grads.bytes);
  }
}

}  // namespace rondo::engine
