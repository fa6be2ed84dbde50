#include "engine/model_store.h"

#include <ATen/ATen.h>

#include <cstring>

#include "kernels/cpu/adamw8bit.h"
#include "kernels/error.h"
#include "kernels/quant.h"

namespace rondo::engine {

std::vector<offload::LayerDesc> layer_descs(
    const std::vector<models::LayerSpec>& specs,
    const std::function<bool(const models::ParamSpec&)>& trainable) {
  std::vector<offload::LayerDesc> out(specs.size());
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (const models::ParamSpec& p : specs[l].params) {
      offload::TensorDesc t{.name = p.name, .numel = p.numel()};
      if (p.tied) {
        for (std::size_t o = 0; o < l && t.tied_to_layer < 0; ++o)
          for (const models::ParamSpec& q : specs[o].params)
            if (q.name == p.name && !q.tied) {
              t.tied_to_layer = static_cast<int>(o);
              t.trainable = trainable(q);
            }
        if (t.tied_to_layer < 0)
          throw InternalError("tied parameter " + p.name + " has no owner in an earlier layer");
      } else {
        t.trainable = trainable(p);
      }
      out[l].tensors.push_back(std::move(t));
    }
  return out;
}

at::ScalarType scalar_type(kernels::FloatDType dtype) {
  switch (dtype) {
    case kernels::FloatDType::kF32:
      return at::kFloat;
    case kernels::FloatDType::kBF16:
      return at::kBFloat16;
    case kernels::FloatDType::kF16:
      return at::kHalf;
  }
  throw InternalError("unknown FloatDType");
}

namespace {
const models::ParamSpec& spec_of(const std::vector<models::LayerSpec>& specs,
                                 const offload::LayerStore& store, std::size_t layer,
                                 std::size_t index) {
  RONDO_ASSERT_MSG(layer < specs.size() && specs.size() == store.layers() &&
                       index < specs[layer].params.size() &&
                       specs[layer].params.size() == store.layer(layer).size(),
                   "the layer specs do not describe this store");
  return specs[layer].params[index];
}
}  // namespace

namespace {
at::Tensor view_of(const offload::TensorState& t, const offload::LayerStore& store,
                   const models::ParamSpec& p, std::size_t layer, StateView what) {
  // Optimizer state at `data`: null when frozen, on the NVMe tier, or in the other moment format.
  auto state = [&](void* data, std::vector<std::int64_t> shape, at::ScalarType dtype) {
    if (!t.trainable)
      throw Error("tensor " + p.name + " of layer " + std::to_string(layer) +
                  " is frozen: it has no master weights, moments or gradient");
    const bool eight_bit = t.m_codes != nullptr, f32_moments = t.m != nullptr;
    if (data == nullptr && (eight_bit || f32_moments))
      throw Error("tensor " + p.name + " of layer " + std::to_string(layer) +
                  " keeps its moments " +
                  (eight_bit ? "in 8 bits: view the codes and absmax (kMCodes, kMAbsmax, ...)"
                             : "in f32: they have no codes or absmax"));
    if (data == nullptr)
      throw Error("tensor " + p.name + " of layer " + std::to_string(layer) +
                  ": its optimizer state is on the NVMe tier; open the layer with "
                  "LayerStore::access");
    return at::from_blob(data, shape, at::TensorOptions().dtype(dtype));
  };
  auto f32 = [&](float* data) { return state(data, p.shape, at::kFloat); };
  const std::vector<std::int64_t> blocks = {
      static_cast<std::int64_t>(kernels::adamw8bit_blocks(t.numel))};
  switch (what) {
    case StateView::kStream:
      if (t.quant.type != kernels::QuantType::kNone)
        throw Error("tensor " + p.name + " is kept quantised (" + kernels::to_string(t.quant) +
                    "); dequantise it with stream_tensor");
      if (t.stream == nullptr)
        throw Error("tensor " + p.name + " of layer " + std::to_string(layer) +
                    ": its streaming copy is on the NVMe tier; open the layer with "
                    "LayerStore::access");
      return at::from_blob(t.stream, p.shape, scalar_type(store.stream_dtype()));
    case StateView::kGrad:
      if (!t.trainable) return f32(nullptr);
      return at::from_blob(t.grad, p.shape, scalar_type(store.grad_dtype()));
    case StateView::kMaster:
      return f32(t.master);
    case StateView::kM:
      return f32(t.m);
    case StateView::kV:
      return f32(t.v);
    case StateView::kMCodes:
      return state(t.m_codes, p.shape, at::kByte);
    case StateView::kVCodes:
      return state(t.v_codes, p.shape, at::kByte);
    case StateView::kMAbsmax:
      return state(t.m_absmax, blocks, at::kFloat);
    case StateView::kVAbsmax:
      return state(t.v_absmax, blocks, at::kFloat);
  }
  throw InternalError("unknown StateView");
}
}  // namespace

PieceState piece_state(const offload::TensorState& view, std::size_t begin, StateView what) {
  const std::size_t n = view.numel;
  auto f32 = [&](float* p) {
    return PieceState{reinterpret_cast<std::uint8_t*>(p), n * sizeof(float), begin * sizeof(float)};
  };
  auto absmax = [&](float* p) {
    return PieceState{reinterpret_cast<std::uint8_t*>(p),
                      kernels::adamw8bit_blocks(n) * sizeof(float),
                      begin / kernels::kAdamW8bitBlock * sizeof(float)};
  };
  PieceState s;
  switch (what) {
    case StateView::kMaster:
      s = f32(view.master);
      break;
    case StateView::kM:
      s = f32(view.m);
      break;
    case StateView::kV:
      s = f32(view.v);
      break;
    case StateView::kMCodes:
      s = {view.m_codes, n, begin};
      break;
    case StateView::kVCodes:
      s = {view.v_codes, n, begin};
      break;
    case StateView::kMAbsmax:
      s = absmax(view.m_absmax);
      break;
    case StateView::kVAbsmax:
      s = absmax(view.v_absmax);
      break;
    default:
      throw InternalError("piece_state: not optimizer state");
  }
  if (s.data == nullptr)
    throw InternalError(
        "piece_state: the view has no state of that kind (the other moment "
        "format?)");
  return s;
}

at::Tensor state_view(const offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                      std::size_t layer, std::size_t index, StateView what) {
  const models::ParamSpec& p = spec_of(specs, store, layer, index);
  return view_of(store.layer(layer)[index], store, p, layer, what);
}

at::Tensor state_view(const offload::LayerAccess& access, const offload::LayerStore& store,
                      const std::vector<models::LayerSpec>& specs, std::size_t layer,
                      std::size_t index, StateView what) {
  const models::ParamSpec& p = spec_of(specs, store, layer, index);
  return view_of(access[index], store, p, layer, what);
}

at::Tensor stream_tensor(const offload::LayerAccess& access, const offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs, std::size_t layer,
                         std::size_t index) {
  const models::ParamSpec& p = spec_of(specs, store, layer, index);
  const offload::TensorState& t = access[index];
  if (t.tied) throw InternalError("stream_tensor: " + p.name + " is tied; read its owner");
  if (t.quant.type == kernels::QuantType::kNone)
    return view_of(t, store, p, layer, StateView::kStream);
  at::Tensor out = at::empty(p.shape, at::TensorOptions().dtype(scalar_type(store.stream_dtype())));
  kernels::dequantize(t.quant, t.stream, t.rows, t.cols, store.stream_dtype(), out.data_ptr());
  return out;
}

// Note [Loading in slices]
// Loading holds little of a tensor outside the store. The reader hands a tensor stored in the
// streaming dtype as a view of the file's mapping, whose pages fill as they are touched; the
// loader copies it into the store a slice at a time — a weight piece of a frozen tensor, an
// optimizer piece (streaming copy and master) of a trained one — rounding each slice on its own
// where the part is on NVMe, and tells the reader as each slice is in (done_range), which drops
// its pages. So loading touches about a piece of the file at a time, not the largest tensor (an
// untied embedding of a large vocabulary is hundreds of MB). A tensor the reader converts (another
// dtype in the file) or dequantises is still held whole while it is loaded.
void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const WeightSource& source) {
  const at::ScalarType sd = scalar_type(store.stream_dtype());
  for (std::size_t l = 0; l < store.layers(); ++l) {
    // The weights a layer at a time where they live in host memory, in pieces where on NVMe
    // (Note [Weight pieces]); the masters a chunk at a time (Note [Optimizer chunks] in
    // offload/layer_store.cpp), each chunk opened once, as its first piece comes, and written
    // back when the load has moved past it (its moments start at zero).
    unsigned in_host = 0;
    std::optional<offload::PieceWriter> writers[2];
    for (unsigned part : {offload::kBasePart, offload::kStreamPart}) {
      if (store.tier(l, part) == offload::Tier::kHost)
        in_host |= part;
      else
        writers[part == offload::kBasePart ? 0 : 1].emplace(store, l, part);
    }
    const offload::LayerAccess a = store.access(l, in_host, offload::AccessMode::kOverwrite);
    std::optional<offload::LayerAccess> chunk;
    std::size_t chunk_no = 0;
    // The tensor's streaming copy as stored, from `data` (t.stream_bytes).
    auto put = [&](const offload::TensorState& t, const void* data) {
      if (t.stream)
        std::memcpy(t.stream, data, t.stream_bytes);
      else
        writers[t.trainable ? 1 : 0]->put(t.stream_offset, data, t.stream_bytes);
    };
    for (std::size_t i = 0; i < a.size(); ++i) {
      const offload::TensorState& t = a[i];
      if (t.tied) continue;
      const models::ParamSpec& p = spec_of(specs, store, l, i);
      std::optional<at::Tensor> blob;
      if (t.quant.type != kernels::QuantType::kNone && source.blocks) blob = source.blocks(p.name);
      if (blob) {
        at::Tensor b = blob->to(at::kCPU).contiguous();
        if (static_cast<std::size_t>(b.nbytes()) != t.stream_bytes)
          throw Error("tensor " + p.name + ": " + std::to_string(b.nbytes()) +
                      " bytes given for its " + kernels::to_string(t.quant) + " form, which is " +
                      std::to_string(t.stream_bytes) + " bytes");
        put(t, b.data_ptr());
      } else {
        at::Tensor src = source.tensor(p.name);
        if (src.sizes() != at::IntArrayRef(p.shape))
          throw Error("tensor " + p.name + " has shape " + models::shape_text(src.sizes().vec()) +
                      ", the model needs " + models::shape_text(p.shape));
        src = src.to(at::kCPU).contiguous();
        if (t.quant.type != kernels::QuantType::kNone) {
          // From the checkpoint's own dtype, as bitsandbytes quantises the weights it is given.
          const at::ScalarType st = src.scalar_type();
          const at::Tensor f = st == at::kBFloat16 || st == at::kHalf ? src : src.to(at::kFloat);
          std::vector<std::uint8_t> blocks(t.stream ? 0 : t.stream_bytes);
          kernels::quantize(t.quant, f.data_ptr(),
                            st == at::kBFloat16 ? kernels::FloatDType::kBF16
                            : st == at::kHalf   ? kernels::FloatDType::kF16
                                                : kernels::FloatDType::kF32,
                            t.rows, t.cols, t.stream ? t.stream : blocks.data());
          if (!t.stream) put(t, blocks.data());
        } else {
          // A slice at a time (Note [Loading in slices]): the streaming copy and, trained, the
          // master of each optimizer piece of the tensor; frozen, slices of a weight piece.
          const at::Tensor flat = src.reshape({-1});
          const std::size_t ss = kernels::dtype_size(store.stream_dtype());
          auto copy = [&](std::size_t begin, std::size_t n) {
            const at::Tensor from =
                flat.narrow(0, static_cast<std::int64_t>(begin), static_cast<std::int64_t>(n));
            if (t.stream) {
              at::from_blob(static_cast<std::uint8_t*>(t.stream) + begin * ss,
                            {static_cast<std::int64_t>(n)}, sd)
                  .copy_(from);
            } else {
              const at::Tensor rounded = from.to(sd).contiguous();
              writers[t.trainable ? 1 : 0]->put(t.stream_offset + begin * ss, rounded.data_ptr(),
                                                n * ss);
            }
          };
          auto copied = [&](std::size_t begin, std::size_t n) {
            if (source.done_range)
              source.done_range(p.name, static_cast<std::int64_t>(begin),
                                static_cast<std::int64_t>(n));
          };
          // Sharded optimizer state another rank holds: the streaming copy only.
          const bool with_master = t.trainable && store.holds_optimizer(l);
          if (!with_master) {
            const std::size_t slice = std::max<std::size_t>(store.piece_bytes() / 4, 1);
            for (std::size_t b = 0; b < t.numel; b += slice) {
              copy(b, std::min(slice, t.numel - b));
              copied(b, std::min(slice, t.numel - b));
            }
          }
          for (const auto& [k, pi] : with_master
                                         ? store.tensor_pieces(l, i)
                                         : std::vector<std::pair<std::size_t, std::size_t>>{}) {
            if (!chunk || chunk_no != k) {
              chunk.reset();
              chunk = store.access_chunk(l, k, offload::AccessMode::kOverwrite);
              chunk_no = k;
            }
            const offload::TensorState& v = (*chunk)[pi];
            const std::size_t begin = chunk->piece(pi).begin;
            copy(begin, v.numel);
            at::from_blob(v.master, {static_cast<std::int64_t>(v.numel)}, at::kFloat)
                .copy_(flat.narrow(0, static_cast<std::int64_t>(begin),
                                   static_cast<std::int64_t>(v.numel)));
            copied(begin, v.numel);
          }
        }
      }
      if (source.done) source.done(p.name);
    }
    chunk.reset();
    for (std::optional<offload::PieceWriter>& w : writers)
      if (w) w->finish();
    if (source.progress) source.progress(l + 1, store.layers());
  }
  store.flush();
}

