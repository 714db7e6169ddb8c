"""Share LISA models on the Hugging Face Hub: adapter-only or merged weights, a real model card, one atomic commit.

``push_to_hub`` builds everything in a temporary folder (weights as safetensors, configs, tokenizer, ``README.md``),
checks it, and uploads it as a single ``create_commit``: an upload that fails midway leaves the repo as it was.
What today's stack gets wrong, and this module does not:

- ``PeftModel.push_to_hub`` publishes a card without ``base_model``, so the adapter never shows under its base model;
  the card here carries ``base_model``, ``base_model_relation``, ``library_name``, tags, license and ``model-index``.
- ``Trainer.push_to_hub`` uploads a pickled ``training_args.bin``; nothing pickled is ever uploaded here (allowlist
  plus a final assertion), and loading refuses pickle unless asked.
- Transient HTTP errors (5xx, 429, dropped connections) are retried with exponential backoff, without ever committing
  twice: the commit names its parent, and a retry first checks whether the previous attempt already landed.

Loading lives in [`hf_lisa.loading`] and is re-exported here: ``from_pretrained`` and ``explain_missing_import``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from .errors import MISSING_IMPORT_HINT
from .loading import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_PICKLE_NAME,
    ADAPTER_SAFETENSORS_NAME,
    MODEL_CONFIG_NAME,
    TASK_TYPE_TO_AUTO_CLASS,
    _auto_class_for_config,
    explain_missing_import,
    from_pretrained,
)

logger = logging.getLogger(__name__)

PUSH_MODES = ("adapter", "merged")
TRAINING_SUMMARY_NAME = "training_summary.json"
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
TRANSIENT_STATUS_CODES = (408, 429, 500, 502, 503, 504)
_TRANSPORT_ERROR_NAMES = {"TransportError", "TimeoutException", "NetworkError", "RemoteProtocolError"}
# a Hub repo id ("name" or "namespace/name"): what the Hub accepts as base_model
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][\w\-.]{0,95}/)?[A-Za-z0-9][\w\-.]{0,95}$")

METHOD_TITLES = {
    "lisa": "full-parameter LISA: sampled blocks train in place",
    "lisa-adapter": "LISA adapters: sparse low-rank updates, layerwise sampled",
    "lora": "LoRA",
    "dora": "DoRA",
    "full": "full fine-tuning",
}
_ADAPTER_METHODS = ("lisa-adapter", "lora", "dora")
TASK_TYPE_TO_PIPELINE_TAG = {
    "CAUSAL_LM": "text-generation",
    "SEQ_CLS": "text-classification",
    "SEQ_2_SEQ_LM": "text2text-generation",
    "TOKEN_CLS": "token-classification",
    "QUESTION_ANS": "question-answering",
    "FEATURE_EXTRACTION": "feature-extraction",
}

__all__ = [
    "HubPushError",
    "push_to_hub",
    "from_pretrained",
    "render_model_card",
    "explain_missing_import",
    "hub_cli",
    "MISSING_IMPORT_HINT",
]


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
    summary: dict = field(default_factory=dict)
    loss_plot: Optional[str] = None
    source_base: Optional[str] = None  # base_model_name_or_path as recorded by training (maybe a local path)


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


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and isinstance(getattr(value, "value"), str):  # enums such as PeftType, TaskType
        return value.value
    return value


def _read_json(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


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


def _check_mergeable(peft_model) -> None:
    """Refuse before any copy or upload when the tuner cannot merge (layer interpolation raises ValueError)."""
    check = getattr(peft_model.base_model, "_check_merge_allowed", None)
    if check is None:
        return
    try:
        check()
    except ValueError as exc:
        raise ValueError(f"{exc} To share this model, push it with mode='adapter'.") from exc


def _copy_tokenizer_files(src: str, folder: str) -> list[str]:
    copied = []
    for name in sorted(os.listdir(src)):
        if name in TOKENIZER_FILES and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(folder, name))
            copied.append(name)
    templates = os.path.join(src, "additional_chat_templates")
    if os.path.isdir(templates):
        shutil.copytree(templates, os.path.join(folder, "additional_chat_templates"), dirs_exist_ok=True)
    return copied


def _find_loss_plot(src: str, summary: dict) -> Optional[str]:
    name = summary.get("loss_plot") or DEFAULT_LOSS_PLOT
    path = os.path.join(src, name)
    if not os.path.isfile(path):
        if summary.get("loss_plot"):
            logger.warning("training_summary.json names loss plot %r, which is not in %s; the card has none.", name,
                           src)
        return None
    if not name.lower().endswith(IMAGE_SUFFIXES) or os.path.isabs(name) or ".." in name.split("/"):
        logger.warning("Ignoring loss plot %r: expected an image file inside the output directory.", name)
        return None
    return name


def _stage_directory(src: str, mode: Optional[str], folder: str, tokenizer, max_shard_size, base_model) -> _Staged:
    if not os.path.isdir(src):
        raise FileNotFoundError(f"output directory {src!r} does not exist.")
    summary = _read_json(os.path.join(src, TRAINING_SUMMARY_NAME)) or {}
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
                     summary=summary)
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
            shutil.copy2(os.path.join(src, name), os.path.join(folder, name))
    elif kind == "adapter":
        # merge from disk: one copy of the weights in memory, and the tuner's own merge (which refuses interpolation)
        override = base_model if _looks_local(staged.source_base) and not os.path.exists(staged.source_base) else None
        peft_model = from_pretrained(src, base_model=override)
        _check_mergeable(peft_model)
        merged = peft_model.merge_and_unload(safe_merge=True)
        merged.save_pretrained(folder, max_shard_size=max_shard_size)
        staged.model_config = _read_json(os.path.join(folder, MODEL_CONFIG_NAME))
    else:
        model_cls = _auto_class_for_config(model_config)
        has_safetensors = any(
            os.path.isfile(os.path.join(src, n)) for n in ("model.safetensors", "model.safetensors.index.json")
        )
        if not has_safetensors:
            logger.warning("%s has no safetensors weights; loading its own pickle weights to convert them.", src)
        model = model_cls.from_pretrained(src, dtype="auto")
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        staged.model_config = _read_json(os.path.join(folder, MODEL_CONFIG_NAME))
        staged.source_base = summary.get("base_model") or model_config.get("_name_or_path")

    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    else:
        _copy_tokenizer_files(src, folder)
    staged.loss_plot = _find_loss_plot(src, summary)
    if staged.loss_plot:
        os.makedirs(os.path.dirname(os.path.join(folder, staged.loss_plot)), exist_ok=True)
        shutil.copy2(os.path.join(src, staged.loss_plot), os.path.join(folder, staged.loss_plot))
    return staged


def _stage_peft_model(model, mode: Optional[str], folder: str, tokenizer, max_shard_size, summary: dict) -> _Staged:
    mode = _resolve_mode(mode, "adapter", "the PeftModel")
    adapter_name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    config = _jsonable(model.peft_config[adapter_name].to_dict())
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
        _check_mergeable(model)
        # merge a copy: the caller's model stays a trainable PeftModel (costs one extra copy of the weights; push
        # the output directory instead to merge from disk)
        merged = copy.deepcopy(model).merge_and_unload(safe_merge=True)
        merged.save_pretrained(folder, max_shard_size=max_shard_size)
        staged.model_config = _read_json(os.path.join(folder, MODEL_CONFIG_NAME))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return staged


def _stage_full_model(model, mode: Optional[str], folder: str, tokenizer, max_shard_size, summary: dict) -> _Staged:
    mode = _resolve_mode(mode, "full", f"the {type(model).__name__}")
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    staged = _Staged(folder=folder, mode=mode, model_config=_read_json(os.path.join(folder, MODEL_CONFIG_NAME)),
                     summary=summary, source_base=summary.get("base_model") or getattr(model, "name_or_path", None))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return staged


def _stage(model_or_dir, mode, folder, tokenizer, max_shard_size, base_model, summary) -> _Staged:
    if isinstance(model_or_dir, (str, os.PathLike)):
        staged = _stage_directory(os.fspath(model_or_dir), mode, folder, tokenizer, max_shard_size, base_model)
        if summary:
            staged.summary = {**staged.summary, **summary}
        return staged
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
    """The first candidate that is a Hub repo id; local paths are skipped (the Hub's validator rejects them)."""
    for name in candidates:
        if name and not _looks_local(name):
            return name
    return None


def _point_adapter_config_at_hub(staged: _Staged, hub_base: Optional[str]) -> None:
    """Make the uploaded adapter_config.json name the Hub base model, so that others can load it."""
    path = os.path.join(staged.folder, ADAPTER_CONFIG_NAME)
    config = _read_json(path)
    recorded = config.get("base_model_name_or_path")
    if _looks_local(recorded):
        if hub_base:
            logger.info("adapter_config.json: base_model_name_or_path %r -> %r (Hub id).", recorded, hub_base)
            config["base_model_name_or_path"] = hub_base
            _write_json(path, config)
            staged.adapter_config = config
        else:
            logger.warning(
                "The adapter's base_model_name_or_path is the local path %r and no Hub id is known: others will "
                "need hf_lisa.from_pretrained(repo, base_model=...). Pass base_model='namespace/name' to fix it.",
                recorded,
            )
    elif hub_base and recorded and recorded != hub_base:
        logger.warning("base_model=%r differs from the adapter config's base_model_name_or_path %r; the card uses "
                       "the former, loaders the latter.", hub_base, recorded)


# ----------------------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(_fmt(v) for v in value) if value else "–"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items()) if value else "–"
    if value is None:
        return "–"
    return str(value)


def _cell(text: str) -> str:
    """A Markdown table cell: pipes would split it, newlines would end the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _method_of(mode: str, adapter_config: Optional[dict], summary: dict) -> str:
    if summary.get("method"):
        return str(summary["method"])
    if adapter_config is not None:
        peft_type = str(adapter_config.get("peft_type", "")).upper()
        if peft_type == "LISA":
            return "lisa-adapter"
        if peft_type == "LORA":
            return "dora" if adapter_config.get("use_dora") else "lora"
        return peft_type.lower() or "adapter"
    return "lisa"


def _module_groups(config: dict) -> list[dict]:
    """Rank, alpha and sparsity per group of adapted modules, from the config and its per-module patterns."""
    from peft.utils.other import get_pattern_key

    r, alpha = config.get("r"), config.get("lisa_alpha", config.get("lora_alpha"))
    sparsity = float(config.get("sparsity") or 0.0)
    patterns = {
        "r": config.get("rank_pattern") or {},
        "alpha": config.get("alpha_pattern") or {},
        "sparsity": config.get("sparsity_pattern") or {},
    }
    structure = config.get("sparsity_structure", "block")
    block, n_m = config.get("block_size") or (2, 2), config.get("n_m") or (2, 4)

    def resolve(key: str) -> tuple:
        def pick(pattern: dict, default):
            return pattern.get(get_pattern_key(pattern.keys(), key), default) if pattern else default

        return pick(patterns["r"], r), pick(patterns["alpha"], alpha), float(pick(patterns["sparsity"], sparsity))

    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple, set)) and targets:
        grouped: dict[tuple, list[str]] = {}
        for name in sorted(targets):
            grouped.setdefault(resolve(name), []).append(name)
        rows = [(", ".join(f"`{m}`" for m in names), key) for key, names in grouped.items()]
    else:
        label = f"`{targets}`" if targets else "architecture defaults"
        rows = [(label, (r, alpha, sparsity))]
        keys = sorted(set().union(*[set(p) for p in patterns.values()]))
        rows += [(f"`{k}` (pattern)", resolve(k)) for k in keys]

    groups = []
    for modules, (gr, ga, gs) in rows:
        if gs > 0:
            mask = {"block": f"{block[0]}×{block[1]} blocks", "n:m": f"{n_m[0]}:{n_m[1]}"}.get(structure, structure)
        else:
            mask = "dense (LoRA-equivalent)"
        scaling = _fmt(ga / gr) if isinstance(gr, (int, float)) and isinstance(ga, (int, float)) and gr else "–"
        groups.append({"modules": _cell(modules), "r": _cell(_fmt(gr)), "alpha": _cell(_fmt(ga)), "scaling": scaling,
                       "sparsity": _cell(_fmt(gs)), "mask": mask})
    return groups


def _training_rows(method: str, adapter_config: Optional[dict], summary: dict) -> list[tuple[str, str]]:
    rows = [("Method", f"{METHOD_TITLES.get(method, method)} (`{method}`)")]
    lisa = dict(summary.get("lisa") or {})
    config = adapter_config or {}
    gamma = lisa.pop("activated_layers", config.get("lisa_activated_layers"))
    interval = lisa.pop("interval_steps", config.get("lisa_interval_steps"))
    sampling = lisa.pop("sampling", config.get("lisa_sampling"))
    if gamma:
        rows.append(("Layer sampling", f"γ = {gamma} blocks active at a time, switched every K = {_fmt(interval)} "
                                       f"optimizer steps, {_fmt(sampling)} sampling"))
    elif str(config.get("peft_type", "")).upper() == "LISA":
        rows.append(("Layer sampling", "off: every block's adapter trains (γ = 0)"))
    attribute = lisa.pop("layers_attribute", config.get("lisa_layers_attribute"))
    if attribute:
        rows.append(("Block list", f"`{attribute}`"))
    if str(config.get("peft_type", "")).upper() == "LISA":
        if config.get("sparsity") or any((config.get("sparsity_pattern") or {}).values()):
            rows.append(("Mask selection", f"{_fmt(config.get('mask_init'))}, re-selected every "
                                           f"{_fmt(config.get('mask_update_interval'))} steps from "
                                           f"{_fmt(config.get('importance_steps'))} batches"))
        if config.get("layer_interpolation"):
            rows.append(("Layer interpolation", f"h_l = α_l · f_l(h_(l−1)) + β_l, α_l = exp(δ_l), |δ_l| ≤ "
                                                f"{_fmt(config.get('interpolation_delta_bound'))}, λ·Σβ² with λ = "
                                                f"{_fmt(config.get('interpolation_beta_l2'))} (cannot be merged)"))
        else:
            rows.append(("Layer interpolation", "off"))
    for key, value in sorted(lisa.items()):
        rows.append((f"LISA `{key}`", _fmt(value)))
    return [(_cell(name), _cell(value)) for name, value in rows]


def _eval_results(metrics: dict, task_type: str, datasets: list[str], dataset_name: Optional[str], model_name: str):
    from huggingface_hub import EvalResult

    dataset = dataset_name or (datasets[0] if datasets else None)
    if not dataset:
        if metrics:
            logger.info("Metrics are listed in the card body only: model-index needs a dataset name.")
        return None
    results = []
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        split = "validation" if name.startswith("eval_") else "test" if name.startswith("test_") else None
        metric_type = re.sub(r"^(eval|test|train)_", "", name)
        results.append(EvalResult(
            task_type=task_type, dataset_type=dataset, dataset_name=dataset, dataset_split=split,
            metric_type=metric_type, metric_name=name, metric_value=float(value),
        ))
    return results or None


def _framework_versions() -> list[tuple[str, str]]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("hf-lisa", "peft", "transformers", "torch", "huggingface_hub"):
        try:
            out.append((name, version(name)))
        except PackageNotFoundError:
            if name == "hf-lisa":
                from . import __version__

                out.append((name, __version__))
    return out


def render_model_card(
    repo_id: Optional[str] = None,
    mode: str = "adapter",
    *,
    base_model: Optional[str] = None,
    adapter_config: Optional[dict] = None,
    model_config: Optional[dict] = None,
    summary: Optional[dict] = None,
    card_data: Optional[dict] = None,
    loss_plot: Optional[str] = None,
    license: Optional[str] = None,
    template_path: Optional[str] = None,
):
    """Render the model card of a LISA adapter or merged model from the ``model_cards/`` template.

    The metadata places the model under its base model on the Hub: ``library_name`` (``peft`` for adapters,
    ``transformers`` for merged weights), ``base_model``, ``base_model_relation`` (``adapter`` / ``finetune``),
    ``tags`` (``lisa``, ``peft`` for adapters, the method), ``license``, ``datasets`` and the final metrics as
    ``model-index``. The body says how to load the model, how it was trained (method, γ, K, sampling, rank and
    sparsity per module group, interpolation), the hyperparameters, the metrics, the loss plot and the versions.

    Args:
        repo_id: the repo the card is for (used in the loading snippet and as the model-index name).
        mode: ``"adapter"`` or ``"merged"``.
        base_model: Hub id of the base model. When unset, taken from ``summary["base_model"]`` or the adapter's
            ``base_model_name_or_path``; a local path is left out of the metadata with a warning, since the Hub
            rejects it.
        adapter_config: the adapter's ``adapter_config.json`` as a dict (for merged adapters too).
        model_config: the model's ``config.json`` as a dict.
        summary: the training summary (``training_summary.json``: method, lisa, hyperparameters, metrics,
            datasets, dataset_name, loss_plot, license).
        card_data: metadata overrides, e.g. ``{"language": "en", "license": "mit"}``.
        loss_plot: file name of the loss plot inside the repo.
        license: license identifier, e.g. inherited from the base model.
        template_path: a custom Jinja template; ``model_cards.template_path()`` by default.

    Returns:
        `huggingface_hub.ModelCard`

    Example:
        ```py
        >>> from hf_lisa.hub import render_model_card
        >>> card = render_model_card("me/smollm2-lisa", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        ...                          adapter_config={"peft_type": "LISA", "task_type": "CAUSAL_LM", "r": 8})
        >>> card.data.base_model_relation
        'adapter'
        ```
    """
    from huggingface_hub import ModelCard, ModelCardData

    from . import model_cards

    if mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {PUSH_MODES}.")
    summary = dict(summary or {})
    card_data = dict(card_data or {})
    recorded_base = (adapter_config or {}).get("base_model_name_or_path") or (model_config or {}).get("_name_or_path")
    hub_base = _resolve_hub_base_model(base_model, card_data.pop("base_model", None), summary.get("base_model"),
                                       recorded_base)
    if hub_base is None:
        local = base_model or summary.get("base_model") or recorded_base
        logger.warning(
            "No Hub id is known for the base model (%s): the card leaves base_model out, so the model will not be "
            "listed under its base model. Pass base_model='namespace/name' or set it in training_summary.json.",
            "a local path" if local else "unknown",
        )
    method = _method_of(mode, adapter_config, summary)
    task_type = str((adapter_config or {}).get("task_type") or "CAUSAL_LM").upper()
    datasets = summary.get("datasets") or ([summary["dataset_name"]] if summary.get("dataset_name") else [])
    datasets = [datasets] if isinstance(datasets, str) else list(datasets)
    metrics = {k: v for k, v in (summary.get("metrics") or {}).items() if v is not None}
    model_name = (repo_id or "model").split("/")[-1]

    tags = ["lisa"] + (["peft"] if mode == "adapter" or method in _ADAPTER_METHODS else []) + [method]
    tags += [t for t in card_data.pop("tags", []) or [] if t not in tags]
    metadata = {
        "library_name": "peft" if mode == "adapter" else "transformers",
        "license": card_data.pop("license", None) or summary.get("license") or license,
        "tags": list(dict.fromkeys(tags)),
        "datasets": datasets or None,
        "pipeline_tag": TASK_TYPE_TO_PIPELINE_TAG.get(task_type),
        "eval_results": _eval_results(metrics, TASK_TYPE_TO_PIPELINE_TAG.get(task_type, "text-generation"),
                                      datasets, summary.get("dataset_name"), model_name),
    }
    if metadata["eval_results"]:
        metadata["model_name"] = model_name  # model-index needs a name; elsewhere it is noise in the metadata
    if hub_base:
        metadata["base_model"] = hub_base
        metadata["base_model_relation"] = "adapter" if mode == "adapter" else "finetune"
    metadata.update(card_data)
    data = ModelCardData(**{k: v for k, v in metadata.items() if v is not None})

    hyperparameters = [(_cell(k), _cell(_fmt(v))) for k, v in (summary.get("hyperparameters") or {}).items()]
    config_for_rows = adapter_config if (adapter_config or {}).get("r") else None
    if model_config is not None and model_config.get("architectures"):
        auto_class = _auto_class_name_for(model_config)
    else:
        auto_class = TASK_TYPE_TO_AUTO_CLASS.get(task_type, "AutoModelForCausalLM")
    # PEFT's auto classes mirror transformers' names: AutoModelForCausalLM -> AutoPeftModelForCausalLM
    peft_auto = TASK_TYPE_TO_AUTO_CLASS.get(task_type, "AutoModelForCausalLM").replace("AutoModel", "AutoPeftModel")
    local_display = os.path.basename(os.path.normpath(str(recorded_base))) if recorded_base else "unknown"
    sparse = config_for_rows is not None and (
        float(config_for_rows.get("sparsity") or 0) > 0 or any((config_for_rows.get("sparsity_pattern") or {}).values())
    )
    return ModelCard.from_template(
        data,
        template_path=template_path or model_cards.template_path(),
        title=model_name,
        mode=mode,
        repo_id=repo_id or "<namespace>/<repo>",
        base_model=hub_base,
        base_model_display=local_display,
        method=method,
        method_title=METHOD_TITLES.get(method, method),
        merged_from_adapter=mode == "merged" and adapter_config is not None,
        has_masks=sparse,
        interpolation=bool((adapter_config or {}).get("layer_interpolation")),
        auto_class=auto_class,
        peft_auto_class=peft_auto,
        training_rows=_training_rows(method, adapter_config, summary),
        module_groups=_module_groups(config_for_rows) if config_for_rows else [],
        hyperparameters=hyperparameters,
        metrics=[(_cell(k), _cell(_fmt(v))) for k, v in metrics.items()],
        datasets=datasets,
        loss_plot=loss_plot,
        versions=_framework_versions(),
    )


def _auto_class_name_for(model_config: dict) -> str:
    arch = (model_config.get("architectures") or [""])[0]
    for suffix, auto in (
        ("ForCausalLM", "AutoModelForCausalLM"),
        ("ForSequenceClassification", "AutoModelForSequenceClassification"),
        ("ForConditionalGeneration", "AutoModelForSeq2SeqLM"),
        ("ForTokenClassification", "AutoModelForTokenClassification"),
        ("ForQuestionAnswering", "AutoModelForQuestionAnswering"),
    ):
        if arch.endswith(suffix):
            return auto
    return "AutoModel"


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


# ----------------------------------------------------------------------------------------------------------------------
# Upload: one commit, retried on transient errors, never twice
# ----------------------------------------------------------------------------------------------------------------------
def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status_of(exc: BaseException) -> Optional[int]:
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return None


def _is_transient(exc: BaseException) -> bool:
    for e in _chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status in TRANSIENT_STATUS_CODES
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if _TRANSPORT_ERROR_NAMES & {cls.__name__ for cls in type(e).__mro__}:
            return True
    return False


def _transport_cause(exc: BaseException) -> str:
    """The connection-level error under huggingface_hub's wrappers, e.g. "ConnectError: connection refused"."""
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError)) or _TRANSPORT_ERROR_NAMES & {
            c.__name__ for c in type(e).__mro__
        }:
            return f"{type(e).__name__}: {e}"
    return type(exc).__name__


