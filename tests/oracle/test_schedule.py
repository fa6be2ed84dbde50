"""Learning-rate schedules against transformers' schedulers as the Trainer drives them (optimizer
step, then scheduler step): the learning rate of every optimizer step, for constant, linear and
cosine (with and without a floor) schedules with and without warmup, within 1e-12 relative."""
import json

import numpy as np
import pytest
import torch
import transformers as T

from rondo_oracle import driver


def reference(kind, lr, warmup, total, min_lr_ratio):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    if kind == "constant":
        sched = T.get_constant_schedule_with_warmup(opt, warmup)
    elif kind == "linear":
        sched = T.get_linear_schedule_with_warmup(opt, warmup, total)
    elif min_lr_ratio > 0:
        sched = T.get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total,
                                                              min_lr_rate=min_lr_ratio)
    else:
        sched = T.get_cosine_schedule_with_warmup(opt, warmup, total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])  # what this optimizer step uses
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("kind,warmup,total,min_lr_ratio", [
    ("constant", 0, 7, 0.0), ("constant", 3, 9, 0.0),
    ("linear", 0, 10, 0.0), ("linear", 4, 25, 0.0), ("linear", 1, 1, 0.0),
    ("cosine", 0, 10, 0.0), ("cosine", 5, 100, 0.0), ("cosine", 5, 100, 0.1),
    ("cosine", 10, 10, 0.0),
])
def test_learning_rate_per_step_equals_transformers(kind, warmup, total, min_lr_ratio, tmp_path):
    lr = 3e-4
    (tmp_path / "in.json").write_text(json.dumps(dict(
        kind=kind, lr=lr, warmup=warmup, total=total, min_lr_ratio=min_lr_ratio)))
    driver("lr-schedule", tmp_path / "in.json", tmp_path / "out.json")
    got = json.loads((tmp_path / "out.json").read_text())["lr"]
    want = reference(kind, lr, warmup, total, min_lr_ratio)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-18)
