#!/usr/bin/env bash
# Fuzzes the readers of untrusted input (fuzz/: safetensors, GGUF, tokenizer.json, chat templates,
# JSONL data, the TOML config, a checkpoint's state.json) with libFuzzer, AddressSanitizer and
# UBSan: builds the harnesses with clang into build-fuzz, then runs each for SECONDS (default 10)
# from its seed corpus (fuzz/corpus/<name>) plus what earlier runs found (build-fuzz/corpus/<name>).
# A crash, a sanitizer report, a leak or a hang (an input over 10 s) fails; the input that did it
# is left in build-fuzz/artifacts/. Needs scripts/setup.sh first (clang, libclang-rt-14-dev).
#
#   scripts/fuzz.sh [SECONDS] [HARNESS...]     e.g. scripts/fuzz.sh 1800 tokenizer jsonl
#   RONDO_FUZZ_JOBS=2 scripts/fuzz.sh 1800     harnesses run two at a time
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RONDO_CACHE=${RONDO_CACHE:-$HOME/.cache/rondo}
RONDO_VENV=${RONDO_VENV:-$RONDO_CACHE/venv}
BUILD=${RONDO_FUZZ_BUILD_DIR:-$ROOT/build-fuzz}
export CCACHE_DIR=${CCACHE_DIR:-$RONDO_CACHE/ccache}
SECONDS_EACH=${1:-10}
shift || true
ALL=(safetensors gguf tokenizer chat_template jsonl config state_json)
HARNESSES=("$@")
((${#HARNESSES[@]})) || HARNESSES=("${ALL[@]}")
JOBS=${RONDO_FUZZ_JOBS:-1}

if [[ ! -f "$BUILD/build.ninja" ]]; then
  echo "==> configuring $BUILD (clang, libFuzzer, ASan, UBSan)"
  cmake -S "$ROOT/fuzz" -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
    -DRONDO_PYTHON="$RONDO_VENV/bin/python" >/dev/null || {
    echo "scripts/fuzz.sh: configure failed" >&2
    exit 1
  }
fi
echo "==> building the harnesses"
ninja -C "$BUILD" fuzz_all || {
  echo "scripts/fuzz.sh: build failed" >&2
  exit 1
}

mkdir -p "$BUILD/artifacts" "$BUILD/logs"
run_one() {
  local h=$1
  local corpus="$BUILD/corpus/$h"
  mkdir -p "$corpus"
  # Leaks inside the uninstrumented torch wheel are not ours to report (the torch-free harnesses
  # keep leak detection).
  local leaks=1
  case $h in safetensors | gguf | config) leaks=0 ;; esac
  ASAN_OPTIONS="detect_leaks=$leaks" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1" \
    "$BUILD/${h}_fuzz" "$corpus" "$ROOT/fuzz/corpus/$h" -max_total_time="$SECONDS_EACH" \
    -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$BUILD/artifacts/${h}-" >"$BUILD/logs/$h.log" 2>&1
  local rc=$?
  echo "$rc" >"$BUILD/logs/$h.rc"
  local stats
  stats=$(grep -E '^stat::number_of_executed_units|^stat::peak_rss_mb' "$BUILD/logs/$h.log" |
    sed 's/stat:://' | tr '\n' ' ')
  local cov
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$BUILD/logs/$h.log" | tail -1)
  if ((rc == 0)); then
    echo "    $h: ok ($SECONDS_EACH s; $cov; $stats)"
  else
    echo "    $h: FAILED (rc $rc; log $BUILD/logs/$h.log)"
    grep -E 'ERROR: |SUMMARY: |Test unit written' "$BUILD/logs/$h.log" | head -5 | sed 's/^/      /'
  fi
  return $rc
}

echo "==> fuzzing ${HARNESSES[*]} for $SECONDS_EACH s each ($JOBS at a time)"
failed=()
for h in "${HARNESSES[@]}"; do
  if [[ ! -x "$BUILD/${h}_fuzz" ]]; then
    echo "scripts/fuzz.sh: no harness '$h' (known: ${ALL[*]})" >&2
    exit 2
  fi
  rm -f "$BUILD/logs/$h.rc"
  run_one "$h" &
  while (($(jobs -rp | wc -l) >= JOBS)); do sleep 1; done
done
# Each harness's result from the file it wrote (`wait PID` can no longer name a job that `jobs`
# has reaped: "not a child of this shell").
wait
for h in "${HARNESSES[@]}"; do
  [[ "$(cat "$BUILD/logs/$h.rc" 2>/dev/null)" == 0 ]] || failed+=("$h")
done
if ((${#failed[@]})); then
  echo "scripts/fuzz.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/fuzz.sh: no crash, leak or hang"
