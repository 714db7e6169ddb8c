"""Studies over ``compare.py``'s runs: LISA's levers, and a fair quality comparison over a learning-rate grid.

Each variant is one ``compare.py`` method run (a fresh process, the same preset, seed, data and steps) with a few
settings changed, so its figures are the same instrument's: median step time, CPU time, training-phase peak RSS,
optimizer-state bytes and eval loss.

* ``levers``: full-parameter LISA at the preset's γ and K (the reference), then one lever at a time: E+H frozen
  (``lisa_always_trainable=none``: backprop stops below the lowest active block), the importance and cyclic samplers,
  γ ∈ {1, 2, 4} and K ∈ {5, 20, 50}. Each row reports the eval-loss gain (step 0 minus the end), and that gain per GiB
  of peak memory and per 100 s of training (the steps' measured time, evaluations excluded); the best of each is
  named under the table.
* ``fair-lr``: full, LoRA, DoRA, LISA and the LISA adapter, each at three learning rates; each method's best rate
  (lowest final eval loss) is compared at equal steps and at equal wall time (the eval-loss curve of each method
  interpolated at the training time of the fastest best run).

Usage::

    python benchmarks/sweep.py --study levers            # make bench-levers
    python benchmarks/sweep.py --study fair-lr           # make bench-fair-lr
    python benchmarks/sweep.py --study fair-lr --steps 20 --name quick

Results go to ``benchmarks/results/<date>-<study>.{md,json,png}``, rewritten after every run, so an interrupted study
keeps the runs it finished.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

if __package__ in (None, ""):  # `python benchmarks/sweep.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import METHODS, PRESETS, Preset  # noqa: E402
from benchmarks.report import GIB, final_eval_loss, peak_memory_bytes  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: the learning-rate grid of the fair comparison, per family (the presets' single rates are the middle points)
LR_GRID = {"full-parameter": (3e-5, 1e-4, 3e-4), "adapter": (2e-4, 5e-4, 1.5e-3)}
FAIR_METHODS = ("full", "lora", "dora", "lisa", "lisa-adapter")


@dataclass(frozen=True)
class Variant:
    """One run of a study: a ``compare.py`` method under the preset with ``preset_overrides`` and ``lisa_extra``."""

    label: str
    method: str
    preset_overrides: dict = field(default_factory=dict)
    lisa_extra: dict = field(default_factory=dict)
    lever: str = ""

    def preset(self, base: Preset) -> Preset:
        extra = tuple(sorted({**dict(base.lisa_extra), **self.lisa_extra}.items()))
        return base.updated(**self.preset_overrides, lisa_extra=extra)


def lever_variants(base: Preset) -> list[Variant]:
    """The reference run and one lever changed at a time (duplicates of the reference are dropped)."""
    gamma, k = base.lisa_activated_layers, base.lisa_interval_steps
    variants = [Variant(f"lisa γ={gamma} K={k} uniform (reference)", "lisa", lever="reference")]
    variants.append(Variant("E+H frozen", "lisa", lisa_extra={"lisa_always_trainable": ["none"]}, lever="E+H"))
    for sampling in ("importance", "cyclic"):
        variants.append(Variant(f"sampler {sampling}", "lisa", lisa_extra={"lisa_sampling": sampling},
                                lever="sampler"))
    for g in (1, 2, 4):
        if g != gamma:
            variants.append(Variant(f"γ={g}", "lisa", {"lisa_activated_layers": g}, lever="γ"))
    for interval in (5, 20, 50):
        if interval != k:
            variants.append(Variant(f"K={interval}", "lisa", {"lisa_interval_steps": interval}, lever="K"))
    return variants


def fair_variants(base: Preset, methods: Sequence[str] = FAIR_METHODS) -> list[Variant]:
    """Every method at each rate of its family's grid."""
    from benchmarks.presets import METHODS

    variants = []
    for method in methods:
        family = METHODS[method].family
        key = "lr_adapter" if family == "adapter" else "lr_full_parameter"
        for lr in LR_GRID[family]:
            variants.append(Variant(f"{method} lr={lr:g}", method, {key: lr}, lever=method))
    return variants


