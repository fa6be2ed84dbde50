// Driver subcommands for the AdamW oracle tests (tests/oracle/test_adamw.py): Rondo's fused CPU
// AdamW kernel and gradient sum of squares, run on tensors from a safetensors file.
//   adamw <in.safetensors> <run.json> <out.safetensors>
//     in: "master", "m", "v" (n) F32; "grad.1" .. "grad.S" (n) F32, F16 or BF16.
//     run.json: {"steps": [{"lr", "beta1", "beta2", "eps", "weight_decay", "step",
//                           "grad_scale"}, ...], "stream_dtype": "BF16" | "F16" | "F32" | null,
//                "simd": "auto" | "scalar" | "avx2" | "avx512"}
//     out: "master", "m", "v" after all steps, "stream" (the last step's streaming copy, when
//     stream_dtype is set); prints the SIMD path that ran.
//   adamw8bit <in.safetensors> <run.json> <out.safetensors>
//     The 8-bit kernel (kernels/cpu/adamw8bit.h). in: "master" (n) F32, "grad.1" .. "grad.S" as
//     above, and optionally the 8-bit state "m_codes", "v_codes" (n) U8, "m_absmax", "v_absmax"
//     (ceil(n / 256)) F32 (absent: the fresh state, all zero). run.json as above, plus "chunk":
//     elements per call (a multiple of 256; absent: the whole tensor in one call).
//     out: "master", the four state tensors, "stream" as above, and "qmap1", "qmap2" (256) F32,
//     the maps the kernel used; prints the SIMD path that ran.
//   sum_squares <in.safetensors> <name> <simd>
//     prints Σ g² of tensor <name> with 17 significant digits.
#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw8bit.h"
#include "kernels/cpu/dynamic_map.h"
#include "kernels/error.h"
#include "models/safetensors.h"
#include "models/tensor_view.h"

