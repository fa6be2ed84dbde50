"""Data parallelism with a mixture of experts (docs/distributed.md): `rondo train` of a tiny
transformers Mixtral, its router's load-balancing loss on (output_router_logits), as 2 ranks on
loopback (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them) against one process
running the same global batch. Each rank adds the router loss of its own microbatches weighted by
1 / (the microbatches of the whole step, over every rank), so the sum across ranks is one process's.

Compared: every step's loss (the router loss included) within 1e-5 and every tensor of the
exported adapter within 1e-4 (the bounds of tests/cli/distributed_test.cpp, why there). The router
loss's coefficient is large (0.5) so that its weighting shows: with each rank weighting its own
microbatch by 1 / (its own count) instead, the losses differ far beyond the bound (docs/distributed.md
gives the figure measured with that mutation).
The one-process run against transformers is tests/oracle/test_engine.py's mixtral_aux."""
import json
import os
import socket
import subprocess

import numpy as np
import torch
import transformers as T
from safetensors.numpy import load_file

import tokenizer_builders as tb
from rondo_oracle import RONDO, lora_chat_config

QA = [("hello", "hi there"), ("two plus two", "four"), ("colour of the sky", "blue"),
      ("opposite of hot", "cold"), ("a baby cat", "a kitten"), ("days in a week", "seven"),
      ("capital of France", "Paris"), ("bees make", "honey")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_events(run):
    return [e for e in (json.loads(l) for l in (run / "events.jsonl").read_text().splitlines())
            if e["type"] == "step"]


def config(tmp_path, base_dir, data, name):
    return lora_chat_config(tmp_path / f"{name}.toml", base_dir, data, tmp_path / name, steps=6,
                            batch_rows=1, lr=0.01, seed=7, sim_devices=1, exports='["adapter"]')


def test_moe_router_loss_on_two_ranks_equals_one_process(tmp_path):
    torch.manual_seed(11)
    tok = tb.qwen2()
    base_dir = tmp_path / "base"
    tb.save_chatml(tok, base_dir)
    coef = 0.5  # large, so that its weighting shows in the loss
    config_ = T.MixtralConfig(vocab_size=tok.get_vocab_size(), hidden_size=32,
                              intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=128, output_router_logits=True,
                              router_aux_loss_coef=coef, attn_implementation="eager")
    T.MixtralForCausalLM(config_).eval().save_pretrained(base_dir, safe_serialization=True)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in QA))

    one = config(tmp_path, base_dir, data, "one")
    p = subprocess.run([RONDO, "train", str(one)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr

    two = config(tmp_path, base_dir, data, "two")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([RONDO, "train", str(two)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"rank {rank}:\n{out}"

    a, b = step_events(tmp_path / "one"), step_events(tmp_path / "two")
    assert [e["step"] for e in a] == [e["step"] for e in b] == list(range(1, 7))
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    wa = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    weight_diff = max(float(np.abs(wa[k].astype(np.float64) - wb[k]).max()) for k in wa)
    print(f"losses differ by {loss_diff:.3g} at most, the adapter by {weight_diff:.3g}")
    assert loss_diff < 1e-5
    assert weight_diff < 1e-4

