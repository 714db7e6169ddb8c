"""Stage what a push uploads: adapter or merged weights, tokenizer files, the loss plot; refuse pickle, half folders.

Symbolic links: a link inside the folder being pushed (or exported: :mod:`hf_lisa.export` stages through here) whose
target stays inside that folder is followed like the file it points to. A link that leads out of the folder (or
nowhere) is never followed: it is not read, copied or uploaded, and a warning names the link and its target
(:func:`scan_links`). When such a link stands for a file the model is loaded from (``adapter_model.safetensors``,
``config.json``, weight shards), the push or export is refused with a :class:`~hf_lisa.errors.UsageError` naming it.

An adapter is pushed only with a Hub id for its base model: when its ``base_model_name_or_path`` is a local folder
and no Hub id is known (``base_model=``, ``card_data["base_model"]``, ``training_summary.json``'s ``base_model``), the
push is refused before anything is uploaded, since nobody could load the pushed adapter.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional, Union

from ..errors import UsageError
from .load import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_PICKLE_NAME,
    ADAPTER_SAFETENSORS_NAME,
    MODEL_CONFIG_NAME,
    _auto_class_for_config,
    from_pretrained,
)
from .summary import TRAINING_SUMMARY_NAME, TrainingSummary, jsonable

logger = logging.getLogger(__name__)


PUSH_MODES = ("adapter", "merged")

DEFAULT_LOSS_PLOT = "loss.png"

README_NAME = "README.md"

# formats that unpickle (and can run code) when loaded; never uploaded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")

TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
        "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
        "chat_template.jinja", "chat_template.json",
    }
)

ADAPTER_FILES = frozenset({ADAPTER_CONFIG_NAME, ADAPTER_SAFETENSORS_NAME})

MERGED_FILES = frozenset(
    {MODEL_CONFIG_NAME, "generation_config.json", "model.safetensors", "model.safetensors.index.json"}
)

MERGED_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg")


# a Hub repo id ("name" or "namespace/name"): what the Hub accepts as base_model
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][\w\-.]{0,95}/)?[A-Za-z0-9][\w\-.]{0,95}$")


class HubPushError(RuntimeError):
    """A push to the Hub failed. The message names the step and the cause and never contains the token.

    Attributes:
        stage: the step that failed, e.g. ``"creating the commit"``.
        status: the HTTP status of the failure, or ``None`` (connection errors, local checks).
    """

    def __init__(self, message: str, *, stage: Optional[str] = None, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.status = status


# ----------------------------------------------------------------------------------------------------------------------
# Staging: everything the commit will hold, written to a temporary folder first
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class _Staged:
    folder: str
    mode: str  # "adapter" | "merged"
    adapter_config: Optional[dict] = None  # the adapter's config, also for a merged adapter (for the card)
    model_config: Optional[dict] = None
    summary: TrainingSummary = field(default_factory=TrainingSummary)
    loss_plot: Optional[str] = None
    source_base: Optional[str] = None  # base_model_name_or_path as recorded by training (maybe a local path)
    skipped_links: list[str] = field(default_factory=list)  # "name -> target": links out of the source, not followed


def _is_pickle(path: str) -> bool:
    name = os.path.basename(path).lower()
    return name.endswith(PICKLE_SUFFIXES) or name == "training_args.bin"


def _looks_local(name: Optional[str]) -> bool:
    """Whether ``name`` is a filesystem path rather than a Hub repo id (the Hub rejects paths as base_model)."""
    if not name:
        return False
    if os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or not _HUB_ID_RE.fullmatch(name):
        return True
    return os.path.isdir(name)


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------------------------------------------------
# Symbolic links: never followed out of the folder being pushed or exported
# ----------------------------------------------------------------------------------------------------------------------
def _is_model_file(name: str) -> bool:
    """Whether transformers or PEFT may load the top-level file ``name`` as weights or config."""
    return name in MERGED_FILES or name in ADAPTER_FILES or (
        name.startswith(("model", "pytorch_model", "adapter_model")) and name.endswith((".safetensors", ".bin", ".json")))


def link_out_of(src: str, path: str) -> Optional[str]:
    """Where ``path`` leads when it (or a folder on its way) is a link out of ``src``; ``None`` while inside."""
    root, real = os.path.realpath(src), os.path.realpath(path)
    if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
        return None
    return os.readlink(path) if os.path.islink(path) else real


def scan_links(src: str) -> list[str]:
    """Every link under ``src`` that leads out of it, as ``"name -> target"``, each named in a warning; none is
    followed. A link standing for a model file (weights, config) is refused instead, naming it.

    Raises:
        UsageError: a weight or config file of ``src`` is a link out of it.
    """
    skipped = []
    for root, dirs, files in os.walk(src):  # links to folders are listed, never entered
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            target = link_out_of(src, path) if os.path.islink(path) else None
            if target is None:
                continue
            rel = os.path.relpath(path, src)
            if root == src and _is_model_file(name):
                raise UsageError(
                    f"{rel} in {src!r} is a symbolic link to {target!r}, outside that folder: hf-lisa never reads "
                    "weights or configs through a link that leaves the folder it pushes or exports. Copy the file "
                    "into the folder (e.g. `cp --remove-destination TARGET LINK`) if it belongs there."
                )
            logger.warning("Skipping %s -> %s: a symbolic link out of %s is never uploaded or copied.", rel, target,
                           src)
            skipped.append(f"{rel} -> {target}")
    return skipped


def copy_inside(src: str, rel: str, folder: str) -> bool:
    """Copy ``src/rel`` to ``folder/rel`` when it is a file that stays inside ``src`` (links in it followed)."""
    path = os.path.join(src, rel)
    if not os.path.isfile(path) or link_out_of(src, path) is not None:
        return False
    os.makedirs(os.path.dirname(os.path.join(folder, rel)), exist_ok=True)
    shutil.copy2(path, os.path.join(folder, rel))
    return True


def _resolve_mode(mode: Optional[str], kind: str, what: str) -> str:
    if mode is None:
        return "adapter" if kind == "adapter" else "merged"
    if mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {PUSH_MODES} (or None to choose from the input).")
    if mode == "adapter" and kind == "full":
        raise ValueError(
            f"{what} holds full model weights (full-parameter LISA or an already merged model), not an adapter; "
            "push it with mode='merged'."
        )
    return mode


def check_mergeable(peft_model) -> None:
    """Refuse before any copy or upload when the tuner cannot merge (layer interpolation raises ValueError)."""
    check = getattr(peft_model.base_model, "_check_merge_allowed", None)
    if check is None:
        return
    try:
        check()
    except ValueError as exc:
        raise ValueError(f"{exc} To share this model, push it with mode='adapter'.") from exc


def _copy_tokenizer_files(src: str, folder: str) -> list[str]:
    """Copy the tokenizer files of ``src`` (and ``additional_chat_templates/``) that stay inside it."""
    copied = [name for name in sorted(os.listdir(src)) if name in TOKENIZER_FILES and copy_inside(src, name, folder)]
    templates = os.path.join(src, "additional_chat_templates")
    if os.path.isdir(templates) and link_out_of(src, templates) is None:
        for root, _, names in os.walk(templates):
            for name in sorted(names):
                rel = os.path.relpath(os.path.join(root, name), src)
                if copy_inside(src, rel, folder):
                    copied.append(rel.replace(os.sep, "/"))
    return copied


def _find_loss_plot(src: str, summary: TrainingSummary) -> Optional[str]:
    name = summary.loss_plot or DEFAULT_LOSS_PLOT
    path = os.path.join(src, name)
    if not os.path.isfile(path):
        if summary.loss_plot:
            logger.warning("The training summary names loss plot %r, which is not in %s; the card has none.", name,
                           src)
        return None
    if not name.lower().endswith(IMAGE_SUFFIXES) or os.path.isabs(name) or ".." in name.split("/"):
        logger.warning("Ignoring loss plot %r: expected an image file inside the output directory.", name)
        return None
    return None if link_out_of(src, path) is not None else name  # a link out of src: scan_links named it


def stage_directory(src: str, mode: Optional[str], folder: str, tokenizer, max_shard_size, base_model,
                     summary: TrainingSummary) -> _Staged:
    if not os.path.isdir(src):
        raise FileNotFoundError(f"output directory {src!r} does not exist.")
    skipped_links = scan_links(src)  # before any file of src is read: refuses weights behind a link out of src
    adapter_config = _read_json(os.path.join(src, ADAPTER_CONFIG_NAME))
    model_config = _read_json(os.path.join(src, MODEL_CONFIG_NAME))
    if adapter_config is None and model_config is None:
        raise ValueError(
            f"{src!r} holds neither {ADAPTER_CONFIG_NAME} (adapter output) nor {MODEL_CONFIG_NAME} (full-parameter "
            "output); point push_to_hub at the directory the training saved its final model to."
        )
    kind = "adapter" if adapter_config is not None else "full"
    mode = _resolve_mode(mode, kind, f"{src!r}")
    staged = _Staged(folder=folder, mode=mode, adapter_config=adapter_config, model_config=model_config,
                     summary=summary, skipped_links=skipped_links)
    if adapter_config is not None:
        staged.source_base = adapter_config.get("base_model_name_or_path")

    if mode == "adapter":
        if not os.path.isfile(os.path.join(src, ADAPTER_SAFETENSORS_NAME)):
            if os.path.isfile(os.path.join(src, ADAPTER_PICKLE_NAME)):
                raise ValueError(
                    f"{src!r} has only {ADAPTER_PICKLE_NAME} (pickle), which hf-lisa never uploads. Re-save the "
                    "adapter with model.save_pretrained(dir), which writes adapter_model.safetensors."
                )
            raise FileNotFoundError(f"{src!r} has {ADAPTER_CONFIG_NAME} but no {ADAPTER_SAFETENSORS_NAME}.")
        for name in ADAPTER_FILES:
            copy_inside(src, name, folder)
    elif kind == "adapter":
        # merge from disk: one copy of the weights in memory, and the tuner's own merge (which refuses interpolation)
        override = base_model if _looks_local(staged.source_base) and not os.path.exists(staged.source_base) else None
        peft_model = from_pretrained(src, base_model=override)
        check_mergeable(peft_model)
        merged = peft_model.merge_and_unload(safe_merge=True)
        merged.save_pretrained(folder, max_shard_size=max_shard_size)
        staged.model_config = _read_json(os.path.join(folder, MODEL_CONFIG_NAME))
    else:
        _check_safetensors_weights(src)
        model_cls = _auto_class_for_config(model_config)
        # safetensors only (never a pickle beside them), and never the model's own code
        model = model_cls.from_pretrained(src, dtype="auto", use_safetensors=True, trust_remote_code=False)
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        staged.model_config = _read_json(os.path.join(folder, MODEL_CONFIG_NAME))
        staged.source_base = summary.base_model or model_config.get("_name_or_path")

    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    else:
        _copy_tokenizer_files(src, folder)
    staged.loss_plot = _find_loss_plot(src, summary)
    if staged.loss_plot:
        copy_inside(src, staged.loss_plot, folder)
    return staged


def _check_safetensors_weights(src: str) -> None:
    """Refuse a full-weights folder without safetensors weights, naming its pickle weights: never unpickled (issue 33
    item 14: converting ``pytorch_model.bin`` relied on torch's ``weights_only`` default alone to stop a payload)."""
    if any(os.path.isfile(os.path.join(src, name)) for name in ("model.safetensors", "model.safetensors.index.json")):
        return
    pickles = sorted(name for name in os.listdir(src) if os.path.isfile(os.path.join(src, name))
                     and name.startswith(("pytorch_model", "model")) and _is_pickle(name.removesuffix(".index.json")))
    if not pickles:
        raise FileNotFoundError(f"{src!r} has {MODEL_CONFIG_NAME} but no model.safetensors: no weights to push.")
    raise UsageError(
        f"{src!r} holds its weights only as pickle ({', '.join(pickles)}), which hf-lisa never unpickles: loading a "
        "pickle can run any code it carries. If you trust the file, convert it once to safetensors, e.g. "
        f"`AutoModelForCausalLM.from_pretrained({src!r}).save_pretrained({src!r})` (transformers writes "
        "model.safetensors), then run this again."
    )


def _stage_peft_model(model, mode: Optional[str], folder: str, tokenizer, max_shard_size,
                      summary: TrainingSummary) -> _Staged:
    mode = _resolve_mode(mode, "adapter", "the PeftModel")
    adapter_name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    config = jsonable(model.peft_config[adapter_name].to_dict())
    staged = _Staged(folder=folder, mode=mode, adapter_config=config, summary=summary,
                     source_base=config.get("base_model_name_or_path"))
    if mode == "adapter":
        scratch = tempfile.mkdtemp(prefix="peft-", dir=folder)
        model.save_pretrained(scratch, selected_adapters=[adapter_name], safe_serialization=True)
        # PEFT writes non-default adapters into a subfolder named after them
        saved = scratch if os.path.isfile(os.path.join(scratch, ADAPTER_CONFIG_NAME)) else os.path.join(
            scratch, adapter_name)
        for name in ADAPTER_FILES:
            if not os.path.isfile(os.path.join(saved, name)):
                raise HubPushError(f"PeftModel.save_pretrained did not write {name}.", stage="saving the adapter")
            shutil.move(os.path.join(saved, name), os.path.join(folder, name))
        shutil.rmtree(scratch)
        staged.adapter_config = _read_json(os.path.join(folder, ADAPTER_CONFIG_NAME))
    else:
        check_mergeable(model)
        # merge a copy: the caller's model stays a trainable PeftModel (costs one extra copy of the weights; push
        # the output directory instead to merge from disk)
        merged = copy.deepcopy(model).merge_and_unload(safe_merge=True)
        merged.save_pretrained(folder, max_shard_size=max_shard_size)
        staged.model_config = _read_json(os.path.join(folder, MODEL_CONFIG_NAME))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return staged


def _stage_full_model(model, mode: Optional[str], folder: str, tokenizer, max_shard_size,
                      summary: TrainingSummary) -> _Staged:
    mode = _resolve_mode(mode, "full", f"the {type(model).__name__}")
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    staged = _Staged(folder=folder, mode=mode, model_config=_read_json(os.path.join(folder, MODEL_CONFIG_NAME)),
                     summary=summary, source_base=summary.base_model or getattr(model, "name_or_path", None))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return staged


def summary_of_dir(src: str) -> TrainingSummary:
    """``training_summary.json`` of ``src``; an empty summary when there is none, or when it is a link out of ``src``
    (:func:`scan_links` names it)."""
    if link_out_of(src, os.path.join(src, TRAINING_SUMMARY_NAME)) is not None:
        return TrainingSummary()
    return TrainingSummary.from_dir(src)


def _summary_for(model_or_dir, summary: Optional[Union[TrainingSummary, dict]]) -> TrainingSummary:
    """The summary of a push: an object as given; a dict over the directory's ``training_summary.json``, if any."""
    if isinstance(summary, TrainingSummary):
        return summary
    if isinstance(model_or_dir, (str, os.PathLike)) and os.path.isdir(model_or_dir):
        return TrainingSummary.from_dict({**summary_of_dir(os.fspath(model_or_dir)).to_dict(), **(summary or {})})
    return TrainingSummary.from_dict(summary)


def _stage(model_or_dir, mode, folder, tokenizer, max_shard_size, base_model, summary) -> _Staged:
    summary = _summary_for(model_or_dir, summary)
    if isinstance(model_or_dir, (str, os.PathLike)):
        return stage_directory(os.fspath(model_or_dir), mode, folder, tokenizer, max_shard_size, base_model, summary)
    from peft import PeftModel
    from transformers import PreTrainedModel

    if isinstance(model_or_dir, PeftModel):
        return _stage_peft_model(model_or_dir, mode, folder, tokenizer, max_shard_size, summary)
    if isinstance(model_or_dir, PreTrainedModel):
        return _stage_full_model(model_or_dir, mode, folder, tokenizer, max_shard_size, summary)
    raise TypeError(
        f"push_to_hub got a {type(model_or_dir).__name__}; expected a peft.PeftModel, a transformers.PreTrainedModel "
        "(full-parameter LISA) or the path of a training output directory."
    )


def _resolve_hub_base_model(*candidates: Optional[str]) -> Optional[str]:
    """The first candidate that is a Hub repo id; local paths are skipped (the Hub's validator rejects them), except
    the embedded demo model's folder, which stands for its Hub id."""
    from ..models import DEFAULT_MODEL_ID, is_default_model

    for name in candidates:
        if name and not _looks_local(name):
            return name
        if name and is_default_model(name):
            return DEFAULT_MODEL_ID
    return None


def local_base_refusal(path: str, how: str) -> str:
    """Why an adapter whose base is the local folder ``path`` is not pushed, and ``how`` to name its Hub id."""
    return (f"the adapter's base model is the local folder {path!r} and no Hub id is known for it: the pushed "
            "adapter_config.json would name a folder nobody else has, so loading the adapter from the Hub would fail. "
            f"Pass the base model's Hub id with {how}; it is recorded in the pushed adapter_config.json.")


def _point_adapter_config_at_hub(staged: _Staged, hub_base: Optional[str]) -> None:
    """Make the uploaded adapter_config.json name the Hub base model, so that others can load it.

    Raises:
        UsageError: the config names a local folder and no Hub id is known (nothing is uploaded).
    """
    path = os.path.join(staged.folder, ADAPTER_CONFIG_NAME)
    config = _read_json(path)
    recorded = config.get("base_model_name_or_path")
    if _looks_local(recorded):
        if not hub_base:
            raise UsageError(local_base_refusal(recorded, "--base_model namespace/name (hf-lisa push) or "
                                                "base_model='namespace/name' (push_to_hub)") + " Nothing was uploaded.")
        logger.info("adapter_config.json: base_model_name_or_path %r -> %r (Hub id).", recorded, hub_base)
        config["base_model_name_or_path"] = hub_base
        _write_json(path, config)
        staged.adapter_config = config
    elif hub_base and recorded and recorded != hub_base:
        logger.warning("base_model=%r differs from the adapter config's base_model_name_or_path %r; the card uses "
                       "the former, loaders the latter.", hub_base, recorded)


# ----------------------------------------------------------------------------------------------------------------------
# Validation of the staged folder
# ----------------------------------------------------------------------------------------------------------------------
def _collect_files(folder: str, mode: str, loss_plot: Optional[str]) -> list[str]:
    """Files to upload: an allowlist per mode; pickle is dropped and, as a last guard, asserted absent."""
    allowed_exact = set(TOKENIZER_FILES) | {README_NAME} | (ADAPTER_FILES if mode == "adapter" else MERGED_FILES)
    if loss_plot:
        allowed_exact.add(loss_plot)
    keep, dropped = [], []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            allowed = (
                rel in allowed_exact
                or (mode == "merged" and MERGED_SHARD_RE.fullmatch(rel))
                or (rel.startswith("additional_chat_templates/") and rel.endswith(".jinja"))
            )
            (keep if allowed and not _is_pickle(rel) else dropped).append(rel)
    if dropped:
        logger.info("Not uploading %d staged file(s) outside the %s allowlist: %s", len(dropped), mode,
                    ", ".join(sorted(dropped)))
    pickled = [p for p in keep if _is_pickle(p)]
    if pickled:  # unreachable by construction; the guarantee must not depend on the allowlist staying right
        raise HubPushError(f"refusing to upload pickle files {pickled}.", stage="checking the files")
    return sorted(keep)


def _validate_staged(staged: _Staged, files: list[str]) -> None:
    from safetensors import safe_open

    folder = staged.folder

    def fail(message: str):
        raise HubPushError(f"the staged {staged.mode} upload is invalid: {message}", stage="checking the files")

    def tensor_names(path: str) -> list[str]:
        try:
            with safe_open(os.path.join(folder, path), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # noqa: BLE001 - any parse failure means a broken file
            fail(f"{path} is not a readable safetensors file ({exc}).")

    if README_NAME not in files:
        fail("README.md (the model card) is missing.")
    if staged.mode == "adapter":
        for name in ADAPTER_FILES:
            if name not in files:
                fail(f"{name} is missing.")
        config = _read_json(os.path.join(folder, ADAPTER_CONFIG_NAME))
        if not isinstance(config, dict) or not config.get("peft_type"):
            fail(f"{ADAPTER_CONFIG_NAME} has no peft_type.")
        keys = tensor_names(ADAPTER_SAFETENSORS_NAME)
        if not keys:
            fail(f"{ADAPTER_SAFETENSORS_NAME} holds no tensors.")
        if str(config["peft_type"]).upper() == "LISA":
            sparse = float(config.get("sparsity") or 0) > 0 or any((config.get("sparsity_pattern") or {}).values())
            if sparse and not any("lisa_mask" in k for k in keys):
                fail("the config is sparse but the weights hold no lisa_mask: the adapter would reload dense.")
            if config.get("layer_interpolation") and not any("lisa_interp_delta" in k for k in keys):
                fail("layer_interpolation is on but the weights hold no lisa_interp_delta/lisa_interp_beta.")
    else:
        if MODEL_CONFIG_NAME not in files:
            fail("config.json is missing.")
        shards = [f for f in files if f == "model.safetensors" or MERGED_SHARD_RE.fullmatch(f)]
        if "model.safetensors.index.json" in files:
            index = _read_json(os.path.join(folder, "model.safetensors.index.json"))
            needed = set((index or {}).get("weight_map", {}).values())
            missing = needed - set(files)
            if not needed or missing:
                fail(f"model.safetensors.index.json names missing shards {sorted(missing)}.")
        elif shards != ["model.safetensors"]:
            fail("no model.safetensors weights.")
        for shard in shards:
            leftovers = [k for k in tensor_names(shard) if "lisa_" in k or ".base_layer." in k]
            if leftovers:
                fail(f"{shard} still holds adapter tensors ({leftovers[:3]}...): the merge did not unload them.")
