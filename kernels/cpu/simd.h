// Which x86 SIMD path a CPU kernel runs (scalar, AVX2, AVX-512), chosen at run time, and the
// floating-point storage types those kernels read and write. The build targets x86-64-v3; AVX-512
// code is compiled per file and only runs after simd_path_resolve() found the CPU supports it.
// Used by the CPU kernels (adamw.h) and by tests that force each path.
//
//   kernels::SimdPath used = kernels::simd_path_resolve(kernels::SimdPath::kAuto);
//   std::printf("AdamW runs on %s\n", kernels::to_string(used));  // "avx512"
//
// No inline functions here on purpose: the per-ISA translation units include this header, and an
// inline function emitted there could be picked by the linker for baseline code. See
// Note [One ISA per translation unit] in adamw.cpp.
#pragma once

#include <cstddef>

namespace rondo::kernels {

enum class SimdPath {
  kAuto,    // the widest path this CPU supports, capped by the RONDO_SIMD environment variable
  kScalar,  // the reference: plain C++, also used for the tail of every SIMD loop
  kAvx2,    // AVX2 + FMA + F16C, 8 floats per instruction
  kAvx512,  // AVX-512F, 16 floats per instruction
};

const char* to_string(SimdPath path);  // "auto", "scalar", "avx2", "avx512"

// Whether this CPU (and OS: the AVX-512 register state must be enabled) can run `path`.
bool simd_path_supported(SimdPath path);

// The path a kernel called with `requested` runs. kAuto gives the widest supported one, capped by
// RONDO_SIMD=scalar|avx2|avx512 when set (to rule out a SIMD bug without rebuilding). An explicit
// path the CPU lacks, or an unknown RONDO_SIMD value, throws rondo::Error.
SimdPath simd_path_resolve(SimdPath requested);

// Storage types of gradients and streaming weight copies. Master weights and moments are f32.
enum class FloatDType {
  kF32,   // IEEE binary32
  kF16,   // IEEE binary16 (converted with F16C, round to nearest even)
  kBF16,  // bfloat16: the upper half of a binary32 (round to nearest even, NaN stays NaN)
};

const char* to_string(FloatDType dtype);   // "F32", "F16", "BF16" (safetensors names)
std::size_t dtype_size(FloatDType dtype);  // bytes per element: 4, 2, 2

}  // namespace rondo::kernels
