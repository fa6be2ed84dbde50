"""A frozen LoRA base kept quantised (model.quantize), against independent references.

- What the devices compute with: rondo_oracle_driver quantised-base loads a model as a LoRA run
  does (the planner's placement, the run's loading) and writes every base tensor dequantised.
  NF4 (with and without double quantisation) equals bitsandbytes' dequantize_4bit(quantize_4bit(w))
  and INT8 equals bitsandbytes' int8_vectorwise_quant codes times absmax / 127, bit for bit (fp32);
  a GGUF base kept in Q4_0, Q4_1, Q8_0 (blocks from gguf-py's quantize), Q4_K or Q6_K (blocks from
  Rondo's quantiser, which gguf-py cannot make) equals gguf-py's dequantisation with llama.cpp's
  q/k row permutation undone. Everything else equals the checkpoint. The logits of each against
  the unquantised model are printed (the quantisation error, stated; 8-bit formats must err less
  than 4-bit ones).
- Training: `rondo train` LoRA on the same small model as a bf16 Hugging Face base, quantised to
  NF4 at load, and as a Q4_K GGUF: each learns, and each quantised loss curve stays within a stated
  margin of the bf16 one. The exported adapters load in peft onto the unquantised transformers
  model; with its weights replaced by the references' dequantisation, peft's logits equal Rondo's
  (rondo_oracle_driver run-logits: the run's own checkpoint and base) within 1e-4.
"""
import json
import os
import subprocess

import bitsandbytes.functional as bnbf
import gguf
import numpy as np
import peft
import pytest
import torch
import transformers as T
from safetensors.numpy import load_file

import tokenizer_builders as tb
from rondo_oracle import RONDO, driver
from test_gguf import (add_dimensions, gguf_name, llama_cpp_inverse_permute, llama_cpp_permute,
                       write_gguf)

QT = gguf.GGMLQuantizationType
SEED = int.from_bytes(os.urandom(4), "little")
QUANT_DRIVER = os.environ.get("RONDO_QUANT_DRIVER", "")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHATML = tb.CHATML
QA = [("hello", "hi there"), ("two plus two", "four"), ("colour of the sky", "blue"),
      ("opposite of hot", "cold"), ("a baby cat", "a kitten"), ("days in a week", "seven"),
      ("capital of France", "Paris"), ("bees make", "honey")]


