"""What a run leaves behind: the start-of-training lines, the loss plot, the final model, its summary and model card,
each recorded in ``output_dir``'s manifest (:func:`~hf_lisa.train.run_folder.output_dir.record_outputs`) with the checkpoints."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Iterator, Optional, Sequence

from torch import nn

from ..errors import RunError
from ..hub.summary import TRAINING_SUMMARY_NAME, TrainingSummary, jsonable
from .run_folder.output_dir import (MODEL_FILE_PATTERNS, STAGING_PREFIX, WEIGHT_PATTERNS, fsync_tree, matches, record_outputs,
                         remove_checkpoints, split_owned)
from .quantization import parameter_count

logger = logging.getLogger("hf_lisa.train")

__all__ = ["LOSS_PLOT_NAME", "TRAINING_SUMMARY_NAME", "build_training_summary", "plot_losses", "save_final_model",
           "held_out_rows", "staged_final_model", "start_notes", "trainable_summary", "write_error",
           "write_model_card"]


LOSS_PLOT_NAME = "loss.png"


TRAINING_ARGS_JSON = "training_args.json"


SUMMARY_PREFIX = "hf-lisa"


# ----------------------------------------------------------------------------------------------------------------------
# Start-of-training summary line
# ----------------------------------------------------------------------------------------------------------------------
def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def trainable_summary(model: nn.Module, layers_attribute: Optional[str] = None) -> dict:
    """Trainable parameters by group (embeddings / blocks / other) and the active blocks, from ``requires_grad``.

    The groups are those of the model's :class:`~hf_lisa.scheduler.active_set.BlockIndex`, as for LLRD and the monitor.
    """
    from ..scheduler.active_set import EMBEDDINGS_GROUP, BlockIndex

    index = BlockIndex.of(model, layers_attribute)
    counts = {"embeddings": 0, "blocks": 0, "other": 0}
    active: set[int] = set()
    total = 0
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += parameter_count(param)  # 4-bit weights pack two per byte
        if not param.requires_grad:
            continue
        block = index.block_of(name)
        if block is not None:
            counts["blocks"] += param.numel()
            active.add(block)
        elif index.groups[name] == EMBEDDINGS_GROUP:
            counts["embeddings"] += param.numel()
        else:
            counts["other"] += param.numel()
    return {
        "total_params": total,
        "trainable_params": sum(counts.values()),
        "trainable_by_group": counts,
        "active_blocks": sorted(active),
        "num_blocks": index.num_blocks,
    }


def never_trained(model: nn.Module, schedules: Sequence) -> list[str]:
    """Names of the parameters that the LISA callbacks in ``schedules`` will never train (outside the blocks and not in
    ``always_trainable``), read after their ``on_train_begin``."""
    frozen = {id(p) for cb in schedules for p in (getattr(getattr(cb, "layer_scheduler", None), "frozen_params", None)
                                                  or ())}
    return [name for name, p in model.named_parameters() if id(p) in frozen]


def held_out_rows(raw) -> int:
    """How many rows of train ``raw["validation"]`` holds when it was split from train (the same source, as
    :func:`~hf_lisa.data.validation.source_of` reads it from the line numbers), else 0."""
    from ..data.validation import source_of

    if "validation" not in raw or source_of(raw["validation"]) != source_of(raw["train"]):
        return 0
    return len(raw["validation"])


def start_notes(training_args, held_out: int = 0, validation_split_percentage: float = 0.0) -> list[str]:
    """What the start-of-training lines say beyond the parameters: the rows of train held out for evaluation
    (``held_out``, when the validation set was split from train) and the checkpoints kept beside the final model."""
    notes = []
    if held_out:
        notes.append(f"held out {validation_split_percentage:g}% of train ({held_out} row{'s' * (held_out != 1)}) for "
                     "evaluation (--validation_split_percentage 0 to train on all)")
    if training_args.save_strategy != "no":
        if not getattr(training_args, "keep_checkpoints", True):
            notes.append("checkpoint-N folders are removed once the final model is saved (--keep_checkpoints false)")
        else:
            kept = "weights only" if training_args.save_only_model else "optimizer state included"
            notes.append(f"checkpoint-N folders ({kept}) stay in output_dir beside the final model: "
                         "--keep_checkpoints false removes them once it is saved, --save_strategy no writes none")
    return notes


def _active_adapter_config(model):
    """The PEFT config of ``model``'s active adapter, or ``None`` for a model without adapters."""
    configs = getattr(model, "peft_config", None) or {}
    return configs.get(getattr(model, "active_adapter", None)) if isinstance(configs, dict) else None