def _server_message(exc: BaseException) -> str:
    for e in _chain(exc):
        message = getattr(e, "server_message", None)
        if message:
            return str(message).strip()
    return ""


class _Redactor:
    def __init__(self, token: Optional[str]) -> None:
        self.token = token if isinstance(token, str) and token else None

    def __call__(self, text: str) -> str:
        return text.replace(self.token, "***") if self.token else text


def _push_error(exc: BaseException, stage: str, repo_id: str, endpoint: str, attempts: int, redact) -> HubPushError:
    status = _status_of(exc)
    said = _server_message(exc)
    said = f" The server said: {said}" if said else ""
    where = f"{repo_id} on {endpoint}"
    if isinstance(exc, ValueError) and "Invalid metadata in README.md" in str(exc):
        message = f"the Hub rejected the model card metadata while {stage} for {where}: {exc}"
    elif status == 401:
        message = (f"authentication failed (HTTP 401) while {stage} for {where}: the token is invalid, expired or "
                   f"missing. Pass a valid write token (token=..., HF_TOKEN, or `hf auth login`).{said}")
    elif status == 403:
        message = (f"the Hub refused the write (HTTP 403) while {stage} for {where}: the token has no write access "
                   f"to this namespace, or the repository is read-only.{said}")
    elif status == 404:
        message = (f"not found (HTTP 404) while {stage} for {where}: the repository or branch does not exist or is "
                   f"not visible with this token.{said}")
    elif status == 412:
        message = (f"the branch moved while {stage} for {where} (HTTP 412, another commit landed first); nothing was "
                   f"committed by this push. Push again.{said}")
    elif _is_transient(exc):
        cause = f"HTTP {status}" if status else _transport_cause(exc)
        message = (f"{stage} for {where} failed after {attempts} attempt(s) with transient errors ({cause}). A push "
                   "is a single commit: unless the last request reached the server, the repository was left as it "
                   "was. Push again when the Hub is reachable.")
    else:
        message = f"{stage} for {where} failed: {type(exc).__name__}: {exc}"
    return HubPushError(redact(message), stage=stage, status=status)


