"""The side-by-side protocol of the harness (``benchmarks/study.py``): every method of a config trained once, the same
way, measured, in one table with ratios against LoRA and full fine-tuning (``make bench``, ``make bench-peers``).

Every method trains the same model on the same data with the same seed, batch and steps, through the same pieces as
``hf-lisa train`` (``hf_lisa.trainer.methods.setup_method``, its ``Trainer`` and ``hf_lisa.data``), each in its own
process so that peak memory is per method. The peers BAdam and GaLore come from their own packages and run in a plain
``transformers.Trainer`` as their docs say (``benchmarks/peers.py``). A measuring callback (``benchmarks/measure.py``)
records, per optimizer step: wall time, tokens, optimizer-state bytes (and what the shapes say they must be,
``benchmarks/theory.py``), trainable parameters, train loss; eval loss at fixed steps; and, on the bundled task,
generation exact match at the end.

Each method's record is appended to ``benchmarks/results/<name>.jsonl`` as it ends (``<name>``: the config's
``results`` template, ``{date}-{machine}`` for ``bench.json``), so that an interrupted run continues where it stopped
(a record made under other settings is refused, naming them); the report is rewritten from the records:
``<name>.md`` (also printed), ``<name>.json`` (every raw number) and two PNG plots (``benchmarks/report.py``).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.measure import (
    cpu_name, current_rss_bytes, load_average, make_recorder, schedule_reader, state_kind, withheld_reader,
)
from benchmarks.presets import METHODS, MethodSpec, Preset

#: preset fields that must be integers of at least 1
_POSITIVE = ("steps", "batch_size", "seq_len", "eval_every", "eval_samples", "lisa_activated_layers",
             "lisa_interval_steps", "lora_r")


def run_method(method: str, preset: Preset, work_dir: str, exact_match_before: bool = False,
               extra_callbacks: Sequence = (), methods: Optional[dict[str, MethodSpec]] = None) -> dict:
    """Train ``method`` (a name of ``methods``, default: ``bench.json``'s) under ``preset`` in this process and return
    every measurement as plain JSON data.

    ``extra_callbacks`` go to the Trainer after the method's own (tests use them to watch the weights move)."""
    wall_start = time.perf_counter()
    rss_start = current_rss_bytes()
    load_start = load_average()
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

    spec = (METHODS if methods is None else methods)[method]
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
    kind = state_kind(spec, preset.lisa_extra)
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
            "device_name": cuda or cpu_name(),
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
                "load_average": [load_start, load_average()],
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


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# ----------------------------------------------------------------------------------------------------------------------
# Settings: the preset with the command line's --set, the methods, the results file
# ----------------------------------------------------------------------------------------------------------------------
def resolve_preset(config, preset_name: str, settings: dict[str, Any], model: Optional[str] = None) -> Preset:
    """The config's preset with ``settings`` (``--set FIELD=VALUE``) and ``--model`` applied; a wrong field or value
    is refused, naming it and what is allowed."""
    try:
        preset = config.presets[preset_name].updated(**settings, model=model)
    except TypeError as err:
        raise ValueError(f"--set: {err}") from err
    for name in _POSITIVE:
        value = getattr(preset, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--set {name}={value!r} is invalid; allowed: an integer >= 1.")
    if preset.task not in _task_names():
        raise ValueError(f"--set task={preset.task!r} is invalid; allowed: {', '.join(_task_names())}.")
    if preset.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--set device={preset.device!r} is invalid; allowed: auto, cpu, cuda.")
    return preset


def _task_names() -> tuple[str, ...]:
    from benchmarks.tasks import TASKS

    return tuple(TASKS)


def resolve_methods(config, preset: Preset, methods: Optional[str]) -> list[str]:
    """``--methods``: comma-separated names of the config's methods, or the name of one of its sets; default: the
    config's ``run`` set."""
    if not methods:
        return list(preset.methods)
    if methods in config.sets:
        return list(config.sets[methods])
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in config.methods]
    if unknown or not names:
        raise ValueError(f"--methods: unknown method(s) {unknown}; allowed: {', '.join(config.methods)}, or one of "
                         f"{', '.join(config.sets)}.")
    return names


def machine_slug(preset: Preset) -> str:
    """``cpu2`` (device and cores) or e.g. ``nvidia-h200``: the ``{machine}`` of a results name."""
    import torch

    if preset.device == "cuda" or (preset.device == "auto" and torch.cuda.is_available()):
        if torch.cuda.is_available():
            return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu{cores}"


def preset_record(preset: Preset) -> dict:
    data = asdict(preset)
    data["methods"] = list(preset.methods)
    data["lisa_extra"] = [list(pair) for pair in preset.lisa_extra]
    return data


def _different_settings(records: list[dict], preset: Preset) -> list[str]:
    """The preset fields in which earlier records of a results file differ from this run's (``methods`` aside)."""
    now = json.loads(json.dumps(preset_record(preset)))
    changed = set()
    for record in records:
        before = record.get("preset") or {}
        changed |= {k for k in now if k != "methods" and k in before and before[k] != now[k]}
    return sorted(changed)


# ----------------------------------------------------------------------------------------------------------------------
# Running: each method in its own process (or this one), its record appended as it ends
# ----------------------------------------------------------------------------------------------------------------------
def run_one(run, out: Path, config, preset: Preset, exact_match_before: bool, in_process: bool = False) -> dict:
    """Train ``run.method``, append its record to ``out`` and return it (a failure is recorded too)."""
    from benchmarks.study import append_record

    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="hf-lisa-bench-") as work_dir:
            result = run_method(run.method, preset, work_dir, exact_match_before, methods=config.methods)
    except Exception as err:  # the report names the failure and the run moves on to the next method
        import traceback

        traceback.print_exc()
        result = {"method": run.method, "ok": False, "error": f"{type(err).__name__}: {err}"}
    result.update(key=run.key, run=asdict(run), preset=preset_record(preset), in_process=in_process,
                  wall_s=time.time() - started)
    append_record(out, result)
    return result


