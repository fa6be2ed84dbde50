# Libraries from Debian's packages (scripts/setup.sh installs them). On a GPU machine without them,
# scripts/gpu-check.sh unpacks the same packages into a folder and points CMAKE_PREFIX_PATH there;
# where pkg-config itself is missing, the C libraries are found by header and library name.
find_package(Threads REQUIRED)
find_package(PkgConfig QUIET)

# rondo_find_c_library(<NAME> <pkg-config module> <header> <library>) -> PkgConfig::<NAME>
function(rondo_find_c_library name module header library)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(${name} QUIET IMPORTED_TARGET GLOBAL ${module})
  endif()
  if(NOT TARGET PkgConfig::${name})
    find_path(${name}_INCLUDE_DIR ${header})
    find_library(${name}_LIBRARY ${library})
    if(NOT ${name}_INCLUDE_DIR OR NOT ${name}_LIBRARY)
      message(FATAL_ERROR "${module} not found (${header}, lib${library}). "
                          "Run scripts/setup.sh, or install its Debian -dev package.")
    endif()
    add_library(PkgConfig::${name} INTERFACE IMPORTED GLOBAL)
    target_include_directories(PkgConfig::${name} INTERFACE "${${name}_INCLUDE_DIR}")
    target_link_libraries(PkgConfig::${name} INTERFACE "${${name}_LIBRARY}")
  endif()
  message(STATUS "${module}: found")
endfunction()

rondo_find_c_library(HWLOC hwloc hwloc.h hwloc)
rondo_find_c_library(URING liburing liburing.h uring)
rondo_find_c_library(XXHASH libxxhash xxhash.h xxhash)  # XXH3 checksums (kernels/checksum.h)
rondo_find_c_library(PCRE2 libpcre2-8 pcre2.h pcre2-8)
# oneTBB (Debian's libtbb-dev ships its CMake config): the CPU kernels' threads.
find_package(TBB REQUIRED)
find_package(nlohmann_json REQUIRED)
if(RONDO_WITH_TORCH)
  find_package(CLI11 REQUIRED)
  find_package(tomlplusplus REQUIRED)  # config.toml (cli/config_file.cpp)
endif()
if(RONDO_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
