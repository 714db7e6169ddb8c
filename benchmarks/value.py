"""The value study: for each task and model, which method gives the best model for a budget of steps, time or memory.

Protocol, per (model, task): every method runs at each learning rate of its family's grid with seed 0; its best rate
(lowest final eval loss) then runs with the other seeds. Each run is one ``compare.py`` method run (its own process,
the same data, batch, steps and evaluation for every method, the peers BAdam and GaLore from their own packages), so
the figures are the harness's: eval loss every ``--eval-every`` steps, training time per step, peak RSS.

Reported at each method's best rate, over seeds (mean, and the min-max spread):

* **equal steps**: the final eval loss;
* **equal time**: the eval loss reached after the training time of the fastest method's run (each run's curve
  interpolated against its own steps' CPU seconds, which two runs side by side do not inflate; evaluations excluded);
* **equal memory**: each method's peak RSS, and the best eval loss any method reaches within that peak (a method is
  on the memory frontier when nothing that needs less memory does better).

Presets:

* ``cpu`` (what was run on 2 CPU cores): the embedded SmolLM2-135M-Instruct, 30 steps, 3 seeds, 2 runs at a time
  with one thread each;
* ``full`` (the protocol the issue asks for, sized for a GPU): SmolLM2-135M and SmolLM2-360M (``--models``; the 360M
  is read from the Hub or a local path), 300 steps, 3 seeds.

Usage::

    python benchmarks/value.py --preset cpu                        # make bench-value
    python benchmarks/value.py --preset full --models embedded,HuggingFaceTB/SmolLM2-360M-Instruct

Results go to ``benchmarks/results/<date>-value.{md,json,png}``, rewritten after every run, so an interrupted study
keeps what it finished; ``--budget-min`` stops starting runs after that many minutes (the table says what ran).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

if __package__ in (None, ""):  # `python benchmarks/value.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import METHODS, PRESETS  # noqa: E402
from benchmarks.report import GIB, final_eval_loss, peak_memory_bytes  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks.sweep import LR_GRID  # noqa: E402
from benchmarks.tasks import TASKS  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: the methods a user chooses between (issue 26): PEFT's LoRA, hf-lisa's two forms, the two installable peers
VALUE_METHODS = ("lora", "lisa", "lisa-adapter", "badam", "galore")
#: added on the classification task: the design's mixed sparse-QKV + dense-FFN adapter recipe
TASK_METHODS = {"classification": ("lisa-adapter-mixed",)}


@dataclass(frozen=True)
class StudyPreset:
    models: tuple[Optional[str], ...]  # None: the embedded SmolLM2-135M-Instruct
    tasks: tuple[str, ...]
    steps: int
    seeds: tuple[int, ...]
    eval_every: int
    jobs: int
    base: str = "cpu-small"


STUDIES = {
    "cpu": StudyPreset(models=(None,), tasks=("arithmetic", "instructions", "classification"), steps=30,
                       seeds=(0, 1, 2), eval_every=10, jobs=2),
    "full": StudyPreset(models=(None, "HuggingFaceTB/SmolLM2-360M-Instruct"),
                        tasks=("arithmetic", "instructions", "classification"), steps=300, seeds=(0, 1, 2),
                        eval_every=30, jobs=1, base="gpu"),
}


@dataclass(frozen=True)
class Run:
    model: Optional[str]
    task: str
    method: str
    lr: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.model or 'embedded'}|{self.task}|{self.method}|{self.lr:g}|{self.seed}"


def lr_overrides(method: str, lr: float) -> dict:
    return {"lr_adapter" if METHODS[method].family == "adapter" else "lr_full_parameter": lr}


def execute(run: Run, study: StudyPreset, work_dir: str, in_process: bool = False) -> dict:
    """One ``compare.py`` run in its own process (``in_process``: in this one, for the smoke test)."""
    from benchmarks import compare

    # no generation (its cost would dominate the short causal-LM runs); the classification task's accuracy is a
    # single forward pass over the eval rows and is always measured
    preset = PRESETS[study.base].updated(model=run.model, task=run.task, steps=study.steps, seed=run.seed,
                                         eval_every=study.eval_every, exact_match_samples=0,
                                         **lr_overrides(run.method, run.lr))
    run_dir = os.path.join(work_dir, run.key.replace("|", "_").replace("/", "_"))
    os.makedirs(run_dir, exist_ok=True)
    if in_process:
        result = compare.run_method(run.method, preset, run_dir)
    else:
        result = compare._run_subprocess(run.method, preset, run_dir, exact_match_before=False)
    result.update(run={"model": run.model, "task": run.task, "method": run.method, "lr": run.lr, "seed": run.seed})
    return result


# ----------------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------------
#: the clock of "equal time": each step's CPU seconds. With two runs side by side on a shared machine it is what the
#: run itself spent, and with one thread per run it equals the wall time of an undisturbed run
CLOCK = "cpu_seconds"


def training_seconds(result: dict) -> float:
    """The run's training time on :data:`CLOCK` (evaluations excluded)."""
    return sweep.training_seconds(result, CLOCK)


