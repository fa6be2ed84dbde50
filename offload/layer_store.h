// The model's state at rest, layer by layer (docs/architecture.md §5): for every tensor the
// streaming copy the devices upload, and for trainable tensors the fp32 master weights, the AdamW
// moments m and v, and a buffer for the gradient as the devices download it. Flat arenas with
// named views, so that uploads, checkpoints and NVMe offload are byte ranges:
//  - two streaming regions per layer (its tensors back to back, each 64-byte aligned): the frozen
//    tensors' (the base of a LoRA run: written once, at load) and the trained tensors' (written by
//    every optimizer step); a stage's weights upload as two copies per layer at most. A frozen
//    tensor may be kept quantised (GGUF blocks, NF4, INT8: kernels/quant.h) and is dequantised
//    on the device;
//  - one gradient region per layer, laid out like its trainable tensors, in host memory, or on the
//    NVMe tier as a record per optimizer chunk (LayerDesc::grads; Note [Gradients on NVMe] in
//    transfer.cpp);
//  - master, m and v per layer, each contiguous: m and v in f32, or (MomentFormat::kBlockwise8)
//    as bitsandbytes' blockwise 8-bit codes with an f32 absmax per block of 256 elements of a
//    tensor (kernels/cpu/adamw8bit.h).
// Each of a layer's three parts — frozen streaming copies, trained streaming copies, optimizer
// state (master, m, v) — lives in host memory or on the NVMe tier (an NvmeStore), as the planner
// placed it (Tier). State on NVMe is reached only through access(): it is read into host staging
// memory and written back when the access ends.
// Optimizer state moves in chunks (Note [Optimizer chunks] in layer_store.cpp): a layer's trained
// tensors are cut into pieces of at most chunk_bytes of masters and moments together, and on NVMe
// each chunk is a record of its own, so that the optimizer stages one chunk (access_chunk), not a
// whole layer — an embedding of a large vocabulary included. The loaders read NVMe-resident
// weights in pieces of about the same size (read_piece, Note [Weight pieces]).
// A tied tensor (the LM head that is the embedding) is stored once, by its owner; the tying layer
// views the owner's streaming copy and master, but gets a gradient buffer of its own (each layer's
// job downloads its own gradient; the optimizer adds them). Layers with ties stay in host memory.
//
//   offload::LayerStore store(arena, layers, kernels::FloatDType::kBF16,
//                             kernels::FloatDType::kF32);
//   {
//     offload::LayerAccess a = store.access(3, offload::kBasePart,
//                                           offload::AccessMode::kOverwrite);
//     std::memcpy(a[0].stream, bf16_bits, a[0].numel * 2);
//   }  // written back here when layer 3's weights live on NVMe
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cpu/simd.h"
#include "kernels/quant.h"
#include "offload/host_arena.h"

