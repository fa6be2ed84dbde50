// Quantised weight formats for frozen LoRA bases, which stay quantised in host memory, on NVMe and
// on the wire and are dequantised on the device just before use (Stream::dequantize). Here: the
// formats and their byte layouts, the CPU quantisers, and the CPU dequantisation that every device
// path equals bit for bit. docs/quantisation.md describes the layouts.
//
// Invariants: a tensor is row-major (rows, cols), torch's (out, in); its quantised form is one
// self-contained blob of exactly quant_bytes(format, rows, cols) bytes. GGUF types are llama.cpp's
// blocks (gguf-py decodes them to what dequantize() gives); NF4 is bitsandbytes 0.50.2's
// quantize_4bit / dequantize_4bit on the CPU, bit for bit. Nothing here includes torch.
// Used by models/ (GGUF tensors), offload/ (quantised bases) and the devices' streams.
//
//   kernels::QuantFormat nf4{.type = kernels::QuantType::kNF4, .double_quant = true};
//   std::vector<std::uint8_t> blob(kernels::quant_bytes(nf4, rows, cols));
//   kernels::quantize(nf4, weights, kernels::FloatDType::kBF16, rows, cols, blob.data());
//   up.upload(q_dev, blob.data(), blob.size());          // q_dev: a device buffer of blob.size()
//   up.dequantize(nf4, q_dev, rows, cols, kernels::FloatDType::kBF16, w_dev);
#pragma once

#include <cstdint>
#include <string>

#include "kernels/cpu/simd.h"