def _with_retries(fn: Callable[[], Any], stage: str, ctx: dict, before_retry: Optional[Callable[[], Any]] = None):
    attempt = 0
    while True:
        try:
            if attempt and before_retry is not None:
                landed = before_retry()
                if landed is not None:
                    return landed
            return fn()
        except HubPushError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as HubPushError
            if not _is_transient(exc) or attempt >= ctx["max_retries"]:
                raise _push_error(exc, stage, ctx["repo_id"], ctx["endpoint"], attempt + 1, ctx["redact"]) from exc
            wait = min(ctx["retry_base_wait"] * 2**attempt, 30.0)
            attempt += 1
            logger.warning(
                "%s for %s hit a transient error (%s); retrying in %.1fs (attempt %d of %d).", stage,
                ctx["repo_id"], ctx["redact"](f"HTTP {_status_of(exc)}" if _status_of(exc) else type(exc).__name__),
                wait, attempt + 1, ctx["max_retries"] + 1,
            )
            time.sleep(wait)


def _upload(api, repo_id: str, folder: str, files: list[str], message: str, private: Optional[bool],
            revision: Optional[str], ctx: dict):
    from huggingface_hub import CommitInfo, CommitOperationAdd

    _with_retries(lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
                  "creating the repository", ctx)
    branch = revision or "main"
    if branch != "main":
        _with_retries(lambda: api.create_branch(repo_id, branch=branch, exist_ok=True),
                      f"creating branch {branch!r}", ctx)
    parent = _with_retries(lambda: api.repo_info(repo_id, revision=branch).sha, f"reading the head of {branch!r}", ctx)

    def commit():
        # fresh operations per attempt: create_commit mutates them
        operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=os.path.join(folder, p)) for p in files]
        return api.create_commit(repo_id, operations=operations, commit_message=message, revision=branch,
                                 parent_commit=parent)

    def landed_already():
        # a dropped connection can hide a commit that the server applied: never commit twice
        head = api.repo_info(repo_id, revision=branch).sha
        if head == parent:
            return None
        commits = api.list_repo_commits(repo_id, revision=branch)
        if len(commits) >= 2 and commits[0].title == message and commits[1].commit_id == parent:
            logger.warning("The previous attempt's commit %s reached %s before the connection dropped; not "
                           "committing twice.", head, repo_id)
            return CommitInfo(commit_url=f"{api.endpoint}/{repo_id}/commit/{head}", commit_message=message,
                              commit_description="", oid=head, _endpoint=api.endpoint)
        raise HubPushError(
            f"branch {branch!r} of {repo_id} moved to {head} during the push (another writer?); this push committed "
            "nothing. Push again.", stage="creating the commit",
        )

    logger.info("Pushing %d files to %s (branch %s) in one commit: %s", len(files), repo_id, branch, ", ".join(files))
    return _with_retries(commit, "uploading the files and creating the commit", ctx, before_retry=landed_already)


