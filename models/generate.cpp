#include "models/generate.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <random>

#include "kernels/error.h"

namespace rondo::models {

std::int64_t sample_token(const at::Tensor& logits, const SamplingOptions& options,
                          std::uint64_t& rng_state) {
  at::Tensor l = logits.to(at::kCPU, at::kFloat).contiguous();
  // NaN or Inf logits come from an overflow in a low-precision forward or from broken weights;
  // sampling from them would pick garbage (and sorting NaN is undefined).
  if (!at::isfinite(l).all().item<bool>())
    throw Error(
        "the model produced non-finite logits (NaN or Inf); its weights may be corrupt, or "
        "the forward overflowed (try --dtype f32)");
  if (options.temperature <= 0) return l.argmax().item<std::int64_t>();
  auto [probs, order] = at::sort(at::softmax(l / options.temperature, -1), -1, /*descending=*/true);
  const float* p = probs.data_ptr<float>();
  const std::int64_t* ids = order.data_ptr<std::int64_t>();
  const std::int64_t V = probs.numel();
  // The smallest set of most likely tokens whose mass reaches top_p (at least one token).
  double kept = 0;
  std::int64_t n = 0;
  while (n < V && (n == 0 || kept < options.top_p))
    kept += p[n++];
  std::mt19937_64 rng(rng_state);
  double r = std::uniform_real_distribution<double>(0.0, kept)(rng);
  rng_state = rng();
  for (std::int64_t i = 0; i < n; ++i) {
    r -= p[i];
    if (r <= 0) return ids[i];
  }
  return ids[n - 1];
}

std::string TextStreamer::push(std::int32_t id) {
  ids_.push_back(id);
  return advance(false);
}

std::string TextStreamer::finish() {
  return advance(true);
}

std::string TextStreamer::advance(bool final) {
  std::string text = tokenizer_.decode(ids_, skip_special_);
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::size_t end = text.size();
  while (!final && end >= 3 && text.compare(end - 3, 3, kReplacement) == 0)
    end -= 3;
  // Decoders may rewrite the start (strip a leading space); emit only past what was emitted, and
  // nothing while the text does not extend it.
  if (end <= shown_.size() || text.compare(0, shown_.size(), shown_) != 0) return {};
  std::string out = text.substr(shown_.size(), end - shown_.size());
  shown_.assign(text, 0, end);
  return out;
}

std::vector<std::int64_t> generate(const Model& model, const std::vector<std::int64_t>& prompt,
                                   const SamplingOptions& options,
                                   const std::function<bool(std::int64_t)>& on_token) {
  if (prompt.empty()) throw Error("generate: the prompt is empty");
  const ModelConfig& c = model.config();
  for (std::int64_t t : prompt)
    if (t < 0 || t >= c.vocab_size)
      throw Error("generate: token id " + std::to_string(t) + " is outside the vocabulary (" +
                  std::to_string(c.vocab_size) + ")");
  const auto& layers = model.layers();
  std::vector<BlockWeights> blocks;
  for (std::size_t i = 1; i + 1 < layers.size(); ++i)
    blocks.push_back(BlockWeights::bind(layers[i], model.layer_tensors(i)));
  std::vector<at::Tensor> head = model.layer_tensors(layers.size() - 1);
  const at::Tensor& emb = model.tensor("model.embed_tokens.weight");
  std::vector<KvCache> caches(blocks.size());
  std::vector<std::int64_t> stops =
      options.stop_tokens.empty() ? c.eos_token_ids : options.stop_tokens;

  std::vector<std::int64_t> out;
  std::vector<std::int64_t> next = prompt;
  std::uint64_t rng_state = options.seed;
  c10::InferenceMode inference;  // no autograd bookkeeping while generating
  while (static_cast<std::int64_t>(out.size()) < options.max_new_tokens) {
    const std::int64_t offset = caches.empty() ? 0 : caches[0].length();
    const std::int64_t count = static_cast<std::int64_t>(next.size());
    at::Tensor tokens = at::tensor(next, at::kLong).to(emb.device()).unsqueeze(0);
    AttentionContext ctx = make_decode_context(c, offset, count, emb.scalar_type(), emb.device());
    at::Tensor x = embed(emb, tokens);
    for (std::size_t b = 0; b < blocks.size(); ++b)
      x = block_forward(c, blocks[b], x, ctx, &caches[b]);
    at::Tensor logits = head_logits(c, head[0], head[1], x.narrow(1, count - 1, 1)).view({-1});
    std::int64_t token = sample_token(logits, options, rng_state);
    out.push_back(token);
    if (on_token && !on_token(token)) break;
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
    next = {token};
  }
  return out;
}

}  // namespace rondo::models