namespace rondo::kernels {

enum class QuantType {
  kNone,   // not quantised: rejected by every function here
  kQ4_0,   // GGUF: 32 elements in 18 bytes (f16 scale, 4-bit signed quants)
  kQ4_1,   // GGUF: 32 elements in 20 bytes (f16 scale and minimum, 4-bit quants)
  kQ8_0,   // GGUF: 32 elements in 34 bytes (f16 scale, int8 quants)
  kQ4_K,   // GGUF: 256 elements in 144 bytes (8 sub-blocks with 6-bit scales and minimums)
  kQ6_K,   // GGUF: 256 elements in 210 bytes (16 sub-blocks with int8 scales, 6-bit quants)
  kNF4,    // bitsandbytes NormalFloat4: fp32 (or double-quantised) absmax per `block` elements
  kInt8,   // int8 per output row with one fp32 scale per row (LLM.int8's weights, no outliers)
  kMXFP4,  // OCP MX FP4 as GPT-OSS's checkpoints store its experts (Mxfp4Layout); read, never made
  kGgufMXFP4,  // GGUF: ggml's block_mxfp4, 32 elements in 17 bytes (E8M0 scale, 4-bit e2m1
               // quants as Q4_0 orders them); read, never made
};

const char* to_string(
    QuantType type);  // "none", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "NF4", "INT8", "MXFP4"

struct QuantFormat {
  QuantType type = QuantType::kNone;
  int block = 64;             // NF4: elements per absmax block, a power of two in [32, 4096]
                              // (bitsandbytes' blocksize); ignored by the other types
  bool double_quant = false;  // NF4: quantise the absmax values too, as bitsandbytes'
                              // compress_statistics=True (8-bit codes per block, an fp32 absmax
                              // per 256 blocks and one fp32 offset); ignored by the other types
  std::int64_t experts = 1;   // MXFP4: the matrices the blob holds (rows = experts * C)
};

std::string to_string(const QuantFormat& format);  // "NF4 (block 64, double quant)", "Q4_K"

// Throws Error unless `format` can hold a (rows, cols) tensor: a known type, an NF4 block size
// bitsandbytes accepts, cols a multiple of a GGUF type's block size (32 for Q4_0, Q4_1, Q8_0; 256
// for Q4_K, Q6_K), rows and cols >= 1. The message names the format and the shape.
void check_quant_shape(const QuantFormat& format, std::int64_t rows, std::int64_t cols);

// Bytes of the blob of a (rows, cols) tensor (checked as above).
std::uint64_t quant_bytes(const QuantFormat& format, std::int64_t rows, std::int64_t cols);

// Where the parts of an NF4 blob lie, in bytes from its start. Every part begins at a multiple of
// 16 bytes; the gaps before them are zero. Blocks run over the flattened tensor (n = rows * cols
// elements), the last one possibly partial, as in bitsandbytes.
struct Nf4Layout {
  std::int64_t n = 0;         // elements
  std::int64_t blocks = 0;    // ceil(n / block)
  std::int64_t blocks2 = 0;   // double quant: ceil(blocks / 256), else 0
  std::uint64_t codes = 0;    // (ceil(n / 2)) uint8: two 4-bit codes per byte, element 2i in the
                              // high nibble, 2i + 1 in the low one (odd n: the last low nibble
                              // is code 7, NF4's 0.0)
  std::uint64_t absmax = 0;   // (blocks) fp32 absmax; double quant: (blocks) uint8 codes into
                              // bitsandbytes' signed 8-bit dynamic map
  std::uint64_t absmax2 = 0;  // double quant: (blocks2) fp32 absmax of each 256 codes' block
  std::uint64_t offset = 0;   // double quant: (1) fp32, the mean of the absmax values, added back
  std::uint64_t bytes = 0;    // the whole blob
};
Nf4Layout nf4_layout(const QuantFormat& format, std::int64_t rows, std::int64_t cols);

// An INT8 blob: (rows, cols) int8 at 0, then (rows) fp32 scales at `scales` (a multiple of 16).
struct Int8Layout {
  std::uint64_t scales = 0;
  std::uint64_t bytes = 0;
};
Int8Layout int8_layout(std::int64_t rows, std::int64_t cols);

// An MXFP4 blob, as GPT-OSS's checkpoints store a fused expert weight: for each of E = `experts`
// matrices its stored (R, C) weight in groups of 32 along C. First the blocks (E, R, C/32, 16)
// uint8, two FP4 (e2m1) values per byte, element 2j in the low nibble and 2j + 1 in the high one;
// then the scales (E, R, C/32) uint8, each its group's power of two plus 127 (E8M0). The tensor it
// stands for is (rows, cols) = (E * C, R): each matrix transposed, as the model's fused parameter
// (E, C, R) lies. Element (e, c, r) is fp4 * 2^(scale - 127) in fp32, as transformers'
// convert_moe_packed_tensors computes it (a scale of 255 gives an infinity, not NaN).
struct Mxfp4Layout {
  std::int64_t experts = 0, c = 0, r = 0;
  std::uint64_t scales = 0;  // where the scales begin
  std::uint64_t bytes = 0;
};
Mxfp4Layout mxfp4_layout(const QuantFormat& format, std::int64_t rows, std::int64_t cols);

// Dequantises the blob at `src` into (rows, cols) `out` values at `dst`: float32 first, exactly as
// the format's reference computes it (gguf-py / ggml's dequantize_row_*, bitsandbytes'
// dequantize_4bit: code * absmax in fp32), then rounded to nearest even for BF16 or F16 (NaN stays
// NaN). Parallel over oneTBB threads; src needs no alignment. Throws Error on a bad shape.
void dequantize(const QuantFormat& format, const void* src, std::int64_t rows, std::int64_t cols,
                FloatDType out, void* dst);

// What Stream::dequantize checks before it enqueues anything, so that a bad call throws Error at
// once on the caller's thread: the shape (as check_quant_shape), and dst aligned to the size of an
// `out` element (devices store whole elements).
void check_dequantize(const QuantFormat& format, std::int64_t rows, std::int64_t cols,
                      FloatDType out, const void* dst);

// Quantises a (rows, cols) tensor of `in` values (F32, BF16 or F16) into quant_bytes(...) bytes at
// `dst`, dispatching to the functions below. Throws Error on a bad shape or a value that is not
// finite (naming its row and column).
void quantize(const QuantFormat& format, const void* src, FloatDType in, std::int64_t rows,
              std::int64_t cols, void* dst);

// NF4, equal bit for bit to bitsandbytes 0.50.2's
//   quantize_4bit(x, blocksize=format.block, quant_type="nf4",
//                 compress_statistics=format.double_quant)
// on the CPU (codes, absmax, and with double quant the 8-bit codes, second-level absmax and
// offset). See Note [NF4 as bitsandbytes computes it] in cpu/quantize.cpp for the details that make
// it so, and the one case where bitsandbytes' own result depends on torch's thread count.
void quantize_nf4(const QuantFormat& format, const void* src, FloatDType in, std::int64_t rows,
                  std::int64_t cols, void* dst);

// INT8, symmetric per output row. The codes equal bitsandbytes 0.50.2's int8_vectorwise_quant(x)
// (threshold 0: LLM.int8's weights without outliers) bit for bit: q = round(x * ((1 / absmax) *
// 127)), every step in fp32, rounded to nearest with ties to even (torch.round). The blob stores
// scale = absmax / 127 (fp32 division) where bitsandbytes keeps absmax, so that dequantisation is
// the single multiply float(q) * scale. An all-zero row gets q = 0 and scale 0.
void quantize_int8_rows(const void* src, FloatDType in, std::int64_t rows, std::int64_t cols,
                        void* dst);

// GGUF blocks from float32 values (BF16 and F16 are widened first, exactly). Q8_0, Q4_0 and Q4_1
// equal gguf-py's gguf.quants.quantize (ggml's quantize_row_*_ref without fused multiply-adds) bit
// for bit. Q4_K and Q6_K follow the approach of ggml's reference quantisers (a weighted
// least-squares fit per sub-block, then the sub-block scales quantised against the block's) in
// code of our own; their error is comparable to ggml's (tests/oracle/test_quant.py).
void quantize_gguf(QuantType type, const void* src, FloatDType in, std::int64_t rows,
                   std::int64_t cols, void* dst);

}  // namespace rondo::kernels
