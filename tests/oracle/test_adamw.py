"""Rondo's CPU AdamW kernels against torch.optim.AdamW and bitsandbytes' AdamW8bit on the CPU.

Both sides start from the same fp32 master weights and moments and get the same gradients each
step (Rondo reads them in F32, BF16 or F16; torch gets the same values as fp32 .grad, multiplied
by the same grad_scale in fp32), with a learning-rate schedule, for 10 steps. Expected values
come from torch only.

Tolerance: 1e-6 relative, element-wise, with an absolute floor of 1e-6 times the tensor's largest
magnitude (values that cancelled to nearly zero carry their operands' rounding, not their own).
Rondo performs torch's f32 operations in torch's order; the one difference left is that torch's
sqrt on large tensors is not always correctly rounded (Note [Matching torch.optim.AdamW] in
kernels/cpu/adamw.cpp), which moves an update by ~1e-7 of its size.

The 8-bit kernel (kernels/cpu/adamw8bit.h) is compared with bnb.optim.AdamW8bit on the CPU, bit
for bit: see the section "8-bit AdamW against bitsandbytes" below.
"""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rondo_oracle import correctly_rounded_sqrt, driver

RTOL = 1e-6
STEPS = 10
SIZES = [1, 22, 4097, 1_000_000]
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def new_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    return seed


def make_case(n, grad_dtype, weight_decay, seed, beta1=0.9):
    """Initial state, per-step gradients (stored in grad_dtype) and hyper-parameters. Nothing is
    zero; gradient magnitudes span six decades so that sqrt(v) meets eps."""
    g = torch.Generator().manual_seed(seed)

    def uniform(lo, hi, size):
        return lo + (hi - lo) * torch.rand(size, generator=g, dtype=torch.float64)

    def nonzero(x):
        return torch.where(x == 0, torch.full_like(x, 1e-7), x)

    scale = 10.0 ** uniform(-6, 0, n)
    state = {
        "master": nonzero(uniform(-0.1, 0.1, n)).float(),
        "m": nonzero(0.1 * scale * uniform(-1, 1, n)).float(),
        "v": nonzero(0.01 * (scale * uniform(-1, 1, n)) ** 2).float(),
    }
    grads, steps = [], []
    for k in range(1, STEPS + 1):
        grad = (scale * uniform(-1, 1, n)).to(DTYPES[grad_dtype])
        grad = torch.where(grad == 0, scale.to(DTYPES[grad_dtype]), grad)
        grads.append(grad)
        steps.append({
            "lr": 1e-2 * (1.0 - 0.05 * k),  # a decaying schedule: lr differs per step
            "beta1": beta1, "beta2": 0.999, "eps": 1e-8, "weight_decay": weight_decay,
            "step": k,
            "grad_scale": float(uniform(0.25, 1.75, 1)),  # clip coefficient x inverse loss scale
        })
    return state, grads, steps


def run_torch(state, grads, steps):
    """torch.optim.AdamW (default implementation on the CPU) from the same state."""
    p = torch.nn.Parameter(state["master"].clone())
    s0 = steps[0]
    opt = torch.optim.AdamW([p], lr=s0["lr"], betas=(s0["beta1"], s0["beta2"]), eps=s0["eps"],
                            weight_decay=s0["weight_decay"])
    # Moments that are not zero: state as if resumed from a checkpoint at step 0.
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": state["m"].clone(),
                    "exp_avg_sq": state["v"].clone()}
    for grad, s in zip(grads, steps):
        opt.param_groups[0]["lr"] = s["lr"]
        p.grad = grad.float() * s["grad_scale"]  # fp32 multiply by float(grad_scale); a copy
        opt.step()
    st = opt.state[p]
    return {"master": p.detach(), "m": st["exp_avg"], "v": st["exp_avg_sq"]}


def run_rondo(tmp_path, state, grads, steps, stream_dtype="BF16", simd="auto"):
    tensors = dict(state)
    tensors.update({f"grad.{k}": g for k, g in enumerate(grads, start=1)})
    save_file(tensors, str(tmp_path / "in.safetensors"))
    (tmp_path / "run.json").write_text(json.dumps(
        {"steps": steps, "stream_dtype": stream_dtype, "simd": simd}))
    path = driver("adamw", tmp_path / "in.safetensors", tmp_path / "run.json",
                  tmp_path / "out.safetensors").strip()
    print("SIMD path:", path)
    return load_file(str(tmp_path / "out.safetensors")), path