namespace rondo::offload {

class NvmeStore;

enum class Tier { kHost, kNvme };
const char* to_string(Tier tier);  // "host", "nvme"

struct TensorDesc {
  std::string name;
  std::int64_t numel = 0;
  bool trainable = false;
  int tied_to_layer = -1;  // >= 0: the same tensor as `name` in that (earlier) layer
  // Frozen tensors only: kept (host, NVMe, wire) in this format and dequantised on the device to
  // the streaming dtype; kNone = the streaming dtype. rows * cols = numel.
  kernels::QuantFormat quant;
  std::int64_t rows = 0, cols = 0;
};

// How the AdamW moments m and v of a layer's trainable tensors are kept.
enum class MomentFormat {
  kF32,         // f32: 8 bytes per parameter (kernels::adamw_step)
  kBlockwise8,  // 8-bit codes plus an f32 absmax per 256: 2.03 bytes (kernels::adamw8bit_step)
};
const char* to_string(MomentFormat format);  // "f32", "8-bit"

struct LayerDesc {
  std::vector<TensorDesc> tensors;
  Tier base = Tier::kHost;       // streaming copies of the frozen tensors
  Tier weights = Tier::kHost;    // streaming copies of the trainable tensors
  Tier optimizer = Tier::kHost;  // masters and moments of its trainable tensors
  // Gradients of its trainable tensors: in host memory, or on NVMe as a record per optimizer
  // chunk, written as they come down and read once by the optimizer (Note [Gradients on NVMe]).
  Tier grads = Tier::kHost;
  MomentFormat moments = MomentFormat::kF32;
  // Data parallel with sharded optimizer state (docs/distributed.md): another rank owns this
  // layer's masters and moments, so this store holds none (`optimizer` is ignored); its trained
  // streaming copies and gradients are here as usual. Its chunks still describe the layout, so
  // that access_chunk can read another rank's chunk through the store's ChunkFetch.
  bool optimizer_elsewhere = false;
};

struct TensorState {
  std::string name;
  std::size_t numel = 0;
  bool trainable = false;
  bool tied = false;     // viewing another layer's streaming copy and master
  int owner_layer = -1;  // tied: the layer and index of the tensor it views
  int owner_index = -1;
  std::size_t stream_offset = 0;  // owned: offset of its streaming copy in its part's region
  std::size_t stream_bytes = 0;   // owned: bytes of the streaming copy as stored
  kernels::QuantFormat quant;     // kNone: stored in the streaming dtype
  std::int64_t rows = 0, cols = 0;
  // Host pointers; null where the state lives on NVMe (use LayerStore::access).
  void* stream = nullptr;       // (stream_bytes) streaming dtype, or the quantised blob
  void* grad = nullptr;         // (numel) gradient dtype, trainable only: what devices download
  std::size_t grad_offset = 0;  // trainable: offset of its gradient in the layer's gradient layout
  float* master = nullptr;      // (numel) f32, trainable only
  // The AdamW moments, trainable only: f32 (m, v), or 8-bit (the codes, numel each, and their
  // absmax, kernels::adamw8bit_blocks(numel) each), as the layer's MomentFormat says; the other
  // pointers are null.
  float* m = nullptr;  // (numel) f32 first moment
  float* v = nullptr;  // (numel) f32 second moment
  std::uint8_t* m_codes = nullptr;
  std::uint8_t* v_codes = nullptr;
  float* m_absmax = nullptr;
  float* v_absmax = nullptr;
};

struct ByteRange {
  std::uint8_t* data = nullptr;
  std::size_t bytes = 0;
};

// Elements [begin, begin + numel) of trainable tensor `tensor` (an index in the layer) in one
// optimizer chunk; begin is a multiple of kChunkGrain.
struct OptimizerPiece {
  std::size_t tensor = 0;
  std::size_t begin = 0, numel = 0;
};
// Chunks cut tensors at multiples of this many elements: the 8-bit moments' block
// (kernels::kAdamW8bitBlock), so that a block's absmax belongs to one chunk.
inline constexpr std::size_t kChunkGrain = 256;
// hardware.offload_chunk's default: RoundPipe's and ZeRO-Infinity's order of size.
inline constexpr std::uint64_t kDefaultChunkBytes = 256ull << 20;

// Parts of a layer's state, for access() and prefetch(): the frozen tensors' streaming copies,
// the trainable tensors' streaming copies, their masters and moments.
inline constexpr unsigned kBasePart = 1, kStreamPart = 2, kOptimizerPart = 4;
inline constexpr unsigned kAllParts = kBasePart | kStreamPart | kOptimizerPart;
// Gradients are not a part access() opens: on NVMe they are chunk records (grad_record).
inline constexpr unsigned kGradPart = 8;
// The part of a tensor's streaming copy.
inline unsigned stream_part(const TensorState& t) {
  return t.trainable ? kStreamPart : kBasePart;
}

enum class AccessMode {
  kRead,       // look only
  kReadWrite,  // change in place: NVMe parts are read, then written back
  kOverwrite,  // NVMe parts start as zeros (not read) and are written back: for loading
};

class LayerStore;

// Host views of one layer's state for as long as it lives (move-only). For parts on NVMe it owns
// staging buffers holding them; ending an access opened for writing writes them back (the write
// completes in the background; a later access of the same part waits for it, and its errors are
// thrown there or by LayerStore::flush()).
class LayerAccess {
 public:
  LayerAccess() = default;
  LayerAccess(LayerAccess&& other) noexcept;
  LayerAccess& operator=(LayerAccess&& other) noexcept;
  LayerAccess(const LayerAccess&) = delete;
  LayerAccess& operator=(const LayerAccess&) = delete;
  ~LayerAccess();

