"""Helpers for the oracle tests: run Rondo's side (rondo_oracle_driver, the rondo CLI)."""
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


def driver(*args, timeout=600):
    """Runs a driver subcommand; returns its stdout, raises DriverError on failure."""
    if not DRIVER:
        raise RuntimeError("RONDO_ORACLE_DRIVER is not set: run the oracle tests through ctest")
    p = subprocess.run([DRIVER, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise DriverError(p.returncode, p.stderr)
    return p.stdout
