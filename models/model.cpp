#include "models/model.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <set>

#include "kernels/error.h"
#include "models/gguf_model.h"
#include "models/mxfp4.h"
#include "models/safetensors.h"
#include "models/tensor_view.h"

namespace rondo::models {
namespace fs = std::filesystem;

namespace {

// Tensors a checkpoint may carry that are not weights.
bool ignorable(const std::string& name, const ModelConfig& c) {
  if (name.size() >= 19 && name.compare(name.size() - 19, 19, "rotary_emb.inv_freq") == 0)
    return true;
  // Some tied checkpoints also store the LM head (a copy of the embedding).
  return c.tie_word_embeddings && name == "lm_head.weight";
}
}  // namespace

ModelFormat model_format(const std::string& path) {
  if (fs::is_directory(path)) return ModelFormat::kHfFolder;
  if (!fs::exists(path)) throw Error("model " + path + " does not exist");
  if (fs::path(path).extension() == ".gguf") return ModelFormat::kGguf;
  throw Error(path + " is neither a Hugging Face model folder nor a .gguf file");
}

Model Model::load(const std::string& path, const LoadOptions& options) {
  return model_format(path) == ModelFormat::kHfFolder ? load_hf_folder(path, options)
                                                      : load_gguf(path, options);
}

Model Model::load_gguf(const std::string& path, const LoadOptions& options) {
  GgufFile file(path);
  ModelConfig config = config_from_gguf(file);
  // Quantised tensors are dequantised on load, to F32 unless BF16 is asked for.
  DType target = options.dtype.value_or(DType::kF32);
  if (target != DType::kF32 && target != DType::kBF16)
    throw Error(path + ": GGUF weights load as F32 or BF16, not " + to_string(target));
  std::map<std::string, at::Tensor> tensors;
  for (const GgufTensorMapping& m : gguf_tensor_mapping(file, config))
    tensors.emplace(m.hf_name, load_hf_tensor(file, m, target));
  return from_tensors(std::move(config), std::move(tensors), path);
}

Model Model::load_hf_folder(const std::string& dir, const LoadOptions& options) {
  ModelConfig config = load_hf_config((fs::path(dir) / "config.json").string());
  auto ckpt = std::make_shared<Checkpoint>(Checkpoint::open_hf_folder(dir));
  std::map<std::string, at::Tensor> tensors;
  for (const std::string& name : ckpt->names()) {
    const TensorEntry& e = ckpt->get(name);
    at::Tensor t = e.view();  // zero-copy, read-only
    if (options.dtype && *options.dtype != e.dtype) t = t.to(to_scalar_type(*options.dtype));
    tensors.emplace(name, t);
  }
  // MXFP4 weights (GPT-OSS's experts), dequantised to the dtype asked for, else the config's.
  for (const auto& [name, w] : mxfp4_weights(*ckpt)) {
    tensors.erase(name + "_blocks");
    tensors.erase(name + "_scales");
    tensors[name] = dequantize_mxfp4(w, to_scalar_type(options.dtype.value_or(config.dtype)));
  }
  return from_tensors(std::move(config), std::move(tensors), dir, ckpt);
}

std::vector<std::string> check_weights_match(
    const ModelConfig& config, const std::vector<LayerSpec>& layers,
    const std::map<std::string, std::vector<std::int64_t>>& shapes, const std::string& source) {
  std::set<std::string> expected;
  std::vector<std::string> problems, ignored;
  for (const LayerSpec& layer : layers)
    for (const ParamSpec& p : layer.params) {
      if (!expected.insert(p.name).second) continue;  // tied: checked once
      auto it = shapes.find(p.name);
      if (it == shapes.end()) {
        problems.push_back("missing tensor '" + p.name + "' (shape " + shape_text(p.shape) + ")");
        continue;
      }
      if (it->second != p.shape)
        problems.push_back("tensor '" + p.name + "' has shape " + shape_text(it->second) +
                           " but the config needs " + shape_text(p.shape));
    }
  for (const auto& [name, shape] : shapes) {
    if (expected.count(name)) continue;
    if (ignorable(name, config))
      ignored.push_back(name);
    else
      problems.push_back("unexpected tensor '" + name + "' (not part of a " + config.architecture +
                         " with " + std::to_string(config.num_layers) + " layers)");
  }
  if (!problems.empty()) {
    std::string text = source + ": the weights do not match the config:";
    const std::size_t shown = std::min<std::size_t>(problems.size(), 12);
    for (std::size_t i = 0; i < shown; ++i)
      text += "\n  - " + problems[i];
    if (problems.size() > shown)
      text += "\n  - and " + std::to_string(problems.size() - shown) + " more";
    throw Error(text);
  }
  return ignored;
}

Model Model::from_tensors(ModelConfig config, std::map<std::string, at::Tensor> tensors,
                          std::string source, std::shared_ptr<void> keepalive) {
  Model m;
  m.config_ = std::move(config);
  m.layers_ = layer_specs(m.config_);
  m.source_ = std::move(source);
  m.keepalive_ = std::move(keepalive);
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, t] : tensors)
    shapes.emplace(name, t.sizes().vec());
  for (const std::string& name : check_weights_match(m.config_, m.layers_, shapes, m.source_))
    tensors.erase(name);
  m.tensors_ = std::move(tensors);
  return m;
}