def _inherit_license(api, hub_base: Optional[str]) -> Optional[str]:
    """The base model's license from its Hub card, best effort: a card without one is still a valid card."""
    if not hub_base:
        return None
    try:
        data = api.model_info(hub_base, timeout=10).card_data
    except Exception as exc:  # noqa: BLE001 - offline, private or missing base: just no license
        logger.info("Could not read the license of %s (%s); the card has none unless given.", hub_base,
                    type(exc).__name__)
        return None
    license_ = data.get("license") if data is not None else None
    return license_ if isinstance(license_, str) else None


def push_to_hub(
    model_or_dir,
    repo_id: str,
    mode: Optional[str] = None,
    private: Optional[bool] = None,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    token: Optional[str] = None,
    card_data: Optional[dict] = None,
    base_model: Optional[str] = None,
    tokenizer=None,
    *,
    training_summary: Optional[dict] = None,
    max_shard_size: Union[int, str] = "5GB",
    endpoint: Optional[str] = None,
    max_retries: int = 3,
    retry_base_wait: float = 1.0,
):
    """Push a LISA adapter or merged model to the Hub as one commit with a complete model card.

    ``mode="adapter"`` uploads ``adapter_config.json`` and ``adapter_model.safetensors`` (factors, masks and
    interpolation scalars), the card, the loss plot and the tokenizer files when present. ``mode="merged"`` folds
    ``ΔW = s · M ⊙ (B A)`` into the base weights and uploads sharded safetensors with ``config.json``,
    ``generation_config.json`` and the tokenizer; adapters with layer interpolation cannot be merged and raise
    ``ValueError``. Full-parameter LISA output (a plain transformers model or its directory) is pushed as merged.

    Everything is built in a temporary folder and checked first, then uploaded by a single ``create_commit``: a
    failure leaves the repo as it was. Pickle files (``*.bin``, ``*.pt``, ``training_args.bin``, …) are never
    uploaded. Transient HTTP errors are retried with exponential backoff.

    Args:
        model_or_dir: a ``peft.PeftModel``, a ``transformers.PreTrainedModel`` (full-parameter LISA), or a training
            output directory. A directory may hold ``training_summary.json`` (method, LISA settings,
            hyperparameters, metrics, datasets, loss plot, license, the base model's Hub id) for the card.
        repo_id: ``"namespace/name"``; created if missing.
        mode: ``"adapter"`` or ``"merged"``; by default adapters are pushed as adapters and full weights as merged.
        private: create the repo private (an existing repo keeps its visibility).
        revision: branch to push to, created from ``main`` if missing.
        commit_message: defaults to "Upload adapter (hf-lisa, <method>)" / "Upload merged weights (...)".
        token: a write token; defaults to ``HF_TOKEN`` or the saved login. Never printed or logged.
        card_data: metadata overrides for the card, e.g. ``{"language": "en", "license": "mit"}``.
        base_model: Hub id of the base model, for the card and for the uploaded adapter config when training
            recorded a local path.
        tokenizer: a tokenizer to upload with the model.
        training_summary: the training summary as a dict, for model objects (a directory's file is read itself).
        max_shard_size: largest safetensors shard of merged weights.
        endpoint: the Hub endpoint; ``HF_ENDPOINT`` by default.
        max_retries: retries of each Hub call on transient errors (5xx, 429, dropped connections).
        retry_base_wait: first backoff in seconds; doubles at each retry, capped at 30 s.

    Returns:
        `huggingface_hub.CommitInfo`: the URL of the commit (a ``str``), with ``.oid``.

    Raises:
        HubPushError: the Hub refused or failed the push (the message names the step and the HTTP status).
        ValueError: invalid arguments, or an adapter that cannot be merged.

    Example:
        ```py
        >>> import hf_lisa
        >>> hf_lisa.push_to_hub("outputs/smollm2-lisa", "me/smollm2-lisa")  # doctest: +SKIP
        >>> hf_lisa.push_to_hub("outputs/smollm2-lisa", "me/smollm2-lisa-merged", mode="merged")  # doctest: +SKIP
        ```
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.utils import validate_repo_id

    if mode is not None and mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {PUSH_MODES} (or None to choose from the input).")
    validate_repo_id(repo_id)
    if "/" not in repo_id:
        raise ValueError(f"repo_id={repo_id!r} is invalid; expected 'namespace/name'.")
    if max_retries < 0 or retry_base_wait < 0:
        raise ValueError(f"max_retries={max_retries} and retry_base_wait={retry_base_wait} must be >= 0.")

    with tempfile.TemporaryDirectory(prefix="hf-lisa-push-") as folder:
        staged = _stage(model_or_dir, mode, folder, tokenizer, max_shard_size, base_model, dict(training_summary or {}))
        hub_base = _resolve_hub_base_model(base_model, (card_data or {}).get("base_model"),
                                           staged.summary.get("base_model"), staged.source_base)
        if staged.mode == "adapter":
            _point_adapter_config_at_hub(staged, hub_base)
        api = HfApi(endpoint=endpoint, token=token)
        license_ = None
        if not (card_data or {}).get("license") and not staged.summary.get("license"):
            license_ = _inherit_license(api, hub_base)
        card = render_model_card(
            repo_id, staged.mode, base_model=hub_base, adapter_config=staged.adapter_config,
            model_config=staged.model_config, summary=staged.summary, card_data=card_data,
            loss_plot=staged.loss_plot, license=license_,
        )
        card.save(os.path.join(folder, README_NAME))
        files = _collect_files(folder, staged.mode, staged.loss_plot)
        _validate_staged(staged, files)
        method = _method_of(staged.mode, staged.adapter_config, staged.summary)
        message = commit_message or (
            f"Upload adapter (hf-lisa, {method})" if staged.mode == "adapter"
            else f"Upload merged weights (hf-lisa, {method})"
        )
        ctx = {"repo_id": repo_id, "endpoint": api.endpoint, "redact": _Redactor(token or get_token()),
               "max_retries": max_retries, "retry_base_wait": retry_base_wait}
        info = _upload(api, repo_id, folder, files, message, private, revision, ctx)
    logger.info("Pushed %s to %s: %s", staged.mode, repo_id, info)
    return info


# ----------------------------------------------------------------------------------------------------------------------
# CLI: hf-lisa push OUTPUT_DIR REPO_ID --mode adapter|merged
# ----------------------------------------------------------------------------------------------------------------------
def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-lisa push",
        description="Push a training output directory to the Hugging Face Hub as a LISA adapter or merged model, in "
        "one commit, with a model card. No pickle file is uploaded.",
    )
    parser.add_argument("output_dir", help="Directory the training saved its final model to.")
    parser.add_argument("repo_id", help="Target repo, 'namespace/name'; created if missing.")
    parser.add_argument("--mode", choices=PUSH_MODES, default=None,
                        help="adapter: adapter_config.json + adapter_model.safetensors; merged: full safetensors "
                        "weights with the adapter folded in. Default: adapter for adapter output, merged for "
                        "full-parameter output.")
    parser.add_argument("--private", action="store_true", default=None, help="Create the repo private.")
    parser.add_argument("--revision", default=None, help="Branch to push to (created from main if missing).")
    parser.add_argument("--commit_message", "--commit-message", dest="commit_message", default=None)
    parser.add_argument("--token", default=None,
                        help="Write token. Prefer HF_TOKEN or `hf auth login`: a token on the command line can end "
                        "up in your shell history. Never printed.")
    parser.add_argument("--base_model", "--base-model", dest="base_model", default=None,
                        help="Hub id of the base model, when training used a local copy.")
    parser.add_argument("--max_shard_size", "--max-shard-size", dest="max_shard_size", default="5GB",
                        help="Largest safetensors shard in merged mode (default 5GB).")
    parser.add_argument("--max_retries", "--max-retries", dest="max_retries", type=int, default=3,
                        help="Retries on transient HTTP errors (default 3).")
    return parser


def hub_cli(argv: Optional[Sequence[str]] = None) -> int:
    """``hf-lisa push OUTPUT_DIR REPO_ID [--mode adapter|merged] [--private] [--revision R] [--commit_message M]
    [--token T]``.

    ``argv`` holds the arguments after ``hf-lisa push`` (a leading ``"push"`` is accepted too). Returns the exit
    code: 0 on success (the commit URL is printed), 1 when the push failed (the reason is printed, never the token),
    2 for invalid arguments.

    Example:
        ```py
        >>> from hf_lisa.hub import hub_cli
        >>> hub_cli(["outputs/smollm2-lisa", "me/smollm2-lisa", "--mode", "adapter"])  # doctest: +SKIP
        0
        ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "push":
        argv = argv[1:]
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on errors
        return int(exc.code or 0)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    redact = _Redactor(args.token)
    try:
        info = push_to_hub(
            args.output_dir, args.repo_id, mode=args.mode, private=args.private, revision=args.revision,
            commit_message=args.commit_message, token=args.token, base_model=args.base_model,
            max_shard_size=args.max_shard_size, max_retries=args.max_retries,
        )
    except (HubPushError, ValueError, FileNotFoundError, TypeError) as exc:
        print(f"hf-lisa push: error: {redact(str(exc))}", file=sys.stderr)
        return 1
    print(str(info))
    return 0


if __name__ == "__main__":
    sys.exit(hub_cli())
