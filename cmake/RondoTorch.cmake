# libtorch from the `torch` wheel in Rondo's Python environment (scripts/setup.sh creates it under
# ~/.cache/rondo/venv, or $RONDO_VENV). Debian's libtorch is not used.
#
# Defines rondo::torch (headers + libraries), RONDO_TORCH_LIBDIR and RONDO_TORCH_RPATH (the run path
# every binary linking torch needs, the wheel's CUDA libraries first; see RondoCuda.cmake).
if(NOT RONDO_PYTHON)
  if(DEFINED ENV{RONDO_PYTHON})
    set(_py "$ENV{RONDO_PYTHON}")
  elseif(DEFINED ENV{RONDO_VENV})
    set(_py "$ENV{RONDO_VENV}/bin/python")
  elseif(EXISTS "$ENV{HOME}/.cache/rondo/venv/bin/python")
    set(_py "$ENV{HOME}/.cache/rondo/venv/bin/python")
  else()
    find_program(_py NAMES python3 python)
  endif()
  set(RONDO_PYTHON "${_py}" CACHE FILEPATH "Python interpreter whose torch package is built against")
endif()

execute_process(
  COMMAND "${RONDO_PYTHON}" -c [=[
import glob, os, torch
site = os.path.dirname(os.path.dirname(torch.__file__))
cuda = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*")))
print(os.path.join(os.path.dirname(torch.__file__), "lib"))
print(os.path.dirname(cuda[0]) if cuda else "")
print(torch.__version__)
print(torch.version.cuda or "")
print(int(torch.compiled_with_cxx11_abi()))
]=]
  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "Could not import torch with ${RONDO_PYTHON}:\n${_err}\n"
                      "Run scripts/setup.sh, or point -DRONDO_PYTHON at a Python with torch.")
endif()
string(REPLACE "\n" ";" _out "${_out}")
list(GET _out 0 RONDO_TORCH_LIBDIR)
list(GET _out 1 RONDO_TORCH_CUDA_LIBDIR)
list(GET _out 2 RONDO_TORCH_VERSION)
list(GET _out 3 RONDO_TORCH_CUDA_VERSION)
list(GET _out 4 RONDO_TORCH_CXX11_ABI)

if(RONDO_WITH_CUDA)
  rondo_cuda_runtime("${RONDO_TORCH_CUDA_LIBDIR}")
endif()

# We import the wheel's libraries ourselves instead of find_package(Torch): TorchConfig runs
# Caffe2's CUDA detection, which needs a toolkit matching the wheel and puts the toolkit's libcudart
# on the link line next to the wheel's (two runtimes, and a run path CMake cannot order). libtorch
# finds its own CUDA libraries through its RPATH; we only need the three below.
foreach(_lib torch torch_cpu c10)
  find_library(RONDO_LIB_${_lib} NAMES ${_lib} PATHS "${RONDO_TORCH_LIBDIR}" NO_DEFAULT_PATH REQUIRED)
endforeach()
get_filename_component(_torch_include "${RONDO_TORCH_LIBDIR}/../include" ABSOLUTE)
message(STATUS "torch ${RONDO_TORCH_VERSION} (CUDA ${RONDO_TORCH_CUDA_VERSION}) from ${RONDO_TORCH_LIBDIR}")

add_library(rondo_torch INTERFACE)
add_library(rondo::torch ALIAS rondo_torch)
# All of it within one --no-as-needed: the linker records each library in the order named here,
# and that order matters twice.
#  - libstdc++ comes first, ahead of torch's libraries: some wheels (torch 2.11's libtorch.so)
#    export their own copies of parts of the C++ library (std::filesystem::remove_all,
#    std::chrono's time zones), and the dynamic linker binds each symbol to the first library in
#    the executable's list that defines it. Torch's copies crash when called from our code (a null
#    call inside remove_all); with libstdc++ first, every std:: symbol is the system library's.
#  - libtorch_cuda is named: it arrives through libtorch.so's own needs, which a linker with
#    --as-needed (Ubuntu's default) drops since nothing of ours names its symbols, and torch would
#    then see no GPU and every `cuda` test would skip.
# One push/pop pair only: CMake drops repeated identical flags, which would unbalance a second one.
# tests/support/check_linking.sh checks both.
set(RONDO_TORCH_CUDA_LIB "")
if(EXISTS "${RONDO_TORCH_LIBDIR}/libtorch_cuda.so")
  set(RONDO_TORCH_CUDA_LIB "${RONDO_TORCH_LIBDIR}/libtorch_cuda.so")
endif()
target_link_libraries(rondo_torch INTERFACE
  "-Wl,--push-state,--no-as-needed" stdc++ "${RONDO_LIB_torch}" "${RONDO_LIB_torch_cpu}"
  "${RONDO_LIB_c10}" ${RONDO_TORCH_CUDA_LIB} "-Wl,--pop-state" Threads::Threads)
# Kernels compiled by one CUDA major version and run on another's runtime fail at launch.
if(RONDO_WITH_CUDA AND RONDO_TORCH_CUDA_VERSION)
  string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${RONDO_TORCH_CUDA_VERSION}")
  string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
  if(NOT _torch_cuda_major STREQUAL _nvcc_major)
    message(FATAL_ERROR
      "nvcc ${CMAKE_CUDA_COMPILER_VERSION} is CUDA ${_nvcc_major}, but the torch wheel "
      "(${RONDO_TORCH_LIBDIR}) runs CUDA ${RONDO_TORCH_CUDA_VERSION}: our kernels would be built "
      "for one runtime and loaded with the other. Install a CUDA ${_torch_cuda_major} toolkit "
      "(CMAKE_CUDA_COMPILER), use a torch wheel built for CUDA ${_nvcc_major}, or configure with "
      "-DRONDO_CUDA=OFF.")
  endif()
endif()
target_include_directories(rondo_torch SYSTEM INTERFACE
  "${_torch_include}" "${_torch_include}/torch/csrc/api/include")
# The wheel ships fmt 12 headers in its include folder, which shadow Debian's fmt 9 for every target
# that sees torch's headers. So those targets use the wheel's fmt, header-only: one fmt, no
# mismatch between headers and library.
target_compile_definitions(rondo_torch INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${RONDO_TORCH_CXX11_ABI} RONDO_TORCH_VERSION="${RONDO_TORCH_VERSION}"
  FMT_HEADER_ONLY=1)

set(RONDO_TORCH_RPATH "${RONDO_TORCH_CUDA_LIBDIR};${RONDO_TORCH_LIBDIR}")
list(FILTER RONDO_TORCH_RPATH EXCLUDE REGEX "^$")

# rondo_torch_binary(<target>): an executable that links torch; the wheel's folders go first in
# its run path so the process loads exactly one CUDA runtime, torch's. As DT_RPATH, not RUNPATH:
# an LD_LIBRARY_PATH naming another CUDA cannot swap the runtime under torch.
function(rondo_torch_binary target)
  set_target_properties(${target} PROPERTIES BUILD_RPATH "${RONDO_TORCH_RPATH}"
                                             INSTALL_RPATH "${RONDO_TORCH_RPATH}")
  target_link_options(${target} PRIVATE "-Wl,--disable-new-dtags")
endfunction()