  std::size_t size() const { return tensors_.size(); }
  // A layer access: the layer's tensors. A chunk access (LayerStore::access_chunk): the chunk's
  // pieces, each a TensorState whose numel, master, moments and gradient are the piece's own
  // (the name and flags the tensor's; stream null), piece(i) saying where it lies.
  const TensorState& operator[](std::size_t i) const { return tensors_.at(i); }
  const OptimizerPiece& piece(std::size_t i) const { return pieces_.at(i); }
  const std::vector<TensorState>& tensors() const { return tensors_; }
  // One of the layer's streaming regions (kBasePart or kStreamPart) in host memory (staged when
  // on NVMe); needs that part opened.
  ByteRange stream_bytes(unsigned part) const { return part == kBasePart ? base_ : stream_; }

 private:
  friend class LayerStore;
  void finish() noexcept;
  LayerStore* store_ = nullptr;
  std::size_t layer_ = 0;
  std::size_t chunk_ = SIZE_MAX;  // SIZE_MAX: a layer access
  bool write_ = false;
  std::vector<TensorState> tensors_;
  std::vector<OptimizerPiece> pieces_;
  ByteRange base_, stream_;
  HostBuffer staged_[3];  // NVMe parts, by part index (base, stream, optimizer)
  HostBuffer grads_;      // a chunk's gradient record read from NVMe (never written back)
};

class LayerStore {
 public:
  // Allocates the host-resident state from `arena` (weights, gradients, optimizer state, all
  // zero-filled) and reserves the NVMe-resident state in `nvme` (needed when any layer has a part
  // on Tier::kNvme; size it with nvme_bytes()). Throws Error for inconsistent descriptions (a tie
  // to a later layer or to a missing tensor, a trainable quantised tensor, NVMe without a store,
  // a layer with ties on NVMe, ...).
  // `chunk_bytes`: the most bytes of masters and moments in one optimizer chunk.
  LayerStore(HostArena& arena, const std::vector<LayerDesc>& layers,
             kernels::FloatDType stream_dtype, kernels::FloatDType grad_dtype,
             NvmeStore* nvme = nullptr, std::uint64_t chunk_bytes = kDefaultChunkBytes);
  ~LayerStore();
  LayerStore(const LayerStore&) = delete;
  LayerStore& operator=(const LayerStore&) = delete;

  // Bytes the NVMe tier must hold for these layers (each region rounded up to 4 KiB).
  static std::uint64_t nvme_bytes(const std::vector<LayerDesc>& layers,
                                  kernels::FloatDType stream_dtype,
                                  std::uint64_t chunk_bytes = kDefaultChunkBytes);
  // A layer's optimizer chunks: each a list of pieces of its trainable untied tensors, in order,
  // of at most chunk_bytes of masters and moments (one piece of kChunkGrain elements at least).
  static std::vector<std::vector<OptimizerPiece>> chunks_of(const LayerDesc& layer,
                                                            std::uint64_t chunk_bytes);
  // Bytes of one chunk's record (its masters and moments, as staged).
  static std::uint64_t chunk_record_bytes(const std::vector<OptimizerPiece>& chunk,
                                          MomentFormat format);
  // Bytes of each part of layer `layer` (frozen weights, trained weights, optimizer state) as
  // stored, wherever they live.
  static std::array<std::uint64_t, 3> part_bytes(const std::vector<LayerDesc>& layers,
                                                 std::size_t layer,
                                                 kernels::FloatDType stream_dtype);
  // Bytes of host memory by purpose the store allocates (for the planner and its tests).
  struct HostBytes {
    std::uint64_t weights = 0, gradients = 0, optimizer = 0;
    std::uint64_t masters = 0;  // of `optimizer`, the f32 masters (the rest: the moments)
  };
  static HostBytes host_bytes(const std::vector<LayerDesc>& layers,
                              kernels::FloatDType stream_dtype, kernels::FloatDType grad_dtype);

