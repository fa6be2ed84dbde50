#!/usr/bin/env python3
"""Activation checkpoints at length (issue 35, item 4): one row of 131,072 tokens through a
model whose hidden size is 2,048 (Qwen3-1.7B's), in bf16, so that each layer's checkpoint is
131,072 x 2,048 x 2 bytes = 512 MiB, as a 1.7B model's. LoRA on simulated devices, tiled through
the sequence. The same steps run twice in one run, alternating: with the checkpoints in host
memory, and with `hardware.host_memory` too small for them so that the plan puts them on the NVMe
tier (`hardware.offload_dir`). The figure is the ratio of the median step times (aim ~1.0: the
checkpoints' writes and read-backs are overlapped with compute), with where the plan put them and
how many bytes a step moved to and from the drive.

The model is small everywhere but its width (one attention head of 16, an MLP of 64, the tiny
test tokenizer); the bytes per checkpoint are a 1.7B model's. Documents of a few hundred tokens are
packed into the row. On the project's 2-core VM a step of 7 blocks took 7 to 10 minutes, so the
default 12 blocks want an hour or more there; the NVMe tier is only planned for checkpoints once
they outweigh its host staging window (with 4 blocks they did not; with 7, 6 GiB of them go to
NVMe under 8 GiB of host memory, measured with `--layers 7 --steps 2` in 45 minutes; with 12,
11 GiB). The host-memory run holds the checkpoints and the simulated device's 10 GiB in RAM:
about 19 GiB with 7 blocks, 24 GiB with 12. The NVMe run's "in host memory" figure is what the
checkpoints would take there without the spill.

    bench/long_checkpoints_bench.py [--rondo build/cli/rondo]
        [--tiny-model build/tests/rondo_tiny_model] [--seq 131072] [--layers 4] [--steps 3]
        [--rounds 1] [--offload-dir DIR]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from word_documents import write_word_documents

MAKE_MODEL = r"""
import json, sys, torch, transformers, shutil
src, dst, layers, positions = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tiny = json.load(open(src + "/config.json"))
cfg = transformers.Qwen3Config(
    vocab_size=tiny["vocab_size"], hidden_size=2048, intermediate_size=64,
    num_hidden_layers=layers, num_attention_heads=1, num_key_value_heads=1, head_dim=16,
    max_position_embeddings=positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=tiny.get("bos_token_id"), eos_token_id=tiny.get("eos_token_id"))
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dst)
for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
    try:
        shutil.copy(src + "/" + f, dst + "/" + f)
    except FileNotFoundError:
        pass
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rondo", default="build/cli/rondo")
    ap.add_argument("--tiny-model", default="build/tests/rondo_tiny_model")
    ap.add_argument("--seq", type=int, default=131072)
    # Enough blocks that the checkpoints (two steps' worth in host memory) outweigh the NVMe
    # tier's host window for them (4 + 1 + N checkpoints, and 3 N times those a backward job
    # receives: engine/estimate.cpp), or the plan keeps them in host memory.
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--memory-cap", default="10GiB", help="per simulated device")
    ap.add_argument("--nvme-host-memory", default="8GiB",
                    help="hardware.host_memory of the NVMe run: too little for the checkpoints")
    ap.add_argument("--offload-dir", default=None, help="the NVMe tier (default: a temporary "
                    "folder next to the run)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="rondo-checkpoints-bench-") as tmp:
        tmp = Path(tmp)
        subprocess.run([args.tiny_model, str(tmp / "tiny")], check=True)
        model = tmp / "model"
        subprocess.run([sys.executable, "-c", MAKE_MODEL, str(tmp / "tiny"), str(model),
                        str(args.layers), str(max(args.seq, 4096))], check=True)
        # Enough documents for the steps' rows (about 300 tokens each).
        write_word_documents(tmp / "train.jsonl", args.seq * (args.steps + 1) // 250)
        checkpoint_bytes = args.seq * 2048 * 2
        offload = Path(args.offload_dir) if args.offload_dir else tmp / "nvme"
        offload.mkdir(parents=True, exist_ok=True)

        def run(where, n):
            folder = tmp / f"run-{n}"
            cmd = [args.rondo, "train", "--set", f"model.path={model}",
                   "--set", f"data.train={tmp / 'train.jsonl'}",
                   "--set", f"data.seq_len={args.seq}", "--set", "model.dtype=bf16",
                   "--set", "lora.rank=8", "--set", "lora.alpha=16",
                   "--set", f"training.steps={args.steps}", "--set", "training.batch_rows=1",
                   "--set", "training.grad_accum=1", "--set", "checkpoint.every=0",
                   "--set", "hardware.sim_devices=1",
                   "--set", f"hardware.memory_cap={args.memory_cap}",
                   "--set", f"output.run_dir={folder}", "--set", "output.exports=[]"]
            if where == "nvme":
                # Room for the staging and the NVMe tier's window, not for every layer's
                # checkpoints (12 blocks at 131,072 tokens: 6.6 GiB with the spill, 13 without).
                cmd += ["--set", f"hardware.host_memory={args.nvme_host_memory}",
                        "--set", f"hardware.offload_dir={offload}"]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
            if done.returncode != 0:
                sys.exit(f"checkpoints in {where}: rondo train failed:\n{done.stderr}")
            events = [json.loads(line) for line in open(folder / "events.jsonl")]
            plan = [e for e in events if e["type"] == "plan"][-1]
            plan["peak"] = max(e["bytes_peak"] for e in events
                               if e["type"] == "device" and e["device"] == 0)
            t = [e["t"] for e in events if e["type"] == "step"]
            # The first step fills the pipeline: the rest are the steady state.
            return [b - a for a, b in zip(t, t[1:])] or [t[-1]], plan

        times = {"host": [], "nvme": []}
        plans = {}
        n = 0
        for _ in range(args.rounds):
            for where in times:
                seconds, plans[where] = run(where, n)
                times[where] += seconds
                n += 1
        print(f"one row of {args.seq} tokens, hidden size 2048, bf16, {args.layers} blocks, LoRA, "
              f"1 simulated device ({args.memory_cap}): a checkpoint is "
              f"{checkpoint_bytes / 2**20:.0f} MiB a layer")
        for where, ts in times.items():
            p = plans[where]
            ck = p.get("placement", {}).get("activation_checkpoints", {})
            print(f"checkpoints in {where}: plan {p['plan']}; tier {ck.get('tier')}, "
                  f"{ck.get('host_bytes', 0) / 2**20:.0f} MiB in host memory, "
                  f"{ck.get('nvme_bytes', 0) / 2**20:.0f} MiB on NVMe; planned per step: "
                  f"{p['predicted_nvme_write'] / 2**20:.0f} MiB to the drive, "
                  f"{p['predicted_nvme_read'] / 2**20:.0f} MiB back, "
                  f"{p['predicted_step_s']:.1f} s; measured: median step "
                  f"{statistics.median(ts):.1f} s of {len(ts)}; device peak "
                  f"{p['peak'] / 2**30:.2f} GiB (planned "
                  f"{p['predicted_peak_bytes'][0] / 2**30:.2f})")
        nvme_tier = plans["nvme"].get("placement", {}).get("activation_checkpoints", {})
        if nvme_tier.get("tier") != "nvme":
            print("warning: the NVMe run's plan kept the checkpoints in host memory (too few "
                  "blocks, or --nvme-host-memory too large): the ratio compares one placement")
        ratio = statistics.median(times["nvme"]) / statistics.median(times["host"])
        print(f"step time, checkpoints on NVMe / in host memory: {ratio:.3f} (aim ~1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
