#include "offload/layer_store.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels/cpu/adamw8bit.h"
#include "kernels/error.h"
#include "offload/layer_store_regions.h"
#include "offload/nvme_store.h"

namespace rondo::offload {
namespace {
constexpr std::size_t kAlign = 64;  // a cache line, and a whole AVX-512 vector
std::size_t align_up(std::size_t n, std::size_t a = kAlign) {
  return (n + a - 1) / a * a;
}
constexpr std::size_t kNvmeAlign = 4096;  // O_DIRECT: offsets, sizes and buffers

constexpr unsigned kParts[3] = {kBasePart, kStreamPart, kOptimizerPart};
int part_index(unsigned part) {
  return part == kBasePart ? 0 : part == kStreamPart ? 1 : 2;
}

// The layout both the host arena and the NVMe regions use for one layer.
struct LayerLayout {
  std::vector<std::size_t> stream_off, grad_off, opt_off;  // per tensor, in its part's region
  std::vector<std::size_t> block_off;  // per tensor, 8-bit moments: its first absmax entry
  // base, stream: bytes; optimizer: master, m and v (f32: 3 * opt_elems * 4; 8-bit: the master,
  // then 2 * opt_elems codes and 2 * opt_blocks absmax entries)
  std::size_t bytes[3] = {0, 0, 0};
  std::size_t grad = 0, opt_elems = 0, opt_blocks = 0;
  std::size_t device = 0;  // both streaming parts on a device (dequantised)
};

// Bytes of masters and moments for runs of `elems` elements and (8-bit) `blocks` absmax entries.
std::size_t optimizer_bytes(std::size_t elems, std::size_t blocks, MomentFormat format) {
  return format == MomentFormat::kF32 ? 3 * elems * sizeof(float)
                                      : elems * (sizeof(float) + 2) + 2 * blocks * sizeof(float);
}

std::size_t stored_bytes(const TensorDesc& t, std::size_t ss) {
  if (t.quant.type == kernels::QuantType::kNone) return static_cast<std::size_t>(t.numel) * ss;
  return kernels::quant_bytes(t.quant, t.rows, t.cols);
}

LayerLayout layout_of(const LayerDesc& layer, std::size_t l, kernels::FloatDType stream_dtype,
                      kernels::FloatDType grad_dtype) {
  const std::size_t ss = kernels::dtype_size(stream_dtype), gs = kernels::dtype_size(grad_dtype);
  LayerLayout o;
  for (const TensorDesc& t : layer.tensors) {
    const std::string where = "layer " + std::to_string(l) + ": tensor '" + t.name + "'";
    if (t.numel <= 0) throw Error(where + " has no elements");
    if (t.tied_to_layer >= static_cast<int>(l))
      throw Error(where + " is tied to a layer that is not earlier (" +
                  std::to_string(t.tied_to_layer) + ")");
    if (t.quant.type != kernels::QuantType::kNone) {
      if (t.trainable || t.tied_to_layer >= 0)
        throw Error(where +
                    " is quantised but trained or tied; only frozen tensors are kept "
                    "quantised");
      if (t.rows * t.cols != t.numel)
        throw Error(where + " is quantised as " + std::to_string(t.rows) + " x " +
                    std::to_string(t.cols) + " but has " + std::to_string(t.numel) + " elements");
    }
    const std::size_t n = static_cast<std::size_t>(t.numel);
    std::size_t& region = o.bytes[t.trainable ? 1 : 0];
    o.stream_off.push_back(region);
    o.opt_off.push_back(o.opt_elems);
    o.block_off.push_back(o.opt_blocks);
    o.grad_off.push_back(o.grad);
    if (t.tied_to_layer < 0) {
      region += align_up(stored_bytes(t, ss));
      o.device += align_up(n * ss);
      if (t.trainable) {
        o.opt_elems += align_up(n * 4) / 4;
        o.opt_blocks += align_up(kernels::adamw8bit_blocks(n) * 4) / 4;
      }
    }
    if (t.trainable) o.grad += align_up(n * gs);
  }
  o.bytes[2] =
      layer.optimizer_elsewhere ? 0 : optimizer_bytes(o.opt_elems, o.opt_blocks, layer.moments);
  return o;
}

bool has_ties(const std::vector<LayerDesc>& layers, std::size_t l) {
  for (const TensorDesc& t : layers[l].tensors)
    if (t.tied_to_layer >= 0) return true;
  for (const LayerDesc& other : layers)
    for (const TensorDesc& t : other.tensors)
      if (t.tied_to_layer == static_cast<int>(l)) return true;
  return false;
}

std::array<Tier, 3> tiers_of(const LayerDesc& d) {
  return {d.base, d.weights, d.optimizer_elsewhere ? Tier::kHost : d.optimizer};
}

// A trainable tensor's master and moments in a layer's optimizer region at `base` (the layer's
// opt_elems master elements first, then the moments in `format`), at element `off` and (8-bit)
// absmax entry `block_off` of the layer's runs.
void bind_optimizer(TensorState& t, std::uint8_t* base, MomentFormat format, std::size_t opt_elems,
                    std::size_t opt_blocks, std::size_t off, std::size_t block_off) {
  auto* f32 = reinterpret_cast<float*>(base);
  t.master = f32 + off;
  if (format == MomentFormat::kF32) {
    t.m = f32 + opt_elems + off;
    t.v = f32 + 2 * opt_elems + off;
    return;
  }
  std::uint8_t* codes = base + opt_elems * sizeof(float);
  auto* absmax = reinterpret_cast<float*>(codes + 2 * opt_elems);
  t.m_codes = codes + off;
  t.v_codes = codes + opt_elems + off;
  t.m_absmax = absmax + block_off;
  t.v_absmax = absmax + opt_blocks + block_off;
}

// Bytes of masters and moments per element (the absmax of 8-bit moments counted apart).
std::size_t state_bytes_per_element(MomentFormat format) {
  return format == MomentFormat::kF32 ? 3 * sizeof(float) : sizeof(float) + 2;
}

// Copies a piece's master and moments between a tensor's views (whole) and the piece's own views
// (in a chunk record): elements [begin, begin + piece.numel) of the tensor.
void copy_piece(const TensorState& whole, const TensorState& piece, std::size_t begin,
                bool into_piece) {
  auto copy = [&](void* tensor_at, void* piece_at, std::size_t bytes) {
    if (into_piece)
      std::memcpy(piece_at, tensor_at, bytes);
    else
      std::memcpy(tensor_at, piece_at, bytes);
  };
  const std::size_t n = piece.numel;
  copy(whole.master + begin, piece.master, n * sizeof(float));
  if (piece.m) {
    copy(whole.m + begin, piece.m, n * sizeof(float));
    copy(whole.v + begin, piece.v, n * sizeof(float));
    return;
  }
  const std::size_t b = begin / kernels::kAdamW8bitBlock, nb = kernels::adamw8bit_blocks(n);
  copy(whole.m_codes + begin, piece.m_codes, n);
  copy(whole.v_codes + begin, piece.v_codes, n);
  copy(whole.m_absmax + b, piece.m_absmax, nb * sizeof(float));
  copy(whole.v_absmax + b, piece.v_absmax, nb * sizeof(float));
}

}  // namespace

// Note [Optimizer chunks]
// The optimizer touches a layer's masters and moments once per step, and they are the bulk of
// its state (12 bytes per parameter in f32, 6 with 8-bit moments): staging them a layer at a time
// made the NVMe tier's host staging grow with the largest layer — an untied embedding of a large
// vocabulary is a fifteenth of a Llama 3 8B — so that moving state to the drive could cost more
// host memory than it saved (issue 34). So a layer's trained tensors are cut, in order, into
// chunks of at most chunk_bytes of state (a tensor is cut at multiples of kChunkGrain elements,
// so an 8-bit moment block never straddles two chunks), and an NVMe-resident optimizer part is
// one NVMe region per chunk holding that chunk's record: its pieces' masters, then their moments,
// laid out like a small layer (bind_optimizer). The optimizer reads, updates and writes back one
// chunk at a time (access_chunk), the next chunk read ahead; AdamW is elementwise (and blockwise
// per 256 elements for 8-bit moments), so chunked updates are bit for bit the layer's. A layer
// access of the optimizer part (loading, checkpoints, export) still sees the layer's layout: it
// is gathered from the records and scattered back to them chunk by chunk. Host-resident state is
// viewed in place, chunked or not.
std::vector<std::vector<OptimizerPiece>> LayerStore::chunks_of(const LayerDesc& layer,
                                                               std::uint64_t chunk_bytes) {
  const std::size_t per_element = state_bytes_per_element(layer.moments);
  const std::size_t cap =
      std::max<std::size_t>(kChunkGrain, chunk_bytes / per_element / kChunkGrain * kChunkGrain);
  std::vector<std::vector<OptimizerPiece>> chunks;
  std::vector<OptimizerPiece> current;
  std::size_t filled = 0;
  auto close = [&] {
    if (!current.empty()) chunks.push_back(std::move(current));
    current.clear();
    filled = 0;
  };
  for (std::size_t i = 0; i < layer.tensors.size(); ++i) {
    const TensorDesc& t = layer.tensors[i];
    if (!t.trainable || t.tied_to_layer >= 0) continue;
    const auto numel = static_cast<std::size_t>(t.numel);
    for (std::size_t begin = 0; begin < numel;) {
      std::size_t take = std::min(numel - begin, cap - filled);
      if (take < numel - begin) take = take / kChunkGrain * kChunkGrain;  // a cut: on the grain
      if (take == 0) {
        close();
        continue;
      }
      current.push_back({i, begin, take});
      filled += take;
      begin += take;
      if (filled == cap) close();
    }
  }
  close();
  return chunks;
}

namespace {
// A chunk record's layout: its pieces' runs like a layer's (bind_optimizer).
struct RecordLayout {
  std::vector<std::size_t> off, block_off;  // per piece
  std::size_t elems = 0, blocks = 0, bytes = 0;
};
RecordLayout record_layout(const std::vector<OptimizerPiece>& chunk, MomentFormat format) {
  RecordLayout r;
  for (const OptimizerPiece& p : chunk) {
    r.off.push_back(r.elems);
    r.block_off.push_back(r.blocks);
    r.elems += align_up(p.numel * 4) / 4;
    r.blocks += align_up(kernels::adamw8bit_blocks(p.numel) * 4) / 4;
  }
  r.bytes = optimizer_bytes(r.elems, r.blocks, format);
  return r;
}
}  // namespace

std::uint64_t LayerStore::chunk_record_bytes(const std::vector<OptimizerPiece>& chunk,
                                             MomentFormat format) {
  return record_layout(chunk, format).bytes;
}

const char* to_string(Tier tier) {
  return tier == Tier::kHost ? "host" : "nvme";
}

const char* to_string(MomentFormat format) {
  return format == MomentFormat::kF32 ? "f32" : "8-bit";
}

LayerStore::LayerStore(HostArena& arena, const std::vector<LayerDesc>& layers,
                       kernels::FloatDType stream_dtype, kernels::FloatDType grad_dtype,
                       NvmeStore* nvme, std::uint64_t chunk_bytes)
    : arena_(arena), stream_dtype_(stream_dtype), grad_dtype_(grad_dtype), nvme_(nvme) {
  // First pass: layouts, and the host totals.
  std::vector<LayerLayout> lay;
  std::size_t total[3] = {0, 0, 0}, grad_total = 0;
  std::vector<std::array<std::size_t, 3>> base(layers.size());
  std::vector<std::size_t> grad_base(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    lay.push_back(layout_of(layers[l], l, stream_dtype, grad_dtype));
    const std::array<Tier, 3> t = tiers_of(layers[l]);
    const bool on_nvme =
        std::count(t.begin(), t.end(), Tier::kNvme) > 0 || layers[l].grads == Tier::kNvme;
    if (on_nvme && nvme == nullptr)
      throw Error("layer " + std::to_string(l) +
                  " is placed on the NVMe tier but the store has no NVMe store; set "
                  "hardware.offload_dir");
    if (on_nvme && has_ties(layers, l))
      throw Error("layer " + std::to_string(l) +
                  " has tied tensors and must stay in host memory (its owner and the tying "
                  "layer share one copy)");
    for (int p = 0; p < 3; ++p) {
      base[l][p] = total[p];
      if (t[p] == Tier::kHost) total[p] += lay[l].bytes[p];
    }
    grad_base[l] = grad_total;
    if (layers[l].grads == Tier::kHost) grad_total += lay[l].grad;
  }
  // Frozen and trained streaming copies share one weights buffer: base parts first.
  weights_ = arena.allocate(total[0] + total[1], Purpose::kWeights);
  gradients_ = arena.allocate(grad_total, Purpose::kGradients);
  optimizer_ = arena.allocate(total[2], Purpose::kOptimizerState);
  piece_bytes_ = piece_bytes_for(chunk_bytes, nvme ? nvme->info().block_bytes : 1u << 20);
  regions_ = std::make_unique<Regions>();
  regions_->region.resize(layers.size());
  regions_->chunk.resize(layers.size());
  regions_->grad_chunk.resize(layers.size());

  // Second pass: views. Fresh mmap'd memory is already zero; NVMe parts are written at load.
  auto* wbase = weights_.as<std::uint8_t>();
  auto* gbase = gradients_.as<std::uint8_t>();
  auto* obase = optimizer_.as<std::uint8_t>();
  layers_.resize(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LayerLayout& o = lay[l];
    const std::array<Tier, 3> tier = tiers_of(layers[l]);
    tiers_.push_back(tier);
    grad_tiers_.push_back(layers[l].grads);
    const bool host_grads = layers[l].grads == Tier::kHost && gbase != nullptr;
    opt_elems_.push_back(o.opt_elems);
    opt_blocks_.push_back(o.opt_blocks);
    moments_.push_back(layers[l].moments);
    elsewhere_.push_back(layers[l].optimizer_elsewhere);
    device_bytes_.push_back(o.device);
    std::uint8_t* part_host[3] = {
        tier[0] == Tier::kHost && wbase ? wbase + base[l][0] : nullptr,
        tier[1] == Tier::kHost && wbase ? wbase + total[0] + base[l][1] : nullptr,
        tier[2] == Tier::kHost && obase && !layers[l].optimizer_elsewhere ? obase + base[l][2]
                                                                          : nullptr};
    std::map<std::string, std::size_t> seen;
    for (std::size_t i = 0; i < layers[l].tensors.size(); ++i) {
      const TensorDesc& t = layers[l].tensors[i];
      if (!seen.emplace(t.name, i).second)
        throw Error("layer " + std::to_string(l) + ": tensor '" + t.name + "' appears twice");
      TensorState s;
      s.name = t.name;
      s.numel = static_cast<std::size_t>(t.numel);
      s.trainable = t.trainable;
      s.quant = t.quant;
      s.rows = t.rows;
      s.cols = t.cols;
      if (t.tied_to_layer >= 0) {
        const TensorState* owner = nullptr;
        for (std::size_t oi = 0; oi < layers_[t.tied_to_layer].size(); ++oi)
          if (layers_[t.tied_to_layer][oi].name == t.name) {
            owner = &layers_[t.tied_to_layer][oi];
            s.owner_layer = t.tied_to_layer;
            s.owner_index = static_cast<int>(oi);
          }
        if (owner == nullptr || owner->tied || owner->numel != s.numel ||
            owner->trainable != s.trainable)
          throw Error("layer " + std::to_string(l) + ": tensor '" + t.name + "' is tied to layer " +
                      std::to_string(t.tied_to_layer) +
                      ", which has no untied tensor of that name, size and trainability");
        s.tied = true;
        s.stream = owner->stream;
        s.master = owner->master;
        s.m = owner->m;
        s.v = owner->v;
        s.m_codes = owner->m_codes;
        s.v_codes = owner->v_codes;
        s.m_absmax = owner->m_absmax;
        s.v_absmax = owner->v_absmax;
      } else {
        s.stream_offset = o.stream_off[i];
        s.stream_bytes = stored_bytes(t, kernels::dtype_size(stream_dtype));
        std::uint8_t* region = part_host[t.trainable ? 1 : 0];
        if (region) s.stream = region + o.stream_off[i];
        if (t.trainable && part_host[2])
          bind_optimizer(s, part_host[2], layers[l].moments, o.opt_elems, o.opt_blocks,
                         o.opt_off[i], o.block_off[i]);
      }
      if (t.trainable) {
        s.grad_offset = o.grad_off[i];
        if (host_grads) s.grad = gbase + grad_base[l] + o.grad_off[i];
      }
      layers_[l].push_back(s);
    }
    base_ranges_.push_back({part_host[0], o.bytes[0]});
    stream_ranges_.push_back({part_host[1], o.bytes[1]});
    grad_ranges_.push_back({host_grads ? gbase + grad_base[l] : nullptr, o.grad});
    static const char* kWhat[2] = {"frozen weights", "trained weights"};
    for (int p = 0; p < 2; ++p)
      if (tier[p] == Tier::kNvme && o.bytes[p] > 0)
        regions_->region[l][p] = nvme_->reserve(align_up(o.bytes[p], kNvmeAlign),
                                                "layer " + std::to_string(l) + " " + kWhat[p]);
    chunks_.push_back(chunks_of(layers[l], chunk_bytes));
    for (std::size_t k = 0; k < chunks_[l].size(); ++k) {
      const std::uint64_t bytes = chunk_record_bytes(chunks_[l][k], layers[l].moments);
      max_chunk_bytes_ = std::max(max_chunk_bytes_, align_up(bytes, kNvmeAlign));
      if (tier[2] == Tier::kNvme)
        regions_->chunk[l].push_back(nvme_->reserve(
            align_up(bytes, kNvmeAlign), "layer " + std::to_string(l) + " optimizer state, chunk " +
                                             std::to_string(k + 1) + " of " +
                                             std::to_string(chunks_[l].size())));
      if (layers[l].grads == Tier::kNvme)
        regions_->grad_chunk[l].push_back(
            nvme_->reserve(align_up(grad_record_bytes(l, k), kNvmeAlign),
                           "layer " + std::to_string(l) + " gradients, chunk " +
                               std::to_string(k + 1) + " of " + std::to_string(chunks_[l].size())));
    }
  }
}

LayerStore::~LayerStore() {
  try {
    flush();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rondo: warning: NVMe write-back failed while closing the store: %s\n",
                 e.what());
  }
}

