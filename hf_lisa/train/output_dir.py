"""Where a ``hf-lisa train`` run writes and which checkpoint it resumes, checked before the model or data load.

* ``--output_dir`` is a folder (created if missing) that is empty, or holds the checkpoints of the run being resumed, or
  is reused with ``--overwrite_output_dir``. It is never the folder of the model being trained, nor a folder holding
  model weights that no ``hf-lisa train`` run wrote (not even with ``--overwrite_output_dir``).
* ``--resume_from_checkpoint latest`` (or ``true``) is the newest complete ``checkpoint-N`` of ``--output_dir``. A
  resumed run keeps the method and the schedule (γ, K, sampling, mask interval, importance window) of its checkpoint.
* Nothing is written in place: checkpoints and the final model go to a staging folder whose name starts with
  :data:`STAGING_PREFIX` (hidden, never ``checkpoint-*``) and are renamed into place once complete
  (:class:`~hf_lisa.train.trainer.LisaTrainer`, :func:`~hf_lisa.train.outputs.staged_final_model`). A staging folder
  that a kill left behind is removed by the next run in that ``--output_dir`` (:func:`clear_previous_run`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional

from transformers import TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import UsageError
from ..hub.summary import TRAINING_SUMMARY_NAME
from ..methods import FULL, METHODS, method_of_adapter
from ..scheduler.state import LISA_STATE_FILE
from ..trainer_callbacks.state import stored_schedule_settings

logger = logging.getLogger("hf_lisa.train")

#: names of the folders a save writes before it is complete (hidden; ``get_last_checkpoint`` never matches them)
STAGING_PREFIX = ".partial-"
#: the files that make a folder a model: weights and their shard indexes (``training_args.bin`` is a pickle too)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                   "*.ckpt", "*.gguf", "*.h5", "*.msgpack")
#: the files a saved model, its tokenizer and a run's summary consist of: what a new final model replaces
MODEL_FILE_PATTERNS = WEIGHT_PATTERNS + (
    "*config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
    "chat_template.*", "README.md", TRAINING_SUMMARY_NAME, "training_args.json", "loss.png",
)
#: ``--resume_from_checkpoint`` values that mean the newest complete checkpoint of ``--output_dir``
LATEST = ("latest", "true")
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
#: the LISA callback whose schedule a checkpoint of each LISA method holds, by the registry's ``schedule``
_SCHEDULE_CALLBACKS = {"blocks": "LisaCallback", "adapter": "LisaAdapterCallback"}


@dataclass
class LisaTrainingArguments(TrainingArguments):
    """transformers' ``TrainingArguments`` with ``--overwrite_output_dir``, which transformers 5 dropped."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Reuse a non-empty --output_dir: the checkpoints of the run it holds are removed before training "
            "starts and its final model is replaced when the new one is complete. Never allowed for the folder of "
            "the model being trained, nor for a folder with model weights that no hf-lisa train run wrote."
        },
    )


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether the file name ``name`` matches one of the shell ``patterns``."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def fsync_tree(folder: str) -> None:
    """Flush every file under ``folder``, then the folders themselves (not on Windows, which cannot open a folder),
    so that a rename after it publishes data that survives a power loss, not only a killed process."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        if os.name == "nt":
            continue
        descriptor = os.open(root, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------------
def checkpoint_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint (``None`` when it is one): its trainer state, and the LISA schedule's
    tensors when the state says it has a schedule."""
    if any(part.startswith(STAGING_PREFIX) for part in os.path.normpath(path).split(os.sep)):
        return "it is an unfinished save (a staging folder a kill or a full disk left behind)"
    if not os.path.isdir(path):
        return "it is not a folder" if os.path.exists(path) else "it does not exist"
    state = os.path.join(path, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME} (an interrupted save, or not a Trainer checkpoint)"
    try:
        schedules = stored_schedule_settings(path)
    except ValueError as err:
        return f"its {TRAINER_STATE_NAME} is not valid JSON ({err}; an interrupted save?)"
    if schedules and not os.path.isfile(os.path.join(path, LISA_STATE_FILE)):
        return f"its LISA schedule has no {LISA_STATE_FILE} (an interrupted save)"
    return None


