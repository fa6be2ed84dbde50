#!/bin/bash
# The binaries load torch's CUDA as the GPU path needs (issue: the GPU path made right before its
# first GPU): each needs libtorch_cuda.so directly when the wheel has it (so that a linker with
# --as-needed cannot drop it), carries DT_RPATH rather than RUNPATH (so that LD_LIBRARY_PATH cannot
# swap the CUDA runtime), resolves exactly one libcudart, and needs libstdc++ ahead of libtorch
# (torch 2.11's libtorch.so exports copies of std::filesystem functions that crash when our code
# binds to them; the first library in the list wins).
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
  needed=$(grep -o 'NEEDED.*\[[^]]*\]' <<<"$dyn" | sed 's/.*\[\(.*\)\]/\1/')
  first_stdcxx=$(grep -n '^libstdc++\.so' <<<"$needed" | head -1 | cut -d: -f1)
  first_torch=$(grep -n '^libtorch' <<<"$needed" | head -1 | cut -d: -f1)
  if [[ -n "$first_torch" && (-z "$first_stdcxx" || $first_stdcxx -gt $first_torch) ]]; then
    echo "FAIL: $bin needs libtorch before libstdc++ (torch's copies of std:: functions would win)"
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
