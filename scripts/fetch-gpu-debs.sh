#!/usr/bin/env bash
# Run here (a machine with Debian's package lists), before a GPU check: downloads the Debian
# packages the build needs into .gpu-debs/ (ignored by git), which the device tool carries to the
# GPU machine, where scripts/gpu-check.sh unpacks them. The GPU machine has CUDA, CMake, Ninja and
# torch, but no network and none of these libraries.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST="$ROOT/.gpu-debs"
PACKAGES=(
  libhwloc-dev libhwloc15 libudev1 libnuma-dev libnuma1 libltdl-dev libltdl7
  liburing-dev liburing2 libxxhash-dev libxxhash0
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
  libgtest-dev libgmock-dev googletest
  nlohmann-json3-dev libcli11-dev libpcre2-dev libpcre2-8-0
  libtomlplusplus-dev libtomlplusplus3 libgloo-dev
)
mkdir -p "$DEST"
cd "$DEST"
apt-get download "${PACKAGES[@]}"
ls -1 "$DEST"
du -sh "$DEST"
