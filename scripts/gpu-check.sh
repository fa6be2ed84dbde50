#!/usr/bin/env bash
# The GPU check, one call of the device tool on a fresh GPU machine (16 cores, CUDA, CMake, Ninja
# and torch installed; no network, none of our Debian libraries):
#
#   run: scripts/gpu-check.sh        carry: .gpu-debs   (scripts/fetch-gpu-debs.sh fills it here)
#
#   1. unpacks the Debian packages into .gpu-sysroot/ and loads every library it unpacked;
#   2. configures against the torch already installed, CUDA for sm_90, and builds only what the
#      check runs: the cuda tests, bench/link_bench, bench/attention_bench and bench/train_bench (ninja -k 0: every
#      compile error in one go), timing the build (wall and CPU seconds);
#   3. runs the tests labelled cuda, each under a timeout, and fails when any of them skipped while
#      nvidia-smi sees a GPU (a skip there means torch's CUDA was not loaded);
#   4. runs the benchmarks under a device memory cap (24GB: a big card acting like an RTX 4090):
#      link_bench, attention_bench (packed rows per document against under a mask), and train_bench (rondo train against the plain libtorch loop on the GPU, on
#      Qwen3-1.7B's shape, LoRA r32 and full fine-tuning);
#   5. prints a short table last.
#
# Logs go to $OUT/gpu-check (the device tool brings them back: at most 8 files, this writes 8),
# else build-gpu/gpu-check. Without a
# GPU (here) it runs the same steps: the cuda tests skip and the benchmarks run on the CPU, which
# is how its CPU parts are checked before device time is spent.
#
# Environment: RONDO_FORCE_SYSROOT=1 (unpack the .debs even where the libraries are installed),
#              RONDO_PYTHON (a Python with torch; default: python3, else Rondo's venv),
#              RONDO_GPU_ARCH (90), RONDO_GPU_CAP (24GB), RONDO_GPU_BENCH (full: Qwen3-1.7B's
#              shape; small: a tiny model, for checking the script on a CPU; none: no train_bench),
#              RONDO_GPU_DEADLINE (560 s),
#              JOBS (nproc).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SYSROOT="$ROOT/.gpu-sysroot"
BUILD="$ROOT/build-gpu"
LOGS="${OUT:-$BUILD}/gpu-check"
ARCH=${RONDO_GPU_ARCH:-90}
CAP=${RONDO_GPU_CAP:-24GB}
BENCH=${RONDO_GPU_BENCH:-full}
JOBS=${JOBS:-$(nproc)}
# Seconds the whole check may take: the device tool's call is cut at 600, and the logs and the
# table must come out before that. Benchmarks that would not finish in time are skipped.
DEADLINE=${RONDO_GPU_DEADLINE:-560}
mkdir -p "$LOGS"
T0=$(date +%s)
ROWS=()  # the table: "| step | result | seconds |"

left() { echo $((DEADLINE - ($(date +%s) - T0))); }
say() { echo "==> [$(($(date +%s) - T0))s] $*"; }
row() { ROWS+=("| $1 | $2 | $3 |"); }
table() {
  echo
  echo "| step | result | s |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  echo "gpu-check: $(($(date +%s) - T0))s in all"
}
die() {
  row "$1" "FAILED: $2" "-"
  table
  echo "gpu-check: FAILED: $1: $2" >&2
  exit 1
}

# --- Python with torch, the GPU ------------------------------------------------------------------
PY=${RONDO_PYTHON:-}
if [[ -z "$PY" ]]; then
  if python3 -c "import torch" 2>/dev/null; then
    PY=$(command -v python3)
  elif [[ -x "$HOME/.cache/rondo/venv/bin/python" ]]; then
    PY="$HOME/.cache/rondo/venv/bin/python"
  else
    die "python" "no Python with torch (set RONDO_PYTHON)"
  fi
fi
TORCH=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())' 2>/dev/null)
say "torch $TORCH"
GPUS=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | grep -c "^GPU")
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader | tee "$LOGS/libraries.log"
  row "GPU" "$(head -1 "$LOGS/libraries.log")" "-"
else
  row "GPU" "none (nvidia-smi sees none): cuda tests skip, benchmarks on the CPU" "-"
fi
row "torch" "$TORCH" "-"
command -v nvcc >/dev/null && row "nvcc" "$(nvcc --version | grep -o 'release [0-9.]*')" "-"

# --- Debian libraries, unpacked (no root, no network needed) -------------------------------------
# Unpacked unless every -dev package the build needs is installed (a machine may have some: the
# first GPU machine had hwloc's but not liburing's).
NEED_SYSROOT=${RONDO_FORCE_SYSROOT:-}
for pkg in libhwloc-dev liburing-dev libxxhash-dev libpcre2-dev libtbb-dev libgtest-dev \
  nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libgloo-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || NEED_SYSROOT=1
