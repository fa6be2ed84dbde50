"""Rondo's tokenizer against the `tokenizers` library: for each tokenizer type (GPT-2 and SmolLM byte-level, Llama 3
byte-level with ignore_merges, Qwen2 byte-level with NFC, SentencePiece-style BPE as Llama 2 and
Mistral build it), the ids of a corpus of hard strings and of fresh random strings, with and
without the post-processor's special tokens, decodes, and decodes of random id lists."""
import json
import os
import random
import sys
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer

sys.path.insert(0, os.path.dirname(__file__))
import rondo_oracle  # noqa: E402
import tokenizer_builders as tb  # noqa: E402

HARD = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n \n", "   leading", "trailing   ", "a  b   c    d",
    "tab\tsep\t\tx", "mixed \t \n \r\n  ws\n", " " * 300, "x" + "\n" * 7 + "y",
    "Hello, world!", "I'm can't won't they'll we've you'd SHE'S HE'D", "'S 'T 'RE 'Ve 'ſ 'K",
    "1", "12", "123", "1234", "12345678901234567890", "3.14159", "1,000,000", "v1.2.3-rc4", "9" * 500,
    "٣٤٥ ①②③ Ⅻ ½", "Привет, мир!", "你好，世界", "こんにちは世界", "안녕하세요", "مرحبا بالعالم",
    "नमस्ते दुनिया", "Γειά σου Κόσμε", "שלום עולם", "ภาษาไทย", "ꯃꯤꯇꯩ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "e\u0301 é A\u030a Å n\u0303 ñ a\u0323\u0307 a\u0307\u0323 \u1100\u1161\u11a8 각", "Z\u0351\u0364\u036b\u0300",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇩🇪", "I ❤️ NY", "1️⃣ #️⃣", "🫠🫶",
    "def f(x):\n    return x**2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "<html><body class=\"x\">&nbsp;</body></html>", "ls -la | grep '^d' > out.txt 2>&1",
    "{\"a\": [1, 2.5e-3, null], \"b\": \"\\u00e9\"}", "x==y!=z<=w>=v->u::t...s???r!!!",
    "Hello<|endoftext|>world", "<|im_start|>user\nHi<|im_end|>\n", "a <s> b </s> c", "<s><s></s>",
    "<unk>", "a <unk> b", "x<unk><unk>y",
    "<|endoftext", "<|im_start|", "<|begin_of_text|>Hi<|eot_id|>", "[INST] Hi [/INST]",
    "a <mask> b", "<mask>", "a<mask>b", "x <sw> y", "x<sw>y", "<sw>", "call <tool> now", "<tool>x",
    "cafe\u0301 café", "\u00a0non-breaking\u00a0space", "\u3000ideographic", "line\u2028sep",
    "mongolian\u180evowel", "zero\u200bwidth\u200cjoin\u200d", "\ufeffBOM", "\x00\x01\x1f\x7f",
    "﷽", "Ǆ ǅ ǆ ß ẞ İstanbul ı", "▁already▁metaspace", "Ġ Ċ",
]

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r  ",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "éèêëàâäôöûüçñÅåßøæœ",
    "\u0301\u0308\u0323\u0303\u030a",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "あいうえおかきくけこアイウエオ",
    "가나다라마바사아자차카타파하",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "😀👍🏽🎉❤️🇫🇷\u200d👨👩",
    "\u00a0\u3000\u2028\u200b\ufeff",
]
SPECIAL_SNIPPETS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<mask>", " <mask> ",
                    "<sw>", "<tool>", "<|begin_of_text|>", "<|eot_id|>", "'s", "'LL"]


def random_strings(rng, count):
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.08:
                parts.append(rng.choice(SPECIAL_SNIPPETS))
            else:
                pool = rng.choice(POOLS)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


# Added tokens with every option, on top of each family's special tokens.
EXTRA_TOKENS = [
    AddedToken("<mask>", lstrip=True, rstrip=True, special=True, normalized=False),
    AddedToken("<sw>", single_word=True, special=False, normalized=False),
    AddedToken("<tool>", special=False, normalized=True),
    AddedToken("café", special=False, normalized=True),
]