void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const std::function<at::Tensor(const std::string&)>& tensor) {
  load_weights(store, specs, WeightSource{.tensor = tensor});
}

void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const models::WeightReader& reader,
                  const std::map<std::string, at::Tensor>& extra,
                  const std::function<void(std::size_t, std::size_t)>& progress) {
  const models::DType dtype = store.stream_dtype() == kernels::FloatDType::kBF16
                                  ? models::DType::kBF16
                                  : models::DType::kF32;
  load_weights(store, specs,
               WeightSource{.tensor =
                                [&](const std::string& n) {
                                  auto it = extra.find(n);
                                  return it != extra.end() ? it->second : reader.read(n, dtype);
                                },
                            .blocks = [&](const std::string& n) -> std::optional<at::Tensor> {
                              if (extra.count(n)) return std::nullopt;
                              if (auto q = reader.read_mxfp4(n)) return q->second;
                              std::optional<models::GgufBlocks> b = reader.read_blocks(n);
                              if (!b) return std::nullopt;
                              return b->bytes;
                            },
                            .done =
                                [&](const std::string& n) {
                                  if (!extra.count(n)) reader.release(n);
                                },
                            .done_range =
                                [&](const std::string& n, std::int64_t first, std::int64_t count) {
                                  if (!extra.count(n)) reader.release_range(n, first, count);
                                },
                            .progress = progress});
}

kernels::FloatDType stream_dtype(const std::string& dtype) {
  return dtype == "fp32"   ? kernels::FloatDType::kF32
         : dtype == "fp16" ? kernels::FloatDType::kF16
                           : kernels::FloatDType::kBF16;
}

}  // namespace rondo::engine
