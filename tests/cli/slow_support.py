"""What the slow whole-run scripts here share: bench/peer_bench.py (the bundled model as an fp32
Hugging Face folder, documents of random common words, a side-by-side `rondo train` config), the
command line (RONDO_BIN WORK_DIR, the work folder made afresh) and running `rondo`."""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("peer_bench", ROOT / "bench" / "peer_bench.py")
peer_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_bench)


def arguments():
    """(the rondo binary, an empty work folder) from the command line."""
    rondo, work = sys.argv[1], Path(sys.argv[2])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return rondo, work


def call(rondo, *args, env=None, timeout=1500):
    """Runs `rondo ARGS`; its stdout, or the script ends naming what failed."""
    p = subprocess.run([rondo, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=env)
    if p.returncode != 0:
        sys.exit(f"rondo {' '.join(map(str, args))} failed:\n{p.stdout}{p.stderr}")
    return p.stdout
