"""Rondo's forward pass against transformers on the CPU in fp32, for every family and the shapes
that break naive implementations (GQA, tied embeddings, head_dim != hidden/heads, QKV bias, q/k
norm, llama3, linear, yarn (with mscale and untruncated ramp) and dynamic rope scaling, sliding
window in every layer or per layer, mixture-of-experts blocks of Qwen3-MoE, Mixtral and GPT-OSS
(attention sinks, its router and clamped SwiGLU experts)), loaded from single-file and sharded safetensors.
Tolerance: 1e-4 absolute on logits and loss (fp32 accumulation-order differences are ~1e-6 here).
"""
import json
import os

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.numpy import load_file

from rondo_oracle import driver

TOL = 1e-4
V = 211  # a vocabulary size that is no power of two

VARIANTS = {
    "llama_gqa_tied": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3_rope_scaling": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0)),
    "llama_head_dim_bias": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=12, attention_bias=True,
        mlp_bias=True)),
    "mistral_sliding_window": (T.MistralForCausalLM, T.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=9)),
    "qwen2_qkv_bias": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=1)),
    "qwen3_qk_norm": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    "llama_linear_rope": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2_yarn_rope": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3_yarn_mscale": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                      "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
                      "truncate": False})),
    # Qwen's per-layer windows: the layers from max_window_layers on, or as layer_types says.
    "qwen2_window_layers": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
        max_window_layers=1)),
    "qwen3_layer_types": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Mixture of experts: top-k routing without renormalisation, a dense layer among sparse ones
    # (mlp_only_layers); renormalised top-3 of 5 on every second layer (decoder_sparse_step);
    # Mixtral (renormalised, its own names: block_sparse_moe.experts.N.w1/w2/w3).
    "qwen3_moe_mlp_only": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
        mlp_only_layers=[1])),
    "qwen3_moe_sparse_step": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=5, num_experts_per_tok=3,
        moe_intermediate_size=20, norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral_moe": (T.MixtralForCausalLM, T.MixtralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)),
    # GPT-OSS: attention sinks, biases everywhere, sliding and full layers, YaRN rope (its
    # default), a router with a bias and a softmax over the top-k logits, fused experts with the
    # clamped SwiGLU.
    "gpt_oss": (T.GptOssForCausalLM, T.GptOssConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Dynamic (NTK) rope grows its base once the batch's longest position passes
    # max_position_embeddings: 16 here, so that the 23-token rows below do.
    "mistral_dynamic_rope": (T.MistralForCausalLM, T.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
}
# Dynamic rope depends on the batch's longest position, so documents packed into one row are not
# each what they are alone past max_position_embeddings (transformers is the same); training rows
# never pass it (data.seq_len <= max_position_embeddings).
PACKED_VARIANTS = sorted(v for v in VARIANTS if "dynamic" not in v)


def make_model(name, seed):
    model_cls, config_cls, extra = VARIANTS[name]
    torch.manual_seed(seed)
    config = config_cls(**{**dict(vocab_size=V, hidden_size=32, intermediate_size=56,
                                  num_hidden_layers=3, max_position_embeddings=256,
                                  rms_norm_eps=1e-5), **extra})
    model = model_cls(config).eval()
    with torch.no_grad():  # no zeros and no ones: biases and norm weights matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def rondo_forward(model_dir, tmp_path, tokens, doc_ids=None):
    batch = {"tokens": tokens.tolist(), "dtype": "F32"}
    if doc_ids is not None:
        batch["doc_ids"] = doc_ids.tolist()
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    out = tmp_path / "out.safetensors"
    driver("forward", model_dir, tmp_path / "batch.json", out)
    return load_file(str(out))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_and_loss_match_transformers(name, sharded, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    model = make_model(name, seed)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir, max_shard_size="40KB" if sharded else "10GB")
    assert (model_dir / "model.safetensors.index.json").exists() == sharded

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, 23), generator=g)
    with torch.no_grad():
        ref = model(input_ids=tokens, labels=tokens)
    out = rondo_forward(model_dir, tmp_path, tokens)
    diff = np.abs(out["logits"] - ref.logits.numpy())
    worst = np.unravel_index(diff.argmax(), diff.shape)
    assert diff.max() < TOL, f"logits differ by {diff.max():.3g} at {worst}"
    loss = out["loss_sum"] / out["target_count"]
    assert out["target_count"] == 2 * 22
    assert abs(float(loss) - ref.loss.item()) < TOL, (float(loss), ref.loss.item())


# Document lengths per packed row: short ones (Rondo attends under a mask) and ones of 32 tokens
# or more on average (Rondo attends per document on the CPU, models/attention_masks.h).
PACKED_LAYOUTS = {"masked": [[7, 11, 6], [1, 20, 3]], "per_document": [[40, 1, 55], [30, 66]]}


@pytest.mark.parametrize("layout", sorted(PACKED_LAYOUTS))
@pytest.mark.parametrize("name", PACKED_VARIANTS)
def test_packed_rows_equal_documents_run_separately(name, layout, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    model = make_model(name, seed)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    rows = PACKED_LAYOUTS[layout]
    docs = [[torch.randint(0, V, (n,), generator=g) for n in row] for row in rows]
    tokens = torch.stack([torch.cat(row) for row in docs])
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])
    out = rondo_forward(model_dir, tmp_path, tokens, doc_ids)
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            with torch.no_grad():
                ref = model(input_ids=doc[None]).logits[0].numpy()
            got = out["logits"][r, start:start + len(doc)]
            diff = np.abs(got - ref).max()
            assert diff < TOL, f"row {r}, document at {start}: logits differ by {diff:.3g}"
            start += len(doc)
    # Targets never cross a document boundary: one fewer target per document.
    assert out["target_count"] == sum(sum(n - 1 for n in row) for row in rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_checkpoints_load_to_the_same_weights(dtype, tmp_path):
    """A bf16 or f16 checkpoint read by Rondo into fp32 gives the logits transformers gives when it
    loads the same files into fp32 (the upcast is exact, so the same 1e-4 holds)."""
    model = make_model("qwen3_qk_norm", int.from_bytes(os.urandom(4), "little"))
    model.to(dtype).save_pretrained(tmp_path / "model")
    ref_model = type(model).from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    tokens = torch.randint(0, V, (1, 17))
    with torch.no_grad():
        ref = ref_model(input_ids=tokens).logits.numpy()
    out = rondo_forward(tmp_path / "model", tmp_path, tokens)
    assert np.abs(out["logits"] - ref).max() < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "f16", "f32"])
