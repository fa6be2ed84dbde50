#include "kernels/cpu/simd.h"

#include <cstdlib>
#include <string>

#include "kernels/error.h"

namespace rondo::kernels {

const char* to_string(SimdPath path) {
  switch (path) {
    case SimdPath::kAuto:
      return "auto";
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "?";
}

const char* to_string(FloatDType dtype) {
  switch (dtype) {
    case FloatDType::kF32:
      return "F32";
    case FloatDType::kF16:
      return "F16";
    case FloatDType::kBF16:
      return "BF16";
  }
  return "?";
}

std::size_t dtype_size(FloatDType dtype) {
  return dtype == FloatDType::kF32 ? 4 : 2;
}

bool simd_path_supported(SimdPath path) {
  // libgcc's checks include the OS side (XGETBV): AVX-512 counts only where the kernel saves the
  // ZMM and mask registers.
  __builtin_cpu_init();
  switch (path) {
    case SimdPath::kAuto:
    case SimdPath::kScalar:
      return true;
    case SimdPath::kAvx2:
#if defined(__clang__) && __clang_major__ < 16
      // clang before 16 knows no "f16c" here (the fuzz build uses clang 14); every CPU with AVX2
      // and FMA has F16C (Intel since Haswell, AMD since Piledriver).
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#endif
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && simd_path_supported(SimdPath::kAvx2);
  }
  return false;
}

namespace {

SimdPath widest_supported() {
  static const SimdPath widest = simd_path_supported(SimdPath::kAvx512) ? SimdPath::kAvx512
                                 : simd_path_supported(SimdPath::kAvx2) ? SimdPath::kAvx2
                                                                        : SimdPath::kScalar;
  return widest;
}

// RONDO_SIMD, read once; kAuto when unset or empty.
SimdPath env_cap() {
  static const SimdPath cap = [] {
    const char* value = std::getenv("RONDO_SIMD");
    if (value == nullptr || *value == '\0') return SimdPath::kAuto;
    const std::string text = value;
    for (SimdPath p : {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512})
      if (text == to_string(p)) return p;
    throw Error("RONDO_SIMD='" + text + "' is not a SIMD path: use scalar, avx2 or avx512 (or " +
                "unset it to use the widest this CPU has)");
  }();
  return cap;
}

}  // namespace

SimdPath simd_path_resolve(SimdPath requested) {
  if (requested == SimdPath::kAuto) {
    const SimdPath cap = env_cap();
    const SimdPath widest = widest_supported();
    // The enumerators are ordered by width.
    return cap != SimdPath::kAuto && static_cast<int>(cap) < static_cast<int>(widest) ? cap
                                                                                      : widest;
  }
  if (!simd_path_supported(requested))
    throw Error(std::string("SIMD path ") + to_string(requested) +
                " was requested, but this CPU does not support it (the widest it supports is " +
                to_string(widest_supported()) + ")");
  return requested;
}

}  // namespace rondo::kernels
