"""When does LISA win? A study that can decide (issue 37), on the public API only.

Every run is one plain ``transformers.Trainer`` in its own process, built the way a user would build it: PEFT's
``LoraConfig`` for LoRA, ``hf_lisa.trainer_callbacks.LisaCallback`` for full-parameter LISA, ``hf_lisa.LisaConfig``
with ``LisaAdapterCallback`` for the sampled LISA adapter, ``badam.BlockOptimizer``
and transformers' ``optim="galore_adamw"`` for the peers, nothing at all for full fine-tuning. Nothing here imports a
non-public name of ``hf_lisa``.

Protocol (``--preset cpu``; ``--preset gpu`` is the same at 1000 steps, batch 16, 16K rows):

* the instruction task (``benchmarks/tasks.py``: 8 kinds of word-list instructions in chat form, each reply
  determined by its instruction), ``T`` = 300 steps of batch 4 (1200 rows, each seen once), 10 warmup steps then
  cosine decay; 128 held-out rows split into a *selection* half and a *report* half; the loss on the reply tokens of
  both halves at steps 30/60/120/300, greedy exact match on the report half at the end;
* each ranked method's own learning-rate grid, ×3 spaced, extended outward while its best rate (lowest selection loss
  at seed 0, step T) sits at the grid's edge, up to :data:`GRID_LIMITS`;
* then seeds 1-4 at that rate (seed 0 chose the rate and is not reported: no winner's curse), reported on the report
  half as a mean with a 95% t-interval, and the difference to LoRA paired by seed (same data order) with its interval;
* diagnostics at one seed, each at its parent's best rate: LoRA r=4 and r=128, q/v-only LoRA r=128, LISA with E+H
  frozen, LISA γ=6;
* BAdam and GaLore at their documented settings; where ``T`` is too short for them (fewer than two switches or
  projection updates) they run but are marked "not in its regime" and not ranked;
* the memory table (``--memory``): LoRA, LISA and full at 1024-token rows, batch 1, with and without gradient
  checkpointing: peak RSS and CPU seconds per step.

Results are appended run by run to ``benchmarks/results/study/<name>.jsonl``; running the same command again (or
with ``--resume``) plans what is still missing from what is there, so an interrupted study continues across sessions.
``--report`` writes ``<name>.md`` from the JSONL alone.

Usage::

    python benchmarks/study.py                       # run (or continue) the CPU study, then write the report
    python benchmarks/study.py --memory              # the memory table
    python benchmarks/study.py --report              # the report from what has run
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # `python benchmarks/study.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS_DIR = Path(__file__).resolve().parent / "results" / "study"


@dataclass(frozen=True)
class Preset:
    steps: int
    batch: int
    n_train: int
    n_heldout: int  # split in two halves: selection, report
    eval_at: tuple[int, ...]
    warmup: int
    max_length: int
    seeds: tuple[int, ...]  # reported seeds (seed 0 selects the rate)
    jobs: int
    threads: int
    generate_tokens: int = 32
    model: Optional[str] = None  # None: the embedded SmolLM2-135M-Instruct


PRESETS = {
    "cpu": Preset(steps=300, batch=4, n_train=1200, n_heldout=128, eval_at=(30, 60, 120, 300), warmup=10,
                  max_length=128, seeds=(1, 2, 3, 4), jobs=2, threads=1),
    "gpu": Preset(steps=1000, batch=16, n_train=16000, n_heldout=256, eval_at=(100, 200, 500, 1000), warmup=30,
                  max_length=256, seeds=(1, 2, 3, 4), jobs=1, threads=8),
    # the smoke test's: a tiny model, a few steps
    "tiny": Preset(steps=6, batch=2, n_train=12, n_heldout=8, eval_at=(3, 6), warmup=1, max_length=512, seeds=(1, 2),
                   jobs=1, threads=1, generate_tokens=4),
}


@dataclass(frozen=True)
class Method:
    """A way to train, as its own docs build it. ``grid``: the first learning rates tried; ``parent``: a diagnostic
    runs once, at its parent's best rate; ``min_steps``: below this T the method is out of its regime (not ranked)."""

    name: str
    kind: str  # "lora", "lisa", "lisa-adapter", "full", "badam", "galore"
    grid: tuple[float, ...]
    options: tuple[tuple[str, Any], ...] = ()
    parent: Optional[str] = None
    min_steps: int = 0
    note: str = ""

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


