"""Where a ``hf-lisa train`` run writes and which checkpoint it resumes, checked before the model or data load.

* ``--output_dir`` is a folder (created if missing) that is empty, or holds the checkpoints of the run being resumed, or
  is reused with ``--overwrite_output_dir``. It is never the folder of the model being trained, nor a folder holding
  model weights that no ``hf-lisa train`` run wrote (not even with ``--overwrite_output_dir``).
* ``--resume_from_checkpoint latest`` (or ``true``) is the newest complete ``checkpoint-N`` of ``--output_dir``. A
  resumed run keeps the method and the schedule (γ, K, sampling, mask interval, importance window) of its checkpoint.
* Nothing is written in place: checkpoints and the final model go to a staging folder whose name starts with
  :data:`STAGING_PREFIX` (hidden, never ``checkpoint-*``) and are renamed into place once complete
  (:class:`~hf_lisa.trainer.LisaTrainer`, :func:`~hf_lisa.train.outputs.staged_final_model`). A staging folder
  that a kill left behind is removed by the next run in that ``--output_dir`` (:func:`clear_previous_run`).
* What hf-lisa wrote is recorded in :data:`MANIFEST_NAME` (:func:`record_outputs`): the final model's files, summary,
  plot and card, each ``checkpoint-N`` (before it is written) and ``runs/``. ``--overwrite_output_dir`` removes or
  replaces only those, and refuses a folder that holds anything else unless ``--delete_foreign_files`` is given
  (:func:`split_owned`; a folder from before the manifest is judged by the names a run writes).
* One run per folder at a time: :class:`~hf_lisa.train.run_folder.run_lock.OutputDirLock`, taken by :func:`check_output_dir`
  before it looks at what the folder holds, so that no other run writes between the check and this run's writes.
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

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ...errors import UsageError
from ...hub.summary import TRAINING_SUMMARY_NAME
from ...methods import FULL, METHODS, method_of_adapter, schedules_anything
from ...scheduler.state import LISA_STATE_FILE
from ...trainer_callbacks.state import stored_schedule_settings
from ...trainer import LisaTrainingArguments
from ...trainer.atomic import STAGING_PREFIX, fsync_tree
from .run_lock import LOCK_NAME, OutputDirLock, check_not_in_use

logger = logging.getLogger("hf_lisa.train")

#: the files that make a folder a model: weights and their shard indexes (``training_args.bin`` is a pickle too)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                   "*.ckpt", "*.gguf", "*.h5", "*.msgpack")
#: the files a saved model, its tokenizer and a run's summary consist of: what a new final model replaces
MODEL_FILE_PATTERNS = WEIGHT_PATTERNS + (
    "*config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
    "chat_template.*", "README.md", TRAINING_SUMMARY_NAME, "training_args.json", "loss.png",
)
#: the list of what hf-lisa train runs wrote in ``--output_dir`` (hidden, like the lock file and the staging folders)
MANIFEST_NAME = ".hf-lisa-manifest.json"
#: what a run writes at the top of ``--output_dir``: how a folder from before the manifest is judged (README.md only
#: beside a training_summary.json; checkpoint-N folders as well)
RUN_OUTPUT_PATTERNS = (
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
    "config.json", "generation_config.json", "adapter_config.json", "tokenizer*", "special_tokens_map.json",
    "added_tokens.json", "vocab.*", "merges.txt", "*.model", "chat_template.*", "additional_chat_templates",
    TRAINING_SUMMARY_NAME, "training_args.json", "loss.png", "runs",
)
#: ``--resume_from_checkpoint`` values that mean the newest complete checkpoint of ``--output_dir``
LATEST = ("latest", "true")
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
#: the LISA callback whose schedule a checkpoint of each LISA method holds, by the registry's ``schedule``
_SCHEDULE_CALLBACKS = {"blocks": "LisaCallback", "adapter": "LisaAdapterCallback"}


@dataclass
class RunTrainingArguments(LisaTrainingArguments):
    """The library's :class:`~hf_lisa.trainer.LisaTrainingArguments` (transformers' ``TrainingArguments`` and
    ``LisaTrainer``'s settings) with what the command adds: ``--overwrite_output_dir`` (which transformers 5 dropped),
    ``--delete_foreign_files`` and ``--keep_checkpoints``. A bad ``LisaTrainer`` setting is a usage error naming its
    option."""

    _option_prefix = "--"
    _option_error = UsageError

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Reuse a non-empty --output_dir: the checkpoints of the run it holds are removed before training "
            "starts and its final model is replaced when the new one is complete. Only what earlier hf-lisa train "
            "runs wrote there is removed: a folder that holds other files is refused (see --delete_foreign_files). "
            "Never allowed for the folder of the model being trained, nor for a folder with model weights that no "
            "hf-lisa train run wrote."
        },
    )
    delete_foreign_files: bool = field(
        default=False,
        metadata={
            "help": "--overwrite_output_dir, and also delete the files and folders in --output_dir that no hf-lisa "
            "train run wrote (README.md, configs, notes, ...) before training starts. Model weights that no run "
            "wrote are never deleted: such a folder is refused."
        },
    )
    keep_checkpoints: bool = field(
        default=True,
        metadata={
            "help": "Keep the checkpoint-N folders (model, optimizer state, RNG) in --output_dir beside the final "
            "model. false removes them once the final model is saved, never before and never after a failure."
        },
    )


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether the file name ``name`` matches one of the shell ``patterns``."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


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


def _resolve_resume(value, output_dir: str, lock: Optional[OutputDirLock] = None) -> Optional[str]:
    """The checkpoint ``--resume_from_checkpoint=value`` names, after checking it is complete; ``None`` for none."""
    if value is None or value is False or value == "":
        return None
    if value is True or str(value).lower() in LATEST:
        path = latest_checkpoint(output_dir)
        if path is None:
            missing = not os.path.isdir(output_dir) or (lock is not None and lock.created_folder)  # before the lock
            where = "does not exist" if missing else "holds no complete checkpoint-N folder"
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
    if method is not None and (not METHODS[method].samples_layers or not schedules_anything(config)):
        return method  # a LISA adapter with nothing to schedule (γ = 0, ρ = 0) is trained without a callback
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
    stored = schedules.get(_SCHEDULE_CALLBACKS.get(METHODS[lisa_args.method].schedule), {})
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
# What earlier runs wrote: the manifest
# ----------------------------------------------------------------------------------------------------------------------
def visible_entries(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that count as its content: not the lock, the manifest or a staging folder."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir)
                  if not name.startswith(STAGING_PREFIX) and name not in (LOCK_NAME, MANIFEST_NAME))


def read_manifest(output_dir: str) -> Optional[set[str]]:
    """The names :data:`MANIFEST_NAME` lists, or ``None`` when there is none (a folder from before it) or it cannot
    be read (then the folder is judged as one from before it)."""
    path = os.path.join(output_dir, MANIFEST_NAME)
    try:
        with open(path) as f:
            names = json.load(f)["written"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("Ignoring %s, which cannot be read (%s): judging the folder by its file names.", path, err)
        return None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        logger.warning("Ignoring %s: its 'written' is not a list of names.", path)
        return None
    return set(names)


def split_owned(output_dir: str, entries: Optional[list[str]] = None) -> tuple[list[str], list[str]]:
    """``(owned, foreign)``: the entries of ``output_dir`` that hf-lisa train runs wrote, and the others.

    Owned are the names the manifest lists. A folder without one (from an earlier hf-lisa version) owns the names
    that a run writes (:data:`RUN_OUTPUT_PATTERNS`, ``checkpoint-N`` folders) when it shows a run was there (a
    ``training_summary.json`` or a ``checkpoint-N`` folder), README.md only beside a ``training_summary.json``.
    """
    entries = visible_entries(output_dir) if entries is None else entries
    listed = read_manifest(output_dir)
    if listed is not None:
        owned = [name for name in entries if name in listed]
    else:
        summary = TRAINING_SUMMARY_NAME in entries
        checkpoints = [name for name in entries if _CHECKPOINT.match(name)
                       and os.path.isdir(os.path.join(output_dir, name))]
        owned = [] if not (summary or checkpoints) else [
            name for name in entries if name in checkpoints
            or (summary if name == "README.md" else matches(name, RUN_OUTPUT_PATTERNS))
        ]
    return owned, [name for name in entries if name not in owned]


def record_outputs(output_dir: str, names=()) -> None:
    """Write :data:`MANIFEST_NAME` (atomically): what hf-lisa owns in ``output_dir`` now, plus ``names``, entries about
    to be written (so that a kill while writing them leaves nothing unlisted). Entries gone are dropped; nothing is
    written when nothing changes, or when the folder holds nothing of hf-lisa's and has no manifest."""
    if not os.path.isdir(output_dir):
        return
    before = read_manifest(output_dir)
    listed = set(split_owned(output_dir)[0]) | set(names)
    if listed == before or (before is None and not listed):
        return
    staged = os.path.join(output_dir, STAGING_PREFIX + MANIFEST_NAME.lstrip("."))
    with open(staged, "w") as f:
        json.dump({"written_by": "hf-lisa train", "written": sorted(listed),
                   "note": "what hf-lisa train runs wrote here: --overwrite_output_dir removes or replaces only these"},
                  f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, os.path.join(output_dir, MANIFEST_NAME))


