// Attention (attention.h, attention_masks.h): rotary tables, the limits on what each token sees
// (masks, windows, documents of packed rows), the contexts of training and generation, and a
// block's attention itself (per document, plain, or SDPA). Touches only the tensors handed to it
// (and a per-device cache of whether flash attention runs). Used by block_forward and the engine.
#include "models/attention.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "kernels/error.h"
#include "models/attention_masks.h"
#include "models/layers.h"

namespace rondo::models {

namespace {

// Rotary inverse frequencies, in fp32 as transformers computes them (so that logits agree to
// fp32 rounding, not just to the mathematically exact value). `seq_len`: 1 + the largest position
// of the batch, which dynamic (NTK) scaling grows the base with past max_position_embeddings
// (within it, as in every training row Rondo makes, dynamic is the default rope).
at::Tensor inverse_frequencies(const ModelConfig& c, std::int64_t seq_len) {
  const std::int64_t D = c.head_dim;
  at::Tensor exponent = at::arange(0, D, 2, at::kLong).to(at::kFloat) / static_cast<double>(D);
  at::Tensor pos_freqs = at::pow(at::scalar_tensor(c.rope.theta, at::kFloat), exponent);
  if (c.rope.type == "dynamic" && seq_len > c.max_position_embeddings) {
    // transformers computes the grown base in fp32 tensors (seq_len is one there).
    const double factor = c.rope.factor;
    at::Tensor s = at::scalar_tensor(seq_len, at::kLong);
    at::Tensor base =
        at::pow(s * factor / static_cast<double>(c.max_position_embeddings) - (factor - 1),
                static_cast<double>(D) / static_cast<double>(D - 2)) *
        c.rope.theta;
    pos_freqs = at::pow(base, exponent);
  }
  at::Tensor inv = 1.0 / pos_freqs;
  if (c.rope.type == "linear") inv = inv / c.rope.factor;
  if (c.rope.type == "yarn") {
    // The dimensions whose wavelengths fit the pretraining context many times keep their
    // frequency (extrapolation); the slow ones are divided by factor (interpolation); a linear
    // ramp between, its ends found from beta_fast and beta_slow rotations.
    const double theta = c.rope.theta,
                 orig = static_cast<double>(c.rope.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return (static_cast<double>(D) * std::log(orig / (rotations * 2 * M_PI))) /
             (2 * std::log(theta));
    };
    double low = correction_dim(c.rope.beta_fast), high = correction_dim(c.rope.beta_slow);
    if (c.rope.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(D - 1));
    if (low == high) high += 0.001;  // as transformers: no singular ramp
    at::Tensor ramp = at::clamp((at::arange(D / 2, at::kFloat) - low) / (high - low), 0, 1);
    at::Tensor extrapolation = 1 - ramp;
    at::Tensor interpolated = 1.0 / (c.rope.factor * pos_freqs);
    inv = interpolated * (1 - extrapolation) + inv * extrapolation;
  }
  if (c.rope.type == "llama3") {
    const double factor = c.rope.factor, low = c.rope.low_freq_factor,
                 high = c.rope.high_freq_factor;
    const double old_len = static_cast<double>(c.rope.original_max_position_embeddings);
    const double low_wavelen = old_len / low, high_wavelen = old_len / high;
    at::Tensor wavelen = 2.0 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / factor, inv);
    at::Tensor smooth = (old_len / wavelen - low) / (high - low);
    at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    at::Tensor medium =
        at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

// cos and sin of the angles (B, T, D/2), as (B, 1, T, D) in `dtype`; yarn scales both by its
// attention factor first, in fp32, as transformers does.
void set_cos_sin(const ModelConfig& c, const at::Tensor& freqs, at::ScalarType dtype,
                 AttentionContext& ctx) {
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (c.rope.attention_factor != 1.0) {
    cos = cos * c.rope.attention_factor;
    sin = sin * c.rope.attention_factor;
  }
  ctx.cos = cos.to(dtype).unsqueeze(1);
  ctx.sin = sin.to(dtype).unsqueeze(1);
}

at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

at::Tensor packed_doc_ids(const TokenBatch& batch) {
  if (!batch.doc_ids.defined()) return {};
  if (batch.doc_ids.sizes() != batch.tokens.sizes())
    throw Error("doc_ids must have the tokens' shape");
  at::Tensor docs = batch.doc_ids.to(at::kCPU, at::kLong).contiguous();
  const std::int64_t B = docs.size(0), T = docs.size(1);
  const std::int64_t* d = docs.data_ptr<std::int64_t>();
  bool packed = false;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 1; t < T; ++t) {
      const std::int64_t i = b * T + t;
      if (d[i] == d[i - 1]) continue;
      packed = true;
      for (std::int64_t u = 0; u < t; ++u)
        if (d[b * T + u] == d[i])
          throw Error("doc_ids: document " + std::to_string(d[i]) + " of row " + std::to_string(b) +
                      " is not contiguous");
    }
  // A mask only where some row holds more than one document: with one per row it would be the
  // plain causal one, and it would keep attention off the fused kernels.
  return packed ? docs : at::Tensor();
}

DocSpans doc_spans(const at::Tensor& docs) {
  DocSpans s;
  if (!docs.defined()) return s;
  RONDO_ASSERT(docs.device().is_cpu() && docs.scalar_type() == at::kLong && docs.dim() == 2);
  const at::Tensor d = docs.contiguous();
  const std::int64_t B = d.size(0), T = d.size(1);
  const std::int64_t* id = d.data_ptr<std::int64_t>();
  s.offsets.push_back(0);
  for (std::int64_t i = 1; i <= B * T; ++i)
    if (i == B * T || i % T == 0 || id[i] != id[i - 1]) {
      s.max_len = std::max(s.max_len, i - s.offsets.back());
      s.offsets.push_back(i);
    }
  return s;
}

at::Tensor DocSpans::offsets_tensor() const {
  std::vector<std::int32_t> o(offsets.begin(), offsets.end());
  RONDO_ASSERT(offsets.empty() || offsets.back() <= std::numeric_limits<std::int32_t>::max());
  return at::tensor(o, at::TensorOptions().dtype(at::kInt));
}

namespace {

// Variable-length flash attention: q (N, H, D), k and v (N, KV, D) over the documents at
// `offsets` (int32, on the device), causal within each, keys at most window - 1 back (0 = no
// window). Differentiable (torch's FlashAttentionBackward0).
at::Tensor flash_per_document(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& offsets, std::int64_t max_len, double scale,
                              std::int64_t window) {
  std::optional<std::int64_t> left, right;
  if (window > 0) {
    left = window - 1;
    right = 0;
  }
  return std::get<0>(at::_flash_attention_forward(q, k, v, offsets, offsets, max_len, max_len, 0.0,
                                                  /*is_causal=*/true, /*return_debug_mask=*/false,
                                                  scale, left, right));
}

// Whether flash_per_document runs on this device for this dtype and head size, forward and
// backward: tried once with two documents (an older GPU, or a torch built without flash attention,
// throws; flash's backward lacks head sizes above 192 outside sm80/sm90, where the forward
// runs, so a training step would throw halfway instead of taking the masked path).
bool flash_per_document_runs(at::Device device, at::ScalarType dtype, std::int64_t D) {
  if (!at::globalContext().userEnabledFlashSDP()) return false;
  static std::mutex mu;
  static std::map<std::tuple<int, int, std::int64_t>, bool> known;
  const auto key = std::tuple{static_cast<int>(device.index()), static_cast<int>(dtype), D};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  bool runs = false;
  try {
    // (Autograd is on even under a caller's InferenceMode, which AutoGradMode alone does not undo.)
    c10::InferenceMode no_inference(false);
    c10::AutoGradMode grad_mode(true);
    const auto opts = at::TensorOptions().dtype(dtype).device(device);
    at::Tensor q = at::ones({3, 2, D}, opts).set_requires_grad(true);
    at::Tensor kv = at::ones({3, 1, D}, opts).set_requires_grad(true);
    at::Tensor offsets = at::tensor(std::vector<std::int32_t>{0, 1, 3}, at::kInt).to(device);
    const at::Tensor out = flash_per_document(q, kv, kv, offsets, 2, 1.0, 0);
    const auto grads = torch::autograd::grad({out.sum()}, {q, kv});
    runs = out.isfinite().all().item<bool>() && grads[0].isfinite().all().item<bool>() &&
           grads[1].isfinite().all().item<bool>();
  } catch (const std::exception&) {
    runs = false;
  }
  known[key] = runs;
  return runs;
}

}  // namespace

bool flash_may_attend_per_document(const ModelConfig& c, at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && c.head_dim % 8 == 0 &&
         c.head_dim <= 256 && c.attention_dropout == 0 && !c.attention_sinks;
}

bool attend_per_document(const ModelConfig& c, const DocSpans& spans, at::Device device,
                         at::ScalarType dtype) {
  if (spans.offsets.size() < 2 || c.attention_dropout > 0 || c.attention_sinks) return false;
  if (device.is_cuda())
    return flash_may_attend_per_document(c, dtype) &&
           flash_per_document_runs(device, dtype, c.head_dim);
  if (!device.is_cpu()) return false;
  const auto docs = static_cast<std::int64_t>(spans.offsets.size()) - 1;
  return docs * 32 <= spans.offsets.back() &&
         (c.sliding_window == 0 || spans.max_len <= c.sliding_window);
}

void limit_attention(AttentionContext& ctx, const ModelConfig& c, const at::Tensor& docs,
                     const DocSpans& spans, at::Device device, at::ScalarType dtype,
                     const at::Tensor& offsets_on_device) {
  const std::int64_t B = ctx.positions.size(0), T = ctx.positions.size(1);
  if (docs.defined() && attend_per_document(c, spans, device, dtype)) {
    ctx.doc_offsets = spans.offsets;
    ctx.max_doc_len = spans.max_len;
    if (device.is_cuda())
      ctx.doc_offsets_dev =
          offsets_on_device.defined() ? offsets_on_device : spans.offsets_tensor().to(device);
    return;
  }
  const at::TensorOptions bools = at::TensorOptions().dtype(at::kBool).device(device);
  if (docs.defined()) {
    at::Tensor same = docs.unsqueeze(2).eq(docs.unsqueeze(1));  // (B, T, T)
    at::Tensor causal = at::ones({T, T}, bools).tril();
    ctx.mask = (same & causal).unsqueeze(1);
  }
  if (c.sliding_window > 0 && T > c.sliding_window) {
    // Keys more than sliding_window - 1 positions back are out of reach: in every layer
    // (Mistral), or in the windowed ones only (Qwen's per-layer windows).
    // Query i sees keys i - window + 1 ..= i: the band of the lower triangle (bools only; an
    // int64 (T, T) difference would take 8 times the mask's memory).
    at::Tensor window = at::ones({T, T}, bools).tril().triu(1 - c.sliding_window);
    at::Tensor base =
        ctx.mask.defined() ? ctx.mask : window.unsqueeze(0).unsqueeze(0).expand({B, 1, T, T});
    (c.sliding_layers.empty() ? ctx.mask : ctx.window_mask) = base & window;
  }
}

AttentionContext make_attention_context(const ModelConfig& c, const TokenBatch& batch,
                                        at::ScalarType dtype) {
  AttentionContext ctx = attention_context_without_masks(c, batch, dtype);
  const at::Tensor docs = packed_doc_ids(batch);
  const at::Device device = batch.tokens.device();
  limit_attention(ctx, c, docs.defined() ? docs.to(device) : docs, doc_spans(docs), device, dtype);
  return ctx;
}

AttentionContext attention_context_without_masks(const ModelConfig& c, const TokenBatch& batch,
                                                 at::ScalarType dtype) {
  const at::Tensor& tokens = batch.tokens;
  if (tokens.dim() != 2) throw Error("token batch must be (B, T)");
  const std::int64_t B = tokens.size(0), T = tokens.size(1);
  AttentionContext ctx;
  at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(tokens.device());
  if (batch.doc_ids.defined()) {
    // (packed_doc_ids checks that each document is contiguous; positions need only the shape.)
    if (batch.doc_ids.sizes() != tokens.sizes()) throw Error("doc_ids must have the tokens' shape");
    const at::Tensor all = batch.doc_ids.to(at::kCPU, at::kLong).contiguous();
    at::Tensor pos = at::empty({B, T}, at::kLong);
    const std::int64_t* d = all.data_ptr<std::int64_t>();
    std::int64_t* p = pos.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < B * T; ++i)
      p[i] = (i % T > 0 && d[i] == d[i - 1]) ? p[i - 1] + 1 : 0;
    ctx.positions = pos.to(tokens.device());
  } else {
    ctx.positions = at::arange(T, longs).unsqueeze(0).expand({B, T});
  }
  // Only dynamic rope needs the longest position (a host sync).
  const std::int64_t seq_len =
      c.rope.type == "dynamic" ? ctx.positions.max().item<std::int64_t>() + 1 : 0;
  at::Tensor inv = inverse_frequencies(c, seq_len).to(tokens.device());
  at::Tensor freqs = ctx.positions.to(at::kFloat).unsqueeze(-1) * inv;  // (B, T, D/2)
  set_cos_sin(c, freqs, dtype, ctx);
  return ctx;
}

AttentionContext make_decode_context(const ModelConfig& c, std::int64_t offset, std::int64_t count,
                                     at::ScalarType dtype, at::Device device) {
  at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  AttentionContext ctx;
  ctx.positions = at::arange(offset, offset + count, longs).unsqueeze(0);
  at::Tensor i = ctx.positions.squeeze(0).unsqueeze(1);           // query positions
  at::Tensor j = at::arange(offset + count, longs).unsqueeze(0);  // key positions
  const at::Tensor causal = j <= i;
  if (count > 1) ctx.mask = causal.unsqueeze(0).unsqueeze(0);  // (1, 1, count, offset + count)
  if (c.sliding_window > 0 && offset + count > c.sliding_window) {
    const at::Tensor windowed = (causal & ((i - j) < c.sliding_window)).unsqueeze(0).unsqueeze(0);
    (c.sliding_layers.empty() ? ctx.mask : ctx.window_mask) = windowed;
  }
  at::Tensor freqs = ctx.positions.to(at::kFloat).unsqueeze(-1) *
                     inverse_frequencies(c, offset + count).to(device);
  set_cos_sin(c, freqs, dtype, ctx);
  return ctx;
}

AttentionContext make_decode_context(const ModelConfig& c, std::int64_t offset, std::int64_t count,
                                     at::ScalarType dtype, at::Device device,
                                     const std::vector<std::int64_t>& left_pad) {
  RONDO_ASSERT(!left_pad.empty());
  at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  const auto B = static_cast<std::int64_t>(left_pad.size());
  at::Tensor pad = at::tensor(left_pad, at::kLong).to(device).view({B, 1, 1});
  at::Tensor i = at::arange(offset, offset + count, longs).view({1, count, 1});   // query slots
  at::Tensor j = at::arange(offset + count, longs).view({1, 1, offset + count});  // key slots
  AttentionContext ctx;
  ctx.positions = (i.squeeze(-1) - pad.squeeze(-1)).clamp_min(0);  // (B, count)
  const at::Tensor real_key = (j >= pad) & (j <= i);
  const at::Tensor allowed = real_key | (j == i);  // (B, count, keys)
  ctx.mask = allowed.unsqueeze(1);
  if (c.sliding_window > 0 && offset + count > c.sliding_window) {
    const at::Tensor windowed = ((real_key & ((i - j) < c.sliding_window)) | (j == i)).unsqueeze(1);
    (c.sliding_layers.empty() ? ctx.mask : ctx.window_mask) = windowed;
  }
  at::Tensor freqs = ctx.positions.to(at::kFloat).unsqueeze(-1) *
                     inverse_frequencies(c, offset + count).to(device);
  set_cos_sin(c, freqs, dtype, ctx);
  return ctx;
}

namespace {

// Attention per document of packed rows (AttentionContext::doc_offsets), causal within each:
// q (B, H, T, D), k and v (B, KV, T, D); returns (B, H, T, D). On CUDA one variable-length flash
// attention over the flattened rows (the layer's window, if any, applied by the kernel); on the
// CPU one fused causal attention per document (no window cuts into one: attend_per_document).
at::Tensor attend_documents(const ModelConfig& c, std::int64_t block, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const AttentionContext& ctx) {
  const std::int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  if (q.is_cuda()) {
    auto flat = [&](const at::Tensor& t) {
      return t.transpose(1, 2).reshape({B * T, t.size(1), D});
    };
    return flash_per_document(flat(q), flat(k), flat(v), ctx.doc_offsets_dev, ctx.max_doc_len,
                              scale, c.windowed(block) ? c.sliding_window : 0)
        .view({B, T, H, D})
        .transpose(1, 2);
  }
  // The rows flattened, (1, heads, B * T, D), and split into the documents: the backward of a split
  // is one concatenation, where slicing each document out of the whole tensor gave every document
  // a zero-filled gradient of the whole size to add up (on SmolLM2's packed chats, a fifth of the
  // CPU step).
  std::vector<std::int64_t> lengths;
  for (std::size_t d = 0; d + 1 < ctx.doc_offsets.size(); ++d)
    lengths.push_back(ctx.doc_offsets[d + 1] - ctx.doc_offsets[d]);
  auto documents = [&](const at::Tensor& x) {
    return at::split_with_sizes(x.transpose(0, 1).reshape({1, x.size(1), B * T, D}), lengths, 2);
  };
  const std::vector<at::Tensor> qs = documents(q), ks = documents(k), vs = documents(v);
  std::vector<at::Tensor> parts;
  for (std::size_t d = 0; d < lengths.size(); ++d)
    parts.push_back(at::scaled_dot_product_attention(qs[d], ks[d], vs[d], {}, 0.0,
                                                     /*is_causal=*/true, scale,
                                                     /*enable_gqa=*/H != KV));
  // (1, H, B * T, D) in row order, as (B, H, T, D).
  return at::cat(parts, 2).view({H, B, T, D}).transpose(0, 1);
}

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

at::Tensor attend(const ModelConfig& c, const BlockWeights& w, at::Tensor q, at::Tensor k,
                  at::Tensor v, const AttentionContext& ctx, KvCache* cache) {
  return attend_rotated(c, w, apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin),
                        std::move(v), ctx, cache);
}

at::Tensor attend_rotated(const ModelConfig& c, const BlockWeights& w, const at::Tensor& q,
                          at::Tensor k, at::Tensor v, const AttentionContext& ctx, KvCache* cache) {
  const std::int64_t B = q.size(0), T = q.size(2), H = c.num_heads, KV = c.num_kv_heads,
                     D = c.head_dim;
  // This layer's mask: the windowed one where the layer has a window of its own.
  const at::Tensor& layer_mask =
      ctx.window_mask.defined() && c.windowed(w.block) ? ctx.window_mask : ctx.mask;
  bool causal = !layer_mask.defined();
  if (cache != nullptr) {
    if (cache->k.defined()) {
      k = at::cat({cache->k, k}, 2);
      v = at::cat({cache->v, v}, 2);
    }
    cache->k = k;
    cache->v = v;
    // New tokens see every cached one: the mask (from make_decode_context) says so; one new
    // token needs none.
    causal = false;
  }
  std::optional<at::Tensor> mask;
  if (layer_mask.defined()) mask = layer_mask;
  at::Tensor a;
  const bool dropout = c.attention_dropout > 0 && ctx.dropout_seed >= 0;
  if (!ctx.doc_offsets.empty()) {
    RONDO_ASSERT_MSG(cache == nullptr && !dropout && !w.sinks.defined(),
                     "attention per document is for training and evaluation without dropout or "
                     "sinks (attend_per_document)");
    a = attend_documents(c, w.block, q, k, v, ctx);
  } else if (dropout || w.sinks.defined()) {
    // The plain path, as transformers' eager attention: in training with attention dropout
    // (the fused kernels draw from a generator whose state a recompute could not replay), and
    // with GPT-OSS's sinks (a learned logit per head joins each row's softmax, its share dropped).
    RONDO_ASSERT_MSG(!dropout || cache == nullptr,
                     "attention dropout is for training, not generation");
    at::Tensor kk = H != KV ? k.repeat_interleave(H / KV, 1) : k;
    at::Tensor vv = H != KV ? v.repeat_interleave(H / KV, 1) : v;
    at::Tensor s = at::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    const std::int64_t keys = s.size(-1);
    if (mask || cache == nullptr) {  // one cached token's query sees every key: nothing to mask
      at::Tensor allowed =
          mask ? *mask
               : at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(q.device())).tril();
      s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    }
    if (w.sinks.defined())
      s = at::cat({s, w.sinks.to(s.scalar_type()).view({1, H, 1, 1}).expand({B, H, T, 1})}, -1);
    at::Tensor p = at::softmax(s.to(at::promote_types(s.scalar_type(), at::kFloat)), -1)
                       .narrow(-1, 0, keys)
                       .to(q.scalar_type());
    if (dropout)
      p = seeded_dropout(
          p, c.attention_dropout,
          static_cast<std::int64_t>(static_cast<std::uint64_t>(ctx.dropout_seed) * 1000003u +
                                    static_cast<std::uint64_t>(w.block)));
    a = at::matmul(p, vv);
  } else {
    // (fp32 on CUDA has no flash kernel either: the memory-efficient one, without grouped heads.)
    const bool expand = H != KV && (mask.has_value() || q.scalar_type() == at::kFloat) &&
                        ctx.expand_kv_heads.value_or(q.device().is_cuda());
    if (expand) {
      k = k.repeat_interleave(H / KV, 1);
      v = v.repeat_interleave(H / KV, 1);
    }
    a = at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal,
                                         1.0 / std::sqrt(static_cast<double>(D)),
                                         /*enable_gqa=*/H != KV && !expand);
  }
  return a;
}

}  // namespace rondo::models