def assert_close(name, got, want, rtol=RTOL):
    got, want = got.double(), want.double()
    floor = rtol * want.abs().max().item()
    err = (got - want).abs()
    allowed = rtol * want.abs() + floor
    ratio = err / allowed
    worst = int(ratio.argmax())
    assert bool((err <= allowed).all()), (
        f"{name}: {int((err > allowed).sum())} of {got.numel()} elements differ by more than "
        f"{rtol} relative; worst at index {worst}: rondo {got[worst].item()!r}, torch "
        f"{want[worst].item()!r}, relative {(err[worst] / want[worst].abs()).item():.3g}")


def assert_same_bits(name, got, want):
    """Bit-equal 16-bit values, any NaN matching any NaN."""
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"{name}: NaNs differ"
    g, w = got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, (f"{name}: {bad.numel()} elements differ; first at {int(bad[0])}: "
                              f"rondo {got[~nan][bad[0]].item()}, torch {want[~nan][bad[0]].item()}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", ["F32", "BF16", "F16"])
def test_adamw_matches_torch_over_10_steps(n, weight_decay, grad_dtype, tmp_path):
    state, grads, steps = make_case(n, grad_dtype, weight_decay, new_seed())
    want = run_torch(state, grads, steps)
    got, _ = run_rondo(tmp_path, state, grads, steps, stream_dtype="BF16")
    for key in ("master", "m", "v"):
        assert_close(key, got[key], want[key])
    # The streaming copy is Rondo's master rounded by torch.
    assert_same_bits("bf16 stream", got["stream"], got["master"].to(torch.bfloat16))


@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
def test_every_simd_path_matches_torch(simd, tmp_path):
    n = 4097 + 16 * 1024  # several tiles, a tail
    state, grads, steps = make_case(n, "BF16", 0.01, new_seed())
    want = run_torch(state, grads, steps)
    try:
        got, path = run_rondo(tmp_path, state, grads, steps, stream_dtype="F16", simd=simd)
    except Exception as e:  # noqa: BLE001 - the driver says why
        if "does not support" in str(e):
            pytest.skip(f"this CPU has no {simd}")
        raise
    assert path == simd
    for key in ("master", "m", "v"):
        assert_close(key, got[key], want[key])
    assert_same_bits("f16 stream", got["stream"], got["master"].to(torch.float16))


@pytest.mark.parametrize("beta1", [0.0, 0.3])
def test_small_beta1_matches_torch(beta1, tmp_path):
    """torch's lerp changes form at weight 0.5; beta1 = 0 must give m = g exactly."""
    state, grads, steps = make_case(4097, "F32", 0.01, new_seed(), beta1=beta1)
    want = run_torch(state, grads, steps)
    got, _ = run_rondo(tmp_path, state, grads, steps, stream_dtype=None)
    for key in ("master", "m", "v"):
        assert_close(key, got[key], want[key])
    assert "stream" not in got


def special_masters():
    bits = np.array([
        0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000,  # NaN, -NaN, Inf, -Inf
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000,  # near FLT_MAX / bf16 max
        0x3F808000, 0x3F818000, 0x3F808001, 0xBF808000, 0xBF818000,  # bf16 ties and neighbours
        0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000,  # 65504, f16 overflow tie
        0x3F801000, 0x3F803000, 0x33C00000, 0x00018000, 0x80018000,  # f16 ties, subnormals
    ], dtype=np.uint32)
    x = torch.from_numpy(bits.view(np.float32).copy())
    return x.repeat(7)[:7 * len(bits) - 3]  # lanes and tails both see every value


@pytest.mark.parametrize("stream_dtype", ["BF16", "F16"])
def test_streaming_copy_rounds_special_values_like_torch(stream_dtype, tmp_path):
    """lr = 0 and no weight decay leave the masters unchanged: the streaming copy must be
    torch's rounding of NaN, Inf, the largest finite values and ties."""
    master = special_masters()
    n = master.numel()
    state = {"master": master, "m": torch.full((n,), 1e-3), "v": torch.full((n,), 1e-6)}
    grads = [torch.full((n,), 2e-3)]
    steps = [{"lr": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
              "step": 1}]
    got, _ = run_rondo(tmp_path, state, grads, steps, stream_dtype=stream_dtype)
    finite_or_inf = ~torch.isnan(master)
    assert torch.equal(got["master"][finite_or_inf], master[finite_or_inf])
    assert torch.isnan(got["master"][~finite_or_inf]).all()
    assert_same_bits(f"{stream_dtype} stream", got["stream"], master.to(DTYPES[stream_dtype]))


