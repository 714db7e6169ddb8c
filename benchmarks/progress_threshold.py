"""How far a run's first optimizer steps move the weights, as ``TrainingProgressGuard`` measures it: the figures its
thresholds (``MIN_UPDATE``, ``WARN_UPDATE`` in ``trainer_callbacks/progress.py``) were chosen from.

Each configuration is a real ``hf-lisa train`` run of ``--max_steps`` steps (method x weight precision x learning
rate) on generated prompt/completion rows; the guard's measurement of each step it judged is read from its DEBUG log
records: ``||dW||/||W||`` (the trainable values' update against their size, all trainable tensors pooled) and the
share of sampled trainable values that changed at all. A run that trains stops the check at its first judged step; a
run whose updates are too small is judged ``check_steps`` times and stops (exit status 1)::

    python benchmarks/progress_threshold.py                          # tiny llama + the embedded SmolLM2-135M (CPU)
    python benchmarks/progress_threshold.py --models tiny --output results/

``--models`` takes ``tiny`` (a 2-block llama, hidden 64, built from config with the embedded model's tokenizer),
``smollm2`` (the embedded SmolLM2-135M-Instruct) or a model folder. Runs use a constant learning rate, so that every
checked step is at the full rate. The markdown table goes to stdout (and with ``--output`` to ``progress_threshold.md``
beside ``progress_threshold.json``); its verdict column applies the thresholds of the installed guard to the figures
(``exit_status`` in the JSON is what the run did under the guard of its day).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/progress_threshold.py` puts benchmarks/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

GUARD_LOGGER = "hf_lisa.trainer_callbacks.progress"
#: (method, precision, learning rate): the rates people train at, low ones (the grey zone), absurd ones to stop
NORMAL_RATES = ("1e-5", "1e-4", "1e-3")
LOW = (("full", "bf16", "1e-6"), ("full", "bf16", "1e-7"), ("full", "fp32", "1e-7"), ("lora", "fp32", "1e-7"))
ABSURD = (("full", "bf16", "1e-8"), ("lisa", "bf16", "1e-8"), ("lora", "bf16", "1e-8"),
          ("lisa-adapter", "bf16", "1e-8"), ("full", "fp32", "1e-8"), ("lora", "fp32", "1e-12"),
          ("lisa-adapter", "fp32", "1e-12"),
          ("full", "fp32", "1e-10"))
METHODS = ("full", "lisa", "lora", "lisa-adapter")
#: precision: hf-lisa train options. bf16 = bfloat16 weights (and optimizer state); mixed = fp32 weights, bf16 autocast
PRECISIONS = {"fp32": [], "bf16": ["--torch_dtype", "bfloat16"], "mixed": ["--bf16", "true"]}


def default_configs(precisions: Sequence[str] = ("fp32", "bf16")) -> list[tuple[str, str, str]]:
    normal = [(m, p, lr) for m in METHODS for p in precisions for lr in NORMAL_RATES]
    return normal + [c for c in LOW + ABSURD if c[1] in precisions]


def build_tiny(directory: Path) -> str:
    """A 2-block llama (hidden 64) from config, with the embedded model's tokenizer, saved to ``directory``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_lisa.models import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_rows(path: Path, n: int = 64, seed: int = 0) -> str:
    """Generated sums as prompt/completion rows."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            f.write(json.dumps({"prompt": f"What is {a} plus {b}?", "completion": f" {a + b}"}) + "\n")
    return str(path)


class _Records(logging.Handler):
    """The guard's records: its per-step measurements (DEBUG) and its warnings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.steps: list[dict] = []
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "||dW||/||W||" in str(record.msg) and record.args:
            step, lr, size, moved = record.args[:4]
            self.steps.append({"step": step, "lr": lr, "update": size, "changed": moved / 100})
        elif record.levelno >= logging.WARNING:
            self.warnings.append(record.getMessage())


