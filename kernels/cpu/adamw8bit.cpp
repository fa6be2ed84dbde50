// The CPU AdamW kernel with 8-bit moments (adamw8bit.h): validation, the step's f32 constants,
// the scalar reference path (one block at a time) and the tiling over oneTBB threads. The SIMD
// loops are in adamw_avx2.cpp and adamw_avx512.cpp (one body, adamw8bit_simd_body.h); tiles,
// dtype handling and path choice are the f32 kernel's (adamw_common.h).
//
// Note [bitsandbytes' AdamW8bit on the CPU]
// bitsandbytes 0.50.2's AdamW8bit (Optimizer2State "adam", 8 bits, blockwise) on a CPU tensor of
// at least min_8bit_size elements runs, per parameter and step, the function
// _optimizer_update_8bit_blockwise_cpu (backends/cpu/ops.py): f32 torch operations and two calls
// into its C++ library:
//  - State: state1, state2 uint8 (n); absmax1, absmax2 f32 (ceil(n / 256)); qmap1 the signed
//    dynamic map, qmap2 the unsigned one (dynamic_map.h). All zero at first. state["step"] is
//    counted before the update (t >= 1); lr, betas, eps and weight_decay are read from the param
//    group at every step, so a scheduler's lr applies as set; gnorm_scale is 1.0 (clipping is
//    torch's clip_grad_norm_ on the gradients), our grad_scale is that multiply.
//  - Dequantise: m = qmap1[state1] * absmax1 per block of 256 (C++ dequantizeBlockwise8bitCpu),
//    likewise v.
//  - grad = g.float() * gnorm_scale; m.mul_(β1).add_(grad, alpha=1 - β1); v.mul_(β2)
//    .addcmul_(grad, grad, value=1 - β2). torch's add with alpha is fmadd(grad, alpha, m) and its
//    addcmul fma(value * g, g, v) (Note [Matching torch.optim.AdamW] in adamw.cpp); no lerp here.
//  - correction1 = 1 - β1**t and correction2 = math.sqrt(1 - β2**t) in Python doubles (sqrt, where
//    torch.optim.AdamW takes ** 0.5); denom = (v.sqrt() / correction2).add_(eps); if wd > 0:
//    p.mul_(1 - lr*wd); p.addcdiv_(m, denom, value=-lr / correction1). Each Python scalar reaches
//    its f32 kernel rounded to float once.
//  - Requantise m and v from these f32 values (the update used them unrounded), blocks of 256,
//    with the CPU quantiser's table (C++ quantize_cpu_impl; Note [bitsandbytes' 8-bit quantiser]
//    in dynamic_map.cpp). Round to the table's code, not stochastic.
// So everything is f32, in one order we can follow exactly, and the order inside a block does not
// matter (absmax is a max). One difference remains: torch's sqrt on the CPU goes through MKL's
// vector math (VML, high-accuracy mode), which is not correctly rounded: about 0.6% of elements,
// at any size, get a sqrt 1 ulp off (torch 2.15: 1 of 255, 26 of 4099, 487 of 70001). Ours is IEEE
// sqrt. The moments never go through the sqrt, so codes and absmax equal bitsandbytes' bit for
// bit; the master weight of such an element can end a step 1 ulp apart, and nothing reads it back
// (decoupled decay), so the difference stays within an ulp per step. tests/oracle/test_adamw.py
// checks both: bit for bit against bitsandbytes with torch.Tensor.sqrt made correctly rounded, and
// within that bound against bitsandbytes as shipped.
#include "kernels/cpu/adamw8bit.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/adamw_common.h"
#include "kernels/cpu/dynamic_map.h"
#include "kernels/error.h"

