"""``TrainingSummary``: what a training run hands to its model card and to a push, as one typed object.

``hf_lisa.train`` builds it once at the end of a run and writes it as ``training_summary.json``; the card renderer and
``push_to_hub`` take the object itself. Reading the file back (:meth:`TrainingSummary.from_dir`) is for pushing an
output directory later, e.g. with ``hf-lisa push OUTPUT_DIR REPO``. This module is a leaf: it imports no other part
of hf-lisa but the leaf :mod:`hf_lisa.renamed`, so the training job and the Hub code can both depend on it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from ..renamed import new_names

logger = logging.getLogger(__name__)


TRAINING_SUMMARY_NAME = "training_summary.json"


def jsonable(value: Any) -> Any:
    """``value`` with only JSON types: enums become their value, sets sorted lists, unknown objects their ``str``."""
    if isinstance(value, enum.Enum):  # PeftType, TaskType, SchedulerType, OptimizerNames (str enums)
        return jsonable(value.value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


@dataclass
class TrainingSummary:
    """The record of one training run: what the model card says and what ``training_summary.json`` holds.

    Every field is optional, so that a summary written by hand (or by an older hf-lisa) still renders a card.

    Args:
        base_model: Hub id of the base model (a local path is kept here but left out of the card's metadata).
        method: ``"lisa"``, ``"lisa-adapter"``, ``"lora"``, ``"dora"`` or ``"full"``.
        lisa: the settings the method used, and only those, by their one name (``lisa_activated_layers``,
            ``lisa_interval_steps``, ``lisa_sampling``, ``r``, ``sparsity``, ...): the model card lists them, less those
            a choice switched off. A summary written before 0.3 (``activated_layers``, ...) is read with the new
            names (:func:`hf_lisa.renamed.new_names`).
        hyperparameters: learning rate, steps, batch size, ... as shown in the card.
        metrics: final metrics by name (``eval_loss``, ``eval_exact_match``, ..., ``*_before`` for the start).
        datasets: Hub ids of the training datasets, for the card's ``datasets`` metadata.
        dataset_name: the dataset the metrics were measured on, for the card's ``model-index``.
        data: where the rows came from and how many were kept: ``source``, ``format``, ``train_file``,
            ``validation_file``, ``rows_kept`` (``{split: rows}``) and ``rows_skipped`` (``{split: {reason: rows}}``);
            the card's data table.
        loss_plot: file name of the loss plot inside the output directory.
        license: license identifier of the trained model.
        trainable: the trainable-parameter counts printed when training started (``trainable_params``,
            ``total_params``, ...).
        runtime_seconds: wall-clock time of the run.
        output_dir: where the run saved its model.
        arguments: the parsed command-line arguments, by group (``model``, ``data``, ``lisa``): the card reads the
            split percentage, the sample caps and the generation samples from ``data``, and from ``model`` whether the
            embedded default model was trained.

    Example:
        ```py
        >>> from hf_lisa.hub import TrainingSummary
        >>> summary = TrainingSummary.from_dict({"method": "lora", "metrics": {"eval_loss": 1.25}})
        >>> summary.metrics["eval_loss"], summary.to_dict()["method"]
        (1.25, 'lora')
        ```
    """

    base_model: Optional[str] = None
    method: Optional[str] = None
    lisa: dict[str, Any] = field(default_factory=dict)
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Optional[float]] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    dataset_name: Optional[str] = None
    data: dict[str, Any] = field(default_factory=dict)
    loss_plot: Optional[str] = None
    license: Optional[str] = None
    trainable: dict[str, Any] = field(default_factory=dict)
    runtime_seconds: Optional[float] = None
    output_dir: Optional[str] = None
    arguments: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "TrainingSummary":
        """Build a summary from a ``training_summary.json`` dict; unknown keys are dropped with a warning."""
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            logger.warning("Ignoring training summary keys %s; known keys: %s.", unknown, sorted(names))
        values = {k: v for k, v in data.items() if k in names and v is not None}
        if isinstance(values.get("lisa"), Mapping):
            values["lisa"] = new_names(values["lisa"])
        if isinstance(values.get("datasets"), str):
            values["datasets"] = [values["datasets"]]
        return cls(**values)

    @classmethod
    def from_dir(cls, directory: Union[str, os.PathLike]) -> "TrainingSummary":
        """Read ``training_summary.json`` of an output directory; an empty summary when there is none."""
        path = os.path.join(directory, TRAINING_SUMMARY_NAME)
        if not os.path.isfile(path):
            return cls()
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict: the keys of ``training_summary.json``, in field order."""
        return jsonable({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def save(self, directory: Union[str, os.PathLike]) -> str:
        """Write ``training_summary.json`` into ``directory`` and return its path."""
        path = os.path.join(directory, TRAINING_SUMMARY_NAME)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
        return path
