#!/usr/bin/env python3
"""Sequence tiling's cost where it is not needed: tokens/s of long-sequence LoRA steps on
simulated devices with the blocks tiled through the sequence (training.sequence_tile = N) against
the same steps untiled (sequence_tile = 0), both with memory to spare, in one run. The runs
alternate (untiled, tiled, untiled, ...) so that a busy moment of the machine falls on both; the
figure is the ratio of the median step times. The aim is >= 0.9 (issue 35): tiling recomputes
part of each block's forward in the backward (the MLP's gate and up, q and k where they have
norms), so it is chosen only where a plan does not fit without it.

What long rows hold decides what that recompute weighs against: `--documents long` (the default)
fills each row with one document longer than it, as long-context training does, so attention over
the whole row is most of a step; `--documents packed` packs documents of a few hundred tokens,
each attended alone, so the projections and MLPs are most of it and the recompute weighs most.

    bench/tiling_bench.py [--rondo build/cli/rondo] [--tiny-model build/tests/rondo_tiny_model]
                          [--seq 8192] [--steps 4] [--rounds 2] [--tiles 4096,2048,1024]
                          [--documents long|packed]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from word_documents import write_word_documents


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rondo", default="build/cli/rondo")
    ap.add_argument("--tiny-model", default="build/tests/rondo_tiny_model")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiles", default="4096,2048,1024")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--documents", choices=["long", "packed"], default="long")
    args = ap.parse_args()
    tiles = [int(t) for t in args.tiles.split(",")]

    with tempfile.TemporaryDirectory(prefix="rondo-tiling-bench-") as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        subprocess.run([args.tiny_model, str(model), "1", "2", str(args.hidden),
                        str(args.intermediate)], check=True)
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = max(args.seq, 512)
        (model / "config.json").write_text(json.dumps(config))
        if args.documents == "long":
            # About 3 tokens a word with the tiny tokenizer: every document outruns a row.
            write_word_documents(tmp / "train.jsonl", 64, (args.seq // 2, args.seq // 2))
        else:
            write_word_documents(tmp / "train.jsonl", 2000)

        def step_seconds(tile, run):
            folder = tmp / f"run-{run}"
            cmd = [args.rondo, "train", "--set", f"model.path={model}",
                   "--set", f"data.train={tmp / 'train.jsonl'}",
                   "--set", f"data.seq_len={args.seq}", "--set", "model.dtype=fp32",
                   "--set", f"training.steps={args.steps}", "--set", "training.batch_rows=1",
                   "--set", "training.grad_accum=2", "--set", "checkpoint.every=0",
                   "--set", "hardware.sim_devices=2", "--set", f"training.sequence_tile={tile}",
                   "--set", f"output.run_dir={folder}", "--set", "output.exports=[]"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            events = [json.loads(line) for line in open(folder / "events.jsonl")]
            plans = [e["plan"] for e in events if e["type"] == "plan"]
            t = [e["t"] for e in events if e["type"] == "step"]
            # The first step fills the pipeline: the rest are the steady state.
            return [b - a for a, b in zip(t[1:], t[2:])] or [t[-1]], plans[-1]

        times = {tile: [] for tile in [0] + tiles}
        plans = {}
        run = 0
        for _ in range(args.rounds):
            for tile in times:
                seconds, plans[tile] = step_seconds(tile, run)
                times[tile] += seconds
                run += 1
        base = statistics.median(times[0])
        tokens = 2 * args.seq
        print(f"{args.seq} tokens a row ({args.documents} documents), 2 microbatches a step, "
              f"C={args.hidden} I={args.intermediate}, 2 simulated devices, fp32")
        print(f"untiled: {plans[0]}: {tokens / base:.0f} tokens/s (median of {len(times[0])} "
              "steps)")
        for tile in tiles:
            t = statistics.median(times[tile])
            print(f"tile {tile}: {plans[tile]}: {tokens / t:.0f} tokens/s, "
                  f"ratio to untiled {base / t:.3f} (aim >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
