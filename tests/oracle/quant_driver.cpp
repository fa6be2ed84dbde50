// rondo_quant_oracle: Rondo's side of tests/oracle/test_quant.py, the quantised formats of
// kernels/quant.h. Links rondo_kernels only (no torch), so it builds in seconds. Raw little-endian
// files in, raw files out; a failure prints "error: ..." and exits 1.
//
//   quantize <format> <rows> <cols> <f32|bf16|f16> <in.bin> <out.bin>     the blob
//   dequantize <format> <rows> <cols> <f32|bf16|f16> <in.bin> <out.bin>   (rows, cols) values
//   layout <format> <rows> <cols>       prints {"bytes": .., and the format's part offsets}
//   tables                              prints the NF4 code and the dynamic map as float32 bits
//
// <format>: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, INT8, or NF4:<block>[:dq] (dq = double quant).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "kernels/quant.h"
#include "kernels/quant_blocks.h"

namespace rondo {
namespace {

kernels::QuantFormat parse_format(const std::string& text) {
  using kernels::QuantType;
  for (QuantType t : {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ8_0, QuantType::kQ4_K,
                      QuantType::kQ6_K, QuantType::kInt8})
    if (text == kernels::to_string(t)) return {.type = t};
  if (text.rfind("NF4:", 0) == 0) {
    kernels::QuantFormat f{.type = QuantType::kNF4};
    std::size_t end = 0;
    f.block = std::stoi(text.substr(4), &end);
    const std::string rest = text.substr(4 + end);
    if (rest == ":dq")
      f.double_quant = true;
    else if (!rest.empty())
      throw Error("bad NF4 format '" + text + "' (NF4:<block>[:dq])");
    return f;
  }
  throw Error("unknown format '" + text + "'");
}

kernels::FloatDType parse_dtype(const std::string& text) {
  if (text == "f32") return kernels::FloatDType::kF32;
  if (text == "bf16") return kernels::FloatDType::kBF16;
  if (text == "f16") return kernels::FloatDType::kF16;
  throw Error("unknown dtype '" + text + "' (f32, bf16, f16)");
}

std::vector<std::uint8_t> read_file(const std::string& path, std::size_t expected) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + path);
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  if (bytes.size() != expected)
    throw Error(path + " has " + std::to_string(bytes.size()) + " bytes, expected " +
                std::to_string(expected));
  return bytes;
}

void write_file(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) throw Error("cannot write " + path);
}

int quantize(const std::vector<std::string>& a) {
  if (a.size() != 6) throw Error("usage: quantize <format> <rows> <cols> <dtype> <in> <out>");
  const kernels::QuantFormat f = parse_format(a[0]);
  const std::int64_t rows = std::stoll(a[1]), cols = std::stoll(a[2]);
  const kernels::FloatDType in = parse_dtype(a[3]);
  const auto x = read_file(a[4], static_cast<std::size_t>(rows * cols) * kernels::dtype_size(in));
  std::vector<std::uint8_t> blob(kernels::quant_bytes(f, rows, cols));
  kernels::quantize(f, x.data(), in, rows, cols, blob.data());
  write_file(a[5], blob);
  return 0;
}

int dequantize(const std::vector<std::string>& a) {
  if (a.size() != 6) throw Error("usage: dequantize <format> <rows> <cols> <dtype> <in> <out>");
  const kernels::QuantFormat f = parse_format(a[0]);
  const std::int64_t rows = std::stoll(a[1]), cols = std::stoll(a[2]);
  const kernels::FloatDType out = parse_dtype(a[3]);
  const auto blob = read_file(a[4], kernels::quant_bytes(f, rows, cols));
  std::vector<std::uint8_t> y(static_cast<std::size_t>(rows * cols) * kernels::dtype_size(out));
  kernels::dequantize(f, blob.data(), rows, cols, out, y.data());
  write_file(a[5], y);
  return 0;
}

int layout(const std::vector<std::string>& a) {
  if (a.size() != 3) throw Error("usage: layout <format> <rows> <cols>");
  const kernels::QuantFormat f = parse_format(a[0]);
  const std::int64_t rows = std::stoll(a[1]), cols = std::stoll(a[2]);
  const auto u = [](std::uint64_t v) { return static_cast<unsigned long long>(v); };
  if (f.type == kernels::QuantType::kNF4) {
    const kernels::Nf4Layout l = kernels::nf4_layout(f, rows, cols);
    std::printf(
        "{\"bytes\": %llu, \"codes\": %llu, \"absmax\": %llu, \"absmax2\": %llu, \"offset\": %llu, "
        "\"blocks\": %lld, \"blocks2\": %lld}\n",
        u(l.bytes), u(l.codes), u(l.absmax), u(l.absmax2), u(l.offset),
        static_cast<long long>(l.blocks), static_cast<long long>(l.blocks2));
  } else if (f.type == kernels::QuantType::kInt8) {
    const kernels::Int8Layout l = kernels::int8_layout(rows, cols);
    std::printf("{\"bytes\": %llu, \"scales\": %llu}\n", u(l.bytes), u(l.scales));
  } else {
    std::printf("{\"bytes\": %llu}\n", u(kernels::quant_bytes(f, rows, cols)));
  }
  return 0;
}

int tables(const std::vector<std::string>&) {
  const float nf4[16] = RONDO_NF4_CODE;
  const float dynamic[256] = RONDO_DYNAMIC_MAP_CODE;
  auto print = [](const char* name, const float* v, int n, const char* end) {
    std::printf("\"%s\": [", name);
    for (int i = 0; i < n; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &v[i], 4);
      std::printf("%s%u", i ? ", " : "", bits);
    }
    std::printf("]%s", end);
  };
  std::printf("{");
  print("nf4", nf4, 16, ", ");
  print("dynamic", dynamic, 256, "}\n");
  return 0;
}

}  // namespace
}  // namespace rondo

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + std::min(argc, 2), argv + argc);
  const std::string command = argc >= 2 ? argv[1] : "";
  try {
    if (command == "quantize") return rondo::quantize(args);
    if (command == "dequantize") return rondo::dequantize(args);
    if (command == "layout") return rondo::layout(args);
    if (command == "tables") return rondo::tables(args);
    std::fprintf(stderr, "usage: rondo_quant_oracle quantize|dequantize|layout|tables ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
