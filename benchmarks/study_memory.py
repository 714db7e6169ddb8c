"""The study's memory table at SmolLM2-1.7B shapes (issue 37 item 4): LoRA, full-parameter LISA and full fine-tuning,
each with and without gradient checkpointing, at rows of 1024 and 2048 tokens, batch 1.

Each row is a plain ``transformers.Trainer`` built as the study builds it (``benchmarks/study_run.build``: PEFT's
``LoraConfig`` all-linear r=16 α=32; ``hf_lisa.trainer_callbacks.LisaCallback`` with ``lisa_activated_layers=2``,
``lisa_interval_steps=5``; nothing for full fine-tuning), on a ``LlamaForCausalLM`` of SmolLM2-1.7B's shapes
(``benchmarks/scaling.SHAPES``) with random weights (nothing is downloaded; memory and time do not depend on the
values), random tokens with labels = inputs, ``--steps`` optimizer steps (the first a warm-up left out of s/step).
Public API only.

Recorded per row: on CUDA ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` from the start of training
(weights included; fp32 weights under bf16 autocast), on CPU the peak RSS from the start of training (Linux
``clear_refs``, so loading the model is not counted); the trainable parameters when training begins (after LISA's
callback froze what does not train) and at most over the steps; wall seconds per step (CUDA synchronised); the
floor of weights + gradients + AdamW state from the config (``benchmarks.theory.config_floor``).

Each row runs in its own process (``--in-process`` runs them all in this one: the tests' fast path). Rows are appended
one by one to the JSONL (``--out``); a rerun skips every row already there (a failed row too: its error is in the
table; delete its line to retry it). ``<out>.md`` is written from the JSONL after every row (``--table``: only that).
``--budget-min``: no row starts after it, and a row still running then is stopped and not recorded (it runs again
next time)::

    python benchmarks/study_memory.py --shape 1.7b --lengths 1024,2048 --budget-min 3   # on a GPU
    python benchmarks/study_memory.py --shape tiny --lengths 64,128 --in-process       # the code path, seconds on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/study_memory.py` puts benchmarks/ first, not the repo root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.study import append_record, read_results  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
GIB = 1024 ** 3

#: the table's methods: name -> (the study's method of ``methods_for``, learning rate as in ``study.memory_runs``,
#: ``theory.config_floor``'s method)
METHODS = {"lora": ("lora", 3e-4, "lora"), "lisa": ("lisa-k5", 3e-5, "lisa"), "full": ("full", 3e-5, "full")}
#: a llama of 4 blocks, E and H untied (so that LISA's E+H+γ blocks is a count that tells them apart)
TINY = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def shape_config(shape: str) -> dict:
    if shape == "tiny":
        return dict(TINY)
    if shape == "1.7b":
        from benchmarks.scaling import SHAPES

        return dict(SHAPES["SmolLM2-1.7B"])
    raise ValueError(f"--shape {shape!r} is invalid; allowed: tiny, 1.7b")


@dataclass(frozen=True)
class Row:
    shape: str
    method: str  # a key of METHODS
    length: int  # tokens per row (batch 1)
    checkpointing: bool

    @property
    def key(self) -> str:
        return f"{self.shape}|{self.method}|L{self.length}|gc{int(self.checkpointing)}"


def planned_rows(shape: str, lengths: list[int], methods: list[str]) -> list[Row]:
    """Every row, shortest rows first, then the methods in the given order, without checkpointing first."""
    return [Row(shape, m, n, gc) for n in lengths for m in methods for gc in (False, True)]


# ----------------------------------------------------------------------------------------------------------------------
# One row, in this process
# ----------------------------------------------------------------------------------------------------------------------
def measure_row(row: Row, steps: int, seed: int = 0) -> dict:
    """Train ``row`` for ``steps`` optimizer steps through a plain Trainer and return what it measured."""
    import tempfile

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from benchmarks.measure import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from benchmarks.study import methods_for
    from benchmarks.study_run import build, collate
    from benchmarks.theory import config_floor

    transformers.utils.logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    study_method, lr, floor_method = METHODS[row.method]
    config_kwargs = shape_config(row.shape)
    config = LlamaConfig(**config_kwargs, use_cache=False)
    torch.manual_seed(seed)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    allocated_before_model = torch.cuda.memory_allocated() if cuda else None
    with device:
        model = LlamaForCausalLM(config)
    model, callbacks, optimizers, overrides = build(methods_for(steps)[study_method], model, lr, seed, steps)
    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": ids.tolist(), "labels": ids.tolist()}
            for ids in torch.randint(0, config.vocab_size, (steps, row.length), generator=generator)]
    seen: dict = {"step_s": [], "step_cpu_s": [], "trainable": []}

    def trainable(m) -> int:
        return sum(p.numel() for p in m.parameters() if p.requires_grad)

    class Measure(TrainerCallback):
        """After the LISA callback (placed before it): what trains, the peak from the start of training, step time."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["trainable_at_begin"] = trainable(model)
            seen["checkpointing_on"] = bool(getattr(model, checkpointing_name("is_"), False))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                seen["allocated_at_begin"] = torch.cuda.memory_allocated()
            else:
                seen["peak_reset"] = reset_peak_rss()
                seen["rss_at_begin"] = current_rss_bytes()

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            seen["t0"], seen["c0"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            seen["step_s"].append(time.perf_counter() - seen["t0"])
            seen["step_cpu_s"].append(time.process_time() - seen["c0"])
            seen["trainable"].append(trainable(model))

    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=1, learning_rate=lr,
            lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[],
            seed=seed, data_seed=seed, disable_tqdm=True, use_cpu=not cuda, bf16=cuda, dataloader_num_workers=0,
            remove_unused_columns=False, **{checkpointing_name(): row.checkpointing}, **overrides)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate(0),
                          callbacks=[*callbacks, Measure()], optimizers=optimizers)
        trainer.remove_callback(PrinterCallback)  # the losses are in the record
        trainer.train()
    steady = seen["step_s"][1:] or seen["step_s"]
    floor = config_floor(config, floor_method, tokens=row.length, activated_layers=2, lora_r=16,
                         param_bytes=4, act_bytes=2 if cuda else 4)
    record = {
        "device": device.type, "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "precision": "fp32 weights, bf16 autocast" if cuda else "fp32", "optim": getattr(args.optim, "value", str(args.optim)),
        "torch": torch.__version__, "transformers": transformers.__version__, "lr": lr, "steps": steps,
        "total_params": sum(p.numel() for p in model.parameters()),
        "trainable_at_begin": seen["trainable_at_begin"], "trainable_max": max(seen["trainable"]),
        "checkpointing_on": seen["checkpointing_on"], "step_s": seen["step_s"], "step_cpu_s": seen["step_cpu_s"],
        "median_step_s": statistics.median(steady), "tokens_per_s": row.length / statistics.median(steady),
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "grad_norms": [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log],
        "state_floor_bytes": floor["weights_bytes"] + floor["grad_bytes"] + floor["optimizer_state_bytes"],
        "floor": floor, "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    if cuda:
        record.update(peak_bytes=torch.cuda.max_memory_allocated(), reserved_bytes=torch.cuda.max_memory_reserved(),
                      allocated_before_model=allocated_before_model, allocated_at_begin=seen["allocated_at_begin"],
                      peak_scope="cuda max_memory_allocated from train begin")
    else:
        record.update(peak_bytes=peak_rss_bytes(), rss_at_begin=seen["rss_at_begin"],
                      peak_scope="peak RSS from train begin" if seen["peak_reset"] else "peak RSS of the process")
    return record


def checkpointing_name(prefix: str = "") -> str:
    """transformers' name for gradient checkpointing: ``activation_checkpointing`` from the release that renamed it
    (the old name warns there), ``gradient_checkpointing`` before; with ``prefix="is_"`` the model's attribute."""
    import dataclasses

    from transformers import TrainingArguments

    renamed = any(f.name == "activation_checkpointing" for f in dataclasses.fields(TrainingArguments))
    return prefix + ("activation_checkpointing" if renamed else "gradient_checkpointing")


def run_row(row: Row, out: Path, steps: int) -> dict:
    """Measure ``row`` and append its record (an error is recorded, with its traceback, and the table goes on)."""
    started = time.time()
    try:
        record = {"status": "ok", **measure_row(row, steps)}
    except Exception as err:  # noqa: BLE001 - recorded: the table says why this row has no figures
        record = {"status": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    record.update(key=row.key, row=asdict(row), wall_s=time.time() - started)
    append_record(out, record)
    return record


# ----------------------------------------------------------------------------------------------------------------------
# The table: rows in processes of their own, under the budget
# ----------------------------------------------------------------------------------------------------------------------
def run_in_subprocess(row: Row, out: Path, steps: int, timeout_s: Optional[float]) -> str:
    """``"ok"``, ``"error"`` (recorded) or ``"stopped"`` (at the budget: killed, not recorded)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--run-row", json.dumps(asdict(row)),
               "--out", str(out), "--steps", str(steps)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "stopped"
    if row.key not in read_results(out):  # the child died before recording (out of memory, a signal)
        append_record(out, {"key": row.key, "row": asdict(row), "status": "error",
                            "error": f"the row's process exited with {completed.returncode}: "
                                     f"{completed.stderr[-1500:]}"})
    return read_results(out)[row.key]["status"]


def run_table(rows: list[Row], out: Path, steps: int, budget_min: Optional[float], in_process: bool) -> dict:
    """Run the rows not yet in ``out``; returns ``{"ran": [...], "skipped": [...], "not_started": [...]}``."""
    deadline = None if budget_min is None else time.time() + 60 * budget_min
    done = read_results(out)
    summary: dict[str, list[str]] = {"ran": [], "skipped": [r.key for r in rows if r.key in done], "not_started": []}
    for row in (r for r in rows if r.key not in done):
        left = None if deadline is None else deadline - time.time()
        if left is not None and left <= 0:
            summary["not_started"].append(row.key)
            continue
        began = time.time()
        status = run_row(row, out, steps)["status"] if in_process else run_in_subprocess(row, out, steps, left)
        print(f"[memory] {row.key}: {status} after {time.time() - began:.0f} s", flush=True)
        (summary["ran"] if status != "stopped" else summary["not_started"]).append(row.key)
        write_table(out)
    return summary


def _size(value: Optional[float], unit: int) -> str:
    return "–" if value is None else f"{value / unit:.2f}"


def write_table(out: Path) -> Path:
    """``<out>.md`` from the JSONL alone (written to a temporary file, then renamed into place)."""
    records = list(read_results(out).values())
    ok = [r for r in records if r.get("status") == "ok"]
    cuda = any(r["device"] == "cuda" for r in ok)
    full_peak = {(r["row"]["length"], r["row"]["checkpointing"]): r["peak_bytes"] for r in ok
                 if r["row"]["method"] == "full"}
    order = {name: i for i, name in enumerate(METHODS)}
    records.sort(key=lambda r: (r["row"]["length"], order.get(r["row"]["method"], 99), r["row"]["checkpointing"]))
    first = ok[0] if ok else {}
    name, unit = ("GiB", GIB) if any(r["state_floor_bytes"] >= GIB for r in ok) else ("MiB", 2 ** 20)
    lines = [
        f"# Memory table: {records[0]['row']['shape'] if records else '?'} shapes, batch 1",
        "",
        f"From `{out.name}` ({len(ok)} of {len(records)} rows measured). Device: {first.get('device_name', '?')}; "
        f"{first.get('precision', '?')}; optimizer {first.get('optim', '?')}; {first.get('steps', '?')} steps per row, "
        "the first left out of s/step; random weights and tokens. LoRA: all-linear r=16 α=32; LISA: LisaCallback "
        "γ=2 (E+H+final norm train); full: every weight. "
        + ("Peak: `torch.cuda.max_memory_allocated` (reserved beside it) from the start of training, weights included."
           if cuda else "Peak: the process's peak RSS from the start of training."),
        "",
        f"| tokens | method | checkpointing | trainable params | at train begin {name} | peak {name} | × full | "
        + (f"reserved {name} | " if cuda else "") + f"weights+grads+AdamW floor {name} | s/step | tokens/s |",
        "|---|---|---|---|---|---|---|" + ("---|" if cuda else "") + "---|---|---|",
    ]
    for r in records:
        row = r["row"]
        head = f"| {row['length']} | {row['method']} | {'on' if row['checkpointing'] else 'off'} |"
        if r.get("status") != "ok":
            lines.append(f"{head} failed: {r.get('error', '?').splitlines()[0][:120]} |")
            continue
        full = full_peak.get((row["length"], row["checkpointing"]))
        ratio = f"{r['peak_bytes'] / full:.2f}" if full else "–"
        begin = r.get("allocated_at_begin", r.get("rss_at_begin"))
        lines.append(f"{head} {r['trainable_at_begin']:,} | {_size(begin, unit)} | {_size(r['peak_bytes'], unit)} | "
                     f"{ratio} | " + (f"{_size(r.get('reserved_bytes'), unit)} | " if cuda else "")
                     + f"{_size(r['state_floor_bytes'], unit)} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} |")
    path = out.with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staged.write_text("\n".join(lines) + "\n")
    os.replace(staged, path)
    return path


def parse_list(value: str, flag: str, allowed: Optional[list[str]] = None) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad or not items:
            raise SystemExit(f"{flag} {value!r} is invalid; allowed: a comma-separated subset of {','.join(allowed)}")
        return items
    if not items or not all(v.isdigit() and int(v) > 0 for v in items):
        raise SystemExit(f"{flag} {value!r} is invalid; allowed: comma-separated positive token counts, e.g. 1024,2048")
    return [int(v) for v in items]


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1.7b", choices=["tiny", "1.7b"])
    parser.add_argument("--lengths", default="1024,2048", help="tokens per row, comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS), help="a subset of " + ",".join(METHODS))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per row (the first is a warm-up)")
    parser.add_argument("--out", default=None,
                        help="the JSONL (default: benchmarks/results/memory-<shape>-<cuda|cpu>.jsonl)")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start no row after this many minutes; a row running then is stopped, not recorded")
    parser.add_argument("--in-process", action="store_true", help="every row in this process (no isolation)")
    parser.add_argument("--table", action="store_true", help="only write <out>.md from the JSONL")
    parser.add_argument("--run-row", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps} is invalid; allowed: 2 or more (the first is a warm-up)")
    if args.budget_min is not None and args.budget_min <= 0:
        raise SystemExit(f"--budget-min {args.budget_min:g} is invalid; allowed: a positive number of minutes")
    if args.out is None:
        import torch

        args.out = str(RESULTS_DIR / f"memory-{args.shape}-{'cuda' if torch.cuda.is_available() else 'cpu'}.jsonl")
    out = Path(args.out)
    if args.run_row:
        record = run_row(Row(**json.loads(args.run_row)), out, args.steps)
        if record["status"] != "ok":
            print(record["traceback"], file=sys.stderr)
        return record
    if args.table:
        print(f"[memory] wrote {write_table(out)}", flush=True)
        return {}
    rows = planned_rows(args.shape, parse_list(args.lengths, "--lengths"),
                        parse_list(args.methods, "--methods", list(METHODS)))
    summary = run_table(rows, out, args.steps, args.budget_min, args.in_process)
    table = write_table(out)
    print(f"[memory] {len(summary['ran'])} row(s) run, {len(summary['skipped'])} already in {out}, "
          f"{len(summary['not_started'])} left for the next run; table: {table}", flush=True)
    return summary


if __name__ == "__main__":
    main()
