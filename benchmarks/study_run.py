"""One run of the study (``benchmarks/study.py``): a plain ``transformers.Trainer`` as a user builds it, measured.

Public API only: transformers, PEFT, ``hf_lisa.trainer_callbacks.LisaCallback``, ``hf_lisa.models`` (the embedded
model's path), the peers' own packages. The record appended to the results file holds the losses on both held-out
halves at every evaluation step, greedy exact match on the report half, CPU seconds of training (evaluations
excluded), peak RSS, and the schedule's coverage (distinct blocks trained, steps per block).
"""

from __future__ import annotations

import math
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from benchmarks.study import CONFIG, Run, StudyConfig, append_record
from benchmarks.tasks import instruction_rows


# ----------------------------------------------------------------------------------------------------------------------
# Data: the instruction task, tokenised through the model's chat template; loss on the reply tokens only
# ----------------------------------------------------------------------------------------------------------------------
def split_rows(preset) -> tuple[list[dict], list[dict], list[dict]]:
    """``(train, selection, report)``: held-out rows from another seed, none of them in train."""
    heldout = instruction_rows(preset.n_heldout, 1)
    seen = {row["messages"][1]["content"] for row in heldout}
    pool = instruction_rows(preset.n_train + 2 * preset.n_heldout, 0)
    train = [row for row in pool if row["messages"][1]["content"] not in seen][: preset.n_train]
    half = preset.n_heldout // 2
    return train, heldout[:half], heldout[half:]


def encode(row: dict, tokenizer, max_length: int) -> dict:
    prompt = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not extend the prompt with the reply; cannot mask the prompt")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
    ids = (prompt_ids + reply_ids)[:max_length]
    labels = ([-100] * len(prompt_ids) + reply_ids)[:max_length]
    return {"input_ids": ids, "labels": labels}


def long_rows(rows: list[dict], tokenizer, length: int, count: int) -> list[dict]:
    """``count`` rows of exactly ``length`` tokens (the memory table): conversations rendered one after another."""
    text = "".join(tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length * count:
        raise ValueError(f"{len(rows)} rows give {len(ids)} tokens; {length * count} are needed")
    return [{"input_ids": ids[i * length:(i + 1) * length], "labels": ids[i * length:(i + 1) * length]}
            for i in range(count)]


def collate(pad_id: int):
    import torch

    def collator(features: list[dict]) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), pad_id)
        labels = torch.full((len(features), width), -100)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collator


def reply_loss(model, rows: list[dict], collator, batch_size: int = 16) -> float:
    """Mean loss per reply token over ``rows`` (token-weighted, not batch-averaged)."""
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = {k: v.to(device) for k, v in collator(rows[start:start + batch_size]).items()}
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                shift_logits, shift_labels = logits[:, :-1].float(), batch["labels"][:, 1:]
                losses = torch.nn.functional.cross_entropy(
                    shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), reduction="sum")
                total += float(losses)
                tokens += int((shift_labels != -100).sum())
    finally:
        model.train(was_training)
    return total / max(tokens, 1)


def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 16) -> float:
    """Share of rows whose greedy reply, stripped, equals the reference reply."""
    import torch

    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    right = 0
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            prompts = [tokenizer.apply_chat_template(r["messages"][:-1], tokenize=False, add_generation_prompt=True)
                       for r in chunk]
            batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            batch = {k: v.to(next(model.parameters()).device) for k, v in batch.items()}
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            right += sum(reply.strip() == r["messages"][-1]["content"].strip() for reply, r in zip(replies, chunk))
    finally:
        model.train(was_training)
    return right / max(len(rows), 1)


# ----------------------------------------------------------------------------------------------------------------------
# Methods, as their own docs build them
# ----------------------------------------------------------------------------------------------------------------------
def blocks_of(model) -> list:
    """The transformer blocks (modules), found before any wrapping."""
    from hf_lisa import find_blocks

    return list(find_blocks(model))


def build(method, model, lr: float, seed: int, steps: int) -> tuple[Any, list, tuple, dict]:
    """``(model, callbacks, optimizers, TrainingArguments overrides)`` for ``method``."""
    import torch

    kind = method.kind
    if kind == "full":
        return model, [], (None, None), {}
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        targets = method.option("targets")
        config = LoraConfig(r=method.option("r"), lora_alpha=method.option("alpha"), lora_dropout=0.0,
                            target_modules=targets if targets == "all-linear" else targets.split(","),
                            task_type="CAUSAL_LM")
        return get_peft_model(model, config), [], (None, None), {}
    if kind == "lisa":
        from hf_lisa.trainer_callbacks import LisaCallback

        always, sampling = method.option("always"), method.option("sampling")
        callback = LisaCallback(lisa_activated_layers=method.option("gamma"), lisa_interval_steps=method.option("K"),
                                seed=seed, **({} if always is None else {"lisa_always_trainable": ()}),
                                **({} if sampling is None else {"lisa_sampling": sampling}))
        return model, [callback], (None, None), {}
    if kind == "lisa-adapter":
        from peft import get_peft_model

        import hf_lisa
        from hf_lisa.trainer_callbacks import LisaAdapterCallback

        config = hf_lisa.LisaConfig(r=method.option("r"), lisa_alpha=method.option("alpha"), target_modules="all-linear",
                                    lisa_activated_layers=method.option("gamma"),
                                    lisa_interval_steps=method.option("K"), task_type="CAUSAL_LM")
        return get_peft_model(model, config), [LisaAdapterCallback(seed=seed)], (None, None), {}
    if kind == "badam":
        from badam import BlockOptimizer

        if torch.cuda.is_available():  # its weight copies are made on the weights' device: the model goes there first
            model.to("cuda")
        base = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        optimizer = BlockOptimizer(base_optimizer=base, named_parameters_list=list(model.named_parameters()),
                                   block_prefix_list=[[name + "."] for name, _ in blocks_of(model)],
                                   switch_block_every=method.option("K"), switch_mode="random", verbose=0)
        return model, [], (optimizer, None), {}
    if kind == "galore":
        args = f"rank={method.option('rank')}, update_proj_gap={method.option('gap')}, scale={method.option('scale')}"
        return model, [], (None, None), {"optim": "galore_adamw", "optim_target_modules": [r".*.attn.*", r".*.mlp.*"],
                                         "optim_args": args}
    raise ValueError(f"method kind {kind!r} is unknown")


