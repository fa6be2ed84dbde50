"""llama.cpp itself runs what Rondo exports: llama-cpp-python (compiled into the Python environment
by the opt-in `RONDO_WITH_LLAMA_CPP=1 scripts/setup.sh`) loads the merged GGUF of every type, and
the Q8_0 base with the adapter GGUF (`--lora`), and the merged GGUF of a Hugging Face base (with
and without Llama 3 rope scaling, whose rope_freqs.weight only llama.cpp reads), and its logits
are close to Rondo's with the trained state (rondo_oracle_driver run-logits). Skipped when
llama_cpp is not installed.

Tolerances (relative RMS error of the logits): llama.cpp computes with its own kernels, an f16
KV cache and, for quantised matrices, activations quantised to 8 bits, so its error on a file may
exceed transformers' on the same file: it must stay within twice that for the quantised types,
and within 2e-3 for f32 and f16. The adapter must bring the base within 5e-2 of Rondo's logits, and within a quarter of the
base's own error without it (the adapter is applied, with llama.cpp's scale and q/k order).
"""
import importlib.util

import numpy as np
import pytest
import torch
import transformers as T

from test_gguf_export import hf_trained, rel_rms, rondo, trained  # noqa: F401 (fixtures)

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (RONDO_WITH_LLAMA_CPP=1 scripts/setup.sh "
                "builds it into the Python environment)", allow_module_level=True)

from llama_cpp import Llama  # noqa: E402


def llama_logits(tokens, **kwargs):
    llm = Llama(n_ctx=64, logits_all=True, verbose=False, n_threads=2, **kwargs)
    out = []
    for row in tokens.tolist():
        llm.reset()
        llm.eval(row)
        out.append(np.array(llm.scores[:len(row)], np.float32))
    return np.stack(out)


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_k_m"])
def test_llama_cpp_runs_the_merged_gguf(trained, qtype):  # noqa: F811
    out = trained["dir"] / f"llama-{qtype}"
    rondo("export", trained["run"], "--format", "gguf", "--type", qtype, "--out", out)
    path = out / f"model-{qtype}.gguf"
    got = llama_logits(trained["tokens"], model_path=str(path))
    m = T.AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        hf = m.eval()(input_ids=trained["tokens"]).logits.float().numpy()
    err, hf_err = rel_rms(got, trained["logits"]), rel_rms(hf, trained["logits"])
    print(f"{qtype}: llama.cpp {err:.2e}, transformers {hf_err:.2e} (relative RMS against Rondo)")
    bound = 2e-3 if qtype in ("f32", "f16") else 2 * hf_err
    assert err < bound, (qtype, err, hf_err)


def test_llama_cpp_applies_the_adapter_gguf(trained):  # noqa: F811
    out = trained["dir"] / "llama-adapter"
    rondo("export", trained["run"], "--format", "gguf-adapter", "--out", out)
    base = llama_logits(trained["tokens"], model_path=str(trained["base"]))
    got = llama_logits(trained["tokens"], model_path=str(trained["base"]),
                       lora_path=str(out / "adapter.gguf"))
    err, base_err = rel_rms(got, trained["logits"]), rel_rms(base, trained["logits"])
    print(f"base + adapter: {err:.2e}; base alone: {base_err:.2e} (relative RMS against Rondo)")
    assert err < 5e-2, err
    assert err < base_err / 4, (err, base_err)


def test_llama_cpp_runs_the_gguf_of_a_hugging_face_base(hf_trained):  # noqa: F811
    """Logits within 2e-3 of Rondo's (f32), and llama.cpp's tokenizer built from the written
    metadata gives the Hugging Face tokenizer's ids on the hard strings, NFC-normalised first:
    llama.cpp's qwen2 pre-tokenizer does not normalise (so for any Qwen2 GGUF, text that is not
    NFC tokenizes differently from transformers)."""
    import random
    import unicodedata

    from test_tokenizer import HARD, random_strings
    out = hf_trained["dir"] / "llama-gguf"
    rondo("export", hf_trained["run"], "--format", "gguf", "--type", "f32", "--out", out)
    path = str(out / "model-f32.gguf")
    got = llama_logits(hf_trained["tokens"], model_path=path)
    err = rel_rms(got, hf_trained["logits"])
    print(f"{hf_trained['rope']} rope: llama.cpp {err:.2e} (relative RMS against Rondo)")
    assert err < 2e-3, err
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    for text in HARD + random_strings(random.Random(0), 50):
        text = unicodedata.normalize("NFC", text)
        want = hf_trained["tok"].encode(text).ids
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == want, text
