"""GGUF reading against independent references.

- Dequantisation: files written with gguf-py's GGUFWriter hold tensors of every type Rondo
  supports, in odd shapes (quantised with gguf.quants.quantize where gguf-py can, random valid raw
  blocks otherwise). Rondo's float32 output must equal gguf.quants.dequantize bit for bit: both do
  the same float32 operations in the same order (ggml's reference), so any difference is a bug.
  Rondo's bf16 output must equal torch's round-to-nearest-even conversion of that reference, bit
  for bit; where the reference is NaN, Rondo's value must be NaN (torch canonicalises NaN payloads,
  Rondo keeps them).
- Metadata: every GGUF value type, nested arrays and a custom alignment read back as written.
- Models: tiny random transformers Llama (GQA, llama3 rope scaling, biases, tied embeddings) and
  Qwen2/Qwen3 models are converted to GGUF here, with llama.cpp's conventions (tensor names, ggml
  dims order, the q/k row permutation for llama, rope_freqs for llama3 scaling); Rondo must load
  tensors equal to the HF state dict (exactly in f32) and the HF config's dimensions.
"""
import copy
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from rondo_oracle import DriverError, driver

QT = gguf.GGMLQuantizationType
SEED = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return np.random.default_rng(SEED)


# ---------------------------------------------------------------------------------------------
# helpers


