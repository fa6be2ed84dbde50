"""LoRA as PEFT computes it: a tiny transformers model with a peft LoRA adapter (random, non-zero
B so the adapter matters), saved with save_pretrained; Rondo loads the base folder and the adapter
folder (adapter_config.json + adapter_model.safetensors) and its logits equal peft's within 1e-4
(fp32, different summation orders; the adapter's own contribution is checked to be far larger).
Covers dense families and the mixtures of experts (Qwen3-MoE, Mixtral: experts and router
adapters in PEFT's target_parameters form; GPT-OSS: its experts and router named as
target_parameters), all-linear and a subset of
targets, plain and rsLoRA scaling. Also: adapter configs Rondo cannot reproduce are refused with
the field named; and 3 LoRA training steps from the same starting adapters equal peft +
torch.optim.AdamW (the load-balancing loss on for MoE)."""
import json
import os

import numpy as np
import peft
import pytest
import torch
import torch.nn.functional as F
import transformers as T
from safetensors.numpy import load_file

from rondo_oracle import driver, DriverError

V = 64
OSS_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"]
FAMILIES = {
    "llama": (T.LlamaForCausalLM, T.LlamaConfig, dict(num_key_value_heads=2,
                                                     tie_word_embeddings=False)),
    "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(num_key_value_heads=2,
                                                     tie_word_embeddings=True)),
    # Mixtures of experts (one dense block in Qwen3-MoE). PEFT turns MLP module names into
    # target_parameters on transformers 5's fused experts (gate_up_proj with rank and alpha
    # doubled, down_proj), and leaves the dense block's MLP alone; Rondo does the same.
    "qwen3_moe": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": (T.MixtralForCausalLM, T.MixtralConfig, dict(
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2)),
    # GPT-OSS: its experts (fused x @ W, interleaved gate/up) and router are parameters to PEFT,
    # adapted when named in target_parameters; all-linear reaches only its attention.
    "gpt_oss": (T.GptOssForCausalLM, T.GptOssConfig, dict(
        num_key_value_heads=2, head_dim=8, num_local_experts=3, num_experts_per_tok=2,
        sliding_window=4)),
}
ADAPTERS = {
    "all_linear_r4": dict(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=False),
    "qv_r8_rslora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                         use_rslora=True),
    "mlp_r2": dict(r=2, lora_alpha=3, target_modules=["gate_proj", "up_proj", "down_proj"],
                   use_rslora=False),
    # Mixtral's MLP names (w1 gate, w3 up, w2 down), on its experts, with attention.
    "mixtral_experts_rslora": dict(r=3, lora_alpha=4, target_modules=["q_proj", "w1", "w3", "w2"],
                                   use_rslora=True),
    # GPT-OSS's experts and router, as parameters (rank and alpha as given), with attention.
    "oss_experts": dict(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"],
                        target_parameters=OSS_PARAMETERS, use_rslora=False),
}


def make(tmp_path, family, adapter, seed):
    model_cls, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64,
                        attn_implementation="eager", **extra)
    base = model_cls(config).eval()
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **ADAPTERS[adapter]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; make the adapter count
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path / "adapter")
    return base, model


MOE = {"qwen3_moe", "mixtral", "gpt_oss"}
# PEFT's all-linear on a mixture of experts adapts attention, experts and the router
# (target_parameters gate.weight); Mixtral's MLP names are its own.
CASES = [(f, a) for f in FAMILIES for a in ADAPTERS
         if f != "gpt_oss" and a != "oss_experts" and ((a == "mixtral_experts_rslora") == (f == "mixtral") or
                                (f == "mixtral" and a in ("qv_r8_rslora", "all_linear_r4")))]
CASES += [("gpt_oss", "qv_r8_rslora"), ("gpt_oss", "all_linear_r4"), ("gpt_oss", "oss_experts")]
EXPERTS = {"qwen3_moe": "mlp_r2", "mixtral": "mixtral_experts_rslora",  # an adapter on experts
           "gpt_oss": "oss_experts"}


