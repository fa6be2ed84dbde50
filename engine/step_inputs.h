// A step's inputs: the microbatches checked (shapes, token ids), their attention context built
// without masks (positions, rotary tables), packed rows' document ids and spans, and every tensor
// packed into one host buffer that goes up once per device that runs a job of the step; views of
// that buffer on a device. Pure: no threads, no devices, no transfers (the pipeline uploads the
// buffer through offload::Transfers). Also the packing itself, which generation reuses.
//
//   StepInputs in = prepare_step_inputs(config, at::kBFloat16, "step 3", std::move(microbatches));
//   HostBuffer host = ...(in.layout.bytes);  pack_into(host.data(), in.layout, in.tensors);
//   std::vector<MicrobatchInputs> on_dev = microbatch_views(device_ptr, in.layout, dev);
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "models/attention_masks.h"
#include "models/config.h"

namespace rondo::engine {

// Where one tensor sits in a packed buffer (undefined tensors take no bytes).
struct PackedTensor {
  bool defined = false;
  std::size_t offset = 0;
  std::vector<std::int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
};

// Tensors packed one after another, each at a 256-byte boundary (as device kernels like them).
struct PackedLayout {
  std::vector<PackedTensor> tensors;
  std::size_t bytes = 0;
};

// The layout of `tensors` (contiguous or not; undefined ones are left out), packed in order.
PackedLayout pack_layout(const std::vector<at::Tensor>& tensors);
// Copies `tensors` (CPU) into `dst` as `layout` places them.
void pack_into(void* dst, const PackedLayout& layout, const std::vector<at::Tensor>& tensors);
// Views of the packed tensors at `base` (a copy of the buffer) on `device`; undefined where the
// tensor was.
std::vector<at::Tensor> packed_views(void* base, const PackedLayout& layout, c10::Device device);

// The tensors a microbatch packs, in this order. Masks are not among them: a (B, 1, T, T) mask per
// microbatch would cross the link (T bytes per token); the jobs build them from the documents.
// The last three only for a preference objective's microbatches (Microbatch::pairs).
enum InputPart {
  kPositions,
  kCos,
  kSin,
  kDocs,
  kDocOffsets,
  kTokens,
  kTargets,
  kPairSeq,
  kPairNll,
  kPairReference,
  kInputParts
};

// A step's microbatches, checked and prepared on the host.
struct StepInputs {
  std::vector<Microbatch> mb;  // tokens and targets contiguous int64 on the CPU
  std::int64_t tokens = 0, targets = 0;
  int most_sequences =
      0;  // a preference objective: the most sequences (2 per pair) of a microbatch
  std::vector<models::DocSpans> spans;  // per microbatch: its packed rows' documents
  std::vector<at::Tensor> tensors;      // kInputParts per microbatch, microbatch-major
  PackedLayout layout;                  // of `tensors`
};

// Checks the microbatches (non-empty (B, T) tokens, targets of their shape, token ids inside the
// vocabulary: Error naming `where` and the microbatch otherwise) and prepares their inputs;
// activations in `act_dtype` (the rotary tables' dtype).
StepInputs prepare_step_inputs(const models::ModelConfig& config, at::ScalarType act_dtype,
                               const std::string& where, std::vector<Microbatch> microbatches);

// One microbatch's inputs where a job runs: views into the step's uploaded buffer. Its masks are
// built from `docs` on the device by each job's compute, for the microbatch it runs.
struct MicrobatchInputs {
  models::AttentionContext ctx;  // positions, cos, sin (no masks)
  at::Tensor tokens, targets;
  at::Tensor docs;         // packed rows' document ids (models::packed_doc_ids); undefined: none
  at::Tensor doc_offsets;  // their models::DocSpans::offsets_tensor(); undefined: none
  at::Tensor pair_seq, pair_nll, pair_reference;  // Microbatch::pairs (undefined: none)
};

// Every microbatch's inputs from a copy of the packed step at `base` on `device`.
std::vector<MicrobatchInputs> microbatch_views(void* base, const PackedLayout& layout,
                                               c10::Device device);

}  // namespace rondo::engine
