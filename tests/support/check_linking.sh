#!/bin/bash
# The binaries load torch's CUDA as the GPU path needs (issue: the GPU path made right before its
# first GPU): each needs libtorch_cuda.so directly when the wheel has it (so that a linker with
# --as-needed cannot drop it), carries DT_RPATH rather than RUNPATH (so that LD_LIBRARY_PATH cannot
# swap the CUDA runtime), and resolves exactly one libcudart.
#
#   check_linking.sh WITH_TORCH_CUDA(0|1) BINARY...
set -uo pipefail
want_torch_cuda=$1
shift
status=0
for bin in "$@"; do
  dyn=$(readelf -d "$bin") || { echo "FAIL: cannot read $bin"; status=1; continue; }
  if [[ $want_torch_cuda == 1 ]] && ! grep -q 'NEEDED.*\[libtorch_cuda\.so\]' <<<"$dyn"; then
    echo "FAIL: $bin does not need libtorch_cuda.so (torch would see no GPU)"
    status=1
  fi
  if grep -q '(RUNPATH)' <<<"$dyn" || ! grep -q '(RPATH)' <<<"$dyn"; then
    echo "FAIL: $bin has no DT_RPATH (or a RUNPATH, which LD_LIBRARY_PATH overrides)"
    status=1
  fi
  cudarts=$(ldd "$bin" | awk '/libcudart\.so/ {print $3}' | sort -u)
  n=$(grep -c . <<<"$cudarts")
  if [[ $n -gt 1 ]]; then
    echo "FAIL: $bin resolves $n CUDA runtimes: $(tr '\n' ' ' <<<"$cudarts")"
    status=1
  fi
  echo "$bin: torch_cuda $(grep -c 'libtorch_cuda' <<<"$dyn"), libcudart: ${cudarts:-none}"
done
exit $status