# ----------------------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------------------
def run_variants(base: Preset, variants: Sequence[Variant], in_process: bool = False,
                 log: Callable[[str], None] = print,
                 on_result: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """Run each variant in a fresh process (``in_process`` for the smoke test) and return ``compare.py``'s results,
    each with ``label`` and ``lever`` added; ``on_result`` gets the results so far after each run."""
    from benchmarks import compare

    results = []
    with tempfile.TemporaryDirectory(prefix="hf-lisa-sweep-") as work_dir:
        for index, variant in enumerate(variants):
            log(f"[sweep] {index + 1}/{len(variants)} {variant.label} ...")
            preset = variant.preset(base)
            if in_process:
                result = compare.run_method(variant.method, preset, work_dir)
            else:
                result = compare._run_subprocess(variant.method, preset, work_dir, exact_match_before=False)
            result.update(label=variant.label, lever=variant.lever, lisa_extra=variant.lisa_extra,
                          preset_overrides=variant.preset_overrides)
            if result.get("ok"):
                log(f"[sweep] {variant.label}: eval loss {final_eval_loss(result):.4f}, "
                    f"{result['timing']['median_step_seconds']:.2f} s/step, "
                    f"peak {peak_memory_bytes(result) / GIB:.2f} GiB")
            else:
                log(f"[sweep] {variant.label} FAILED: {result.get('error')}")
            results.append(result)
            if on_result is not None:
                on_result(results)
    return results


# ----------------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------------
def training_seconds(result: dict, clock: str = "seconds") -> float:
    """The run's training time: the sum of its steps' measured times (evaluations excluded); ``clock`` is the steps'
    field to sum: ``"seconds"`` (wall time) or ``"cpu_seconds"`` (the process's CPU time)."""
    return sum(row[clock] for row in result["steps"])


def efficiency(result: dict) -> dict[str, Optional[float]]:
    """Eval-loss gain (step 0 minus the end) and that gain per GiB of peak memory and per second of training."""
    if not result.get("ok"):
        return {"gain": None, "per_gib": None, "per_second": None}
    gain = result["evals"][0][1] - result["evals"][-1][1]
    peak = peak_memory_bytes(result)
    seconds = training_seconds(result)
    return {"gain": gain, "per_gib": gain / (peak / GIB) if peak else None,
            "per_second": gain / seconds if seconds else None}


def eval_points_in_time(result: dict, clock: str = "seconds") -> list[tuple[float, float]]:
    """``(training seconds, eval loss)`` of each evaluation: the steps' measured times (their ``clock`` field)
    summed, evaluations excluded."""
    elapsed, at = 0.0, {0: 0.0}
    for row in result["steps"]:
        elapsed += row[clock]
        at[row["step"]] = elapsed
    return [(at[step], loss) for step, loss in result["evals"] if step in at]


def eval_loss_at_time(result: dict, seconds: float, clock: str = "seconds") -> Optional[float]:
    """The eval loss the run had reached after ``seconds`` of training (linear between evaluations; the training
    time of a step is its measured time, evaluation time excluded)."""
    points = eval_points_in_time(result, clock)
    if not points or seconds < points[0][0]:
        return None
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= seconds <= t1:
            return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0) if t1 > t0 else l1
    return points[-1][1]


def best_per_method(results: Sequence[dict]) -> dict[str, dict]:
    """The run with the lowest final eval loss of each method."""
    best: dict[str, dict] = {}
    for r in results:
        if r.get("ok") and (r["method"] not in best or final_eval_loss(r) < final_eval_loss(best[r["method"]])):
            best[r["method"]] = r
    return best


def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def render_levers(report: dict) -> str:
    rows = report["results"]
    lines = [f"# LISA's levers ({report['date']})", "", f"Command: `{report['command']}`", "",
             "| variant | final eval loss | gain | s/step | CPU s/step | peak GiB | optimizer state MiB | "
             "gain per GiB | gain per 100 s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['label']} | failed: {r.get('error')} | | | | | | | |")
            continue
        e = efficiency(r)
        lines.append(
            f"| {r['label']} | {final_eval_loss(r):.4f} | {e['gain']:.4f} | "
            f"{r['timing']['median_step_seconds']:.2f} | {_fmt(r['timing'].get('median_step_cpu_seconds'), '.2f')} | "
            f"{peak_memory_bytes(r) / GIB:.2f} | {r['optimizer_state']['max_bytes'] / 2**20:.1f} | "
            f"{_fmt(e['per_gib'])} | {_fmt(None if e['per_second'] is None else 100 * e['per_second'])} |")
    ok = [r for r in rows if r.get("ok")]
    if ok:
        lines += ["", f"Best eval loss: **{min(ok, key=final_eval_loss)['label']}**; best gain per GiB: "
                      f"**{max(ok, key=lambda r: efficiency(r)['per_gib'] or -1e9)['label']}**; best gain per "
                      f"second: **{max(ok, key=lambda r: efficiency(r)['per_second'] or -1e9)['label']}**."]
    return "\n".join(lines) + "\n"


