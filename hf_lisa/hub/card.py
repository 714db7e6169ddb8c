"""The model card: metadata and the training table, rendered once from the training summary."""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional, Union

from ..methods import FULL_LISA, METHODS, method_of_adapter
from .load import TASK_TYPE_TO_AUTO_CLASS
from .staging import PUSH_MODES, _resolve_hub_base_model
from .summary import TrainingSummary

logger = logging.getLogger(__name__)


#: the card's title of each method, from the registry
METHOD_TITLES = {name: method.title for name, method in METHODS.items()}


TASK_TYPE_TO_PIPELINE_TAG = {
    "CAUSAL_LM": "text-generation",
    "SEQ_CLS": "text-classification",
    "SEQ_2_SEQ_LM": "text2text-generation",
    "TOKEN_CLS": "token-classification",
    "QUESTION_ANS": "question-answering",
    "FEATURE_EXTRACTION": "feature-extraction",
}


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


def _method_of(mode: str, adapter_config: Optional[dict], summary: TrainingSummary) -> str:
    if summary.method:
        return str(summary.method)
    if adapter_config is not None:
        return method_of_adapter(adapter_config) or str(adapter_config.get("peft_type", "")).lower() or "adapter"
    return FULL_LISA.name


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


def _training_rows(method: str, adapter_config: Optional[dict], summary: TrainingSummary) -> list[tuple[str, str]]:
    rows = [("Method", f"{METHOD_TITLES.get(method, method)} (`{method}`)")]
    lisa = dict(summary.lisa)
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
                from .. import __version__

                out.append((name, __version__))
    return out


def _card_base_model(base_model: Optional[str], card_data: dict, summary: TrainingSummary,
                     recorded_base: Optional[str]) -> Optional[str]:
    """The base model's Hub id for the metadata (popped from ``card_data``); warns when none is known."""
    hub_base = _resolve_hub_base_model(base_model, card_data.pop("base_model", None), summary.base_model,
                                       recorded_base)
    if hub_base is None:
        local = base_model or summary.base_model or recorded_base
        logger.warning(
            "No Hub id is known for the base model (%s): the card leaves base_model out, so the model will not be "
            "listed under its base model. Pass base_model='namespace/name' or set it in training_summary.json.",
            "a local path" if local else "unknown",
        )
    return hub_base


def _card_metadata(mode: str, method: str, task_type: str, hub_base: Optional[str], summary: TrainingSummary,
                   card_data: dict, license: Optional[str], datasets: list[str], metrics: dict, model_name: str):
    """The card's YAML metadata: library, license, tags, datasets, pipeline, model-index, base model, overrides."""
    from huggingface_hub import ModelCardData

    is_adapter = method in METHODS and METHODS[method].is_adapter
    tags = ["lisa"] + (["peft"] if mode == "adapter" or is_adapter else []) + [method]
    tags += [t for t in card_data.pop("tags", []) or [] if t not in tags]
    metadata = {
        "library_name": "peft" if mode == "adapter" else "transformers",
        "license": card_data.pop("license", None) or summary.license or license,
        "tags": list(dict.fromkeys(tags)),
        "datasets": datasets or None,
        "pipeline_tag": TASK_TYPE_TO_PIPELINE_TAG.get(task_type),
        "eval_results": _eval_results(metrics, TASK_TYPE_TO_PIPELINE_TAG.get(task_type, "text-generation"),
                                      datasets, summary.dataset_name, model_name),
    }
    if metadata["eval_results"]:
        metadata["model_name"] = model_name  # model-index needs a name; elsewhere it is noise in the metadata
    if hub_base:
        metadata["base_model"] = hub_base
        metadata["base_model_relation"] = "adapter" if mode == "adapter" else "finetune"
    metadata.update(card_data)
    return ModelCardData(**{k: v for k, v in metadata.items() if v is not None})


