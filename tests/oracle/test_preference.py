"""Preference tuning against TRL 1.16 (tests/oracle/trl_reference.py runs its trainers): `rondo
train` with training.objective dpo (sigmoid and IPO), orpo and simpo, LoRA (from the same
starting adapter, B non-zero) and full fine-tuning, on tiny models of two families with their own
tokenisation: Qwen2 (byte-level BPE, ChatML, no BOS) on conversational pairs with explicit
prompts, and Llama (SentencePiece with BOS) on plain-text pairs whose prompt is implicit (the
common start of chosen and rejected). Three steps of two microbatches of two pairs, examples in
file order; every step's loss and TRL's logged preference metrics within 1e-4 (relative, or
absolute below 1), and the trained adapter or weights within 1e-4 of their largest entry.
fp32 everywhere, no dropout, constant learning rate, no clipping, AdamW eps 1e-4 (as
test_engine.py: it keeps Adam from magnifying rounding noise where a gradient cancels)."""
import json
import os
import subprocess

import numpy as np
import peft
import pytest
import torch
import transformers as T
from safetensors.numpy import load_file

import tokenizer_builders as tb
from rondo_oracle import RONDO
from trl_reference import run_trl

STEPS, PAIRS, ACCUM, MAX_LEN = 3, 2, 2, 40
LR, EPS = 2e-3, 1e-4

QA = [("hello", "hi there, nice to meet you", "go away"),
      ("two plus two", "four", "five, I think"),
      ("colour of the sky", "blue on a clear day", "green"),
      ("opposite of hot", "cold", "warm or maybe lukewarm, it depends"),
      ("a baby cat", "a kitten", "a puppy"),
      ("days in a week", "seven days", "ten"),
      ("capital of France", "Paris is the capital", "Lyon"),
      ("bees make", "honey and wax", "milk"),
      ("ice is", "frozen water", "hot stone"),
      ("the sun rises in the", "east", "west, every morning without fail"),
      ("snow is", "white", "purple"),
      ("fish live in", "water, mostly in the sea and in rivers", "trees")]

# (family, method, DPO loss, LoRA)
CASES = [("qwen2", m, l, lora) for m, l in (("dpo", "sigmoid"), ("dpo", "ipo"), ("orpo", None),
                                            ("simpo", None)) for lora in (True, False)] + \
        [("llama", "dpo", "sigmoid", True), ("llama", "dpo", "ipo", False),
         ("llama", "orpo", None, False), ("llama", "simpo", None, True)]

TRL_METRICS = {"dpo": ["rewards/chosen", "rewards/rejected", "rewards/accuracies",
                       "rewards/margins", "logps/chosen", "logps/rejected"]}
TRL_METRICS["orpo"] = TRL_METRICS["dpo"] + ["nll_loss", "log_odds_ratio", "log_odds_chosen"]
TRL_METRICS["simpo"] = TRL_METRICS["dpo"] + ["nll_loss"]


def make_model(family, folder, seed):
    torch.manual_seed(seed)
    if family == "qwen2":
        tok = tb.qwen2()
        tb.save_chatml(tok, folder)
        config = T.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32,
                               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=False, attn_implementation="eager")
        model = T.Qwen2ForCausalLM(config)
    else:
        tok = tb.llama2()
        tb.save(tok, folder)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": tb.CHATML}, f)
        config = T.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32,
                               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=False, attn_implementation="eager")
        model = T.LlamaForCausalLM(config)
    with torch.no_grad():  # away from the initialisation: log-probabilities not all alike
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval().save_pretrained(folder, safe_serialization=True)
    return model