std::uint64_t LayerStore::nvme_bytes(const std::vector<LayerDesc>& layers,
                                     kernels::FloatDType stream_dtype, std::uint64_t chunk_bytes) {
  std::uint64_t total = 0;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LayerLayout o = layout_of(layers[l], l, stream_dtype, kernels::FloatDType::kF32);
    const std::array<Tier, 3> t = tiers_of(layers[l]);
    for (int p = 0; p < 2; ++p)
      if (t[p] == Tier::kNvme) total += align_up(o.bytes[p], kNvmeAlign);
    for (const auto& chunk : chunks_of(layers[l], chunk_bytes)) {
      if (t[2] == Tier::kNvme)
        total += align_up(chunk_record_bytes(chunk, layers[l].moments), kNvmeAlign);
      if (layers[l].grads == Tier::kNvme) {  // f32 gradients: the most any grad dtype takes
        std::uint64_t grads = 0;
        for (const OptimizerPiece& p : chunk)
          grads += p.numel * sizeof(float);
        total += align_up(grads, kNvmeAlign);
      }
    }
  }
  return total;
}

std::array<std::uint64_t, 3> LayerStore::part_bytes(const std::vector<LayerDesc>& layers,
                                                    std::size_t layer,
                                                    kernels::FloatDType stream_dtype) {
  const LayerLayout o = layout_of(layers.at(layer), layer, stream_dtype, kernels::FloatDType::kF32);
  return {o.bytes[0], o.bytes[1], o.bytes[2]};
}