def claim_output_dir(training_args, lock: OutputDirLock) -> None:
    """On the process that saves: hold the folder's lock (taken by :func:`check_output_dir`), and start the manifest
    with what earlier runs wrote there and the TensorBoard logs this run writes (``runs/``)."""
    if not training_args.should_save:
        return
    lock.acquire()
    output_dir = training_args.output_dir
    logs = "tensorboard" in (training_args.report_to or []) and "runs" not in visible_entries(output_dir)
    record_outputs(output_dir, ["runs"] if logs else [])


def remove_checkpoints(output_dir: str) -> list[str]:
    """Remove the ``checkpoint-N`` folders that hf-lisa runs wrote in ``output_dir`` (``--keep_checkpoints false``,
    once the final model is in place); a folder that cannot be removed is reported, not raised. Returns the removed."""
    removed = []
    for name in split_owned(output_dir)[0]:
        path = os.path.join(output_dir, name)
        if _CHECKPOINT.match(name) and os.path.isdir(path) and not os.path.islink(path):
            try:
                shutil.rmtree(path)
                removed.append(name)
            except OSError as err:
                logger.warning("--keep_checkpoints false: could not remove %s (%s).", path, err)
    record_outputs(output_dir)
    if removed:
        logger.info("--keep_checkpoints false: removed %s from %s.", ", ".join(removed), output_dir)
    return removed


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
        raise UsageError(f"--output_dir={output_dir}: {parent} is not writable (a read-only file system, or not this "
                         "user's). Give another folder.")


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


