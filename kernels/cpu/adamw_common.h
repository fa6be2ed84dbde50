// What the baseline files of the CPU AdamW kernels share: the f32 kernel (adamw.cpp) and the 8-bit
// one (adamw8bit.cpp) load and store the same dtypes, cut tensors into the same tiles, validate
// the same hyper-parameters and pick their SIMD loops the same way. Baseline code only: the
// per-ISA files must never include this (inline functions; Note [One ISA per translation unit] in
// adamw.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw8bit.h"
#include "kernels/cpu/adamw_internal.h"
#include "kernels/cpu/float_convert.h"
#include "kernels/cpu/parallel.h"

namespace rondo::kernels::detail {

// Elements per tile. A tile touches at most 20 bytes per element (f32 gradient, master, m, v and
// stream copy): 160 KiB, which stays in the L2 of any x86 core of the last decade (256 KiB and
// up), so the read-modify-write of master, m and v writes back from L2; and it is a few tens of
// microseconds of work, far above oneTBB's per-task cost. A multiple of every SIMD width and of
// the 8-bit kernel's block, so only the last tile of a tensor has a scalar tail.
constexpr std::size_t kTile = 8192;
// Below this many elements a call runs on the caller's thread: waking workers costs about as much
// as the work (a few tens of microseconds).
constexpr std::size_t kInlineBelow = 4 * kTile;

static_assert(kTile % 16 == 0, "tiles must hold whole AVX-512 vectors");
static_assert(kTile % kAdamW8bitBlock == 0, "tiles must hold whole 8-bit blocks");

inline float load_f32_from(const void* base, FloatDType dtype, std::size_t i) {
  switch (dtype) {
    case FloatDType::kF32:
      return static_cast<const float*>(base)[i];
    case FloatDType::kF16:
      return f32_from_f16(static_cast<const std::uint16_t*>(base)[i]);
    case FloatDType::kBF16:
      return f32_from_bf16(static_cast<const std::uint16_t*>(base)[i]);
  }
  return 0.0f;
}

inline void store_f32_to(void* base, FloatDType dtype, std::size_t i, float x) {
  switch (dtype) {
    case FloatDType::kF32:
      static_cast<float*>(base)[i] = x;
      break;
    case FloatDType::kF16:
      static_cast<std::uint16_t*>(base)[i] = f16_from_f32(x);
      break;
    case FloatDType::kBF16:
      static_cast<std::uint16_t*>(base)[i] = bf16_from_f32(x);
      break;
  }
}

// Calls body(begin, end) over [0, n): inline for small n, else in whole tiles spread over oneTBB
// threads. Chunk boundaries are multiples of kTile.
template <class Body>
void for_each_chunk(std::size_t n, const Body& body) {
  if (n < kInlineBelow) {
    body(std::size_t{0}, n);
    return;
  }
  parallel_for_tiles((n + kTile - 1) / kTile, [&](std::size_t first, std::size_t last) {
    body(first * kTile, std::min(n, last * kTile));
  });
}

inline bool valid_dtype(FloatDType dtype) {
  return dtype == FloatDType::kF32 || dtype == FloatDType::kF16 || dtype == FloatDType::kBF16;
}

// Appends "\n  <problem>" for every hyper-parameter torch would reject and for a gradient or
// streaming dtype the kernels do not read or write (`stream` null: no streaming copy).
void append_step_problems(const AdamWParams& p, FloatDType grad_dtype, const void* stream,
                          FloatDType stream_dtype, std::string& problems);

// The f32 constants of a step (Note [Matching torch.optim.AdamW] in adamw.cpp).
AdamWConstants adamw_constants(const AdamWParams& p);

using AdamWLoop = std::size_t (*)(const AdamWConstants&, const AdamWArrays&, std::size_t,
                                  std::size_t);
using AdamW8bitLoop = std::size_t (*)(const AdamW8bitConstants&, const AdamW8bitArrays&,
                                      std::size_t, std::size_t);
using SumSquaresLoop = std::size_t (*)(const void*, FloatDType, std::size_t, std::size_t, double*);
using CastLoop = std::size_t (*)(const float*, void*, FloatDType, std::size_t, std::size_t);

// The SIMD loops of one path; all null on the scalar path, which then does everything.
struct Loops {
  AdamWLoop adamw = nullptr;
  AdamW8bitLoop adamw8bit = nullptr;
  SumSquaresLoop sum_squares = nullptr;
  CastLoop cast = nullptr;
};

// The loops of simd_path_resolve(requested); throws rondo::Error for a path this CPU lacks.
Loops loops_for(SimdPath requested);

}  // namespace rondo::kernels::detail