BUILDERS = {
    "gpt2": tb.gpt2,
    "smollm": tb.smollm,
    "llama3": tb.llama3,
    "qwen2": tb.qwen2,
    "llama2": tb.llama2,
    "llama2_unk": lambda: tb.llama2(byte_fallback=False),
    "mistral": tb.mistral,
    "mistral_metaspace_decoder": lambda: tb.mistral(metaspace_decoder=True),
}
for _behavior in ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]:
    BUILDERS[f"split_{_behavior}"] = lambda b=_behavior: tb.split(b)
    BUILDERS[f"split_{_behavior}_inverted"] = lambda b=_behavior: tb.split(b, invert=True)
    BUILDERS[f"split_{_behavior}_literal"] = lambda b=_behavior: tb.split(b, literal=True)


def build(name, folder):
    tok = BUILDERS[name]()
    tok.add_tokens(EXTRA_TOKENS)
    path = tb.save(tok, str(folder))
    return Tokenizer.from_file(path), path  # the oracle reads the same file Rondo reads


def build_plain(name, folder):
    """The family's tokenizer without EXTRA_TOKENS, saved; the library reads the saved file."""
    path = tb.save(BUILDERS[name](), str(folder))
    return Tokenizer.from_file(path), path


def run_driver(command, model_path, folder, texts, decode_ids):
    inp, out = os.path.join(folder, "in.json"), os.path.join(folder, "out.json")
    with open(inp, "w", encoding="utf-8") as f:
        json.dump({"texts": texts, "decode_ids": decode_ids}, f)
    rondo_oracle.driver(command, model_path, inp, out)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def first_mismatch(got, want, texts, what, tok):
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            detail = ""
            if isinstance(w, list):
                detail = (f"\n  rondo tokens: {[tok.id_to_token(x) for x in g]}"
                          f"\n  want tokens:  {[tok.id_to_token(x) for x in w]}")
            return f"{what} differ for text {i} {texts[i]!r}:\n  rondo: {g!r}\n  want:  {w!r}{detail}"
    return None


def check_against_library(tok, result, texts, decode_ids):
    problems = []
    want_ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    want_special = [tok.encode(t, add_special_tokens=True).ids for t in texts]
    checks = [
        ("ids", result["ids"], want_ids),
        ("ids with special tokens", result["ids_special"], want_special),
        ("decode", result["decoded"], [tok.decode(ids, skip_special_tokens=False) for ids in want_ids]),
        ("decode skipping special tokens", result["decoded_skip"],
         [tok.decode(ids, skip_special_tokens=True) for ids in want_special]),
    ]
    for what, got, want in checks:
        assert len(got) == len(want)
        m = first_mismatch(got, want, texts, what, tok)
        if m:
            problems.append(m)
    for what, got, skip in [("decode of random ids", result["decode_ids"], False),
                            ("decode of random ids, skipping special", result["decode_ids_skip"], True)]:
        want = [tok.decode(ids, skip_special_tokens=skip) for ids in decode_ids]
        m = first_mismatch(got, want, [str(x) for x in decode_ids], what, tok)
        if m:
            problems.append(m)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_ids_and_decodes_equal_tokenizers(name, tmp_path):
    tok, path = build(name, tmp_path)
    seed = random.randrange(2**32)
    print(f"{name}: seed={seed}")
    rng = random.Random(seed)
    texts = HARD + random_strings(rng, 200)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    decode_ids = [[rng.randrange(vocab + 3) for _ in range(rng.randint(0, 20))] for _ in range(100)]
    # Byte tokens in a row, valid UTF-8 or not, for the ByteFallback and ByteLevel decoders.
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    if all(i is not None for i in byte_ids):
        for _ in range(50):
            decode_ids.append([byte_ids[rng.choice([0x41, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F,
                                                    0x98, 0x80, 0xFF, 0x20])]
                               for _ in range(rng.randint(1, 8))])
    result = run_driver("tokenize", path, str(tmp_path), texts, decode_ids)
    check_against_library(tok, result, texts, decode_ids)
    assert result["vocab_size"] == vocab
    want_special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    assert result["special_ids"] == want_special