def write_gguf(path, arch, tensors, kv=None, alignment=None):
    """tensors: list of (name, array, raw_dtype or None). kv: callable(writer)."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if kv is not None:
        kv(w)
    for name, data, raw in tensors:
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_rondo_dir(d):
    d = Path(d)
    index = json.loads((d / "index.json").read_text())
    dtype = np.float32 if index["dtype"] == "f32" else np.uint16
    return {
        t["name"]: np.fromfile(d / t["file"], dtype=dtype).reshape(t["shape"])
        for t in index["tensors"]
    }


def assert_bits_equal(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bad = np.flatnonzero(actual.ravel() != expected.ravel())
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {actual.size} elements differ; first at flat index {i}: "
            f"rondo {actual.ravel()[i]:#x}, reference {expected.ravel()[i]:#x} (seed {SEED})")


def check_f32(actual, ref, what):
    """Bit-exact float32 equality (NaN payloads included)."""
    assert actual.dtype == np.float32
    assert_bits_equal(actual.view(np.uint32), np.ascontiguousarray(ref, np.float32).view(np.uint32),
                      what)


def check_bf16(actual_bits, ref, what):
    """Rondo's bf16 bits against torch's round-to-nearest-even of the float32 reference."""
    ref = np.ascontiguousarray(ref, np.float32)
    expect = torch.from_numpy(ref.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    expect = expect.view(np.uint16)
    nan = np.isnan(ref)
    rondo_nan = (actual_bits & 0x7FFF) > 0x7F80
    assert np.array_equal(rondo_nan, nan), f"{what}: NaN positions differ (seed {SEED})"
    assert_bits_equal(np.where(nan, 0, actual_bits), np.where(nan, 0, expect), what)


def f16_bits(rng, shape, scale=1.0):
    """Finite random float16 scales, as raw bits."""
    return (rng.standard_normal(shape) * scale).astype(np.float16).view(np.uint16)


# Raw blocks, laid out as ggml's block_* structs (ggml-common.h), with random but valid contents.
def raw_q8_0(rng, n_blocks):
    d = f16_bits(rng, (n_blocks, 1), 0.02).view(np.uint8)
    qs = rng.integers(0, 256, (n_blocks, 32), dtype=np.uint8)
    return np.concatenate([d, qs], axis=1)


def raw_q4_0(rng, n_blocks):
    d = f16_bits(rng, (n_blocks, 1), 0.1).view(np.uint8)
    return np.concatenate([d, rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)], axis=1)


def raw_q4_1(rng, n_blocks):
    dm = f16_bits(rng, (n_blocks, 2), 0.1).view(np.uint8)
    return np.concatenate([dm, rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)], axis=1)


def raw_q4_k(rng, n_blocks):
    # d, dmin (f16), 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles
    dm = f16_bits(rng, (n_blocks, 2), 0.01).view(np.uint8)
    rest = rng.integers(0, 256, (n_blocks, 12 + 128), dtype=np.uint8)
    return np.concatenate([dm, rest], axis=1)


def raw_q6_k(rng, n_blocks):
    # ql (128), qh (64), int8 scales (16), d (f16)
    body = rng.integers(0, 256, (n_blocks, 128 + 64 + 16), dtype=np.uint8)
    d = f16_bits(rng, (n_blocks, 1), 0.01).view(np.uint8)
    return np.concatenate([body, d], axis=1)


def raw_mxfp4(rng, n_blocks):
    # e8m0 scale (every value, 0 and 255 included), 16 bytes of nibbles
    return rng.integers(0, 256, (n_blocks, 1 + 16), dtype=np.uint8)


RAW = {QT.Q8_0: raw_q8_0, QT.Q4_0: raw_q4_0, QT.Q4_1: raw_q4_1, QT.Q4_K: raw_q4_k,
       QT.Q6_K: raw_q6_k, QT.MXFP4: raw_mxfp4}


def raw_tensor(rng, qtype, shape):
    """A raw quantised tensor of `shape` values: uint8 of shape (..., bytes per row)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert shape[-1] % block == 0
    n_blocks = int(np.prod(shape)) // block
    return RAW[qtype](rng, n_blocks).reshape(*shape[:-1], shape[-1] // block * size)


def special_f32(rng, shape):
    """Random float32 bit patterns (NaNs with payloads, infinities, subnormals) and hard cases for
    bf16 rounding: exact ties both ways, the largest finite float, a NaN whose payload lies only in
    the low 16 bits."""
    bits = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    flat = bits.ravel()
    hard = [0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x7F800001, 0xFF800001, 0x80000000,
            0x00000001, 0x7F800000, 0x3F80FFFF, 0x3F807FFF]
    flat[: len(hard)] = hard
    return bits.view(np.float32)


def dequant_cases(rng):
    """(name, data written, raw_dtype, float32 reference)."""
    cases = []

    def add(name, data, raw, ref):
        cases.append((name, data, raw, ref))

    x = special_f32(rng, (37, 29))
    add("f32.bits", x, None, x)
    y = rng.standard_normal((3, 5, 7)).astype(np.float32)
    add("f32.3d", y, None, y)
    add("f32.size1", np.array([rng.standard_normal()], np.float32), None, None)
    z = rng.standard_normal((2, 3, 1, 5)).astype(np.float32)
    add("f32.4d", z, None, z)
    allf16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    add("f16.all_bit_patterns", allf16, None, None)
    add("f16.odd", rng.standard_normal((5, 11)).astype(np.float16), None, None)
    allbf16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    add("bf16.all_bit_patterns", allbf16.view(np.uint8), QT.BF16, None)
    w = rng.standard_normal((7, 13)).astype(np.float32)
    add("bf16.quantized", gguf.quants.quantize(w, QT.BF16), QT.BF16, None)
    for qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):
        for shape in ((3, 96), (1, 32), (2, 3, 64)):
            v = (rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32)
            add(f"{qtype.name}.quantized.{'x'.join(map(str, shape))}",
                gguf.quants.quantize(v, qtype), qtype, None)
        add(f"{qtype.name}.raw", raw_tensor(rng, qtype, (5, 64)), qtype, None)
    for shape in ((3, 96), (1, 32), (4, 2, 64), (2, 8192)):  # 2 x 8192: every scale byte
        add(f"MXFP4.raw.{'x'.join(map(str, shape))}", raw_tensor(rng, QT.MXFP4, shape), QT.MXFP4,
            None)
    for qtype in (QT.Q4_K, QT.Q6_K):
        for shape in ((3, 512), (1, 256), (2, 3, 256)):
            add(f"{qtype.name}.raw.{'x'.join(map(str, shape))}", raw_tensor(rng, qtype, shape),
                qtype, None)
    out = []
    for name, data, raw, ref in cases:
        if ref is None:
            ref = gguf.quants.dequantize(data, raw if raw is not None else
                                         (QT.F16 if data.dtype == np.float16 else QT.F32))
        out.append((name, data, raw, np.asarray(ref, np.float32)))
    return out


