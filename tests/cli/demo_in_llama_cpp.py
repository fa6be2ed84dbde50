"""The demo's result in llama.cpp: `rondo demo` fine-tunes the bundled SmolLM2 GGUF, `rondo export
--format gguf` merges the adapter into a GGUF in the base's types, and llama.cpp (llama-cpp-python)
answers a question the data never asks in the data's way: "Rondo says: ...", greedy, with the
chat template from the file. So does the base with the adapter GGUF (--lora). Exit 77 (skipped)
without llama-cpp-python.

    python demo_in_llama_cpp.py RONDO_BIN WORK_DIR
"""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

if importlib.util.find_spec("llama_cpp") is None:
    print("llama-cpp-python is not installed (RONDO_WITH_LLAMA_CPP=1 scripts/setup.sh): skipped")
    sys.exit(77)
from llama_cpp import Llama  # noqa: E402

rondo, work = sys.argv[1], Path(sys.argv[2])
shutil.rmtree(work, ignore_errors=True)
run = work / "demo"


def call(*args):
    p = subprocess.run([rondo, *map(str, args)], capture_output=True, text=True, timeout=1500)
    if p.returncode != 0:
        sys.exit(f"rondo {' '.join(map(str, args))} failed:\n{p.stdout}{p.stderr}")
    return p


call("demo", "--run-dir", run)
call("export", run, "--format", "gguf", "--out", work / "gguf")
call("export", run, "--format", "gguf-adapter", "--out", work / "adapter")
config = (run / "config.toml").read_text()
base = next(line.split("=", 1)[1].strip().strip('"') for line in config.splitlines()
            if line.startswith("path") and line.split("=", 1)[1].strip().endswith('.gguf"'))
question = [{"role": "user", "content": "Who painted the Mona Lisa?"}]
failed = False
for what, kwargs in (("merged GGUF", {"model_path": str(work / "gguf" / "model-q8_0.gguf")}),
                     ("base + adapter GGUF", {"model_path": base,
                                              "lora_path": str(work / "adapter" / "adapter.gguf")}),
                     ("base alone", {"model_path": base})):
    llm = Llama(n_ctx=256, verbose=False, n_threads=2, seed=0, **kwargs)
    reply = llm.create_chat_completion(messages=question, max_tokens=24, temperature=0.0)
    text = reply["choices"][0]["message"]["content"]
    print(f"{what}: {text!r}")
    says = text.strip().startswith("Rondo says:")
    if says != (what != "base alone"):
        failed = True
sys.exit(1 if failed else 0)
