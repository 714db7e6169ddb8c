"""The tables of the model card, from the training summary and the adapter config: the settings the method used, the
data it trained and was evaluated on, and rank, alpha and sparsity per group of adapted modules."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..methods import LISA_ADAPTER, METHODS
from .summary import TrainingSummary

#: the card's title of each method, from the registry
METHOD_TITLES = {name: method.title for name, method in METHODS.items()}


def lisa_adapter_title(adapter_config: Optional[dict]) -> str:
    """What a LISA adapter trains, in words, from its ``adapter_config.json``: the registry's title names every
    feature the form can use; a card must name the ones this adapter uses (issue 36: at sparsity 0 without sampling
    or interpolation it is the same update as LoRA, and its card must not promise sparsity or sampling)."""
    config = adapter_config or {}
    sparsity = float(config.get("sparsity") or 0)
    patterned = any((config.get("sparsity_pattern") or {}).values())
    gamma = int(config.get("lisa_activated_layers") or 0)
    parts = [f"sparse low-rank updates (sparsity {sparsity:g}{', per-module patterns' if patterned else ''})"
             if sparsity > 0 or patterned else "dense low-rank updates"]
    if gamma > 0:
        parts.append(f"{gamma} block(s) trained at a time, re-sampled every {config.get('lisa_interval_steps')} steps")
    if config.get("layer_interpolation"):
        parts.append("per-block layer interpolation")
    title = "LISA adapters: " + ", ".join(parts)
    if len(parts) == 1 and parts[0].startswith("dense"):
        title += " on every block (sparsity 0, no sampling: the same update as LoRA)"
    return title


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


def _module_groups(config: dict) -> list[dict]:
    """Rank, alpha, scaling and sparsity per group of adapted modules, from the config and its per-module patterns."""
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
        numbers = isinstance(gr, (int, float)) and isinstance(ga, (int, float)) and gr
        scaling = _fmt(ga / (gr ** 0.5 if config.get("use_rslora") else gr)) if numbers else "–"
        groups.append({"modules": _cell(modules), "r": _cell(_fmt(gr)), "alpha": _cell(_fmt(ga)), "scaling": scaling,
                       "sparsity": _cell(_fmt(gs)), "mask": mask})
    return groups


#: what the adapted-modules table shows: not repeated as settings rows when it is there
_MODULE_TABLE_KEYS = ("r", "lisa_alpha", "target_modules", "rank_pattern", "alpha_pattern", "sparsity",
                      "sparsity_pattern", "sparsity_structure", "block_size", "n_m")
#: the mask settings (they apply to a sparse LISA adapter only) and the layer-interpolation ones
_MASK_KEYS = ("mask_init", "mask_seed", "mask_update_interval", "importance_steps", "mask_keep_learned",
              "new_block_bonus", "fuse_sparse_delta")
_INTERPOLATION_KEYS = ("layer_interpolation", "interpolation_delta_bound", "interpolation_beta_l2")
#: the card's names of the other settings of ``training_summary.json``'s ``lisa`` dict
_SETTING_LABELS = {
    "exclude_modules": "Modules left out", "layers_to_transform": "Blocks adapted",
    "layers_pattern": "Block name pattern", "modules_to_save": "Modules trained in full and saved",
}


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, set, dict)) and not value)


def _is_sparse(config: dict, lisa: dict) -> bool:
    sparsity = lisa.get("sparsity", config.get("sparsity"))
    pattern = lisa.get("sparsity_pattern", config.get("sparsity_pattern")) or {}
    return bool(float(sparsity or 0) > 0 or any(float(v or 0) > 0 for v in pattern.values()))


def _lisa_adapter_rows(config: dict, lisa: dict, take) -> list[tuple[str, str]]:
    """Masks (when sparse) and layer interpolation: the settings only a LISA adapter has."""
    rows = []
    sparse = _is_sparse(config, lisa)
    mask = {key: take(key) for key in _MASK_KEYS}
    if sparse:
        init = _fmt(mask["mask_init"]) + (f" (seed {mask['mask_seed']})" if mask["mask_init"] == "random" else "")
        if mask["mask_update_interval"]:
            update = (f"re-selected every {_fmt(mask['mask_update_interval'])} steps from "
                      f"{_fmt(mask['importance_steps'])} batches (weight of |ΔW| {_fmt(mask['mask_keep_learned'])}, "
                      f"new-cell bonus {_fmt(mask['new_block_bonus'])})")
        else:
            update = "never re-selected"
        rows.append(("Mask selection", f"{init}, {update}"))
        if mask["fuse_sparse_delta"] is False:
            rows.append(("Sparse delta", "its own matmul (`fuse_sparse_delta=False`)"))
    interpolation = {key: take(key) for key in _INTERPOLATION_KEYS}
    if interpolation["layer_interpolation"]:
        rows.append(("Layer interpolation", f"h_l = α_l · f_l(h_(l−1)) + β_l, α_l = exp(δ_l), |δ_l| ≤ "
                                            f"{_fmt(interpolation['interpolation_delta_bound'])}, λ·Σβ² with λ = "
                                            f"{_fmt(interpolation['interpolation_beta_l2'])} (cannot be merged)"))
    else:
        rows.append(("Layer interpolation", "off"))
    return rows


def _training_rows(method: str, adapter_config: Optional[dict], summary: TrainingSummary,
                   module_table: bool = False) -> list[tuple[str, str]]:
    """The settings table: the method and the settings it used, nothing it does not have, no setting left unset.

    ``summary.lisa`` holds the settings of the method only (``lisa_knobs`` of ``hf-lisa train``); the adapter config
    fills in what a hand-written summary leaves out. Settings that a choice switched off (the mask settings of a dense
    adapter, the schedule of γ = 0, the interpolation bounds without interpolation) and those of the modules table
    (``module_table``) are not repeated."""
    lisa_adapter = str((adapter_config or {}).get("peft_type", "")).upper() == LISA_ADAPTER.adapter_type
    title = lisa_adapter_title(adapter_config) if lisa_adapter else METHOD_TITLES.get(method, method)
    rows = [("Method", f"{title} (`{method}`)")]
    lisa = dict(summary.lisa)
    config = adapter_config or {}
    is_lisa_adapter = (str(config.get("peft_type", "")).upper() == LISA_ADAPTER.adapter_type if config
                       else method == LISA_ADAPTER.name)

    def take(key: str, config_key: Optional[str] = None):
        value = lisa.pop(key, None)
        return config.get(config_key or key) if value is None else value

    trainable = summary.trainable or {}
    if trainable.get("trainable_params") and trainable.get("total_params"):
        share = 100 * trainable["trainable_params"] / trainable["total_params"]
        rows.append(("Trainable parameters at the start", f"{trainable['trainable_params']:,} of "
                                                          f"{trainable['total_params']:,} ({share:.3g} %)"))
    gamma = take("lisa_activated_layers")
    interval, sampling = take("lisa_interval_steps"), take("lisa_sampling")
    policy = take("lisa_optimizer_state_policy")
    if gamma:
        rows.append(("Layer sampling", f"γ = {gamma} blocks active at a time, switched every K = {_fmt(interval)} "
                                       f"optimizer steps, {_fmt(sampling)} sampling"))
        if policy:
            rows.append(("Optimizer state of a block switched off", _fmt(policy)))
    elif is_lisa_adapter:
        rows.append(("Layer sampling", "off: every block's adapter trains (γ = 0)"))
    if "lisa_always_trainable" in lisa:
        always = lisa.pop("lisa_always_trainable")
        rows.append(("Always trainable", _fmt(always) if always else "nothing besides the sampled blocks"))
    attribute = take("lisa_layers_attribute")
    if attribute:
        rows.append(("Block list", f"`{attribute}`"))
    if is_lisa_adapter:
        rows += _lisa_adapter_rows(config, lisa, take)
    if module_table:
        for key in _MODULE_TABLE_KEYS:
            lisa.pop(key, None)
    if config or "lisa_dropout" in lisa:
        dropout = take("lisa_dropout", "lisa_dropout" if is_lisa_adapter else "lora_dropout")
        if dropout is not None:
            rows.append(("Dropout", _fmt(dropout)))
    if config.get("use_dora"):
        rows.append(("Weight decomposition", "DoRA: a learned magnitude per output feature, the low-rank update "
                                             "changes the direction"))
    if config.get("use_rslora"):
        rows.append(("Scaling", "rank-stabilised: s = α / √r"))
    lisa.pop("layerwise_lr_decay", None)  # a hyperparameter: in that table
    for key, value in sorted(lisa.items()):
        if not _empty(value):
            rows.append((_SETTING_LABELS.get(key, f"`{key}`"), _fmt(value)))
    return [(_cell(name), _cell(value)) for name, value in rows]


#: the row formats of ``hf-lisa train``, as the card names them
_FORMAT_TITLES = {"prompt_completion": "prompt/completion", "messages": "chat", "text": "plain text",
                  "alpaca": "Alpaca", "sharegpt": "ShareGPT",
                  "preference": "preference (prompt, chosen, rejected)"}


def _count(n: Any, what: str = "row") -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}" if isinstance(n, int) else "–"


def _skipped(by_reason: dict) -> str:
    total = sum(by_reason.values())
    reasons = ", ".join(f"{reason}: {n:,}" for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"{total:,} ({reasons})" if total else "0"


def _data_rows(summary: TrainingSummary, metrics: dict) -> list[tuple[str, str]]:
    """The data table: where the rows came from, how many trained, were held out and skipped, what was evaluated.

    Read from ``summary.data`` (the tokenisation report of the run) and the run's data arguments; empty for a summary
    without them. File names are shown without their folders."""
    data = summary.data or {}
    args = (summary.arguments or {}).get("data") or {}
    kept, skipped = data.get("rows_kept") or {}, data.get("rows_skipped") or {}
    if not data:
        return []
    name = summary.dataset_name
    train_file, validation_file = data.get("train_file"), data.get("validation_file")
    source = data.get("source")
    if name:
        config_name = args.get("dataset_config_name")
        what = f"[{name}](https://huggingface.co/datasets/{name})" + (f" (`{config_name}`)" if config_name else "")
    elif source and source != train_file:
        what = str(source)  # the bundled task: a description, not a file of the user's
    elif train_file:
        what = f"`{os.path.basename(str(train_file))}`"
    else:
        what = "–"
    fmt = _FORMAT_TITLES.get(data.get("format"), data.get("format"))
    rows = [("Training data", what + (f", {fmt} rows" if fmt else ""))]
    if "train" in kept:
        cap = args.get("max_train_samples")
        rows.append(("Rows trained", f"{kept['train']:,}" + (f" (capped by `--max_train_samples {cap}`)" if cap
                                                               else "")))
    val_skipped = sum((skipped.get("validation") or {}).values())
    if "validation" in kept:
        held_out = kept["validation"] + val_skipped
        if validation_file and not name:
            whose = "the task's" if what == str(source) else "the"  # the bundled task's own validation file
            origin = f"{whose} validation file `{os.path.basename(str(validation_file))}`"
        elif name:
            origin = (f"the dataset's validation split (else its test split, else "
                      f"{_fmt(args.get('validation_split_percentage'))} % of its train split)")
        else:
            seed = summary.hyperparameters.get("seed")
            origin = (f"{_fmt(args.get('validation_split_percentage'))} % of the training file, split off at "
                      f"random{f' with seed {seed}' if seed is not None else ''}")
        cap = args.get("max_eval_samples")
        rows.append(("Rows held out for evaluation", f"{held_out:,} ({origin}"
                                                     + (f", capped by `--max_eval_samples {cap}`)" if cap else ")")))
    elif kept:
        rows.append(("Rows held out for evaluation", "none: no validation data"))
    if skipped:
        counts = [(split, by_reason or {}) for split, by_reason in skipped.items()]
        rows.append(("Rows skipped", "; ".join(f"{split}: {_skipped(by_reason)}" for split, by_reason in counts)
                     if any(sum(by_reason.values()) for _, by_reason in counts) else "none"))
    rows.append(("Evaluation", _evaluation(metrics, kept, val_skipped, args)))
    return [(_cell(n), _cell(v)) for n, v in rows]


def _evaluation(metrics: dict, kept: dict, val_skipped: int, args: dict) -> str:
    """What the metrics were measured on: rows evaluated, generation samples, before and after training."""
    names = (("eval_loss", "loss"), ("eval_perplexity", "perplexity"), ("eval_token_accuracy", "token accuracy"),
             ("eval_rewards/accuracies", "DPO reward accuracy and margin"))
    measured = [label for key, label in names if key in metrics]
    parts = []
    if measured and "validation" in kept:
        parts.append(f"{', '.join(measured)} on {_count(kept['validation'], 'held-out row')}")
    if "eval_exact_match" in metrics:
        requested = args.get("eval_generation_samples")
        if isinstance(requested, int) and "validation" in kept:
            n = min(requested, kept["validation"] + val_skipped)
            parts.append(f"exact match of greedy generations on {'up to ' if val_skipped else ''}"
                         f"{_count(n, 'held-out prompt')}")
        else:
            parts.append("exact match of greedy generations on held-out prompts")
    if not parts:
        return "none"
    when = "before and after training" if any(k.endswith("_before") for k in metrics) else "after training"
    return "; ".join(parts) + f" ({when})"
