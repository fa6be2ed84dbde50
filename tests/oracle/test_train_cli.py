"""PEFT compatibility end to end: `rondo train` fine-tunes a tiny transformers model (a Qwen2-style
byte-level tokenizer with ChatML, saved with save_pretrained) with LoRA on chat data, and exports
a PEFT adapter and a merged checkpoint. peft loads the adapter onto the transformers model and
transformers loads the merged folder; both give Rondo's logits with its trained state (from
rondo_oracle_driver run-logits: the run's config and the fp32 masters of its last checkpoint, not
the exported files) within 1e-4 in fp32.
`rondo export` from the last checkpoint gives the same adapter bytes."""
import json
import os
import subprocess

import numpy as np
import peft
import torch
import transformers as T
from safetensors.numpy import load_file

import tokenizer_builders as tb
from rondo_oracle import RONDO, driver, lora_chat_config

QA = [("hello", "hi there"), ("two plus two", "four"), ("colour of the sky", "blue"),
      ("opposite of hot", "cold"), ("a baby cat", "a kitten"), ("days in a week", "seven"),
      ("capital of France", "Paris"), ("bees make", "honey")]


def rondo(*args):
    p = subprocess.run([RONDO, *map(str, args)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_trained_adapter_and_merged_checkpoint_load_in_peft_and_transformers(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    torch.manual_seed(seed)
    tok = tb.qwen2()
    base_dir = tmp_path / "base"
    tb.save_chatml(tok, base_dir)
    config = T.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, tie_word_embeddings=True,
                           attn_implementation="eager")
    T.Qwen2ForCausalLM(config).eval().save_pretrained(base_dir, safe_serialization=True)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in QA))
    run = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    lora_chat_config(cfg, base_dir, data, run, steps=8, batch_rows=2, lr=0.02, seed=seed % 100000,
                     sim_devices=2, exports='["adapter", "merged"]')
    rondo("train", cfg)
    losses = [json.loads(l)["loss"] for l in (run / "events.jsonl").read_text().splitlines()
              if json.loads(l)["type"] == "step"]
    assert len(losses) == 8 and losses[-1] < losses[0], losses

    tokens = torch.randint(0, tok.get_vocab_size(), (2, 13),
                           generator=torch.Generator().manual_seed(seed))
    (tmp_path / "batch.json").write_text(json.dumps({"tokens": tokens.tolist()}))
    driver("run-logits", run, tmp_path / "batch.json", tmp_path / "rondo.safetensors")
    got = load_file(tmp_path / "rondo.safetensors")["logits"]

    base = T.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=tokens).logits.float().numpy()
        model = peft.PeftModel.from_pretrained(base, run / "adapter").eval()
        want = model(input_ids=tokens).logits.float().numpy()
        merged = T.AutoModelForCausalLM.from_pretrained(run / "merged",
                                                        torch_dtype=torch.float32).eval()
        merged_logits = merged(input_ids=tokens).logits.float().numpy()
    scale = np.abs(want).max()
    assert np.abs(want - base_logits).max() > 1e-2 * scale, "training hardly moved the adapter"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(merged_logits, want, rtol=0, atol=1e-4 * scale)
    # The merged folder is complete: transformers' tokenizer loads from it.
    assert (run / "merged" / "tokenizer.json").exists()

    rondo("export", run, "--out", tmp_path / "again")
    assert ((tmp_path / "again" / "adapter_model.safetensors").read_bytes() ==
            (run / "adapter" / "adapter_model.safetensors").read_bytes())