def check_output_dir(model_args, lisa_args, training_args, lock: Optional[OutputDirLock] = None) -> Optional[str]:
    """Check ``--output_dir`` and ``--resume_from_checkpoint`` before anything loads; return the checkpoint to resume.

    ``training_args.resume_from_checkpoint`` is set to that checkpoint's path (``latest``/``true`` resolved), or
    ``None``; a resumed checkpoint must have been written with this run's method and schedule
    (:func:`check_resume_matches`). Raises [`~hf_lisa.errors.UsageError`] naming the option, the path and the fix.
    Writes only ``lock``, taken first on the process that saves (the content is checked under it): what must go is
    removed when the run is ready to train (:func:`clear_previous_run`), once checked removable here.
    """
    output_dir = training_args.output_dir
    overwrite, flag = _overwrite_flag(training_args)
    _check_writable_folder(output_dir)
    _check_not_the_model(output_dir, model_args.model_name_or_path)
    if training_args.should_save:  # the process that saves locks; the others would find the folder locked by it
        lock.acquire() if lock is not None else check_not_in_use(output_dir)
    entries = visible_entries(output_dir)
    _check_no_foreign_weights(output_dir, entries)
    resume = _resolve_resume(training_args.resume_from_checkpoint, output_dir, lock)
    if resume is not None:
        check_resume_matches(resume, lisa_args)
    own = resume is not None and os.path.realpath(os.path.dirname(os.path.normpath(resume))) == os.path.realpath(
        output_dir)
    if own and overwrite:
        raise UsageError(
            f"{flag} would delete the checkpoints of --output_dir={output_dir}, including "
            f"--resume_from_checkpoint={resume}. Resume without {flag}, or start over without "
            "--resume_from_checkpoint."
        )
    if entries and not overwrite and not own:
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        resumable = latest_checkpoint(output_dir)
        hint = f"--resume_from_checkpoint latest to continue from {resumable}, " if resumable else ""
        raise UsageError(
            f"--output_dir={output_dir} is not empty (it holds {shown}). Use {hint}--overwrite_output_dir to replace "
            "what hf-lisa train runs wrote there (--delete_foreign_files to delete the rest too), or another "
            "--output_dir."
        )
    if overwrite and entries:
        _check_foreign_files(output_dir, entries, getattr(training_args, "delete_foreign_files", False))
    _check_removable(output_dir, _to_clear(training_args), flag)
    training_args.resume_from_checkpoint = resume
    return resume


