"""TRL 1.16 as the preference-tuning oracle (a helper module, not a test).

run_trl() trains a saved transformers causal LM with TRL's DPOTrainer (sigmoid / ipo),
trl.experimental.orpo.ORPOTrainer or trl.experimental.cpo.CPOTrainer (loss_type="simpo") on a JSONL
file of preference pairs, in fp32 on the CPU with every source of nondeterminism or approximation that
TRL turns on by default turned off (bf16 autocast, gradient checkpointing, dropout, shuffling,
gradient clipping, warmup/decay of the learning rate, weight decay), and returns the metrics TRL
logs at every optimizer step. See docs/preference-reference.md for what TRL computes.

Settings that matter for matching (checked against TRL 1.16.0 + transformers 5.24):
- Examples are visited in dataset order: micro-batch k of step s holds processed examples
  [(s-1)*G*B + k*B, ... + B) with B = pairs_per_microbatch, G = grad_accum (transformers'
  train_sampling_strategy="sequential", and _get_train_sampler is overridden to a SequentialSampler
  as well). DPO drops pairs whose prompt alone has >= max_length tokens before that, so indices
  then refer to the filtered dataset.
- "loss" is transformers' per-step value: the sum over the G micro-batches of loss_k / G (all three
  trainers set loss_is_scaled_for_ga=False), i.e. the unweighted mean of the micro-batch losses; it is
  not rounded and, with logging_steps=1, not a running average. logging_nan_inf_filter is off, so a
  NaN/inf loss is reported as is.
- The TRL metrics (rewards/*, logps/*, logits/*, nll_loss, ...) are stored once per micro-batch and
  averaged (plain mean over the G micro-batches) when the step is logged.
- max_grad_norm=0 skips clipping; transformers still computes grad_norm (clip_grad_norm_ with
  max_norm=inf, which multiplies the gradients by exactly 1.0) and logs it.
- If the tokenizer has no pad token, pad_token is set to eos_token before the trainer is built.
  DPOTrainer does the same itself; ORPOTrainer and CPOTrainer would otherwise fail in their collator
  (CPO sets its eos fallback only after building the collator with pad_token_id=None).
"""
import os

# Never reach the network (hub look-ups, telemetry) from the oracle.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import tempfile  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402

METHODS = ("dpo", "orpo", "simpo")


def _common_args(out_dir, *, steps, pairs_per_microbatch, grad_accum, lr, beta, max_length, seed,
                 adam_eps=1e-8):
    return dict(
        output_dir=str(out_dir),
        # precision / determinism
        bf16=False, fp16=False, tf32=False, use_cpu=True,
        gradient_checkpointing=False, disable_dropout=True,
        # optimizer and schedule
        optim="adamw_torch", learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=adam_eps, max_grad_norm=0.0,
        # batching
        per_device_train_batch_size=pairs_per_microbatch, gradient_accumulation_steps=grad_accum,
        max_steps=steps, num_train_epochs=1, train_sampling_strategy="sequential",
        dataloader_drop_last=False, dataloader_num_workers=0,
        # logging / saving
        logging_steps=1, logging_first_step=False, logging_nan_inf_filter=False, report_to="none",
        save_strategy="no", disable_tqdm=True,
        seed=seed, data_seed=seed,
        beta=beta, max_length=max_length,
    )


def _sequential(trainer_cls):
    """trainer_cls with a SequentialSampler, no telemetry, and a record of the micro-batches."""

    class Sequential(trainer_cls):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def _send_telemetry(self):
            pass

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            if model.training and getattr(self, "_rondo_record", None) is not None:
                loss = out[0] if return_outputs else out
                self._rondo_record["microbatch_losses"].append(loss.detach().double().item())
            return out

    Sequential.__name__ = Sequential.__qualname__ = "Sequential" + trainer_cls.__name__
    return Sequential


def _row_key(row):
    return tuple((k, tuple(row[k])) for k in sorted(row) if k.endswith("ids"))


def _record_batches(trainer, record):
    """Wrap the collator so record["batches"] gets, per micro-batch, the indices (into the trainer's
    processed train dataset) of the examples it holds."""
    index = {}
    for i, row in enumerate(trainer.train_dataset):
        index.setdefault(_row_key(row), []).append(i)
    collate = trainer.data_collator

    def wrapped(features):
        record["batches"].append([index.get(_row_key(f), [None])[0] for f in features])
        return collate(features)

    trainer.data_collator = wrapped