DType Model::dtype() const {
  return dtype_of(tensors_.at("model.embed_tokens.weight"));
}

const at::Tensor& Model::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw Error(source_ + ": no tensor '" + name + "'");
  return it->second;
}

std::vector<at::Tensor> Model::layer_tensors(std::size_t layer) const {
  RONDO_ASSERT(layer < layers_.size());
  std::vector<at::Tensor> out;
  for (const ParamSpec& p : layers_[layer].params)
    out.push_back(tensors_.at(p.name));
  return out;
}

std::int64_t Model::param_count() const {
  std::int64_t n = 0;
  for (const LayerSpec& l : layers_)
    n += l.param_count();
  return n;
}

at::Tensor Model::hidden(const TokenBatch& batch) const {
  const at::Tensor& emb = tensor("model.embed_tokens.weight");
  AttentionContext ctx = make_attention_context(config_, batch, emb.scalar_type());
  at::Tensor x = embed(emb, batch.tokens);
  for (std::size_t i = 1; i + 1 < layers_.size(); ++i)
    x = block_forward(config_, BlockWeights::bind(layers_[i], layer_tensors(i)), x, ctx);
  return x;
}

at::Tensor Model::logits(const TokenBatch& batch) const {
  std::vector<at::Tensor> head = layer_tensors(layers_.size() - 1);
  return head_logits(config_, head[0], head[1], hidden(batch));
}

at::Tensor Model::loss_sum(const TokenBatch& batch, const at::Tensor& targets) const {
  std::vector<at::Tensor> head = layer_tensors(layers_.size() - 1);
  return head_loss_sum(config_, head[0], head[1], hidden(batch), targets);
}

at::Tensor next_token_targets(const TokenBatch& batch, const at::Tensor& loss_mask) {
  at::Tensor tokens = batch.tokens.to(at::kLong);
  const std::int64_t T = tokens.size(1);
  at::Tensor targets = at::full_like(tokens, -100);
  if (T > 1) {
    at::Tensor next = tokens.narrow(1, 1, T - 1);
    at::Tensor same = at::ones_like(next, at::kBool);
    if (batch.doc_ids.defined()) {
      at::Tensor d = batch.doc_ids.to(at::kLong);
      same = d.narrow(1, 1, T - 1).eq(d.narrow(1, 0, T - 1));
    }
    if (loss_mask.defined()) same = same & loss_mask.narrow(1, 1, T - 1).to(at::kBool);
    targets.narrow(1, 0, T - 1).copy_(at::where(same, next, at::full_like(next, -100)));
  }
  return targets;
}

}  // namespace rondo::models
