"""Rondo's quantised formats (kernels/quant.h) against bitsandbytes 0.50.2 and gguf-py on the CPU.

Rondo's side runs in rondo_quant_oracle (tests/oracle/quant_driver.cpp, kernels only). Expected
values come from bitsandbytes and gguf-py; every comparison is bit for bit.

- NF4 quantisation: codes, absmax, and with compress_statistics=True the 8-bit absmax codes, the
  second-level absmax and the offset, equal bitsandbytes.functional.quantize_4bit(quant_type="nf4")
  for float32, bfloat16 and float16 input, odd shapes (the last block partial, an odd count), block
  sizes 32 to 4096, all-zero blocks and values exactly on the midpoints between NF4 codes.
- NF4 dequantisation to F32, BF16 and F16 equals bitsandbytes' dequantize_4bit (its CPU kernel;
  see test_nf4_dequantize_equals_bitsandbytes for the shapes where that kernel is wrong).
- INT8 codes equal bitsandbytes' int8_vectorwise_quant; the scale is its absmax / 127.
- Q8_0, Q4_0 and Q4_1 blocks equal gguf.quants.quantize's.
- Q4_K and Q6_K (gguf-py cannot quantise them): gguf.quants.dequantize decodes Rondo's blocks to
  exactly what Rondo's dequantize gives, and their error is stated and bounded, against gguf-py's
  own Q4_0/Q4_1 on the same weights.

bitsandbytes' double quantisation takes the mean of the absmax values with torch.mean, which torch
splits over its threads above 32768 blocks; Rondo reproduces the one-thread sum (Note [NF4 as
bitsandbytes computes it] in kernels/cpu/quantize.cpp), so those cases run bitsandbytes with
torch.set_num_threads(1).
"""
import json
import os
import subprocess
from contextlib import contextmanager

import bitsandbytes.functional as F
import gguf
import numpy as np
import pytest
import torch

DRIVER = os.environ.get("RONDO_QUANT_DRIVER", "")
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
QT = gguf.GGMLQuantizationType
NP_DTYPES = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


def run(*args):
    if not DRIVER:
        raise RuntimeError("RONDO_QUANT_DRIVER is not set: run the oracle tests through ctest")
    p = subprocess.run([DRIVER, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"rondo_quant_oracle {' '.join(map(str, args))}: {p.stderr}"
    return p.stdout


def raw_bytes(t):
    """A CPU tensor's storage as bytes (bf16 through an int16 view)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def rondo_quantize(fmt, x, tmp_path):
    """Rondo's blob for the 2-D tensor x (float32, bfloat16 or float16)."""
    rows, cols = x.shape
    dtype = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[x.dtype]
    (tmp_path / "x.bin").write_bytes(raw_bytes(x))
    run("quantize", fmt, rows, cols, dtype, tmp_path / "x.bin", tmp_path / "q.bin")
    return np.frombuffer((tmp_path / "q.bin").read_bytes(), np.uint8)


def rondo_dequantize(fmt, blob, rows, cols, out, tmp_path):
    """Rondo's (rows, cols) values as raw bits: uint32 for f32, uint16 for bf16/f16."""
    (tmp_path / "b.bin").write_bytes(np.ascontiguousarray(blob, np.uint8).tobytes())
    run("dequantize", fmt, rows, cols, out, tmp_path / "b.bin", tmp_path / "y.bin")
    bits = np.uint32 if out == "f32" else np.uint16
    return np.frombuffer((tmp_path / "y.bin").read_bytes(), bits).reshape(rows, cols)


def layout(fmt, rows, cols):
    return json.loads(run("layout", fmt, rows, cols))


def bits_of(t):
    """A tensor's values as raw bits (uint32 / uint16), for bit-exact comparison."""
    t = t.contiguous()
    if t.element_size() == 4:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


def assert_same(what, got, want):
    got, want = np.asarray(got).ravel(), np.asarray(want).ravel()
    assert got.shape == want.shape, f"{what}: {got.shape} values, expected {want.shape}"
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} differ; first at {bad[0]}: rondo "
                           f"{got[bad[0]]:#x}, reference {want[bad[0]]:#x} (seed {SEED})")


@contextmanager
def torch_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# NF4