def test_rms_norm_rounds_as_each_family_does(dtype, tmp_path):
    """RMSNorm in half precision, bit for bit as transformers' module of each family: Llama's and
    Qwen3's cast the normalised rows back before the weight, GPT-OSS's multiplies by the weight in
    fp32 first (the two differ on these inputs, so the test tells them apart)."""
    from safetensors.torch import load_file as load_torch, save_file
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    C, eps = 64, 1e-5
    x = (3 * torch.randn(2, 7, C, generator=g)).to(dtype)
    w = (1 + 0.5 * torch.randn(C, generator=g)).to(dtype)
    save_file({"x": x, "weight": w}, str(tmp_path / "in.safetensors"))
    refs = {}
    for name, norm, config in [
            ("llama", LlamaRMSNorm, T.LlamaConfig), ("qwen3", Qwen3RMSNorm, T.Qwen3Config),
            ("gpt_oss", GptOssRMSNorm, T.GptOssConfig)]:
        module = norm(C, eps=eps).to(dtype)
        with torch.no_grad():
            module.weight.copy_(w)
            refs[name] = module(x)
        config(vocab_size=V, hidden_size=C, num_attention_heads=4, num_key_value_heads=4,
               head_dim=16, rms_norm_eps=eps,
               num_hidden_layers=1).save_pretrained(tmp_path / name)
        driver("rms-norm", tmp_path / name / "config.json", tmp_path / "in.safetensors",
               tmp_path / f"{name}.safetensors")
        got = load_torch(tmp_path / f"{name}.safetensors")["y"]
        assert got.dtype == refs[name].dtype, (name, got.dtype)
        assert torch.equal(got, refs[name]), \
            f"{name}: {(got.float() - refs[name].float()).abs().max():.3g} off"
    if dtype != torch.float32:
        assert not torch.equal(refs["llama"], refs["gpt_oss"]), "the families' roundings agree here"


FP4 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4_encode(w):
    """A fused expert weight (E, in, out) as GPT-OSS's checkpoints store it: rows of the (E, out, in)
    transpose in groups of 32, each a power-of-two scale (+127) and 4-bit e2m1 codes, two per byte,
    low nibble first. Written here from the format's description, not with Rondo."""
    w = w.transpose(1, 2).contiguous()
    E, rows, cols = w.shape
    g = w.reshape(E, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6)).clamp(-127, 127)
    codes = ((g / torch.pow(2.0, exp)[..., None])[..., None] - FP4).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantises_them(tmp_path):
    """A GPT-OSS folder whose experts are MXFP4 (gate_up_proj_blocks/_scales, down_proj_*, with
    the quantization_config the official checkpoints carry): Rondo's logits equal transformers'
    on the weights it dequantises itself (Mxfp4Config(dequantize=True))."""
    from safetensors.torch import load_file as load_torch, save_file
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    torch.manual_seed(seed)
    config = T.GptOssConfig(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                            max_position_embeddings=256, rms_norm_eps=1e-5)
    model = T.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "plain")
    tensors, packed = {}, 0
    for name, t in load_torch(str(tmp_path / "plain" / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_encode(t)
            packed += 1
        else:
            tensors[name] = t
    assert packed == 2 * config.num_hidden_layers
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))

    ref = T.GptOssForCausalLM.from_pretrained(
        folder, quantization_config=T.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    # The reference did dequantise: its experts are not the unquantised ones.
    plain = model.model.layers[0].mlp.experts.gate_up_proj
    deq = ref.model.layers[0].mlp.experts.gate_up_proj
    assert deq.dtype == torch.float32 and 1e-3 < float((deq - plain).norm() / plain.norm()) < 0.3
    tokens = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = ref(input_ids=tokens).logits.numpy()
    out = rondo_forward(folder, tmp_path, tokens)
    diff = np.abs(out["logits"] - want).max()
    assert diff < TOL, f"logits differ by {diff:.3g}"

    # A LoRA run's frozen base: the experts dequantised at load (quantize = none) or kept in MXFP4
    # and dequantised per use (stored; what the devices compute with), both bit for bit the
    # experts transformers dequantises; everything else as stored.
    want_tensors = {n: t.detach().numpy() for n, t in ref.state_dict().items()}
    for quantize in ("none", "stored"):
        kept = driver("quantised-base", folder, quantize, 0, tmp_path / f"{quantize}.safetensors")
        kept = sorted(line.split()[1:] for line in kept.splitlines() if line.startswith("kept "))
        experts = sorted(n for n in want_tensors if n.endswith(("gate_up_proj", "down_proj")))
        assert kept == ([] if quantize == "none" else [[n, "MXFP4"] for n in experts]), kept
        got = load_file(tmp_path / f"{quantize}.safetensors")
        for name, t in got.items():
            assert np.array_equal(t, want_tensors[name]), f"{quantize}: {name}"
