"""State bigger than the machine, under a hard memory limit (issue 34): full fine-tuning (fp32, on
the CPU device and on 2 simulated GPUs) of a Llama-shaped model whose untied embedding and head
are each many times a block, with its training state 3x hardware.host_memory, and a LoRA run
whose base is 3x the budget, each run inside a memory cgroup of the budget plus the overhead the
plan states (plus, for the simulated GPUs, their memory caps: a real card's memory is its own).
Each must complete, with weights (the merged export, the adapter) byte for byte those of the same
run held in memory; the peaks are printed.

Needs a writable cgroup v1 memory controller (/sys/fs/cgroup/memory, as root); without one the
script says so and exits 77 (ctest: skipped).

    budget_in_cgroup.py RONDO_BIN WORK_DIR"""
import json
import os
import subprocess
import sys
from pathlib import Path

import slow_support
from slow_support import peer_bench

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
STEPS = 3


def cgroup_usable():
    probe = CGROUP_ROOT / f"rondo-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(1 << 30))
        return True
    except OSError:
        return False
    finally:
        if probe.exists():
            probe.rmdir()


def model_folder(work, blocks):
    """A Llama-shaped fp32 model with SmolLM2's tokenizer (49,152 tokens): hidden 512, `blocks`
    blocks of 2.9 M parameters, embedding and head 25.2 M each (8.7x a block), untied; with 30
    blocks 137 M in all, about SmolLM2-135M's shape. So many blocks because on the CPU device the
    budget must also hold what the device computes the head with (full fine-tuning: its weights,
    its gradient twice and logits, about 300 MiB; LoRA: its weights and logits, about 150 MiB),
    next to the arena, while the state is 3x the budget."""
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(peer_bench.hf_folder(peer_bench.bundled_gguf(),
                                                                   work / "bundled"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=blocks, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(torch.float32)
    out = work / f"model-{blocks}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert embed >= 3 * block, (embed, block)
    return out, params


def write_config(work, folder, data, name, method, hardware):
    text = peer_bench.rondo_config(folder, data, method, STEPS, 2, 128, work / name, hardware)
    text = text.replace("exports = []",
                        'exports = ["merged"]' if method == "full" else 'exports = ["adapter"]')
    path = work / f"{name}.toml"
    path.write_text(text)
    return path


def export_bytes(run, method):
    f = run / ("merged/model.safetensors" if method == "full" else
               "adapter/adapter_model.safetensors")
    return f.read_bytes()


def run_in_cgroup(rondo, config, limit):
    """`rondo train CONFIG` in a fresh memory cgroup of `limit` bytes: (return code, output, the
    cgroup's peak usage, its peak RSS + swap from memory.stat, times the limit was hit)."""
    group = CGROUP_ROOT / f"rondo-budget-{os.getpid()}-{config.stem}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))  # no escape into swap
        procs = group / "cgroup.procs"
        p = subprocess.run([rondo, "train", str(config)], capture_output=True, text=True,
                           timeout=3000, preexec_fn=lambda: procs.write_text(str(os.getpid())))
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        failcnt = int((group / "memory.failcnt").read_text())
        return p.returncode, p.stdout + p.stderr, peak, failcnt
    finally:
        group.rmdir()


def main():
    rondo, work = slow_support.arguments()
    if not cgroup_usable():
        print(f"skipped: no writable cgroup v1 memory controller at {CGROUP_ROOT} (run as root "
              "where one is mounted)")
        sys.exit(77)
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in peer_bench.documents(64)))
    offload = work / "offload"
    failures, rows = [], []
    # Training state independently of Rondo: fp32 weights 4 B per parameter; a trained one also
    # 4 B of gradient, 4 of master and 8 of moments.
    # Full fine-tuning of the 30-block model; LoRA of a 110-block one. Its frozen base is 4 B a
    # parameter, so 3x the budget takes more of them; and on the CPU device the head's stage
    # (its 96 MiB of weights copied whole from the tier, a chunk of logits, the next stage read
    # ahead: about 282 MiB) must fit beside the arena, which a 60-block model's 285 MiB budget
    # cannot hold. (Computing the head a vocabulary slice at a time would lift that.)
    sim2 = "sim_devices = 2\nmemory_cap = \"1GB\"\n"
    cases = [("full", "", 30), ("full", sim2, 30), ("lora", "", 110), ("lora", sim2, 110)]
    models = {}
    for method, devices, blocks in cases:
        if blocks not in models:
            models[blocks] = model_folder(work, blocks)
        folder, params = models[blocks]
        state = params * (20 if method == "full" else 4)
        where = "2 simulated GPUs" if devices else "the CPU"
        name = f"{method}-{'sim2' if devices else 'cpu'}"
        budget = state // 3
        hardware = (devices + f'host_memory = "{budget}"\noffload_dir = "{offload}"\n')
        config = write_config(work, folder, data, f"cg-{name}", method, hardware)
        p = subprocess.run([rondo, "plan", str(config), "--json"], capture_output=True, text=True,
                           timeout=600)
        plan = json.loads(p.stdout)
        if plan["verdict"] == "does not fit":
            failures.append(f"{method} on {where}: the plan says it does not fit: "
                            + "; ".join(plan["problems"]))
            continue
        ref = write_config(work, folder, data, f"mem-{name}", method, devices)
        slow_support.call(rondo, "train", ref)
        overhead = plan["host_overhead_bytes"]
        # Simulated GPUs keep their memory in this process: on a real machine it is the cards'
        # own, so their caps come on top (the CPU device's memory is the budget's: the plan
        # counts it).
        device_memory = sum(d["cap_bytes"] for d in plan["devices"]) if devices else 0
        limit = budget + overhead + device_memory
        code, out, peak, failcnt = run_in_cgroup(rondo, config, limit)
        run = work / f"cg-{name}"
        end = {}
        events = run / "events.jsonl"
        if events.exists():
            for line in events.read_text().splitlines():
                e = json.loads(line)
                if e.get("type") == "run_end":
                    end = e
        mib = 1 / 1048576
        rows.append(
            f"{method} on {where}: state {state * mib:.0f} MiB, budget {budget * mib:.0f} MiB, "
            f"stated overhead {overhead * mib:.0f} MiB, simulated devices' caps "
            f"{device_memory * mib:.0f} MiB, cgroup limit {limit * mib:.0f} MiB; "
            f"exit {code}, cgroup peak {peak * mib:.0f} MiB (page cache included), limit hit "
            f"{failcnt} times, process peak RSS {end.get('host_peak_bytes', 0) * mib:.0f} MiB, "
            f"arena peak {end.get('host_arena_peak_bytes', 0) * mib:.0f} MiB")
        if code != 0:
            failures.append(f"{method} on {where} did not complete inside the cgroup (exit {code}):"
                            f"\n{out[-3000:]}")
            continue
        if export_bytes(run, method) != export_bytes(work / f"mem-{name}", method):
            failures.append(f"{method} on {where}: the export differs from the run in memory")
    print("\n".join(rows))
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