def checkpoint_step(path: str) -> int:
    """The optimizer step a complete checkpoint was saved at (its ``trainer_state.json``'s ``global_step``)."""
    with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
        return int(json.load(f).get("global_step", 0))


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The newest complete ``checkpoint-N`` of ``output_dir`` (:func:`checkpoint_problem`), or ``None``."""
    if not os.path.isdir(output_dir):
        return None
    numbered = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.match(name))]
    for _, name in sorted(numbered, reverse=True):
        path = os.path.join(output_dir, name)
        if checkpoint_problem(path) is None:
            return path
    return None


def _resolve_resume(value, output_dir: str) -> Optional[str]:
    """The checkpoint ``--resume_from_checkpoint=value`` names, after checking it is complete; ``None`` for none."""
    if value is None or value is False or value == "":
        return None
    if value is True or str(value).lower() in LATEST:
        path = latest_checkpoint(output_dir)
        if path is None:
            where = "does not exist" if not os.path.isdir(output_dir) else "holds no complete checkpoint-N folder"
            raise UsageError(
                f"--resume_from_checkpoint={value}: --output_dir={output_dir} {where}, so there is nothing to resume. "
                "Start without --resume_from_checkpoint, or give the path of a checkpoint folder."
            )
        logger.info("Resuming from %s, the newest complete checkpoint of %s.", path, output_dir)
        return path
    problem = checkpoint_problem(value)
    if problem is not None:
        raise UsageError(
            f"--resume_from_checkpoint={value} is not a checkpoint to resume: {problem}. Give a checkpoint-N folder "
            f"that a run wrote, or {'/'.join(LATEST)} for the newest complete one in --output_dir."
        )
    return value


def _checkpoint_method(checkpoint: str, schedules: dict) -> str:
    """The ``--method`` that wrote ``checkpoint``: from its LISA schedule, else from its adapter config."""
    for method in METHODS.values():
        if _SCHEDULE_CALLBACKS.get(method.schedule) in schedules:
            return method.name
    adapter_config = os.path.join(checkpoint, "adapter_config.json")
    if not os.path.isfile(adapter_config):
        return FULL.name
    with open(adapter_config) as f:
        config = json.load(f)
    method = method_of_adapter(config)
    if method is not None and not METHODS[method].samples_layers:
        return method
    return f"a {config.get('peft_type')} adapter without a LISA schedule"


def check_resume_matches(checkpoint: str, lisa_args) -> None:
    """Refuse resuming ``checkpoint`` with another ``--method`` or other schedule settings than it was written with.

    A resumed schedule continues the stored sampler, period and mask windows; with another γ, K, sampling strategy,
    mask interval or importance window it would follow neither the old nor the new schedule. Every difference is
    named at once, with the checkpoint's value and this run's.
    """
    schedules = stored_schedule_settings(checkpoint)
    written_by = _checkpoint_method(checkpoint, schedules)
    if written_by != lisa_args.method:
        raise UsageError(
            f"--resume_from_checkpoint={checkpoint} was written by --method {written_by}, but this run is --method "
            f"{lisa_args.method}. Resume with --method {written_by}, or start a new run in another --output_dir."
        )
    stored = schedules.get(_SCHEDULE_CALLBACKS.get(lisa_args.method), {})
    changed = [
        f"--{name}={getattr(lisa_args, name)!r} (the checkpoint has {value!r})"
        for name, value in stored.items()
        if getattr(lisa_args, name) != value
    ]
    if changed:
        raise UsageError(
            f"--resume_from_checkpoint={checkpoint}: this run changes the LISA schedule it continues: "
            f"{', '.join(changed)}. A resumed run would follow neither schedule; resume with the checkpoint's values, "
            "or start a new run in another --output_dir."
        )


# ----------------------------------------------------------------------------------------------------------------------
# --output_dir
# ----------------------------------------------------------------------------------------------------------------------
def _check_writable_folder(output_dir: str) -> None:
    """``output_dir`` is a folder, or can be created as one."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(
            f"--output_dir={output_dir} is a file, not a folder. Give a folder path (it is created if missing)."
        )
    parent = os.path.abspath(output_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--output_dir={output_dir} cannot be created: {parent} is a file, not a folder.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--output_dir={output_dir}: {parent} is not writable by this user. Give another folder.")


def _check_not_the_model(output_dir: str, model_path: Optional[str]) -> None:
    """``output_dir`` is neither the folder of the model being trained nor one of its checkpoints' folders."""
    if not model_path or not os.path.isdir(model_path):
        return  # a Hub id, or the embedded model (its cached folder holds weights: see _check_no_foreign_weights)
    model, out = os.path.realpath(model_path), os.path.realpath(output_dir)
    if model == out:
        what = "is the folder of the model being trained"
    elif os.path.dirname(model) == out and _CHECKPOINT.match(os.path.basename(model)):
        what = f"holds the model being trained as {os.path.basename(model)}, which this run's checkpoints replace"
    else:
        return
    raise UsageError(
        f"--output_dir={output_dir} {what} (--model_name_or_path={model_path}, i.e. {model}): saving there would "
        f"overwrite its weights. hf-lisa never does, even with --overwrite_output_dir. Choose another --output_dir, "
        f"e.g. {out}-lisa."
    )


def _check_no_foreign_weights(output_dir: str, entries: list[str]) -> None:
    """``output_dir`` holds no model weights unless an ``hf-lisa train`` run wrote them (its ``training_summary.json``
    says so)."""
    weights = [name for name in entries if matches(name, WEIGHT_PATTERNS)
               and os.path.isfile(os.path.join(output_dir, name))]
    if weights and TRAINING_SUMMARY_NAME not in entries:
        raise UsageError(
            f"--output_dir={output_dir} holds model weights ({', '.join(sorted(weights)[:4])}) that no hf-lisa train "
            f"run wrote (there is no {TRAINING_SUMMARY_NAME}): a base model or a download. hf-lisa never writes "
            "into such a folder, even with --overwrite_output_dir. Choose another --output_dir, or move the weights "
            "away first."
        )


def check_output_dir(model_args, lisa_args, training_args) -> Optional[str]:
    """Check ``--output_dir`` and ``--resume_from_checkpoint`` before anything loads; return the checkpoint to resume.

    ``training_args.resume_from_checkpoint`` is set to that checkpoint's path (``latest``/``true`` resolved), or
    ``None``; a resumed checkpoint must have been written with this run's method and schedule
    (:func:`check_resume_matches`). Raises [`~hf_lisa.errors.UsageError`] naming the option, the path and the fix.
    Only reads the file system: what must go is removed once the run is ready to train (:func:`clear_previous_run`).
    """
    output_dir = training_args.output_dir
    overwrite = getattr(training_args, "overwrite_output_dir", False)
    _check_writable_folder(output_dir)
    _check_not_the_model(output_dir, model_args.model_name_or_path)
    entries = [name for name in os.listdir(output_dir) if not name.startswith(STAGING_PREFIX)] if os.path.isdir(
        output_dir) else []
    _check_no_foreign_weights(output_dir, entries)
    resume = _resolve_resume(training_args.resume_from_checkpoint, output_dir)
    if resume is not None:
        check_resume_matches(resume, lisa_args)
    own = resume is not None and os.path.realpath(os.path.dirname(os.path.normpath(resume))) == os.path.realpath(
        output_dir)
    if own and overwrite:
        raise UsageError(
            f"--overwrite_output_dir would delete the checkpoints of --output_dir={output_dir}, including "
            f"--resume_from_checkpoint={resume}. Resume without --overwrite_output_dir, or start over without "
            "--resume_from_checkpoint."
        )
    if entries and not overwrite and not own:
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        resumable = latest_checkpoint(output_dir)
        hint = f"--resume_from_checkpoint latest to continue from {resumable}, " if resumable else ""
        raise UsageError(
            f"--output_dir={output_dir} is not empty (it holds {shown}). Use {hint}--overwrite_output_dir to replace "
            "what it holds, or another --output_dir."
        )
    training_args.resume_from_checkpoint = resume
    return resume


def clear_previous_run(training_args) -> list[str]:
    """Remove what an earlier run left in ``--output_dir``: unfinished saves, and with ``--overwrite_output_dir`` its
    checkpoints (they would mix with this run's). Its final model stays until this run's replaces it.

    Call it on the process(es) that save, once the run is ready to train. Returns the paths removed.
    """
    output_dir = training_args.output_dir
    if not os.path.isdir(output_dir):
        return []
    overwrite = getattr(training_args, "overwrite_output_dir", False)
    removed = [
        os.path.join(output_dir, name) for name in sorted(os.listdir(output_dir))
        if name.startswith(STAGING_PREFIX) or (overwrite and _CHECKPOINT.match(name))
    ]
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if removed:
        logger.info("Removed from %s what an earlier run left: %s", output_dir,
                    ", ".join(os.path.basename(p) for p in removed))
    return removed
