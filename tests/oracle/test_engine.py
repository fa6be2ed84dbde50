"""Rondo's engine against Hugging Face transformers + torch.optim.AdamW on the CPU: 3 optimizer
steps of a tiny random model, on the same data split into the same microbatches.

Rondo's side (driver `engine-train`) runs Engine::train on 1-3 simulated devices under a given plan
(forward stages, fused tail, backward stages with stage- or layer-grain recompute). The reference
is the transformers model in float32: per microbatch the logits from model(...) on packed rows,
the summed cross-entropy over the targets divided by the number of targets in the whole step's
batch, backward (gradients accumulate over the microbatches), then clip_grad_norm_ over all
parameters and torch.optim.AdamW.step(). The targets are computed here, independently of Rondo:
the next token inside the same document, none at each document's last token.

The dense variants (llama3, linear and YaRN rope, Mistral's window, Qwen2's max_window_layers,
Qwen3's layer_types) run on one two-device plan (VARIANTS); those with windows shorter than the
rows on rows of one document each, which the reference runs under the model's own mask.

Mixtures of experts (Qwen3-MoE, Mixtral, GPT-OSS) run with output_router_logits: the reference
adds, per microbatch, router_aux_loss_coef times transformers' own load_balancing_loss_func on the
routers' logits (taken with forward hooks) divided by the number of microbatches, Rondo's
definition (one microbatch is transformers' loss exactly).

Packed rows: each row holds two documents (doc_ids 0 then 1 from a random cut). transformers 5
takes a 4D attention mask as given (masking_utils returns a 4D mask as-is), so the reference passes
an additive (B, 1, T, T) mask that is causal and block-diagonal by document, and position_ids that
restart at 0 in each document; the eager attention adds it to the scores. A check below confirms
that on the reference itself: a packed row's logits equal each document run alone. (Given the
mask, restarting positions changes nothing in exact arithmetic, since rotary scores depend only on
position differences inside a document; the positions are passed for fidelity, and neither this
test nor the check can tell whether they restart.)

Compared: each step's loss (mean cross-entropy over the step's targets) and gradient norm (before
clipping) within 1e-5 relative (observed: <= 3e-7), the number of targets exactly, and every final
weight tensor elementwise with rtol 1e-5 and atol 1e-5 * max|ref| of that tensor.

Why those numbers. Both sides are float32 with different summation orders (Rondo's kernels, stage
boundaries, recompute, the chunked head vs. transformers' autograd graph), so gradients differ by
~1e-7..1e-6 of their scale. Weights move ~lr = 1e-3 per step (an Adam step is about lr), so an
error anywhere in the step moves every tensor far beyond the tolerance. Measured with a broken
reference, the worst element in units of the tolerance: weight decay left out 15, lr 1.1e-3 for
1e-3 230, clipping left out 80, one microbatch's backward left out 1600; exact reference 0.03.

Adam magnifies gradient noise where it divides by sqrt(v) + eps: in step 1 an update is
lr * g / (|g| + eps), whose slope at g = 0 is lr / eps, so an entry whose gradient happens to cancel
to ~0 (from terms of ~1e-2, with ~1e-8 of rounding noise) takes that noise times lr / eps into its
weight. Worst element as a fraction of max|ref| over 10-48 random runs per eps: eps 1e-6 up to
1.04e-5 (so the test failed now and then), eps 1e-5 up to 4.4e-6, eps 1e-4 up to 7.4e-7. Hence
eps = 1e-4: the worst rounding effect is ~14 times below the tolerance, while entries with real
gradients (1e-4..1e-1 here) still get Adam's usual near-unit steps.

GPT-OSS clamps its SwiGLU inputs; a draw whose reference puts one within 1e-6 of the clamp, where
~1e-7 of rounding decides whether it is clamped, is drawn again (CLAMP_MARGIN).

max_grad_norm is 0.7 of the step-1 gradient norm (a reference pass before the run), so clipping
is active at least in step 1.

After the three steps, Engine::evaluate (forward-only jobs on the same devices and plan) computes
the loss of an evaluation set of 5 microbatches of 2 rows (so batches of M microbatches with a
shorter last one), against the trained reference's cross-entropy over the same targets without the
router's auxiliary loss, within 1e-6 relative.
"""
import contextlib
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers as T
from safetensors.numpy import load_file