namespace rondo::oracle {
namespace {

kernels::FloatDType float_dtype(models::DType dtype, const std::string& what) {
  switch (dtype) {
    case models::DType::kF32:
      return kernels::FloatDType::kF32;
    case models::DType::kF16:
      return kernels::FloatDType::kF16;
    case models::DType::kBF16:
      return kernels::FloatDType::kBF16;
    default:
      throw Error(what + " is " + models::to_string(dtype) + "; AdamW takes F32, F16 or BF16");
  }
}

kernels::SimdPath simd_path(const std::string& name) {
  for (auto p : {kernels::SimdPath::kAuto, kernels::SimdPath::kScalar, kernels::SimdPath::kAvx2,
                 kernels::SimdPath::kAvx512})
    if (name == kernels::to_string(p)) return p;
  throw Error("unknown SIMD path '" + name + "' (auto, scalar, avx2, avx512)");
}

const models::TensorEntry& entry(const models::SafetensorsFile& file, const std::string& name,
                                 std::int64_t n) {
  const models::TensorEntry* e = file.find(name);
  if (e == nullptr) throw Error(file.path() + " has no tensor '" + name + "'");
  if (n >= 0 && e->numel() != n)
    throw Error(name + " has " + std::to_string(e->numel()) + " elements, expected " +
                std::to_string(n));
  return *e;
}

// A writable copy of a tensor of the file, which must be of `dtype`.
at::Tensor copy_of(const models::SafetensorsFile& file, const std::string& name, std::int64_t n,
                   models::DType dtype) {
  const models::TensorEntry& e = entry(file, name, n);
  if (e.dtype != dtype) throw Error(name + " must be " + models::to_string(dtype));
  return e.view().reshape({n}).clone();
}

at::Tensor f32_copy(const models::SafetensorsFile& file, const std::string& name, std::int64_t n) {
  return copy_of(file, name, n, models::DType::kF32);
}

// What both AdamW subcommands read from run.json besides the steps.
struct RunOptions {
  kernels::SimdPath path = kernels::SimdPath::kAuto;
  at::Tensor stream;  // undefined: no streaming copy
  kernels::FloatDType stream_dtype = kernels::FloatDType::kBF16;
};

RunOptions run_options(const nlohmann::json& run, std::int64_t n) {
  RunOptions o;
  o.path = simd_path(run.value("simd", std::string("auto")));
  if (run.contains("stream_dtype") && !run["stream_dtype"].is_null()) {
    const std::string name = run["stream_dtype"].get<std::string>();
    const auto dtype = models::dtype_from_string(name);
    if (!dtype) throw Error("unknown stream_dtype '" + name + "'");
    o.stream_dtype = float_dtype(*dtype, "stream_dtype");
    o.stream = at::empty({n}, at::TensorOptions().dtype(models::to_scalar_type(*dtype)));
  }
  return o;
}

kernels::AdamWParams step_params(const nlohmann::json& s) {
  return {.lr = s.at("lr").get<double>(),
          .beta1 = s.at("beta1").get<double>(),
          .beta2 = s.at("beta2").get<double>(),
          .eps = s.at("eps").get<double>(),
          .weight_decay = s.at("weight_decay").get<double>(),
          .step = s.at("step").get<std::int64_t>(),
          .grad_scale = s.value("grad_scale", 1.0)};
}

int adamw(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: adamw <in.safetensors> <run.json> <out.safetensors>");
  const models::SafetensorsFile in(args[0]);
  nlohmann::json run;
  std::ifstream(args[1]) >> run;
  const std::int64_t n = entry(in, "master", -1).numel();
  at::Tensor master = f32_copy(in, "master", n);
  at::Tensor m = f32_copy(in, "m", n);
  at::Tensor v = f32_copy(in, "v", n);
  RunOptions o = run_options(run, n);
  int k = 0;
  for (const nlohmann::json& s : run.at("steps")) {
    ++k;
    const models::TensorEntry& g = entry(in, "grad." + std::to_string(k), n);
    const kernels::AdamWTensor tensor{.n = static_cast<std::size_t>(n),
                                      .grad = g.data,
                                      .grad_dtype = float_dtype(g.dtype, g.name),
                                      .master = master.data_ptr<float>(),
                                      .m = m.data_ptr<float>(),
                                      .v = v.data_ptr<float>(),
                                      .stream = o.stream.defined() ? o.stream.data_ptr() : nullptr,
                                      .stream_dtype = o.stream_dtype};
    kernels::adamw_step(tensor, step_params(s), o.path);
  }
  std::vector<std::pair<std::string, at::Tensor>> out{{"master", master}, {"m", m}, {"v", v}};
  if (o.stream.defined()) out.emplace_back("stream", o.stream);
  models::write_safetensors(args[2], out);
  std::printf("%s\n", kernels::to_string(kernels::simd_path_resolve(o.path)));
  return 0;
}

// 8-bit state from the file, or the fresh state (zeros) when the file has none.
at::Tensor state_or_zeros(const models::SafetensorsFile& file, const std::string& name,
                          std::int64_t n, models::DType dtype) {
  if (file.find(name) == nullptr)
    return at::zeros({n}, at::TensorOptions().dtype(models::to_scalar_type(dtype)));
  return copy_of(file, name, n, dtype);
}

at::Tensor map_tensor(const kernels::DynamicMap& map) {
  return at::from_blob(const_cast<float*>(map.code), {256}, at::kFloat).clone();
}

int adamw8bit(const std::vector<std::string>& args) {
  if (args.size() != 3)
    throw Error("usage: adamw8bit <in.safetensors> <run.json> <out.safetensors>");
  const models::SafetensorsFile in(args[0]);
  nlohmann::json run;
  std::ifstream(args[1]) >> run;
  const std::int64_t n = entry(in, "master", -1).numel();
  const auto blocks =
      static_cast<std::int64_t>(kernels::adamw8bit_blocks(static_cast<std::size_t>(n)));
  at::Tensor master = f32_copy(in, "master", n);
  at::Tensor m_codes = state_or_zeros(in, "m_codes", n, models::DType::kU8);
  at::Tensor v_codes = state_or_zeros(in, "v_codes", n, models::DType::kU8);
  at::Tensor m_absmax = state_or_zeros(in, "m_absmax", blocks, models::DType::kF32);
  at::Tensor v_absmax = state_or_zeros(in, "v_absmax", blocks, models::DType::kF32);
  RunOptions o = run_options(run, n);
  const auto chunk = run.value("chunk", static_cast<std::int64_t>(n));
  if (chunk <= 0 || (chunk < n && chunk % static_cast<std::int64_t>(kernels::kAdamW8bitBlock) != 0))
    throw Error("chunk must be a positive multiple of 256, got " + std::to_string(chunk));
  int k = 0;
  for (const nlohmann::json& s : run.at("steps")) {
    ++k;
    const models::TensorEntry& g = entry(in, "grad." + std::to_string(k), n);
    const kernels::FloatDType grad_dtype = float_dtype(g.dtype, g.name);
    // Block-aligned ranges, each stepped as a tensor of its own (AdamW8bitTensor's range rule).
    for (std::int64_t begin = 0; begin < n; begin += chunk) {
      const std::int64_t end = std::min(n, begin + chunk);
      const std::int64_t block = begin / static_cast<std::int64_t>(kernels::kAdamW8bitBlock);
      const kernels::AdamW8bitTensor tensor{
          .n = static_cast<std::size_t>(end - begin),
          .grad = static_cast<const std::uint8_t*>(g.data) +
                  begin * static_cast<std::int64_t>(kernels::dtype_size(grad_dtype)),
          .grad_dtype = grad_dtype,
          .master = master.data_ptr<float>() + begin,
          .m_codes = m_codes.data_ptr<std::uint8_t>() + begin,
          .m_absmax = m_absmax.data_ptr<float>() + block,
          .v_codes = v_codes.data_ptr<std::uint8_t>() + begin,
          .v_absmax = v_absmax.data_ptr<float>() + block,
          .stream = o.stream.defined()
                        ? static_cast<std::uint8_t*>(o.stream.data_ptr()) +
                              begin * static_cast<std::int64_t>(o.stream.element_size())
                        : nullptr,
          .stream_dtype = o.stream_dtype};
      kernels::adamw8bit_step(tensor, step_params(s), o.path);
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> out{
      {"master", master},
      {"m_codes", m_codes},
      {"m_absmax", m_absmax},
      {"v_codes", v_codes},
      {"v_absmax", v_absmax},
      {"qmap1", map_tensor(kernels::dynamic_map_signed())},
      {"qmap2", map_tensor(kernels::dynamic_map_unsigned())}};
  if (o.stream.defined()) out.emplace_back("stream", o.stream);
  models::write_safetensors(args[2], out);
  std::printf("%s\n", kernels::to_string(kernels::simd_path_resolve(o.path)));
  return 0;
}

int sum_squares(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: sum_squares <in.safetensors> <name> <simd>");
  const models::SafetensorsFile in(args[0]);
  const models::TensorEntry& g = entry(in, args[1], -1);
  const double sum =
      kernels::grad_sum_squares(g.data, float_dtype(g.dtype, g.name),
                                static_cast<std::size_t>(g.numel()), simd_path(args[2]));
  std::printf("%.17g\n", sum);
  return 0;
}

RegisterCommand reg_adamw("adamw", "<in.safetensors> <run.json> <out.safetensors>", adamw);
RegisterCommand reg_adamw8bit("adamw8bit", "<in.safetensors> <run.json> <out.safetensors>",
                              adamw8bit);
RegisterCommand reg_sum_squares("sum_squares", "<in.safetensors> <name> <simd>", sum_squares);

}  // namespace
}  // namespace rondo::oracle