LayerStore::HostBytes LayerStore::host_bytes(const std::vector<LayerDesc>& layers,
                                             kernels::FloatDType stream_dtype,
                                             kernels::FloatDType grad_dtype) {
  HostBytes b;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LayerLayout o = layout_of(layers[l], l, stream_dtype, grad_dtype);
    const std::array<Tier, 3> t = tiers_of(layers[l]);
    if (t[0] == Tier::kHost) b.weights += o.bytes[0];
    if (t[1] == Tier::kHost) b.weights += o.bytes[1];
    if (t[2] == Tier::kHost && !layers[l].optimizer_elsewhere) {
      b.optimizer += o.bytes[2];
      b.masters += o.opt_elems * sizeof(float);
    }
    if (layers[l].grads == Tier::kHost) b.gradients += o.grad;
  }
  return b;
}

Tier LayerStore::tier(std::size_t layer, unsigned part) const {
  return tiers_.at(layer)[part_index(part)];
}

const TensorState& LayerStore::tensor(std::size_t layer, const std::string& name) const {
  if (layer >= layers_.size())
    throw Error("layer " + std::to_string(layer) + " does not exist (" +
                std::to_string(layers_.size()) + " layers)");
  for (const TensorState& t : layers_[layer])
    if (t.name == name) return t;
  throw Error("layer " + std::to_string(layer) + " has no tensor '" + name + "'");
}

