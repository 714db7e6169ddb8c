"""One prepared GPU check: ``make bench-peers``' comparison (LISA, LoRA, DoRA, full, the naive callback, LISA adapters,
BAdam, GaLore) on one GPU in under 10 minutes, with tokens/s and peak CUDA memory per method.

It runs the harness (``benchmarks/study.py``, the side-by-side protocol of ``configs/peers.json``), each method in
its own process, under the ``gpu`` preset (the embedded
SmolLM2-135M-Instruct in fp32 under bf16 autocast, the bundled task, batch 16) cut to ``--steps`` (default 100) with
K = 20, and no method starts after ``--budget_s`` (default 480 s). It then checks the paper's speed claim: LISA's
tokens/s at least ``--min_speedup`` (1.5) times LoRA's. Results in ``--output`` (default ``$OUT``, else ``./results``):
``gpu_check.md``/``.json`` (the per-method table and the check) beside ``gpu-compare.md``/``.json`` and its two
plots (the harness's full report; its records, ``gpu-compare.jsonl``, let a rerun into the same ``--output``
continue)::

    timeout 590 python benchmarks/gpu_check.py --output $OUT            # the day a GPU is lent
    python benchmarks/gpu_check.py --dry_run                            # the plan; needs no GPU

Exit status: 0 when every method ran and the check passed, 3 when the check failed, 1 when a method failed or was not
run. Without CUDA it says so, writes a "skipped" result and exits with 0 (``--allow_cpu`` runs the same harness on
CPU, for the smoke test, and leaves the check unjudged).

``--grid scaling`` runs instead the scaling preset's grid (``benchmarks/scaling.py``: SmolLM2-135M/360M/1.7B shapes,
random-initialised, x rows of 128/512/2048 tokens x full, LoRA, LISA) on the one GPU under bf16 autocast, each cell in
this process with the CUDA peak reset: peak allocated and reserved memory, tokens/s, s/step, and the theoretical floor
beside them. Cells whose floor exceeds the GPU's memory are recorded as not fitting; cells not started within
``--grid_budget_s`` (default 480 s, so that the script with its start-up fits 10 minutes) are recorded as not run.
Results are rewritten after every cell (``gpu-scaling.json``/``.md``, and ``.png`` at the end), so a kill keeps what
was measured. ``--dry_run`` prints the grid's cells and floors and trains nothing (works without a GPU)::

    timeout 590 python benchmarks/gpu_check.py --grid scaling --output $OUT     # the day a GPU is lent
    python benchmarks/gpu_check.py --grid scaling --dry_run --gpu_memory_gib 141
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # runnable from a checkout without installing hf-lisa
    sys.path.insert(0, str(REPO_ROOT))

#: exit status when every method ran but LISA's tokens/s fell short of --min_speedup times LoRA's
CHECK_FAILED = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=os.environ.get("OUT") or "results", help="directory for the JSON and markdown")
    p.add_argument("--model", default=None, help="local directory or Hub id; default: the embedded SmolLM2-135M")
    p.add_argument("--data", default=None, help="training file (the harness's --set data=...); default: the bundled task")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods of benchmarks/configs/bench.json, or 'peers' (the default: make bench-peers' "
                   "list); with --grid scaling, a subset of full,lora,lisa (default: all three)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per method")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s and step time")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=256, help="max_seq_length (rows are padded to the batch's longest)")
    p.add_argument("--eval_every", type=int, default=50, help="eval-loss interval (and at step 0 and at the end)")
    p.add_argument("--exact_match_samples", type=int, default=64, help="prompts scored by generation at the end")
    p.add_argument("--lisa_activated_layers", type=int, default=2, help="γ: blocks trained at a time (E+H+γL)")
    p.add_argument("--lisa_interval_steps", type=int, default=20,
                   help="K: switch every K steps (also BAdam's switch_block_every and GaLore's update_proj_gap)")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=None,
                   help="full-parameter methods (default: the gpu preset's 1e-4; --grid scaling: 1e-5)")
    p.add_argument("--lora_learning_rate", type=float, default=None,
                   help="adapter methods (default: the gpu preset's 5e-4; --grid scaling: 2e-4)")
    p.add_argument("--budget_s", type=float, default=480.0, help="no method starts after this many seconds")
    p.add_argument("--min_speedup", type=float, default=1.5, help="the check: LISA tokens/s >= this x LoRA's")
    p.add_argument("--no_autocast", action="store_true", help="fp32 instead of bf16 autocast")
    p.add_argument("--allow_cpu", action="store_true", help="run on CPU when there is no GPU (smoke test)")
    p.add_argument("--in_process", action="store_true", help="every method in this process (smoke test only)")
    p.add_argument("--grid", choices=("none", "scaling"), default="none",
                   help="'scaling': run benchmarks/scaling.py's grid on this GPU instead of the comparison")
    p.add_argument("--grid_shapes", default=None, help="comma-separated subset of the grid's shapes (default: all)")
    p.add_argument("--grid_seq_lens", default=None, help="comma-separated row lengths (default: 128,512,2048)")
    p.add_argument("--grid_steps", type=int, default=10, help="optimizer steps per grid cell")
    p.add_argument("--grid_warmup", type=int, default=3, help="grid steps left out of tokens/s and s/step")
    p.add_argument("--grid_budget_s", type=float, default=480.0, help="no grid cell starts after this many seconds")
    p.add_argument("--gpu_memory_gib", type=float, default=None,
                   help="memory a cell may use (default: the GPU's total less 2 GiB); with --dry_run and no GPU, "
                   "the memory the plan assumes")
    p.add_argument("--dry_run", action="store_true",
                   help="print the plan (the comparison's harness command, or the grid's cells and floors) and "
                   "train nothing")
    return p


def harness_argv(args, device: str) -> list[str]:
    """The harness's command line this check runs (``benchmarks/study.py``, the side-by-side protocol of
    ``configs/peers.json`` under its ``gpu`` preset)."""
    settings = {"device": device, "steps": args.steps, "timing_warmup_steps": args.warmup,
                "batch_size": args.batch_size, "seq_len": args.seq_len, "eval_every": args.eval_every,
                "exact_match_samples": args.exact_match_samples, "lisa_activated_layers": args.lisa_activated_layers,
                "lisa_interval_steps": args.lisa_interval_steps, "lora_r": args.lora_r}
    if args.no_autocast or device == "cpu":
        settings["bf16"] = "false"
    for key, value in (("data", args.data), ("lr_full_parameter", args.learning_rate),
                       ("lr_adapter", args.lora_learning_rate)):
        if value is not None:
            settings[key] = value
    argv = ["--config", str(REPO_ROOT / "benchmarks" / "configs" / "peers.json"), "--preset", "gpu", "--methods", args.methods or "peers",
            *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")],
            "--budget-min", f"{args.budget_s / 60:g}", "--results-dir", str(args.output), "--name", "gpu-compare"]
    if args.model is not None:
        argv += ["--model", str(args.model)]
    if args.in_process:
        argv.append("--in-process")
    return argv


def summarize(report: dict, min_speedup: float, command: str = "") -> dict:
    """Per method: tokens/s, peak CUDA memory, s/step, optimizer state, eval loss, exact match; and the check."""
    from benchmarks.report import final_eval_loss

    rows = []
    for r in report["results"]:
        if not r.get("ok"):
            rows.append({"method": r["method"], "error": r.get("error", "?")})
            continue
        cuda = r["memory"].get("cuda") or {}
        rows.append({
            "method": r["method"], "tokens_per_second": r["timing"]["tokens_per_second"],
            "median_step_seconds": r["timing"]["median_step_seconds"],
            "peak_allocated_bytes": cuda.get("max_allocated"), "peak_reserved_bytes": cuda.get("max_reserved"),
            "peak_rss_bytes": r["memory"].get("peak_rss_bytes"),
            "optimizer_state_bytes": r["optimizer_state"]["max_bytes"], "eval_loss": final_eval_loss(r),
            "exact_match": r.get("exact_match"), "trainable_params": r["params"]["trainable_max"],
        })
    ok = {row["method"]: row for row in rows if "error" not in row}
    check: dict[str, Any] = {"claim": f"LISA tokens/s >= {min_speedup:g} x LoRA's", "min_speedup": min_speedup}
    if "lisa" in ok and "lora" in ok:
        check["speedup"] = ok["lisa"]["tokens_per_second"] / ok["lora"]["tokens_per_second"]
        on_gpu = any(r.get("device") == "cuda" for r in report["results"] if r.get("ok"))
        check["passed"] = check["speedup"] >= min_speedup if on_gpu else None  # a CPU smoke run judges nothing
    else:
        check["passed"] = None
    return {"status": "ok", "command": command or report["command"], "harness_command": report["command"],
            "in_process": report.get("in_process", False), "date": report["date"],
            "total_seconds": report["total_seconds"], "device": _device_name(report), "rows": rows, "check": check,
            "full_report": report.get("files", {}).get("markdown")}


def _device_name(report: dict) -> str:
    ok = [r for r in report["results"] if r.get("ok")]
    return ok[0]["device_name"] if ok else "?"


def _gib(n: Optional[int]) -> str:
    return "–" if n is None else f"{n / 2**30:.2f}"


def render_markdown(summary: dict) -> str:
    if summary.get("status") != "ok":
        return f"# GPU check: {summary.get('status')}\n\n{summary.get('reason', '')}\n"
    ok = {row["method"]: row for row in summary["rows"] if "error" not in row}
    lora = ok.get("lora")
    lines = [f"# GPU check: {summary['device']}", "",
             f"`{summary['command']}` ({summary['date']}, {summary['total_seconds'] / 60:.1f} min). Every number "
             "comes from the harness, "
             + ("every method in one process (a smoke run)" if summary["in_process"] else
                "each method in its own process") + f"; its full report: `{summary['full_report']}`.", "",
             "| method | tokens/s | tokens/s vs LoRA | peak CUDA alloc. (GiB) | peak reserved (GiB) | peak vs LoRA "
             "| s/step | optimizer state (MiB) | eval loss | exact match |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in summary["rows"]:
        if "error" in row:
            lines.append(f"| `{row['method']}` | {row['error']} |" + " |" * 9)
            continue
        speed = f"{row['tokens_per_second'] / lora['tokens_per_second']:.2f}×" if lora else "–"
        peak = (f"{row['peak_allocated_bytes'] / lora['peak_allocated_bytes']:.2f}×"
                if lora and row["peak_allocated_bytes"] and lora["peak_allocated_bytes"] else "–")
        em = "–" if row["exact_match"] is None else f"{row['exact_match']:.3f}"
        loss = "–" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}"
        lines.append(f"| `{row['method']}` | {row['tokens_per_second']:,.0f} | {speed} | "
                     f"{_gib(row['peak_allocated_bytes'])} | {_gib(row['peak_reserved_bytes'])} | {peak} | "
                     f"{row['median_step_seconds']:.3f} | {row['optimizer_state_bytes'] / 2**20:.1f} | {loss} | {em} |")
    check = summary["check"]
    verdict = {True: "**passed**", False: "**failed**", None: "not judged (no GPU, or LISA or LoRA did not run)"}
    speedup = f"{check['speedup']:.2f}×" if "speedup" in check else "–"
    lines += ["", f"Check, {check['claim']}: measured {speedup}, {verdict[check['passed']]}."]
    return "\n".join(lines) + "\n"


def _write(output: Path, summary: dict) -> dict[str, str]:
    output.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output / "gpu_check.json", output / "gpu_check.md"
    json_path.write_text(json.dumps(summary, indent=1))
    md_path.write_text(render_markdown(summary))
    return {"json": str(json_path), "markdown": str(md_path)}


def run_comparison(args, output: Path, argv_given: Optional[Sequence[str]] = None) -> int:
    """The comparison: the harness's side-by-side protocol on this GPU, then the per-method table and the speed check."""
    if args.steps <= args.warmup:
        print(f"--steps={args.steps} must exceed --warmup={args.warmup}.", file=sys.stderr)
        return 2
    from benchmarks import study
    from benchmarks.presets import METHOD_SETS, METHODS

    methods = METHOD_SETS.get(args.methods or "peers") or [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        print(f"--methods={args.methods!r} is invalid; allowed: methods among {', '.join(METHODS)}, or one of "
              f"{', '.join(METHOD_SETS)}.", file=sys.stderr)
        return 2
    if args.dry_run:
        print("gpu_check --dry_run: would run, each method in its own process:\n  python benchmarks/study.py "
              + " ".join(harness_argv(args, "cuda")) + f"\nmethods: {', '.join(methods)}; then the check LISA "
              f"tokens/s >= {args.min_speedup:g} x LoRA's")
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        reason = (f"No CUDA device is visible to torch {torch.__version__} (cuda build: {torch.version.cuda}); "
                  "nothing was measured. Run this on a GPU machine, or pass --allow_cpu for a CPU smoke run.")
        paths = _write(output, {"status": "skipped", "reason": reason})
        print(f"gpu_check: {reason}\nWrote {paths['json']}")
        return 0
    report = study.main(harness_argv(args, "cuda" if cuda else "cpu"))
    summary = summarize(report, args.min_speedup, "python benchmarks/gpu_check.py " + " ".join(
        sys.argv[1:] if argv_given is None else argv_given))
    paths = _write(output, summary)
    print(render_markdown(summary))
    print(f"Wrote {paths['json']} and {paths['markdown']} beside {summary['full_report']}")
    if not all(r.get("ok") for r in report["results"]):
        return 1
    return CHECK_FAILED if summary["check"]["passed"] is False else 0


def run_scaling_grid(args, output: Path) -> int:
    """``--grid scaling``: the scaling preset's grid on one GPU (bf16 autocast), in this process, within the budget."""
    import dataclasses
    import time

    import torch

    from benchmarks import scaling

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    if args.grid_steps <= args.grid_warmup:
        print(f"--grid_steps={args.grid_steps} must exceed --grid_warmup={args.grid_warmup}.", file=sys.stderr)
        return 2
    try:
        names = scaling.parse_csv(args.grid_shapes or ",".join(scaling.SHAPES), scaling.SHAPES, "--grid_shapes")
        shapes = {s: scaling.SHAPES[s] for s in names}
        seq_lens = scaling.parse_csv(args.grid_seq_lens or ",".join(map(str, scaling.SEQ_LENS)), None,
                                     "--grid_seq_lens", int)
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    if args.gpu_memory_gib is not None:
        limit = args.gpu_memory_gib
    elif cuda:
        limit = torch.cuda.get_device_properties(0).total_memory / 2**30 - 2
    else:
        limit = 141.0 - 2  # the plan of a dry run without a GPU: one H200
    device = "cuda" if cuda else "cpu"
    settings = scaling.ScalingSettings(steps=args.grid_steps, warmup_steps=args.grid_warmup, device=device,
                                       bf16=not args.no_autocast and (cuda or args.dry_run), threads=0,
                                       lisa_activated_layers=args.lisa_activated_layers, lora_r=args.lora_r,
                                       lora_alpha=2.0 * args.lora_r,
                                       lr_full_parameter=1e-5 if args.learning_rate is None else args.learning_rate,
                                       lr_adapter=2e-4 if args.lora_learning_rate is None else args.lora_learning_rate)
    # one process for every cell: no deferral (the gate equals the limit) and no host-memory guard
    policy = scaling.MemoryPolicy(fit_limit_gib=limit, gate_gib=limit, guard_gib=0.0, defer_wait_s=0.0,
                                  available=lambda: None)
    methods = [m.strip() for m in (args.methods or ",".join(scaling.METHODS)).split(",")]
    cells = scaling.grid_cells(shapes, seq_lens, [m for m in scaling.METHODS if m in methods])
    if args.dry_run:
        precision = "bf16 autocast" if settings.bf16 else "fp32"
        print(f"gpu_check --grid scaling --dry_run: {len(cells)} cells, limit {limit:.0f} GiB, {precision}, "
              f"{settings.steps} steps ({settings.warmup_steps} warm-up)")
        for cell in cells:
            floor = scaling.cell_floor(cell["config"], cell["method"], cell["seq_len"], settings)["total_bytes"]
            verdict, why = scaling.decide(floor, None, policy)
            print(f"  {scaling.cell_name(cell):<32} floor {floor / 2**30:7.2f} GiB  {why or 'would run'}")
        return 0
    if not cuda and not args.allow_cpu:
        reason = (f"No CUDA device is visible to torch {torch.__version__}; the grid was not run (--dry_run prints "
                  "its plan; --allow_cpu runs it on CPU).")
        _write(output, {"status": "skipped", "reason": reason})
        print(f"gpu_check: {reason}")
        return 0
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": "python benchmarks/gpu_check.py "
              + " ".join(sys.argv[1:]), "settings": dataclasses.asdict(settings), "shapes": shapes,
              "seq_lens": seq_lens, "methods": list(dict.fromkeys(c["method"] for c in cells)), "in_process": True,
              "machine": {"gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
                          "gpu_memory_limit_gib": limit, "cpu_cores": os.cpu_count()}}

    def save(rep: dict) -> None:
        rep["total_seconds"] = time.perf_counter() - started
        scaling.write_outputs(rep, output, "gpu-scaling", plot=False)

    scaling.run_grid(cells, settings, policy, report, save, in_process=True, deadline=started + args.grid_budget_s,
                     log=lambda message: print(message, flush=True))
    report["total_seconds"] = time.perf_counter() - started
    paths = scaling.write_outputs(report, output, "gpu-scaling")
    print(scaling.render_markdown(report))
    print(f"Wrote {paths['json']}, {paths['markdown']} and {paths['plot']} in {report['total_seconds']:.0f} s")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    output = Path(args.output)
    args.output = output
    if args.grid == "scaling":
        try:
            import torch  # noqa: F401
        except ImportError:
            print("gpu_check: torch is not installed.", file=sys.stderr)
            return 2
        return run_scaling_grid(args, output)
    return run_comparison(args, output, argv)


if __name__ == "__main__":
    sys.exit(main())