def _check_removable(output_dir: str, names: list[str], flag: str) -> None:
    """Every folder :func:`clear_previous_run` removes from is writable, checked before any weight loads: a removal
    failing half-way would leave half an earlier run."""
    trees = [path for path in (os.path.join(output_dir, name) for name in names) if not os.path.islink(path)]
    folders = [root for tree in trees if os.path.isdir(tree) for root, _, _ in os.walk(tree)]
    for folder in ([output_dir] if names else []) + folders:
        if not os.access(folder, os.W_OK | os.X_OK) or (folder != output_dir and os.path.ismount(folder)):
            raise UsageError(
                f"{flag}: --output_dir={output_dir}: {folder} is not writable (a read-only file system, a mount point, "
                "another user's), so it cannot be emptied. Nothing was deleted. Make it writable or move it away.")


def _overwrite_flag(training_args) -> tuple[bool, str]:
    """Whether the run replaces what ``--output_dir`` holds, and the flag that says so."""
    if getattr(training_args, "delete_foreign_files", False):
        return True, "--delete_foreign_files"
    return bool(getattr(training_args, "overwrite_output_dir", False)), "--overwrite_output_dir"


def _check_foreign_files(output_dir: str, entries: list[str], delete: bool) -> None:
    """Refuse to overwrite a folder holding what no hf-lisa train run wrote, unless ``delete``; never delete weights."""
    foreign = split_owned(output_dir, entries)[1]
    weights = [name for name in foreign if matches(name, WEIGHT_PATTERNS)]
    if weights:
        raise UsageError(
            f"--output_dir={output_dir} holds model weights that no hf-lisa train run wrote ({', '.join(weights[:4])}; "
            f"they are not in its {MANIFEST_NAME}). hf-lisa never deletes them, even with --delete_foreign_files. "
            "Move them away first, or choose another --output_dir."
        )
    if foreign and not delete:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise UsageError(
            f"--overwrite_output_dir: --output_dir={output_dir} holds files that no hf-lisa train run wrote: {shown}. "
            "--overwrite_output_dir removes only what earlier runs wrote there; nothing was deleted. Move those away, "
            "choose another --output_dir, or pass --delete_foreign_files true to delete them as well."
        )


def _to_clear(training_args) -> list[str]:
    """The names :func:`clear_previous_run` removes from ``--output_dir``, sorted."""
    output_dir = training_args.output_dir
    if not os.path.isdir(output_dir):
        return []
    overwrite, _ = _overwrite_flag(training_args)
    owned, foreign = split_owned(output_dir)
    names = [name for name in os.listdir(output_dir) if name.startswith(STAGING_PREFIX)]
    if overwrite:
        names += [name for name in owned if _CHECKPOINT.match(name)]
    if getattr(training_args, "delete_foreign_files", False):
        names += foreign
    return sorted(names)


def clear_previous_run(training_args) -> list[str]:
    """Remove what an earlier run left in ``--output_dir``: unfinished saves, and with ``--overwrite_output_dir`` its
    checkpoints (they would mix with this run's), with ``--delete_foreign_files`` also what no run wrote there
    (:func:`split_owned`). Its final model stays until this run's replaces it.

    Call it on the process(es) that save, once the run is ready to train. Returns the paths removed.
    """
    output_dir = training_args.output_dir
    removed = [os.path.join(output_dir, name) for name in _to_clear(training_args)]
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if removed:
        logger.info("Removed from %s what an earlier run left: %s", output_dir,
                    ", ".join(os.path.basename(p) for p in removed))
        record_outputs(output_dir)
    return removed