def run_protocol(config, preset_name: str, settings: dict[str, Any], model: Optional[str], methods: Optional[str],
                 results_dir: Path, name: Optional[str], in_process: bool, budget_min: Optional[float],
                 command: str, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                 dry_run: bool = False) -> Optional[dict]:
    """Run (or continue) the config's methods under ``preset_name`` and write the report; return the report (with
    ``dry_run``: print the plan, run nothing, return ``None``)."""
    import torch

    from benchmarks.study import Run, read_results

    preset = resolve_preset(config, preset_name, settings, model)
    names = resolve_methods(config, preset, methods)
    started = _dt.datetime.now()
    name = name or config.results.format(date=f"{started:%Y-%m-%d}", machine=machine_slug(preset))
    out = Path(results_dir) / f"{name}.jsonl"
    changed = _different_settings(list(read_results(out).values()), preset)
    if changed:
        raise ValueError(f"{out} holds runs made with other settings ({', '.join(changed)}); give --name for a new "
                         "results file, or remove that one")
    if dry_run:
        print(f"{command}\n  would run, each method in its own process: {', '.join(names)}\n  preset {preset_name}: "
              + ", ".join(f"{k}={v}" for k, v in preset_record(preset).items() if k != "methods")
              + f"\n  records: {out}" + "".join(f"\n  then the check: {c['claim']}" for c in config.checks))
        return None
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--preset {preset_name}: device=cuda, and torch {torch.__version__} sees no CUDA device "
                         "here; nothing was run. Run it on a GPU machine, or add --set device=cpu for a CPU smoke run "
                         "(its checks are then not judged)")
    deadline = None if budget_min is None else time.time() + 60 * budget_min
    runs = {m: Run(m, preset.lr_adapter if config.methods[m].family == "adapter" else preset.lr_full_parameter,
                   preset.seed, preset_name) for m in names}
    skipped: dict[str, str] = {}
    for index, method in enumerate(names):
        run = runs[method]
        recorded = read_results(out).get(run.key)
        if recorded is not None and recorded.get("ok"):  # a failed method runs again (its later record wins)
            log(f"[bench] {index + 1}/{len(names)} {method}: recorded in {out.name}")
            continue
        if deadline is not None and time.time() > deadline:
            skipped[method] = f"not run: the time budget (--budget-min {budget_min:g}) was spent"
            log(f"[bench] {index + 1}/{len(names)} {method}: {skipped[method]}")
            continue
        log(f"[bench] {index + 1}/{len(names)} {method} ...")
        if in_process:
            result = run_one(run, out, config, preset, index == 0, in_process=True)
        else:
            result = _run_in_child(run, out, config, settings, model, index == 0)
        _log_result(result, log)
    records = read_results(out)
    results = [records[runs[m].key] if runs[m].key in records else
               {"method": m, "ok": False, "error": skipped.get(m, "not recorded (killed): it runs again next time")}
               for m in names]
    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": command,
        "config": config.path,
        "preset": preset_record(preset),
        "methods": names,
        "machine": {"slug": machine_slug(preset), "hostname": platform.node(), "cpu": cpu_name(),
                    "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "platform": platform.platform()},
        "in_process": any(r.get("in_process") for r in results),
        "results": results,
        "total_seconds": sum(r.get("wall_s", 0.0) for r in results),
        "records": out.name,
    }
    report["checks"] = judge(config.checks, results)
    report["paths"] = write_outputs(report, Path(results_dir), name)
    from benchmarks.report import render_markdown

    print(render_markdown(report))
    log(f"[bench] wrote {report['paths']['markdown']}, {report['paths']['json']} and two plots "
        f"({report['total_seconds']:.0f} s of runs)")
    return report