// ---- access to NVMe-resident state ----

LayerAccess::LayerAccess(LayerAccess&& other) noexcept {
  *this = std::move(other);
}

LayerAccess& LayerAccess::operator=(LayerAccess&& other) noexcept {
  if (this != &other) {
    finish();
    store_ = std::exchange(other.store_, nullptr);
    layer_ = other.layer_;
    chunk_ = other.chunk_;
    write_ = other.write_;
    tensors_ = std::move(other.tensors_);
    pieces_ = std::move(other.pieces_);
    base_ = other.base_;
    stream_ = other.stream_;
    for (int p = 0; p < 3; ++p)
      staged_[p] = std::move(other.staged_[p]);
    grads_ = std::move(other.grads_);
  }
  return *this;
}

LayerAccess::~LayerAccess() {
  finish();
}

void LayerAccess::finish() noexcept {
  if (store_ && write_ && (staged_[0] || staged_[1] || staged_[2])) store_->write_back(*this);
  pieces_.clear();
  store_ = nullptr;
  for (HostBuffer& b : staged_)
    b.reset();
  grads_.reset();
}

std::vector<TensorState> LayerStore::chunk_views(std::size_t layer, std::size_t chunk,
                                                 std::uint8_t* record) const {
  const std::vector<OptimizerPiece>& pieces = chunks_[layer][chunk];
  const RecordLayout rl = record_layout(pieces, moments_[layer]);
  std::vector<TensorState> views;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const OptimizerPiece& p = pieces[i];
    const TensorState& t = layers_[layer][p.tensor];
    TensorState v;
    v.name = t.name;
    v.numel = p.numel;
    v.trainable = true;
    if (record) {
      bind_optimizer(v, record, moments_[layer], rl.elems, rl.blocks, rl.off[i], rl.block_off[i]);
    } else {  // in place in the host arena
      const std::size_t b = p.begin / kernels::kAdamW8bitBlock;
      v.master = t.master + p.begin;
      if (t.m) {
        v.m = t.m + p.begin;
        v.v = t.v + p.begin;
      } else {
        v.m_codes = t.m_codes + p.begin;
        v.v_codes = t.v_codes + p.begin;
        v.m_absmax = t.m_absmax + b;
        v.v_absmax = t.v_absmax + b;
      }
    }
    views.push_back(std::move(v));
  }
  return views;
}

