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
