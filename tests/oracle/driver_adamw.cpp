// Driver subcommands for the AdamW oracle tests (tests/oracle/test_adamw.py): Rondo's fused CPU
// AdamW kernel and gradient sum of squares, run on tensors from a safetensors file.
//   adamw <in.safetensors> <run.json> <out.safetensors>
//     in: "master", "m", "v" (n) F32; "grad.1" .. "grad.S" (n) F32, F16 or BF16.
//     run.json: {"steps": [{"lr", "beta1", "beta2", "eps", "weight_decay", "step",
//                           "grad_scale"}, ...], "stream_dtype": "BF16" | "F16" | "F32" | null,
//                "simd": "auto" | "scalar" | "avx2" | "avx512"}
//     out: "master", "m", "v" after all steps, "stream" (the last step's streaming copy, when
//     stream_dtype is set); prints the SIMD path that ran.
//   sum_squares <in.safetensors> <name> <simd>
//     prints Σ g² of tensor <name> with 17 significant digits.
#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "kernels/cpu/adamw.h"
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

// A writable f32 copy of a tensor of the file.
at::Tensor f32_copy(const models::SafetensorsFile& file, const std::string& name, std::int64_t n) {
  const models::TensorEntry& e = entry(file, name, n);
  if (e.dtype != models::DType::kF32) throw Error(name + " must be F32");
  return e.view().reshape({n}).clone();
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
  const kernels::SimdPath path = simd_path(run.value("simd", std::string("auto")));

  at::Tensor stream;
  kernels::FloatDType stream_dtype = kernels::FloatDType::kBF16;
  if (run.contains("stream_dtype") && !run["stream_dtype"].is_null()) {
    const std::string name = run["stream_dtype"].get<std::string>();
    const auto dtype = models::dtype_from_string(name);
    if (!dtype) throw Error("unknown stream_dtype '" + name + "'");
    stream_dtype = float_dtype(*dtype, "stream_dtype");
    stream = at::empty({n}, at::TensorOptions().dtype(models::to_scalar_type(*dtype)));
  }

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
                                      .stream = stream.defined() ? stream.data_ptr() : nullptr,
                                      .stream_dtype = stream_dtype};
    const kernels::AdamWParams params{.lr = s.at("lr").get<double>(),
                                      .beta1 = s.at("beta1").get<double>(),
                                      .beta2 = s.at("beta2").get<double>(),
                                      .eps = s.at("eps").get<double>(),
                                      .weight_decay = s.at("weight_decay").get<double>(),
                                      .step = s.at("step").get<std::int64_t>(),
                                      .grad_scale = s.value("grad_scale", 1.0)};
    kernels::adamw_step(tensor, params, path);
  }
  std::vector<std::pair<std::string, at::Tensor>> out{{"master", master}, {"m", m}, {"v", v}};
  if (stream.defined()) out.emplace_back("stream", stream);
  models::write_safetensors(args[2], out);
  std::printf("%s\n", kernels::to_string(kernels::simd_path_resolve(path)));
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
RegisterCommand reg_sum_squares("sum_squares", "<in.safetensors> <name> <simd>", sum_squares);

}  // namespace
}  // namespace rondo::oracle
