"""GGUF exports (`rondo export --format gguf | gguf-adapter`) against independent readers.

A small Llama (C = 256 so that every matrix holds whole K-quant blocks) is written as a Q8_0 GGUF
the way llama.cpp's converter writes it (test_quantised_base.write_model_gguf: names, q/k row
permutation, byte-level BPE tokenizer, ChatML template). `rondo train` fine-tunes it with LoRA, and
Rondo's own logits with the trained state come from rondo_oracle_driver run-logits (the run's
config and checkpoint, not an exported file).

- The adapter GGUF: gguf-py reads it; its metadata is llama.cpp's adapter layout; applied with
  llama.cpp's semantics (W + alpha / r * B A in ggml's layout, r from lora_b, as
  llama_adapter_lora_weight::get_scale) to gguf-py's dequantisation of the base, with llama.cpp's
  q/k permutation undone, a transformers LlamaForCausalLM gives Rondo's logits within 1e-4.
- The merged Hugging Face folder (tokenizer rebuilt from the GGUF) and the PEFT adapter: transformers
  and peft load them with Rondo's logits; the tokenizer gives the original tokenizer's ids.
- The merged GGUF in every type: gguf-py reads it; the tokenizer, chat template and architecture
  keys are the base's. Every tensor equals the merged weight (the f32 export, itself within 1e-5 of
  Rondo's logits) as an independent quantiser makes it: numpy's f16, torch's bf16, gguf-py's Q8_0,
  bit for bit; Q4_K and Q6_K (which gguf-py cannot make) lie within a relative RMS error of 0.12
  and 0.03. transformers loads the file (gguf_file=: its own reader, dequantiser and q/k
  permutation) with the logits of those weights within 1e-4, and the error each type adds to
  Rondo's logits is printed and bounded (relative RMS: f32 1e-5, f16 2e-3, bf16 2e-2, q8_0 5e-2,
  base (Q8_0 here) 5e-2; q4_k_m: less than gguf-py's Q4_0 of the same weights).
"""
import json
import subprocess

import gguf
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.numpy import load_file

import tokenizer_builders as tb
from rondo_oracle import RONDO, driver
from test_gguf import gguf_name, llama_cpp_inverse_permute, llama_cpp_permute
from test_quantised_base import CHATML, QA, SEED, write_model_gguf

QT = gguf.GGMLQuantizationType
# The relative RMS error of the logits a type may add (a random model of a trained one's weight
# scale; test_quantised_base states the same errors for bases kept in these types).
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 2e-2, "q8_0": 5e-2, "base": 5e-2}


def rondo(*args):
    p = subprocess.run([RONDO, *map(str, args)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def small_llama(tok, **config):
    """A small Llama (C = 256: whole K-quant blocks) with weights of a trained model's scale."""
    cfg = T.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        rms_norm_eps=1e-5, attn_implementation="eager", **config)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.05)
    return model


def train_lora(d, base, steps, exports, vocab):
    """`rondo train` LoRA on `base` with the QA chat data in folder d, and Rondo's logits with the
    trained state for fresh tokens (rondo_oracle_driver run-logits)."""
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in QA))
    run = d / "run"
    (d / "run.toml").write_text(f"""
[model]
path = "{base}"
dtype = "fp32"
[data]
train = "{data}"
seq_len = 64
[lora]
rank = 8
alpha = 16
[training]
steps = {steps}
batch_rows = 2
lr = 0.01
warmup_steps = 1
seed = 7
[output]
run_dir = "{run}"
exports = {json.dumps(exports)}
""")
    rondo("train", d / "run.toml")
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab, (2, 17), generator=g)
    (d / "batch.json").write_text(json.dumps({"tokens": tokens.tolist()}))
    driver("run-logits", run, d / "batch.json", d / "rondo.safetensors")
    return run, tokens, load_file(d / "rondo.safetensors")["logits"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    print(f"seed {SEED}")
    torch.manual_seed(SEED)
    d = tmp_path_factory.mktemp("gguf-export")
    tok = tb.qwen2()
    model = small_llama(tok, vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    base = d / "base-Q8_0.gguf"
    base_tensors = write_model_gguf(model, tok, base, QT.Q8_0, d)  # {hf name: dequantised}
    run, tokens, logits = train_lora(d, base, 6, ["gguf-adapter", "gguf"], tok.get_vocab_size())
    return dict(dir=d, base=base, base_tensors=base_tensors, model=model, run=run, tok=tok,
                tokens=tokens, logits=logits)


def logits_with(config, tensors, tokens):
    m = T.LlamaForCausalLM(config).eval()
    m.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, np.float32))
                       for k, v in tensors.items()}, strict=True)
    with torch.no_grad():
        return m(input_ids=tokens).logits.float().numpy()


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