from rondo_oracle import driver
from test_model_forward import VARIANTS as FORWARD_VARIANTS

V = 64  # vocabulary
L = 3  # blocks: the layer list is [prefix, block_0, block_1, block_2, head], 5 layers
ROWS, SEQ, STEPS = 6, 12, 3
HP = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-4)
RTOL = 1e-5
EVAL_MICROBATCHES, EVAL_ROWS, EVAL_RTOL = 5, 2, 1e-6

FAMILIES = {
    "llama_gqa_untied": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2_tied_qkv_bias": (T.Qwen2ForCausalLM, T.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Mixture of experts with the router's load-balancing loss on (output_router_logits), its
    # coefficient large enough that its gradient shows in every router weight.
    "qwen3_moe_aux": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1],
        output_router_logits=True, router_aux_loss_coef=0.05)),
    "mixtral_aux": (T.MixtralForCausalLM, T.MixtralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.05)),
    # GPT-OSS: sinks, biases, fused experts; the clamp low enough that some gate and up values
    # pass it. Its windows are longer than the rows here: given a 4D mask (packed rows),
    # transformers applies it to the sliding layers as it is, without their window (the windows
    # are checked by test_model_forward).
    "gpt_oss_aux": (T.GptOssForCausalLM, T.GptOssConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=SEQ + 1, swiglu_limit=0.3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        output_router_logits=True, router_aux_loss_coef=0.05)),
}

# The dense variants (rope scalings, per-layer windows) on one plan of two devices with stage
# boundaries and a recomputed backward: what differs from their family is the forward, whose
# gradient the engine takes like any other. Windows shorter than the rows need rows of one
# document (transformers applies no window under a 4D mask), so those rows are not packed.
# Dynamic (NTK) rope is left out: training rows never pass max_position_embeddings
# (data.seq_len <= max_position_embeddings), where it is plain rope (test_model_forward checks it
# past that length). They are the models whose logits test_model_forward checks.
VARIANTS = {name: FORWARD_VARIANTS[name] for name in [
    "llama3_rope_scaling", "llama_linear_rope", "qwen2_yarn_rope", "qwen3_yarn_mscale",
    "mistral_sliding_window", "qwen2_window_layers", "qwen3_layer_types"]}
UNPACKED = {"mistral_sliding_window", "qwen2_window_layers", "qwen3_layer_types"}
VARIANT_PLAN = "2dev_stages_M2_stage"

# (devices, M, plan) over the 5 layers. The tail ends at 5 and holds the head; forward stages cover
# [0, tail begin) ascending, backward stages the same range descending (cut independently).
PLANS = {
    "1dev_whole_tail_M1": (1, 1, dict(forward=[], tail=[0, 5], backward=[], grain="stage")),
    "2dev_stages_M2_stage": (2, 2, dict(forward=[[0, 2], [2, 3]], tail=[3, 5],
                                        backward=[[1, 3], [0, 1]], grain="stage",
                                        head_chunk_tokens=5)),
    "3dev_stages_M3_layer": (3, 3, dict(forward=[[0, 1], [1, 2], [2, 4]], tail=[4, 5],
                                        backward=[[2, 4], [0, 2]], grain="layer")),
    "2dev_stages_M3_layer": (2, 3, dict(forward=[[0, 3]], tail=[3, 5],
                                        backward=[[2, 3], [1, 2], [0, 1]], grain="layer",
                                        head_chunk_tokens=7)),
    # Sequence tiling: the MLPs over tiles of 5 tokens (microbatches of 2 rows of 12), in the
    # forward stage, the fused tail and both grains of the backward.
    "2dev_stages_M3_tiled": (2, 3, dict(forward=[[0, 2], [2, 3]], tail=[3, 5],
                                        backward=[[2, 3], [0, 2]], grain="stage",
                                        mlp_tile_tokens=5)),
}


