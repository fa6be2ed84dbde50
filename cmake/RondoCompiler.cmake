# Compiler launcher and per-target flags. Flags are set per target, never through the global
# CMAKE_CXX_FLAGS (docs/README.md, "How the code is written").

find_program(RONDO_CCACHE ccache)
if(RONDO_CCACHE)
  # The precompiled header needs these sloppiness settings or ccache never hits.
  set(_rondo_launcher ${CMAKE_COMMAND} -E env
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
      ${RONDO_CCACHE})
  set(CMAKE_C_COMPILER_LAUNCHER ${_rondo_launcher})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${_rondo_launcher})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${_rondo_launcher})
  message(STATUS "ccache: ${RONDO_CCACHE}")
endif()

# rondo_target_flags(<target> [NUMERIC])
#   Warnings, the x86-64-v3 baseline (AVX-512 paths are chosen at run time), and for NUMERIC code
#   -fno-math-errno (without it GCC does not vectorise sqrt). Applies ThreadSanitizer or
#   AddressSanitizer (+ UBSan) when on.
function(rondo_target_flags target)
  cmake_parse_arguments(ARG "NUMERIC" "" "" ${ARGN})
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers -march=x86-64-v3>)
  if(ARG_NUMERIC)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-math-errno>)
  endif()
  if(RONDO_TSAN)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread -g>)
    target_link_options(${target} PRIVATE -fsanitize=thread)
  endif()
  if(RONDO_ASAN)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -g>)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()