def test_adapter_gguf_is_llama_cpp_layout_and_gives_rondo_logits(trained):
    out = trained["dir"] / "gguf-adapter"
    rondo("export", trained["run"], "--format", "gguf-adapter", "--out", out)
    r = gguf.GGUFReader(str(out / "adapter.gguf"))
    assert field(r, "general.architecture") == "llama"
    assert field(r, "general.type") == "adapter"
    assert field(r, "adapter.type") == "lora"
    alpha = field(r, "adapter.lora.alpha")
    assert alpha == pytest.approx(16.0)
    cfg = trained["model"].config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    pairs = {}
    for t in r.tensors:
        assert t.tensor_type == QT.F32, t.name
        stem, part = t.name.rsplit(".", 1)
        pairs.setdefault(stem, {})[part] = np.array(t.data, np.float32)
    # all-linear: seven projections in each of the two blocks
    assert len(pairs) == 14, sorted(pairs)
    gguf_to_hf = {gguf_name(hf): hf for hf in trained["base_tensors"]}
    tensors = {k: np.array(v, np.float32) for k, v in trained["base_tensors"].items()}
    for stem, ab in pairs.items():
        a, b = ab["lora_a"], ab["lora_b"]  # numpy shapes: ne reversed, (r, in) and (out, r)
        rank = b.shape[1]  # ggml's b->ne[0]
        assert a.shape[0] == rank == 8, stem
        delta = (alpha / rank) * (b.astype(np.float64) @ a.astype(np.float64))  # ggml row order
        hf = gguf_to_hf[stem]
        heads = H if ".q_proj." in hf else KV if ".k_proj." in hf else None
        if heads:
            delta = llama_cpp_inverse_permute(delta, heads)
        assert delta.shape == tensors[hf].shape, stem
        assert np.abs(delta).max() > 0, f"{stem}: the adapter learned nothing"
        tensors[hf] = (tensors[hf] + delta).astype(np.float32)
    want = logits_with(cfg, tensors, trained["tokens"])
    got = trained["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # A permutation mistake is caught: the same with q/k left in ggml's order differs.
    assert not np.allclose(llama_cpp_permute(tensors["model.layers.0.self_attn.q_proj.weight"], H),
                           tensors["model.layers.0.self_attn.q_proj.weight"])


def rel_rms(got, want):
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16", "q8_0", "q4_k_m", "base"])
def test_merged_gguf_loads_in_transformers_with_rondo_logits(trained, qtype):
    out = trained["dir"] / f"gguf-{qtype}"
    rondo("export", trained["run"], "--format", "gguf", "--type", qtype, "--out", out)
    path = out / f"model-{qtype}.gguf"
    r = gguf.GGUFReader(str(path))
    base = gguf.GGUFReader(str(trained["base"]))
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template", "llama.block_count",
                "llama.attention.head_count_kv", "llama.rope.freq_base"):
        assert field(r, key) == field(base, key), key
    types = {t.name: t.tensor_type for t in r.tensors}
    assert sorted(types) == sorted(t.name for t in base.tensors)
    for name, t in types.items():
        if name.endswith("_norm.weight"):
            assert t == QT.F32, name
    if qtype == "q4_k_m":
        # llama.cpp's mix for 2 layers: Q6_K output and layer 1's attn_v / ffn_down, Q4_K else
        assert types["output.weight"] == QT.Q6_K
        assert types["blk.1.attn_v.weight"] == QT.Q6_K
        assert types["blk.1.ffn_down.weight"] == QT.Q6_K
        assert types["blk.0.attn_v.weight"] == QT.Q4_K
        assert types["blk.0.attn_q.weight"] == QT.Q4_K
    expect_type = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0,
                   "base": QT.Q8_0}.get(qtype)
    if expect_type is not None:
        assert types["blk.0.attn_q.weight"] == expect_type

    # Each tensor against the merged weight it stands for (the f32 export's, whose logits are
    # Rondo's within 1e-5), quantised by an independent quantiser where there is one: numpy's f16,
    # torch's bf16, gguf-py's Q8_0 (bit for bit). gguf-py cannot make Q4_K or Q6_K blocks: those
    # must lie within a relative RMS error of 0.12 and 0.03 of the weight.
    f32 = trained["dir"] / "gguf-f32" / "model-f32.gguf"
    if not f32.exists():
        rondo("export", trained["run"], "--format", "gguf", "--type", "f32", "--out", f32.parent)
    exact = {t.name: np.array(t.data, np.float32) for t in gguf.GGUFReader(str(f32)).tensors}
    cfg = trained["model"].config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    reference = {}
    for t in r.tensors:
        got = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        want = exact[t.name].reshape(got.shape)
        if t.tensor_type == QT.F32:
            assert np.array_equal(got, want), t.name
        elif t.tensor_type == QT.F16:
            assert np.array_equal(got, want.astype(np.float16).astype(np.float32)), t.name
        elif t.tensor_type == QT.BF16:
            assert np.array_equal(got, torch.from_numpy(want).bfloat16().float().numpy()), t.name
        elif t.tensor_type == QT.Q8_0:
            ref = gguf.quants.quantize(want, QT.Q8_0)
            assert np.array_equal(np.array(t.data).reshape(ref.shape), ref), t.name
        else:
            assert t.tensor_type in (QT.Q4_K, QT.Q6_K), (t.name, t.tensor_type)
            bound = 0.12 if t.tensor_type == QT.Q4_K else 0.03
            assert rel_rms(got, want) < bound, (t.name, rel_rms(got, want))
        reference[t.name] = got
    def logits_of(tensors):  # by GGUF name, in ggml's row order
        hf = {}
        for name in trained["base_tensors"]:
            x = tensors[gguf_name(name)]
            heads = H if ".q_proj." in name else KV if ".k_proj." in name else None
            hf[name] = llama_cpp_inverse_permute(x, heads) if heads else x
        return logits_with(cfg, hf, trained["tokens"])

    want = logits_of(reference)

    # transformers reads the file as those weights: its own GGUF loader, dequantiser and q/k
    # permutation.
    m = T.AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        got = m.eval()(input_ids=trained["tokens"]).logits.float().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # The type's own error, against Rondo's logits with the trained state, stated.
    err = rel_rms(got, trained["logits"])
    print(f"{qtype}: logits relative RMS error against Rondo's {err:.2e}")
    if qtype == "q4_k_m":
        # No fixed figure: the mix must err less than the plainest 4-bit type, gguf-py's Q4_0 of
        # the same weights.
        q4_0 = {n: gguf.quants.dequantize(gguf.quants.quantize(x, QT.Q4_0), QT.Q4_0)
                if x.ndim == 2 else x for n, x in exact.items()}
        q4_0_err = rel_rms(logits_of(q4_0), trained["logits"])
        print(f"gguf-py Q4_0 of the same weights: {q4_0_err:.2e}")
        assert err < q4_0_err, (err, q4_0_err)
    else:
        assert err < TOLERANCE[qtype], (qtype, err)


