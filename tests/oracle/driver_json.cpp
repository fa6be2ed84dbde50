#include "driver_json.h"

#include <ATen/ATen.h>

#include "kernels/error.h"

namespace rondo::oracle {

at::Tensor int_matrix(const nlohmann::json& rows) {
  const std::int64_t B = static_cast<std::int64_t>(rows.size());
  const std::int64_t T = B ? static_cast<std::int64_t>(rows[0].size()) : 0;
  at::Tensor t = at::empty({B, T}, at::kLong);
  for (std::int64_t b = 0; b < B; ++b) {
    if (static_cast<std::int64_t>(rows[b].size()) != T) throw Error("rows of different lengths");
    for (std::int64_t i = 0; i < T; ++i)
      t[b][i] = rows[b][i].get<std::int64_t>();
  }
  return t;
}

}  // namespace rondo::oracle
