"""Throughput of ``hf-lisa train --packing``: the same rows trained unpacked and packed, side by side.

Both runs go through the pieces ``hf-lisa train --packing`` uses, from the library (``LisaTrainingArguments``, the
method's wrapping by ``hf_lisa.trainer.methods.setup_method``, ``LisaTrainer``, ``hf_lisa.data.packing``), on the same
tokenised rows of the bundled arithmetic task (short prompt/completion rows), for one pass over them, with the same
batch size:

* **unpacked**: ``--batch-size`` rows per step, right-padded to the longest row of the batch (the default);
* **packed**: ``--batch-size`` sequences of up to ``--pack-length`` tokens per step, each holding several rows
  (``hf_lisa.data.packing``): fewer steps for the same rows, no padding inside a sequence.

Reported per mode: the steps, the median seconds per step, tokens per second (tokens of the rows, padding not counted,
over the timed steps: every step after the first), the share of the computed positions that were padding, and the
packed / unpacked ratio of tokens per second. On a busy machine the times move: ``--repeats N`` runs each mode N times,
alternating, and keeps the fastest of each.

Usage::

    python benchmarks/packing.py            # SmolLM2-135M-Instruct, method lisa, 96 rows, 4 per step, 256 tokens
    python benchmarks/packing.py --tiny     # a tiny random llama (SmolLM2's tokenizer): a smoke run in seconds

The table goes to stdout, every record to ``benchmarks/results/<date>-packing[-tiny].json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/packing.py` puts benchmarks/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MODES = ("unpacked", "packed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/packing.py", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, help="Training rows, one pass each way (default: 96; 24 with --tiny).")
    p.add_argument("--batch-size", type=int, default=4, help="Rows or sequences per step (default: %(default)s).")
    p.add_argument("--seq-len", type=int, default=256, help="max_seq_length (default: %(default)s).")
    p.add_argument("--pack-length", type=int,
                   help="max_seq_length of a packed sequence (default: --seq-len, as hf-lisa train --packing does).")
    p.add_argument("--method", default="lisa", help="hf-lisa train --method (default: %(default)s).")
    p.add_argument("--repeats", type=int, default=1,
                   help="Runs of each mode, alternating; the fastest of each is kept (default: %(default)s).")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 with --tiny).")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tiny", action="store_true", help="A tiny random llama with SmolLM2's tokenizer (smoke run).")
    p.add_argument("--output-dir", default=str(RESULTS_DIR), help="Where the JSON goes (default: %(default)s).")
    return p


def _arguments(ns: argparse.Namespace, work_dir: str):
    """The run's ``LisaTrainingArguments``: one pass at a constant rate, no checkpoints, no logging to speak of."""
    import torch

    from hf_lisa.trainer import LisaTrainingArguments

    return LisaTrainingArguments(
        output_dir=work_dir, per_device_train_batch_size=ns.batch_size, num_train_epochs=1, learning_rate=1e-4,
        lr_scheduler_type="constant", logging_steps=1000, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=ns.seed, dataloader_pin_memory=torch.cuda.is_available(),  # pinning needs a GPU
        progress_check_steps=0,
    )