def run_trl(method, model_dir, data_path, out_dir, *, lora_init=None, steps, pairs_per_microbatch,
            grad_accum, lr, beta, loss_type="sigmoid", simpo_gamma=0.5, cpo_alpha=0.0, max_length=64,
            seed=0, adam_eps=1e-8, record=None):
    """Train with TRL and return one dict per optimizer step (index 0 = step 1) holding "loss" and
    every metric TRL logged at that step (plus transformers' "grad_norm", "learning_rate", "epoch",
    "step").

    method: "dpo" (loss_type "sigmoid" or "ipo"), "orpo", or "simpo" (CPOTrainer, loss_type="simpo",
    simpo_gamma, cpo_alpha; cpo_alpha=0 is pure SimPO). beta is DPO's beta / IPO's tau, ORPO's lambda,
    SimPO's beta.
    lora_init: None = full fine-tuning of every parameter, saved as out_dir/model.safetensors;
    else a PEFT adapter folder that training starts from (DPO's reference is then a frozen copy of
    that starting adapter), saved as out_dir/adapter_model.safetensors (PEFT naming).
    record: optional dict; gets "batches" (per micro-batch, indices into the processed training
    dataset), "microbatch_losses" (each micro-batch's loss before the 1/grad_accum scaling) and
    "trainer" (the trainer object, for inspection).
    """
    import datasets
    import transformers as T

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    os.makedirs(out_dir, exist_ok=True)
    T.set_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    tokenizer = T.AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                   attn_implementation="eager")
    if lora_init is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, str(lora_init), is_trainable=True)

    with tempfile.TemporaryDirectory() as cache:
        dataset = datasets.load_dataset("json", data_files=str(data_path), split="train",
                                        cache_dir=cache, keep_in_memory=True)
        common = _common_args(out_dir, steps=steps, pairs_per_microbatch=pairs_per_microbatch,
                              grad_accum=grad_accum, lr=lr, beta=beta, max_length=max_length,
                              seed=seed, adam_eps=adam_eps)
        if method == "dpo":
            from trl import DPOConfig, DPOTrainer
            if loss_type not in ("sigmoid", "ipo"):
                raise ValueError(f"DPO loss_type must be sigmoid or ipo, not {loss_type!r}")
            args = DPOConfig(**common, loss_type=[loss_type], truncation_mode="keep_start",
                             precompute_ref_log_probs=False, label_smoothing=0.0)
            trainer = _sequential(DPOTrainer)(model=model, ref_model=None, args=args,
                                              train_dataset=dataset, processing_class=tokenizer)
        elif method == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer
            args = ORPOConfig(**common, remove_unused_columns=False)
            trainer = _sequential(ORPOTrainer)(model=model, args=args, train_dataset=dataset,
                                               processing_class=tokenizer)
        else:
            from trl.experimental.cpo import CPOConfig, CPOTrainer
            args = CPOConfig(**common, loss_type="simpo", simpo_gamma=simpo_gamma,
                             cpo_alpha=cpo_alpha, label_smoothing=0.0, alpha=0.0,
                             remove_unused_columns=False)
            trainer = _sequential(CPOTrainer)(model=model, args=args, train_dataset=dataset,
                                              processing_class=tokenizer)

        if record is not None:
            record.setdefault("batches", [])
            record.setdefault("microbatch_losses", [])
            record["trainer"] = trainer
            trainer._rondo_record = record
            _record_batches(trainer, record)
        trainer.train()

    logs = [dict(e) for e in trainer.state.log_history if "loss" in e and "step" in e]
    if [e["step"] for e in logs] != list(range(1, steps + 1)):
        raise RuntimeError(f"expected one log per step 1..{steps}, got steps "
                           f"{[e['step'] for e in logs]}")

    trained = trainer.model
    if lora_init is not None:
        # Only the trained adapter; DPO's frozen "ref" copy is not part of the result.
        trained.save_pretrained(str(out_dir), selected_adapters=["default"],
                                safe_serialization=True)
    else:
        trained.save_pretrained(str(out_dir), safe_serialization=True)
    return logs