  std::size_t layers() const { return layers_.size(); }
  // The layer's tensors; the pointers of NVMe-resident parts are null.
  const std::vector<TensorState>& layer(std::size_t i) const { return layers_.at(i); }
  // Throws Error naming the layer and tensor when absent.
  const TensorState& tensor(std::size_t layer, const std::string& name) const;

  // Where a part of a layer lives (a layer whose optimizer state is elsewhere: kHost, holding
  // none).
  Tier tier(std::size_t layer, unsigned part) const;
  // Whether this store holds the layer's masters and moments (LayerDesc::optimizer_elsewhere).
  bool holds_optimizer(std::size_t layer) const { return !elsewhere_.at(layer); }
  // Sharded optimizer state: how access_chunk(kRead) reads a chunk of a layer this store does not
  // hold — fills `record` (chunk_record_bytes of the chunk) with the chunk's record as pack_chunk
  // made it on the rank that holds it. Unset: such an access throws Error.
  using ChunkFetch =
      std::function<void(std::size_t layer, std::size_t chunk, std::uint8_t* record)>;
  void set_chunk_fetch(ChunkFetch fetch) { fetch_ = std::move(fetch); }
  // A chunk this store holds as a record (its pieces' masters and moments, laid out as on the
  // NVMe tier) in fresh staging memory: what another rank's ChunkFetch receives.
  HostBuffer pack_chunk(std::size_t layer, std::size_t chunk);
  // Bytes of a chunk's record (pack_chunk's, ChunkFetch's).
  std::uint64_t chunk_bytes(std::size_t layer, std::size_t chunk) const {
    return chunk_record_bytes(chunks_.at(layer).at(chunk), moments_.at(layer));
  }
  // How the layer's AdamW moments are kept.
  MomentFormat moments(std::size_t layer) const { return moments_.at(layer); }
  // The layer's streaming copies of one part (kBasePart or kStreamPart) as stored (tied ones
  // excluded: their owner uploads them); data is null when they live on NVMe. And its gradients
  // (data null where they live on NVMe; bytes: the layer's gradient layout either way).
  ByteRange stream_bytes(std::size_t layer, unsigned part) const {
    return part == kBasePart ? base_ranges_.at(layer) : stream_ranges_.at(layer);
  }
  ByteRange grad_bytes(std::size_t layer) const { return grad_ranges_.at(layer); }
  Tier grad_tier(std::size_t layer) const { return grad_tiers_.at(layer); }
  // Bytes of the layer's streaming copies once on a device: dequantised ones in the streaming
  // dtype (their quantised blobs come on top while the upload lands).
  std::size_t device_bytes(std::size_t layer) const { return device_bytes_.at(layer); }

  // Host views of `parts` (kBasePart | kStreamPart | kOptimizerPart) of a layer, wherever they
  // live. For NVMe parts this reads them (or takes a prefetched read) — blocking — unless `mode`
  // overwrites them, and writes them back when the access ends unless `mode` only reads. Every NVMe
  // part must be overwritten once (loading) before it is read. Throws offload::IoError (named file,
  // offset, what to do) on an I/O failure — also one of an earlier write-back —, HostOutOfMemory
  // when staging would pass the host budget.
  LayerAccess access(std::size_t layer, unsigned parts, AccessMode mode);
  // Starts reading the NVMe-resident `parts` of a layer into staging memory so that a later
  // access() finds them there. No-op for host-resident parts or when already prefetched. For the
  // optimizer part, only its first chunk is read ahead.
  void prefetch(std::size_t layer, unsigned parts);