ROUND_TRIP = {"gpt2": lambda s: s, "smollm": lambda s: s, "llama3": lambda s: s,
              "qwen2": lambda s: unicodedata.normalize("NFC", s), "llama2": lambda s: s,
              "mistral": lambda s: s}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_decode_of_encode_gives_the_text_back(name, tmp_path):
    """decode(encode(x)) == x (NFC(x) for Qwen2), from Rondo alone. SentencePiece-style: texts without
    a leading space (Metaspace 'first' swallows it, in `tokenizers` too) and without '▁'."""
    tok, path = build(name, tmp_path)
    seed = random.randrange(2**32)
    print(f"{name}: seed={seed}")
    texts = HARD + random_strings(random.Random(seed), 200)
    # Added tokens do not round-trip by design (lstrip/rstrip eat spaces; ByteLevel decodes "café"
    # as bytes), in `tokenizers` too: leave them out.
    added = SPECIAL_SNIPPETS + ["<|", "<unk>", "[INST]", "[/INST]", "café", "cafe\u0301"]
    texts = [t for t in texts if not any(s in t for s in added)]
    if name in ("llama2", "mistral"):
        texts = [t for t in texts if "▁" not in t and not t[:1].isspace()]
    result = run_driver("tokenize", path, str(tmp_path), texts, [])
    bad = [(t, d) for t, d in zip(texts, result["decoded"]) if d != ROUND_TRIP[name](t)]
    assert len(texts) > 100
    assert not bad, f"{len(bad)} texts do not round-trip, e.g. {bad[0][0]!r} -> {bad[0][1]!r}"


def test_ignore_merges_is_observable(tmp_path):
    """The Llama 3 test above would not notice a missing ignore_merges unless some word differs."""
    with_flag = tb.llama3(ignore_merges=True)
    without = tb.llama3(ignore_merges=False)
    text = "The quickbrown fox and the lazydog"
    assert with_flag.encode(text).ids != without.encode(text).ids
    path = tb.save(with_flag, str(tmp_path))
    result = run_driver("tokenize", path, str(tmp_path), [text], [])
    assert result["ids"][0] == with_flag.encode(text, add_special_tokens=False).ids