done
if [[ -n "$NEED_SYSROOT" ]]; then
  [[ -d "$ROOT/.gpu-debs" ]] || die "libraries" ".gpu-debs/ is missing: run scripts/fetch-gpu-debs.sh here and carry .gpu-debs"
  T=$(date +%s)
  rm -rf "$SYSROOT"
  "$PY" - "$ROOT/.gpu-debs" "$SYSROOT" <<'PYEOF' >>"$LOGS/libraries.log" 2>&1 || { cat "$LOGS/libraries.log"; die "libraries" "unpacking the .deb files"; }
import io, os, sys, tarfile
src, dest = sys.argv[1], sys.argv[2]
os.makedirs(dest, exist_ok=True)
debs = sorted(n for n in os.listdir(src) if n.endswith(".deb"))
for name in debs:
    blob = open(os.path.join(src, name), "rb").read()
    assert blob[:8] == b"!<arch>\n", name + ": not a .deb"
    pos, found = 8, False
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        member = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        if member.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(blob[pos + 60:pos + 60 + size])) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(dest, filter="tar")
                else:
                    tar.extractall(dest)
            found = True
        pos += 60 + size + (size & 1)
    assert found, name + ": no data.tar member"
print(f"unpacked {len(debs)} packages")
PYEOF
  LIBDIR="$SYSROOT/usr/lib/x86_64-linux-gnu"
  export CMAKE_PREFIX_PATH="$SYSROOT/usr:$LIBDIR/cmake${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export PKG_CONFIG_LIBDIR="$LIBDIR/pkgconfig:$SYSROOT/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$SYSROOT"
  export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Every shared library unpacked must load here (its own needs met by the system or the sysroot),
  # and every header the build needs must be there: a missing one fails now, not mid-build.
  "$PY" - "$LIBDIR" "$SYSROOT/usr/include" <<'PYEOF' >>"$LOGS/libraries.log" 2>&1 || { cat "$LOGS/libraries.log"; die "libraries" "a library or header is missing or does not load"; }
import ctypes, glob, os, sys
libdir, include = sys.argv[1], sys.argv[2]
libs = sorted(p for p in glob.glob(os.path.join(libdir, "lib*.so.*")) if not os.path.islink(p))
bad = []
for lib in libs:
    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        bad.append(f"{lib}: {e}")
for header in ["hwloc.h", "liburing.h", "xxhash.h", "pcre2.h", "numa.h", "oneapi/tbb.h",
               "gtest/gtest.h", "gmock/gmock.h", "nlohmann/json.hpp", "CLI/CLI.hpp",
               "toml++/toml.h"]:
    if not os.path.exists(os.path.join(include, header)):
        bad.append(f"{include}/{header}: missing")
print(f"loaded {len(libs) - sum(1 for b in bad if 'missing' not in b)} of {len(libs)} libraries")
for b in bad:
    print("  " + b)
sys.exit(1 if bad else 0)
PYEOF
  row "libraries" "$(grep -h "unpacked\|loaded" "$LOGS/libraries.log" | tr '\n' ' ')" $(($(date +%s) - T))
fi

# --- Configure and build -------------------------------------------------------------------------
T=$(date +%s)
# CMake 4 refuses package files that ask for policies older than 3.5; Debian's ask for ranges that
# reach past it, and this keeps any that do not from stopping the configure.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
say "configuring $BUILD (CUDA arch $ARCH, $(cmake --version | head -1))"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRONDO_PYTHON="$PY" \
  -DRONDO_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DRONDO_BUILD_BENCH=ON -DRONDO_WITH_GUI=OFF \
  >"$LOGS/configure.log" 2>&1 || { tail -40 "$LOGS/configure.log"; die "configure" "see configure.log"; }
row "configure" "ok" $(($(date +%s) - T))
TARGETS=(kernels_cuda_test models_cuda_test engine_cuda_test link_bench attention_bench train_bench)
say "building ${TARGETS[*]} with $JOBS jobs"
T=$(date +%s)
TIMEFORMAT='%R %U %S'
{ time ninja -C "$BUILD" -k 0 -j "$JOBS" "${TARGETS[@]}" >"$LOGS/build.log" 2>&1; } 2>"$BUILD/build-time.txt"
BUILD_RC=$(grep -c "FAILED:" "$LOGS/build.log")
read -r WALL USER_S SYS_S <"$BUILD/build-time.txt" || true
CPU_S=$(awk -v u="${USER_S:-0}" -v s="${SYS_S:-0}" 'BEGIN { printf "%.0f", u + s }')
if ((BUILD_RC > 0)); then
  grep -E "error|FAILED" "$LOGS/build.log" | head -60
  die "build" "$BUILD_RC step(s) failed (build.log); wall ${WALL}s, ${CPU_S} CPU-s"
fi
row "build (${#TARGETS[@]} targets, $JOBS jobs)" "ok: ${CPU_S} CPU-s" "${WALL%.*}"

