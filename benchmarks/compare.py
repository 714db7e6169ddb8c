"""Benchmark LISA against LoRA, full fine-tuning, the naive LISA callback and its peers, side by side in one run.

Every method trains the same model on the same data with the same seed, batch and steps, through the same pieces as
``hf-lisa train`` (``hf_lisa.trainer.methods.setup_method``, its ``Trainer`` subclass and ``hf_lisa.data``), each in its own
process so that peak memory is per method. The peers BAdam and GaLore come from their own packages and run in a plain
``transformers.Trainer`` as their docs say (``benchmarks/peers.py``). A measuring callback records, per optimizer step:
wall time, tokens, optimizer-state bytes (and what the shapes say they must be), trainable parameters, train loss;
eval loss at fixed steps; and, on the bundled task, generation exact match at the end. The results go to stdout
(markdown) and to ``benchmarks/results/<date>-<machine>.md`` with a JSON of every raw number and two PNG plots.

Usage::

    python benchmarks/compare.py --preset cpu-small            # what `make bench` runs (~20 min on 2 CPU cores)
    python benchmarks/compare.py --preset cpu-small --eval-every 20 --methods peers   # `make bench-peers`
    python benchmarks/compare.py --preset gpu                  # one GPU, bf16 autocast
    python benchmarks/compare.py --preset cpu-small --methods lisa,lora --steps 10 --model ./my-model --data train.jsonl

``--in-process`` runs every method in this process instead (faster to start, used by the smoke test): peak memory
is then shared between methods and the table says so.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence


REPO_ROOT = Path(__file__).resolve().parent.parent


if str(REPO_ROOT) not in sys.path:  # `python benchmarks/compare.py` puts benchmarks/ first, not the repo root
    sys.path.insert(0, str(REPO_ROOT))


from benchmarks.measure import current_rss_bytes, make_recorder, schedule_reader, state_kind, withheld_reader  # noqa: E402
from benchmarks.presets import METHOD_SETS, METHODS, PRESETS, Preset  # noqa: E402
from benchmarks.tasks import TASKS  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


WORKER_FLAG = "--worker"


def run_method(method: str, preset: Preset, work_dir: str, exact_match_before: bool = False,
               extra_callbacks: Sequence = ()) -> dict:
    """Train ``method`` under ``preset`` in this process and return every measurement as plain JSON data.

    ``extra_callbacks`` go to the Trainer after the method's own (tests use them to watch the weights move)."""
    wall_start = time.perf_counter()
    rss_start = current_rss_bytes()
    load_start = _load_average()
    import peft
    import torch
    import transformers
    from transformers import set_seed

    from benchmarks.naive_lisa import NaiveLisaCallback
    from benchmarks.peers import PEER_PACKAGES, package_version
    from benchmarks.theory import ACTIVATION_FORMULA, parameter_inventory
    from benchmarks.measure import setup_benchmarked_method
    from hf_lisa import data as data_lib
    from hf_lisa.evaluation import generation_exact_match, generation_rows
    from hf_lisa.models import (
        DEFAULT_MODEL_ID, default_model_path, is_default_model, load_model_and_tokenizer, quantization_config,
    )
    from hf_lisa.trainer import LisaTrainer

    spec = METHODS[method]
    transformers.utils.logging.set_verbosity_error()
    if preset.device == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_name = preset.device
    if device_name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch.cuda.is_available() is False; use --device cpu.")
    set_seed(preset.seed)
    from hf_lisa.optim import apply_cpu_allocator

    allocator = apply_cpu_allocator(preset.cpu_allocator, on_cpu=device_name == "cpu")  # as hf-lisa train does

    # -- data: the preset's task (benchmarks/tasks.py) unless --data names a file -------------------------------------
    from benchmarks import tasks as tasks_lib

    task = tasks_lib.TASKS[preset.task]
    bundled = preset.data is None
    seq_cls = bundled and task.head == "seq-cls"
    if bundled:
        train_file, validation_file = tasks_lib.task_files(preset.task)
    else:
        train_file, validation_file = preset.data, None
    if seq_cls:  # text + label rows: no chat rendering, no causal-LM format detection
        import datasets

        raw = datasets.load_dataset("json", data_files={"train": train_file, "validation": validation_file})
    else:
        raw = data_lib.load_raw_datasets(train_file=train_file, validation_file=validation_file, seed=preset.seed)
    if "validation" not in raw:
        raise ValueError(f"--data {preset.data!r} gave no validation split; the benchmark needs one for eval loss.")
    n_train = min(len(raw["train"]), preset.steps * preset.batch_size)
    raw["train"] = raw["train"].select(range(n_train))
    generation_source = raw["validation"]
    raw["validation"] = raw["validation"].select(range(min(preset.eval_samples, len(raw["validation"]))))
    rss_before_model = current_rss_bytes()

    # -- model ---------------------------------------------------------------------------------------------------------
    path = preset.model or default_model_path()
    base_model_id = DEFAULT_MODEL_ID if is_default_model(path) else path
    if seq_cls:
        model, tokenizer = tasks_lib.load_seq_cls(path, task.num_labels, preset.dtype, preset.seed)
        tokenized = tasks_lib.tokenize_classification(raw, tokenizer, preset.seq_len)
        report = data_lib.TokenizationReport(data_format="text+label", kept={k: len(v) for k, v in tokenized.items()})
        collator = transformers.DataCollatorWithPadding(tokenizer)
    else:
        model, tokenizer = load_model_and_tokenizer(
            path, dtype=preset.dtype, quantization_config=quantization_config(**spec.model_overrides, dtype=preset.dtype))
        tokenized, report = data_lib.tokenize_datasets(raw, tokenizer, max_seq_length=preset.seq_len)
        collator = data_lib.data_collator(tokenizer)
    from hf_lisa.trainer import LisaTrainingArguments
    from hf_lisa.trainer.training_args import TRAINER_OPTIONS

    overrides = {**spec.lisa_overrides, **dict(preset.lisa_extra)}
    trainer_settings = {name: overrides.pop(name) for name in list(overrides) if name in TRAINER_OPTIONS}
    trainer_settings.update(chunked_loss=preset.chunked_loss, cpu_allocator=preset.cpu_allocator)
    model, callbacks = setup_benchmarked_method(model, spec.train_method, preset.seed, {
        "lisa_activated_layers": preset.lisa_activated_layers,
        "lisa_interval_steps": preset.lisa_interval_steps,
        "r": preset.lora_r,
        "lisa_alpha": preset.lora_alpha,
        "target_modules": ["all-linear"],
        "importance_steps": preset.importance_steps,
        **overrides,
    })
    lr = preset.lr_adapter if spec.family == "adapter" else preset.lr_full_parameter
    if spec.naive:
        callbacks = callbacks + [
            NaiveLisaCallback(n_layers=preset.lisa_activated_layers, interval_steps=preset.lisa_interval_steps,
                              seed=preset.seed)
        ]
    inventory = parameter_inventory(model)
    peer = None
    if spec.peer:  # BAdam / GaLore from their own packages, in a plain transformers.Trainer (benchmarks/peers.py)
        from benchmarks.peers import setup_peer

        peer = setup_peer(spec.peer, model, inventory, preset, lr, device_name)
    sparse = bool(spec.lisa_overrides.get("sparsity"))
    # the packed sparse masks are part of what the adapter must hold: 1 bit per weight element
    mask_bytes = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "lisa_mask" in n)
    device = torch.device(device_name)
    kind = state_kind(method, preset.lisa_extra)
    estimate_kwargs = {
        "act_bytes": 2 if (preset.bf16 or preset.dtype in ("bfloat16", "float16")) else 4,
        "adapter_rank": preset.lora_r if spec.family == "adapter" else 0,
        "sparse": sparse,
        # a sparse adapter materialises M ⊙ (B A) per adapted linear: the block's linear weights once more
        "sparse_delta_elements": sum(p.numel() for p in inventory.block_base[0] if p.dim() == 2) if sparse else 0,
        "interpolation": bool(spec.lisa_overrides.get("layer_interpolation")),
        "head_trains": peer.head_trains if peer else spec.family == "full-parameter" and kind != "lisa-blocks",
    }
    probe_step = min(preset.timing_warmup_steps + 1, preset.steps)
    # bitsandbytes' 8-bit AdamW: its own state layout; the Trainer keeps nn.Embedding weights (a tied E/H) at 32 bits
    state_bytes, state_formula = None, None
    if "bnb_8bit" in str(spec.training_overrides.get("optim", "")):
        from benchmarks.theory import adamw8bit_state_bytes

        fp32 = set() if trainer_settings.get("optim_8bit_embeddings") else {
            id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        state_bytes = functools.partial(adamw8bit_state_bytes, fp32=fp32)
        state_formula = "bitsandbytes 8-bit AdamW" + ("" if trainer_settings.get("optim_8bit_embeddings") else
                                                      ", E/H state at 32 bits")
    recorder = make_recorder(inventory, kind, model.config, schedule_reader(callbacks, inventory, peer),
                              withheld_reader(callbacks),
                              device, estimate_kwargs, probe_step, state_bytes=state_bytes, peer=peer)
    if peer:
        from benchmarks.peers import peer_trainer_class

        base, state_formula = peer_trainer_class(), peer.state_formula
        trainer_kwargs = {"optimizers": peer.optimizers, "chunked_loss": preset.chunked_loss,
                          "cpu_allocator": preset.cpu_allocator}  # the peers' Trainer takes these as keywords
    else:
        base = LisaTrainer
        trainer_kwargs = {}

    class MeasuredTrainer(base):
        """The method's Trainer (``hf-lisa train``'s; a plain ``transformers.Trainer`` for a peer), counting the
        tokens of every micro-batch (and, in one step, the bytes autograd saves)."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            recorder.count_batch(inputs)
            with recorder.saved_tensors_probe(model, self.state.global_step):
                return super().training_step(model, inputs, num_items_in_batch)

    args = LisaTrainingArguments(**{**dict(trainer_settings,
        output_dir=os.path.join(work_dir, method),
        max_steps=preset.steps,
        per_device_train_batch_size=preset.batch_size,
        per_device_eval_batch_size=max(preset.batch_size, 8),
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch_fused" if device_name == "cuda" else "adamw_torch",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=preset.eval_every,
        prediction_loss_only=True,  # no logits kept: a 49k-vocab eval set would dominate peak memory
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=preset.seed,
        data_seed=preset.seed,
        use_cpu=device_name == "cpu",
        bf16=preset.bf16,
        dataloader_num_workers=0,
    ), **spec.training_overrides, **(peer.training_overrides if peer else {})})
    trainer = MeasuredTrainer(
        model=model,
        args=args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        processing_class=tokenizer,
        data_collator=collator,
        callbacks=[recorder] + callbacks + list(extra_callbacks),
        **trainer_kwargs,
    )

    # -- the same generation prompts before (once per run) and after ---------------------------------------------------
    chat = data_lib.use_chat_template(tokenizer, "auto")
    gen_rows: list[dict] = []
    if (bundled and not seq_cls and preset.exact_match_samples
            and report.data_format in ("prompt_completion", "messages")):
        gen_rows = generation_rows(generation_source, report.data_format, preset.exact_match_samples)

    def exact_match() -> tuple[float, float]:
        started = time.perf_counter()
        score, _ = generation_exact_match(
            # one batch for the preset's 32 prompts: 0.85x the time of two batches of 16 (1 thread, SmolLM2-135M)
            trainer.model, tokenizer, gen_rows, chat, max_new_tokens=32, batch_size=32,
            answer_pattern=task.answer_pattern, lenient=task.answer_pattern is not None,
        )
        return score, time.perf_counter() - started

    result: dict[str, Any] = {}
    if gen_rows and exact_match_before:
        result["exact_match_before"], _ = exact_match()
    trainer.evaluate()  # step 0: every method starts from the same function (adapters start at zero)
    trainer.train()
    if not recorder.evals or recorder.evals[-1][0] != trainer.state.global_step:
        trainer.evaluate()
    if gen_rows:
        result["exact_match"], result["exact_match_seconds"] = exact_match()
    if seq_cls:  # the classification task's exact match: argmax accuracy on the eval rows
        result["exact_match"] = tasks_lib.classification_accuracy(trainer.model, tokenized["validation"], collator)

    steps = recorder.steps
    eval_steps = {s for s, _ in recorder.evals}
    steady = [r for r in steps if r["step"] > preset.timing_warmup_steps and r["step"] not in eval_steps
              and r["step"] != recorder.probe_step]
    if not steady:  # very short runs (the smoke test): time every step
        steady = steps
    state_measured = [r["optimizer_state_bytes"] for r in steps]
    grads = max(r["grad_bytes"] for r in steps)
    state_floor = max(r["expected_state_bytes"] for r in steps)
    activations = max(r["activation_bytes"] for r in steps)
    weights = inventory.weight_bytes + mask_bytes
    cuda = torch.cuda.get_device_name(device) if device_name == "cuda" else None
    result.update(
        {
            "method": method,
            "description": spec.description,
            "family": spec.family,
            "train_method": spec.train_method,
            "state_kind": kind,
            "state_formula": state_formula,
            "optimizer": {"optim": ("badam.BlockOptimizer(torch.optim.AdamW)" if spec.peer == "badam"
                                    else str(getattr(args.optim, "value", args.optim))),
                          "max_grad_norm": args.max_grad_norm,
                          "step_in_backward": bool(trainer_settings.get("optim_step_in_backward"))},
            "peer": ({"package": PEER_PACKAGES[spec.peer], "version": package_version(spec.peer),
                      "trainer": "transformers.Trainer", "settings": peer.settings} if peer else None),
            "cpu_allocator": {"policy": preset.cpu_allocator, "applied": allocator,
                              "trims": trainer.heap_trim.calls if trainer.heap_trim is not None else 0},
            "chunked_loss": trainer.chunked_loss,
            "training_overrides": {**spec.training_overrides, **(peer.training_overrides if peer else {})},
            "learning_rate": lr,
            "ok": True,
            "device": device_name,
            "device_name": cuda or _cpu_name(),
            "threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__, "python": platform.python_version()},
            "model": base_model_id,
            "data": task.description if bundled else preset.data,
            "task": preset.task if bundled else None,
            "data_format": report.data_format,
            "train_rows": report.kept.get("train"),
            "eval_rows": report.kept.get("validation"),
            "inventory": inventory.summary(),
            "steps": steps,
            "evals": recorder.evals,
            "train_loss": {str(k): v for k, v in sorted(recorder.train_loss.items())},
            "timing": {
                "median_step_seconds": _median([r["seconds"] for r in steady]),
                # CPU time of all the process's threads: less sensitive than wall time to other load on a shared host
                "median_step_cpu_seconds": _median([r["cpu_seconds"] for r in steady]),
                "tokens_per_second": sum(r["tokens"] for r in steady) / max(sum(r["seconds"] for r in steady), 1e-9),
                "steady_steps": [r["step"] for r in steady],
                "setup_seconds": (recorder.t_first_step or recorder.t_train_begin) - recorder.t_train_begin,
                "train_seconds": recorder.t_train_end - recorder.t_train_begin,
                "wall_seconds": time.perf_counter() - wall_start,
                # other processes on the machine: 1-minute load average when this method started and ended
                "load_average": [load_start, _load_average()],
            },
            "optimizer_state": {
                "max_bytes": max(state_measured),
                "final_bytes": state_measured[-1],
                "max_abs_diff_from_formula": max(abs(r["optimizer_state_bytes"] - r["expected_state_bytes"])
                                                 for r in steps),
                "steps_equal_to_formula": sum(r["optimizer_state_bytes"] == r["expected_state_bytes"] for r in steps),
            },
            "params": {
                "total": inventory.total_params,
                "trainable_max": max(r["trainable_params"] for r in steps),
                "trainable_final": steps[-1]["trainable_params"],
            },
            "memory": {
                "peak_scope": recorder.peak_scope,
                "rss_start_bytes": rss_start,
                "rss_before_model_bytes": rss_before_model,
                "rss_train_begin_bytes": recorder.rss_train_begin,
                "peak_rss_bytes": recorder.peak_rss_train,
                "cuda": recorder.cuda_peak,
            },
            "floor": {
                "weights_bytes": weights,
                "grad_bytes": grads,
                "optimizer_state_bytes": state_floor,
                "activation_bytes": activations,
                "mask_bytes": mask_bytes,
                "total_bytes": weights + grads + state_floor + activations,
                "activation_bytes_per": "max over steps of the estimate for that step's batch and active blocks",
                "activation_formula": ACTIVATION_FORMULA,
                "activation_dtype_bytes": estimate_kwargs["act_bytes"],
                "activation_probe": recorder.probe,
            },
        }
    )
    return result


def _load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _worker_main(config_path: str, result_path: str) -> int:
    with open(config_path) as f:
        config = json.load(f)
    preset = Preset(**{**config["preset"], "methods": tuple(config["preset"]["methods"])})
    try:
        result = run_method(config["method"], preset, config["work_dir"], config.get("exact_match_before", False))
    except Exception as err:  # the parent reports the failure in the table and moves on to the next method
        import traceback

        traceback.print_exc()
        result = {"method": config["method"], "ok": False, "error": f"{type(err).__name__}: {err}"}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


# ----------------------------------------------------------------------------------------------------------------------
# Parent: run every method, then report
# ----------------------------------------------------------------------------------------------------------------------
def _preset_dict(preset: Preset) -> dict:
    from dataclasses import asdict

    data = asdict(preset)
    data["methods"] = list(preset.methods)
    return data


def run_all(preset: Preset, methods: Sequence[str], in_process: bool = False, log=print,
            budget_s: Optional[float] = None) -> list[dict]:
    """Run every method (each in a fresh Python process unless ``in_process``) and return their results in order.

    With ``budget_s``, a method not started within that many seconds is recorded as not run (``ok`` False)."""
    results = []
    work_dir = tempfile.mkdtemp(prefix="hf-lisa-bench-")
    begin = time.perf_counter()
    try:
        for index, method in enumerate(methods):
            started = time.perf_counter()
            if budget_s is not None and started - begin > budget_s:
                log(f"[bench] {index + 1}/{len(methods)} {method}: not run (--budget-s {budget_s:g} spent)")
                results.append({"method": method, "ok": False, "in_process": in_process,
                                "error": f"not run: the time budget (--budget-s {budget_s:g}) was spent"})
                continue
            log(f"[bench] {index + 1}/{len(methods)} {method} ...")
            first = index == 0
            if in_process:
                try:
                    result = run_method(method, preset, work_dir, exact_match_before=first)
                except Exception as err:
                    import traceback

                    traceback.print_exc()
                    result = {"method": method, "ok": False, "error": f"{type(err).__name__}: {err}"}
            else:
                result = _run_subprocess(method, preset, work_dir, exact_match_before=first)
            result["in_process"] = in_process
            results.append(result)
            if result.get("ok"):
                timing = result["timing"]
                log(f"[bench] {method}: {timing['median_step_seconds']:.3f} s/step, "
                    f"peak {_gib(_peak_bytes(result)):.2f} GiB, optimizer state "
                    f"{result['optimizer_state']['max_bytes'] / 2**20:.1f} MiB, final eval loss "
                    f"{result['evals'][-1][1]:.4f} ({time.perf_counter() - started:.0f} s)")
            else:
                log(f"[bench] {method} FAILED: {result.get('error')}")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return results


def _run_subprocess(method: str, preset: Preset, work_dir: str, exact_match_before: bool) -> dict:
    config_path = os.path.join(work_dir, f"{method}.config.json")
    result_path = os.path.join(work_dir, f"{method}.result.json")
    with open(config_path, "w") as f:
        json.dump({"method": method, "preset": _preset_dict(preset), "work_dir": work_dir,
                   "exact_match_before": exact_match_before}, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the worker's own output goes to our stderr: stdout carries only the table
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", WORKER_FLAG, config_path, result_path],
        cwd=str(REPO_ROOT), env=env, stdout=sys.stderr, stderr=sys.stderr,
    )
    if os.path.exists(result_path):
        with open(result_path) as f:
            return json.load(f)
    return {"method": method, "ok": False, "error": f"worker exited with code {proc.returncode} and wrote no result"}


def _gib(n: Optional[float]) -> float:
    return float("nan") if n is None else n / 2**30


def _peak_bytes(result: dict) -> Optional[int]:
    memory = result["memory"]
    return memory["cuda"].get("max_allocated") if memory.get("cuda") else memory.get("peak_rss_bytes")


def machine_slug(results: list[dict]) -> str:
    """``cpu2`` (device and cores) or e.g. ``nvidia-h200``, for the results file name."""
    ok = [r for r in results if r.get("ok")]
    if ok and ok[0]["device"] == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", ok[0]["device_name"].lower()).strip("-")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu{cores}"


def write_outputs(report: dict, output_dir: Path, stem: str) -> dict[str, str]:
    """Write ``<stem>.md``, ``<stem>.json`` and the two PNG plots; return their paths."""
    from benchmarks.report import plot_eval_loss, plot_optimizer_state, render_markdown

    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": str(output_dir / f"{stem}.md"),
        "json": str(output_dir / f"{stem}.json"),
        "eval_loss_plot": str(output_dir / f"{stem}-eval-loss.png"),
        "optimizer_state_plot": str(output_dir / f"{stem}-optimizer-state.png"),
    }
    report["files"] = {k: os.path.basename(v) for k, v in paths.items()}
    plot_eval_loss(report, paths["eval_loss_plot"])
    plot_optimizer_state(report, paths["optimizer_state_plot"])
    with open(paths["markdown"], "w") as f:
        f.write(render_markdown(report))
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/compare.py",
        description="Benchmark LISA against LoRA, full fine-tuning, the naive LISA callback and its peers (BAdam, "
        "GaLore), side by side.",
    )
    parser.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS),
                        help="Base settings (default: cpu-small).")
    parser.add_argument("--methods", help=f"Comma-separated methods among: {', '.join(METHODS)}; or one of "
                        + ", ".join(f"'{k}' ({','.join(v)})" for k, v in METHOD_SETS.items())
                        + ". Default: the preset's (= 'default').")
    parser.add_argument("--model", help="Model path or Hub id (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--data", help="Training file hf-lisa train accepts (.jsonl/.json/.csv/.parquet/.txt); "
                        "default: the bundled arithmetic task. 5%% is held out for eval loss.")
    parser.add_argument("--task", choices=tuple(TASKS),
                        help="A task of benchmarks/tasks.py when --data is not given (default: the preset's, "
                        "arithmetic); classification trains a sequence-classification head.")
    parser.add_argument("--steps", type=int, help="Optimizer steps per method.")
    parser.add_argument("--seq-len", type=int, dest="seq_len", help="max_seq_length of tokenisation.")
    parser.add_argument("--batch-size", type=int, dest="batch_size", help="Sequences per optimizer step.")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="Where to train.")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="dtype of the loaded weights.")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast.")
    parser.add_argument("--eval-every", type=int, dest="eval_every", help="Eval-loss interval in steps.")
    parser.add_argument("--eval-samples", type=int, dest="eval_samples", help="Rows of the fixed eval set.")
    parser.add_argument("--exact-match-samples", type=int, dest="exact_match_samples",
                        help="Prompts scored by generation at the end (bundled task; 0 skips).")
    parser.add_argument("--timing-warmup-steps", type=int, dest="timing_warmup_steps",
                        help="First steps left out of the median step time.")
    parser.add_argument("--lr-full-parameter", type=float, dest="lr_full_parameter",
                        help="Learning rate of full, lisa, lisa-naive, badam and galore.")
    parser.add_argument("--lr-adapter", type=float, dest="lr_adapter", help="Learning rate of lora and lisa-adapter*.")
    parser.add_argument("--lisa-activated-layers", type=int, dest="lisa_activated_layers", help="γ.")
    parser.add_argument("--lisa-interval-steps", type=int, dest="lisa_interval_steps", help="K.")
    parser.add_argument("--lora-r", type=int, dest="lora_r", help="Adapter rank (lora and lisa-adapter*).")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--cpu-allocator", dest="cpu_allocator", choices=("default", "trim", "lean"),
                        help="hf-lisa train's --cpu_allocator for every method (default: the preset's).")
    parser.add_argument("--chunked-loss", dest="chunked_loss", choices=("true", "false"),
                        help="hf-lisa train's --chunked_loss for every method (default: the preset's, true).")
    parser.add_argument("--budget-s", type=float, dest="budget_s",
                        help="No method starts after this many seconds; later ones are reported as not run.")
    parser.add_argument("--in-process", action="store_true",
                        help="Run every method in this process (fast start; peak memory is then shared).")
    parser.add_argument("--output-dir", default=str(RESULTS_DIR), help="Where the results go (default: %(default)s).")
    parser.add_argument("--name", help="File stem of the results (default: <date>-<machine>).")
    return parser


def resolve_preset(ns: argparse.Namespace) -> tuple[Preset, list[str]]:
    preset = PRESETS[ns.preset]
    overrides = {k: getattr(ns, k) for k in (
        "model", "data", "task", "steps", "seq_len", "batch_size", "device", "dtype", "bf16", "eval_every",
        "eval_samples", "exact_match_samples", "timing_warmup_steps", "lr_full_parameter", "lr_adapter",
        "lisa_activated_layers", "lisa_interval_steps", "lora_r", "seed", "cpu_allocator")}
    if ns.chunked_loss is not None:
        overrides["chunked_loss"] = ns.chunked_loss == "true"
    preset = preset.updated(**overrides)
    if ns.methods in METHOD_SETS:
        methods = list(METHOD_SETS[ns.methods])
    elif ns.methods:
        methods = [m.strip() for m in ns.methods.split(",") if m.strip()]
    else:
        methods = list(preset.methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown method(s) {unknown}; allowed: {', '.join(METHODS)}, or one of "
                         f"{', '.join(METHOD_SETS)}.")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_samples", "lisa_activated_layers",
                 "lisa_interval_steps", "lora_r"):
        if getattr(preset, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"{flag}={getattr(preset, name)} is invalid; allowed: an integer >= 1.")
    return preset, methods


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the benchmark and return the report (also written to ``--output-dir``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    preset, methods = resolve_preset(ns)
    started = _dt.datetime.now()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results = run_all(preset, methods, in_process=ns.in_process, log=log, budget_s=ns.budget_s)
    stem = ns.name or f"{started:%Y-%m-%d}-{machine_slug(results)}"
    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": "python benchmarks/compare.py " + " ".join(argv),
        "preset": _preset_dict(preset),
        "methods": methods,
        "machine": {"slug": machine_slug(results), "hostname": platform.node(), "cpu": _cpu_name(),
                    "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "platform": platform.platform()},
        "in_process": ns.in_process,
        "results": results,
        "total_seconds": (_dt.datetime.now() - started).total_seconds(),
    }
    paths = write_outputs(report, Path(ns.output_dir), stem)
    from benchmarks.report import render_markdown

    print(render_markdown(report))
    log(f"[bench] wrote {paths['markdown']}, {paths['json']} and two plots in {report['total_seconds']:.0f} s")
    report["paths"] = paths
    return report


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == WORKER_FLAG:
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
    report = main()
    sys.exit(0 if all(r.get("ok") for r in report["results"]) else 1)