std::vector<std::pair<std::size_t, std::size_t>> LayerStore::tensor_pieces(
    std::size_t layer, std::size_t index) const {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  const auto& chunks = chunks_.at(layer);
  for (std::size_t k = 0; k < chunks.size(); ++k)
    for (std::size_t p = 0; p < chunks[k].size(); ++p)
      if (chunks[k][p].tensor == index) out.emplace_back(k, p);
  return out;
}

// Note [Weight pieces]
// The loaders read a layer's NVMe-resident streaming copies in pieces of piece_bytes() (the
// optimizer chunk size on the drive's blocks), each into staging of its own that goes back as
// soon as its upload has landed, so that a window of reads ahead of the uploads holds pieces, not
// layers: an untied embedding or LM head of a large vocabulary no longer stages whole. A piece is
// a block-aligned range of the part's region (the part was written whole, so its blocks are read
// as written). The optimizer rewrites the trained part in pieces too (PieceWriter), so that
// neither staging nor a write-back ever holds a whole part: a piece read takes the buffer of that
// piece's write while it is in flight, a piece write drops its piece read ahead (it held the old
// data), and writes to the same bytes never overlap in flight (a drive may reorder them). A whole
// part's access waits for its piece writes, and a whole part's write-back drops every piece read
// ahead of it.
std::uint64_t LayerStore::piece_bytes_for(std::uint64_t chunk_bytes, std::uint64_t block_bytes) {
  return std::max(block_bytes, chunk_bytes / block_bytes * block_bytes);
}

std::size_t LayerStore::pieces(std::size_t layer, unsigned part) const {
  RONDO_ASSERT(layer < layers_.size() && (part == kBasePart || part == kStreamPart));
  const Region& region = regions_->region[layer][part_index(part)];
  if (tiers_[layer][part_index(part)] != Tier::kNvme || region.bytes == 0) return 0;
  return (region.bytes + piece_bytes_ - 1) / piece_bytes_;
}

HostBuffer LayerStore::read_piece(std::size_t layer, unsigned part, std::size_t index) {
  RONDO_ASSERT(index < pieces(layer, part));
  rethrow_write_error();
  Regions& r = *regions_;
  const Region& region = r.region[layer][part_index(part)];
  const std::uint64_t offset = index * piece_bytes_;
  return r.read_piece(nvme_, arena_, {layer, part, 0}, {layer, part, index + 1}, region, offset,
                      std::min(piece_bytes_, region.bytes - offset));
}

