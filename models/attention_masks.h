// The attention masks of a training batch, built where attention runs. make_attention_context
// (layers.h) builds the whole context on the batch's device; the engine instead sends a step's
// small inputs (positions, rotary tables, the document ids of packed rows) over the link and
// builds the (B, 1, T, T) masks on each device, per job for the microbatch it runs: a packed row of
// 16k tokens would otherwise cross the link and sit in host staging as 256 MiB of mask.
//
//   at::Tensor docs = models::packed_doc_ids(batch);          // host, cheap
//   ... upload docs (B, T) ...
//   models::AttentionMasks m = models::attention_masks(cfg, docs_on_device, B, T, device);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "models/config.h"
#include "models/layers.h"

namespace rondo::models {

// make_attention_context without the masks: positions and rotary tables only. It checks the ids'
// shape, not that each document is contiguous: packed_doc_ids does (call it too, as the engine
// does, or make_attention_context).
AttentionContext attention_context_without_masks(const ModelConfig& config, const TokenBatch& batch,
                                                 at::ScalarType dtype);

// A batch's document ids (B, T) int64 on the host when some row holds more than one document (the
// mask then keeps each document to itself); undefined when every row is one document (plain
// causal attention, the fused kernels). Throws Error for ids of another shape or a document that
// is not contiguous within its row.
at::Tensor packed_doc_ids(const TokenBatch& batch);

struct AttentionMasks {
  at::Tensor mask;         // AttentionContext::mask
  at::Tensor window_mask;  // AttentionContext::window_mask
};
// The masks make_attention_context sets, for B rows of T tokens whose packed document ids are
// `docs` (from packed_doc_ids, on `device`; undefined = one document per row), on `device`.
AttentionMasks attention_masks(const ModelConfig& config, const at::Tensor& docs, std::int64_t B,
                               std::int64_t T, at::Device device);

}  // namespace rondo::models
