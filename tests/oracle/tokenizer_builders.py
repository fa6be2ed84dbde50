"""Small tokenizers built with the `tokenizers` library, configured as the real families' tokenizer.json
files are (normaliser, pre-tokenizer, model options, decoder, post-processor, special tokens), for the
tokenizer and chat-template oracle tests. No hub: each is trained on CORPUS in a second or two."""
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_LINES = [
    "The quick brown fox jumps over the lazy dog. It's what they'd've done, isn't it?",
    "I'm sure we'll see; you're right, they've left and he'd gone.",
    "Numbers: 0 1 2 3 42 314159 2024-06-01 1,000,000.50 and v1.2.3",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product",
    "<html><body class=\"main\">Hello &amp; welcome</body></html>",
    "{\"name\": \"Rondo\", \"layers\": 32, \"ok\": true, \"list\": [1, 2, 3]}",
    "Привет, как дела? Всё хорошо, спасибо.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "こんにちは、世界。カタカナとひらがな。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Γειά σου Κόσμε, τι κάνεις;",
    "Café naïve résumé façade coöperate élève Ångström São Paulo.",
    "Emoji: 😀 😃 😄 👍 👍🏽 🎉 ❤️ 🇫🇷 👨‍👩‍👧‍👦",
    "Tabs\tand\tnewlines\nare\n\nwhitespace   too.",
    "   Leading spaces and trailing ones   ",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "Math: x^2 + y^2 = z^2, ∑ i = n(n+1)/2, π ≈ 3.14159, ∞",
]
CORPUS = [line for _ in range(20) for line in _LINES]

GPT2_SPECIALS = ["<|endoftext|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"] + [f"<|reserved_special_token_{i}|>" for i in range(6)]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def _train_byte_level(pre_tokenizer, normalizer=None, vocab_size=1200):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _model_json(tok):
    return json.loads(tok.to_str())["model"]


def gpt2():
    """GPT-2: the ByteLevel pre-tokenizer with its built-in regex."""
    tok = _train_byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(GPT2_SPECIALS)
    return tok


def split(behavior, invert=False, literal=False):
    """Split with `behavior` (removed, isolated, merged_with_previous, merged_with_next, contiguous),
    on a regex (runs of white space, single digits) or on the literal " ", then ByteLevel: every
    behaviour the tokenizer.json format allows, whether or not a family uses it."""
    pattern = " " if literal else Regex(r"\s+|\p{N}")
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern, behavior=behavior, invert=invert),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = _train_byte_level(pre)
    tok.add_special_tokens(GPT2_SPECIALS)
    return tok


def smollm():
    """SmolLM / SmolLM2: Digits(individual_digits) then the GPT-2 ByteLevel split."""
    pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok = _train_byte_level(pre)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok


def llama3(ignore_merges=True):
    """Llama 3: Split(regex) + ByteLevel(use_regex=False), ignore_merges, BOS template. Two extra vocab
    entries that no merge builds make ignore_merges observable."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    trained = _train_byte_level(pre)
    m = _model_json(trained)
    vocab = dict(m["vocab"])
    for extra in ["Ġquickbrown", "Ġlazydog"]:
        vocab.setdefault(extra, len(vocab))
    merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return tok


def qwen2():
    """Qwen2/2.5: NFC, Split(regex) + ByteLevel(use_regex=False), ByteLevel post-processor."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok = _train_byte_level(pre, normalizer=normalizers.NFC())
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(QWEN2_SPECIALS)
    return tok


def _sentencepiece_model(byte_fallback, extra_specials=(), limit_alphabet=120):
    """A SentencePiece-like BPE vocabulary: <unk> <s> </s>, <0x00>..<0xFF>, then learned pieces."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=1000, show_progress=False, limit_alphabet=limit_alphabet)
    t.train_from_iterator(CORPUS, trainer=trainer)
    m = _model_json(t)
    vocab = {}
    for s in SP_SPECIALS + list(extra_specials):
        vocab[s] = len(vocab)
    if byte_fallback:
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(m["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
    return models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                      byte_fallback=byte_fallback)


def _sp_decoder():
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(content=" ", left=1, right=0)])


def _bos_template(tok):
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])


def llama2(byte_fallback=True):
    """Llama 2 / Mistral v0.1 (legacy): Prepend('▁') + Replace(' ', '▁') normaliser, no
    pre-tokenizer, byte fallback, fused <unk>, Replace/ByteFallback/Fuse/Strip decoder."""
    tok = Tokenizer(_sentencepiece_model(byte_fallback))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = _sp_decoder()
    tok.add_special_tokens(SP_SPECIALS)
    _bos_template(tok)
    return tok


def mistral(metaspace_decoder=False):
    """Mistral v0.3-style (non-legacy): Metaspace(prepend_scheme='first', split=False) pre-tokenizer,
    [INST] and [/INST] as control tokens. metaspace_decoder: the Metaspace decoder instead."""
    tok = Tokenizer(_sentencepiece_model(True, extra_specials=["[INST]", "[/INST]"]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = (decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
                   if metaspace_decoder else _sp_decoder())
    tok.add_special_tokens(SP_SPECIALS + ["[INST]", "[/INST]"])
    _bos_template(tok)
    return tok


def save(tok, folder, name="tokenizer.json"):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tok.save(path)
    return path


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def save_chatml(tok, folder):
    """The tokenizer and a tokenizer_config.json with ChatML and <|im_end|> as the end token, as a
    model folder of the tests' chat models holds them."""
    save(tok, folder)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}, f)