def _usage_fields(repo_id: Optional[str], hub_base: Optional[str], recorded_base: Optional[str],
                  model_config: Optional[dict], task_type: str) -> dict:
    """The template fields of the loading snippet: repo, base model and the auto classes to load with."""
    if model_config is not None and model_config.get("architectures"):
        auto_class = _auto_class_name_for(model_config)
    else:
        auto_class = TASK_TYPE_TO_AUTO_CLASS.get(task_type, "AutoModelForCausalLM")
    # PEFT's auto classes mirror transformers' names: AutoModelForCausalLM -> AutoPeftModelForCausalLM
    peft_auto = TASK_TYPE_TO_AUTO_CLASS.get(task_type, "AutoModelForCausalLM").replace("AutoModel", "AutoPeftModel")
    local_display = os.path.basename(os.path.normpath(str(recorded_base))) if recorded_base else "unknown"
    return {
        "repo_id": repo_id or "<namespace>/<repo>",
        "base_model": hub_base,
        "base_model_display": local_display,
        "auto_class": auto_class,
        "peft_auto_class": peft_auto,
    }


def _training_fields(mode: str, method: str, adapter_config: Optional[dict], summary: TrainingSummary,
                     metrics: dict, datasets: list[str], loss_plot: Optional[str]) -> dict:
    """The template fields of how it was trained: method, the training and module tables, metrics, loss plot."""
    config_for_rows = adapter_config if (adapter_config or {}).get("r") else None
    sparse = config_for_rows is not None and (
        float(config_for_rows.get("sparsity") or 0) > 0 or any((config_for_rows.get("sparsity_pattern") or {}).values())
    )
    return {
        "method": method,
        "method_title": METHOD_TITLES.get(method, method),
        "merged_from_adapter": mode == "merged" and adapter_config is not None,
        "has_masks": sparse,
        "interpolation": bool((adapter_config or {}).get("layer_interpolation")),
        "training_rows": _training_rows(method, adapter_config, summary),
        "module_groups": _module_groups(config_for_rows) if config_for_rows else [],
        "hyperparameters": [(_cell(k), _cell(_fmt(v))) for k, v in summary.hyperparameters.items()],
        "metrics": [(_cell(k), _cell(_fmt(v))) for k, v in metrics.items()],
        "datasets": datasets,
        "loss_plot": loss_plot,
    }


def render_model_card(
    repo_id: Optional[str] = None,
    mode: str = "adapter",
    *,
    base_model: Optional[str] = None,
    adapter_config: Optional[dict] = None,
    model_config: Optional[dict] = None,
    summary: Optional[Union[TrainingSummary, dict]] = None,
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
        base_model: Hub id of the base model. When unset, taken from ``summary.base_model`` or the adapter's
            ``base_model_name_or_path``; a local path is left out of the metadata with a warning, since the Hub
            rejects it.
        adapter_config: the adapter's ``adapter_config.json`` as a dict (for merged adapters too).
        model_config: the model's ``config.json`` as a dict.
        summary: the training summary: a [`TrainingSummary`], or its ``training_summary.json`` dict (method, lisa,
            hyperparameters, metrics, datasets, dataset_name, loss_plot, license).
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
    from huggingface_hub import ModelCard

    from .. import model_cards

    if mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is invalid; allowed: {PUSH_MODES}.")
    if not isinstance(summary, TrainingSummary):
        summary = TrainingSummary.from_dict(summary)
    card_data = dict(card_data or {})
    recorded_base = (adapter_config or {}).get("base_model_name_or_path") or (model_config or {}).get("_name_or_path")
    hub_base = _card_base_model(base_model, card_data, summary, recorded_base)
    method = _method_of(mode, adapter_config, summary)
    task_type = str((adapter_config or {}).get("task_type") or "CAUSAL_LM").upper()
    datasets = list(summary.datasets) or ([summary.dataset_name] if summary.dataset_name else [])
    metrics = {k: v for k, v in summary.metrics.items() if v is not None}
    model_name = (repo_id or "model").split("/")[-1]
    data = _card_metadata(mode, method, task_type, hub_base, summary, card_data, license, datasets, metrics,
                          model_name)
    return ModelCard.from_template(
        data,
        template_path=template_path or model_cards.template_path(),
        title=model_name,
        mode=mode,
        **_usage_fields(repo_id, hub_base, recorded_base, model_config, task_type),
        **_training_fields(mode, method, adapter_config, summary, metrics, datasets, loss_plot),
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