ADAPTER_GRID = (1e-4, 3e-4, 1e-3)
FULL_GRID = (1e-5, 3e-5, 1e-4)
#: how far a grid may be extended while its best rate sits at an edge
GRID_LIMITS = (1e-6, 1e-2)
#: BAdam's rule for its switch interval (its README): K = min(max(n / (B · D), 50), 100); with n = 1200 rows, B = 4,
#: D = 30 blocks that is 50. GaLore's fine-tuning gap is 200-500 (its paper's GLUE runs: 500; transformers' docs: 200).
BADAM_K = 50
GALORE_GAP = 200


def methods_for(steps: int) -> dict[str, Method]:
    k_long = max(steps // 10, 1)  # the LISA paper's best ablation: K ≈ T/10
    found = [
        Method("lora", "lora", ADAPTER_GRID, (("r", 16), ("alpha", 32), ("targets", "all-linear")),
               note="PEFT LoRA on every linear layer, r=16, α=32 (LLaMA-Factory's and axolotl's usual baseline)"),
        Method("full", "full", FULL_GRID, note="every weight, AdamW"),
        Method("lisa-k5", "lisa", FULL_GRID, (("gamma", 2), ("K", 5)), note="LisaCallback γ=2, K=5 (E+H train)"),
        Method(f"lisa-k{k_long}", "lisa", FULL_GRID, (("gamma", 2), ("K", k_long)),
               note=f"LisaCallback γ=2, K=T/10={k_long} (the paper's best ablation ratio)"),
        Method(f"lisa-adapter-k{k_long}", "lisa-adapter", ADAPTER_GRID,
               (("r", 16), ("alpha", 32), ("gamma", 2), ("K", k_long)),
               note=f"LisaConfig r=16, α=32 on every linear layer, γ=2 blocks' adapters train, K={k_long}, dense "
                    "(the sampled LISA adapter: its own rate, issue 37 item 3)"),
        Method("badam", "badam", FULL_GRID, (("K", BADAM_K),), min_steps=2 * BADAM_K,
               note=f"badam.BlockOptimizer, one block at a time, switch_block_every={BADAM_K}, random order"),
        Method("galore", "galore", FULL_GRID, (("rank", 128), ("gap", GALORE_GAP), ("scale", 0.25)),
               min_steps=2 * GALORE_GAP,
               note=f"optim='galore_adamw' on attention+MLP, rank=128, update_proj_gap={GALORE_GAP}, scale=0.25"),
        # diagnostics: one seed, at the parent's best rate
        Method("lora-r4", "lora", (), (("r", 4), ("alpha", 8), ("targets", "all-linear")), parent="lora"),
        Method("lora-r128", "lora", (), (("r", 128), ("alpha", 256), ("targets", "all-linear")), parent="lora"),
        Method("lora-qv-r128", "lora", (), (("r", 128), ("alpha", 256), ("targets", "q_proj,v_proj")),
               parent="lora", note="the LISA paper's likely LoRA baseline"),
        Method("lisa-eh-frozen", "lisa", (), (("gamma", 2), ("K", k_long), ("always", "")), parent=f"lisa-k{k_long}"),
        Method("lisa-g6", "lisa", (), (("gamma", 6), ("K", k_long)), parent=f"lisa-k{k_long}"),
    ]
    return {m.name: m for m in found}


@dataclass(frozen=True)
class Run:
    method: str
    lr: float
    seed: int
    preset: str
    memory: Optional[dict] = None  # the memory table's runs: {"max_length": 1024, "gradient_checkpointing": bool}

    @property
    def key(self) -> str:
        extra = "" if self.memory is None else f"|mem{self.memory['max_length']}-gc{int(self.memory['gradient_checkpointing'])}"
        return f"{self.preset}|{self.method}|{self.lr:g}|{self.seed}{extra}"


# ----------------------------------------------------------------------------------------------------------------------
# Planning: what is still missing, from what is there
# ----------------------------------------------------------------------------------------------------------------------
#: a run whose failure is the machine's, not the method's (a broken pipe when the parent restarts, a full disk, a kill
#: by signal), is recorded with ``"infrastructure": true``: it is no result, so it is planned again, at most this many
#: times (then it is left out, and named, so that a persistent failure cannot loop forever)
INFRASTRUCTURE_RETRIES = 2


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_results(path: Path) -> dict[str, dict]:
    """The results by run key; the infrastructure failures are not results (see :data:`INFRASTRUCTURE_RETRIES`)."""
    return {record["key"]: record for record in _records(path) if not record.get("infrastructure")}


def infrastructure_failures(path: Path) -> dict[str, int]:
    """How often each run key failed for the machine's reasons."""
    counts: dict[str, int] = {}
    for record in _records(path):
        if record.get("infrastructure"):
            counts[record["key"]] = counts.get(record["key"], 0) + 1
    return counts


def selection_loss(record: Optional[dict]) -> float:
    """The rate-selection criterion: loss on the selection half at the last step (inf for a failed or diverged run)."""
    if record is None or record.get("error"):
        return math.inf
    value = record["evals"][-1]["selection_loss"]
    return value if math.isfinite(value) else math.inf


def grid_state(method: Method, preset: str, results: dict[str, dict]) -> tuple[list[float], Optional[float]]:
    """``(rates still to run at seed 0, best rate or None while undecided)`` for a ranked method's grid."""
    rates = list(method.grid)
    while True:
        missing = [lr for lr in rates if Run(method.name, lr, 0, preset).key not in results]
        if missing:
            return missing, None
        losses = {lr: selection_loss(results[Run(method.name, lr, 0, preset).key]) for lr in rates}
        best = min(rates, key=lambda lr: losses[lr])
        if not math.isfinite(losses[best]):  # every rate failed or diverged: nothing to choose, said in the report
            return [], None
        if best == rates[0] and _ladder(rates[0], up=False) >= GRID_LIMITS[0] * 0.99:
            rates.insert(0, _ladder(rates[0], up=False))
        elif best == rates[-1] and _ladder(rates[-1], up=True) <= GRID_LIMITS[1] * 1.01:
            rates.append(_ladder(rates[-1], up=True))
        else:
            return [], best


def _ladder(lr: float, up: bool) -> float:
    """The next rate of the ×3-spaced ladder 1, 3, 10, 30, ... × 10^k above (or below) ``lr``."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = round(lr / 10 ** exponent)
    if up:
        return float(f"{3 if mantissa == 1 else 1}e{exponent if mantissa == 1 else exponent + 1}")
    return float(f"{1 if mantissa == 3 else 3}e{exponent if mantissa == 3 else exponent - 1}")


def plan(preset_name: str, results: dict[str, dict]) -> list[Run]:
    """The runs that can start now, in the order they run: the diagnostics of every decided method, then its seeds,
    then the grids still open. A decided method's comparisons (r=4 against r=128, its interval against LoRA's) can
    then be answered while other grids are still running; the total is the same in any order."""
    preset = PRESETS[preset_name]
    methods = methods_for(preset.steps)
    grids: list[Run] = []
    best: dict[str, Optional[float]] = {}
    for m in methods.values():
        if m.parent is None:
            missing, best[m.name] = grid_state(m, preset_name, results)
            grids += [Run(m.name, lr, 0, preset_name) for lr in missing]
    diagnostics = [Run(m.name, best[m.parent], 0, preset_name) for m in methods.values()
                   if m.parent is not None and best.get(m.parent) is not None]
    seeds = [Run(m.name, best[m.name], s, preset_name) for m in methods.values()
             if m.parent is None and best[m.name] is not None for s in preset.seeds]
    return [run for run in diagnostics + seeds + grids if run.key not in results]


def memory_runs(preset_name: str) -> list[Run]:
    return [Run(m, lr, 0, preset_name, {"max_length": 1024, "gradient_checkpointing": gc})
            for m, lr in (("lora", 3e-4), ("lisa-k5", 3e-5), ("full", 3e-5)) for gc in (False, True)]


# ----------------------------------------------------------------------------------------------------------------------
# Running: each run in its own process, its record appended under a lock
# ----------------------------------------------------------------------------------------------------------------------
def append_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f, fcntl.LOCK_UN)


def launch(run: Run, out: Path, model: Optional[str], threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(Path(__file__).resolve()), "--run-one", json.dumps(asdict(run)), "--out", str(out)]
    if model:
        command += ["--model", model]
    infrastructure_before = infrastructure_failures(out).get(run.key, 0)
    started = time.time()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    recorded = run.key in read_results(out) or infrastructure_failures(out).get(run.key, 0) > infrastructure_before
    if completed.returncode != 0 and not recorded:  # the child records its own failures; this covers a crash
        record = {"key": run.key, "run": asdict(run), "error": completed.stderr[-2000:],
                  "returncode": completed.returncode, "wall_s": time.time() - started}
        if completed.returncode < 0:  # killed by a signal (the session ending, a kill): the machine's, run again
            record.update(infrastructure=True, error=f"killed by signal {-completed.returncode}; "
                          + completed.stderr[-1800:])
        append_record(out, record)  # an exit status without a record of the child's own: a failed run, a result
    print(f"[study] {run.key}: exit {completed.returncode} after {time.time() - started:.0f} s", flush=True)


def study(preset_name: str, out: Path, model: Optional[str], budget_min: Optional[float], jobs: int,
          memory: bool) -> None:
    preset = PRESETS[preset_name]
    deadline = None if budget_min is None else time.time() + 60 * budget_min
    while True:
        results = read_results(out)
        todo = [r for r in memory_runs(preset_name) if r.key not in results] if memory else plan(preset_name, results)
        failures = infrastructure_failures(out)
        given_up = [r.key for r in todo if failures.get(r.key, 0) > INFRASTRUCTURE_RETRIES]
        if given_up:
            print(f"[study] left out after {INFRASTRUCTURE_RETRIES + 1} failures of the machine's kind (see their "
                  f"records in {out}): {', '.join(given_up)}", flush=True)
        todo = [r for r in todo if r.key not in given_up]
        if not todo:
            print(f"[study] nothing left to run in {out}", flush=True)
            return
        if deadline is not None and time.time() > deadline:
            print(f"[study] budget reached; {len(todo)} run(s) planned, not started", flush=True)
            return
        batch = todo[:jobs]
        with ThreadPoolExecutor(len(batch)) as pool:
            list(pool.map(lambda r: launch(r, out, model or preset.model, preset.threads), batch))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--name", default=None, help="results file stem (default: study-<preset>)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--model", default=None, help="a local model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the preset's)")
    parser.add_argument("--budget-min", type=float, default=None, help="start no run after this many minutes")
    parser.add_argument("--memory", action="store_true", help="the memory table instead of the study")
    parser.add_argument("--report", action="store_true", help="only write the report from the results so far")
    parser.add_argument("--resume", action="store_true", help="accepted for clarity: every run continues the file")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        from benchmarks.study_run import run_one

        run = json.loads(args.run_one)
        run_one(Run(**run), Path(args.out), args.model)
        return
    name = args.name or f"study-{args.preset}"
    directory = Path(args.results_dir)
    out = directory / (f"{name}-memory.jsonl" if args.memory else f"{name}.jsonl")
    if not args.report:
        study(args.preset, out, args.model, args.budget_min, args.jobs or PRESETS[args.preset].jobs, args.memory)
    from benchmarks.study_report import write_report

    report = write_report(directory, name, args.preset)
    print(f"[study] wrote {report}", flush=True)


if __name__ == "__main__":
    main()