void LayerStore::prefetch_piece(std::size_t layer, unsigned part, std::size_t index) {
  RONDO_ASSERT(index < pieces(layer, part));
  Regions& r = *regions_;
  const Region& region = r.region[layer][part_index(part)];
  const std::uint64_t offset = index * piece_bytes_;
  r.prefetch_piece(nvme_, arena_, {layer, part, 0}, {layer, part, index + 1}, region, offset,
                   std::min(piece_bytes_, region.bytes - offset));
}

std::uint64_t LayerStore::piece_size(std::size_t layer, unsigned part, std::size_t index) const {
  RONDO_ASSERT(index < pieces(layer, part));
  const Region& region = regions_->region[layer][part_index(part)];
  return std::min(piece_bytes_, region.bytes - index * piece_bytes_);
}

HostBuffer LayerStore::piece_buffer(std::size_t layer, unsigned part, std::size_t index) {
  return arena_.allocate(piece_size(layer, part, index), Purpose::kStaging);
}

void LayerStore::write_piece(std::size_t layer, unsigned part, std::size_t index, HostBuffer data) {
  RONDO_ASSERT(index < pieces(layer, part));
  rethrow_write_error();
  Regions& r = *regions_;
  const Region& region = r.region[layer][part_index(part)];
  const std::uint64_t offset = index * piece_bytes_;
  const std::uint64_t bytes = std::min(piece_bytes_, region.bytes - offset);
  RONDO_ASSERT(data.bytes() >= bytes);
  std::vector<std::pair<Regions::Key, Regions::Io>> evicted;
  // Writes to the same bytes still in flight — this piece's of an earlier step, the whole part's
  // — end first: the drive may reorder writes in flight.
  {
    std::unique_lock<std::mutex> lock(r.mutex);
    r.settle(lock, {layer, part, 0});
    r.settle(lock, {layer, part, index + 1});
    r.take_write({layer, part, 0}, evicted);
    r.take_write({layer, part, index + 1}, evicted);
  }
  if (std::exception_ptr e = r.complete(nvme_, evicted)) std::rethrow_exception(e);
  evicted.clear();
  r.submit_write(nvme_, {layer, part, index + 1}, region, std::move(data), evicted, offset, bytes);
  if (std::exception_ptr e = r.complete(nvme_, evicted)) std::rethrow_exception(e);
}

void LayerStore::rethrow_write_error() {
  Regions& r = *regions_;
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.write_error) std::rethrow_exception(std::exchange(r.write_error, nullptr));
}

LayerAccess LayerStore::access(std::size_t layer, unsigned parts, AccessMode mode) {
  RONDO_ASSERT(layer < layers_.size());
  Regions& r = *regions_;
  rethrow_write_error();
  LayerAccess a;
  a.store_ = this;
  a.layer_ = layer;
  a.write_ = mode != AccessMode::kRead;
  a.tensors_ = layers_[layer];
  a.base_ = base_ranges_[layer];
  a.stream_ = stream_ranges_[layer];
  if ((parts & kOptimizerPart) && elsewhere_[layer] && !chunks_[layer].empty())
    throw Error("layer " + std::to_string(layer) +
                "'s optimizer state is held by another rank (sharded): this store has none");
  for (unsigned part : kParts) {
    const int p = part_index(part);
    if (!(parts & part) || tiers_[layer][p] != Tier::kNvme) continue;
    if (part == kOptimizerPart) {
      const std::size_t chunks = chunks_[layer].size();
      if (chunks == 0) continue;
      // The layer's layout gathered from its chunk records, the next record read ahead.
      a.staged_[p] =
          arena_.allocate(optimizer_bytes(opt_elems_[layer], opt_blocks_[layer], moments_[layer]),
                          Purpose::kStaging);
      auto* base = a.staged_[p].as<std::uint8_t>();
      std::size_t off = 0, block_off = 0;
      for (TensorState& t : a.tensors_) {
        if (t.tied || !t.trainable) continue;
        bind_optimizer(t, base, moments_[layer], opt_elems_[layer], opt_blocks_[layer], off,
                       block_off);
        off += align_up(t.numel * 4) / 4;
        block_off += align_up(kernels::adamw8bit_blocks(t.numel) * 4) / 4;
      }
      if (mode == AccessMode::kOverwrite) continue;  // fresh pages: zeros
      for (std::size_t k = 0; k < chunks; ++k) {
        if (k + 1 < chunks) prefetch_chunk(layer, k + 1);
        const HostBuffer record =
            r.stage(nvme_, arena_, {layer, part, k}, r.chunk[layer][k], AccessMode::kRead);
        const std::vector<TensorState> views = chunk_views(layer, k, record.as<std::uint8_t>());
        for (std::size_t i = 0; i < views.size(); ++i) {
          const OptimizerPiece& piece = chunks_[layer][k][i];
          copy_piece(a.tensors_[piece.tensor], views[i], piece.begin, /*into_piece=*/false);
        }
      }
      continue;
    }
    const Region region = r.region[layer][p];
    if (region.bytes == 0) continue;
    a.staged_[p] = r.stage(nvme_, arena_, {layer, part, 0}, region, mode);
    auto* base = a.staged_[p].as<std::uint8_t>();
    (part == kBasePart ? a.base_ : a.stream_).data = base;
    for (TensorState& t : a.tensors_)
      if (!t.tied && stream_part(t) == part) t.stream = base + t.stream_offset;
  }
  return a;
}

