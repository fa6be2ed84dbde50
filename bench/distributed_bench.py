#!/usr/bin/env python3
"""Data parallelism on loopback (docs/distributed.md, issue 36), two figures, each against a
baseline measured in the same run:

1. The gradient path's sums across ranks (engine/ranks.h's Collective, one all-reduce per layer
   as the optimizer thread issues them) against one plain c10d all-reduce of the same bytes:
   bench/allreduce_bench.cpp, started here as --ranks processes. Aim >= 0.9. Reported for a
   full fine-tuning's layer sizes (--layer-mb, default 16 MiB) and a LoRA's (0.25 MiB).
2. The step time of R ranks against 1 rank with the same work per rank (each rank the same
   microbatches a step, so R ranks train R times the tokens): `rondo train` on the tiny model,
   each rank pinned to its own core (taskset, one thread) so that the ranks do not share one, the
   runs alternating (1 rank, R ranks, 1 rank, ...), the median of the steady steps. The ratio
   (1 rank's step time / R ranks') is what the gradient sums and the ranks' waiting for each other
   cost: 1.0 would be free. And R ranks with sharded optimizer state (distributed.shard_optimizer:
   each rank updates 1/R of the layers and broadcasts their new weights) against the same 1 rank.

    bench/distributed_bench.py [--build build] [--ranks 2] [--rounds 2] [--steps 8]
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from word_documents import write_word_documents


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(cmd, ranks, pin=False, extra_env=None):
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(extra_env or {}))
        full = (["taskset", "-c", str(r % os.cpu_count())] if pin else []) + cmd
        procs.append(subprocess.Popen(full, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    for p, o in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{o}")
    return outs


def allreduce(args):
    bench = Path(args.build) / "bench" / "allreduce_bench"
    if not bench.exists():
        raise SystemExit(f"{bench} is missing: configure with -DRONDO_BUILD_BENCH=ON and build "
                         "allreduce_bench")
    for layers, mb in ((30, args.layer_mb), (60, 0.25)):
        out = start_ranks([str(bench), "--layers", str(layers), "--layer-mb", str(mb),
                           "--rounds", str(args.rounds * 4 + 1)], args.ranks)[0]
        r = json.loads(out.strip().splitlines()[-1])
        print(f"all-reduce, {r['ranks']} ranks, {layers} layers of {mb} MiB: plain c10d "
              f"{r['plain_gb_s']:.2f} GB/s, gradient path {r['path_gb_s']:.2f} GB/s, ratio "
              f"{r['ratio']:.3f} (aim >= 0.9)")


def steps(args):
    rondo = Path(args.build) / "cli" / "rondo"
    tiny = Path(args.build) / "tests" / "rondo_tiny_model"
    with tempfile.TemporaryDirectory(prefix="rondo-distributed-bench-") as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        subprocess.run([str(tiny), str(model), "1", "4", str(args.hidden),
                        str(args.intermediate)], check=True)
        write_word_documents(tmp / "train.jsonl", 2000)

        def run(ranks, n, shard=False):
            folder = tmp / f"run-{n}"
            cmd = [str(rondo), "train", "--set", f"model.path={model}",
                   "--set", f"data.train={tmp / 'train.jsonl'}", "--set", "data.seq_len=512",
                   "--set", "model.dtype=fp32", "--set", f"training.method={args.method}",
                   "--set", f"training.steps={args.steps}", "--set", "training.batch_rows=2",
                   "--set", f"training.grad_accum={2 * ranks}",
                   "--set", "checkpoint.every=0", "--set", "hardware.sim_devices=1",
                   "--set", f"output.run_dir={folder}", "--set", "output.exports=[]",
                   "--set", f"distributed.shard_optimizer={'true' if shard else 'false'}"]
            # One rank: RANK=0 WORLD_SIZE=1, a single process as always.
            start_ranks(cmd, ranks, pin=True, extra_env={"OMP_NUM_THREADS": "1"})
            events = [json.loads(line) for line in open(folder / "events.jsonl")]
            t = [e["t"] for e in events if e["type"] == "step"]
            shutil.rmtree(folder)
            return [b - a for a, b in zip(t[1:], t[2:])]

        # 1 rank, R ranks, R ranks with sharded optimizer state (each updates 1/R of the layers
        # and broadcasts their weights), alternating.
        kinds = [(1, False), (args.ranks, False), (args.ranks, True)]
        times = {k: [] for k in kinds}
        n = 0
        for _ in range(args.rounds):
            for ranks, shard in kinds:
                times[(ranks, shard)] += run(ranks, n, shard)
                n += 1
        one, many, sharded = (statistics.median(times[k]) for k in kinds)
        print(f"step time, {args.method}, tiny model C={args.hidden} I={args.intermediate} 4 "
              f"blocks, 2 microbatches of 2 x 512 tokens per rank, one core per rank: 1 rank "
              f"{one * 1e3:.0f} ms, {args.ranks} ranks {many * 1e3:.0f} ms, sharded "
              f"{sharded * 1e3:.0f} ms (medians of {len(times[kinds[0]])} steps each); ratio "
              f"{one / many:.3f}, sharded {one / sharded:.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layer-mb", type=float, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--method", default="full")
    ap.add_argument("--only", choices=["allreduce", "steps"])
    args = ap.parse_args()
    if args.only != "steps":
        allreduce(args)
    if args.only != "allreduce":
        steps(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