def eval_loss_at_time(result: dict, seconds: float) -> Optional[float]:
    """The eval loss the run had reached after ``seconds`` of training on :data:`CLOCK`."""
    return sweep.eval_loss_at_time(result, seconds, CLOCK)


def _runs(results: Sequence[dict], model, task, method=None, lr=None, seed=None) -> list[dict]:
    return [r for r in results if r.get("ok") and r["run"]["model"] == model and r["run"]["task"] == task
            and (method is None or r["run"]["method"] == method) and (lr is None or r["run"]["lr"] == lr)
            and (seed is None or r["run"]["seed"] == seed)]


def best_rate(results: Sequence[dict], model, task, method, search_seed: int = 0) -> Optional[float]:
    """The learning rate whose ``search_seed`` run ends with the lowest eval loss."""
    runs = _runs(results, model, task, method, seed=search_seed)
    return min(runs, key=final_eval_loss)["run"]["lr"] if runs else None


def _spread(values: Sequence[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(results: Sequence[dict], model, task, methods: Sequence[str]) -> dict[str, Any]:
    """Per method at its best rate: eval loss at equal steps / equal time over seeds, peak memory, frontier."""
    rows: dict[str, dict] = {}
    for method in methods:
        lr = best_rate(results, model, task, method)
        runs = _runs(results, model, task, method, lr=lr) if lr is not None else []
        if not runs:
            continue
        rows[method] = {"lr": lr, "runs": runs, "seeds": sorted(r["run"]["seed"] for r in runs),
                        "final": _spread([final_eval_loss(r) for r in runs]),
                        "train_seconds": statistics.fmean(training_seconds(r) for r in runs),
                        "s_per_step": statistics.fmean(r["timing"]["median_step_cpu_seconds"] for r in runs),
                        "peak_bytes": max(peak_memory_bytes(r) for r in runs),
                        "state_bytes": max(r["optimizer_state"]["max_bytes"] for r in runs),
                        "start": statistics.fmean(r["evals"][0][1] for r in runs),
                        "exact_match": (statistics.fmean(r["exact_match"] for r in runs)
                                        if all("exact_match" in r for r in runs) else None),
                        "lr_search": {r["run"]["lr"]: final_eval_loss(r)
                                      for r in _runs(results, model, task, method, seed=0)}}
    if not rows:
        return {"rows": rows, "horizon": None}
    horizon = min(row["train_seconds"] for row in rows.values())
    for row in rows.values():
        at_time = [eval_loss_at_time(r, horizon) for r in row["runs"]]
        row["at_time"] = _spread([v for v in at_time if v is not None]) if any(v is not None for v in at_time) else None
    for method, row in rows.items():
        cheaper = [m for m, o in rows.items() if o["peak_bytes"] <= row["peak_bytes"]]
        best = min(cheaper, key=lambda m: rows[m]["final"]["mean"])
        row["best_within_memory"] = best
        row["on_frontier"] = best == method
    return {"rows": rows, "horizon": horizon}


def _fmt_spread(s: Optional[dict]) -> str:
    if not s:
        return "—"
    return f"{s['mean']:.4f} ({s['min']:.4f}–{s['max']:.4f})" if s["n"] > 1 else f"{s['mean']:.4f}"


def render(report: dict) -> str:
    lines = [f"# Value study ({report['date']})", "", f"Command: `{report['command']}`", "",
             f"{report['protocol']}", ""]
    results = report["results"]
    for model in report["models"]:
        for task in report["tasks"]:
            summary = summarise(results, model, task, report["methods_by_task"][task])
            rows = summary["rows"]
            lines += [f"## {task} — {model or 'SmolLM2-135M-Instruct (embedded)'}", "",
                      f"{TASKS[task].description}. Equal time = {summary['horizon'] or 0:.0f} CPU seconds of training "
                      "(the fastest method's mean run; evaluations excluded).", "",
                      "| method | best lr (seed-0 loss per lr) | eval loss, equal steps: mean (min–max) | "
                      "eval loss, equal time | peak RSS GiB | opt. state MiB | best within this memory | "
                      "CPU s/step | " + ("accuracy" if TASKS[task].head == "seq-cls" else "exact match") + " |",
                      "|---|---|---|---|--:|--:|---|--:|--:|"]
            lora = rows.get("lora")
            for method, row in sorted(rows.items(), key=lambda kv: kv[1]["final"]["mean"]):
                search = ", ".join(f"{lr:g}: {loss:.3f}" for lr, loss in sorted(row["lr_search"].items()))
                ratio = f" ({row['final']['mean'] / lora['final']['mean']:.2f}x LoRA)" if lora else ""
                em = "—" if row["exact_match"] is None else f"{row['exact_match']:.3f}"
                lines.append(
                    f"| {method} | {row['lr']:g} ({search}) | {_fmt_spread(row['final'])}{ratio} | "
                    f"{_fmt_spread(row['at_time'])} | {row['peak_bytes'] / GIB:.2f} | {row['state_bytes'] / 2**20:.1f} "
                    f"| {row['best_within_memory']}{' (frontier)' if row['on_frontier'] else ''} | "
                    f"{row['s_per_step']:.2f} | {em} |")
            failed = [r for r in results if not r.get("ok") and r.get("run", {}).get("task") == task
                      and r.get("run", {}).get("model") == model]
            for r in failed:
                lines.append(f"\nFailed: {r['run']['method']} lr={r['run']['lr']:g} seed={r['run']['seed']}: "
                             f"{r.get('error')}")
            lines.append("")
    lines.append(f"Runs: {len([r for r in results if r.get('ok')])} finished, "
                 f"{len([r for r in results if not r.get('ok')])} failed or not run, of {report['planned']} planned; "
                 f"total {report.get('total_seconds', 0) / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Per task: eval loss against steps (mean over seeds at the best rate, min-max band) and against peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [(m, t) for m in report["models"] for t in report["tasks"]]
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 8), squeeze=False)
    for col, (model, task) in enumerate(tasks):
        rows = summarise(report["results"], model, task, report["methods_by_task"][task])["rows"]
        for method, row in rows.items():
            steps = [s for s, _ in row["runs"][0]["evals"]]
            curves = [[loss for _, loss in r["evals"]] for r in row["runs"] if len(r["evals"]) == len(steps)]
            mean = [statistics.fmean(c[i] for c in curves) for i in range(len(steps))]
            line, = axes[0][col].plot(steps, mean, marker="o", label=f"{method} (lr {row['lr']:g})")
            axes[0][col].fill_between(steps, [min(c[i] for c in curves) for i in range(len(steps))],
                                      [max(c[i] for c in curves) for i in range(len(steps))], alpha=0.2,
                                      color=line.get_color())
            f = row["final"]
            axes[1][col].errorbar([row["peak_bytes"] / GIB], [f["mean"]], yerr=[[f["mean"] - f["min"]],
                                  [f["max"] - f["mean"]]], fmt="o", color=line.get_color(), label=method, capsize=3)
        axes[0][col].set(title=f"{task}: eval loss, mean of seeds (band: min-max)", xlabel="optimizer step",
                         ylabel="eval loss", yscale="log")
        axes[1][col].set(title=f"{task}: final eval loss against peak RSS", xlabel="peak RSS (GiB)",
                         ylabel="eval loss")
        for ax in axes[:, col]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/value.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(STUDIES))
    parser.add_argument("--models", help="Comma-separated model paths or Hub ids ('embedded' for the packaged "
                                         "SmolLM2-135M-Instruct).")
    parser.add_argument("--tasks", help=f"Comma-separated tasks among {', '.join(TASKS)}.")
    parser.add_argument("--methods", help=f"Comma-separated methods (default: {', '.join(VALUE_METHODS)}, plus "
                                          "lisa-adapter-mixed on classification).")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seeds", type=int, help="Number of seeds (0, 1, ...); seed 0 also searches the rate.")
    parser.add_argument("--jobs", type=int, help="Runs at a time (each gets cores / jobs threads).")
    parser.add_argument("--budget-min", type=float, dest="budget_min",
                        help="Start no run after this many minutes; later runs are reported as not run.")
    parser.add_argument("--lr-grid", dest="lr_grid", help="Learning rates for every method instead of the family "
                                                           "grids, comma-separated.")
    parser.add_argument("--in-process", action="store_true", help="Run in this process, one at a time (smoke test; "
                                                                   "peak memory is then shared).")
    parser.add_argument("--from-json", dest="from_json", help="Render the tables and plot of a finished study's JSON "
                                                              "again (nothing is run).")
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    parser.add_argument("--name", help="File stem (default: <date>-value).")
    return parser


