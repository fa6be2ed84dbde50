"""Estimates you can trust (issue 14): on three configs the plan's predicted step time is within
25% of the steps `rondo train` then measures, and `rondo plan` asked three times, each measuring
the CPU afresh (an empty speed cache), varies by under 10%. Run on a quiet machine: what it checks
is a timing. slow.

    python estimate_accuracy.py RONDO_BIN WORK_DIR

The configs, on the bundled SmolLM2-135M-Instruct, 2 rows x 256 tokens per step:
  - `rondo demo` itself (LoRA, the GGUF's quantised base, the CPU device);
  - full fine-tuning of the fp32 folder (transformers' dequantisation of the GGUF), the CPU device;
  - LoRA of the fp32 folder on 2 simulated GPUs (the engine's emulated link, stages on both).
A step's measured time is the difference of consecutive `step` events' clocks; the median over
the steps after the first (which warms up) and before the last (which evaluates and samples in the
demo) is compared with the `plan` event's predicted_step_s.
"""
import json
import os
import statistics
import sys
from pathlib import Path

import slow_support
from slow_support import peer_bench

rondo, work = slow_support.arguments()
STEPS = 10
TOLERANCE = 0.25
PLAN_SPREAD = 0.10


def call(*args, env=None):
    return slow_support.call(rondo, *args, env=env)


def measured_and_predicted(run_dir):
    clocks, predicted = [], None
    for line in (Path(run_dir) / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["type"] == "step":
            clocks.append(e["t"])
        elif e["type"] == "plan":
            predicted = e["predicted_step_s"]  # the latest plan is the one in use
    steps = [b - a for a, b in zip(clocks, clocks[1:])]  # steps 2..N
    return statistics.median(steps[:-1]), predicted, steps


folder = peer_bench.hf_folder(peer_bench.bundled_gguf(), work)
data = work / "train.jsonl"
data.write_text("".join(json.dumps({"text": d}) + "\n" for d in peer_bench.documents(64)))


def config(name, method, hardware=""):
    path = work / f"{name}.toml"
    path.write_text(peer_bench.rondo_config(folder, data, method, STEPS, 2, 256, work / name,
                                            hardware))
    return path


configs = {
    "full, the CPU": config("full-cpu", "full"),
    "LoRA, 2 simulated GPUs": config("lora-sim2", "lora",
                                     'sim_devices = 2\nmemory_cap = "1GB"'),
}
failures = []
rows = []

# Repeated plans, each measuring the CPU again.
for name, path in configs.items():
    predictions = []
    for i in range(3):
        cache = work / f"speed-{path.stem}-{i}"
        out = call("plan", path, "--json", env=dict(os.environ, RONDO_SPEED_CACHE=str(cache)))
        predictions.append(json.loads(out)["step_seconds"])
    spread = max(predictions) / min(predictions) - 1
    rows.append(f"plan x3, {name}: {', '.join(f'{p:.3f}' for p in predictions)} s "
                f"(spread {spread:.1%})")
    if spread >= PLAN_SPREAD:
        failures.append(f"`rondo plan` on {name} varied by {spread:.1%}")

# Predicted against measured: the runs measure the CPU once more (a cache of their own, shared by
# them as a user's runs share ~/.cache/rondo/speed), not whatever an earlier build left there.
runs_env = dict(os.environ, RONDO_SPEED_CACHE=str(work / "speed-runs"))
call("demo", "--steps", STEPS, "--run-dir", work / "demo", env=runs_env)
runs = {"the demo (LoRA, GGUF base, the CPU)": work / "demo"}
for name, path in configs.items():
    call("train", path, env=runs_env)
    runs[name] = work / path.stem
for name, run_dir in runs.items():
    measured, predicted, steps = measured_and_predicted(run_dir)
    off = predicted / measured - 1
    rows.append(f"{name}: predicted {predicted:.3f} s, measured {measured:.3f} s "
                f"({off:+.1%}; steps {', '.join(f'{s:.2f}' for s in steps)})")
    if abs(off) > TOLERANCE:
        failures.append(f"{name}: predicted {predicted:.3f} s per step, measured {measured:.3f} s")

print("\n".join(rows))
if failures:
    sys.exit("estimates off:\n  " + "\n  ".join(failures))