# ---------------------------------------------------------------------------------------------
# dequantisation


@pytest.mark.parametrize("target", ["f32", "bf16"])
def test_dequant_every_type_equals_gguf(tmp_path, rng, target):
    cases = dequant_cases(rng)
    path = tmp_path / "types.gguf"
    write_gguf(path, "test", [(n, d, r) for n, d, r, _ in cases])
    driver("gguf-dequant", path, tmp_path / "out", target)
    got = read_rondo_dir(tmp_path / "out")
    assert sorted(got) == sorted(n for n, *_ in cases)
    seen = set()
    for name, _, _, ref in cases:
        seen.add(name.split(".")[0])
        if target == "f32":
            check_f32(got[name], ref, name)
        else:
            check_bf16(got[name], ref, name)
    assert seen == {"f32", "f16", "bf16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "MXFP4"}


def test_unsupported_type_is_named(tmp_path, rng):
    """A type gguf-py knows but Rondo cannot dequantise (Q5_K) opens, then fails by name."""
    block, size = gguf.GGML_QUANT_SIZES[QT.Q5_K]
    q5 = np.concatenate([f16_bits(rng, (2, 2), 0.01).view(np.uint8),
                         rng.integers(0, 256, (2, size - 4), dtype=np.uint8)], axis=1)
    path = tmp_path / "q5k.gguf"
    write_gguf(path, "test", [("ok", rng.standard_normal(8).astype(np.float32), None),
                              ("blk.0.odd", q5.reshape(1, 2 * size), QT.Q5_K)])
    meta = tmp_path / "meta.json"
    driver("gguf-meta", path, meta)
    assert [t["type"] for t in json.loads(meta.read_text())["tensors"]] == ["F32", "Q5_K"]
    with pytest.raises(DriverError) as e:
        driver("gguf-dequant", path, tmp_path / "out", "f32")
    assert str(path) in e.value.message and "'blk.0.odd'" in e.value.message
    assert "Q5_K" in e.value.message


# ---------------------------------------------------------------------------------------------
# metadata


def test_metadata_every_value_type(tmp_path, rng):
    ints = rng.integers(-2**31, 2**31, 5).tolist()
    f32 = float(np.float32(rng.standard_normal()))
    f64 = float(rng.standard_normal())
    T = gguf.GGUFValueType
    written = {  # key: (type name, value, element type name)
        "t.u8": ("UINT8", 250, None), "t.i8": ("INT8", -100, None),
        "t.u16": ("UINT16", 65000, None), "t.i16": ("INT16", -32000, None),
        "t.u32": ("UINT32", 4_000_000_000, None), "t.i32": ("INT32", -2_000_000_000, None),
        "t.u64": ("UINT64", 2**64 - 3, None), "t.i64": ("INT64", -(2**62) - 7, None),
        "t.f32": ("FLOAT32", f32, None), "t.f64": ("FLOAT64", f64, None),
        "t.bool": ("BOOL", True, None), "t.false": ("BOOL", False, None),
        "t.str": ("STRING", "héllo ▁wörld 🦙", None),
        "t.ints": ("ARRAY", ints, "INT32"),
        "t.u64s": ("ARRAY", [0, 2**64 - 1, 7], "UINT64"),
        "t.i8s": ("ARRAY", [-128, 127, 0], "INT8"),
        "t.f32s": ("ARRAY", [float(np.float32(v)) for v in rng.standard_normal(4)], "FLOAT32"),
        "t.f64s": ("ARRAY", rng.standard_normal(3).tolist(), "FLOAT64"),
        "t.bools": ("ARRAY", [True, False, True], "BOOL"),
        "t.strs": ("ARRAY", ["a", "", "ß✓", "<0x0A>"], "STRING"),
        "t.nested": ("ARRAY", [[1, 2], [3], [4, 5, 6]], "ARRAY"),
        "t.nested_strs": ("ARRAY", [["x", "y"], ["z"]], "ARRAY"),
    }

    def kv(w):
        for key, (tname, value, ename) in written.items():
            sub = getattr(T, ename) if ename not in (None, "ARRAY") else None
            w.add_key_value(key, value, getattr(T, tname), sub_type=sub)

    path = tmp_path / "meta.gguf"
    t = rng.standard_normal((3, 5)).astype(np.float32)
    write_gguf(path, "test", [("a", t, None), ("b", t[:1], None)], kv=kv, alignment=64)
    out = tmp_path / "meta.json"
    driver("gguf-meta", path, out)
    got = json.loads(out.read_text())
    assert got["version"] == 3
    assert got["alignment"] == 64
    assert got["data_offset"] % 64 == 0
    meta = got["metadata"]
    assert meta["general.architecture"] == {"type": "STRING", "value": "test"}
    assert meta["general.alignment"] == {"type": "UINT32", "value": 64}
    for key, (tname, value, ename) in written.items():
        assert meta[key]["type"] == tname, key
        assert meta[key]["value"] == value, key
        if ename is not None:
            assert meta[key]["element_type"] == ename, key
    # Tensor infos as gguf-py's own reader sees them.
    reader = gguf.GGUFReader(str(path))
    assert [(t["name"], t["ne"], t["type"], t["offset"], t["n_bytes"]) for t in got["tensors"]] == [
        (r.name, [int(x) for x in r.shape], r.tensor_type.name, int(r.data_offset) -
         got["data_offset"], int(r.n_bytes)) for r in reader.tensors]


# ---------------------------------------------------------------------------------------------
# models: transformers -> GGUF (llama.cpp's conventions, written here) -> Rondo


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotary halves -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama_cpp_inverse_permute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def llama3_rope_freqs(rope, head_dim):
    """rope_freqs.weight as llama.cpp's converter computes it for llama3 rope scaling."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


GGUF_NAMES = [  # (HF suffix, llama.cpp name)
    ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
    ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"),
    ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
]


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"], hf
    module, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{dict(GGUF_NAMES)[module]}.{kind}"


def add_dimensions(w, cfg, head_dim):
    """The dimension keys llama.cpp's converter writes for every architecture (TextModel)."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def convert(model, path, arch, quant=None, drop=(), extra=()):
    """Writes `model` as llama.cpp would; returns {hf name: expected float32 tensor}. quant: a
    ggml type for the 2-D weights (reference: gguf-py's dequantisation of what was written).
    drop: GGUF names left out; extra: (name, array) written in addition (corrupt models)."""
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rope = cfg.rope_parameters

    def kv(w):
        add_dimensions(w, cfg, D)
        w.add_rope_dimension_count(D)
        w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        experts = getattr(cfg, "num_local_experts", 0)
        if experts:  # as llama.cpp's converter writes Qwen3-MoE and Mixtral
            w.add_expert_count(experts)
            w.add_expert_used_count(cfg.num_experts_per_tok)
            if arch == "qwen3moe":
                w.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    mixtral = type(model).__name__.startswith("Mixtral")

    def expert_name(layer, e, proj):  # the per-expert HF name Rondo uses (the checkpoints')
        if mixtral:
            return (f"model.layers.{layer}.block_sparse_moe.experts.{e}."
                    f"{dict(gate='w1', up='w3', down='w2')[proj]}.weight")
        return f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"

    def add_experts(gguf_tensor, stacked, layer, proj):
        """One expert-major tensor (E, rows, cols), quantised row by row like any matrix."""
        if quant is not None and stacked.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(stacked, quant)
            tensors.append((gguf_tensor, q, quant))
            back = gguf.quants.dequantize(q, quant)
        else:
            tensors.append((gguf_tensor, stacked, None))
            back = stacked
        for e in range(stacked.shape[0]):
            expected[expert_name(layer, e, proj)] = back[e]

    tensors, expected = [], {}
    for name, p in model.named_parameters():
        x = p.detach().float().numpy().copy()
        if ".mlp.experts." in name:  # transformers 5 fuses the experts in memory
            layer = int(name.split(".")[2])
            blk = f"blk.{layer}."
            if name.endswith("gate_up_proj"):
                half = x.shape[1] // 2
                add_experts(blk + "ffn_gate_exps.weight", np.ascontiguousarray(x[:, :half]), layer,
                            "gate")
                add_experts(blk + "ffn_up_exps.weight", np.ascontiguousarray(x[:, half:]), layer,
                            "up")
            else:
                add_experts(blk + "ffn_down_exps.weight", x, layer, "down")
            continue
        if name.endswith(".mlp.gate.weight"):  # the router
            layer = int(name.split(".")[2])
            tensors.append((f"blk.{layer}.ffn_gate_inp.weight", x, None))
            expected[name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name] = x
            continue
        permute = None
        if arch == "llama" and ".q_proj." in name:  # Mixtral too: llama.cpp's llama
            permute = H
        elif arch == "llama" and ".k_proj." in name:
            permute = KV
        stored = llama_cpp_permute(x, permute) if permute else x
        if quant is not None and stored.ndim == 2 and stored.shape[1] % 32 == 0:
            q = gguf.quants.quantize(stored, quant)
            tensors.append((gguf_name(name), q, quant))
            back = gguf.quants.dequantize(q, quant)
            expected[name] = llama_cpp_inverse_permute(back, permute) if permute else back
        else:
            tensors.append((gguf_name(name), stored, None))
            expected[name] = x
    if rope.get("rope_type") == "llama3":
        tensors.append(("rope_freqs.weight", llama3_rope_freqs(rope, D), None))
    scaling = {"linear": gguf.RopeScalingType.LINEAR, "yarn": gguf.RopeScalingType.YARN}.get(
        rope.get("rope_type"))

    def kv_scaled(w):  # as llama.cpp's converter writes linear and yarn scaling
        kv(w)
        if scaling is not None:
            w.add_rope_scaling_type(scaling)
            w.add_rope_scaling_factor(rope["factor"])
            if scaling == gguf.RopeScalingType.YARN:
                w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tensors = [t for t in tensors if t[0] not in drop] + [(n, a, None) for n, a in extra]
    write_gguf(path, arch, tensors, kv=kv_scaled)
    return expected


def tiny(kind):
    import transformers as tf
    common = dict(num_hidden_layers=2, max_position_embeddings=131072, rms_norm_eps=1e-5)
    if kind.startswith("llama-gqa-llama3"):
        # Llama 3's theta puts frequencies on both plateaus and the ramp between them; with
        # theta = 10000 and D = 16 none reaches the `factor` plateau, so only the factors, not
        # the parameters, can be recovered.
        theta = 10000.0 if kind.endswith("ramp-only") else 500000.0
        cfg = tf.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 0.25, "high_freq_factor": 8.0,
                                           "original_max_position_embeddings": 8192,
                                           "rope_theta": theta}, **common)
        return tf.LlamaForCausalLM(cfg), "llama"
    if kind == "llama-tied-bias-headdim":
        cfg = tf.LlamaConfig(vocab_size=77, hidden_size=48, intermediate_size=64,
                             num_attention_heads=6, num_key_value_heads=3, head_dim=12,
                             attention_bias=True, tie_word_embeddings=True,
                             rope_theta=500000.0, **common)
        return tf.LlamaForCausalLM(cfg), "llama"
    if kind == "qwen2-tied":
        cfg = tf.Qwen2Config(vocab_size=93, hidden_size=64, intermediate_size=80,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, **common)
        return tf.Qwen2ForCausalLM(cfg), "qwen2"
    if kind == "qwen2-yarn":
        cfg = tf.Qwen2Config(vocab_size=93, hidden_size=64, intermediate_size=80,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32768}, **common)
        return tf.Qwen2ForCausalLM(cfg), "qwen2"
    if kind == "llama-linear":
        cfg = tf.LlamaConfig(vocab_size=77, hidden_size=48, intermediate_size=64,
                             num_attention_heads=6, num_key_value_heads=3,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}, **common)
        return tf.LlamaForCausalLM(cfg), "llama"
    if kind == "qwen3-headdim":
        cfg = tf.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             tie_word_embeddings=False, **common)
        return tf.Qwen3ForCausalLM(cfg), "qwen3"
    if kind == "qwen3moe":  # every block sparse, as llama.cpp's qwen3moe has them
        cfg = tf.Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=80,
                                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, tie_word_embeddings=False, **common)
        return tf.Qwen3MoeForCausalLM(cfg), "qwen3moe"
    if kind == "mixtral":
        cfg = tf.MixtralConfig(vocab_size=77, hidden_size=64, intermediate_size=64,
                               num_local_experts=3, num_experts_per_tok=2,
                               num_attention_heads=4, num_key_value_heads=2, **common)
        return tf.MixtralForCausalLM(cfg), "llama"
    raise ValueError(kind)


