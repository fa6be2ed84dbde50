#include "offload/transfer.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <optional>
#include <string>
#include <thread>

#include "kernels/cpu/adamw.h"
#include "kernels/error.h"

namespace rondo::offload {

DeviceWeights::~DeviceWeights() {
  // Staged NVMe reads are the uploads' sources: freed only once the copies are done.
  if (staged_.empty() || !ready_) return;
  try {
    ready_->synchronize();
  } catch (...) {  // a failed stream: whoever waits on the job reports it; nothing runs after it
  }
}

void DeviceWeights::release_staging() {
  if (staged_.empty()) return;
  ready_->synchronize();
  staged_.clear();
}

void* DeviceWeights::tensor(int layer, std::size_t index) const {
  const TensorState& t = store_->layer(static_cast<std::size_t>(layer)).at(index);
  if (t.tied) {
    layer = t.owner_layer;
    index = static_cast<std::size_t>(t.owner_index);
  }
  auto it = tensors_.find({layer, index});
  if (it == tensors_.end())
    throw InternalError("transfers: layer " + std::to_string(layer) + " tensor " +
                        std::to_string(index) + " was not loaded for this job");
  return it->second;
}

Transfers::Transfers(LayerStore& store, HostArena& arena, std::vector<kernels::Device*> devices,
                     TransferOptions options)
    : store_(store), arena_(arena), options_(options) {
  RONDO_ASSERT(options_.max_chunk_bytes > 0 && options_.nvme_window >= 1);
  if (options_.spill_bytes > 0) {
    if (!store_.nvme())
      throw InternalError("transfers: activation checkpoints on NVMe without an NVMe tier");
    spill_ = std::make_unique<ActivationSpill>(
        *store_.nvme(), options_.spill_bytes,
        [this](std::size_t bytes) {
          HostBuffer b = take_staging(bytes);
          count_spill_staged(+1);
          return b;
        },
        [this](HostBuffer b) {
          count_spill_staged(-1);
          recycle(std::move(b));
        });
  }
  for (kernels::Device* dev : devices) {
    DeviceLinks l;
    l.dev = dev;
    l.act_up = &dev->create_stream("activation-upload", kernels::StreamPriority::kHigh);
    l.weight_up = &dev->create_stream("weight-upload");
    l.down = &dev->create_stream("download");
    devs_.push_back(l);
  }
  for (std::size_t l = 0; l < store_.layers(); ++l)
    if (store_.grad_tier(l) == Tier::kNvme) {
      // A download stream of its own, so that the writer's copies never queue behind another
      // job's (and the work that job waits for).
      for (DeviceLinks& dl : devs_)
        dl.grad_down = &dl.dev->create_stream("gradient-download");
      grads_ = std::make_unique<GradientWriter>(store_, devs_, mutex_, stats_);
      break;
    }
}

// Note [Gradients on NVMe]
// When gradients do not fit host memory, the planner puts some layers' on the NVMe tier
// (LayerDesc::grads). A job still accumulates a layer's gradient on its device over the step's
// microbatches, so each layer's gradient comes down once per step; for an NVMe-resident one the
// gradient writer (a thread of Transfers per device) takes it from there: once the job's compute is
// done it downloads the gradient a chunk record at a time (the layer's optimizer chunks, Note
// [Optimizer chunks] in layer_store.cpp) into staging of the record's size, writes the record to
// the drive in the background, and folds each piece into the layer's sum of squares (kernels::
// SumSquaresStream: bit for bit the sum of the gradient in memory, so the global-norm clip, and
// every update, is exact). The optimizer waits for that sum (gradients_written) where it would
// have read the gradient, and reads each record once, with its chunk (LayerStore::access_chunk).
// So a step writes and reads every NVMe gradient byte once, and host staging holds a record being
// filled, the writes in flight and the optimizer's records, never a layer's gradient. The device
// memory of the gradient stays held (by the job's `keep`) until the writer has brought it down.
class Transfers::GradientWriter {
 public:
  // A thread per device, so that the devices' gradients come down their links side by side.
  GradientWriter(LayerStore& store, std::vector<DeviceLinks>& devs, std::mutex& stats_mutex,
                 TransferStats& stats)
      : store_(store), devs_(devs), stats_mutex_(stats_mutex), stats_(stats), queues_(devs.size()) {
    for (std::size_t d = 0; d < devs.size(); ++d)
      threads_.emplace_back([this, d] { serve(d); });
  }
  ~GradientWriter() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_)
      t.join();
  }
  void add(int d, int layer, const void* src, std::shared_ptr<kernels::Event> ready,
           std::shared_ptr<void> keep) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queues_.at(static_cast<std::size_t>(d))
          .push_back({d, layer, src, std::move(ready), std::move(keep)});
    }
    cv_.notify_all();
  }
  double written(int layer) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !results_[layer].empty(); });
    Result r = std::move(results_[layer].front());
    results_[layer].pop_front();
    if (r.error) std::rethrow_exception(r.error);
    return r.sum;
  }

 private:
  struct Job {
    int d, layer;
    const void* src;
    std::shared_ptr<kernels::Event> ready;
    std::shared_ptr<void> keep;
  };
  struct Result {
    double sum = 0;
    std::exception_ptr error;
  };
  void serve(std::size_t d) {
    std::deque<Job>& queue = queues_[d];
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue.empty(); });
        if (queue.empty()) return;  // stopping, nothing left
        job = std::move(queue.front());
        queue.pop_front();
      }
      Result r;
      try {
        r.sum = write(job);
      } catch (...) {
        r.error = std::current_exception();
      }
      job.keep.reset();  // the device memory goes back (in its stream's order)
      {
        std::lock_guard<std::mutex> lock(mutex_);
        results_[job.layer].push_back(std::move(r));
      }
      cv_.notify_all();
    }
  }
  double write(const Job& job) {
    const auto l = static_cast<std::size_t>(job.layer);
    const DeviceLinks& dl = devs_.at(static_cast<std::size_t>(job.d));
    const std::vector<TensorState>& ts = store_.layer(l);
    const std::size_t gs = kernels::dtype_size(store_.grad_dtype());
    const auto* src = static_cast<const std::uint8_t*>(job.src);
    job.ready->synchronize();  // the job's compute is done: its gradients are final
    double layer_sum = 0;
    std::optional<kernels::SumSquaresStream> tensor_sum;
    std::size_t tensor = SIZE_MAX;
    std::uint64_t bytes = 0;
    for (std::size_t k = 0; k < store_.optimizer_chunks(l); ++k) {
      const std::vector<OptimizerPiece>& chunk = store_.optimizer_chunk(l, k);
      HostBuffer record = store_.grad_record(l, k);
      std::size_t at = 0;
      for (const OptimizerPiece& p : chunk) {
        dl.grad_down->download(record.as<std::uint8_t>() + at,
                               src + ts[p.tensor].grad_offset + p.begin * gs, p.numel * gs);
        at += p.numel * gs;
      }
      auto landed = dl.dev->create_event();
      dl.grad_down->record(*landed);
      landed->synchronize();
      bytes += at;
      at = 0;
      for (const OptimizerPiece& p : chunk) {
        if (p.tensor != tensor) {
          if (tensor_sum) layer_sum += tensor_sum->total();
          tensor = p.tensor;
          tensor_sum.emplace(store_.grad_dtype(), ts[p.tensor].numel);
        }
        tensor_sum->add(record.as<std::uint8_t>() + at, p.numel);
        at += p.numel * gs;
      }
      store_.write_grad_record(l, k, std::move(record));
    }
    if (tensor_sum) layer_sum += tensor_sum->total();
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.gradients_down += bytes;
    return layer_sum;
  }

  LayerStore& store_;
  std::vector<DeviceLinks>& devs_;
  std::mutex& stats_mutex_;
  TransferStats& stats_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::deque<Job>> queues_;  // per device
  std::map<int, std::deque<Result>> results_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

