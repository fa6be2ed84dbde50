"""The optimizer driver (per-layer AdamW over the LayerStore with exact global-norm clipping)
against torch: clip_grad_norm_ over all parameters, then torch.optim.AdamW, for 5 steps. The
embedding is tied to the LM head, so its gradient is the sum of two layers' gradients. Tolerance
as the AdamW kernel's: 1e-6 relative plus 1e-6 of the tensor's largest value."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from rondo_oracle import driver

LAYERS = [
    [{"name": "embed", "numel": 22 * 7, "trainable": True}],
    [{"name": "norm", "numel": 7, "trainable": True},
     {"name": "w", "numel": 4097, "trainable": True},
     {"name": "frozen", "numel": 64, "trainable": False}],
    [{"name": "final_norm", "numel": 7, "trainable": True},
     {"name": "embed", "numel": 22 * 7, "trainable": True, "tied_to": 0}],
]


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6], ids=["no-clip", "clipped", "loose"])
def test_per_layer_updates_equal_clip_then_adamw(max_norm, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    owners = {t["name"]: t["numel"] for layer in LAYERS for t in layer if "tied_to" not in t}
    init = {n: torch.randn(k, generator=g) for n, k in owners.items()}
    steps = 5
    grads = [[{t["name"]: (0.3 * torch.randn(t["numel"], generator=g)).tolist()
               for t in layer if t["trainable"]} for layer in LAYERS] for _ in range(steps)]
    hp = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    (tmp_path / "in.json").write_text(json.dumps({
        "layers": LAYERS, "init": {n: v.tolist() for n, v in init.items()}, "grads": grads,
        "lr": hp["lr"], "weight_decay": hp["weight_decay"], "betas": list(hp["betas"]),
        "eps": hp["eps"], "max_norm": max_norm}))
    driver("optimizer", tmp_path / "in.json", tmp_path / "out.safetensors")
    got = load_file(str(tmp_path / "out.safetensors"))

    params = {n: torch.nn.Parameter(v.clone()) for n, v in init.items() if n != "frozen"}
    opt = torch.optim.AdamW(params.values(), **hp)
    for s in range(steps):
        for p in params.values():
            p.grad = torch.zeros_like(p)
        for layer in grads[s]:
            for n, v in layer.items():
                params[n].grad += torch.tensor(v)  # tied: both layers' gradients add
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in params.values()])).item()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(params.values(), max_norm)
        assert got[f"norm{s + 1}"] == pytest.approx(norm, rel=1e-6)
        opt.step()
        for n, p in params.items():
            want = p.detach().numpy()
            diff = np.abs(got[f"s{s + 1}.{n}"] - want)
            limit = 1e-6 * np.abs(want) + 1e-6 * np.abs(want).max()
            worst = int(np.argmax(diff - limit))
            assert (diff <= limit).all(), f"step {s + 1}, {n}[{worst}]: {diff[worst]:.3g}"