MODELS = ["llama-gqa-llama3", "llama-gqa-llama3-ramp-only", "llama-tied-bias-headdim", "qwen2-tied",
          "qwen3-headdim", "qwen2-yarn", "llama-linear", "qwen3moe", "mixtral"]


def random_model(kind):
    torch.manual_seed(SEED)
    model, arch = tiny(kind)
    with torch.no_grad():
        for p in model.parameters():  # norms start at ones and biases at zeros: too easy
            p.normal_(0.0, 0.5)
    return model, arch


@pytest.mark.parametrize("kind", MODELS)
def test_model_tensors_and_config_equal_transformers(tmp_path, kind):
    model, arch = random_model(kind)
    path = tmp_path / "model.gguf"
    expected = convert(model, path, arch)
    driver("gguf-model", path, tmp_path / "f32", "f32")
    got = read_rondo_dir(tmp_path / "f32")
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        check_f32(got[name], ref, name)
    driver("gguf-model", path, tmp_path / "bf16", "bf16")
    got16 = read_rondo_dir(tmp_path / "bf16")
    for name, ref in expected.items():
        check_bf16(got16[name], ref, name)

    cfg = model.config
    c = json.loads((tmp_path / "f32" / "config.json").read_text())
    H = cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    assert c["architecture"] == type(model).__name__
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings"):
        assert c[field] == getattr(cfg, field), field
    assert c["head_dim"] == D
    # GGUF stores these as float32.
    assert c["rms_norm_eps"] == float(np.float32(cfg.rms_norm_eps))
    rope = cfg.rope_parameters
    assert c["rope_theta"] == float(np.float32(rope["rope_theta"]))
    assert c["attention_bias"] == (arch == "qwen2" or getattr(cfg, "attention_bias", False))
    assert c["qk_norm"] == (arch in ("qwen3", "qwen3moe"))
    assert c["num_experts"] == getattr(cfg, "num_local_experts", 0)
    if c["num_experts"]:
        assert c["experts_per_token"] == cfg.num_experts_per_tok and c["norm_topk_prob"]
        assert c["moe_intermediate_size"] == getattr(cfg, "moe_intermediate_size",
                                                     cfg.intermediate_size)
    assert c["bos_token_id"] == 1 and c["eos_token_ids"] == [2]
    if rope.get("rope_type") == "llama3":
        assert c["rope_type"] == "llama3"
        # What matters: transformers' llama3 inverse frequencies from Rondo's parameters equal
        # those from the HF config (the parameters come back from float32 factors: rtol 1e-5).
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        mine = copy.deepcopy(cfg)
        mine.rope_parameters = dict(
            rope, factor=c["rope_factor"], low_freq_factor=c["rope_low_freq_factor"],
            high_freq_factor=c["rope_high_freq_factor"],
            original_max_position_embeddings=c["rope_original_max_position_embeddings"])
        inv_hf = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))[0]
        inv_rondo = ROPE_INIT_FUNCTIONS["llama3"](mine, torch.device("cpu"))[0]
        torch.testing.assert_close(inv_rondo, inv_hf, rtol=1e-5, atol=0)
        if not kind.endswith("ramp-only"):  # all three regions present: parameters unique
            for k in ("factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings"):
                assert c[f"rope_{k}"] == pytest.approx(rope[k], rel=1e-5), k
    elif rope.get("rope_type") in ("linear", "yarn"):
        # The scaling llama.cpp stores: transformers' inverse frequencies and attention factor
        # from Rondo's parameters equal those from the HF config.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        kind_ = rope["rope_type"]
        assert c["rope_type"] == kind_ and c["rope_factor"] == rope["factor"]
        mine = copy.deepcopy(cfg)
        mine.rope_parameters = dict(rope, factor=c["rope_factor"])
        if kind_ == "yarn":
            assert c["rope_original_max_position_embeddings"] == \
                rope["original_max_position_embeddings"]
            mine.rope_parameters["original_max_position_embeddings"] = \
                c["rope_original_max_position_embeddings"]
        inv_hf, scale_hf = ROPE_INIT_FUNCTIONS[kind_](cfg, torch.device("cpu"))
        inv_rondo, _ = ROPE_INIT_FUNCTIONS[kind_](mine, torch.device("cpu"))
        torch.testing.assert_close(inv_rondo, inv_hf, rtol=0, atol=0)
        assert c["rope_attention_factor"] == pytest.approx(scale_hf, rel=1e-12)
    else:
        assert c["rope_type"] == "default"