def load_rows(ns: argparse.Namespace):
    """``(tokenizer, model path, tokenised train rows)``: the bundled task's first ``--rows`` rows."""
    from hf_lisa.demo_task import cached_dataset_files
    from hf_lisa.models import default_model_path
    from hf_lisa import data as data_lib

    path = default_model_path()
    tokenizer = _tokenizer(path)
    raw = data_lib.load_raw_datasets(train_file=cached_dataset_files(2000)[0], validation_split_percentage=0)
    raw["train"] = raw["train"].select(range(min(ns.rows, len(raw["train"]))))
    tokenized, _ = data_lib.tokenize_datasets(raw, tokenizer, max_seq_length=ns.seq_len)
    return tokenizer, path, tokenized


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def _model(ns: argparse.Namespace, path: str, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(ns.seed)
    if ns.tiny:
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=max(ns.pack_length, ns.seq_len)))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def run_one(mode: str, ns: argparse.Namespace, tokenizer, path: str, tokenized, work_dir: str) -> dict:
    """One pass over the rows in ``mode``; the per-step times and token counts."""
    from transformers import PrinterCallback, TrainerCallback, set_seed

    from benchmarks.measure import setup_benchmarked_method
    from hf_lisa.trainer import LisaTrainer
    from hf_lisa import data as data_lib
    from hf_lisa.data.packing import prepare_packing

    training_args = _arguments(ns, f"{work_dir}/{mode}")
    set_seed(ns.seed)
    model = _model(ns, path, len(tokenizer))
    collator, report = data_lib.data_collator(tokenizer), None
    if mode == "packed":
        tokenized, collator, report = prepare_packing(tokenized, model, tokenizer, ns.pack_length, ns.seed, collator)
    model, callbacks = setup_benchmarked_method(model, ns.method, ns.seed, {})  # the method's defaults
    batches: list[tuple[int, int]] = []  # (tokens of the rows, positions computed) per batch, in step order

    def counting(features):
        batch = collator(features)
        batches.append((sum(len(f["input_ids"]) for f in features), batch["input_ids"].numel()))
        return batch

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    timer = StepTimes()
    trainer = LisaTrainer(model=model, args=training_args, train_dataset=tokenized["train"],
                          processing_class=tokenizer, data_collator=counting, callbacks=callbacks + [timer])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    timed = slice(1, None) if len(timer.seconds) > 1 else slice(None)  # the first step warms up (and calibrates)
    seconds, counted = timer.seconds[timed], batches[:len(timer.seconds)][timed]
    tokens, positions = sum(t for t, _ in counted), sum(p for _, p in counted)
    return {
        "mode": mode, "rows": report.rows if report else len(tokenized["train"]),
        "sequences": report.sequences if report else len(tokenized["train"]), "steps": len(timer.seconds),
        "seconds_per_step": statistics.median(seconds), "tokens_per_second": tokens / sum(seconds),
        "padding": 1 - tokens / positions, "packing_ratio": report.ratio if report else 1.0,
        "step_seconds": [round(t, 3) for t in timer.seconds],
    }


def render(rows: list[dict]) -> str:
    lines = ["| mode | rows | sequences | steps | s/step | tokens/s | padding |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['rows']} | {r['sequences']} | {r['steps']} | {r['seconds_per_step']:.3f} "
                     f"| {r['tokens_per_second']:.0f} | {r['padding']:.0%} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Train both ways, print the table and the ratio, write the JSON; return the report (with ``json_path``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    ns.rows = ns.rows or (24 if ns.tiny else 96)
    ns.pack_length = ns.pack_length or ns.seq_len
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    started = _dt.datetime.now()
    threads = torch.get_num_threads()
    torch.set_num_threads(ns.threads or (1 if ns.tiny else threads))
    try:
        with tempfile.TemporaryDirectory(prefix="hf-lisa-packing-") as work_dir:
            tokenizer, path, tokenized = load_rows(ns)
            runs = []
            for repeat in range(ns.repeats):  # alternating, so that a change of load hits both modes
                for mode in MODES:
                    print(f"[packing] {mode} ({repeat + 1}/{ns.repeats}) ...", file=sys.stderr, flush=True)
                    runs.append(run_one(mode, ns, tokenizer, path, tokenized, work_dir))
            rows = [max((r for r in runs if r["mode"] == mode), key=lambda r: r["tokens_per_second"])
                    for mode in MODES]
    finally:
        torch.set_num_threads(threads)
    ratio = rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"]
    table = render(rows)
    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": "python benchmarks/packing.py " + " ".join(argv),
        "model": "tiny llama (random init)" if ns.tiny else "SmolLM2-135M-Instruct (fp32)",
        "settings": {k: v for k, v in vars(ns).items() if k != "output_dir"},
        "rows": rows,
        "runs": runs,
        "tokens_per_second_ratio": ratio,
    }
    out_dir = Path(ns.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{started:%Y-%m-%d-%H%M%S}-packing{'-tiny' if ns.tiny else ''}.json"
    path.write_text(json.dumps(report, indent=2))
    report["json_path"] = str(path)
    print(table)
    print(f"packed / unpacked tokens per second: {ratio:.2f}x ({rows[1]['packing_ratio']:.2f} rows per sequence); "
          f"{path}")
    return report


if __name__ == "__main__":
    main()