def judge(checks: Sequence[dict], results: list[dict]) -> list[dict]:
    """Each check of the config with its measured ``ratio`` and ``passed`` (``None``: not judged, ``why`` says)."""
    ok = {r["method"]: r for r in results if r.get("ok")}
    judged = []
    for check in checks:
        entry = dict(check)
        missing = [m for m in (check["method"], check["against"]) if m not in ok]
        if missing:
            entry.update(passed=None, why=f"not judged: {', '.join(missing)} did not run")
            judged.append(entry)
            continue
        mine, theirs = ok[check["method"]], ok[check["against"]]
        entry["ratio"] = mine["timing"]["tokens_per_second"] / theirs["timing"]["tokens_per_second"]
        devices = {mine["device"], theirs["device"]}
        if check.get("device") and devices != {check["device"]}:
            entry.update(passed=None, why=f"not judged: measured on {', '.join(sorted(devices))}, the claim is for "
                         f"{check['device']}")
        else:
            entry["passed"] = entry["ratio"] >= check["at_least"]
        judged.append(entry)
    return judged


#: exit status of a side-by-side run whose methods all ran but a judged check failed (1: a method failed or did not run)
CHECK_FAILED = 3


def exit_status(report: dict) -> int:
    if not all(r.get("ok") for r in report["results"]):
        return 1
    return CHECK_FAILED if any(c.get("passed") is False for c in report.get("checks", [])) else 0


def _run_in_child(run, out: Path, config, settings: dict, model: Optional[str], exact_match_before: bool) -> dict:
    from benchmarks.study import launch, read_results

    extra = [arg for key, value in settings.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    launch(run, out, model, None, config, (*extra, *(["--exact-match-before"] if exact_match_before else [])),
           echo=True)  # the child's output goes to our stderr: stdout carries only the table
    return read_results(out).get(run.key) or {  # a kill is the machine's failure, not a result: it runs again
        "method": run.method, "ok": False, "error": "killed by a signal before it recorded; it runs again next time"}


def _log_result(result: dict, log: Callable[[str], None]) -> None:
    if result.get("ok"):
        timing = result["timing"]
        log(f"[bench] {result['method']}: {timing['median_step_seconds']:.3f} s/step, "
            f"peak {_gib(_peak_bytes(result)):.2f} GiB, optimizer state "
            f"{result['optimizer_state']['max_bytes'] / 2**20:.1f} MiB, final eval loss "
            f"{result['evals'][-1][1]:.4f} ({result['wall_s']:.0f} s)")
    else:
        log(f"[bench] {result['method']} FAILED: {result.get('error')}")


def _gib(n: Optional[float]) -> float:
    return float("nan") if n is None else n / 2**30


def _peak_bytes(result: dict) -> Optional[int]:
    memory = result["memory"]
    return memory["cuda"].get("max_allocated") if memory.get("cuda") else memory.get("peak_rss_bytes")



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