@pytest.mark.parametrize("grad_dtype", ["F32", "BF16", "F16"])
def test_grad_sum_squares_matches_torch_in_float64(grad_dtype, tmp_path):
    g = torch.Generator().manual_seed(new_seed())
    n = 1_000_003
    grad = (10.0 ** (-3 + 3 * torch.rand(n, generator=g, dtype=torch.float64))
            * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)).to(DTYPES[grad_dtype])
    save_file({"grad": grad}, str(tmp_path / "g.safetensors"))
    want = grad.double().square().sum().item()
    for simd in ("auto", "scalar"):
        got = float(driver("sum_squares", tmp_path / "g.safetensors", "grad", simd))
        # Any order of f64 additions of n positive terms stays within n * 2^-53 of the sum.
        assert abs(got - want) <= n * 2.0 ** -53 * want, (simd, got, want)


# --- 8-bit AdamW against bitsandbytes ---------------------------------------------------------
#
# Rondo's adamw8bit_step (kernels/cpu/adamw8bit.h) against bnb.optim.AdamW8bit on the CPU, from
# the fresh state, with the same fp32 gradients (Rondo reads them in F32, BF16 or F16; bitsandbytes
# gets the same values as fp32 .grad, multiplied by the same grad_scale in fp32). Expected values
# come from bitsandbytes only. Two comparisons:
#  - against bitsandbytes with torch.Tensor.sqrt made correctly rounded: everything bit for bit
#    (codes, absmax, master, and the bf16 streaming copy against the master rounded by torch);
#  - against bitsandbytes as shipped: torch's CPU sqrt goes through MKL's vector math, 1 ulp off
#    for ~0.6% of elements (Note [bitsandbytes' AdamW8bit on the CPU] in kernels/cpu/adamw8bit.cpp).
#    The moments never see the sqrt: codes and absmax still bit for bit. A master may differ by
#    what a 1-ulp sqrt does to each step: an ulp of the master plus 2^-21 of the update, per step.

BNB_SIZES = [1, 22, 255, 257, 4099, 70_001]
STATE8 = ("m_codes", "m_absmax", "v_codes", "v_absmax")


def run_bnb8(master, grads, steps, exact_sqrt):
    """bnb.optim.AdamW8bit on the CPU from the fresh state; returns its state after the steps
    (Rondo's names) and the master after every step."""
    bnb = pytest.importorskip("bitsandbytes")
    p = torch.nn.Parameter(master.clone())
    s0 = steps[0]
    opt = bnb.optim.AdamW8bit([p], lr=s0["lr"], betas=(s0["beta1"], s0["beta2"]), eps=s0["eps"],
                              weight_decay=s0["weight_decay"], min_8bit_size=0)
    trajectory = [master.clone()]
    with correctly_rounded_sqrt(exact_sqrt):
        for grad, s in zip(grads, steps):
            opt.param_groups[0]["lr"] = s["lr"]
            p.grad = grad.float() * s["grad_scale"]  # fp32 multiply by float(grad_scale)
            opt.step()
            trajectory.append(p.detach().clone())
    st = opt.state[p]
    assert st["state1"].dtype == torch.uint8, "bitsandbytes did not take the 8-bit path"
    return {"master": p.detach().clone(), "m_codes": st["state1"], "m_absmax": st["absmax1"],
            "v_codes": st["state2"], "v_absmax": st["absmax2"], "qmap1": st["qmap1"],
            "qmap2": st["qmap2"]}, trajectory


def run_rondo8(tmp_path, master, grads, steps, state=None, stream_dtype="BF16", simd="auto",
               chunk=None):
    tensors = {"master": master, **(state or {})}
    tensors.update({f"grad.{k}": g for k, g in enumerate(grads, start=1)})
    save_file(tensors, str(tmp_path / "in8.safetensors"))
    run = {"steps": steps, "stream_dtype": stream_dtype, "simd": simd}
    if chunk is not None:
        run["chunk"] = chunk
    (tmp_path / "run8.json").write_text(json.dumps(run))
    path = driver("adamw8bit", tmp_path / "in8.safetensors", tmp_path / "run8.json",
                  tmp_path / "out8.safetensors").strip()
    print("SIMD path:", path)
    return load_file(str(tmp_path / "out8.safetensors")), path


def assert_equal_bits(name, got, want):
    """Bit-equal tensors of any dtype; reports how many differ and the first."""
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert g.shape == w.shape, f"{name}: {tuple(got.shape)} against {tuple(want.shape)}"
    width = got.element_size()
    bad = (g.view(-1, width) != w.view(-1, width)).any(dim=1).nonzero()
    assert bad.numel() == 0, (
        f"{name}: {bad.numel()} of {got.numel()} elements differ; first at {int(bad[0])}: "
        f"rondo {got.view(-1)[bad[0]].item()!r}, bitsandbytes {want.view(-1)[bad[0]].item()!r}")