@pytest.mark.parametrize("kind,quant", [("llama-gqa-llama3", QT.Q8_0),
                                        ("llama-tied-bias-headdim", QT.Q4_1),
                                        ("qwen3-headdim", QT.Q4_0), ("qwen3moe", QT.Q8_0),
                                        ("mixtral", QT.Q4_0)])
def test_quantised_model_unpermutes_dequantised_rows(tmp_path, kind, quant):
    """llama.cpp quantises after permuting: Rondo must dequantise, then undo the permutation."""
    model, arch = random_model(kind)
    path = tmp_path / "model.gguf"
    expected = convert(model, path, arch, quant=quant)
    driver("gguf-model", path, tmp_path / "out", "f32")
    got = read_rondo_dir(tmp_path / "out")
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        check_f32(got[name], ref, name)


def test_missing_wrong_and_unexpected_tensors_are_named(tmp_path):
    model, arch = random_model("qwen3-headdim")

    def fails(name, **kw):
        path = tmp_path / f"{name}.gguf"
        convert(model, path, arch, **kw)
        with pytest.raises(DriverError) as e:
            driver("gguf-model", path, tmp_path / name, "f32")
        assert str(path) in e.value.message
        return e.value.message

    msg = fails("missing", drop={"blk.1.attn_k_norm.weight"})
    assert "'blk.1.attn_k_norm.weight'" in msg and "missing" in msg
    msg = fails("extra", extra=[("blk.2.attn_q.weight", np.ones((64, 48), np.float32))])
    assert "'blk.2.attn_q.weight'" in msg and "not part of" in msg
    msg = fails("wrong", drop={"blk.0.ffn_up.weight"},
                extra=[("blk.0.ffn_up.weight", np.ones((81, 48), np.float32))])
    assert "'blk.0.ffn_up.weight'" in msg and "[81, 48]" in msg and "[80, 48]" in msg


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_moe_gguf_logits_equal_transformers(tmp_path, kind):
    """A mixture of experts in llama.cpp's layout (expert-major ffn_*_exps tensors, the router as
    ffn_gate_inp), loaded by Rondo from the GGUF alone: the HF model's logits (fp32)."""
    model, arch = random_model(kind)
    with torch.no_grad():  # smaller weights than random_model's: logits of a usual size
        for p in model.parameters():
            p.mul_(0.2)
    model.eval()
    path = tmp_path / "model.gguf"
    convert(model, path, arch)
    assert_logits_equal(model, path, tmp_path)