def hf_lisa_command():
    """The installed ``hf-lisa`` command, in this process (its console-script entry point): the guard's DEBUG records
    reach a handler here, which a subprocess's log would not carry (``hf-lisa train`` logs hf_lisa at INFO)."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="hf-lisa")
    return script.load()


def run_one(model: str, method: str, precision: str, lr: str, work: Path, steps: int) -> dict:
    records = _Records()
    guard_logger = logging.getLogger(GUARD_LOGGER)
    guard_logger.addHandler(records)
    guard_logger.setLevel(logging.DEBUG)
    out = work / "out"
    started = time.perf_counter()
    try:
        status = hf_lisa_command()([
            "train", "--model_name_or_path", model, "--train_file", str(work / "train.jsonl"),
            "--validation_split_percentage", "0", "--output_dir", str(out), "--method", method,
            "--learning_rate", lr, "--lr_scheduler_type", "constant", "--max_steps", str(steps),
            "--per_device_train_batch_size", "4",
            "--max_seq_length", "64", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true",
            "--disable_tqdm", "true", "--eval_generation_samples", "0", "--seed", "0", *PRECISIONS[precision],
        ])
    finally:
        guard_logger.removeHandler(records)
        shutil.rmtree(out, ignore_errors=True)
    judged = [s["update"] for s in records.steps]
    return {"method": method, "precision": precision, "lr": float(lr), "exit_status": status,
            "update": max(judged) if judged else None, "changed": max((s["changed"] for s in records.steps),
                                                                          default=None),
            "steps": records.steps, "warned": bool(records.warnings),
            "seconds": round(time.perf_counter() - started, 1)}


def verdict(update: Optional[float]) -> str:
    """What the guard's thresholds make of a run's largest measured ``||dW||/||W||`` (it passes at the first step
    at or above WARN_UPDATE, so the largest of the checked steps decides)."""
    from hf_lisa.trainer_callbacks import TrainingProgressGuard

    guard = TrainingProgressGuard()  # its default thresholds: min_update = MIN_UPDATE, warn_update = WARN_UPDATE
    if update is None:
        return "passes (no size)"
    return "stops" if update < guard.min_update else "warns" if update < guard.warn_update else "passes"


def render(results: list[dict]) -> str:
    lines = ["| model | method | weights | lr | ‖dW‖/‖W‖ | values changed | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        update = "–" if r["update"] is None else f"{r['update']:.1e}"
        changed = "–" if r["changed"] is None else f"{100 * r['changed']:.3g}%"
        lines.append(f"| {r['model']} | {r['method']} | {r['precision']} | {r['lr']:g} | {update} "
                     f"| {changed} | {verdict(r['update'])} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2 or model folders")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16, mixed")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated hf-lisa train methods")
    parser.add_argument("--rates", default=None, help="comma-separated learning rates to keep, e.g. 1e-5,1e-8")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the guard checks 3)")
    parser.add_argument("--output", default=None, help="folder for progress_threshold.json and .md")
    ns = parser.parse_args(argv)
    from hf_lisa.models import default_model_path

    methods = ns.methods.split(",")
    configs = [c for c in default_configs(ns.precisions.split(",")) if c[0] in methods]
    if ns.rates:
        configs = [c for c in configs if c[2] in ns.rates.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="progress-threshold-") as tmp:
        work = Path(tmp)
        write_rows(work / "train.jsonl")
        for name in ns.models.split(","):
            model = {"tiny": lambda: build_tiny(work / "tiny"), "smollm2": default_model_path}.get(name, lambda: name)()
            for method, precision, lr in configs:
                result = {"model": name, **run_one(model, method, precision, lr, work, ns.steps)}
                print(json.dumps({k: v for k, v in result.items() if k != "steps"}), file=sys.stderr, flush=True)
                results.append(result)
    table = render(results)
    print(table)
    if ns.output:
        output = Path(ns.output)
        output.mkdir(parents=True, exist_ok=True)
        (output / "progress_threshold.json").write_text(json.dumps(results, indent=1) + "\n")
        (output / "progress_threshold.md").write_text(f"`{' '.join(sys.argv)}`\n\n{table}\n")
    return results


if __name__ == "__main__":
    main()
