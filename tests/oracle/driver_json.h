// Helpers the driver subcommands share for reading their JSON inputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>

namespace rondo::oracle {

// [[int, ...], ...] -> (B, T) int64; throws Error for ragged rows.
at::Tensor int_matrix(const nlohmann::json& rows);

}  // namespace rondo::oracle