def _what_trains(model) -> str:
    """`` (LISA adapters: ...)`` for a LISA adapter, naming what it trains (the same words as its card); else ``""``."""
    config = _active_adapter_config(model)
    peft_type = str(getattr(config, "peft_type", "")).upper().split(".")[-1]
    if peft_type == "LORA":  # the defaults (all-linear, α = 2r) are said where they take effect
        targets = config.target_modules
        targets = ", ".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else str(targets)
        return (f" (PEFT {'DoRA' if config.use_dora else 'LoRA'} r={config.r}, alpha={config.lora_alpha:g} on "
                f"{targets})")
    if config is None or peft_type != "LISA":
        return ""
    from ..hub.card_tables import lisa_adapter_title

    return f" ({lisa_adapter_title(config.to_dict())})"


def _sparse_costs(model) -> list[str]:
    """What a sparse LISA adapter costs beyond LoRA, said before the first step (issue 36: a calibration step of
    minutes under load came unannounced)."""
    config = _active_adapter_config(model)
    if config is None or not (getattr(config, "sparsity", 0) or any((getattr(config, "sparsity_pattern", None)
                                                                      or {}).values())):
        return []
    notes = ["sparse masks cost extra compute: "]
    if getattr(config, "mask_init", None) == "importance":
        notes[0] += (f"before the first step, the masks are calibrated from |dL/dW| over {config.importance_steps} "
                     "extra forward/backward passes that train nothing; ")
    if getattr(config, "mask_update_interval", 0):
        notes[0] += f"every {config.mask_update_interval} steps each active layer's mask is re-selected; "
    notes[0] += "`hf-lisa export lora` of a sparse adapter is a truncated SVD (lossy; it reports the error)"
    return notes


def _summary_callback(method: str, output_dir: str, layers_attribute: Optional[str], store: dict,
                      schedules: Sequence = (), notes: Sequence[str] = ()):
    from transformers import TrainerCallback

    class StartSummaryCallback(TrainerCallback):
        """Prints one line when training starts, after the LISA callbacks have frozen what does not train, and the
        ``notes`` (:func:`start_notes`) a line each."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            info = trainable_summary(model, layers_attribute)
            store.update(info)
            groups = info["trainable_by_group"]
            blocks = info["active_blocks"]
            shown = ",".join(map(str, blocks)) if len(blocks) <= 8 else f"{len(blocks)} blocks"
            line = (
                f"[{SUMMARY_PREFIX}] method={method}{_what_trains(model)} | trainable {_fmt_count(info['trainable_params'])} of "
                f"{_fmt_count(info['total_params'])} params (embeddings {_fmt_count(groups['embeddings'])}, blocks "
                f"{_fmt_count(groups['blocks'])}, head/other {_fmt_count(groups['other'])}) | active blocks "
                f"{len(blocks)}/{info['num_blocks']} [{shown}] | output_dir={output_dir}"
            )
            never = never_trained(model, schedules)
            store["never_trained"] = never
            if never:
                shown = ", ".join(never[:6]) + (f" and {len(never) - 6} more" if len(never) > 6 else "")
                line += (f"\n[{SUMMARY_PREFIX}] never trains (outside the blocks, not in --lisa_always_trainable): "
                         f"{shown}")
            line += "".join(f"\n[{SUMMARY_PREFIX}] {note}" for note in (*notes, *_sparse_costs(model)))
            if state.is_world_process_zero:
                print(line, flush=True)

    return StartSummaryCallback()


def _manifest_callback():
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class OutputManifestCallback(TrainerCallback):
        """Lists each ``checkpoint-N`` in ``output_dir``'s manifest before the Trainer writes it (a kill while it is
        written leaves nothing of this run unlisted), and drops the ones rotated away once it is saved."""

        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save and args.should_save:
                record_outputs(args.output_dir, [f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"])

        on_epoch_end = on_step_end

        def on_save(self, args, state, control, **kwargs):
            if args.should_save:
                record_outputs(args.output_dir)

    return OutputManifestCallback()


# ----------------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------------
def plot_losses(log_history: list[dict], path: str, before_eval_loss: Optional[float] = None,
                after_eval_loss: Optional[float] = None, final_step: Optional[int] = None,
                title: str = "hf-lisa training", switch_steps: Sequence[int] = ()) -> Optional[str]:
    """Write a PNG of the training loss (and the eval loss) against the optimizer step, with a faint vertical line at
    each step where LISA switched its active blocks (``switch_steps``); ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss plot (pip install matplotlib).")
        return None
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if before_eval_loss is not None:
        evals = [(0, before_eval_loss)] + [p for p in evals if p[0] != 0]
    if after_eval_loss is not None and final_step is not None and not any(s == final_step for s, _ in evals):
        evals.append((final_step, after_eval_loss))
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if evals:
        ax.plot(*zip(*sorted(evals)), "o--", label="eval loss", color="tab:orange")
    for i, step in enumerate(sorted(set(switch_steps))):
        ax.axvline(step, color="0.5", linewidth=0.8, linestyle=":", alpha=0.6,
                   label="blocks switched" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def save_final_model(trainer, model: nn.Module, tokenizer, output_dir: str, method: str) -> None:
    """Adapters as ``adapter_config.json`` + ``adapter_model.safetensors``; full weights as safetensors; the arguments
    as ``training_args.json`` (Hub token masked). No pickle. ``output_dir`` is the staging folder of
    :func:`staged_final_model` in ``hf-lisa train``."""
    # gather on every rank (FSDP/DeepSpeed shards), write on the main process only
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.args.should_save:
        return
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    os.makedirs(output_dir, exist_ok=True)
    unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    with open(os.path.join(output_dir, TRAINING_ARGS_JSON), "w") as f:
        f.write(trainer.args.to_json_string())


#: the errors of a file system that refuses a write: full, over quota, read-only, file too large, failing, not allowed
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO, errno.EACCES, errno.EPERM}
#: how an ``std::io::Error`` of a Rust library (safetensors' ``SafetensorError``) shows its errno
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
#: torch.save's short writes (its zip writer knows no errno): ``PytorchStreamWriter failed writing file ...: file
#: write failed``, ``unexpected pos 19840 vs 19728``
_TORCH_SHORT_WRITE = re.compile(r"PytorchStreamWriter failed writing|file write failed|unexpected pos \d+ vs \d+")