def master_bound(trajectory):
    """Per element: Σ over steps of an ulp of the master plus 2^-21 of the update."""
    bound = torch.zeros_like(trajectory[0], dtype=torch.float64)
    for before, after in zip(trajectory, trajectory[1:]):
        a = after.double()
        ulp = torch.from_numpy(np.spacing(np.abs(after.numpy()))).double()
        bound += ulp + 2.0 ** -21 * (a - before.double()).abs()
    return bound


def case8(n, grad_dtype, weight_decay, beta1=0.9):
    state, grads, steps = make_case(n, grad_dtype, weight_decay, new_seed(), beta1=beta1)
    return state["master"], grads, steps


def assert_matches_bnb_exactly(got, want):
    for key in STATE8 + ("master",):
        assert_equal_bits(key, got[key], want[key])
    if "stream" in got:
        assert_same_bits("bf16 stream", got["stream"], want["master"].to(torch.bfloat16))


def test_adamw8bit_maps_are_bitsandbytes(tmp_path):
    master, grads, steps = case8(1, "F32", 0.0)
    want, _ = run_bnb8(master, grads[:1], steps[:1], exact_sqrt=True)
    got, _ = run_rondo8(tmp_path, master, grads[:1], steps[:1])
    assert_equal_bits("qmap1 (signed)", got["qmap1"], want["qmap1"])
    assert_equal_bits("qmap2 (unsigned)", got["qmap2"], want["qmap2"])


@pytest.mark.parametrize("n", BNB_SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", ["F32", "BF16"])
def test_adamw8bit_matches_bitsandbytes_over_10_steps(n, weight_decay, grad_dtype, tmp_path):
    master, grads, steps = case8(n, grad_dtype, weight_decay)
    got, _ = run_rondo8(tmp_path, master, grads, steps, stream_dtype="BF16")
    want, _ = run_bnb8(master, grads, steps, exact_sqrt=True)
    assert_matches_bnb_exactly(got, want)
    shipped, trajectory = run_bnb8(master, grads, steps, exact_sqrt=False)
    for key in STATE8:
        assert_equal_bits(f"{key} (bitsandbytes as shipped)", got[key], shipped[key])
    err = (got["master"].double() - shipped["master"].double()).abs()
    bound = master_bound(trajectory)
    worst = int((err / bound.clamp_min(1e-45)).argmax())
    print(f"master against bitsandbytes as shipped: {int((err > 0).sum())} of {n} differ")
    assert bool((err <= bound).all()), (
        f"master: {int((err > bound).sum())} elements beyond the bound; worst at {worst}: rondo "
        f"{got['master'][worst].item()!r}, bitsandbytes {shipped['master'][worst].item()!r}, "
        f"bound {bound[worst].item():.3g}")


@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
def test_adamw8bit_every_simd_path_matches_bitsandbytes(simd, tmp_path):
    n = 4099 + 16 * 1024  # several tiles, a partial last block
    master, grads, steps = case8(n, "BF16", 0.01)
    try:
        got, path = run_rondo8(tmp_path, master, grads, steps, simd=simd)
    except Exception as e:  # noqa: BLE001 - the driver says why
        if "does not support" in str(e):
            pytest.skip(f"this CPU has no {simd}")
        raise
    assert path == simd
    want, _ = run_bnb8(master, grads, steps, exact_sqrt=True)
    assert_matches_bnb_exactly(got, want)


def test_adamw8bit_zero_gradient_block_and_small_beta1(tmp_path):
    """A block whose gradients are all zero keeps absmax 0 and code 0 (bitsandbytes' zero block);
    beta1 = 0.3 on the side."""
    master, grads, steps = case8(70_001, "F32", 0.1, beta1=0.3)
    for g in grads:
        g[256:512] = 0
    got, _ = run_rondo8(tmp_path, master, grads, steps)
    want, _ = run_bnb8(master, grads, steps, exact_sqrt=True)
    assert_matches_bnb_exactly(got, want)
    assert got["m_absmax"][1].item() == 0 and got["v_absmax"][1].item() == 0


def test_adamw8bit_chunks_and_resume_match_bitsandbytes(tmp_path):
    """Stepped in block-aligned chunks, stopped after 4 steps and resumed from the saved 8-bit
    state and master: bitsandbytes' 10 uninterrupted steps, bit for bit."""
    master, grads, steps = case8(70_001, "BF16", 0.1)
    first, _ = run_rondo8(tmp_path, master, grads[:4], steps[:4], chunk=1024)
    state = {key: first[key] for key in STATE8}
    got, _ = run_rondo8(tmp_path, first["master"], grads[4:], steps[4:], state=state,
                        chunk=256 * 37)
    want, _ = run_bnb8(master, grads, steps, exact_sqrt=True)
    assert_matches_bnb_exactly(got, want)
