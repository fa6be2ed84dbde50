"""Benchmark (c) of issue 4, in one run: Rondo's fused CPU AdamW against a memory-bandwidth triad
(from adamw_bench, same threads and tiles) and against torch.optim.AdamW on the CPU, at the same
thread counts and tensor size.

    bench/adamw_bench.py [--bench build/bench/adamw_bench] [--elements 64M] [--reps 5]

torch is timed the way Rondo's training state is laid out:
  - "f32 grad, no copy": fp32 parameter with an fp32 .grad; opt.step() of torch.optim.AdamW, both
    the default implementation (foreach=False on the CPU) and fused=True (torch's own fused CPU
    kernel).
  - "bf16 grad -> bf16 copy": what a reference pipeline without a fused kernel does (RoundPipe,
    docs/architecture.md §3.6): copy the bf16 gradient into the fp32 .grad, opt.step(), copy the
    master back to the bf16 weights.
Throughput is Rondo's byte count for the same work divided by torch's time, so every ratio below
is a ratio of times. Each figure is the best of --reps steps.
"""
import argparse
import json
import subprocess
import sys
import time

import torch

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text):
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def best_seconds(reps, fn):
    fn()  # warm-up: torch allocates its state on the first step
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def torch_f32(n, reps, fused):
    p = torch.nn.Parameter(torch.full((n,), 0.05))
    p.grad = torch.full((n,), 1e-2)
    opt = torch.optim.AdamW([p], lr=1e-5, weight_decay=0.1, fused=fused)
    return best_seconds(reps, opt.step)


def torch_bf16_pipeline(n, reps, fused):
    p = torch.nn.Parameter(torch.full((n,), 0.05))
    p.grad = torch.empty(n)
    grad_bf16 = torch.full((n,), 1e-2, dtype=torch.bfloat16)
    weights_bf16 = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p], lr=1e-5, weight_decay=0.1, fused=fused)

    def step():
        p.grad.copy_(grad_bf16)
        opt.step()
        with torch.no_grad():
            weights_bf16.copy_(p)

    return best_seconds(reps, step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="build/bench/adamw_bench")
    ap.add_argument("--elements", default="64M")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = parse_count(args.elements)

    out = subprocess.run([args.bench, "--elements", args.elements, "--reps", str(args.reps),
                          "--json"], check=True, capture_output=True, text=True).stdout
    print(out.split("JSON ")[0], end="")
    rows = json.loads(out.split("JSON ", 1)[1])
    widest = rows[0]["path"]

    print(f"\ntorch {torch.__version__} on the CPU ({torch.backends.cpu.get_cpu_capability()}), "
          f"{n} elements, best of {args.reps}; Rondo on its {widest} path")
    print(f"{'case':<24} {'threads':>7} {'torch impl':<10} {'torch GB/s':>10} {'Rondo GB/s':>10} "
          f"{'Rondo/torch':>11} {'Rondo/triad':>11}")
    for row in rows:
        if row["path"] != widest or row["case"] not in ("f32 grad, no copy",
                                                        "bf16 grad -> bf16 copy"):
            continue
        torch.set_num_threads(row["threads"])
        bytes_step = row["bytes_per_element"] * n
        for fused in (False, True):
            fn = torch_f32 if row["case"].startswith("f32") else torch_bf16_pipeline
            seconds = fn(n, args.reps, fused)
            torch_gbs = bytes_step / seconds / 1e9
            print(f"{row['case']:<24} {row['threads']:>7} {'fused' if fused else 'default':<10} "
                  f"{torch_gbs:>10.2f} {row['adamw_gbs']:>10.2f} "
                  f"{row['adamw_gbs'] / torch_gbs:>11.2f} "
                  f"{row['adamw_gbs'] / row['triad_gbs']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