def write_error(err: BaseException, output_dir: str) -> Optional[Exception]:
    """The error to report instead of ``err`` when ``err`` is a write the file system refused (disk full, read-only,
    ...) and does not say where: safetensors' ``SafetensorError`` (``... No space left on device (os error 28)``, no
    file at all), an ``OSError`` naming no file or a relative one (an ``OSError`` naming ``output_dir``, or the relative
    file under it), torch.save's short write (a ``RunError`` naming ``output_dir``). ``None`` for anything else."""
    if isinstance(err, OSError):
        code, filename = err.errno, err.filename
        if code not in _WRITE_ERRNOS or (filename and os.path.isabs(os.fsdecode(filename))):
            return None
    elif isinstance(err, RuntimeError) and _TORCH_SHORT_WRITE.search(str(err)):
        return RunError(
            f"writing into --output_dir={output_dir} failed: torch.save wrote less than it was asked to "
            f"({str(err).strip().splitlines()[0]}), which means the disk is full or over quota. Free some space (or "
            "choose another --output_dir) and run again; --resume_from_checkpoint latest continues from the last "
            "complete checkpoint."
        )
    else:
        found = _RUST_OS_ERROR.search(str(err))
        code, filename = (int(found.group(1)), None) if found else (None, None)
        if code not in _WRITE_ERRNOS:
            return None
    where = f"{output_dir} ({os.fsdecode(filename)})" if filename else output_dir
    return OSError(code, os.strerror(code), where)


def _weight_rank(name: str) -> int:
    """0 for a file that does not make a folder a model, 1 for weights, 2 for a shard index (it names the shards)."""
    return 2 if name.endswith(".index.json") else int(matches(name, WEIGHT_PATTERNS))


def publish_model_files(staging: str, output_dir: str) -> None:
    """Move the files of the complete model in ``staging`` into ``output_dir`` in place of the model there.

    The previous model's files (:data:`~hf_lisa.train.run_folder.output_dir.MODEL_FILE_PATTERNS`, only those an hf-lisa run
    wrote: :func:`~hf_lisa.train.run_folder.output_dir.split_owned`) go first, shard indexes and weights before the rest, so
    that a lisa run's ``model.safetensors`` never stays beside a later adapter; then the new files arrive, weights last
    and shard indexes after their shards. Every step is a rename on one file system: a kill in between leaves a folder
    that no loader takes for a model, never a mix of two models or half of one. The manifest lists the new files
    before they arrive. Checkpoints, logs and files no run wrote stay.
    """
    previous = [name for name in split_owned(output_dir)[0]
                if matches(name, MODEL_FILE_PATTERNS) and os.path.isfile(os.path.join(output_dir, name))]
    arriving = sorted(os.listdir(staging), key=_weight_rank)
    record_outputs(output_dir, arriving)
    for name in sorted(previous, key=_weight_rank, reverse=True):
        os.remove(os.path.join(output_dir, name))
    for name in arriving:
        os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
    os.rmdir(staging)
    record_outputs(output_dir)  # the previous model's files that the new one did not replace are gone


