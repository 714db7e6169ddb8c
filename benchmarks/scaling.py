"""Scaling preset: peak memory and s/step of full fine-tuning, LoRA and full-parameter LISA over model shapes and row
lengths, with the theoretical floor of every cell beside the measurement.

The grid is the SmolLM2 family's shapes (135M, 360M, 1.7B; random-initialised ``LlamaForCausalLM`` built from the
config: cost does not depend on the weights' values) times row lengths 128, 512 and 2048, one row per batch (no
padding, random tokens, labels = inputs). Each cell trains ``steps`` optimizer steps through the same pieces as
``hf-lisa train`` (``hf_lisa.trainer.methods.setup_method``, ``LisaTrainer``, AdamW at a constant learning rate) with
``benchmarks.measure``'s recorder, in a fresh process, so its peak RSS is its own (reset when training starts, Linux
``clear_refs``). The first step is a warm-up; s/step is the median of the others.

Before a cell runs, :func:`benchmarks.theory.config_floor` gives its floor (weights + gradients + AdamW state +
saved activations) from the config alone. A floor above ``fit_limit_gib`` is recorded as "does not fit" without
running; a floor above ``gate_gib`` runs only while the machine has floor + ``headroom_gib`` available, otherwise the
cell is deferred to the end of the grid and retried; a watchdog kills a cell when the machine's available memory
falls under ``guard_gib``, and a wall-clock timeout ends a cell that would not finish. Every outcome is a row of the
table. Results are rewritten after every cell, so an interrupted run keeps what it measured (``--resume`` continues).

Usage::

    make bench-scaling                                    # = python benchmarks/scaling.py (2 CPU cores: see README)
    python benchmarks/scaling.py --shapes SmolLM2-135M --seq-lens 128,512 --name quick
    python benchmarks/scaling.py --resume                 # keep finished cells of today's file, run the others

On a GPU, ``--gpu`` runs the same grid on the one GPU under bf16 autocast (``--no-autocast``: fp32), every cell in
this process with the CUDA peak reset, 10 steps a cell (3 of them warm-up), AdamW at 1e-5 (full-parameter) and 2e-4
(LoRA); cells whose floor exceeds the GPU's memory (less 2 GiB; ``--gpu-memory-gib``) are recorded as not fitting, and
no cell starts after ``--budget-s`` (480 s, so that the run with its start-up fits 10 minutes). Results are rewritten
after every cell (``gpu-scaling.json``/``.md``, ``.png`` at the end). ``--dry-run`` prints the cells and their floors
and trains nothing (no GPU needed)::

    timeout 590 python benchmarks/scaling.py --gpu --output-dir $OUT        # the day a GPU is lent
    python benchmarks/scaling.py --gpu --dry-run --gpu-memory-gib 141
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python benchmarks/scaling.py` puts benchmarks/ first, not the repo root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.measure import (  # noqa: E402
    child_pythonpath, cpu_name, current_rss_bytes, load_average, make_recorder, schedule_reader, state_kind,
    withheld_reader,
)
from benchmarks.presets import Preset  # noqa: E402
from benchmarks.scaling_report import render_markdown, plot_ratios  # noqa: E402
from benchmarks.theory import config_floor  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
WORKER_FLAG = "--worker"
GIB = 2**30

#: the SmolLM2 family (config.json of HuggingFaceTB/SmolLM2-{135M,360M,1.7B}); vocabulary 49152, tied E/H, head_dim 64
_SMOLLM2 = {"vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
SHAPES: dict[str, dict] = {
    "SmolLM2-135M": {**_SMOLLM2, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3},
    "SmolLM2-360M": {**_SMOLLM2, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5},
    "SmolLM2-1.7B": {**_SMOLLM2, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32},
}
SEQ_LENS: tuple[int, ...] = (128, 512, 2048)
METHODS: tuple[str, ...] = ("full", "lora", "lisa")
_BASE = Preset(name="scaling")  # learning rates, γ, rank and seed as in bench.json's presets


@dataclass(frozen=True)
class ScalingSettings:
    """What every cell shares. ``steps`` includes ``warmup_steps`` (left out of s/step); K is larger than ``steps``,
    so a cell measures one active set (a switch's cost is in the first step). ``threads``: torch's intra-op threads
    (0 keeps torch's default). One thread by default: on a shared CPU, two OpenMP threads per process slowed a step
    3-10x whenever the cores were oversubscribed, which no ratio survives."""

    steps: int = 3
    warmup_steps: int = 1
    batch_size: int = 1
    device: str = "cpu"
    threads: int = 1
    bf16: bool = False
    lr_full_parameter: float = _BASE.lr_full_parameter
    lr_adapter: float = _BASE.lr_adapter
    lisa_activated_layers: int = _BASE.lisa_activated_layers
    lisa_interval_steps: int = _BASE.lisa_interval_steps
    lora_r: int = _BASE.lora_r
    lora_alpha: float = _BASE.lora_alpha
    seed: int = _BASE.seed
    chunked_loss: bool = True


@dataclass(frozen=True)
class MemoryPolicy:
    """When a cell may run (sizes in GiB, of the memory ``available`` reports: host RAM, or the GPU's)."""

    fit_limit_gib: float = 22.0
    gate_gib: float = 8.0
    headroom_gib: float = 4.0
    guard_gib: float = 1.0
    timeout_s: float = 2400.0
    defer_wait_s: float = 600.0
    available: Callable[[], Optional[int]] = field(default=None, compare=False, repr=False)

    def available_bytes(self) -> Optional[int]:
        return (self.available or host_available_bytes)()


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` (what ``free`` calls available); ``None`` where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def decide(floor_bytes: int, available: Optional[int], policy: MemoryPolicy) -> tuple[str, str]:
    """``("run", "")``, ``("does-not-fit", why)`` or ``("defer", why)`` for a cell of floor ``floor_bytes``."""
    floor = floor_bytes / GIB
    if floor > policy.fit_limit_gib:
        return "does-not-fit", f"does not fit (floor {floor:.1f} GiB > {policy.fit_limit_gib:g} GiB limit)"
    if floor > policy.gate_gib:
        if available is None:
            return "defer", f"skipped: floor {floor:.1f} GiB > {policy.gate_gib:g} GiB and available memory unknown"
        need = floor + policy.headroom_gib
        if available / GIB <= need:
            return "defer", (f"skipped: needs floor {floor:.1f} + {policy.headroom_gib:g} GiB available, "
                             f"had {available / GIB:.1f} GiB")
    return "run", ""


def cell_floor(config_kwargs: dict, method: str, seq_len: int, settings: ScalingSettings) -> dict:
    """:func:`benchmarks.theory.config_floor` of one cell (fp32 weights; activations in bf16 under autocast)."""
    from transformers import LlamaConfig

    return config_floor(LlamaConfig(**config_kwargs), method, tokens=settings.batch_size * seq_len,
                        activated_layers=settings.lisa_activated_layers, lora_r=settings.lora_r,
                        param_bytes=4, act_bytes=2 if settings.bf16 else 4)


# ----------------------------------------------------------------------------------------------------------------------
# One cell, in this process
# ----------------------------------------------------------------------------------------------------------------------
def run_cell(cell: dict, settings: ScalingSettings, work_dir: str, progress_path: Optional[str] = None) -> dict:
    """Train one cell (``cell``: ``shape``, ``config`` kwargs, ``seq_len``, ``method``) and return its measurements."""
    rss_before_model = current_rss_bytes()
    load_start = load_average()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, set_seed

    from benchmarks.measure import setup_benchmarked_method
    from benchmarks.theory import parameter_inventory
    from hf_lisa.trainer import LisaTrainer, LisaTrainingArguments

    transformers.utils.logging.set_verbosity_error()
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    method, seq_len = cell["method"], cell["seq_len"]
    device = torch.device(settings.device)
    set_seed(settings.seed)
    cuda_at_start = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    config = LlamaConfig(**cell["config"], use_cache=False)
    t0 = time.perf_counter()
    with device:
        model = LlamaForCausalLM(config)
    init_seconds = time.perf_counter() - t0
    model, callbacks = setup_benchmarked_method(model, method, settings.seed, {
        "lisa_activated_layers": settings.lisa_activated_layers, "lisa_interval_steps": settings.lisa_interval_steps,
        "r": settings.lora_r, "lisa_alpha": settings.lora_alpha, "target_modules": ["all-linear"],
    })
    inventory = parameter_inventory(model)
    estimate_kwargs = {"act_bytes": 2 if settings.bf16 else 4,
                       "adapter_rank": settings.lora_r if method == "lora" else 0, "sparse": False,
                       "sparse_delta_elements": 0, "interpolation": False, "head_trains": method != "lora"}
    # the probe of saved activations runs in the warm-up step, which the timing leaves out
    recorder = make_recorder(inventory, state_kind(method), model.config, schedule_reader(callbacks, inventory),
                             withheld_reader(callbacks), device, estimate_kwargs, probe_step=1)

    class Progress(TrainerCallback):
        """After each step: the step times so far, for a cell the timeout ends."""

        def on_step_end(self, args, state, control, **kwargs):
            if progress_path:
                with open(progress_path, "w") as f:
                    json.dump({"step_seconds": [s["seconds"] for s in recorder.steps],
                               "step_cpu_seconds": [s["cpu_seconds"] for s in recorder.steps]}, f)

    class MeasuredTrainer(LisaTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            recorder.count_batch(inputs)
            with recorder.saved_tensors_probe(model, self.state.global_step):
                return super().training_step(model, inputs, num_items_in_batch)

    generator = torch.Generator().manual_seed(settings.seed)
    rows = [torch.randint(0, config.vocab_size, (seq_len,), generator=generator)
            for _ in range(settings.steps * settings.batch_size)]
    lr = settings.lr_adapter if method == "lora" else settings.lr_full_parameter
    args = LisaTrainingArguments(
        output_dir=os.path.join(work_dir, "trainer"), max_steps=settings.steps, chunked_loss=settings.chunked_loss,
        per_device_train_batch_size=settings.batch_size, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        logging_steps=1, eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
        seed=settings.seed, data_seed=settings.seed, use_cpu=device.type == "cpu", bf16=settings.bf16,
        dataloader_num_workers=0,
    )
    trainer = MeasuredTrainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows],
        data_collator=transformers.default_data_collator, callbacks=[recorder, Progress()] + callbacks,
    )
    trainer.train()

    steps = recorder.steps
    steady = [s for s in steps if s["step"] > settings.warmup_steps] or steps
    floor = cell_floor(cell["config"], method, seq_len, settings)
    peak = recorder.cuda_peak.get("max_allocated") if recorder.cuda_peak else recorder.peak_rss_train
    return {
        **{k: cell[k] for k in ("shape", "seq_len", "method")},
        "status": "ok",
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "total_params": inventory.total_params,
        "trainable_params": max(s["trainable_params"] for s in steps),
        "learning_rate": lr,
        "peak_bytes": peak,
        "peak_scope": "cuda max_allocated" if recorder.cuda_peak else f"RSS ({recorder.peak_scope})",
        "cuda_peak": recorder.cuda_peak,
        "cuda_allocated_at_start_bytes": cuda_at_start,
        "rss_before_model_bytes": rss_before_model,
        "rss_train_begin_bytes": recorder.rss_train_begin,
        "init_seconds": init_seconds,
        "step_seconds": [s["seconds"] for s in steps],
        "median_step_seconds": statistics.median(s["seconds"] for s in steady),
        "median_step_cpu_seconds": statistics.median(s["cpu_seconds"] for s in steady),
        "load_average": [load_start, load_average()],
        "tokens_per_second": sum(s["tokens"] for s in steady) / max(sum(s["seconds"] for s in steady), 1e-9),
        "train_loss": [recorder.train_loss.get(s["step"]) for s in steps],
        "optimizer_state_bytes": max(s["optimizer_state_bytes"] for s in steps),
        "expected_state_bytes": max(s["expected_state_bytes"] for s in steps),
        "activation_probe": recorder.probe,
        "floor": floor,
    }


# ----------------------------------------------------------------------------------------------------------------------
# The grid: each cell in a fresh process, under the memory policy
# ----------------------------------------------------------------------------------------------------------------------
def _proc_kib(pid: int, key: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _run_subprocess(cell: dict, settings: ScalingSettings, policy: MemoryPolicy, work_dir: str) -> dict:
    stem = os.path.join(work_dir, f"{cell['shape']}-{cell['seq_len']}-{cell['method']}")
    paths = {k: f"{stem}.{k}.json" for k in ("config", "result", "progress")}
    with open(paths["config"], "w") as f:
        json.dump({"cell": cell, "settings": asdict(settings), "work_dir": work_dir, "progress": paths["progress"]}, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.scaling", WORKER_FLAG, paths["config"],
                             paths["result"]], cwd=str(REPO_ROOT), env=env, stdout=sys.stderr, stderr=sys.stderr)
    stopped, hwm = "", 0
    while proc.poll() is None:
        time.sleep(0.5)
        hwm = max(hwm, _proc_kib(proc.pid, "VmHWM") or 0)
        elapsed = time.perf_counter() - started
        available = policy.available_bytes()
        if elapsed > policy.timeout_s:
            stopped = f"timed out after {policy.timeout_s:.0f} s"
        elif available is not None and available < policy.guard_gib * GIB:
            stopped = (f"aborted: the machine's available memory fell to {available / GIB:.1f} GiB (< "
                       f"{policy.guard_gib:g} GiB) with the cell at {hwm / GIB:.1f} GiB peak RSS")
        if stopped:
            proc.kill()
            proc.wait()
    seconds = time.perf_counter() - started
    if not stopped and os.path.exists(paths["result"]):
        with open(paths["result"]) as f:
            return {**json.load(f), "wall_seconds": seconds}
    progress = {"step_seconds": [], "step_cpu_seconds": []}
    if os.path.exists(paths["progress"]):
        with open(paths["progress"]) as f:
            progress = json.load(f)
    done = progress["step_seconds"]
    if stopped:
        stopped += f" ({len(done)} of {settings.steps} steps done)"
    return {**cell, "status": "timed-out" if stopped.startswith("timed out") else ("aborted" if stopped else "failed"),
            "reason": stopped or f"worker exited with code {proc.returncode} and wrote no result",
            **progress, "peak_bytes_seen": hwm or None, "wall_seconds": seconds}


def _worker_main(config_path: str, result_path: str) -> int:
    with open(config_path) as f:
        job = json.load(f)
    try:
        result = run_cell(job["cell"], ScalingSettings(**job["settings"]), job["work_dir"], job["progress"])
    except Exception as err:  # noqa: BLE001 - the parent records the failure in the table and goes on
        import traceback

        traceback.print_exc()
        result = {**job["cell"], "status": "failed", "reason": f"{type(err).__name__}: {err}"}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["status"] == "ok" else 1


def grid_cells(shapes: dict[str, dict], seq_lens: Sequence[int], methods: Sequence[str]) -> list[dict]:
    """Every cell, cheapest first: shapes in the given order, then row lengths, then methods."""
    return [{"shape": s, "config": shapes[s], "seq_len": n, "method": m}
            for s in shapes for n in seq_lens for m in methods]


def run_grid(
    cells: list[dict],
    settings: ScalingSettings,
    policy: MemoryPolicy,
    report: dict,
    save: Callable[[dict], None],
    in_process: bool = False,
    deadline: Optional[float] = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Run ``cells`` into ``report["cells"]`` (cells already there with a final status are kept), calling ``save``
    after each. ``deadline`` (a ``time.perf_counter()`` value): cells not started by then are recorded as not run."""
    kept = {_key(c): c for c in report.get("cells", []) if c.get("status") in ("ok", "does-not-fit", "timed-out")}
    results = dict(kept)
    report["cells"] = _in_grid_order(results)
    work_dir = tempfile.mkdtemp(prefix="hf-lisa-scaling-")

    def attempt(cell: dict, final: bool) -> bool:
        floor = cell_floor(cell["config"], cell["method"], cell["seq_len"], settings)
        verdict, why = decide(floor["total_bytes"], policy.available_bytes(), policy)
        if deadline is not None and time.perf_counter() > deadline and verdict != "does-not-fit":
            verdict, why = "not-run", "not run: the time budget was spent"
        if verdict == "defer" and not final:
            log(f"[scaling] {cell_name(cell)}: deferred ({why})")
            return False
        started = time.perf_counter()
        if verdict == "run":
            log(f"[scaling] {cell_name(cell)}: floor {floor['total_bytes'] / GIB:.2f} GiB, running ...")
            if in_process:
                try:
                    result = run_cell(cell, settings, work_dir)
                except Exception as err:  # noqa: BLE001 - a failed cell (CUDA out of memory too) is a row of the table
                    result = {**cell, "status": "failed", "reason": f"{type(err).__name__}: {err}".splitlines()[0]}
                result["wall_seconds"] = time.perf_counter() - started
                _release_memory()
            else:
                result = _run_subprocess(cell, settings, policy, work_dir)
        else:
            result = {**cell, "status": "skipped" if verdict == "defer" else verdict, "reason": why}
        result = {**{k: v for k, v in result.items() if k != "config"}, "floor": floor}
        results[_key(cell)] = result
        report["cells"] = _in_grid_order(results)
        save(report)
        log(f"[scaling] {cell_name(cell)}: " + (f"{result['peak_bytes'] / GIB:.2f} GiB peak, "
            f"{result['median_step_seconds']:.2f} s/step" if result["status"] == "ok" else result["reason"])
            + f" ({time.perf_counter() - started:.0f} s)")
        return True

    deferred = [c for c in cells if _key(c) not in kept and not attempt(c, final=False)]
    for cell in deferred:  # at the end, wait (up to defer_wait_s) for the memory the cell needs
        waited = 0.0
        floor = cell_floor(cell["config"], cell["method"], cell["seq_len"], settings)["total_bytes"]
        while (decide(floor, policy.available_bytes(), policy)[0] == "defer" and waited < policy.defer_wait_s
               and (deadline is None or time.perf_counter() < deadline)):
            time.sleep(10)
            waited += 10
        attempt(cell, final=True)
    return report


def _release_memory() -> None:
    """Between in-process cells: collect the last cell's model, and hand cached CUDA blocks back."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _key(cell: dict) -> tuple:
    return cell["shape"], cell["seq_len"], cell["method"]


def _in_grid_order(results: dict) -> list[dict]:
    """Every cell of ``results`` (a resumed file's cells as well as this call's), by shape, row length and method."""
    shapes = [s for s in SHAPES if any(k[0] == s for k in results)]
    shapes += list(dict.fromkeys(k[0] for k in results if k[0] not in SHAPES))
    methods = list(METHODS) + [m for m in dict.fromkeys(k[2] for k in results) if m not in METHODS]
    return [results[k] for k in sorted(results, key=lambda k: (shapes.index(k[0]), k[1], methods.index(k[2])))]


def cell_name(cell: dict) -> str:
    return f"{cell['shape']} x {cell['seq_len']} {cell['method']}"


def write_outputs(report: dict, output_dir: Path, stem: str, plot: bool = True) -> dict[str, str]:
    """Write ``<stem>.json`` and ``<stem>.md`` (and, with ``plot``, ``<stem>.png``); return their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: output_dir / f"{stem}.{ext}" for k, ext in (("json", "json"), ("markdown", "md"), ("plot", "png"))}
    report["files"] = {k: p.name for k, p in paths.items()}
    if plot:
        plot_ratios(report, str(paths["plot"]))
    for key, text in (("json", json.dumps(report, indent=1)), ("markdown", render_markdown(report))):
        partial = paths[key].with_suffix(paths[key].suffix + ".partial")
        partial.write_text(text)
        os.replace(partial, paths[key])
    return {k: str(p) for k, p in paths.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)), help="comma-separated row lengths")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per cell (default {ScalingSettings.steps}, the first a warm-up; --gpu: 10, "
                   "3 of them warm-up)")
    p.add_argument("--threads", type=int, default=ScalingSettings.threads,
                   help="torch threads per cell (0: torch's default)")
    p.add_argument("--timeout-s", type=float, default=MemoryPolicy.timeout_s, help="wall-clock limit of one cell")
    p.add_argument("--fit-limit-gib", type=float, default=MemoryPolicy.fit_limit_gib,
                   help="a floor above this is recorded as 'does not fit' without running")
    p.add_argument("--defer-wait-s", type=float, default=MemoryPolicy.defer_wait_s,
                   help="how long a deferred cell waits at the end for the memory it needs")
    p.add_argument("--chunked-loss", choices=("true", "false"), default="true",
                   help="hf-lisa train's --chunked_loss in every cell (default: true, its default)")
    p.add_argument("--in-process", action="store_true", help="run the cells in this process (peaks then overlap)")
    p.add_argument("--resume", action="store_true", help="keep the finished cells of the results file; run the rest")
    p.add_argument("--output-dir", default=str(RESULTS_DIR), help="where the results go (default: %(default)s)")
    p.add_argument("--name", help="file stem of the results (default: <date>-scaling; with --gpu, gpu-scaling)")
    p.add_argument("--gpu", action="store_true", help="the grid on this machine's one GPU, in this process (above)")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="--gpu: memory a cell may use (default: the GPU's total less 2 GiB; without a GPU, with "
                   "--dry-run, an H200's 141)")
    p.add_argument("--budget-s", type=float, default=480.0, help="--gpu: no cell starts after this many seconds")
    p.add_argument("--no-autocast", action="store_true", help="--gpu: fp32 instead of bf16 autocast")
    p.add_argument("--allow-cpu", action="store_true", help="--gpu without a GPU: the same run on CPU (smoke test)")
    p.add_argument("--dry-run", action="store_true", help="--gpu: print the cells and their floors, train nothing")
    return p


def parse_csv(value: str, allowed: Optional[Sequence] = None, flag: str = "", cast=str) -> list:
    try:
        items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}={value!r} is invalid; allowed: comma-separated integers.") from None
    bad = [v for v in items if (allowed is not None and v not in allowed) or (cast is int and v < 1)]
    if bad or not items:
        raise SystemExit(f"{flag}={value!r} is invalid; allowed: comma-separated "
                         + (", ".join(map(str, allowed)) if allowed is not None else "integers >= 1") + ".")
    return items


def _resumed_grid(report: dict, settings: ScalingSettings, shapes: dict, seq_lens: list, methods: list):
    """The grid a resumed results file reports: its own shapes, row lengths and methods plus this call's (a subset run
    adds cells, it does not shrink the table). Its cells must have been measured with this call's settings."""
    stored = {**asdict(ScalingSettings()), "chunked_loss": False, **report.get("settings", {})}  # older files: no key
    differ = {k: (stored[k], v) for k, v in asdict(settings).items() if stored.get(k) != v}
    if differ:
        raise SystemExit("--resume: the results file's cells were measured with other settings, so new cells would "
                         "not be comparable: " + ", ".join(f"{k}={a!r} there, {b!r} here" for k, (a, b) in
                                                           differ.items()) + ". Use the same settings or --name.")
    all_shapes = {**report.get("shapes", {}), **shapes}
    shapes = {name: all_shapes[name] for name in SHAPES if name in all_shapes}
    seq_lens = sorted(set(report.get("seq_lens", [])) | set(seq_lens))
    methods = [m for m in METHODS if m in set(report.get("methods", [])) | set(methods)]
    return shapes, seq_lens, methods


def run_on_gpu(ns: argparse.Namespace, argv: list[str], shapes: dict, seq_lens: list, methods: list) -> Optional[dict]:
    """``--gpu``: the grid on one GPU (bf16 autocast), every cell in this process, within ``--budget-s``."""
    import torch

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    if ns.gpu_memory_gib is not None:
        limit = ns.gpu_memory_gib
    elif cuda:
        limit = torch.cuda.get_device_properties(0).total_memory / GIB - 2
    else:
        limit = 141.0 - 2  # the plan of a dry run without a GPU: one H200
    steps = ns.steps or 10
    settings = ScalingSettings(steps=steps, warmup_steps=3 if steps > 3 else 1, device="cuda" if cuda else "cpu",
                               bf16=not ns.no_autocast and (cuda or ns.dry_run), threads=0,
                               lr_full_parameter=1e-5, lr_adapter=2e-4, chunked_loss=ns.chunked_loss == "true")
    # one process for every cell: no deferral (the gate equals the limit) and no host-memory guard
    policy = MemoryPolicy(fit_limit_gib=limit, gate_gib=limit, guard_gib=0.0, defer_wait_s=0.0, available=lambda: None)
    cells = grid_cells(shapes, seq_lens, methods)
    if ns.dry_run:
        print(f"scaling --gpu --dry-run: {len(cells)} cells, limit {limit:.0f} GiB, "
              f"{'bf16 autocast' if settings.bf16 else 'fp32'}, {settings.steps} steps ({settings.warmup_steps} "
              "warm-up)")
        for cell in cells:
            floor = cell_floor(cell["config"], cell["method"], cell["seq_len"], settings)["total_bytes"]
            verdict = decide(floor, None, policy)[1] or "would run"
            print(f"  {cell_name(cell):<32} floor {floor / GIB:7.2f} GiB  {verdict}")
        return None
    if not cuda and not ns.allow_cpu:
        raise SystemExit(f"--gpu: torch {torch.__version__} sees no CUDA device here; nothing was run (--dry-run "
                         "prints the plan; --allow-cpu runs it on CPU).")
    out, stem = Path(ns.output_dir), ns.name or "gpu-scaling"
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": "python benchmarks/scaling.py " + " ".join(argv),
              "settings": asdict(settings), "shapes": shapes, "seq_lens": seq_lens,
              "methods": list(dict.fromkeys(c["method"] for c in cells)), "in_process": True,
              "machine": {"gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
                          "gpu_memory_limit_gib": limit, "cpu_cores": os.cpu_count()}}

    def save(rep: dict) -> None:
        rep["total_seconds"] = time.perf_counter() - started
        write_outputs(rep, out, stem, plot=False)

    run_grid(cells, settings, policy, report, save, in_process=True, deadline=started + ns.budget_s,
             log=lambda message: print(message, flush=True))
    report["total_seconds"] = time.perf_counter() - started
    paths = write_outputs(report, out, stem)
    print(render_markdown(report))
    print(f"Wrote {paths['json']}, {paths['markdown']} and {paths['plot']} in {report['total_seconds']:.0f} s")
    return report


def main(argv: Optional[Sequence[str]] = None) -> Optional[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    shapes = {s: SHAPES[s] for s in parse_csv(ns.shapes, SHAPES, "--shapes")}
    seq_lens = parse_csv(ns.seq_lens, None, "--seq-lens", int)
    methods = parse_csv(ns.methods, METHODS, "--methods")
    if ns.steps is not None and ns.steps < 2:
        raise SystemExit(f"--steps={ns.steps} is invalid; allowed: an integer >= 2 (the first step is a warm-up).")
    if ns.gpu:
        return run_on_gpu(ns, argv, shapes, seq_lens, methods)
    gpu_only = [flag for flag, given in (("--dry-run", ns.dry_run), ("--no-autocast", ns.no_autocast),
                                         ("--allow-cpu", ns.allow_cpu), ("--gpu-memory-gib", ns.gpu_memory_gib))
                if given]
    if gpu_only:
        raise SystemExit(f"{', '.join(gpu_only)}: options of --gpu.")
    settings = ScalingSettings(steps=ns.steps or ScalingSettings.steps, threads=ns.threads,
                               chunked_loss=ns.chunked_loss == "true")
    policy = replace(MemoryPolicy(), timeout_s=ns.timeout_s, fit_limit_gib=ns.fit_limit_gib,
                     defer_wait_s=ns.defer_wait_s)
    started = _dt.datetime.now()
    stem, out = ns.name or f"{started:%Y-%m-%d}-scaling", Path(ns.output_dir)
    report: dict = {}
    run_shapes, run_seq_lens, run_methods = shapes, seq_lens, methods  # the cells this call runs
    if ns.resume and (out / f"{stem}.json").exists():
        report = json.loads((out / f"{stem}.json").read_text())
        shapes, seq_lens, methods = _resumed_grid(report, settings, shapes, seq_lens, methods)
    t0 = time.perf_counter() - report.get("total_seconds", 0.0)
    report.update({
        "date": report.get("date", started.isoformat(timespec="seconds")),
        "command": "python benchmarks/scaling.py " + " ".join(argv),
        "commands": report.get("commands", [report["command"]] if "command" in report else [])
        + ["python benchmarks/scaling.py " + " ".join(argv)],
        "settings": asdict(settings), "policy": {k: v for k, v in asdict(policy).items() if k != "available"},
        "shapes": shapes, "seq_lens": seq_lens, "methods": methods,
        "machine": {"cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "memory_gib": round((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / GIB, 1),
                    "platform": platform.platform(), "python": platform.python_version()},
        "in_process": ns.in_process,
    })

    def save(rep: dict) -> None:
        rep["total_seconds"] = time.perf_counter() - t0
        write_outputs(rep, out, stem, plot=False)

    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    run_grid(grid_cells(run_shapes, run_seq_lens, run_methods), settings, policy, report, save,
             in_process=ns.in_process, log=log)
    report["total_seconds"] = time.perf_counter() - t0
    paths = write_outputs(report, out, stem)
    print(render_markdown(report))
    log(f"[scaling] wrote {paths['markdown']}, {paths['json']} and {paths['plot']} in {report['total_seconds']:.0f} s")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == WORKER_FLAG:
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
    main()