def _positive(parser, name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        parser.error(f"--{name}={value} is invalid; allowed: an integer >= 1.")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    for name in ("steps", "seeds", "jobs"):
        _positive(parser, name, getattr(ns, name))
    if ns.from_json:
        report = json.loads(Path(ns.from_json).read_text())
        stem = ns.name or Path(ns.from_json).stem
        out = Path(ns.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.md").write_text(text := render(report))
        if os.path.abspath(out / f"{stem}.json") != os.path.abspath(ns.from_json):
            (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        plot(report, out / f"{stem}.png")
        print(text)
        return report
    study = STUDIES[ns.preset]
    models = tuple(None if m.strip() == "embedded" else m.strip() for m in ns.models.split(",")) if ns.models \
        else study.models
    tasks = tuple(t.strip() for t in ns.tasks.split(",")) if ns.tasks else study.tasks
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(unknown)}; allowed: {', '.join(TASKS)}")
    methods = tuple(m.strip() for m in ns.methods.split(",")) if ns.methods else VALUE_METHODS
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    study = StudyPreset(models=models, tasks=tasks, steps=ns.steps or study.steps,
                        seeds=tuple(range(ns.seeds)) if ns.seeds else study.seeds, eval_every=study.eval_every,
                        jobs=ns.jobs or study.jobs, base=study.base)
    by_task = {t: methods + (() if ns.methods else TASK_METHODS.get(t, ())) for t in tasks}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // study.jobs)
    if not ns.in_process:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read by each run's torch at start
    grid = dict(LR_GRID)
    if ns.lr_grid:
        allowed = ("comma-separated positive numbers, or per family 'adapter=5e-4,1e-3;full-parameter=1e-4'")
        try:
            parts = [p.split("=", 1) if "=" in p else [None, p] for p in ns.lr_grid.split(";")]
            given = {family: tuple(float(v) for v in rates.split(",")) for family, rates in parts}
        except ValueError:
            parser.error(f"--lr-grid={ns.lr_grid!r} is invalid; allowed: {allowed}.")
        if None in given:
            given = {family: given[None] for family in grid}
        if set(given) - set(grid) or any(not r or min(r) <= 0 for r in given.values()):
            parser.error(f"--lr-grid={ns.lr_grid!r} is invalid; allowed: {allowed}.")
        grid.update(given)
    if ns.in_process:
        study = StudyPreset(**{**study.__dict__, "jobs": 1})
    search = [Run(m, t, meth, lr, study.seeds[0]) for m in models for t in tasks for meth in by_task[t]
              for lr in grid[METHODS[meth].family]]
    planned = len(search) + sum(len(by_task[t]) for t in tasks) * len(models) * (len(study.seeds) - 1)
    started = _dt.datetime.now()
    stem = ns.name or f"{started:%Y-%m-%d}-value"
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"), "command": "python benchmarks/value.py " + " ".join(argv),
        "models": list(models), "tasks": list(tasks), "methods_by_task": {t: list(v) for t, v in by_task.items()},
        "steps": study.steps, "seeds": list(study.seeds), "jobs": study.jobs, "planned": planned,
        "lr_grid": grid, "base_preset": study.base, "results": [],
        "protocol": (f"{study.steps} steps per run, batch {PRESETS[study.base].batch_size}, eval every "
                     f"{study.eval_every} steps on {PRESETS[study.base].eval_samples} held-out rows; learning rates "
                     f"{grid['adapter']} (adapters) and {grid['full-parameter']} (full-parameter: lisa, badam, "
                     f"galore), the best by seed {study.seeds[0]}'s final eval loss, then seeds {list(study.seeds)} "
                     f"at that rate; {study.jobs} run(s) at a time, {threads} thread(s) each; "
                     f"K = {PRESETS[study.base].lisa_interval_steps} (LISA's interval, BAdam's switch_block_every, "
                     f"GaLore's update_proj_gap), γ = {PRESETS[study.base].lisa_activated_layers}, "
                     f"r = {PRESETS[study.base].lora_r}."),
    }
    lock = threading.Lock()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731

    def write() -> str:
        report["total_seconds"] = (_dt.datetime.now() - started).total_seconds()
        text = render(report)
        (out / f"{stem}.md").write_text(text)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        plot(report, out / f"{stem}.png")
        return text

    def one(run: Run, work_dir: str) -> None:
        elapsed = (_dt.datetime.now() - started).total_seconds() / 60
        if ns.budget_min is not None and elapsed > ns.budget_min:
            result = {"ok": False, "error": f"not run: --budget-min {ns.budget_min:g} spent",
                      "run": {"model": run.model, "task": run.task, "method": run.method, "lr": run.lr,
                              "seed": run.seed}}
        else:
            log(f"[value] {run.key} ...")
            result = execute(run, study, work_dir, in_process=ns.in_process)
            log(f"[value] {run.key}: " + (f"eval loss {final_eval_loss(result):.4f}" if result.get("ok")
                                          else f"FAILED {result.get('error')}"))
        with lock:
            report["results"].append(result)
            write()

    with tempfile.TemporaryDirectory(prefix="hf-lisa-value-") as work_dir:
        with ThreadPoolExecutor(max_workers=study.jobs) as pool:
            list(pool.map(lambda r: one(r, work_dir), search))
        seeds = [Run(m, t, meth, lr, seed) for m in models for t in tasks for meth in by_task[t]
                 for lr in [best_rate(report["results"], m, t, meth)] if lr is not None for seed in study.seeds[1:]]
        with ThreadPoolExecutor(max_workers=study.jobs) as pool:
            list(pool.map(lambda r: one(r, work_dir), seeds))
    print(write())
    return report


if __name__ == "__main__":
    report = main()
    sys.exit(0 if all(r.get("ok") for r in report["results"]) else 1)