def make_model(family, seed):
    model_cls, config_cls, extra = {**FAMILIES, **VARIANTS}[family]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=V, hidden_size=32, intermediate_size=56, num_hidden_layers=L,
                        max_position_embeddings=64, rms_norm_eps=1e-5,
                        attn_implementation="eager", **extra)
    model = model_cls(config).eval()  # no dropout in these models; eval() only to be explicit
    with torch.no_grad():  # no zeros and no ones (biases, norms), and attention far from uniform
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def random_step(g, packed=True):
    """One step's global batch: tokens and doc_ids (ROWS, SEQ), two documents per row (one when
    not packed)."""
    tokens = torch.randint(0, V, (ROWS, SEQ), generator=g)
    doc_ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r in range(ROWS if packed else 0):
        cut = int(torch.randint(1, SEQ, (1,), generator=g))
        doc_ids[r, cut:] = 1
    return tokens, doc_ids


def split(t, m):
    """m microbatches of consecutive rows."""
    n = t.shape[0]
    return [t[n * i // m:n * (i + 1) // m] for i in range(m)]


def targets_of(tokens, doc_ids):
    """Next token inside the same document; -100 at each document's last token."""
    y = torch.full_like(tokens, -100)
    same = doc_ids[:, 1:] == doc_ids[:, :-1]
    y[:, :-1] = torch.where(same, tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
    return y


def packed_inputs(doc_ids):
    """An additive (B, 1, T, T) mask (causal, inside a document) and positions restarting at 0."""
    B, S = doc_ids.shape
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    mask = torch.zeros(B, 1, S, S)
    mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    pos = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for t in range(1, S):
            pos[b, t] = pos[b, t - 1] + 1 if doc_ids[b, t] == doc_ids[b, t - 1] else 0
    return mask, pos


def logits_of(model, tokens, doc_ids):
    return output_of(model, tokens, doc_ids).logits


def output_of(model, tokens, doc_ids):
    """The model's output; for a mixture of experts also `router_logits`, every router's logits
    in block order, taken with forward hooks: the model's own output_router_logits would compute
    its aux loss with our 4D mask flattened as if it were a 2D padding mask."""
    mask, pos = packed_inputs(doc_ids)
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    logits = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: logits.append(out[0]))
             for r in routers]
    if not doc_ids.any():  # one document per row: the model's own causal (and windowed) mask
        mask = None
    try:
        out = model(input_ids=tokens, attention_mask=mask, position_ids=pos,
                    output_router_logits=False) if routers else \
            model(input_ids=tokens, attention_mask=mask, position_ids=pos)
    finally:
        for h in hooks:
            h.remove()
    out.router_logits = tuple(logits)
    return out


def aux_loss_of(model, out):
    """transformers' own load_balancing_loss_func on the microbatch's router logits (no padding
    mask: every position counts, as in Rondo), times the coefficient."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    c = model.config
    assert len(out.router_logits) == sum(
        1 for m in model.modules() if type(m).__name__.endswith("TopKRouter"))
    return c.router_aux_loss_coef * load_balancing_loss_func(
        out.router_logits, c.num_local_experts, c.num_experts_per_tok, None)


def backward_step(model, step, m):
    """Accumulates the step's gradient over m microbatches; returns (mean loss, targets)."""
    tokens, doc_ids = step
    targets = targets_of(tokens, doc_ids)
    count = int((targets != -100).sum())
    total = 0.0
    aux_total = 0.0
    for tok, doc, y in zip(split(tokens, m), split(doc_ids, m), split(targets, m)):
        out = output_of(model, tok, doc)
        loss_sum = F.cross_entropy(out.logits.reshape(-1, V).float(), y.reshape(-1),
                                   reduction="sum", ignore_index=-100)
        loss = loss_sum / count
        if getattr(model.config, "output_router_logits", False):
            # Each microbatch's load-balancing loss counts 1 / m (Rondo's definition; one
            # microbatch is transformers' loss + coef * aux_loss exactly).
            aux = aux_loss_of(model, out) / m
            loss = loss + aux
            aux_total += aux.item()
        loss.backward()
        total += loss_sum.item()
    return total / count + aux_total, count


# GPT-OSS clamps its SwiGLU inputs (gate at +limit, up at +-limit); the test model's limit (0.3)
# is low so that the clamp acts. An input within rounding of the limit is clamped on one side and
# not on the other, and that element's gradient flips between its value and zero: seen as a step-2
# gradient norm 3e-5 off (seed 2162418404, every plan with M = 3; with limit 7 the same draw
# passes, and its routing margins were all above 2e-4). Rondo and transformers differ by ~1e-7
# relative there, so a draw whose reference comes within 1e-6 of the limit is drawn again.
CLAMP_MARGIN = 1e-6


@contextlib.contextmanager
def clamp_margin(model, margins):
    """Appends, for every GPT-OSS experts call and expert, the least distance of a gate or up
    input of the tokens routed to it from the clamp."""
    def hook(mod, args, out):
        with torch.no_grad():
            x = args[0].reshape(-1, mod.hidden_size)
            chosen = args[1].reshape(x.shape[0], -1)  # router_indices: (tokens, top-k)
            for e in range(mod.num_experts):
                rows = (chosen == e).any(-1)
                if not rows.any():
                    continue
                gu = x[rows] @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
                gate, up = gu[..., ::2], gu[..., 1::2]
                margins.append(min((gate - mod.limit).abs().min().item(),
                                   (up.abs() - mod.limit).abs().min().item()))
    hooks = [mod.register_forward_hook(hook) for mod in model.modules()
             if type(mod).__name__ == "GptOssExperts"]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def eval_loss(model, microbatches):
    """Cross-entropy summed over every target of the microbatches (float64), over their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, doc_ids in microbatches:
            y = targets_of(tokens, doc_ids)
            logits = logits_of(model, tokens, doc_ids)
            total += F.cross_entropy(logits.reshape(-1, V).double(), y.reshape(-1),
                                     reduction="sum", ignore_index=-100).item()
            count += int((y != -100).sum())
    return total / count, count


def reference(model, steps, m, max_norm):
    params = list(model.parameters())  # a tied LM head is the embedding: listed once
    opt = torch.optim.AdamW(params, **HP)
    out = []
    for step in steps:
        opt.zero_grad()
        loss, count = backward_step(model, step, m)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        opt.step()
        out.append((loss, norm, count))
    return out


def test_packed_mask_equals_documents_run_alone():
    """The reference's packed-row inputs (4D mask, restarting positions) do what they claim in
    transformers: each document's logits equal the document run alone."""
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    for family in FAMILIES:
        model = make_model(family, seed)
        tokens, doc_ids = random_step(g)
        with torch.no_grad():
            packed = logits_of(model, tokens, doc_ids)
            for r in range(ROWS):
                cut = int((doc_ids[r] == 0).sum())
                for a, b in ((0, cut), (cut, SEQ)):
                    alone = model(input_ids=tokens[r:r + 1, a:b]).logits[0]
                    diff = (packed[r, a:b] - alone).abs().max().item()
                    assert diff < 1e-5, f"{family} row {r} [{a},{b}): {diff:.3g}"


@pytest.mark.parametrize("family,plan_name",
                         [(f, p) for f in sorted(FAMILIES) for p in sorted(PLANS)] +
                         [(v, VARIANT_PLAN) for v in sorted(VARIANTS)])
def test_three_steps_match_transformers_and_adamw(family, plan_name, tmp_path):
    devices, m, plan = PLANS[plan_name]
    packed = family not in UNPACKED
    model_dir = tmp_path / "model"
    # Fresh every run (RONDO_ORACLE_SEED repeats a printed one). A draw whose reference puts a
    # clamped SwiGLU input within rounding of the clamp is drawn again (see clamp_margin).
    for attempt in range(8):
        seed = int(os.environ.get("RONDO_ORACLE_SEED") or int.from_bytes(os.urandom(4), "little"))
        print("seed", seed)
        model = make_model(family, seed)
        model.save_pretrained(model_dir)  # safetensors, float32
        g = torch.Generator().manual_seed(seed)
        steps = [random_step(g, packed) for _ in range(STEPS)]

        # Clipping active in step 1: max_norm below that step's gradient norm (a dry pass).
        model.zero_grad()
        backward_step(model, steps[0], m)
        max_norm = 0.7 * torch.nn.utils.clip_grad_norm_(list(model.parameters()),
                                                        float("inf")).item()
        model.zero_grad()
        # The reference trains the model in memory; Rondo reads the folder saved above.
        margins = []
        with clamp_margin(model, margins):
            ref = reference(model, steps, m, max_norm)
        if margins:
            print(f"least distance of a SwiGLU input from the clamp: {min(margins):.2g}")
        if os.environ.get("RONDO_ORACLE_SEED") or min(margins, default=1.0) >= CLAMP_MARGIN:
            break
        print("drawn again")
    else:
        pytest.fail("8 draws in a row put a SwiGLU input at the clamp")
    evaluation = []
    for _ in range(EVAL_MICROBATCHES):
        tokens, doc_ids = random_step(g, packed)
        evaluation.append((tokens[:EVAL_ROWS], doc_ids[:EVAL_ROWS]))
    ref_eval = eval_loss(model, evaluation)  # the trained reference

    (tmp_path / "in.json").write_text(json.dumps({
        "microbatches": [[{"tokens": t.tolist(), "doc_ids": d.tolist()}
                          for t, d in zip(split(tokens, m), split(doc_ids, m))]
                         for tokens, doc_ids in steps],
        **plan, "devices": devices, "lr": HP["lr"], "weight_decay": HP["weight_decay"],
        "betas": list(HP["betas"]), "eps": HP["eps"], "max_grad_norm": max_norm,
        "eval": [{"tokens": t.tolist(), "doc_ids": d.tolist()} for t, d in evaluation]}))
    driver("engine-train", model_dir, tmp_path / "in.json", tmp_path / "out.safetensors",
           timeout=120)  # ~1 s; a hang in the engine fails here
    got = load_file(str(tmp_path / "out.safetensors"))

    for s, (loss, norm, count) in enumerate(ref, 1):
        assert int(got[f"targets{s}"][0]) == count, f"step {s}: targets"
        assert float(got[f"loss{s}"][0]) == pytest.approx(loss, rel=RTOL), f"step {s}: loss"
        assert float(got[f"norm{s}"][0]) == pytest.approx(norm, rel=RTOL), f"step {s}: norm"
        print(f"step {s}: loss {loss:.6f} rel diff {abs(got[f'loss{s}'][0] / loss - 1):.2g}, "
              f"norm {norm:.4g} rel diff {abs(got[f'norm{s}'][0] / norm - 1):.2g}, "
              f"clipped to {max_norm:.4g}")

    assert int(got["eval_targets"][0]) == ref_eval[1], "evaluation: targets"
    assert float(got["eval_loss"][0]) == pytest.approx(ref_eval[0], rel=EVAL_RTOL), "evaluation"
    print(f"evaluation: loss {ref_eval[0]:.6f} rel diff {abs(got['eval_loss'][0] / ref_eval[0] - 1):.2g}")

    # The reference's weights as its checkpoint names them (transformers writes fused experts
    # back as one module per expert); a tied LM head is not written.
    model.save_pretrained(tmp_path / "reference")
    want_all = load_file(str(tmp_path / "reference" / "model.safetensors"))
    initial = load_file(str(model_dir / "model.safetensors"))
    weights = {n for n in got if not n.startswith(("loss", "norm", "targets", "eval_"))}
    assert weights == set(want_all)
    worst = 0.0
    for name, want in want_all.items():
        scale = np.abs(want).max()
        moved = np.abs(want - initial[name]).max()
        assert moved > 1e-3 * scale, f"{name} hardly moved ({moved:.3g})"
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=RTOL * scale, err_msg=name)
        worst = max(worst, np.abs(got[name] - want).max() / scale)
    print(f"largest weight difference / max|ref|: {worst:.3g}")
