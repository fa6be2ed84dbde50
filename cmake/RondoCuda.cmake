# CUDA is optional and declared here only. RONDO_WITH_CUDA is ON when RONDO_CUDA is ON, or AUTO and
# nvcc is found. All CUDA code then compiles, whether or not a GPU is present.
#
# One CUDA runtime per process: libtorch_cuda loads the libcudart (and cuBLAS) of the torch wheel,
# so our code links those same files (rondo::cudart, rondo::cublas) rather than the toolkit's, and
# their folder comes first in the run path. The toolkit only supplies nvcc and headers. Nothing
# links libcuda (the driver): binaries must start on machines without one.
set(RONDO_WITH_CUDA OFF)
if(RONDO_TSAN)
  set(RONDO_CUDA OFF)  # the TSan build covers the simulated device only
endif()
if(NOT RONDO_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(RONDO_WITH_CUDA ON)
  elseif(RONDO_CUDA STREQUAL "ON")
    message(FATAL_ERROR "RONDO_CUDA=ON but no CUDA compiler (nvcc) was found. "
                        "Install the CUDA toolkit or configure with -DRONDO_CUDA=OFF.")
  endif()
endif()

if(RONDO_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # An explicit list: "native" fails on machines without a GPU (CI, this build host). Only the
    # architectures this nvcc knows: sm_120 came with CUDA 12.8.
    execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version OUTPUT_VARIABLE _nvcc_out
                    ERROR_QUIET)
    string(REGEX MATCH "release ([0-9]+\\.[0-9]+)" _ "${_nvcc_out}")
    set(_nvcc_version "${CMAKE_MATCH_1}")
    set(CMAKE_CUDA_ARCHITECTURES
        80   # A100
        86   # RTX 3090 / A6000 (Ampere consumer)
        89   # RTX 4090 / L40 (Ada)
        90   # H100 / H200 (Hopper)
    )
    if(_nvcc_version VERSION_GREATER_EQUAL 12.8)
      list(APPEND CMAKE_CUDA_ARCHITECTURES 120)  # RTX 5090 (Blackwell consumer)
    else()
      message(STATUS "CUDA: nvcc ${_nvcc_version} predates sm_120 (RTX 50xx): not built for it")
    endif()
  endif()
  # We link the runtime ourselves (below), never the toolkit's static one.
  set(CMAKE_CUDA_RUNTIME_LIBRARY None)
  enable_language(CUDA)
  # C++17 for .cu files: CMake 3.25 (Debian 12) does not know nvcc's C++20 flag. Kernels and their
  # launchers need nothing newer; C++20 code stays in .cpp files.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "CUDA: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
endif()

# rondo_cuda_runtime(<dir>): called once the torch wheel's CUDA library folder is known (or with an
# empty dir to fall back on the toolkit). Defines rondo::cudart and rondo::cublas.
function(rondo_cuda_runtime libdir)
  if(TARGET rondo::cudart)
    return()
  endif()
  foreach(lib cudart cublas)
    set(_file "")
    if(libdir)
      file(GLOB _cands "${libdir}/lib${lib}.so.[0-9]*")
      list(SORT _cands)
      list(LENGTH _cands _n)
      if(_n GREATER 0)
        list(GET _cands 0 _file)
      endif()
    endif()
    if(_file)
      add_library(rondo::${lib} SHARED IMPORTED GLOBAL)
      set_target_properties(rondo::${lib} PROPERTIES
        IMPORTED_LOCATION "${_file}" IMPORTED_NO_SONAME OFF
        INTERFACE_INCLUDE_DIRECTORIES "${CUDAToolkit_INCLUDE_DIRS}")
    else()
      add_library(rondo::${lib} INTERFACE IMPORTED GLOBAL)
      target_link_libraries(rondo::${lib} INTERFACE CUDA::${lib})
    endif()
    if(_file)
      message(STATUS "CUDA ${lib}: ${_file} (the torch wheel's)")
    else()
      message(STATUS "CUDA ${lib}: the toolkit's")
    endif()
  endforeach()
endfunction()