  // The layer's optimizer chunks (none without trained tensors) and their pieces.
  std::size_t optimizer_chunks(std::size_t layer) const { return chunks_.at(layer).size(); }
  const std::vector<OptimizerPiece>& optimizer_chunk(std::size_t layer, std::size_t chunk) const {
    return chunks_.at(layer).at(chunk);
  }
  // Host views of one optimizer chunk's masters and moments (see LayerAccess), as access() for
  // the optimizer part: in place where the layer's optimizer state is in host memory, else staged
  // (only this chunk) and written back when the access ends unless `mode` only reads.
  // With `grads`, the pieces' gradients too (the optimizer's update): in place, or the chunk's
  // gradient record read from NVMe (it must have been written: grad_record).
  LayerAccess access_chunk(std::size_t layer, std::size_t chunk, AccessMode mode,
                           bool grads = false);
  // Starts reading an NVMe-resident chunk (with `grads`, its gradient record too) ahead of its
  // access_chunk(); no-op otherwise.
  void prefetch_chunk(std::size_t layer, std::size_t chunk, bool grads = false);
  // Where tensor `index` of the layer lies in its chunks: (chunk, piece) pairs in element order.
  std::vector<std::pair<std::size_t, std::size_t>> tensor_pieces(std::size_t layer,
                                                                 std::size_t index) const;
  // The NVMe-resident streaming parts read in pieces (Note [Weight pieces] in layer_store.cpp):
  // each part is cut into pieces of piece_bytes() (the last one shorter), which the loaders read
  // one at a time into staging of their own (offload::Transfers). Pieces of a part not on NVMe:
  // none.
  std::size_t pieces(std::size_t layer, unsigned part) const;
  std::uint64_t piece_bytes() const { return piece_bytes_; }
  // Bytes of piece `index` of the part (piece_bytes(), or fewer for the last).
  std::uint64_t piece_size(std::size_t layer, unsigned part, std::size_t index) const;
  // Piece bytes for a store of this chunk size on an NVMe store of these blocks: the chunk
  // size on the blocks (one block at least).
  static std::uint64_t piece_bytes_for(std::uint64_t chunk_bytes, std::uint64_t block_bytes);
  // Piece `index` of the part: its bytes (piece_bytes() or fewer) read into a fresh staging
  // buffer (or taken from prefetch_piece()), blocking; offset index * piece_bytes() in the part's
  // region as stream_bytes() lays it out. A write-back of the whole part still in flight is
  // waited for first. Throws IoError on a failed read.
  HostBuffer read_piece(std::size_t layer, unsigned part, std::size_t index);
  // Starts reading a piece ahead of read_piece(); no-op when one is already under way or a
  // write-back of the part is in flight.
  void prefetch_piece(std::size_t layer, unsigned part, std::size_t index);
  // Loading a part in pieces: a zeroed staging buffer for piece `index`, and its write (in the
  // background, write-backs bounded as for access()). Every piece of the part is written once,
  // and flush() ends the load before anything reads the part.
  HostBuffer piece_buffer(std::size_t layer, unsigned part, std::size_t index);
  void write_piece(std::size_t layer, unsigned part, std::size_t index, HostBuffer data);
  // Host staging of `bytes` from the store's arena (counted as staging against the budget).
  HostBuffer piece_staging(std::size_t bytes) { return arena_.allocate(bytes, Purpose::kStaging); }
  // Gradients on NVMe (Note [Gradients on NVMe] in layer_store.cpp), one record per optimizer
  // chunk: its pieces' gradients back to back in the gradient dtype, grad_record_bytes() in all.
  // grad_record() is zeroed staging for one, write_grad_record() its write (in the background,
  // bounded like write-backs). access_chunk() reads the record for the chunk's views.
  std::uint64_t grad_record_bytes(std::size_t layer, std::size_t chunk) const;
  HostBuffer grad_record(std::size_t layer, std::size_t chunk);
  void write_grad_record(std::size_t layer, std::size_t chunk, HostBuffer record);
  // The largest chunk record of any layer (what one staged chunk takes).
  std::uint64_t max_chunk_bytes() const { return max_chunk_bytes_; }
  // Waits for every write-back; throws the first I/O error one met.
  void flush();