def is_projection(name):
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small Llama (C = 256 so that every matrix holds whole K-quant blocks), saved in fp32 with
    a byte-level BPE tokenizer and ChatML."""
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    d = tmp_path_factory.mktemp("base")
    tok = tb.qwen2()
    tb.save_chatml(tok, d)
    cfg = T.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, tie_word_embeddings=False,
                        rms_norm_eps=1e-5, attn_implementation="eager")
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # weights of a trained model's scale; norms not all ones
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.05)
    model.save_pretrained(d, safe_serialization=True)
    return d, tok, model


def driver_base(model_path, quantize, tmp_path, double_quant=False):
    out = tmp_path / f"base-{quantize}-{int(double_quant)}.safetensors"
    driver("quantised-base", model_path, quantize, int(double_quant), out)
    return load_file(out)


def logits_with(model, tensors, tokens):
    m = T.LlamaForCausalLM(model.config).eval()
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    m.load_state_dict(sd, strict=True)
    with torch.no_grad():
        return m(input_ids=tokens).logits.float().numpy()


def quantisation_error(model, tensors, tokens):
    """RMS of (logits - logits of the unquantised model) / RMS of the unquantised logits, and the
    share of positions whose top token changes."""
    with torch.no_grad():
        want = model(input_ids=tokens).logits.float().numpy()
    got = logits_with(model, tensors, tokens)
    rms = float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))
    flips = float(np.mean(got.argmax(-1) != want.argmax(-1)))
    return rms, flips


def tokens_for(model):
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, model.config.vocab_size, (2, 17), generator=g)


def nf4_reference(w, double_quant, dtype=torch.float32):
    x = torch.from_numpy(w).to(dtype)
    q, state = bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4",
                                  compress_statistics=double_quant)
    return bnbf.dequantize_4bit(q, state).float().numpy()


def int8_reference(w, dtype=torch.float32):
    codes, absmax, _ = bnbf.int8_vectorwise_quant(torch.from_numpy(w).to(dtype))
    scale = (absmax.float() / 127.0).unsqueeze(1)
    return (codes.float() * scale).numpy()


@pytest.mark.parametrize("quantize,double_quant", [("nf4", False), ("nf4", True), ("int8", False)])
def test_hf_base_as_computed_equals_bitsandbytes(base, tmp_path, quantize, double_quant):
    d, _, model = base
    got = driver_base(d, quantize, tmp_path, double_quant)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(sd)
    for name, w in sd.items():
        if not is_projection(name):
            np.testing.assert_array_equal(got[name], w, err_msg=name)
            continue
        want = nf4_reference(w, double_quant) if quantize == "nf4" else int8_reference(w)
        assert got[name].dtype == np.float32
        bad = np.flatnonzero(got[name].view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, (f"{name}: {bad.size} of {w.size} differ, first at {bad[0]}: "
                               f"{got[name].ravel()[bad[0]]} vs {want.ravel()[bad[0]]} (seed {SEED})")


def rondo_k_quant(w, qtype, tmp_path):
    """Blocks of `w` (rows, cols) in Q4_K or Q6_K from Rondo's quantiser."""
    src, dst = tmp_path / "w.bin", tmp_path / "q.bin"
    np.ascontiguousarray(w, np.float32).tofile(src)
    subprocess.run([QUANT_DRIVER, "quantize", qtype.name, str(w.shape[0]), str(w.shape[1]), "f32",
                    str(src), str(dst)], check=True, capture_output=True)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.fromfile(dst, dtype=np.uint8).reshape(w.shape[0], w.shape[1] // block * size)


def write_model_gguf(model, tok, path, qtype, tmp_path):
    """`model` as llama.cpp's converter writes it (names, q/k permutation), every matrix in
    `qtype`, with its tokenizer and chat template; returns {hf name: what the GGUF stands for}."""
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    specials = set(tb.QWEN2_SPECIALS)
    merges = json.loads(tok.to_str())["model"]["merges"]

    def kv(w):
        add_dimensions(w, cfg, D)
        w.add_rope_dimension_count(D)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                           for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_eos_token_id(vocab["<|im_end|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)

    tensors, expected = [], {}
    for name, p in model.named_parameters():
        x = p.detach().float().numpy().copy()
        permute = H if ".q_proj." in name else KV if ".k_proj." in name else None
        stored = llama_cpp_permute(x, permute) if permute else x
        if stored.ndim == 2:
            q = (gguf.quants.quantize(stored, qtype) if qtype in (QT.Q4_0, QT.Q4_1, QT.Q8_0)
                 else rondo_k_quant(stored, qtype, tmp_path))
            tensors.append((gguf_name(name), q, qtype))
            back = gguf.quants.dequantize(q, qtype)
            expected[name] = llama_cpp_inverse_permute(back, permute) if permute else back
        else:
            tensors.append((gguf_name(name), stored, None))
            expected[name] = x
    write_gguf(path, "llama", tensors, kv=kv)
    return expected


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K],
                         ids=lambda q: q.name)
def test_gguf_base_as_computed_equals_gguf_py(base, tmp_path, qtype):
    _, tok, model = base
    path = tmp_path / f"model-{qtype.name}.gguf"
    expected = write_model_gguf(model, tok, path, qtype, tmp_path)
    got = driver_base(path, "gguf", tmp_path)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        want = np.ascontiguousarray(want, np.float32)
        bad = np.flatnonzero(got[name].view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, f"{name}: {bad.size} of {want.size} differ (seed {SEED})"


def test_logits_on_each_quantised_base_against_the_unquantised_model(base, tmp_path):
    """The quantisation error, stated: relative RMS error of the logits (and top-1 changes) of a
    model whose base is kept in each format, against the fp32 model (a random model of a trained
    one's weight scale: its logits are no larger than a trained model's, so the relative error is
    of the same order). 8-bit formats must err less than every 4-bit one."""
    d, tok, model = base
    tokens = tokens_for(model)
    errors = {}
    for quantize, dq in (("int8", False), ("nf4", False), ("nf4", True)):
        errors[quantize.upper() + (" + double quant" if dq else "")] = quantisation_error(
            model, driver_base(d, quantize, tmp_path, dq), tokens)
    for qtype in (QT.Q8_0, QT.Q6_K, QT.Q4_K, QT.Q4_1, QT.Q4_0):
        path = tmp_path / f"model-{qtype.name}.gguf"
        write_model_gguf(model, tok, path, qtype, tmp_path)
        errors[f"GGUF {qtype.name}"] = quantisation_error(model, driver_base(path, "gguf", tmp_path),
                                                          tokens)
    print("| base kept as | logits: relative RMS error | top-1 token changed |")
    print("|---|---|---|")
    for name, (rms, flips) in errors.items():
        print(f"| {name} | {rms:.4f} | {flips:.1%} |")
    eight = [errors["INT8"][0], errors["GGUF Q8_0"][0]]
    four = [errors[k][0] for k in ("NF4", "NF4 + double quant", "GGUF Q4_K", "GGUF Q4_1",
                                   "GGUF Q4_0")]
    assert max(eight) < min(four), errors
    assert errors["GGUF Q6_K"][0] < min(four), errors
    assert max(four) < 0.5, errors
    assert min(eight) > 0, errors


def rondo(*args):
    p = subprocess.run([RONDO, *map(str, args)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def train(tmp_path, model_path, name, quantize, data, steps, targets=("all-linear",),
          exports=("adapter",)):
    run = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f"""
[model]
path = "{model_path}"
dtype = "bf16"
quantize = "{quantize}"
[data]
train = "{data}"
seq_len = 64
[lora]
rank = 8
alpha = 16
targets = {json.dumps(list(targets))}
[training]
steps = {steps}
batch_rows = 2
grad_accum = 2
lr = 0.01
warmup_steps = 2
seed = 7
[hardware]
sim_devices = 2
[output]
run_dir = "{run}"
exports = {json.dumps(list(exports))}
""")
    rondo("train", cfg)
    events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()]
    plan = [e for e in events if e["type"] == "plan"][0]
    losses = [e["loss"] for e in events if e["type"] == "step"]
    return run, losses, plan


def peft_logits(model, base_tensors, adapter_dir, tokens):
    m = T.LlamaForCausalLM(model.config).eval()
    m.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
                       base_tensors.items()}, strict=True)
    with torch.no_grad():
        p = peft.PeftModel.from_pretrained(m, adapter_dir).eval()
        return p(input_ids=tokens).logits.float().numpy()


