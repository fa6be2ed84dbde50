"""Helpers for the oracle tests: run Rondo's side (rondo_oracle_driver, the rondo CLI)."""
import contextlib
import os
import subprocess

DRIVER = os.environ.get("RONDO_ORACLE_DRIVER", "")
RONDO = os.environ.get("RONDO_BIN", "")


class DriverError(RuntimeError):
    """The driver exited non-zero; .message is what it printed after 'error: '."""

    def __init__(self, code, stderr):
        super().__init__(f"rondo_oracle_driver exited {code}: {stderr.strip()}")
        self.code = code
        self.message = stderr.strip().removeprefix("error: ")


@contextlib.contextmanager
def correctly_rounded_sqrt(enabled=True):
    """torch.Tensor.sqrt through numpy (IEEE sqrt) while bitsandbytes steps: torch's CPU sqrt on
    large tensors goes through MKL's vector math, 1 ulp off for ~0.6% of elements, and
    bitsandbytes' CPU AdamW8bit uses it (test_adamw.py)."""
    if not enabled:
        yield
        return
    import numpy as np
    import torch
    original = torch.Tensor.sqrt
    torch.Tensor.sqrt = lambda self: torch.from_numpy(np.sqrt(self.detach().numpy()))
    try:
        yield
    finally:
        torch.Tensor.sqrt = original


def driver(*args, timeout=600):
    """Runs a driver subcommand; returns its stdout, raises DriverError on failure."""
    if not DRIVER:
        raise RuntimeError("RONDO_ORACLE_DRIVER is not set: run the oracle tests through ctest")
    p = subprocess.run([DRIVER, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise DriverError(p.returncode, p.stderr)
    return p.stdout


def lora_chat_config(path, model, data, run, steps, batch_rows, lr, seed, sim_devices, exports):
    """Writes `path`: a `rondo train` config of fp32 LoRA (rank 4, alpha 8, every linear layer)
    on chat data in rows of 64 tokens, 2 microbatches a step."""
    path.write_text(f"""
[model]
path = "{model}"
dtype = "fp32"
[data]
train = "{data}"
seq_len = 64
[lora]
rank = 4
alpha = 8
targets = ["all-linear"]
[training]
steps = {steps}
batch_rows = {batch_rows}
grad_accum = 2
lr = {lr}
seed = {seed}
[hardware]
sim_devices = {sim_devices}
[output]
run_dir = "{run}"
exports = {exports}
""")
    return path