  kernels::FloatDType stream_dtype() const { return stream_dtype_; }
  kernels::FloatDType grad_dtype() const { return grad_dtype_; }
  NvmeStore* nvme() const { return nvme_; }

 private:
  friend class LayerAccess;
  struct Regions;  // NVMe regions and I/O in flight (layer_store.cpp)
  void write_back(LayerAccess& a) noexcept;
  void rethrow_write_error();  // the first failed write-back not yet reported
  // Host views of a chunk's pieces in a record at `record` (staged) or in the host arena (null).
  std::vector<TensorState> chunk_views(std::size_t layer, std::size_t chunk,
                                       std::uint8_t* record) const;

  HostArena& arena_;
  kernels::FloatDType stream_dtype_, grad_dtype_;
  NvmeStore* nvme_ = nullptr;
  std::vector<std::vector<TensorState>> layers_;
  std::vector<std::array<Tier, 3>> tiers_;  // per layer, by part index
  std::vector<Tier> grad_tiers_;            // per layer
  std::vector<ByteRange> base_ranges_, stream_ranges_, grad_ranges_;
  std::vector<std::size_t> device_bytes_;
  std::vector<std::size_t> opt_elems_;   // per layer: elements of each of master, m, v
  std::vector<std::size_t> opt_blocks_;  // per layer, 8-bit moments: absmax entries of each
  std::vector<MomentFormat> moments_;    // per layer
  std::vector<bool> elsewhere_;          // per layer: LayerDesc::optimizer_elsewhere
  ChunkFetch fetch_;
  std::vector<std::vector<std::vector<OptimizerPiece>>> chunks_;  // per layer, per chunk
  std::uint64_t max_chunk_bytes_ = 0;
  std::uint64_t piece_bytes_ = 0;
  HostBuffer weights_, gradients_, optimizer_;
  std::unique_ptr<Regions> regions_;
};

// Writing an NVMe-resident streaming part piece by piece (Note [Weight pieces] in
// layer_store.cpp): bytes put at increasing offsets of the part (as LayerStore::stream_bytes lays
// it out), each piece written as the writer moves past it, so that staging holds a piece, not the
// part. Loading writes the frozen and trained parts so, the optimizer the trained part.
//
//   offload::PieceWriter w(store, layer, offload::kStreamPart);
//   w.put(t.stream_offset, bytes, t.stream_bytes);  // tensor by tensor, in layout order
//   w.finish();                                      // the pieces left, zeros where nothing was
//   put
class PieceWriter {
 public:
  PieceWriter(LayerStore& store, std::size_t layer, unsigned part);
  // `bytes` at `offset` of the part; offsets only grow from call to call.
  void put(std::size_t offset, const void* data, std::size_t bytes);
  // Writes the pieces left (zeros where nothing was put).
  void finish();

 private:
  // Pieces before `index` written; buf_ holding piece `index` (when there is one).
  void advance_to(std::size_t index);
  LayerStore& store_;
  std::size_t layer_;
  unsigned part_;
  std::size_t pieces_, next_ = 0, end_ = 0;  // end_: where the last put ended
  HostBuffer buf_;
  bool open_ = false;  // buf_ holds piece next_
};

}  // namespace rondo::offload