def trained_blocks(blocks: list) -> list[int]:
    """Blocks with at least one parameter that requires a gradient now."""
    return [i for i, (_, block) in enumerate(blocks) if any(p.requires_grad for p in block.parameters())]


# ----------------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------------
def run_one(run: Run, out: Path, model_path: Optional[str], config: StudyConfig = CONFIG) -> None:
    started = time.time()
    try:
        record = _run(run, model_path, config)
    except Exception as err:  # recorded, so that the study moves on and the report says why
        record = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        if isinstance(err, OSError):  # a broken pipe, a full disk: the machine's failure, not the method's (planned again)
            record["infrastructure"] = True
    record.update(key=run.key, run=asdict(run), wall_s=time.time() - started)
    append_record(out, record)
    if record.get("error"):
        print(record["traceback"], file=sys.stderr)
        sys.exit(1)


def _run(run: Run, model_path: Optional[str], config: StudyConfig) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    preset = config.preset(run.preset)
    method = config.methods_for(preset.steps)[run.method]
    if model_path is None:
        from hf_lisa.models import default_model_path

        model_path = default_model_path()
    torch.manual_seed(run.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    blocks = blocks_of(model)
    train_rows, selection_rows, report_rows = split_rows(preset)
    max_length = preset.max_length
    steps = preset.steps
    if run.memory is not None:
        max_length, steps = run.memory["max_length"], 4
        train = long_rows(train_rows, tokenizer, max_length, steps)
        selection = report = []
    else:
        train = [encode(r, tokenizer, max_length) for r in train_rows]
        selection = [encode(r, tokenizer, max_length) for r in selection_rows]
        report = [encode(r, tokenizer, max_length) for r in report_rows]
    collator = collate(tokenizer.pad_token_id)
    model, callbacks, optimizers, overrides = build(method, model, run.lr, run.seed, steps)
    eval_model = model
    evals: list[dict] = []
    coverage: Counter = Counter()
    clock = {"eval_cpu": 0.0, "step_cpu": []}

    class Measure(TrainerCallback):
        """Evaluations at the preset's steps (their CPU time excluded from training) and the blocks each step trains
        (read after the LISA callback's own ``on_step_begin``; BAdam's through requires_grad after its switch)."""

        def _evaluate(self, step: int) -> None:
            began = time.process_time()
            evals.append({"step": step, "selection_loss": reply_loss(eval_model, selection, collator),
                          "report_loss": reply_loss(eval_model, report, collator)})
            clock["eval_cpu"] += time.process_time() - began

        def on_train_begin(self, args, state, control, **kwargs):
            if run.memory is None:
                self._evaluate(0)
            clock["train_start"] = time.process_time()

        def on_step_begin(self, args, state, control, **kwargs):
            clock["step_start"] = time.process_time()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            clock["step_cpu"].append(time.process_time() - clock["step_start"])
            for block in trained_blocks(blocks):
                coverage[block] += 1
            if run.memory is None and state.global_step in preset.eval_at:
                self._evaluate(state.global_step)

    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=preset.batch if run.memory is None
            else 1, learning_rate=run.lr, lr_scheduler_type="cosine", warmup_steps=preset.warmup, weight_decay=0.0,
            logging_steps=10, save_strategy="no", report_to=[], seed=run.seed, data_seed=run.seed,
            disable_tqdm=True, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
            remove_unused_columns=False, **overrides,
            **({"gradient_checkpointing": True} if run.memory and run.memory["gradient_checkpointing"] else {}))
        trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collator,
                          callbacks=[*callbacks, Measure()], optimizers=optimizers)
        result = trainer.train()
    train_cpu = time.process_time() - clock["train_start"] - clock["eval_cpu"]
    record: dict[str, Any] = {
        "method": method.name, "note": method.note, "lr": run.lr, "seed": run.seed, "steps": steps,
        "evals": evals, "train_loss": result.training_loss,
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "train_cpu_s": train_cpu, "cpu_s_per_step": statistics_median(clock["step_cpu"][1:] or clock["step_cpu"]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "coverage": {"distinct_blocks": len(coverage), "num_blocks": len(blocks),
                     "steps_per_block": {str(b): c for b, c in sorted(coverage.items())}},
        "in_regime": preset.steps >= method.min_steps, "torch_threads": torch.get_num_threads(),
    }
    if run.memory is None:
        record["exact_match"] = exact_match(eval_model, tokenizer, report_rows, preset.generate_tokens)
        if not all(math.isfinite(e["selection_loss"]) for e in evals):
            record["diverged"] = True
    return record


def statistics_median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