namespace rondo::kernels {

static_assert(kAdamW8bitBlock == detail::kBlock8bit, "adamw_internal.h repeats the block size");

namespace {

using detail::AdamW8bitArrays;
using detail::AdamW8bitConstants;
using detail::for_each_chunk;
using detail::kBlock8bit;

// The reference, one block [begin, end) with begin a multiple of 256 and end - begin <= 256. See
// Note [Bit-identical paths] in adamw.cpp before changing an operation here: the SIMD body
// (adamw8bit_simd_body.h) must change with it.
void adamw8bit_block_scalar(const AdamW8bitConstants& c, const AdamW8bitArrays& a,
                            std::size_t begin, std::size_t end) {
  const std::size_t block = begin / kBlock8bit, len = end - begin;
  const float m_absmax = a.m_absmax[block], v_absmax = a.v_absmax[block];
  float m1[kBlock8bit], v1[kBlock8bit];  // the updated moments in f32, to requantise
  for (std::size_t j = 0; j < len; ++j) {
    const std::size_t i = begin + j;
    const float g = detail::load_f32_from(a.grad, a.grad_dtype, i) * c.f32.grad_scale;
    const float m = c.m_code[a.m_codes[i]] * m_absmax;
    const float v = c.v_code[a.v_codes[i]] * v_absmax;
    m1[j] = std::fma(c.one_minus_beta1, g, m * c.beta1);
    v1[j] = std::fma(c.f32.one_minus_beta2 * g, g, v * c.f32.beta2);
    const float p = a.master[i] * c.f32.decay;
    const float denom = std::sqrt(v1[j]) / c.f32.bc2_sqrt + c.f32.eps;
    const float p1 = p + (c.f32.neg_step * m1[j]) / denom;
    a.master[i] = p1;
    if (a.stream != nullptr) detail::store_f32_to(a.stream, a.stream_dtype, i, p1);
  }
  a.m_absmax[block] = quantize_dynamic_block(m1, len, c.m_bin_code, a.m_codes + begin);
  a.v_absmax[block] = quantize_dynamic_block(v1, len, c.v_bin_code, a.v_codes + begin);
}

void validate(const AdamW8bitTensor& t, const AdamWParams& p) {
  std::string problems;
  detail::append_step_problems(p, t.grad_dtype, t.stream, t.stream_dtype, problems);
  if (t.n > 0 && (t.grad == nullptr || t.master == nullptr || t.m_codes == nullptr ||
                  t.m_absmax == nullptr || t.v_codes == nullptr || t.v_absmax == nullptr))
    problems += "\n  grad, master, m_codes, m_absmax, v_codes and v_absmax must all be set for " +
                std::to_string(t.n) + " elements";
  if (!problems.empty()) throw Error("AdamW 8-bit step: invalid arguments:" + problems);
}

// Note [bitsandbytes' AdamW8bit on the CPU]: the f32 kernel's constants where bitsandbytes rounds
// the same doubles, its own where it differs.
AdamW8bitConstants constants(const AdamWParams& p) {
  AdamW8bitConstants c{};
  c.f32 = detail::adamw_constants(p);
  c.f32.bc2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(p.beta2, static_cast<double>(p.step))));
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.m_code = dynamic_map_signed().code;
  c.m_bin_code = dynamic_map_signed().bin_code;
  c.v_code = dynamic_map_unsigned().code;
  c.v_bin_code = dynamic_map_unsigned().bin_code;
  return c;
}

const DynamicMap& map_of(Moment moment) {
  return moment == Moment::kFirst ? dynamic_map_signed() : dynamic_map_unsigned();
}

void check_moment_arrays(const char* what, std::size_t n, const void* codes, const void* absmax,
                         const void* values) {
  if (n > 0 && (codes == nullptr || absmax == nullptr || values == nullptr))
    throw Error(std::string(what) + ": null array for " + std::to_string(n) + " elements");
}

}  // namespace

void adamw8bit_step(const AdamW8bitTensor& tensor, const AdamWParams& params, SimdPath path) {
  validate(tensor, params);
  const detail::Loops loops = detail::loops_for(path);
  if (tensor.n == 0) return;
  const AdamW8bitConstants c = constants(params);
  const AdamW8bitArrays a{tensor.grad,     tensor.grad_dtype, tensor.master,
                          tensor.m_codes,  tensor.m_absmax,   tensor.v_codes,
                          tensor.v_absmax, tensor.stream,     tensor.stream_dtype};
  // Chunks start at multiples of kTile, hence of the block: blocks never straddle two chunks.
  for_each_chunk(tensor.n, [&](std::size_t begin, std::size_t end) {
    std::size_t i = loops.adamw8bit ? loops.adamw8bit(c, a, begin, end) : begin;
    for (; i < end; i += kBlock8bit)
      adamw8bit_block_scalar(c, a, i, std::min(end, i + kBlock8bit));
  });
}

void quantize_moment(Moment moment, const float* values, std::size_t n, std::uint8_t* codes,
                     float* absmax) {
  check_moment_arrays("quantize_moment", n, codes, absmax, values);
  const std::uint8_t* bin_code = map_of(moment).bin_code;
  for_each_chunk(n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; i += kBlock8bit) {
      const std::size_t len = std::min(end - i, kBlock8bit);
      absmax[i / kBlock8bit] = quantize_dynamic_block(values + i, len, bin_code, codes + i);
    }
  });
}

void dequantize_moment(Moment moment, const std::uint8_t* codes, const float* absmax, std::size_t n,
                       float* values) {
  check_moment_arrays("dequantize_moment", n, codes, absmax, values);
  const float* code = map_of(moment).code;
  for_each_chunk(n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i)
      values[i] = code[codes[i]] * absmax[i / kBlock8bit];
  });
}

}  // namespace rondo::kernels
