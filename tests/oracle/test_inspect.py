"""`rondo inspect --json` against what transformers and safetensors say about the same folder."""
import json
import subprocess

import pytest
from safetensors import safe_open

from rondo_oracle import RONDO
from test_model_forward import VARIANTS, make_model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inspect_reports_what_transformers_sees(name, tmp_path):
    model = make_model(name, 7)
    model.save_pretrained(tmp_path / "m", max_shard_size="40KB")
    out = subprocess.run([RONDO, "inspect", "--json", str(tmp_path / "m")], capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
    cfg = model.config
    assert got["params"] == sum(p.numel() for p in model.parameters())  # tied counted once
    assert got["num_layers"] == cfg.num_hidden_layers
    assert got["num_kv_heads"] == cfg.num_key_value_heads
    # (Mixtral's config has head_dim None: hidden / heads.)
    assert got["head_dim"] == (getattr(cfg, "head_dim", None) or
                               cfg.hidden_size // cfg.num_attention_heads)
    # A token uses num_experts_per_tok of a sparse block's experts (transformers' fused expert
    # parameters); everything else always.
    experts = getattr(cfg, "num_local_experts", 0)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = got["params"] - (expert_params * (1 - cfg.num_experts_per_tok / experts)
                              if experts else 0)
    assert got["num_experts"] == experts
    assert got["active_params"] == pytest.approx(active, rel=1e-12)
    assert got["tie_word_embeddings"] == cfg.tie_word_embeddings
    stored = 0
    for f in (tmp_path / "m").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            stored += sum(st.get_tensor(k).nbytes for k in st.keys())
    assert got["bytes_stored"] == stored
    assert len(got["layers"]) == cfg.num_hidden_layers + 2


def test_inspect_of_a_missing_model_says_so(tmp_path):
    p = subprocess.run([RONDO, "inspect", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert p.returncode == 1
    assert "does not exist" in p.stderr and "nothing" in p.stderr
