#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to a built Rondo: Debian packages, the Python
# environment (libtorch + the test oracles), configure, build. Idempotent: with nothing changed it
# finishes in seconds. Every step is announced; a failure names the step.
#
# Environment (all optional):
#   RONDO_CACHE      where the Python environment and ccache live   (~/.cache/rondo)
#   RONDO_VENV       the Python environment                          ($RONDO_CACHE/venv)
#   RONDO_BUILD_DIR  the build folder                                (<checkout>/build)
#   RONDO_PYTHON_BASE  the Python that creates the environment       (python3)
#   RONDO_CMAKE_ARGS extra arguments for the first configure (e.g. -DRONDO_WITH_GUI=ON)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RONDO_CACHE=${RONDO_CACHE:-$HOME/.cache/rondo}
RONDO_VENV=${RONDO_VENV:-$RONDO_CACHE/venv}
BUILD=${RONDO_BUILD_DIR:-$ROOT/build}
export CCACHE_DIR=${CCACHE_DIR:-$RONDO_CACHE/ccache}

STEP="start"
step() {
  STEP="$*"
  echo "==> $*"
}
trap 'echo "scripts/setup.sh: FAILED in step: $STEP (see the output above)" >&2' ERR

# --- Debian packages ---------------------------------------------------------------------------
PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git python3 python3-venv
  libtbb-dev libhwloc-dev liburing-dev libxxhash-dev nlohmann-json3-dev libpcre2-dev libcli11-dev
  libtomlplusplus-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev
  qt6-base-dev qt6-charts-dev libqt6opengl6-dev libgl-dev xvfb libsimdjson-dev
  clang libclang-rt-14-dev libgloo-dev
)
step "checking Debian packages"
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  step "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "not root and no sudo: install ${missing[*]}" >&2; false; }
    SUDO=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# --- Python environment ------------------------------------------------------------------------
REQ="$ROOT/scripts/requirements.txt"
REQ_NODEPS="$ROOT/scripts/requirements-nodeps.txt"
STAMP="$RONDO_VENV/.rondo-requirements.sha256"
want=$(cat "$REQ" "$REQ_NODEPS" | sha256sum | cut -d' ' -f1)
if [[ ! -x "$RONDO_VENV/bin/python" ]]; then
  step "creating the Python environment in $RONDO_VENV"
  mkdir -p "$(dirname "$RONDO_VENV")"
  "${RONDO_PYTHON_BASE:-python3}" -m venv "$RONDO_VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  step "installing Python packages from scripts/requirements.txt (torch is large: minutes)"
  "$RONDO_VENV/bin/python" -m pip install -q --upgrade pip
  "$RONDO_VENV/bin/python" -m pip install -q -r "$REQ"
  "$RONDO_VENV/bin/python" -m pip install -q --no-deps -r "$REQ_NODEPS"
  step "checking the Python environment"
  "$RONDO_VENV/bin/python" -c "import torch, transformers, peft, safetensors, tokenizers, gguf, numpy, pytest; print('torch', torch.__version__)"
  echo "$want" >"$STAMP"
else
  echo "    Python environment up to date ($RONDO_VENV)"
fi

# --- llama.cpp, opt-in: RONDO_WITH_LLAMA_CPP=1 ---------------------------------------------------
# llama-cpp-python from PyPI, compiled here (10-20 minutes on 2 cores), for tests/oracle/
# test_llama_cpp.py (skipped without it). Portable AVX2 code, not -march=native: a native build
# uses AMX where the CPU has it, and crashed (SIGSEGV) on Q8_0 models in a VM that does not enable
# AMX for processes.
LLAMA_CPP_VERSION=0.3.36
if [[ "${RONDO_WITH_LLAMA_CPP:-0}" == 1 ]]; then
  if "$RONDO_VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_VERSION')" 2>/dev/null; then
    echo "    llama-cpp-python $LLAMA_CPP_VERSION already installed"
  else
    step "building llama.cpp into the Python environment (llama-cpp-python $LLAMA_CPP_VERSION; 10-20 minutes)"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$RONDO_VENV/bin/python" -m pip install -q --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
  fi
fi

# --- Configure and build -----------------------------------------------------------------------
if [[ ! -f "$BUILD/build.ninja" ]]; then
  step "configuring $BUILD"
  # shellcheck disable=SC2086
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DRONDO_PYTHON="$RONDO_VENV/bin/python" \
    ${RONDO_CMAKE_ARGS:-}
fi
step "building (ninja -C $BUILD)"
ninja -C "$BUILD"
echo "==> done: $BUILD/cli/rondo"