Transfers::~Transfers() = default;  // grads_, then spill_ go first (declared last)

namespace {
unsigned nvme_parts(const LayerStore& store, std::size_t layer, bool frozen_only) {
  return (store.tier(layer, kBasePart) == Tier::kNvme ? kBasePart : 0) |
         (!frozen_only && store.tier(layer, kStreamPart) == Tier::kNvme ? kStreamPart : 0);
}
}  // namespace

std::unique_ptr<DeviceWeights> Transfers::load_weights(int d, const std::vector<int>& layers) {
  const DeviceLinks& dl = devs_.at(d);
  const std::size_t ss = kernels::dtype_size(store_.stream_dtype());
  std::uint64_t up = 0, dequantised = 0, read = 0;
  // NVMe-resident parts are read in pieces (Note [Weight pieces] in layer_store.cpp): every piece
  // of this call in order, so that reads run nvme_window pieces ahead of the uploads, across
  // layers. In staging, oldest first, each with the event behind its upload.
  struct Piece {
    std::size_t layer;
    unsigned part;
    std::size_t index;
  };
  std::vector<Piece> pieces;
  for (int l : layers)
    for (unsigned part : {kBasePart, kStreamPart})
      if (nvme_parts(store_, static_cast<std::size_t>(l), false) & part)
        for (std::size_t i = 0; i < store_.pieces(static_cast<std::size_t>(l), part); ++i)
          pieces.push_back({static_cast<std::size_t>(l), part, i});
  std::size_t next = 0;  // in pieces: the next to read
  struct Staging {
    HostBuffer buffer;
    std::unique_ptr<kernels::Event> uploaded;
  };
  std::deque<Staging> window;
  // An error part way (a later piece's read failing, most often) unwinds while the staged pieces'
  // copies may still be queued: their host memory (its own mapping) goes only once the stream is
  // past them. Unmapped under a queued copy, it crashed the process instead of reporting the error.
  // The wait also covers the device buffers' stream-ordered releases (`w` goes before it), so the
  // stream is idle when the error leaves.
  struct StagingOutlivesItsCopies {
    kernels::Stream& stream;
    const int unwinding = std::uncaught_exceptions();
    ~StagingOutlivesItsCopies() {
      if (std::uncaught_exceptions() == unwinding) return;
      try {
        stream.synchronize();
      } catch (...) {  // the stream's own failure: the error already under way is the one to report
      }
    }
  } outlive{*dl.weight_up};
  auto w = std::make_unique<DeviceWeights>();
  w->store_ = &store_;
  auto upload = [&](std::uint8_t* dst, const std::uint8_t* src, std::size_t bytes) {
    for (std::size_t off = 0; off < bytes; off += options_.max_chunk_bytes)
      dl.weight_up->upload(dst + off, src + off,
                           std::min<std::size_t>(options_.max_chunk_bytes, bytes - off));
  };
  for (int l : layers) {
    const std::size_t layer = static_cast<std::size_t>(l);
    // One device buffer per layer: the frozen part, then the trained part.
    ByteRange parts[2] = {store_.stream_bytes(layer, kBasePart),
                          store_.stream_bytes(layer, kStreamPart)};
    const unsigned on_nvme = nvme_parts(store_, layer, false);
    // A part read where the store keeps it in host memory (TransferOptions::share_frozen, for the
    // trained part share_trained) is not copied; what is left is.
    std::uint8_t* in_place[2] = {nullptr, nullptr};
    for (int p : {0, 1})
      if ((p == 0 ? options_.share_frozen : options_.share_trained) &&
          !(on_nvme & (p == 0 ? kBasePart : kStreamPart)) && parts[p].bytes > 0) {
        in_place[p] = parts[p].data;
        parts[p] = {};
      }
    const std::size_t bytes = parts[0].bytes + parts[1].bytes;
    if (bytes == 0 && !in_place[0] && !in_place[1]) continue;
    kernels::DeviceBuffer buf;
    if (bytes > 0) buf = dl.dev->allocate(bytes, dl.weight_up);
    auto* base = static_cast<std::uint8_t*>(buf.data());
    std::size_t at = 0;
    for (int p : {0, 1}) {
      const ByteRange& range = parts[p];
      const unsigned part = p == 0 ? kBasePart : kStreamPart;
      if (!(on_nvme & part)) {
        upload(base + at, range.data, range.bytes);
        at += range.bytes;
        continue;
      }
      for (std::size_t i = 0; i < store_.pieces(layer, part); ++i) {
        RONDO_ASSERT(next < pieces.size() && pieces[next].layer == layer &&
                     pieces[next].part == part && pieces[next].index == i);
        // Staging for at most nvme_window pieces: wait for the oldest upload to end first.
        while (static_cast<int>(window.size()) >= options_.nvme_window) {
          window.front().uploaded->synchronize();
          window.pop_front();
        }
        // Reads for this piece and the next ones of the window (one already under way is left
        // alone).
        for (std::size_t j = next;
             j < std::min(pieces.size(), next + static_cast<std::size_t>(options_.nvme_window));
             ++j)
          store_.prefetch_piece(pieces[j].layer, pieces[j].part, pieces[j].index);
        ++next;
        HostBuffer piece = store_.read_piece(layer, part, i);
        const std::size_t offset = i * store_.piece_bytes();
        const std::size_t n = std::min<std::size_t>(store_.piece_bytes(), range.bytes - offset);
        upload(base + at + offset, piece.as<std::uint8_t>(), n);
        read += n;
        window.push_back({std::move(piece), dl.dev->create_event()});
        dl.weight_up->record(*window.back().uploaded);
      }
      at += range.bytes;
    }
    up += bytes;
    const std::vector<TensorState>& ts = store_.layer(layer);
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const TensorState& t = ts[i];
      if (t.tied) continue;
      const int p = t.trainable ? 1 : 0;  // its part
      std::uint8_t* src =
          (in_place[p] ? in_place[p] : base + (p == 1 ? parts[0].bytes : 0)) + t.stream_offset;
      if (t.quant.type == kernels::QuantType::kNone) {
        w->tensors_[{l, i}] = src;
        continue;
      }
      // Quantised on the wire: dequantised here, in stream order behind the upload.
      kernels::DeviceBuffer out = dl.dev->allocate(t.numel * ss, dl.weight_up);
      dl.weight_up->dequantize(t.quant, src, t.rows, t.cols, store_.stream_dtype(), out.data());
      w->tensors_[{l, i}] = out.data();
      w->buffers_.push_back(std::move(out));
      dequantised += t.numel * ss;
    }
    if (bytes > 0) w->buffers_.push_back(std::move(buf));
  }
  for (Staging& s : window)
    w->staged_.push_back(std::move(s.buffer));  // freed once the uploads are done
  w->ready_ = std::shared_ptr<kernels::Event>(dl.dev->create_event());
  dl.weight_up->record(*w->ready_);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.weights_up += up;
  stats_.weights_dequantised += dequantised;
  stats_.nvme_read += read;
  return w;
}

