// The transfer engine: every byte that crosses a device's host link is issued here
// (docs/architecture.md §2.7). The engine keeps the schedule — which job runs where, and when —
// and asks for "these layers' weights on device d, ready by an event", "this activation down to
// the host", "this one up to device d", "these gradients down to the store"; this class decides
// where the bytes come from (the host store, the NVMe tier, a quantised copy dequantised on the
// device), how they are staged and chunked, and on which stream, so that activations go first.
//
// Per device three copy streams besides the engine's compute stream: activation upload (high
// priority), weight upload (weights cut into chunks of at most max_chunk_bytes so that activation
// uploads slot in between them on the shared link) and download. Host staging buffers for
// activations are recycled (mapping and pinning fresh pages per microbatch is far too slow).
// Thread-safe: the engine's loaders, workers and optimizer call it concurrently.
//
//   offload::Transfers xfer(store, arena, devices);
//   auto w = xfer.load_weights(d, {3, 4});             // uploads enqueued
//   compute.wait(w->ready());
//   at::Tensor q = view(w->tensor(3, 0), ...);          // streaming dtype, on the device
//   offload::Staged s = xfer.download(d, dev_ptr, bytes, after_compute);
//   auto up = xfer.upload(e, dst_ptr, s, bytes);        // on device e, after s.done
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/device.h"
#include "offload/activation_spill.h"
#include "offload/host_arena.h"
#include "offload/layer_store.h"

namespace rondo::offload {

struct TransferOptions {
  // Weight uploads are cut into pieces of at most this size, so that an activation upload waits
  // for one piece at most (RoundPipe's priority rule, docs/architecture.md §3.4).
  std::uint64_t max_chunk_bytes = 256ull << 20;
  // Pieces of layers (LayerStore::piece_bytes() each at most) read from the NVMe tier ahead of
  // their upload, per device: host staging holds at most this many pieces per device (plus as
  // many read ahead for its next job), whatever a stage's or a layer's size, while reads overlap
  // uploads.
  int nvme_window = 2;
  // Bytes of the store's NVMe tier (store.nvme(), sized for them) for activation checkpoints:
  // > 0 turns spill() on (offload/activation_spill.h).
  std::uint64_t spill_bytes = 0;
  // The devices compute in this process's memory (the CPU device): a layer's frozen part, when the
  // store holds it in host memory, is read where it is instead of copied every step (it never
  // changes; a quantised one is dequantised from there). Not for simulated GPUs, whose copies
  // stand for a link.
  bool share_frozen = false;
  // The same for the trained part (the streaming copies the optimizer writes): only where nothing
  // reads a layer while the optimizer writes it, i.e. exact synchronous training (the engine's
  // Note [Engine synchronisation], 2), not the one-step-stale mode's publishing.
  bool share_trained = false;
};

// What a copy carries, for TransferStats.
enum class Cargo {
  kInputs,       // a step's tokens, targets and attention context; generation's tokens
  kActivations,  // stage outputs, activation checkpoints, their gradients
  kKvCache,      // generation's KV caches kept in host memory between tokens
  kOutputs,      // small results: a job's loss sum, generation's logits
};

// Bytes moved, by direction and kind, since the engine was made (for events and benchmarks).
// Every copy between host and device memory is issued by Transfers and counted here once: the
// sums of the *_up and *_down fields are the bytes the devices' links carried (tested against a
// simulated device's own traffic counters).
struct TransferStats {
  std::uint64_t weights_up = 0;           // as sent over the link (quantised where stored so)
  std::uint64_t weights_dequantised = 0;  // bytes written on the devices by dequantisation
  std::uint64_t inputs_up = 0;
  std::uint64_t activations_up = 0, activations_down = 0;
  std::uint64_t gradients_down = 0;
  std::uint64_t kv_up = 0, kv_down = 0;
  std::uint64_t outputs_down = 0;
  std::uint64_t bytes_up() const { return weights_up + inputs_up + activations_up + kv_up; }
  std::uint64_t bytes_down() const {
    return activations_down + gradients_down + kv_down + outputs_down;
  }
  std::uint64_t nvme_read = 0;  // weights read from the NVMe tier for uploads
  SpillStats spill;             // activation checkpoints on the NVMe tier
  // The most checkpoints handed to the NVMe tier in host staging at once: waiting for the drive,
  // being written, read back and not yet given back with recycle_unspilled() (the planner counts
  // these: engine/estimate.cpp). Checkpoints dropped unread (a segment that failed) count off as
  // their staging comes back.
  std::uint64_t spill_staged_peak = 0;
};

// Some layers' weights on one device. Destroying it frees the device memory in stream order and
// the host staging of NVMe-resident layers once the uploads are done.
class DeviceWeights {
 public:
  DeviceWeights() = default;
  ~DeviceWeights();
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  // Tensor `index` of `layer` on the device, in the store's streaming dtype (dequantised if the
  // store keeps it quantised); a tied tensor resolves to its owner. Throws InternalError when the
  // layer was not loaded.
  void* tensor(int layer, std::size_t index) const;
  // Recorded on the weight-upload stream behind every copy and dequantisation. Shared, so that
  // a waiter may keep it after the weights are freed.
  const std::shared_ptr<kernels::Event>& ready() const { return ready_; }
  // Frees the host staging of NVMe-resident layers (waiting for the uploads that read it). Call
  // from the thread that loaded the weights.
  void release_staging();