def assert_logits_equal(model, path, tmp_path):
    """Rondo's fp32 logits from the GGUF at `path` equal `model`'s within 1e-4 of their scale."""
    tokens = torch.randint(0, model.config.vocab_size, (2, 13),
                           generator=torch.Generator().manual_seed(SEED))
    (tmp_path / "batch.json").write_text(json.dumps({"tokens": tokens.tolist(), "dtype": "F32"}))
    driver("forward", path, tmp_path / "batch.json", tmp_path / "out.safetensors")
    from safetensors.numpy import load_file
    got = load_file(str(tmp_path / "out.safetensors"))["logits"]
    with torch.no_grad():
        want = model(input_ids=tokens).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


def convert_gpt_oss(model, path, experts_qtype=None):
    """A GPT-OSS model as llama.cpp's converter writes it (conversion/gpt_oss.py): arch gpt-oss,
    HF's fused x @ W experts split into ffn_gate_exps / ffn_up_exps (E, I, C) from the even and odd
    columns of gate_up_proj and ffn_down_exps (E, C, I), their biases likewise, F32 norms, biases,
    sinks and router. experts_qtype: the three expert weights in that ggml type (the rest F32).
    Returns the HF model's state dict with the experts as the file holds them (gguf-py's
    dequantisation, fused back)."""
    cfg = model.config
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rope = cfg.rope_parameters
    sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight",
             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
             "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    for p in ("q", "k", "v"):
        names[f"self_attn.{p}_proj.weight"] = f"attn_{p}.weight"
        names[f"self_attn.{p}_proj.bias"] = f"attn_{p}.bias"
    names["self_attn.o_proj.weight"] = "attn_output.weight"
    names["self_attn.o_proj.bias"] = "attn_output.bias"
    tensors, expected = [], dict(sd)

    def add_expert(name, x):  # (E, rows, cols); returns what the file holds, as float32
        x = np.ascontiguousarray(x)
        if experts_qtype is None:
            tensors.append((name, x, None))
            return x
        q = gguf.quants.quantize(x, experts_qtype)
        tensors.append((name, q, experts_qtype))
        return gguf.quants.dequantize(q, experts_qtype)

    for name, x in sd.items():
        if name == "model.embed_tokens.weight":
            tensors.append(("token_embd.weight", x, None))
        elif name == "model.norm.weight":
            tensors.append(("output_norm.weight", x, None))
        elif name == "lm_head.weight":
            tensors.append(("output.weight", x, None))
        else:
            layer, rest = int(name.split(".")[2]), ".".join(name.split(".")[3:])
            blk = f"blk.{layer}."
            if rest == "mlp.experts.gate_up_proj":  # (E, C, 2I), gate and up interleaved
                gate = add_expert(blk + "ffn_gate_exps.weight", x[:, :, ::2].transpose(0, 2, 1))
                up = add_expert(blk + "ffn_up_exps.weight", x[:, :, 1::2].transpose(0, 2, 1))
                fused = np.stack([gate, up], axis=2).reshape(x.shape[0], -1, x.shape[1])
                expected[name] = fused.transpose(0, 2, 1)
            elif rest == "mlp.experts.gate_up_proj_bias":
                tensors.append((blk + "ffn_gate_exps.bias", np.ascontiguousarray(x[:, ::2]), None))
                tensors.append((blk + "ffn_up_exps.bias", np.ascontiguousarray(x[:, 1::2]), None))
            elif rest == "mlp.experts.down_proj":  # (E, I, C)
                expected[name] = add_expert(blk + "ffn_down_exps.weight",
                                            x.transpose(0, 2, 1)).transpose(0, 2, 1)
            else:
                tensors.append((blk + names[rest], x, None))

    def kv(w):
        add_dimensions(w, cfg, D)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    write_gguf(path, "gpt-oss", tensors, kv=kv)
    return expected


@pytest.mark.parametrize("experts", ["f32", "mxfp4"])
def test_gpt_oss_gguf_logits_equal_transformers(tmp_path, experts):
    """GPT-OSS in llama.cpp's layout (separate gate, up and down expert tensors, sinks, biases,
    YaRN, even layers sliding), experts in F32 or MXFP4: Rondo's logits from the GGUF alone equal
    transformers' on the weights the file holds (fp32), with windows shorter than the rows."""
    import transformers as tf
    torch.manual_seed(SEED)
    cfg = tf.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=6, rms_norm_eps=1e-5)
    model = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path / "model.gguf"
    expected = convert_gpt_oss(model, path, None if experts == "f32" else QT.MXFP4)
    if experts == "mxfp4":  # the reference computes with what the file holds
        plain = model.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
        held = expected["model.layers.0.mlp.experts.gate_up_proj"]
        assert 1e-3 < np.linalg.norm(held - plain) / np.linalg.norm(plain) < 0.5
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                               for k, v in expected.items()})
    assert_logits_equal(model, path, tmp_path)