@contextmanager
def staged_final_model(output_dir: str, should_save: bool, keep_checkpoints: bool = True) -> Iterator[str]:
    """A staging folder (``output_dir/.partial-final``) for everything the final save writes: weights, tokenizer,
    ``training_args.json``, summary, plot and card; moved into ``output_dir`` by :func:`publish_model_files` when the
    block completes, removed when it raises. A full disk or a crash while writing leaves ``output_dir`` as it was.
    With ``keep_checkpoints=False`` the ``checkpoint-N`` folders go once the new model is in place, never before.

    Example:
        ```py
        >>> with staged_final_model(training_args.output_dir, training_args.should_save) as staging:  # doctest: +SKIP
        ...     save_final_model(trainer, trainer.model, tokenizer, staging, "lisa")
        ```
    """
    staging = os.path.join(output_dir, STAGING_PREFIX + "final")
    if should_save:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    try:
        yield staging
        if should_save:
            fsync_tree(staging)
            publish_model_files(staging, output_dir)
            if not keep_checkpoints:
                remove_checkpoints(output_dir)
    finally:
        if should_save:
            shutil.rmtree(staging, ignore_errors=True)


def _license_for(base_model_id: str) -> Optional[str]:
    from ..models import DEFAULT_MODEL_ID, DEFAULT_MODEL_LICENSE

    return DEFAULT_MODEL_LICENSE if base_model_id == DEFAULT_MODEL_ID else None


def build_training_summary(model_args, data_args, lisa_args, training_args, *, base_model_id: str, lisa: dict,
                           metrics: dict[str, float], global_step: int, data_report, bundled: bool, trainable: dict,
                           started: float) -> TrainingSummary:
    """The run's [`~hf_lisa.hub.TrainingSummary`], built once: saved as ``training_summary.json``, rendered into the
    model card and handed to the push as it is.

    Args:
        model_args, data_args, lisa_args, training_args: the run's parsed arguments.
        base_model_id: Hub id of the base model (or the local path it was loaded from).
        lisa: the method's knobs, for the card's training table.
        metrics: final metrics (``*_before`` for the evaluation before training).
        global_step: optimizer steps taken.
        data_report: the tokenisation report (``data_format``, ``kept``, ``skipped``).
        bundled: whether the run used the bundled arithmetic task.
        trainable: the trainable-parameter counts of the start-of-training line.
        started: ``time.time()`` when the run started.
    """
    return TrainingSummary(
        base_model=base_model_id,
        method=lisa_args.method,
        lisa=lisa,
        hyperparameters=jsonable({
            "learning_rate": training_args.learning_rate,
            "max_steps": global_step,
            "per_device_train_batch_size": training_args.per_device_train_batch_size,
            "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
            "world_size": training_args.world_size,
            "max_seq_length": data_args.max_seq_length,
            "warmup_steps": training_args.warmup_steps,
            "lr_scheduler_type": training_args.lr_scheduler_type,
            "weight_decay": training_args.weight_decay,
            "max_grad_norm": training_args.max_grad_norm,
            "optim": training_args.optim,
            "bf16": training_args.bf16,
            "gradient_checkpointing": bool(training_args.gradient_checkpointing),
            "layerwise_lr_decay": training_args.layerwise_lr_decay,
            "seed": training_args.seed,
            # --stage dpo: the objective and its beta (an SFT summary leaves both out)
            **({"stage": lisa_args.stage, "dpo_beta": lisa_args.dpo_beta} if lisa_args.stage != "sft" else {}),
        }),
        metrics=dict(metrics),
        datasets=[data_args.dataset_name] if data_args.dataset_name else [],
        # the bundled task has no Hub id: leave it out of the card metadata rather than invent one
        dataset_name=data_args.dataset_name,
        data={
            "source": "hf-lisa bundled arithmetic task (hf_lisa.demo_task)" if bundled else (
                data_args.dataset_name or data_args.train_file),
            "format": data_report.data_format,
            "train_file": data_args.train_file,
            "validation_file": data_args.validation_file,
            "rows_kept": data_report.kept,
            "rows_skipped": data_report.skipped,
        },
        license=_license_for(base_model_id),
        trainable=trainable,
        runtime_seconds=round(time.time() - started, 1),
        output_dir=training_args.output_dir,
        arguments=jsonable({"model": asdict(model_args), "data": asdict(data_args), "lisa": asdict(lisa_args)}),
    )


def write_model_card(output_dir: str, summary: TrainingSummary, mode: str, repo_id: Optional[str] = None):
    """Render the model card once from ``summary`` and save it as ``README.md``; ``None`` when rendering failed.

    ``repo_id`` is the repo the run pushes to, if any: the card's loading snippet names it, and the push uploads this
    very card. The adapter or model config is read from the model the run just saved to ``output_dir``.
    """
    from ..hub import render_model_card

    def read(name):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        return None

    try:
        card = render_model_card(
            repo_id, mode, base_model=summary.base_model, adapter_config=read("adapter_config.json"),
            model_config=read("config.json"), summary=summary, loss_plot=summary.loss_plot,
        )
    except Exception as err:  # a card is a convenience; never lose a finished training run over it
        logger.warning("Could not render the model card: %s", err)
        return None
    card.save(os.path.join(output_dir, "README.md"))
    return card