# --- Tests labelled cuda -------------------------------------------------------------------------
say "tests labelled cuda"
T=$(date +%s)
# Verbose: the tests' own lines (which SDPA kernel packed rows get) land in the log too.
ctest --test-dir "$BUILD" -L cuda --timeout 120 -V >"$LOGS/ctest-cuda.log" 2>&1
CUDA_RC=$?
PASSED=$(grep -c " Passed " "$LOGS/ctest-cuda.log")
SKIPPED=$(grep -c "(Skipped)\| Skipped " "$LOGS/ctest-cuda.log")
FAILED_N=$(grep -cE "\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception|Not Run" "$LOGS/ctest-cuda.log")
RESULT="$PASSED passed, $FAILED_N failed, $SKIPPED skipped"
if ((PASSED + FAILED_N + SKIPPED == 0)); then
  CUDA_RC=1
  RESULT="FAILED: ctest found no cuda tests (ctest-cuda.log)"
fi
if ((GPUS > 0 && SKIPPED > 0)); then
  CUDA_RC=1
  RESULT="$RESULT: FAILED, a GPU is present so nothing may skip"
fi
((CUDA_RC == 0)) || grep -E "\*\*\*|Failure|Expected|Which is|error" "$LOGS/ctest-cuda.log" | head -40
row "ctest -L cuda" "$RESULT" $(($(date +%s) - T))
SDPA=$(grep -o "packed rows, deterministic [a-z]*: SDPA backend [a-z]*" "$LOGS/ctest-cuda.log" |
  sed 's/packed rows, deterministic \([a-z]*\): SDPA backend /\1: /' | paste -sd, -)
[[ -n "$SDPA" ]] && row "SDPA kernel, packed rows (deterministic)" "$SDPA" "-"

# --- Benchmarks ---------------------------------------------------------------------------------
say "link_bench --cap $CAP"
T=$(date +%s)
timeout $(($(left) < 60 ? $(left) : 60)) "$BUILD/bench/link_bench" --cap "$CAP" >"$LOGS/link_bench.log" 2>&1
LINK_RC=$?
row "link_bench --cap $CAP" "exit $LINK_RC" $(($(date +%s) - T))

# Packed rows: attention per document (variable-length flash attention on a GPU) against a mask.
ADEV=cpu
((GPUS > 0)) && ADEV=cuda
say "attention_bench --device $ADEV --dtype bf16"
T=$(date +%s)
timeout $(($(left) < 60 ? $(left) : 60)) "$BUILD/bench/attention_bench" --device $ADEV --dtype bf16 \
  >"$LOGS/attention_bench.log" 2>&1
ATT_RC=$?
ATT=$(awk '$1 == 1 && $2 == 2048 && $3 == 8 { print $6 }' "$LOGS/attention_bench.log")
row "attention_bench $ADEV bf16" "exit $ATT_RC, masked / per-document time (T 2048, 8 docs) = ${ATT:-?}" \
  $(($(date +%s) - T))

METHODS=(lora full)
if [[ "$BENCH" == none ]]; then
  METHODS=()
elif [[ "$BENCH" == full ]]; then
  # Qwen3-1.7B's shape, random bf16 weights, rows of 4096 tokens, 8 microbatches of one row per
  # step, LoRA r32 on all linear layers or full fine-tuning (bench/train_bench.cpp). The host
  # memory is named: a microVM's MemAvailable starts far below what it can grow to.
  MODEL=(--preset qwen3-1.7b --host-memory 96GB)
else
  MODEL=(--layers 2 --hidden 128 --ffn 256 --heads 4 --kv-heads 2 --seq-len 128 --rows 2
         --accum 2 --steps 4 --rank 8)
fi
TRAIN_RC=0
for method in "${METHODS[@]}"; do
  LIMIT=$(($(left) - 15))
  ((LIMIT > 220)) && LIMIT=220
  if ((LIMIT < 30)); then
    row "train_bench $method bf16" "skipped: out of time" 0
    continue
  fi
  say "train_bench --method $method --dtype bf16 --cap $CAP ${MODEL[*]} (at most ${LIMIT}s)"
  # LoRA also runs rondo with deterministic kernels off: what exactness costs.
  EXTRA=()
  [[ $method == lora ]] && EXTRA=(--nondeterministic)
  T=$(date +%s)
  timeout $LIMIT "$BUILD/bench/train_bench" --method $method --dtype bf16 --cap "$CAP" "${MODEL[@]}" \
    "${EXTRA[@]}" >"$LOGS/train_bench_$method.log" 2>&1
  RC=$?
  ((RC == 0)) || TRAIN_RC=$RC
  RATIO=$(grep -o "ratio rondo / plain: [0-9.]*" "$LOGS/train_bench_$method.log" | grep -o "[0-9.]*$")
  row "train_bench $method bf16" "exit $RC, rondo / plain tokens/s = ${RATIO:-?}" $(($(date +%s) - T))
done

# --- Results, the table last ---------------------------------------------------------------------
echo
for f in link_bench attention_bench train_bench_lora train_bench_full; do
  [[ -f "$LOGS/$f.log" ]] || continue
  echo "--- $f"
  tail -15 "$LOGS/$f.log"
done
table
[[ $CUDA_RC -eq 0 && $LINK_RC -eq 0 && $ATT_RC -eq 0 && $TRAIN_RC -eq 0 ]]