@pytest.mark.parametrize("family,adapter", CASES)
def test_logits_equal_peft(family, adapter, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    _, model = make(tmp_path, family, adapter, seed)
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(input_ids=tokens).logits.float().numpy()
        with model.disable_adapter():
            base_logits = model(input_ids=tokens).logits.float().numpy()
    (tmp_path / "batch.json").write_text(json.dumps({"tokens": tokens.tolist()}))
    driver("lora-logits", tmp_path / "base", tmp_path / "adapter", tmp_path / "batch.json",
           tmp_path / "out.safetensors")
    got = load_file(tmp_path / "out.safetensors")["logits"]
    assert np.abs(want - base_logits).max() > 1e-2, "the adapter hardly changes the logits"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_with_an_adapter_equals_peft_greedy(family, tmp_path):
    """`rondo generate --adapter` (the driver's generate with "adapter", the same loader): the
    greedy tokens of the base with the PEFT adapter folded in equal greedy decoding with peft's
    model (full forward each step, fp32); a near tie (top-2 gap under 1e-4) may pick otherwise."""
    # A random adapter need not change 16 greedy tokens (a small random model's argmax can hold):
    # the precondition is drawn again, up to 8 seeds, before Rondo is asked anything.
    for attempt in range(8):
        seed = int.from_bytes(os.urandom(4), "little")
        print("seed", seed)
        case = tmp_path / f"seed{attempt}"
        _, model = make(case, family, EXPERTS.get(family, "all_linear_r4"), seed)
        prompt = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref, gaps, seq = [], [], list(prompt)
        with torch.no_grad():
            for _ in range(16):
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
                top = torch.topk(logits, 2).values
                ref.append(int(logits.argmax()))
                gaps.append(float(top[0] - top[1]))
                seq.append(ref[-1])
            base = []
            with model.disable_adapter():
                seq = list(prompt)
                for _ in range(16):
                    base.append(int(model(input_ids=torch.tensor([seq]),
                                          use_cache=False).logits[0, -1].argmax()))
                    seq.append(base[-1])
        if ref != base:
            break
    assert ref != base, "no adapter of 8 seeds changes what is generated: the test would not see it"
    (case / "in.json").write_text(json.dumps({"prompt": prompt, "max_new_tokens": 16,
                                              "adapter": str(case / "adapter")}))
    driver("generate", case / "base", case / "in.json", case / "out.json")
    got = json.loads((case / "out.json").read_text())["tokens"]
    eos = model.config.eos_token_id  # Rondo stops after it; the reference ran on
    if eos in ref:
        ref = ref[:ref.index(eos) + 1]
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gaps[i] < 1e-4, f"step {i}: {a} vs {b}, top-2 gap {gaps[i]:.3g} ({got} vs {ref})"
            return
    assert got == ref


def test_an_adapter_of_another_model_is_refused(tmp_path):
    make(tmp_path / "a", "llama", "all_linear_r4", 1)
    other = tmp_path / "b"
    config_cls = FAMILIES["llama"][1]
    torch.manual_seed(2)
    T.LlamaForCausalLM(config_cls(vocab_size=V, hidden_size=48, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64)).save_pretrained(other)
    (tmp_path / "in.json").write_text(json.dumps({"prompt": [1, 2], "max_new_tokens": 2,
                                                  "adapter": str(tmp_path / "a" / "adapter")}))
    with pytest.raises(DriverError) as e:
        driver("generate", other, tmp_path / "in.json", tmp_path / "out.json")
    assert "does not fit" in str(e.value) and "lora_A.weight is [4, 32], this base needs [4, 48]" \
        in str(e.value), str(e.value)


@pytest.mark.parametrize("field,value,message", [
    ("use_dora", True, "use_dora"),
    ("bias", "lora_only", "bias"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("rank_pattern", {"q_proj": 2}, "rank_pattern"),
    ("target_modules", ["q_proj", "embed_tokens"], "embed_tokens"),
    ("r", 0, "rank"),
])
def test_unsupported_adapter_configs_are_refused(field, value, message, tmp_path):
    make(tmp_path, "llama", "all_linear_r4", 1)
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    (tmp_path / "batch.json").write_text(json.dumps({"tokens": [[1, 2, 3]]}))
    with pytest.raises(DriverError) as e:
        driver("lora-logits", tmp_path / "base", tmp_path / "adapter", tmp_path / "batch.json",
               tmp_path / "out.safetensors")
    assert "adapter_config.json" in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_adapter_exports_load_in_peft_and_transformers(family, tmp_path):
    """Rondo trains LoRA adapters (engine, 2 simulated devices, 3 steps) and exports them: the PEFT
    folder loaded by peft onto the transformers base, and the merged checkpoint loaded by
    transformers alone, both give Rondo's logits within 1e-4 (fp32)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    make(tmp_path, family, EXPERTS.get(family, "all_linear_r4"), seed)
    g = torch.Generator().manual_seed(seed)
    steps = [[torch.randint(0, V, (2, 10), generator=g).tolist() for _ in range(2)]
             for _ in range(3)]
    eval_tokens = torch.randint(0, V, (2, 9), generator=g)
    (tmp_path / "in.json").write_text(json.dumps({
        # On a mixture of experts: the experts' gate_up_proj and down_proj and the router (PEFT's
        # target_parameters), written so that peft reads them back.
        "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"] +
                 (["gate_proj", "up_proj", "gate"] if family in MOE else []), "rslora": True},
        "seed": seed % 2**31, "lr": 1e-2, "steps": steps, "eval_tokens": eval_tokens.tolist()}))
    out = tmp_path / "out"
    driver("lora-train-export", tmp_path / "base", tmp_path / "in.json", out)
    rondo = load_file(out / "logits.safetensors")["logits"]

    model_cls = FAMILIES[family][0]
    base = model_cls.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    with torch.no_grad():
        base_logits = base(input_ids=eval_tokens).logits.float().numpy()
    peft_model = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        via_peft = peft_model(input_ids=eval_tokens).logits.float().numpy()
    merged = model_cls.from_pretrained(out / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        via_merged = merged(input_ids=eval_tokens).logits.float().numpy()
    scale = np.abs(via_peft).max()
    assert np.abs(via_peft - base_logits).max() > 1e-3 * scale, "training did not move the adapter"
    np.testing.assert_allclose(rondo, via_peft, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(via_merged, via_peft, rtol=0, atol=1e-4 * scale)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] is True
    if family in MOE:  # the experts' and router's adapters are in what peft loaded
        adapted = {n for n, _ in peft_model.named_parameters() if "lora_A" in n}
        assert any(".mlp.experts." in n for n in adapted), sorted(adapted)
        assert any(".mlp.gate." in n or ".mlp.router." in n for n in adapted), sorted(adapted)


def test_moe_adapters_rondo_cannot_reproduce_are_refused(tmp_path):
    """Training refuses gate_proj without up_proj (one fused weight per expert, Qwen3-MoE's and
    GPT-OSS's alike), dropout on experts or the router (PEFT cannot apply it) and the router of a
    dense model, each saying what to do."""
    make(tmp_path, "qwen3_moe", "mlp_r2", 1)

    def train(lora, base=tmp_path / "base"):
        (tmp_path / "in.json").write_text(json.dumps({
            "lora": {"r": 4, "alpha": 8, "rslora": False, **lora}, "seed": 1, "lr": 1e-2,
            "steps": [[[1, 2, 3, 4]]], "eval_tokens": [[1, 2]]}))
        with pytest.raises(DriverError) as e:
            driver("lora-train-export", base, tmp_path / "in.json", tmp_path / "out")
        return str(e.value)
    msg = train({"targets": ["q_proj", "gate_proj"]})
    assert "gate_proj and up_proj" in msg and "target both or neither" in msg, msg
    msg = train({"targets": ["gate"], "dropout": 0.1})
    assert "dropout must be 0 for adapters on experts or the router" in msg, msg
    make(tmp_path / "dense", "llama", "qv_r8_rslora", 1)
    msg = train({"targets": ["gate"]}, tmp_path / "dense" / "base")
    assert "'gate' is a mixture of experts' router" in msg, msg
    make(tmp_path / "oss", "gpt_oss", "qv_r8_rslora", 1)
    msg = train({"targets": ["q_proj", "up_proj"]}, tmp_path / "oss" / "base")
    assert "gate_proj and up_proj" in msg and "target both or neither" in msg, msg


def peft_router_logits(model, tokens):
    """The model's output and every router's logits (forward hooks on the routers, which see the
    router's adapter: PEFT swaps the adapted weight in around the router's own forward)."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    logits = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: logits.append(out[0]))
             for r in routers]
    try:
        out = model(input_ids=tokens)
    finally:
        for h in hooks:
            h.remove()
    return out, tuple(logits)


@pytest.mark.parametrize("family,tile", [("llama", 0), ("llama", 7), ("qwen3_moe", 0),
                                         ("mixtral", 0), ("gpt_oss", 0)])
def test_three_lora_steps_equal_peft_and_adamw(family, tile, tmp_path):
    """LoRA training from the same starting adapters (peft's, B made non-zero), 3 steps of 2
    microbatches: Rondo's engine (2 simulated devices, a recomputed backward stage) against peft
    + torch.optim.AdamW. On the mixtures of experts: all-linear as peft resolves it (attention,
    the experts' gate_up_proj and down_proj, the router's gate.weight; GPT-OSS: all-linear and
    its experts and router named as target_parameters) and the router's
    load-balancing loss on (each microbatch's counts 1/2), so every kind of adapter and the aux
    loss's gradient are in the trajectory; Llama once more with its MLPs tiled (sequence
    tiling, tiles of 7 tokens). AdamW eps 1e-4 (see test_engine.py: it keeps Adam from
    magnifying rounding noise in entries whose gradient cancels)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    model_cls, config_cls, extra = FAMILIES[family]
    moe = family in MOE
    torch.manual_seed(seed)
    config = config_cls(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64,
                        attn_implementation="eager", **extra,
                        **(dict(output_router_logits=True, router_aux_loss_coef=0.05)
                           if moe else {}))
    base = model_cls(config).eval()
    with torch.no_grad():  # far from the initialisation: routing and attention not uniform
        for p in base.parameters():
            p.add_(0.1 * torch.randn_like(p))
    base.save_pretrained(tmp_path / "base")
    oss = family == "gpt_oss"
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear",
        **(dict(target_parameters=OSS_PARAMETERS) if oss else {})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "init")
    g = torch.Generator().manual_seed(seed)
    steps = [[torch.randint(0, V, (2, 10), generator=g) for _ in range(2)] for _ in range(3)]
    lr, eps = 1e-3, 1e-4
    (tmp_path / "in.json").write_text(json.dumps({
        "lora": {"r": 2, "alpha": 4, "targets": ["all-linear"] + (["gate"] if moe else []) +
                 (["gate_proj", "up_proj", "down_proj"] if oss else []),
                 "rslora": False},
        "seed": 1, "lr": lr, "eps": eps, "init_adapter": str(tmp_path / "init"),
        "mlp_tile_tokens": tile,  # sequence tiling: the MLPs over tiles of 7 of a microbatch's 20
        "steps": [[t.tolist() for t in step] for step in steps], "eval_tokens": [[1, 2]]}))
    driver("lora-train-export", tmp_path / "base", tmp_path / "in.json", tmp_path / "out")
    got = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")

    model.train()  # no dropout anywhere; train() only for autograd through peft's layers
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=0.0)
    for step in steps:
        opt.zero_grad()
        count = sum(int(t[:, 1:].numel()) for t in step)
        for tokens in step:
            out, router_logits = peft_router_logits(model, tokens)
            loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V).float(),
                                   tokens[:, 1:].reshape(-1), reduction="sum") / count
            if moe:
                assert 0 < len(router_logits) == sum(
                    1 for m in model.modules() if type(m).__name__.endswith("TopKRouter"))
                loss = loss + config.router_aux_loss_coef * load_balancing_loss_func(
                    router_logits, config.num_local_experts, config.num_experts_per_tok,
                    None) / len(step)
            loss.backward()
        opt.step()
    want = {n.replace(".default", ""): p.detach().numpy() for n, p in model.named_parameters()
            if p.requires_grad}
    assert set(got) == set(want)
    start = load_file(tmp_path / "init" / "adapter_model.safetensors")
    if moe:
        assert any(".mlp.experts." in n for n in want)
        assert any(".mlp.gate." in n or ".mlp.router." in n for n in want)
    for name, ref in want.items():
        scale = np.abs(ref).max()
        assert np.abs(ref - start[name]).max() > 1e-4 * scale, f"{name} hardly moved"
        np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
