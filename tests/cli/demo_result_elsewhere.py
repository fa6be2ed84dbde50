"""The demo's result where people run models: `rondo demo` fine-tunes the bundled SmolLM2 GGUF;
`rondo export --format merged` writes a Hugging Face folder (tokenizer and chat template rebuilt
from the GGUF) whose greedy reply in transformers to a question the data never asks answers in
the data's way, "Rondo says: ...". Where llama-cpp-python is installed (RONDO_WITH_LLAMA_CPP=1
scripts/setup.sh), so do llama.cpp with the merged GGUF (`--format gguf`) and with the base plus
the adapter GGUF (`--format gguf-adapter`), and the base alone does not.

    python demo_result_elsewhere.py RONDO_BIN WORK_DIR
"""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers as T

rondo, work = sys.argv[1], Path(sys.argv[2])
shutil.rmtree(work, ignore_errors=True)
run = work / "demo"
QUESTION = [{"role": "user", "content": "Who painted the Mona Lisa?"}]


def call(*args):
    p = subprocess.run([rondo, *map(str, args)], capture_output=True, text=True, timeout=1500)
    if p.returncode != 0:
        sys.exit(f"rondo {' '.join(map(str, args))} failed:\n{p.stdout}{p.stderr}")


call("demo", "--run-dir", run)
call("export", run, "--format", "merged", "--out", work / "merged")
failed = False
tok = T.AutoTokenizer.from_pretrained(work / "merged")
model = T.AutoModelForCausalLM.from_pretrained(work / "merged", dtype=torch.float32).eval()
ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                              return_dict=True)["input_ids"]
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
print(f"transformers, merged folder: {text!r}")
failed |= not text.strip().startswith("Rondo says:")

if importlib.util.find_spec("llama_cpp") is None:
    print("llama-cpp-python is not installed (RONDO_WITH_LLAMA_CPP=1 scripts/setup.sh): "
          "its part is skipped")
    sys.exit(1 if failed else 0)
from llama_cpp import Llama  # noqa: E402

call("export", run, "--format", "gguf", "--out", work / "gguf")
call("export", run, "--format", "gguf-adapter", "--out", work / "adapter")
config = (run / "config.toml").read_text()
base = next(line.split("=", 1)[1].strip().strip('"') for line in config.splitlines()
            if line.startswith("path") and line.split("=", 1)[1].strip().endswith('.gguf"'))
for what, kwargs in (("merged GGUF", {"model_path": str(work / "gguf" / "model-q8_0.gguf")}),
                     ("base + adapter GGUF", {"model_path": base,
                                              "lora_path": str(work / "adapter" / "adapter.gguf")}),
                     ("base alone", {"model_path": base})):
    llm = Llama(n_ctx=256, verbose=False, n_threads=2, seed=0, **kwargs)
    reply = llm.create_chat_completion(messages=QUESTION, max_tokens=24, temperature=0.0)
    text = reply["choices"][0]["message"]["content"]
    print(f"llama.cpp, {what}: {text!r}")
    failed |= text.strip().startswith("Rondo says:") != (what != "base alone")
sys.exit(1 if failed else 0)