 private:
  friend class Transfers;
  const LayerStore* store_ = nullptr;
  std::map<std::pair<int, std::size_t>, void*> tensors_;
  std::vector<kernels::DeviceBuffer> buffers_;
  std::vector<HostBuffer> staged_;  // NVMe-resident pieces, read into host memory for the copy
  std::shared_ptr<kernels::Event> ready_;
};

// An activation in host staging memory, complete once `done` has (download stream; null: now).
struct Staged {
  HostBuffer host;
  std::unique_ptr<kernels::Event> done;
};

// An activation uploaded to a fresh device buffer, there once `ready` has.
struct Uploaded {
  kernels::DeviceBuffer buffer;
  std::unique_ptr<kernels::Event> ready;
};

class Transfers {
 public:
  // Creates the three copy streams on each device. `devices` are borrowed and must outlive this.
  Transfers(LayerStore& store, HostArena& arena, std::vector<kernels::Device*> devices,
            TransferOptions options = {});
  ~Transfers();
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  std::size_t devices() const { return devs_.size(); }
  kernels::Stream& activation_upload_stream(int d) const { return *devs_.at(d).act_up; }
  kernels::Stream& weight_upload_stream(int d) const { return *devs_.at(d).weight_up; }
  kernels::Stream& download_stream(int d) const { return *devs_.at(d).down; }

  // The streaming copies of `layers` (tied owners included by the caller) to device d: from host
  // memory, or read from the NVMe tier first — in pieces (LayerStore::read_piece), nvme_window
  // pieces ahead of the uploads, the caller blocking while it waits for a read or for an upload to
  // free its staging; quantised tensors go over the link as stored and are dequantised on the
  // device. Returns once every copy is enqueued; ready() completes when they have landed.
  // Allocates device memory (kernels::OutOfMemory past the cap); offload::IoError on an NVMe
  // failure.
  std::unique_ptr<DeviceWeights> load_weights(int d, const std::vector<int>& layers);
  // Starts the NVMe reads of the first nvme_window pieces of the NVMe-resident layers of `layers`
  // ahead of load_weights. With `frozen_only`, of the frozen weights only (the trained ones may be
  // about to change).
  void prefetch_weights(const std::vector<int>& layers, bool frozen_only = false);