if __name__ == "__main__":
    # Self-check: tiny Qwen2 + ChatML tokenizer, 8 conversational and 8 standard pairs, every method
    # for 2 steps (2 pairs per micro-batch, 2 micro-batches per step), full and LoRA.
    import json
    import math
    import sys

    import numpy as np
    import peft
    import transformers as T
    from safetensors.numpy import load_file

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tokenizer_builders as tb

    QA = [("hello", "hi there", "go away"), ("two plus two", "four", "five"),
          ("colour of the sky", "blue", "green"), ("opposite of hot", "cold", "warm"),
          ("a baby cat", "a kitten", "a puppy"), ("days in a week", "seven", "ten"),
          ("capital of France", "Paris", "Rome"), ("bees make", "honey", "milk")]

    def user(c):
        return [{"role": "user", "content": c}]

    def assistant(c):
        return [{"role": "assistant", "content": c}]

    tmp = tempfile.mkdtemp(prefix="trl_reference_")
    torch.manual_seed(0)
    tok = tb.qwen2()
    base_dir = os.path.join(tmp, "base")
    tb.save_chatml(tok, base_dir)
    config = T.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=128, tie_word_embeddings=True,
                           attention_dropout=0.0, attn_implementation="eager")
    T.Qwen2ForCausalLM(config).eval().save_pretrained(base_dir, safe_serialization=True)

    conv = os.path.join(tmp, "conv.jsonl")
    std = os.path.join(tmp, "std.jsonl")
    with open(conv, "w") as f:
        for q, c, r in QA:
            f.write(json.dumps({"prompt": user(q), "chosen": assistant(c),
                                "rejected": assistant(r)}) + "\n")
    with open(std, "w") as f:
        for q, c, r in QA:
            f.write(json.dumps({"prompt": f"Q: {q}\nA:", "chosen": f" {c}",
                                "rejected": f" {r}"}) + "\n")

    adapter_dir = os.path.join(tmp, "adapter0")
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                           task_type="CAUSAL_LM")
    pm = peft.get_peft_model(T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                             lcfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(adapter_dir)
    start = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))

    runs = [("dpo", {"loss_type": "sigmoid"}), ("dpo", {"loss_type": "ipo"}), ("orpo", {}),
            ("simpo", {"simpo_gamma": 0.5, "cpo_alpha": 0.0}),
            ("simpo", {"simpo_gamma": 0.5, "cpo_alpha": 1.0})]
    want_batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    failures = []
    for data_name, data in [("conv", conv), ("std", std)]:
        for lora in (None, adapter_dir):
            for method, kw in runs:
                name = f"{method}{kw.get('loss_type', '')}-{data_name}-{'lora' if lora else 'full'}"
                if method == "simpo":
                    name += f"-a{kw['cpo_alpha']:g}"
                out = os.path.join(tmp, name)
                record = {}
                logs = run_trl(method, base_dir, data, out, lora_init=lora, steps=2,
                               pairs_per_microbatch=2, grad_accum=2, lr=1e-2, beta=0.1, seed=0,
                               record=record, **kw)
                print(f"== {name}")
                for e in logs:
                    print("  ", json.dumps(e, sort_keys=True))
                mb = record["microbatch_losses"]
                checks = {
                    "finite": all(math.isfinite(v) for e in logs for v in e.values()
                                  if isinstance(v, float)),
                    "order": record["batches"] == want_batches,
                    "loss=mean(microbatches)": all(
                        abs(e["loss"] - (mb[2 * i] + mb[2 * i + 1]) / 2) < 1e-6
                        for i, e in enumerate(logs)),
                }
                if method == "dpo" and kw["loss_type"] == "sigmoid":
                    checks["step1=log2"] = abs(logs[0]["loss"] - math.log(2)) < 1e-6
                    checks["step1 rewards 0"] = (abs(logs[0]["rewards/chosen"]) < 1e-6
                                                 and abs(logs[0]["rewards/rejected"]) < 1e-6)
                if method == "dpo" and kw["loss_type"] == "ipo":
                    checks["step1=(1/2b)^2"] = abs(logs[0]["loss"] - (1 / (2 * 0.1)) ** 2) < 1e-4
                if lora:
                    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
                    checks["adapter keys"] = sorted(saved) == sorted(start)
                    checks["adapter moved"] = any(np.abs(saved[k] - start[k]).max() > 1e-4
                                                  for k in saved)
                    if method == "dpo":
                        t = record["trainer"].model
                        checks["ref adapter frozen"] = all(
                            not p.requires_grad for n, p in t.named_parameters() if ".ref." in n)
                else:
                    checks["model.safetensors"] = os.path.exists(
                        os.path.join(out, "model.safetensors"))
                print("   batches", record["batches"], "microbatch losses",
                      [round(v, 6) for v in mb])
                print("   checks", checks)
                failures += [f"{name}: {k}" for k, ok in checks.items() if not ok]
    print("scratch dir", tmp)
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        sys.exit(1)
    print("all self-checks passed")