LayerAccess LayerStore::access_chunk(std::size_t layer, std::size_t chunk, AccessMode mode,
                                     bool with_grads) {
  RONDO_ASSERT(layer < layers_.size() && chunk < chunks_[layer].size());
  rethrow_write_error();
  LayerAccess a;
  a.store_ = this;
  a.layer_ = layer;
  a.chunk_ = chunk;
  a.write_ = mode != AccessMode::kRead;
  a.pieces_ = chunks_[layer][chunk];
  std::uint8_t* record = nullptr;
  if (elsewhere_[layer]) {
    if (mode != AccessMode::kRead || with_grads || !fetch_)
      throw Error("layer " + std::to_string(layer) +
                  "'s optimizer state is held by another rank (sharded): this store can only "
                  "read it, through that rank");
    a.write_ = false;
    a.staged_[2] = arena_.allocate(chunk_bytes(layer, chunk), Purpose::kStaging);
    record = a.staged_[2].as<std::uint8_t>();
    fetch_(layer, chunk, record);
  } else if (tiers_[layer][2] == Tier::kNvme) {
    Regions& r = *regions_;
    a.staged_[2] =
        r.stage(nvme_, arena_, {layer, kOptimizerPart, chunk}, r.chunk[layer][chunk], mode);
    record = a.staged_[2].as<std::uint8_t>();
  }
  a.tensors_ = chunk_views(layer, chunk, record);
  // The pieces' gradients: in place in host memory, or the chunk's record read from NVMe.
  if (!with_grads) return a;
  const std::size_t gs = kernels::dtype_size(grad_dtype_);
  std::uint8_t* grads = nullptr;
  if (grad_tiers_[layer] == Tier::kNvme) {
    Regions& r = *regions_;
    a.grads_ = r.stage(nvme_, arena_, {layer, kGradPart, chunk}, r.grad_chunk[layer][chunk],
                       AccessMode::kRead);
    grads = a.grads_.as<std::uint8_t>();
  }
  for (std::size_t i = 0; i < a.tensors_.size(); ++i) {
    const OptimizerPiece& p = a.pieces_[i];
    if (grads) {
      a.tensors_[i].grad = grads;
      grads += p.numel * gs;
    } else if (void* g = layers_[layer][p.tensor].grad) {
      a.tensors_[i].grad = static_cast<std::uint8_t*>(g) + p.begin * gs;
    }
  }
  return a;
}

HostBuffer LayerStore::pack_chunk(std::size_t layer, std::size_t chunk) {
  RONDO_ASSERT(layer < layers_.size() && chunk < chunks_[layer].size() && !elsewhere_[layer]);
  HostBuffer record = arena_.allocate(chunk_bytes(layer, chunk), Purpose::kStaging);
  const LayerAccess from = access_chunk(layer, chunk, AccessMode::kRead);
  const std::vector<TensorState> to = chunk_views(layer, chunk, record.as<std::uint8_t>());
  for (std::size_t i = 0; i < to.size(); ++i)
    copy_piece(from[i], to[i], 0, /*into_piece=*/true);
  return record;
}

std::uint64_t LayerStore::grad_record_bytes(std::size_t layer, std::size_t chunk) const {
  std::uint64_t bytes = 0;
  for (const OptimizerPiece& p : chunks_.at(layer).at(chunk))
    bytes += p.numel * kernels::dtype_size(grad_dtype_);
  return bytes;
}

HostBuffer LayerStore::grad_record(std::size_t layer, std::size_t chunk) {
  RONDO_ASSERT(grad_tiers_.at(layer) == Tier::kNvme);
  return arena_.allocate(regions_->grad_chunk[layer].at(chunk).bytes, Purpose::kStaging);
}

void LayerStore::write_grad_record(std::size_t layer, std::size_t chunk, HostBuffer record) {
  RONDO_ASSERT(grad_tiers_.at(layer) == Tier::kNvme);
  rethrow_write_error();
  Regions& r = *regions_;
  const Region& region = r.grad_chunk[layer].at(chunk);
  RONDO_ASSERT(record.bytes() >= region.bytes);
  std::vector<std::pair<Regions::Key, Regions::Io>> evicted;
  // The record's last write (a step ago) ends first: the drive may reorder writes in flight.
  {
    std::unique_lock<std::mutex> lock(r.mutex);
    r.settle(lock, {layer, kGradPart, chunk});
    r.take_write({layer, kGradPart, chunk}, evicted);
  }
  if (std::exception_ptr e = r.complete(nvme_, evicted)) std::rethrow_exception(e);
  evicted.clear();
  r.submit_write(nvme_, {layer, kGradPart, chunk}, region, std::move(record), evicted);
  if (std::exception_ptr e = r.complete(nvme_, evicted)) std::rethrow_exception(e);
}