  // `bytes` of device memory on d down to a recycled host staging buffer, after `after`.
  Staged download(int d, const void* src, std::size_t bytes, kernels::Event& after);
  // A staged activation up to a new buffer on device d (after its download), on the
  // high-priority activation stream. The staging buffer stays owned by `staged` (give it back
  // with recycle() once `ready` has completed).
  Uploaded upload(int d, const Staged& staged, std::size_t bytes);
  // `bytes` of host memory at `src` up to a new buffer on device d that belongs to `consumer` (a
  // stream of d): allocated and released in its order, so that the buffer may be dropped as soon
  // as the consumer's work is enqueued; the copy runs on the activation stream once the consumer
  // has reached this point (and `after`, when given, has completed). `src` must stay valid until
  // `ready` (page-locked staging, for a copy that does not block).
  Uploaded upload_for(int d, kernels::Stream& consumer, const void* src, std::size_t bytes,
                      Cargo cargo, kernels::Event* after = nullptr);
  // Host staging memory (page-locked where the arena pins) from the pool, or new: for data the
  // engine writes on the host and uploads itself.
  HostBuffer take_staging(std::size_t bytes);
  // Staging memory back to the pool, for later downloads.
  void recycle(HostBuffer buffer);
  // Frees the pooled staging memory (between segments, when nothing is in flight).
  void clear_staging();

  // Activation checkpoints on the NVMe tier (TransferOptions::spill_bytes > 0): a staged one is
  // written there in the background once downloaded, its staging recycled once written; unspill()
  // brings it back into staging (blocking; prefetch() starts that early). Throws IoError there
  // when its write or read failed.
  bool spills() const { return spill_ != nullptr; }
  Spilled spill(Staged staged, std::size_t bytes);
  void prefetch(Spilled& spilled);
  Staged unspill(Spilled& spilled);
  // An unspilled checkpoint's staging back to the pool (recycle(), counted off the tier's staging).
  void recycle_unspilled(HostBuffer buffer);

  // Layer `layer`'s gradients, laid out as the store's gradient region, from `src` on device d
  // into the store, after `after`; returns the event behind the copy. `src` may be the store's own
  // gradient region (a device computing in host memory accumulated them there): then nothing is
  // copied. Where the store keeps the layer's gradients on NVMe (Note [Gradients on NVMe] in
  // transfer.cpp) the gradient writer brings them down a chunk record at a time and writes each
  // to the drive, summing their squares as they land; `keep` holds the device memory at `src`
  // until it is done, and gradients_written() waits for it (the event returned then orders
  // nothing of it).
  std::unique_ptr<kernels::Event> download_gradients(int d, int layer, const void* src,
                                                     kernels::Event& after,
                                                     std::shared_ptr<void> keep = nullptr);
  // NVMe-resident gradients: waits until the writer has put the layer's oldest gradients handed
  // to download_gradients on their way to the drive, and returns their sum of squares — what
  // engine::Optimizer::partial_sum_squares computes from host memory, bit for bit. Rethrows the
  // writer's error for them (IoError, HostOutOfMemory).
  double gradients_written(int layer);
  // The same for any device memory (the tail's loss, logits, new KV-cache positions) into
  // caller-owned host memory, counted as `cargo`.
  std::unique_ptr<kernels::Event> download_value(int d, void* dst, const void* src,
                                                 std::size_t bytes, kernels::Event& after,
                                                 Cargo cargo = Cargo::kOutputs);

  TransferStats stats() const;

 private:
  struct DeviceLinks {
    kernels::Device* dev = nullptr;
    kernels::Stream *act_up = nullptr, *weight_up = nullptr, *down = nullptr;
    kernels::Stream* grad_down = nullptr;  // the gradient writer's (gradients on NVMe only)
  };
  std::unique_ptr<kernels::Event> enqueue_download(int d, void* dst, const void* src,
                                                   std::size_t bytes, kernels::Event& after);
  void count(Cargo cargo, bool up, std::uint64_t bytes);  // under mutex_

  LayerStore& store_;
  HostArena& arena_;
  TransferOptions options_;
  std::vector<DeviceLinks> devs_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, HostBuffer> free_;  // recycled staging, by size
  TransferStats stats_;
  std::uint64_t spill_staged_ = 0;          // spilled checkpoints in host staging now, under mutex_
  void count_spill_staged(int change);      // +1 onto the tier's staging, -1 off it
  std::unique_ptr<ActivationSpill> spill_;  // its writer thread recycles into free_
  class GradientWriter;                     // transfer.cpp
  std::unique_ptr<GradientWriter> grads_;   // last: its thread uses the streams and the store
};

}  // namespace rondo::offload
