#!/usr/bin/env bash
# The GPU check, run on a GPU machine through the device tool (carry: .gpu-debs):
#   unpack the Debian packages fetched by scripts/fetch-gpu-debs.sh, configure against the torch
#   already installed there, build with CUDA for sm_90, run the tests labelled cuda (and cpu), run
#   the GPU benchmark under a 24GB device memory cap, and print a short table last.
# Also runs on a machine without a GPU (the CUDA tests then skip themselves), which is how its CPU
# parts are checked before spending device time.
#
# Environment: RONDO_FORCE_SYSROOT=1 (unpack the .debs even where the libraries are installed),
#              RONDO_PYTHON (a Python with torch; default: python3, else Rondo's venv),
#              RONDO_GPU_ARCH (default 90), RONDO_GPU_CAP (default 24GB), JOBS.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SYSROOT="$ROOT/.gpu-sysroot"
BUILD="$ROOT/build-gpu"
LOGS="${OUT:-$BUILD}/gpu-check-logs"
ARCH=${RONDO_GPU_ARCH:-90}
CAP=${RONDO_GPU_CAP:-24GB}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$LOGS"
T0=$(date +%s)

say() { echo "==> [$(($(date +%s) - T0))s] $*"; }
die() {
  echo "gpu-check: FAILED: $*" >&2
  exit 1
}

# --- Python with torch ---------------------------------------------------------------------------
PY=${RONDO_PYTHON:-}
if [[ -z "$PY" ]]; then
  if python3 -c "import torch" 2>/dev/null; then
    PY=$(command -v python3)
  elif [[ -x "$HOME/.cache/rondo/venv/bin/python" ]]; then
    PY="$HOME/.cache/rondo/venv/bin/python"
  else
    die "no Python with torch (set RONDO_PYTHON)"
  fi
fi
say "torch: $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader

# --- Debian libraries, unpacked (no root, no network needed) -------------------------------------
if [[ -n "${RONDO_FORCE_SYSROOT:-}" ]] || ! dpkg-query -W libhwloc-dev >/dev/null 2>&1; then
  [[ -d "$ROOT/.gpu-debs" ]] || die ".gpu-debs/ is missing: run scripts/fetch-gpu-debs.sh and carry it"
  say "unpacking $(ls "$ROOT"/.gpu-debs/*.deb | wc -l) Debian packages into $SYSROOT"
  "$PY" - "$ROOT/.gpu-debs" "$SYSROOT" <<'PYEOF' || die "unpacking .deb files"
import io, os, sys, tarfile
src, dest = sys.argv[1], sys.argv[2]
os.makedirs(dest, exist_ok=True)
for name in sorted(os.listdir(src)):
    if not name.endswith(".deb"):
        continue
    blob = open(os.path.join(src, name), "rb").read()
    assert blob[:8] == b"!<arch>\n", name
    pos = 8
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        member = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        data = blob[pos + 60:pos + 60 + size]
        if member.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                tar.extractall(dest, filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(dest)
        pos += 60 + size + (size & 1)
PYEOF
  LIBDIR="$SYSROOT/usr/lib/x86_64-linux-gnu"
  export CMAKE_PREFIX_PATH="$SYSROOT/usr:$LIBDIR/cmake${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_LIBDIR="$LIBDIR/pkgconfig:$SYSROOT/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$SYSROOT"
  export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# --- Configure and build -------------------------------------------------------------------------
say "configuring $BUILD (CUDA arch $ARCH)"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRONDO_PYTHON="$PY" \
  -DRONDO_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DRONDO_BUILD_BENCH=ON \
  >"$LOGS/configure.log" 2>&1 || { tail -40 "$LOGS/configure.log"; die "configure"; }
say "building with $JOBS jobs"
ninja -C "$BUILD" -j "$JOBS" >"$LOGS/build.log" 2>&1 || { grep -E "error|FAILED" "$LOGS/build.log" | head -40; die "build"; }

# --- Tests and benchmark ------------------------------------------------------------------------
say "tests labelled cuda"
ctest --test-dir "$BUILD" -L cuda --output-on-failure >"$LOGS/ctest-cuda.log" 2>&1
CUDA_RC=$?
say "tests labelled cpu"
ctest --test-dir "$BUILD" -L cpu -j 8 --output-on-failure >"$LOGS/ctest-cpu.log" 2>&1
CPU_RC=$?
say "benchmark: link_bench --cap $CAP"
"$BUILD/bench/link_bench" --cap "$CAP" >"$LOGS/bench.log" 2>&1
BENCH_RC=$?

# --- Summary, last -------------------------------------------------------------------------------
summary() { grep -E "tests passed|tests failed" "$1" | tail -1; }
echo
[[ $CUDA_RC -eq 0 ]] || grep -E "Failed|\*\*\*|Error" "$LOGS/ctest-cuda.log" | head -20
[[ $CPU_RC -eq 0 ]] || grep -E "Failed|\*\*\*|Error" "$LOGS/ctest-cpu.log" | head -20
echo "| check | result |"
echo "|---|---|"
echo "| cuda tests | $(summary "$LOGS/ctest-cuda.log") (skipped: $(grep -c "(Skipped)" "$LOGS/ctest-cuda.log")) |"
echo "| cpu tests | $(summary "$LOGS/ctest-cpu.log") |"
echo "| benchmark | exit $BENCH_RC |"
echo
cat "$LOGS/bench.log"
echo "gpu-check: $(($(date +%s) - T0))s"
[[ $CUDA_RC -eq 0 && $CPU_RC -eq 0 && $BENCH_RC -eq 0 ]]
