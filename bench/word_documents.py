"""What the Python benchmarks train on: plain-text documents of 60 to 120 random words from a
vocabulary of ten (a few hundred tokens each with the tiny test tokenizer), or of `words` words,
one JSON object a line, the same for the same arguments."""
import json
import random


def write_word_documents(path, count, words_per_document=(60, 120)):
    rng = random.Random(1)
    words = "alpha beta gamma delta river stone cloud light quiet north".split()
    with open(path, "w") as f:
        for _ in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(*words_per_document)))
            f.write(json.dumps({"text": text}) + "\n")