def spec_from_file(tok_path, kind, **extra):
    """A TokenizerSpec (as GGUF metadata would give it) from a tokenizer.json."""
    with open(tok_path, encoding="utf-8") as f:
        j = json.load(f)
    vocab = dict(j["model"]["vocab"])
    for a in j["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m.split(" ") if isinstance(m, str) else m for m in j["model"]["merges"]]
    spec = {"kind": kind, "tokens": tokens, "merges": merges,
            "special_ids": [a["id"] for a in j["added_tokens"] if a["special"]],
            "added_ids": [a["id"] for a in j["added_tokens"] if not a["special"]]}
    spec.update(extra)
    return spec


SPECS = {
    "gpt2": (tb.gpt2, dict(kind="bytelevel")),
    "smollm": (tb.smollm, dict(kind="bytelevel", split_regexes=[r"\p{N}"], gpt2_split_after=True)),
    "llama3": (tb.llama3, dict(kind="bytelevel", split_regexes=[tb.LLAMA3_REGEX], ignore_merges=True,
                               add_bos=True)),
    "qwen2": (tb.qwen2, dict(kind="bytelevel", split_regexes=[tb.QWEN2_REGEX], nfc=True)),
    "mistral": (tb.mistral, dict(kind="sentencepiece", add_space_prefix=True, byte_fallback=True,
                                 add_bos=True)),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_tokenizer_from_spec_equals_tokenizers(name, tmp_path):
    """from_spec (the GGUF path) builds the same pipeline as the family's tokenizer.json."""
    builder, fields = SPECS[name]
    tok = builder()
    path = tb.save(tok, str(tmp_path))
    tok = Tokenizer.from_file(path)
    fields = dict(fields)
    kind = fields.pop("kind")
    spec = spec_from_file(path, kind, **fields)
    for key, name_ in [("bos_id", "<|begin_of_text|>"), ("bos_id", "<s>"), ("unk_id", "<unk>"),
                       ("eos_id", "</s>")]:
        if tok.token_to_id(name_) is not None and key not in spec:
            spec[key] = tok.token_to_id(name_)
    spec_path = os.path.join(str(tmp_path), "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    seed = random.randrange(2**32)
    print(f"{name}: seed={seed}")
    texts = HARD + random_strings(random.Random(seed), 100)
    result = run_driver("tokenize-spec", spec_path, str(tmp_path), texts, [])
    check_against_library(tok, result, texts, [])


def test_sentencepiece_merges_from_scores(tmp_path):
    """GGUF's SentencePiece vocabularies have scores, not merges: merges derived from the scores must
    tokenize as `tokenizers` does with the merges transformers' converter derives from them."""
    from tokenizers import models
    base = tb.mistral()
    j = json.loads(base.to_str())
    vocab = j["model"]["vocab"]
    by_id = sorted(vocab, key=vocab.get)
    # Scores: learned pieces by id (earlier = higher), specials and bytes at 0 as in Llama 2.
    n_fixed = 5 + 256
    scores = {t: (0.0 if vocab[t] < n_fixed else -float(vocab[t])) for t in by_id}
    merges = []
    for piece in sorted(by_id, key=lambda t: -scores[t]):  # stable: equal scores keep id order
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda lr: (vocab[lr[0]], vocab[lr[1]])))
    j["model"]["merges"] = [list(m) for m in merges]
    oracle = Tokenizer.from_str(json.dumps(j))
    path = tb.save(oracle, str(tmp_path))
    oracle = Tokenizer.from_file(path)
    spec = spec_from_file(path, "sentencepiece", add_space_prefix=True, byte_fallback=True,
                          add_bos=True, bos_id=vocab["<s>"], unk_id=vocab["<unk>"], eos_id=vocab["</s>"])
    spec["merges"] = []
    spec["scores"] = [scores.get(t, 0.0) for t in spec["tokens"]]
    spec_path = os.path.join(str(tmp_path), "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    texts = HARD + random_strings(random.Random(seed), 100)
    result = run_driver("tokenize-spec", spec_path, str(tmp_path), texts, [])
    check_against_library(oracle, result, texts, [])
    assert models  # imported for the oracle's model class


def test_gguf_sentencepiece_tokenizer_equals_tokenizers(tmp_path):
    """A SentencePiece vocabulary as llama.cpp writes it into a GGUF (Mistral v0.3: <unk> of token
    type UNKNOWN, <s> </s> [INST] [/INST] CONTROL, <0xXX> BYTE, the rest NORMAL) gives the tokenizer
    `tokenizers` runs from the model's tokenizer.json, where <unk> is a special token too: split out
    of text, dropped by decode(skip_special_tokens=True)."""
    import gguf
    tok, path = build_plain("mistral", tmp_path)
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    vocab = j["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in j["added_tokens"] if a["special"]}
    assert "<unk>" in special and tok.get_added_tokens_decoder()[vocab["<unk>"]].special

    def token_type(t):
        if t == "<unk>":
            return gguf.TokenType.UNKNOWN
        if t in special:
            return gguf.TokenType.CONTROL
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            return gguf.TokenType.BYTE
        return gguf.TokenType.NORMAL

    gguf_path = os.path.join(str(tmp_path), "mistral.gguf")
    w = gguf.GGUFWriter(gguf_path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([token_type(t) for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    texts = HARD + random_strings(rng, 100)
    decode_ids = [[rng.choice([vocab["<unk>"], vocab["<s>"], rng.randrange(len(tokens))])
                   for _ in range(rng.randint(1, 12))] for _ in range(50)]
    result = run_driver("tokenize", gguf_path, str(tmp_path), texts, decode_ids)
    check_against_library(tok, result, texts, decode_ids)
    assert result["special_ids"] == sorted(vocab[t] for t in special)


def test_unsupported_model_names_file_and_path(tmp_path):
    tok, path = build("gpt2", tmp_path)
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        j["pre_tokenizer"], {"type": "BertPreTokenizer"}]}
    bad = os.path.join(str(tmp_path), "bad.json")
    with open(bad, "w", encoding="utf-8") as f:
        json.dump(j, f)
    with pytest.raises(rondo_oracle.DriverError) as e:
        run_driver("tokenize", bad, str(tmp_path), ["x"], [])
    assert "bad.json" in e.value.message
    assert "pre_tokenizer.pretokenizers[1].type" in e.value.message
    assert "BertPreTokenizer" in e.value.message and "supported:" in e.value.message
