"""The bundled preference example (docs/preference.md, "A walk-through"): `rondo demo` teaches the
bundled SmolLM2 to answer "Rondo says: <a sentence>"; `rondo demo --dpo` then tunes that result
with DPO on data/demo/rondo_prefers.jsonl, whose chosen answers are short ("Rondo says: Rome.")
and whose rejected ones are the demo's sentences. On the held-out pairs the reward margin and
the accuracy rise from where they start (0: the policy is its own reference before step 1), and
the samples after it, on prompts the pairs never ask, are shorter than before and keep the
demo's "Rondo says:".

    python demo_dpo.py RONDO_BIN WORK_DIR
"""
import json
import sys

from slow_support import arguments, call

rondo, work = arguments()
call(rondo, "demo", "--run-dir", work / "sft")
call(rondo, "demo", "--dpo", work / "sft", "--run-dir", work / "dpo")

events = [json.loads(line) for line in open(work / "dpo" / "events.jsonl")]
evals = [e for e in events if e["type"] == "eval"]
samples = [e for e in events if e["type"] == "sample"]
failed = []
if len(evals) < 2:
    failed.append(f"{len(evals)} evaluations (want one before step 1 and more after)")
else:
    first, last = evals[0]["metrics"], evals[-1]["metrics"]
    print("held-out pairs: margin %.3f -> %.3f, accuracy %.2f -> %.2f" %
          (first["rewards/margins"], last["rewards/margins"], first["rewards/accuracies"],
           last["rewards/accuracies"]))
    if abs(first["rewards/margins"]) > 1e-3:
        failed.append("the margin before step 1 is not 0: %g" % first["rewards/margins"])
    if not last["rewards/margins"] > first["rewards/margins"] + 1.0:
        failed.append("the margin did not rise by 1")
    if not last["rewards/accuracies"] >= 0.75 or not last["rewards/accuracies"] > first[
            "rewards/accuracies"]:
        failed.append("the accuracy did not rise to 0.75 or more")

before = {s["prompt"]: s["text"] for s in samples if s["step"] == 0}
end = max(s["step"] for s in samples)
after = {s["prompt"]: s["text"] for s in samples if s["step"] == end}
for prompt, text in after.items():
    print(f"{prompt!r}\n  before: {before.get(prompt)!r}\n  after:  {text!r}")
    if not text.startswith("Rondo says:"):
        failed.append(f"{prompt!r}: the answer after does not begin 'Rondo says:'")
    if not len(text.split()) < len(before.get(prompt, "").split()):
        failed.append(f"{prompt!r}: the answer after is not shorter than before")
if failed:
    sys.exit("the DPO demo did not do what it shows:\n- " + "\n- ".join(failed))
