#include "offload/transfer.h"

#include <algorithm>
#include <string>

#include "kernels/error.h"

namespace rondo::offload {

DeviceWeights::~DeviceWeights() {
  // Staging memory is read by the uploads: only back to the pool once they are done.
  if (!staging_.empty() && ready_) ready_->synchronize();
  for (HostBuffer& b : staging_)
    if (give_back_) give_back_(std::move(b));
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
  RONDO_ASSERT(options_.max_chunk_bytes > 0);
  for (kernels::Device* dev : devices) {
    DeviceLinks l;
    l.dev = dev;
    l.act_up = &dev->create_stream("activation-upload", kernels::StreamPriority::kHigh);
    l.weight_up = &dev->create_stream("weight-upload");
    l.down = &dev->create_stream("download");
    devs_.push_back(l);
  }
}

Transfers::~Transfers() = default;

std::unique_ptr<DeviceWeights> Transfers::load_weights(int d, const std::vector<int>& layers) {
  const DeviceLinks& dl = devs_.at(d);
  auto w = std::make_unique<DeviceWeights>();
  w->store_ = &store_;
  w->give_back_ = [this](HostBuffer b) { recycle(std::move(b)); };
  std::uint64_t up = 0;
  for (int l : layers) {
    const ByteRange range = store_.stream_bytes(static_cast<std::size_t>(l));
    if (range.bytes == 0) continue;
    kernels::DeviceBuffer buf = dl.dev->allocate(range.bytes, dl.weight_up);
    auto* base = static_cast<std::uint8_t*>(buf.data());
    for (std::size_t off = 0; off < range.bytes; off += options_.max_chunk_bytes)
      dl.weight_up->upload(base + off, range.data + off,
                           std::min<std::size_t>(options_.max_chunk_bytes, range.bytes - off));
    const std::vector<TensorState>& ts = store_.layer(static_cast<std::size_t>(l));
    for (std::size_t i = 0; i < ts.size(); ++i)
      if (!ts[i].tied) w->tensors_[{l, i}] = base + ts[i].stream_offset;
    w->buffers_.push_back(std::move(buf));
    up += range.bytes;
  }
  w->ready_ = std::shared_ptr<kernels::Event>(dl.dev->create_event());
  dl.weight_up->record(*w->ready_);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.weights_up += up;
  return w;
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
  dl.act_up->wait(*staged.done);
  dl.act_up->upload(u.buffer.data(), staged.host.data(), bytes);
  u.ready = dl.dev->create_event();
  dl.act_up->record(*u.ready);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.activations_up += bytes;
  return u;
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
                                                              kernels::Event& after) {
  const ByteRange gr = store_.grad_bytes(static_cast<std::size_t>(layer));
  auto ev = enqueue_download(d, gr.data, src, gr.bytes, after);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.gradients_down += gr.bytes;
  return ev;
}

std::unique_ptr<kernels::Event> Transfers::download_value(int d, void* dst, const void* src,
                                                          std::size_t bytes,
                                                          kernels::Event& after) {
  auto ev = enqueue_download(d, dst, src, bytes, after);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.activations_down += bytes;
  return ev;
}

TransferStats Transfers::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace rondo::offload