def write_pairs(family, path):
    rows = []
    for q, good, bad in QA:
        if family == "qwen2":  # conversational, explicit prompt
            rows.append({"prompt": [{"role": "user", "content": q}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
        else:  # plain text, implicit prompt (the common start)
            rows.append({"chosen": f"Question: {q}? Answer: {good}",
                         "rejected": f"Question: {q}? Answer: {bad}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_init_adapter(model, folder):
    """A PEFT adapter (rank 4, alpha 8, every linear layer) with B != 0 written to `folder`: the
    starting adapter of a LoRA run (lora.init_adapter), and TRL's reference when it is given.
    `model` gets the adapters (PEFT wraps it in place)."""
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules="all-linear"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    pm.save_pretrained(folder)


def rondo_config(path, model, data, run, method, loss, lora, init, beta, gamma):
    lora_section = (f'[lora]\nrank = 4\nalpha = 8\ntargets = ["all-linear"]\n'
                    f'init_adapter = "{init}"\n') if lora else ""
    path.write_text(f"""
[model]
path = "{model}"
dtype = "fp32"
[data]
train = "{data}"
seq_len = {2 * MAX_LEN}
pack = false
shuffle = false
{lora_section}
[training]
method = "{"lora" if lora else "full"}"
objective = "{method}"
steps = {STEPS}
batch_rows = {PAIRS}
grad_accum = {ACCUM}
lr = {LR}
schedule = "constant"
max_grad_norm = 0
eps = {EPS}
seed = 3
[preference]
beta = {beta}
loss = "{loss or "sigmoid"}"
gamma = {gamma}
max_length = {MAX_LEN}
[hardware]
sim_devices = 1
[output]
run_dir = "{run}"
exports = {'["adapter"]' if lora else '["merged"]'}
""")


def close(got, want, what):
    tol = 1e-4 * max(1.0, abs(want))
    assert abs(got - want) <= tol, f"{what}: rondo {got!r}, TRL {want!r}"


@pytest.mark.parametrize("family,method,loss,lora", CASES)
def test_three_steps_equal_trl(family, method, loss, lora, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    base = tmp_path / "base"
    model = make_model(family, base, seed % 100000)
    data = tmp_path / "pairs.jsonl"
    write_pairs(family, data)
    init = tmp_path / "init"
    if lora:
        write_init_adapter(model, init)
    beta = {"dpo": 0.1 if loss == "sigmoid" else 0.5, "orpo": 0.1, "simpo": 2.0}[method]
    gamma = 0.5

    logs = run_trl(method, base, data, tmp_path / "trl", lora_init=init if lora else None,
                   steps=STEPS, pairs_per_microbatch=PAIRS, grad_accum=ACCUM, lr=LR, beta=beta,
                   loss_type=loss or "sigmoid", simpo_gamma=gamma, cpo_alpha=0.0,
                   max_length=MAX_LEN, seed=seed % 100000, adam_eps=EPS)

    run = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    rondo_config(cfg, base, data, run, method, loss, lora, init, beta, gamma)
    p = subprocess.run([RONDO, "train", cfg], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    steps = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()
             if json.loads(l)["type"] == "step"]
    assert len(steps) == STEPS
    for s, (got, want) in enumerate(zip(steps, logs), 1):
        close(got["loss"], want["loss"], f"step {s} loss")
        for name in TRL_METRICS[method]:
            close(got["metrics"][name], want[name], f"step {s} {name}")
        print(f"step {s}: loss {got['loss']:.6f} (TRL {want['loss']:.6f}), margin "
              f"{got['metrics']['rewards/margins']:.5f} (TRL {want['rewards/margins']:.5f})")
    if method == "dpo":
        assert logs[0]["loss"] == pytest.approx(0.6931472 if loss == "sigmoid" else 1.0 / beta ** 2
                                                / 4, rel=1e-6)  # policy = reference at step 1

    if lora:
        got = load_file(run / "adapter" / "adapter_model.safetensors")
        want = load_file(tmp_path / "trl" / "adapter_model.safetensors")
        start = load_file(init / "adapter_model.safetensors")
    else:
        got = load_file(run / "merged" / "model.safetensors")
        want = load_file(tmp_path / "trl" / "model.safetensors")
        start = load_file(base / "model.safetensors")
    assert set(want) <= set(got), sorted(set(want) - set(got))
    worst, moved = 0.0, 0.0
    for name, w in want.items():
        scale = np.abs(w).max()
        moved = max(moved, np.abs(w - start[name]).max() / scale)
        worst = max(worst, np.abs(got[name] - w).max() / scale)
        np.testing.assert_allclose(got[name], w, rtol=0, atol=1e-4 * scale, err_msg=name)
    assert moved > 1e-3, f"training hardly moved the weights ({moved:.3g})"
    print(f"largest difference / max|TRL|: {worst:.3g}; moved {moved:.3g}")


def test_three_devices_and_a_kill_and_resume_equal_one_uninterrupted_device(tmp_path):
    """DPO with LoRA on Qwen2: one simulated device uninterrupted; three devices, SIGKILLed after
    step 2's event (checkpoint at step 2), then `rondo train --resume` — which reads the
    reference log-probabilities back from the run folder instead of computing them from trained
    weights. The three-device run's losses and adapter equal the one-device run's within 1e-6
    (the same sums on other devices; they came out equal bit for bit when tried)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    base = tmp_path / "base"
    model = make_model("qwen2", base, seed % 100000)
    data = tmp_path / "pairs.jsonl"
    write_pairs("qwen2", data)
    init = tmp_path / "init"
    write_init_adapter(model, init)

    def run(name, devices, env=None, resume=False):
        cfg = tmp_path / f"{name}.toml"
        rondo_config(cfg, base, data, tmp_path / name, "dpo", "sigmoid", True, init, 0.1, 0.5)
        text = cfg.read_text().replace("sim_devices = 1", f"sim_devices = {devices}")
        cfg.write_text(text.replace("[checkpoint]", "") + "[checkpoint]\nevery = 2\n")
        args = [RONDO, "train", "--resume", tmp_path / name] if resume else [RONDO, "train", cfg]
        return subprocess.run(args, capture_output=True, text=True, timeout=600,
                              env={**os.environ, **(env or {})})

    def losses(name):
        return [json.loads(l)["loss"] for l in (tmp_path / name / "events.jsonl").read_text()
                .splitlines() if json.loads(l)["type"] == "step"]

    p = run("one", 1)
    assert p.returncode == 0, p.stdout + p.stderr
    killed = run("three", 3, {"RONDO_FAULT_KILL_AFTER_STEP": "2"})
    assert killed.returncode != 0, "the kill did not happen"
    assert (tmp_path / "three" / "reference_logps.safetensors").exists()
    p = run("three", 3, resume=True)
    assert p.returncode == 0, p.stdout + p.stderr
    want = losses("one")
    got = losses("three")[-STEPS:]  # the resumed run's events follow the killed one's
    assert len(want) == STEPS
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    a = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "three" / "adapter" / "adapter_model.safetensors")
    for name in a:
        scale = np.abs(a[name]).max()
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6 * scale, err_msg=name)
    print("losses", want, "max diff", float(np.abs(np.array(got) - np.array(want)).max()))