SHAPES = [(1, 1), (1, 7), (3, 5), (67, 33), (5, 64), (3, 80), (67, 333), (129, 1), (7, 4096 + 22)]


def weights(rng, shape, dtype):
    """Normal weights with a scale per row, a few outliers and zero rows: what a layer holds."""
    rows, cols = shape
    x = rng.standard_normal(shape) * 0.02 * 10.0 ** rng.uniform(-1, 1, (rows, 1))
    x[rng.random(shape) < 0.005] *= 20
    if rows > 2:
        x[1] = 0.0  # a zero row: all-zero blocks, full or partial
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


def nf4_format(block, dq):
    return f"NF4:{block}" + (":dq" if dq else "")


def check_nf4_quantize(x, block, dq, tmp_path):
    rows, cols = x.shape
    fmt = nf4_format(block, dq)
    blob = rondo_quantize(fmt, x, tmp_path)
    lay = layout(fmt, rows, cols)
    n = rows * cols
    threads = 1 if lay["blocks"] >= 32768 else torch.get_num_threads()
    with torch_threads(threads):
        q, state = F.quantize_4bit(x, blocksize=block, quant_type="nf4", compress_statistics=dq)
    codes = q.numpy().ravel()
    assert_same(f"{fmt} {tuple(x.shape)} {x.dtype}: codes", blob[:(n + 1) // 2], codes)
    if not dq:
        absmax = blob[lay["absmax"]:lay["absmax"] + 4 * lay["blocks"]].view(np.uint32)
        assert_same(f"{fmt} {tuple(x.shape)} {x.dtype}: absmax", absmax, bits_of(state.absmax))
        return blob, state
    qabsmax = blob[lay["absmax"]:lay["absmax"] + lay["blocks"]]
    absmax2 = blob[lay["absmax2"]:lay["absmax2"] + 4 * lay["blocks2"]].view(np.uint32)
    offset = blob[lay["offset"]:lay["offset"] + 4].view(np.uint32)
    assert_same(f"{fmt} {tuple(x.shape)} {x.dtype}: offset", offset, bits_of(state.offset.reshape(1)))
    assert_same(f"{fmt} {tuple(x.shape)} {x.dtype}: absmax codes", qabsmax, state.absmax.numpy())
    assert_same(f"{fmt} {tuple(x.shape)} {x.dtype}: absmax2", absmax2, bits_of(state.state2.absmax))
    return blob, state


def test_tables_equal_bitsandbytes():
    tables = json.loads(run("tables"))
    assert_same("NF4 code", np.array(tables["nf4"], np.uint32),
                bits_of(F.get_4bit_type("nf4", device="cpu")))
    assert_same("dynamic map", np.array(tables["dynamic"], np.uint32),
                bits_of(F.create_dynamic_map(signed=True)))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("dq", [False, True])
def test_nf4_quantize_equals_bitsandbytes(dtype, dq, rng, tmp_path):
    for shape in SHAPES:
        check_nf4_quantize(weights(rng, shape, TORCH_DTYPES[dtype]), 64, dq, tmp_path)


@pytest.mark.parametrize("block", [32, 128, 256, 1024, 4096])
@pytest.mark.parametrize("dq", [False, True])
def test_nf4_block_sizes_equal_bitsandbytes(block, dq, rng, tmp_path):
    for shape in [(3, 5), (67, 333), (7, 4096 + 22), (300, 257)]:
        check_nf4_quantize(weights(rng, shape, torch.float32), block, dq, tmp_path)


def test_nf4_ties_take_the_lower_code(tmp_path):
    """Blocks whose absmax is exactly 1 and whose other values lie exactly on the float32
    midpoints between NF4 codes: torch.bucketize gives the lower code, and so must Rondo."""
    code = F.get_4bit_type("nf4", device="cpu")
    mid = (code[:-1] + code[1:]) / 2
    block = torch.cat([torch.tensor([1.0]), mid, -mid, mid[::2], torch.zeros(64 - 1 - 15 - 15 - 8)])
    x = torch.stack([block, -block, block * 0.5, block[torch.randperm(64)]])
    for dq in (False, True):
        check_nf4_quantize(x, 64, dq, tmp_path)


def test_nf4_scaling_rounds_as_bitsandbytes(rng, tmp_path):
    """bitsandbytes scales a full block by multiplying with 1 / absmax but the last, partial block
    by dividing by absmax. Blocks holding values that land exactly on an NF4 midpoint one way and
    not the other tell the two apart: full blocks where x * (1 / a) is a midpoint and x / a is not,
    and a partial last block the other way round."""
    f32 = np.float32
    code = F.get_4bit_type("nf4", device="cpu").numpy()
    mid = ((code[:-1] + code[1:]) / f32(2)).astype(f32)

    def find(full, count):
        found = []
        while len(found) < count:
            a, m = f32(rng.uniform(0.01, 1.0)), mid[rng.integers(0, 15)]
            x = f32(m * a)
            by_mul, by_div = f32(x * f32(f32(1) / a)), f32(x / a)
            if abs(x) < a and ((by_mul == m) != (by_div == m)) and (by_mul == m) == full:
                found.append((a, x))
        return found

    blocks = []
    for a, x in find(True, 16):
        block = np.zeros(64, f32)
        block[0], block[1:] = a, x  # every other element the same tie
        blocks.append(block)
    a, x = find(False, 1)[0]
    tail = np.full(33, x, f32)
    tail[5] = a
    t = torch.from_numpy(np.concatenate(blocks + [tail])).reshape(1, -1)
    for dq in (False, True):
        check_nf4_quantize(t, 64, dq, tmp_path)


@pytest.mark.parametrize("dq", [False, True])
def test_nf4_large_tensor_equals_bitsandbytes(dq, rng, tmp_path):
    """More than 32768 blocks: bitsandbytes' offset comes from a sum torch would split over its
    threads (run with one); more than 256 second-level blocks."""
    check_nf4_quantize(weights(rng, (2048, 1100), torch.bfloat16), 64, dq, tmp_path)


def avx512_bnb_kernel_misindexes(shape, block):
    """bitsandbytes 0.50.2's CPU dequantize_4bit on AVX-512 (csrc/cpu_ops.cpp) indexes absmax as
    row * (cols // block) + column // block, which is the flat block index only when cols is a
    multiple of the block size; it takes that path whenever cols is a multiple of 16."""
    from bitsandbytes.cextension import lib

    cols = shape[-1]
    return bool(lib.has_avx512f_cpu()) and cols % 16 == 0 and cols % block != 0


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("out", ["f32", "bf16", "f16"])
def test_nf4_dequantize_equals_bitsandbytes(dq, out, rng, tmp_path):
    """Rondo's dequantisation of the blob against bitsandbytes' dequantize_4bit of its own state.
    For the shapes bitsandbytes' AVX-512 kernel gets wrong (avx512_bnb_kernel_misindexes), its
    generic implementation (backends/default/ops.py, the same float32 code * absmax) is the
    reference."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    generic = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    for shape in SHAPES + [(3, 48), (4, 128), (67, 256)]:
        x = weights(rng, shape, torch.float32)
        blob, state = check_nf4_quantize(x, 64, dq, tmp_path)
        absmax = state.absmax
        if dq:
            absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
        q = torch.from_numpy(blob[:(x.numel() + 1) // 2].copy()).reshape(-1, 1)
        if avx512_bnb_kernel_misindexes(shape, 64):
            want = generic(q.reshape(-1), absmax, F.get_4bit_type("nf4", device="cpu"), 64, shape,
                           TORCH_DTYPES[out])
        else:
            want = torch.ops.bitsandbytes.dequantize_4bit.default(q, absmax, 64, "nf4", shape,
                                                                  TORCH_DTYPES[out])
        got = rondo_dequantize(nf4_format(64, dq), blob, *shape, out, tmp_path)
        assert_same(f"NF4 dequantize {shape} dq={dq} to {out}", got, bits_of(want))


# ---------------------------------------------------------------------------------------------
# INT8


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_int8_codes_equal_bitsandbytes(dtype, rng, tmp_path):
    for shape in [(1, 1), (3, 5), (67, 333), (300, 257)]:
        x = weights(rng, shape, TORCH_DTYPES[dtype])
        if shape[0] > 2:
            x[1] = 0  # bitsandbytes divides by zero there; Rondo writes zeros (and scale 0)
        blob = rondo_quantize("INT8", x, tmp_path)
        lay = layout("INT8", *shape)
        codes, row_stats, _ = F.int8_vectorwise_quant(x.clone())
        rows = [r for r in range(shape[0]) if not (shape[0] > 2 and r == 1)]
        got = blob[:x.numel()].view(np.int8).reshape(shape)
        assert_same(f"INT8 {shape} {dtype}: codes", got[rows], codes.numpy()[rows])
        scales = blob[lay["scales"]:lay["scales"] + 4 * shape[0]].view(np.float32)
        want = (row_stats.float() / 127).numpy()  # float32 division, as Rondo's
        assert_same(f"INT8 {shape} {dtype}: scales", scales[rows].view(np.uint32),
                    want[rows].view(np.uint32))
        if shape[0] > 2:
            assert not got[1].any() and scales[1] == 0


# ---------------------------------------------------------------------------------------------
# GGUF

GGUF_SHAPES = [(1, 32), (3, 96), (67, 288), (5, 4128)]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gguf_quantize_equals_gguf_py(qtype, dtype, rng, tmp_path):
    for shape in GGUF_SHAPES:
        x = weights(rng, shape, TORCH_DTYPES[dtype])
        blob = rondo_quantize(qtype, x, tmp_path)
        want = gguf.quants.quantize(x.float().numpy(), QT[qtype])
        assert_same(f"{qtype} {shape} {dtype}", blob, want.ravel())
        got = rondo_dequantize(qtype, blob, *shape, "f32", tmp_path)
        assert_same(f"{qtype} {shape}: dequantized", got,
                    gguf.quants.dequantize(want, QT[qtype]).view(np.uint32))


def rms_error(y, x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean((np.asarray(y, np.float64) - x) ** 2) / np.mean(x ** 2)))


# Q4_K and Q6_K: gguf-py decodes Rondo's blocks to exactly Rondo's values; and their RMS error
# relative to RMS(x), on independent normal weights, stays at what docs/quantisation.md states
# (measured 0.0714 and 0.0177; ggml's reference quantisers, quantize_row_q4_K_ref and
# quantize_row_q6_K_ref built from llama.cpp's source, measured 0.0715 and 0.0177 on the same
# weights) and below gguf-py's own quantisers with fewer levels: Q4_K (4.5 bits per weight) below
# Q4_1 (5.0), Q6_K (6.6) below a quarter of Q4_0 (4.5).
K_BOUNDS = {"Q4_K": (0.074, "Q4_1", 1.0), "Q6_K": (0.0185, "Q4_0", 0.25)}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_decode_like_gguf_py_within_their_error(qtype, rng, tmp_path):
    limit, other, factor = K_BOUNDS[qtype]
    shape = (64, 4096)
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * 0.02
    blob = rondo_quantize(qtype, x, tmp_path)
    ref = gguf.quants.dequantize(blob.reshape(shape[0], -1), QT[qtype])
    got = rondo_dequantize(qtype, blob, *shape, "f32", tmp_path)
    assert_same(f"{qtype}: gguf-py's decoding of Rondo's blocks", got, ref.view(np.uint32))
    err = rms_error(ref, x.numpy())
    theirs = rms_error(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), QT[other]),
                                              QT[other]), x.numpy())
    print(f"{qtype}: RMS error {err:.4f} of RMS(x); gguf-py {other}: {theirs:.4f}")
    assert err <= limit, f"{qtype}: RMS error {err:.4f} above {limit}"
    assert err <= factor * theirs, f"{qtype}: RMS error {err:.4f} not below {factor} x {other}'s"
    # Weights of other magnitudes and shapes, as real layers have them: still decoded exactly.
    for shape in [(1, 256), (3, 768), (67, 512)]:
        x = weights(rng, shape, torch.bfloat16)
        blob = rondo_quantize(qtype, x, tmp_path)
        ref = gguf.quants.dequantize(blob.reshape(shape[0], -1), QT[qtype])
        got = rondo_dequantize(qtype, blob, *shape, "f32", tmp_path)
        assert_same(f"{qtype} {shape}: gguf-py's decoding", got, ref.view(np.uint32))
