// How a training batch's attention is limited, built where attention runs (implemented in
// attention.cpp). make_attention_context (attention.h) builds the whole context on the batch's
// device; the engine instead sends a step's small inputs (positions, rotary tables, the document
// ids of packed rows and their offsets) over the link and sets the limits on each device, per job
// for the microbatch it runs: a packed row of 16k tokens would otherwise cross the link and sit in
// host staging as 256 MiB of mask.
//
// Packed rows attend per document where that is the faster kernel (attend_per_document): on CUDA
// through variable-length flash attention (no mask at all, grouped heads as they are, windows
// included), on the CPU one causal attention per document (measured: bench/attention_bench). The
// (B, 1, T, T) masks are the fallback.
//
//   at::Tensor docs = models::packed_doc_ids(batch);          // host, cheap
//   models::DocSpans spans = models::doc_spans(docs);           // host
//   ... upload docs (B, T) and spans.offsets (int32) ...
//   models::limit_attention(ctx, cfg, docs_on_device, spans, device, dtype, offsets_on_device);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "models/config.h"
#include "models/layers.h"

namespace rondo::models {

// make_attention_context without the limits: positions and rotary tables only. It checks the ids'
// shape, not that each document is contiguous: packed_doc_ids does (call it too, as the engine
// does, or make_attention_context).
AttentionContext attention_context_without_masks(const ModelConfig& config, const TokenBatch& batch,
                                                 at::ScalarType dtype);

// A batch's document ids (B, T) int64 on the host when some row holds more than one document (the
// mask then keeps each document to itself); undefined when every row is one document (plain
// causal attention, the fused kernels). Throws Error for ids of another shape or a document that
// is not contiguous within its row.
at::Tensor packed_doc_ids(const TokenBatch& batch);

// The documents of packed rows (ids from packed_doc_ids, on the host): document d is tokens
// [offsets[d], offsets[d + 1]) of the B * T flattened ones, each within one row. Empty when `docs`
// is undefined.
struct DocSpans {
  std::vector<std::int64_t> offsets;
  std::int64_t max_len = 0;
  // The offsets as an int32 tensor (CPU), what CUDA's variable-length attention takes.
  at::Tensor offsets_tensor() const;
};
DocSpans doc_spans(const at::Tensor& docs);

// Whether packed rows with these documents attend per document on `device` in `dtype` (else under
// masks): on CUDA where variable-length flash attention runs (half precision, a head size it
// takes, a GPU it supports: tried once per device and shape), on the CPU where the documents
// average 32 tokens or more (shorter ones cost more in calls than the mask costs) and no window
// cuts into one. Never with attention dropout or sinks (the plain path needs the mask).
bool attend_per_document(const ModelConfig& config, const DocSpans& spans, at::Device device,
                         at::ScalarType dtype);

// The part of attend_per_document on CUDA known without a GPU: the dtype and the model allow it
// (half precision, a head size flash attention takes, no dropout or sinks). The planner counts
// no masks where this holds (engine/estimate.cpp).
bool flash_may_attend_per_document(const ModelConfig& config, at::ScalarType dtype);

// Sets ctx's limits for B rows of T tokens (B, T from ctx.positions) on `device`: per document
// (doc_offsets; `offsets_on_device` is spans.offsets_tensor() already there, or undefined to copy
// it) or the masks make_attention_context sets, built from `docs` (packed_doc_ids, on `device`;
// undefined = one document per row).
void limit_attention(AttentionContext& ctx, const ModelConfig& config, const at::Tensor& docs,
                     const DocSpans& spans, at::Device device, at::ScalarType dtype,
                     const at::Tensor& offsets_on_device = {});

}  // namespace rondo::models
