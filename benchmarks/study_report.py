"""The study's report (``benchmarks/study.py --report``), computed from its JSONL results alone.

Intervals are two-sided 95% Student-t intervals over the reported seeds; a difference to LoRA is paired by seed (the
same seed gives both methods the same data order), so its interval is that of the per-seed differences.
"""

from __future__ import annotations

import datetime as _dt
import math
import statistics
from pathlib import Path
from typing import Optional

from benchmarks.study import CONFIG, Run, StudyConfig, grid_state, read_results, selection_loss

#: two-sided 95% quantiles of Student's t by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
GIB = 1024 ** 3


def interval(values: list[float]) -> tuple[float, float]:
    """``(mean, half-width)`` of the 95% t-interval; half-width nan with fewer than two values."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def fmt(mean: float, half: float, digits: int = 4) -> str:
    if math.isnan(half):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def final_report_loss(record: dict) -> float:
    return record["evals"][-1]["report_loss"]


def seed_records(results: dict, method: str, lr: float, preset: str,
                 config: StudyConfig = CONFIG) -> dict[int, dict]:
    found = {}
    for seed in config.preset(preset).seeds:
        record = results.get(Run(method, lr, seed, preset).key)
        if record is not None and not record.get("error"):
            found[seed] = record
    return found


def _grid_line(method, preset: str, results: dict, config: StudyConfig) -> tuple[str, Optional[float]]:
    if method.lr is not None:
        return "fixed by the config", method.lr
    missing, best = grid_state(method, preset, results, config.grid_limits)
    seen = sorted({r["run"]["lr"] for r in results.values()
                   if r["run"]["method"] == method.name and r["run"]["seed"] == 0 and not r["run"].get("memory")})
    parts = [f"{lr:g}: {selection_loss(results.get(Run(method.name, lr, 0, preset).key)):.3f}" for lr in seen]
    note = ""
    if best is not None and seen and best in (seen[0], seen[-1]):
        note = " (at the grid's edge: the limit of the search, or the next rate diverged)"
    return ", ".join(parts) + note, best


def write_report(directory: Path, name: str, preset: str, config: StudyConfig = CONFIG) -> Path:
    results = read_results(directory / f"{name}.jsonl")
    memory = read_results(directory / f"{name}-memory.jsonl")
    p = config.preset(preset)
    methods = config.methods_for(p.steps)
    title = "When does LISA win?" if config.name == "study" else f"Study {config.name}"
    chosen = "" if config.name == "study" else f"--config benchmarks/configs/{config.name}.json "
    lines = [f"# {title} ({name}, written {_dt.datetime.now().isoformat(timespec='seconds')})", ""]
    if config.name != "study":
        lines += [config.description, ""]
    lines += [f"Command: `python benchmarks/study.py {chosen}--preset {preset} --name {name}` (resumes; `--report` "
              "rewrites this file from the JSONL beside it).", "",
              f"Instruction task, {p.steps} steps of batch {p.batch} ({p.n_train} rows, seen once), {p.warmup} "
              f"warmup steps then cosine; held-out {p.n_heldout} rows: a selection half chooses each method's rate "
              f"at seed 0, the report half reports seeds {list(p.seeds)} (mean ± 95% t-interval). Δ LoRA: paired by "
              "seed. Exact match: greedy, on the report half.", ""]
    best: dict[str, Optional[float]] = {}
    lines += ["## Rate selection (seed 0, selection-half loss at the last step)", "", "| method | rates tried | best |",
              "|---|---|---|"]
    for m in methods.values():
        if m.parent is None:
            text, best[m.name] = _grid_line(m, preset, results, config)
            lines.append(f"| {m.name} | {text or '—'} | {best[m.name] if best[m.name] is not None else 'undecided'} |")
    lora = seed_records(results, "lora", best["lora"], preset, config) if best.get("lora") is not None else {}
    evals = p.eval_at
    lines += ["", "## Methods at their best rate, reported seeds", "",
              "| method | lr | seeds | report loss @T | Δ LoRA (paired) | exact match | loss @ " +
              " / ".join(str(s) for s in evals) + " | CPU s/step | peak RSS GiB | blocks trained (steps per block) "
              "| in regime |", "|---|---|--:|---|---|---|---|--:|--:|---|---|"]
    for m in methods.values():
        if m.parent is not None or best.get(m.name) is None:
            continue
        records = seed_records(results, m.name, best[m.name], preset, config)
        if not records:
            in_regime = p.steps >= m.min_steps
            state = ("(seeds not run yet)" if in_regime else
                     f"not in its regime (T = {p.steps} < {m.min_steps}): no seeds, not ranked")
            lines.append(f"| {m.name} | {best[m.name]:g} | 0 | {state} | | | | | | | {'yes' if in_regime else 'no'} |")
            continue
        losses = [final_report_loss(r) for r in records.values()]
        common = sorted(set(records) & set(lora))
        delta = ("—" if m.name == "lora" or len(common) < 1 else
                 fmt(*interval([final_report_loss(records[s]) - final_report_loss(lora[s]) for s in common])))
        matches = [r["exact_match"] for r in records.values()]
        curve = " / ".join(f"{statistics.fmean(e['report_loss'] for r in records.values() for e in r['evals'] if e['step'] == s):.3f}"
                           for s in evals)
        cover = [r["coverage"] for r in records.values()]
        blocks = statistics.fmean(c["distinct_blocks"] for c in cover)
        per_block = statistics.fmean(statistics.fmean(c["steps_per_block"].values()) if c["steps_per_block"] else 0
                                     for c in cover)
        lines.append(
            f"| {m.name} | {best[m.name]:g} | {len(records)} | {fmt(*interval(losses))} | {delta} | "
            f"{fmt(*interval(matches), digits=3)} | {curve} | "
            f"{statistics.fmean(r['cpu_s_per_step'] for r in records.values()):.2f} | "
            f"{max(r['peak_rss_bytes'] for r in records.values()) / GIB:.2f} | {blocks:.1f} of "
            f"{cover[0]['num_blocks']} ({per_block:.0f}) | {'yes' if all(r['in_regime'] for r in records.values()) else 'no: not ranked'} |")
    lines += ["", "## Diagnostics (seed 0, the parent's best rate)", "",
              "| run | parent | lr | report loss @T | exact match | blocks trained |", "|---|---|---|---|---|---|"]
    for m in methods.values():
        if m.parent is None:
            continue
        lr = best.get(m.parent)
        record = results.get(Run(m.name, lr, 0, preset).key) if lr is not None else None
        if record is None or record.get("error"):
            state = "not run yet" if record is None else f"failed: {record['error'][:80]}"
            lines.append(f"| {m.name} | {m.parent} | {lr if lr is not None else '—'} | {state} | | |")
            continue
        lines.append(f"| {m.name} | {m.parent} | {lr:g} | {final_report_loss(record):.4f} | "
                     f"{record['exact_match']:.3f} | {record['coverage']['distinct_blocks']} |")
    failed = [r for r in results.values() if r.get("error")]
    if failed:
        lines += ["", "## Failed runs", ""] + [f"- `{r['key']}`: {r['error'][:200]}" for r in failed]
    if memory:
        lines += ["", "## Memory at 1024-token rows, batch 1 (4 steps)", "",
                  "| method | gradient checkpointing | peak RSS GiB | CPU s/step |", "|---|---|--:|--:|"]
        for record in memory.values():
            if record.get("error"):
                lines.append(f"| {record['run']['method']} | {record['run']['memory']['gradient_checkpointing']} | "
                             f"failed: {record['error'][:80]} | |")
                continue
            lines.append(f"| {record['run']['method']} | {record['run']['memory']['gradient_checkpointing']} | "
                         f"{record['peak_rss_bytes'] / GIB:.2f} | {record['cpu_s_per_step']:.2f} |")
    path = directory / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