void Transfers::prefetch_weights(const std::vector<int>& layers, bool frozen_only) {
  // The first nvme_window pieces (Note [Weight pieces]) of the layers' NVMe-resident parts.
  int n = 0;
  for (int l : layers) {
    const std::size_t layer = static_cast<std::size_t>(l);
    const unsigned parts = nvme_parts(store_, layer, frozen_only);
    for (unsigned part : {kBasePart, kStreamPart}) {
      if (!(parts & part)) continue;
      for (std::size_t i = 0; i < store_.pieces(layer, part); ++i) {
        if (n++ >= options_.nvme_window) return;
        store_.prefetch_piece(layer, part, i);
      }
    }
  }
}

HostBuffer Transfers::take_staging(std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // A recycled buffer at most about twice as large: staging sizes repeat (the same stage
    // boundaries every step), so this almost always finds an exact fit.
    auto it = free_.lower_bound(bytes);
    if (it != free_.end() && it->first <= 2 * bytes + 4096) {
      HostBuffer b = std::move(it->second);
      free_.erase(it);
      return b;
    }
  }
  return arena_.allocate(bytes, Purpose::kActivations);
}

void Transfers::recycle(HostBuffer buffer) {
  if (!buffer) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t bytes = buffer.bytes();
  free_.emplace(bytes, std::move(buffer));
}