def test_merged_hf_folder_from_a_gguf_base(trained):
    """--format merged of a GGUF base: a Hugging Face folder (config, generation config, tokenizer
    rebuilt from the GGUF's metadata) that transformers loads with Rondo's logits (fp32, 1e-4),
    whose tokenizer gives the ids of the tokenizer the GGUF was made from (`tokenizers`; Qwen2's
    NFC and split regex, which transformers' own GGUF tokenizer conversion drops) and its chat
    template."""
    import random

    from test_tokenizer import HARD, random_strings
    out = trained["dir"] / "merged"
    rondo("export", trained["run"], "--format", "merged", "--out", out)
    m = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = m(input_ids=trained["tokens"]).logits.float().numpy()
    want = trained["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    ours = T.AutoTokenizer.from_pretrained(out)
    for text in HARD + random_strings(random.Random(SEED), 100):
        ids = ours(text)["input_ids"]
        assert ids == trained["tok"].encode(text).ids, (SEED, text)
        assert ours.decode(ids) == trained["tok"].decode(ids, skip_special_tokens=False), text
    assert ours.chat_template == CHATML and ours.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(chat, tokenize=False) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"


def test_peft_adapter_of_a_gguf_base_loads_onto_transformers_gguf_model(trained):
    """The PEFT adapter of a GGUF base: peft loads it onto the base as transformers reads the GGUF
    (gguf_file=), with Rondo's logits (1e-4); with no repository named in the GGUF's metadata,
    base_model_name_or_path is the file."""
    import peft
    out = trained["dir"] / "peft"
    rondo("export", trained["run"], "--format", "adapter", "--out", out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(trained["base"])
    base = trained["base"]
    m = T.AutoModelForCausalLM.from_pretrained(base.parent, gguf_file=base.name,
                                               dtype=torch.float32)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(m, out).eval()(
            input_ids=trained["tokens"]).logits.float().numpy()
    want = trained["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_run_exports_equal_rondo_export_of_its_last_checkpoint(trained):
    """output.exports writes from the run's state at the end; `rondo export` from its last
    checkpoint: the same bytes."""
    run, d = trained["run"], trained["dir"]
    rondo("export", run, "--format", "gguf-adapter", "--out", d / "again-adapter")
    rondo("export", run, "--format", "gguf", "--out", d / "again-gguf")
    assert (run / "gguf-adapter" / "adapter.gguf").read_bytes() == \
        (d / "again-adapter" / "adapter.gguf").read_bytes()
    assert (run / "gguf" / "model-q8_0.gguf").read_bytes() == \
        (d / "again-gguf" / "model-q8_0.gguf").read_bytes()


def test_full_run_on_a_gguf_base_exports_a_gguf(trained):
    """A full fine-tune of a GGUF base exports a merged GGUF (Q8_0) by default, which
    transformers loads with Rondo's logits within Q8_0's error."""
    d = trained["dir"]
    cfg = (d / "run.toml").read_text().replace('[lora]\nrank = 8\nalpha = 16\n', '')
    cfg = cfg.replace('exports = ["gguf-adapter", "gguf"]\n', '')
    cfg = cfg.replace(f'run_dir = "{trained["run"]}"', f'run_dir = "{d / "full"}"')
    cfg = cfg.replace("[training]\n", '[training]\nmethod = "full"\n').replace("lr = 0.01", "lr = 1e-4")
    (d / "full.toml").write_text(cfg)
    rondo("train", d / "full.toml")
    path = d / "full" / "gguf" / "model-q8_0.gguf"
    r = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in r.tensors} == {QT.Q8_0, QT.F32}
    driver("run-logits", d / "full", d / "batch.json", d / "full.safetensors")
    rondo_logits = load_file(d / "full.safetensors")["logits"]
    assert rel_rms(rondo_logits, trained["logits"]) > 1e-3  # the full run changed the model
    m = T.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               dtype=torch.float32)
    with torch.no_grad():
        got = m.eval()(input_ids=trained["tokens"]).logits.float().numpy()
    err = rel_rms(got, rondo_logits)
    print(f"full run, exported in the base's Q8_0: logits relative RMS error {err:.2e}")
    assert err < TOLERANCE["base"], err


def test_gguf_exports_refuse_what_they_cannot_write(trained):
    p = subprocess.run([RONDO, "export", str(trained["run"]), "--format", "adapter", "--type",
                        "q8_0"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "--type" in p.stderr, p.stderr


@pytest.fixture(scope="module", params=["default", "llama3"])
def hf_trained(request, tmp_path_factory):
    """A small Llama saved as a Hugging Face folder (Qwen2-style byte-level tokenizer, ChatML),
    with default or Llama 3 rope scaling, fine-tuned with LoRA by `rondo train`."""
    torch.manual_seed(SEED)
    d = tmp_path_factory.mktemp(f"hf-{request.param}")
    tok = tb.qwen2()
    base = d / "base"
    tb.save_chatml(tok, base)
    rope = None
    if request.param == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
    model = small_llama(tok, vocab_size=tok.get_vocab_size() + 6,  # 6 padding rows
                        tie_word_embeddings=True, rope_scaling=rope)
    model.save_pretrained(base, safe_serialization=True)
    run, tokens, logits = train_lora(d, base, 4, [], tok.get_vocab_size())
    return dict(dir=d, base=base, run=run, tok=tok, model=model, rope=request.param,
                tokens=tokens, logits=logits)


def test_merged_gguf_from_a_hugging_face_base(hf_trained):
    """--format gguf of a Hugging Face base: llama.cpp's metadata written here (architecture keys,
    the tokenizer in id order with padding tokens for the embedding's extra rows, its merges,
    llama.cpp's name for its pre-tokenizer, the chat template; rope_freqs.weight for Llama 3 rope
    scaling equal to llama.cpp's converter's formula), read by gguf-py; with default rope,
    transformers loads the file with Rondo's logits (f32: 1e-4)."""
    from test_gguf import llama3_rope_freqs
    d, tok = hf_trained["dir"], hf_trained["tok"]
    out = d / "gguf"
    rondo("export", hf_trained["run"], "--format", "gguf", "--type", "f32", "--out", out)
    path = out / "model-f32.gguf"
    r = gguf.GGUFReader(str(path))
    cfg = hf_trained["model"].config
    assert field(r, "general.architecture") == "llama"
    assert field(r, "llama.block_count") == 2 and field(r, "llama.embedding_length") == 256
    assert field(r, "llama.attention.head_count_kv") == 2
    assert field(r, "llama.context_length") == 256
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "qwen2"
    vocab = tok.get_vocab(with_added_tokens=True)
    want = sorted(vocab, key=vocab.get) + [f"[PAD{i}]" for i in range(len(vocab), cfg.vocab_size)]
    assert field(r, "tokenizer.ggml.tokens") == want
    merges = json.loads(tok.to_str())["model"]["merges"]
    assert field(r, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m)
                                                  for m in merges]
    types = field(r, "tokenizer.ggml.token_type")
    assert types[vocab["<|im_end|>"]] == 3 and types[vocab["a"]] == 1 and types[-1] == 5
    assert field(r, "tokenizer.ggml.eos_token_id") == vocab["<|im_end|>"]
    assert field(r, "tokenizer.chat_template") == CHATML
    names = {t.name for t in r.tensors}
    assert "output.weight" not in names  # tied
    if hf_trained["rope"] == "llama3":
        freqs = next(t for t in r.tensors if t.name == "rope_freqs.weight")
        np.testing.assert_allclose(np.array(freqs.data), llama3_rope_freqs(
            {"rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, 64), rtol=1e-6)
        return  # transformers' GGUF loader does not read rope_freqs: test_llama_cpp.py runs it
    assert "rope_freqs.weight" not in names
    m = T.AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        got = m.eval()(input_ids=hf_trained["tokens"]).logits.float().numpy()
    want_logits = hf_trained["logits"]
    np.testing.assert_allclose(got, want_logits, rtol=0, atol=1e-4 * np.abs(want_logits).max())