def render_fair(report: dict) -> str:
    rows = report["results"]
    best = best_per_method(rows)
    lines = [f"# Fair comparison: each method at its best learning rate ({report['date']})", "",
             f"Command: `{report['command']}`", "", "| method | eval loss per learning rate | best rate |",
             "|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        cells = ", ".join(f"{r['learning_rate']:g}: {_fmt(final_eval_loss(r)) if r.get('ok') else 'failed'}"
                          for r in rows if r["method"] == method)
        lines.append(f"| {method} | {cells} | {best[method]['learning_rate']:g} |" if method in best
                     else f"| {method} | {cells} | — |")
    if best:
        train_time = {m: training_seconds(b) for m, b in best.items()}
        horizon = min(train_time.values())
        lines += ["", f"At the best rate; equal wall time = {horizon:.0f} s of training (the fastest method's run).",
                  "", "| method | final eval loss (equal steps) | eval loss at equal wall time | s/step | peak GiB |",
                  "|---|---|---|---|---|"]
        for method, b in sorted(best.items(), key=lambda kv: final_eval_loss(kv[1])):
            lines.append(f"| {method} | {final_eval_loss(b):.4f} | {_fmt(eval_loss_at_time(b, horizon))} | "
                         f"{b['timing']['median_step_seconds']:.2f} | {peak_memory_bytes(b) / GIB:.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """levers: gain per GiB and per 100 s of each variant; fair-lr: the eval-loss curves of each method's best rate
    against steps and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if r.get("ok")]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if report["study"] == "levers":
        labels = [r["label"] for r in ok]
        for ax, key, title in ((axes[0], "per_gib", "eval-loss gain per GiB of peak memory"),
                               (axes[1], "per_second", "eval-loss gain per 100 s of training")):
            values = [(efficiency(r)[key] or 0.0) * (100 if key == "per_second" else 1) for r in ok]
            ax.barh(labels, values)
            ax.invert_yaxis()
            ax.set_title(title)
    else:
        for method, best in best_per_method(ok).items():
            label = f"{method} (lr {best['learning_rate']:g})"
            axes[0].plot([s for s, _ in best["evals"]], [loss for _, loss in best["evals"]], marker="o", label=label)
            points = eval_points_in_time(best)
            axes[1].plot([t for t, _ in points], [loss for _, loss in points], marker="o", label=label)
        for ax, xlabel in ((axes[0], "optimizer step"), (axes[1], "training time (s, evaluations excluded)")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("eval loss")
            ax.set_yscale("log")
            ax.legend()
        axes[0].set_title("each method at its best learning rate: equal steps")
        axes[1].set_title("... and equal wall time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/sweep.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", required=True, choices=("levers", "fair-lr"))
    parser.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, help="Optimizer steps per run (default: the preset's).")
    parser.add_argument("--methods", help=f"fair-lr only: comma-separated methods of benchmarks/presets.py (default: "
                                          f"{', '.join(FAIR_METHODS)}).")
    parser.add_argument("--output-dir", default=str(RESULTS_DIR))
    parser.add_argument("--name", help="File stem (default: <date>-<study>).")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    base = PRESETS[ns.preset].updated(steps=ns.steps, exact_match_samples=0)
    if ns.study == "levers":
        variants = lever_variants(base)
    else:
        methods = [m.strip() for m in ns.methods.split(",")] if ns.methods else list(FAIR_METHODS)
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            parser.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
        variants = fair_variants(base, methods)
    started = _dt.datetime.now()
    stem = ns.name or f"{started:%Y-%m-%d}-{ns.study}"
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": started.isoformat(timespec="seconds"), "study": ns.study,
                              "command": "python benchmarks/sweep.py " + " ".join(argv), "results": []}

    def write(results: list[dict]) -> str:
        report.update(results=results, total_seconds=(_dt.datetime.now() - started).total_seconds())
        text = render_levers(report) if ns.study == "levers" else render_fair(report)
        done = f"{len(results)} of {len(variants)} runs"
        text += f"\nTotal runtime: {report['total_seconds'] / 60:.1f} min ({done}).\n"
        (out / f"{stem}.md").write_text(text)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        plot(report, out / f"{stem}.png")
        return text

    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results = run_variants(base, variants, log=log, on_result=write)
    print(write(results))
    return report


if __name__ == "__main__":
    report = main()
    sys.exit(0 if all(r.get("ok") for r in report["results"]) else 1)
