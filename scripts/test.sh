#!/usr/bin/env bash
# The test command (README, .ci/run): every test that runs without a GPU — labels cpu, oracle and
# gui — in the main build; then the device layer, offload (host arena, NVMe store) and engine tests
# again in a ThreadSanitizer build (our code instrumented; the torch wheel is not, so races inside
# torch are out of its sight; torch on one thread so that its OpenMP pool stays out of it); then the
# models tests (the checkpoint readers' malformed-input tests among them) under AddressSanitizer +
# UBSan; then a short libFuzzer pass of each reader of untrusted input (scripts/fuzz.sh,
# RONDO_FUZZ_SECONDS each, default 15).
# Needs scripts/setup.sh first. Extra arguments go to the main ctest run (e.g. -R SimDevice).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RONDO_CACHE=${RONDO_CACHE:-$HOME/.cache/rondo}
BUILD=${RONDO_BUILD_DIR:-$ROOT/build}
TSAN_BUILD=${RONDO_TSAN_BUILD_DIR:-$ROOT/build-tsan}
ASAN_BUILD=${RONDO_ASAN_BUILD_DIR:-$ROOT/build-asan}
RONDO_VENV=${RONDO_VENV:-$RONDO_CACHE/venv}
export CCACHE_DIR=${CCACHE_DIR:-$RONDO_CACHE/ccache}

if [[ ! -f "$BUILD/build.ninja" ]]; then
  echo "scripts/test.sh: no build in $BUILD; run scripts/setup.sh first" >&2
  exit 1
fi

failed=()
echo "==> building $BUILD"
ninja -C "$BUILD" || failed+=("build")
echo "==> tests: labels cpu, oracle, gui"
ctest --test-dir "$BUILD" -L 'cpu|oracle|gui' -LE slow --output-on-failure -j2 "$@" ||
  failed+=("tests")

echo "==> ThreadSanitizer build of the device layer, host arena and engine ($TSAN_BUILD)"
if [[ ! -f "$TSAN_BUILD/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$TSAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRONDO_TSAN=ON \
    -DRONDO_PYTHON="$RONDO_VENV/bin/python" >/dev/null || failed+=("tsan-configure")
fi
if ninja -C "$TSAN_BUILD" kernels_test offload_test engine_test; then
  # halt_on_error: a data race fails the test instead of scrolling past.
  # Ranks.* runs several ranks of c10d's Gloo process groups in threads of one process: their
  # threads live in the uninstrumented torch wheel, whose atomics (work objects' reference counts,
  # lazily made singletons) ThreadSanitizer cannot see, so it reports their own hand-overs as
  # races. Rondo's side of them uses each group from one thread; those tests run in the plain build.
  for t in kernels_test offload_test engine_test; do
    OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      "$TSAN_BUILD/tests/$t" --gtest_brief=1 --gtest_filter=-Ranks.* || failed+=("tsan-$t")
  done
else
  failed+=("tsan-build")
fi

echo "==> AddressSanitizer build of the models tests ($ASAN_BUILD)"
if [[ ! -f "$ASAN_BUILD/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$ASAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRONDO_CUDA=OFF \
    -DRONDO_ASAN=ON -DRONDO_PYTHON="$RONDO_VENV/bin/python" >/dev/null || failed+=("asan-configure")
fi
if ninja -C "$ASAN_BUILD" models_test; then
  # Leaks inside the uninstrumented torch wheel are not ours to report.
  ASAN_OPTIONS="detect_leaks=0" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1" \
    "$ASAN_BUILD/tests/models_test" --gtest_brief=1 || failed+=("asan-tests")
else
  failed+=("asan-build")
fi

echo "==> fuzzing: a short pass of each harness (scripts/fuzz.sh; clang, ASan, UBSan)"
"$ROOT/scripts/fuzz.sh" "${RONDO_FUZZ_SECONDS:-15}" || failed+=("fuzz")

if ((${#failed[@]})); then
  echo "scripts/test.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/test.sh: all passed"