void LayerStore::prefetch_chunk(std::size_t layer, std::size_t chunk, bool grads) {
  RONDO_ASSERT(layer < layers_.size() && chunk < chunks_[layer].size());
  Regions& r = *regions_;
  if (tiers_[layer][2] == Tier::kNvme)
    r.prefetch(nvme_, arena_, {layer, kOptimizerPart, chunk}, r.chunk[layer][chunk]);
  if (grads && grad_tiers_[layer] == Tier::kNvme)
    r.prefetch(nvme_, arena_, {layer, kGradPart, chunk}, r.grad_chunk[layer][chunk]);
}

void LayerStore::prefetch(std::size_t layer, unsigned parts) {
  RONDO_ASSERT(layer < layers_.size());
  Regions& r = *regions_;
  for (unsigned part : kParts) {
    const int p = part_index(part);
    if (!(parts & part) || tiers_[layer][p] != Tier::kNvme) continue;
    if (part == kOptimizerPart) {
      if (!chunks_[layer].empty()) prefetch_chunk(layer, 0);
      continue;
    }
    const Region region = r.region[layer][p];
    if (region.bytes != 0) r.prefetch(nvme_, arena_, {layer, part, 0}, region);
  }
}

void LayerStore::write_back(LayerAccess& a) noexcept {
  Regions& r = *regions_;
  std::vector<std::pair<Regions::Key, Regions::Io>> evicted;  // waited for outside the lock
  std::exception_ptr error;
  // Each submit may evict older write-backs; they are waited for as we go, so that staging stays
  // bounded while a whole optimizer part is scattered into its records.
  auto complete_evicted = [&] {
    if (std::exception_ptr e = r.complete(nvme_, evicted); e && !error) error = e;
    evicted.clear();
  };
  try {
    for (unsigned part : kParts) {
      const int p = part_index(part);
      HostBuffer& buf = a.staged_[p];
      if (!buf) continue;
      if (part != kOptimizerPart) {
        r.submit_write(nvme_, {a.layer_, part, 0}, r.region[a.layer_][p], std::move(buf), evicted);
      } else if (a.chunk_ != SIZE_MAX) {
        r.submit_write(nvme_, {a.layer_, part, a.chunk_}, r.chunk[a.layer_][a.chunk_],
                       std::move(buf), evicted);
      } else {  // a layer access: scattered back into the chunk records
        for (std::size_t k = 0; k < chunks_[a.layer_].size(); ++k) {
          HostBuffer record = arena_.allocate(r.chunk[a.layer_][k].bytes, Purpose::kStaging);
          const std::vector<TensorState> views =
              chunk_views(a.layer_, k, record.as<std::uint8_t>());
          for (std::size_t i = 0; i < views.size(); ++i) {
            const OptimizerPiece& piece = chunks_[a.layer_][k][i];
            copy_piece(a.tensors_[piece.tensor], views[i], piece.begin, /*into_piece=*/true);
          }
          r.submit_write(nvme_, {a.layer_, part, k}, r.chunk[a.layer_][k], std::move(record),
                         evicted);
          complete_evicted();
        }
        buf.reset();
      }
      complete_evicted();
    }
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  complete_evicted();
  if (error) {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!r.write_error) r.write_error = error;
  }
}

void LayerStore::flush() {
  Regions& r = *regions_;
  std::vector<std::pair<Regions::Key, Regions::Io>> ios;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& [key, io] : r.writes) {
      ios.emplace_back(key, std::move(io));
      r.completing.insert(key);
    }
    for (auto& [key, io] : r.reads) {  // prefetches nobody took: finish them before freeing
      ios.emplace_back(key, std::move(io));
      r.completing.insert(key);
    }
    r.writes.clear();
    r.reads.clear();
    r.write_order.clear();
  }
  std::exception_ptr error = r.complete(nvme_, ios);
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!error) error = std::exchange(r.write_error, nullptr);
  if (error) std::rethrow_exception(error);
}

PieceWriter::PieceWriter(LayerStore& store, std::size_t layer, unsigned part)
    : store_(store), layer_(layer), part_(part), pieces_(store.pieces(layer, part)) {}

void PieceWriter::put(std::size_t offset, const void* data, std::size_t bytes) {
  RONDO_ASSERT_MSG(offset >= end_, "PieceWriter::put: offsets must grow");
  end_ = offset + bytes;
  const auto* src = static_cast<const std::uint8_t*>(data);
  const std::size_t P = store_.piece_bytes();
  while (bytes > 0) {
    const std::size_t index = offset / P;
    advance_to(index);
    const std::size_t in = offset - index * P, n = std::min(bytes, buf_.bytes() - in);
    std::memcpy(buf_.as<std::uint8_t>() + in, src, n);
    offset += n;
    src += n;
    bytes -= n;
  }
}

void PieceWriter::finish() {
  advance_to(pieces_);
}

void PieceWriter::advance_to(std::size_t index) {
  for (; next_ < index; ++next_) {
    if (!open_) buf_ = store_.piece_buffer(layer_, part_, next_);  // nothing put: zeros
    open_ = false;
    store_.write_piece(layer_, part_, next_, std::move(buf_));
  }
  if (index < pieces_ && !open_) {
    buf_ = store_.piece_buffer(layer_, part_, index);
    open_ = true;
  }
}

}  // namespace rondo::offload