void Transfers::clear_staging() {
  std::multimap<std::size_t, HostBuffer> drop;
  std::lock_guard<std::mutex> lock(mutex_);
  drop.swap(free_);
}

Staged Transfers::download(int d, const void* src, std::size_t bytes, kernels::Event& after) {
  const DeviceLinks& dl = devs_.at(d);
  Staged s;
  s.host = take_staging(bytes);
  dl.down->wait(after);
  dl.down->download(s.host.data(), src, bytes);
  s.done = dl.dev->create_event();
  dl.down->record(*s.done);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.activations_down += bytes;
  return s;
}

Uploaded Transfers::upload(int d, const Staged& staged, std::size_t bytes) {
  const DeviceLinks& dl = devs_.at(d);
  Uploaded u;
  u.buffer = dl.dev->allocate(bytes, dl.act_up);
  if (staged.done) dl.act_up->wait(*staged.done);
  dl.act_up->upload(u.buffer.data(), staged.host.data(), bytes);
  u.ready = dl.dev->create_event();
  dl.act_up->record(*u.ready);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.activations_up += bytes;
  return u;
}

Uploaded Transfers::upload_for(int d, kernels::Stream& consumer, const void* src, std::size_t bytes,
                               Cargo cargo, kernels::Event* after) {
  const DeviceLinks& dl = devs_.at(d);
  RONDO_ASSERT(&consumer.device() == dl.dev);
  Uploaded u;
  u.buffer = dl.dev->allocate(bytes, &consumer);
  // The buffer is the consumer's from here: the copy waits for the consumer to reach it (a
  // stream-ordered allocator may hand out memory the consumer's earlier work still reads).
  auto allocated = dl.dev->create_event();
  consumer.record(*allocated);
  dl.act_up->wait(*allocated);
  if (after) dl.act_up->wait(*after);
  if (bytes) dl.act_up->upload(u.buffer.data(), src, bytes);
  u.ready = dl.dev->create_event();
  dl.act_up->record(*u.ready);
  std::lock_guard<std::mutex> lock(mutex_);
  count(cargo, /*up=*/true, bytes);
  return u;
}