def bf16(x):
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).bfloat16().float().numpy()


def test_lora_on_quantised_bases_learns_and_loads_in_peft(base, tmp_path):
    d, tok, model = base
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in QA * 2))
    gguf_path = tmp_path / "model-Q4_K.gguf"
    gguf_expected = write_model_gguf(model, tok, gguf_path, QT.Q4_K, tmp_path)
    steps = 16
    ref_run, ref, _ = train(tmp_path, d, "bf16", "none", data, steps)
    nf4_run, nf4, nf4_plan = train(tmp_path, d, "nf4", "nf4", data, steps)
    q4k_run, q4k, q4k_plan = train(tmp_path, gguf_path, "q4k", "auto", data, steps)
    assert nf4_plan["placement"]["quantize"] == "nf4"
    assert q4k_plan["placement"]["quantize"] == "gguf"
    print("losses bf16", [round(x, 3) for x in ref])
    print("losses nf4 ", [round(x, 3) for x in nf4])
    print("losses q4k ", [round(x, 3) for x in q4k])
    for name, curve in (("bf16", ref), ("nf4", nf4), ("q4k", q4k)):
        assert len(curve) == steps
        assert np.mean(curve[-3:]) < 0.5 * np.mean(curve[:3]), f"{name} did not learn: {curve}"
    # The margin: the mean absolute difference of the curves, relative to the bf16 curve's mean.
    for name, curve in (("nf4", nf4), ("q4k", q4k)):
        gap = float(np.mean(np.abs(np.array(curve) - np.array(ref))) / np.mean(ref))
        print(f"{name}: loss curve within {gap:.3f} (mean |difference| / mean loss) of bf16")
        assert gap < 0.1, (name, gap)

    # The adapters load in peft onto the unquantised transformers model; with the base replaced by
    # the references' dequantisation (in the run's bf16), peft gives Rondo's logits.
    tokens = tokens_for(model)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    nf4_base = {k: (nf4_reference(w, False, torch.bfloat16) if is_projection(k) else bf16(w))
                for k, w in sd.items()}
    q4k_base = {k: bf16(w) for k, w in gguf_expected.items()}
    for run, reference in ((nf4_run, nf4_base), (q4k_run, q4k_base)):
        unquantised = peft_logits(model, sd, run / "adapter", tokens)  # it loads
        want = peft_logits(model, reference, run / "adapter", tokens)
        (tmp_path / "batch.json").write_text(json.dumps({"tokens": tokens.tolist()}))
        driver("run-logits", run, tmp_path / "batch.json", tmp_path / "rondo.safetensors")
        got = load_file(tmp_path / "rondo.safetensors")["logits"]
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
        print(f"{run.name}: peft on the unquantised base differs from the quantised by "
              f"{np.abs(unquantised - want).max() / scale:.4f} of the largest logit")


