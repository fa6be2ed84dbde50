// attention_bench: packed rows attended per document against the same rows under a (B, 1, T, T)
// mask, one transformer block forward and backward, side by side in one run (ratios, never
// absolute targets: these machines are shared). The choice models::attend_per_document makes
// (per document on the CPU from an average of 32 tokens a document; on CUDA through variable-length
// flash attention) is what this measures: a ratio above 1 means per document is faster.
//
//   attention_bench [--device cpu|cuda] [--dtype float|bf16] [--reps 3]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "models/attention_masks.h"
#include "models/layers.h"
#include "models/model.h"

using namespace rondo;
using namespace rondo::models;

namespace {

double seconds_of(const std::function<void()>& f, int reps, bool cuda) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    if (cuda) at::zeros({1}, at::kCUDA).item<float>();  // a sync: nothing queued before the clock
    const auto t0 = std::chrono::steady_clock::now();
    f();
    if (cuda) at::zeros({1}, at::kCUDA).item<float>();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "cpu", dtype_name = "float";
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--device")
      device_name = argv[i + 1];
    else if (a == "--dtype")
      dtype_name = argv[i + 1];
    else if (a == "--reps")
      reps = std::stoi(argv[i + 1]);
  }
  const at::Device device = device_name == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType dtype = dtype_name == "bf16" ? at::kBFloat16 : at::kFloat;
  // A block of Qwen3-0.6B's attention shape (16 query heads, 8 key/value heads of 64), narrowed
  // MLP: attention is what differs.
  const ModelConfig c = parse_hf_config(R"({"architectures":["Qwen3ForCausalLM"],
    "vocab_size":1000,"hidden_size":1024,"intermediate_size":256,"num_hidden_layers":1,
    "num_attention_heads":16,"num_key_value_heads":8,"head_dim":64})",
                                        "bench config");
  const LayerSpec spec = layer_specs(c)[1];
  at::manual_seed(5);
  std::vector<at::Tensor> w;
  for (const ParamSpec& p : spec.params)
    w.push_back((0.05 * at::randn(p.shape) + (p.shape.size() == 1 ? 1.0 : 0.0)).to(device, dtype));
  std::printf("attention_bench on %s, %s; one block forward and backward, best of %d\n",
              device_name.c_str(), dtype_name.c_str(), reps);
  std::printf("%6s %5s %9s %12s %14s %8s %s\n", "rows", "T", "docs/row", "masked ms", "per-doc ms",
              "ratio", "chosen");
  struct Case {
    int rows, T, docs;
  };
  for (const Case k : {Case{2, 128, 8}, Case{2, 256, 8}, Case{2, 512, 2}, Case{2, 512, 8},
                       Case{1, 2048, 2}, Case{1, 2048, 8}, Case{1, 2048, 32}}) {
    at::Tensor docs =
        at::arange(k.T, at::kLong).mul(k.docs).div(k.T, "floor").unsqueeze(0).expand({k.rows, k.T});
    const TokenBatch batch{at::zeros({k.rows, k.T}, at::kLong).to(device), docs.to(device)};
    AttentionContext masked = attention_context_without_masks(c, batch, dtype);
    limit_attention(masked, c, docs.to(device), DocSpans{}, device, dtype);
    AttentionContext per_doc = attention_context_without_masks(c, batch, dtype);
    const DocSpans spans = doc_spans(docs.contiguous());
    const bool chosen = attend_per_document(c, spans, device, dtype);
    per_doc.doc_offsets = spans.offsets;
    per_doc.max_doc_len = spans.max_len;
    if (device.is_cuda()) per_doc.doc_offsets_dev = spans.offsets_tensor().to(device);
    if (device.is_cuda() && !chosen) {
      std::printf("%6d %5d %9d: flash attention per document does not run here\n", k.rows, k.T,
                  k.docs);
      continue;
    }
    const at::Tensor x0 = at::randn({k.rows, k.T, c.hidden_size}).to(device, dtype);
    auto step = [&](const AttentionContext& ctx) {
      std::vector<at::Tensor> ww;
      for (const at::Tensor& t : w)
        ww.push_back(t.detach().requires_grad_(true));
      at::Tensor x = x0.detach().requires_grad_(true);
      block_forward(c, BlockWeights::bind(spec, ww), x, ctx).sum().backward();
    };
    const double m = seconds_of([&] { step(masked); }, reps, device.is_cuda());
    const double d = seconds_of([&] { step(per_doc); }, reps, device.is_cuda());
    std::printf("%6d %5d %9d %12.2f %14.2f %8.2f %s\n", k.rows, k.T, k.docs, m * 1e3, d * 1e3,
                m / d, chosen ? "per document" : "masked");
  }
  return 0;
}