void Transfers::count(Cargo cargo, bool up, std::uint64_t bytes) {
  switch (cargo) {
    case Cargo::kInputs:
      RONDO_ASSERT(up);
      stats_.inputs_up += bytes;
      break;
    case Cargo::kActivations:
      (up ? stats_.activations_up : stats_.activations_down) += bytes;
      break;
    case Cargo::kKvCache:
      (up ? stats_.kv_up : stats_.kv_down) += bytes;
      break;
    case Cargo::kOutputs:
      RONDO_ASSERT(!up);
      stats_.outputs_down += bytes;
      break;
  }
}

std::unique_ptr<kernels::Event> Transfers::enqueue_download(int d, void* dst, const void* src,
                                                            std::size_t bytes,
                                                            kernels::Event& after) {
  const DeviceLinks& dl = devs_.at(d);
  dl.down->wait(after);
  if (bytes) dl.down->download(dst, src, bytes);
  auto ev = dl.dev->create_event();
  dl.down->record(*ev);
  return ev;
}

std::unique_ptr<kernels::Event> Transfers::download_gradients(int d, int layer, const void* src,
                                                              kernels::Event& after,
                                                              std::shared_ptr<void> keep) {
  const ByteRange gr = store_.grad_bytes(static_cast<std::size_t>(layer));
  if (store_.grad_tier(static_cast<std::size_t>(layer)) == Tier::kNvme) {
    // To the gradient writer (Note [Gradients on NVMe]), once the compute is done.
    const DeviceLinks& dl = devs_.at(d);
    dl.grad_down->wait(after);
    std::shared_ptr<kernels::Event> ready = dl.dev->create_event();
    dl.grad_down->record(*ready);
    grads_->add(d, layer, src, ready, std::move(keep));
    auto ev = dl.dev->create_event();
    dl.down->record(*ev);
    return ev;
  }
  // Accumulated where the store keeps them (the CPU device, engine::EngineOptions::
  // share_trained_state): nothing to move, the event still orders the reader behind the compute.
  const std::size_t bytes = src == gr.data ? 0 : gr.bytes;
  auto ev = enqueue_download(d, gr.data, src, bytes, after);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.gradients_down += bytes;
  return ev;
}

std::unique_ptr<kernels::Event> Transfers::download_value(int d, void* dst, const void* src,
                                                          std::size_t bytes, kernels::Event& after,
                                                          Cargo cargo) {
  auto ev = enqueue_download(d, dst, src, bytes, after);
  std::lock_guard<std::mutex> lock(mutex_);
  count(cargo, /*up=*/false, bytes);
  return ev;
}

Spilled Transfers::spill(Staged staged, std::size_t bytes) {
  RONDO_ASSERT(spill_);
  count_spill_staged(+1);
  return spill_->write(std::move(staged.host), bytes, std::move(staged.done));
}

void Transfers::recycle_unspilled(HostBuffer buffer) {
  count_spill_staged(-1);
  recycle(std::move(buffer));
}

void Transfers::count_spill_staged(int change) {
  std::lock_guard<std::mutex> lock(mutex_);
  spill_staged_ = static_cast<std::uint64_t>(static_cast<std::int64_t>(spill_staged_) + change);
  stats_.spill_staged_peak = std::max(stats_.spill_staged_peak, spill_staged_);
}

void Transfers::prefetch(Spilled& spilled) {
  RONDO_ASSERT(spill_);
  spill_->prefetch(spilled);
}

Staged Transfers::unspill(Spilled& spilled) {
  RONDO_ASSERT(spill_);
  Staged s;
  s.host = spill_->read(spilled);
  return s;
}

double Transfers::gradients_written(int layer) {
  RONDO_ASSERT(grads_ && store_.grad_tier(static_cast<std::size_t>(layer)) == Tier::kNvme);
  return grads_->written(layer);
}

TransferStats Transfers::stats() const {
  TransferStats s;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    s = stats_;
  }
  if (spill_) s.spill = spill_->stats();
  return s;
}

}  // namespace rondo::offload