def test_lora_on_a_gpt_oss_base_kept_in_mxfp4_trains_as_on_its_dequantised_experts(tmp_path):
    """GPT-OSS with MXFP4 experts (as its official checkpoints, written here from the format's
    description): a LoRA run that keeps them in MXFP4 (model.quantize = stored: host memory and
    the link carry 17 bytes per 32 values, the devices dequantise) trains exactly as the run that
    dequantises them at load (quantize = none): the same losses, bit for bit. The adapters are on
    the attention and on the experts themselves (gate_up_proj, down_proj)."""
    from safetensors.torch import save_file
    from test_model_forward import mxfp4_encode
    torch.manual_seed(SEED)
    tok = tb.qwen2()
    d = tmp_path / "gpt-oss-mxfp4"
    tb.save_chatml(tok, d)
    config = T.GptOssConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=16, max_position_embeddings=256, rms_norm_eps=1e-5)
    model = T.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_encode(t.detach())
        else:
            tensors[name] = t.detach().contiguous()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    model.save_pretrained(tmp_path / "plain")  # for config.json as transformers writes it
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in QA))
    targets = ("all-linear", "gate_proj", "up_proj", "down_proj")
    kept_run, kept, kept_plan = train(tmp_path, d, "mxfp4", "stored", data, 4, targets,
                                      exports=("adapter", "merged"))
    _, dequantised, plain_plan = train(tmp_path, d, "dequantised", "none", data, 4, targets)
    assert kept_plan["placement"]["quantize"] == "stored"
    assert "MXFP4" in kept_plan["placement"]["formats"], kept_plan["placement"]
    assert plain_plan["placement"]["quantize"] == "none"
    print("losses", kept)
    assert len(kept) == 4 and kept == dequantised
    adapter = json.loads(next(kept_run.rglob("adapter_config.json")).read_text())
    assert adapter["target_parameters"] == ["gate_up_proj", "down_proj"], adapter
    # The merged checkpoint is dense: no MXFP4 quantization_config left for transformers to
    # expect blocks by, and transformers loads it.
    merged = kept_run / "merged"
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    T.GptOssForCausalLM.from_pretrained(merged)
