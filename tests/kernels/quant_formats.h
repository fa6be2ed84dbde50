// Every quantised format the kernels know, NF4 in each block size with and without double
// quantisation: what the CPU and CUDA quantisation tests sweep.
#pragma once

#include <vector>

#include "kernels/quant.h"

namespace rondo::kernels::test {

inline std::vector<QuantFormat> all_quant_formats() {
  std::vector<QuantFormat> formats;
  for (QuantType t : {QuantType::kQ8_0, QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ4_K,
                      QuantType::kQ6_K, QuantType::kInt8})
    formats.push_back({.type = t});
  for (int block : {32, 64, 256, 4096})
    for (bool dq : {false, true})
      formats.push_back({.type = QuantType::kNF4, .block = block, .double_quant = dq});
  return formats;
}

}  // namespace rondo::kernels::test
