"""The checkpoint format of the LISA schedule: small values as JSON, tensors in ``lisa_state.safetensors``.

A schedule's state (:meth:`LayerwiseScheduler.state_dict`, :meth:`MaskScheduler.state_dict`) is nested plain data
plus a few tensors: the sampler's generator state, the bit-packed new-cell grids of the mask schedule and, inside an
importance window, the importance accumulators. :func:`split_tensors` takes the tensors out and leaves a reference
``{"__tensor__": key}`` in their place; :func:`join_tensors` puts them back. Both are exact, and nothing is pickled.

* Trainer checkpoints: the LISA callbacks keep the small values in ``trainer_state.json`` (they are
  ``ExportableState``) and write the tensors with :func:`write_state_file` (see
  :mod:`hf_lisa.trainer_callbacks.state`).
* Custom loops and FSDP2 checkpoints: :func:`save_schedule` writes one ``lisa_state.safetensors`` holding both, the
  small values as JSON in the file's metadata; :func:`load_schedule` reads it back.

Every file carries the format name and :data:`SCHEDULER_STATE_VERSION`, and is written atomically (a temporary name in
the same folder, then ``os.replace``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

from .common import SCHEDULER_STATE_VERSION

LISA_STATE_FILE = "lisa_state.safetensors"
STATE_FORMAT = "hf-lisa-schedule"
_TENSOR = "__tensor__"


def check_state_version(version: Any, what: str) -> None:
    """Refuse schedule state written in another format than this hf-lisa's :data:`SCHEDULER_STATE_VERSION`.

    Version 2 kept the tensors inside ``trainer_state.json`` (base64); version 3 keeps them in
    ``lisa_state.safetensors``.
    """
    if str(version) != str(SCHEDULER_STATE_VERSION):
        raise ValueError(
            f"Cannot restore {what}: the checkpoint stores version {version} of its state and this hf-lisa reads "
            f"version {SCHEDULER_STATE_VERSION} (tensors in {LISA_STATE_FILE}). Resume with the hf-lisa release that "
            "wrote the checkpoint, or start a new run from the saved weights (an adapter loaded with "
            "PeftModel.from_pretrained(..., is_trainable=True) keeps its masks)."
        )


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` with every tensor replaced by ``{"__tensor__": key}`` (JSON-serialisable), and the tensors by key.

    Args:
        state: nested ``dict`` (string keys) / ``list`` / ``tuple`` of ``None``, bools, numbers, strings and tensors.

    Returns:
        The JSON-able tree, and the tensors (on CPU, contiguous) keyed by their path in ``state``, e.g.
        ``"layers/sampler/generator"``.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[path] = obj.detach().cpu().contiguous()
            return {_TENSOR: path}
        if isinstance(obj, Mapping):
            tree = {}
            for key, value in obj.items():
                if not isinstance(key, str):
                    raise TypeError(f"State keys must be strings to survive JSON; got {key!r} at {path or '/'}.")
                tree[key] = walk(value, f"{path}/{key}" if path else key)
            return tree
        if isinstance(obj, (list, tuple)):
            return [walk(value, f"{path}/{i}") for i, value in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"Cannot store a {type(obj).__name__} at {path or '/'} in the LISA schedule state.")

    return walk(state, ""), tensors


def join_tensors(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`: ``tree`` with every reference replaced by its tensor from ``tensors``."""
    if isinstance(tree, dict):
        if _TENSOR in tree:
            key = tree[_TENSOR]
            if key not in tensors:
                raise ValueError(
                    f"The LISA schedule references the tensor {key!r}, which its {LISA_STATE_FILE} does not hold: the "
                    "file and the schedule's values come from different checkpoints."
                )
            return tensors[key]
        return {key: join_tensors(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(value, tensors) for value in tree]
    return tree


def write_state_file(directory: str, tensors: Mapping[str, torch.Tensor], **metadata: str) -> str:
    """Write ``tensors`` to ``directory/lisa_state.safetensors`` atomically; ``metadata`` joins the format and version.

    Returns:
        The path written.
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LISA_STATE_FILE)
    temporary = os.path.join(directory, f".{LISA_STATE_FILE}.{os.getpid()}.tmp")
    header = {"format": STATE_FORMAT, "version": str(SCHEDULER_STATE_VERSION), **metadata}
    try:
        save_file(dict(tensors), temporary, metadata=header)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def read_state_file(directory: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of ``directory/lisa_state.safetensors``, after checking its format and version.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is not a LISA schedule file, or was written in another version of the format.
    """
    from safetensors import safe_open

    path = os.path.join(directory, LISA_STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing. The LISA schedule keeps its tensors there, next to the checkpoint it was saved with "
            "(hf-lisa < 0.2 kept them inside trainer_state.json and cannot be resumed by this release). Resume from "
            "the checkpoint folder the run wrote, with the file included."
        )
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    if metadata.get("format") != STATE_FORMAT:
        raise ValueError(
            f"{path} is not a LISA schedule file (its metadata has format={metadata.get('format')!r}, expected "
            f"{STATE_FORMAT!r}). Resume from a checkpoint folder written by hf-lisa."
        )
    check_state_version(metadata.get("version"), f"the LISA schedule in {path}")
    return tensors, metadata


def save_schedule(directory: str, state: Mapping[str, Any]) -> str:
    """Write a scheduler's ``state_dict()`` to ``directory/lisa_state.safetensors``: tensors, and the rest as JSON in
    the file's metadata (for custom loops; :func:`hf_lisa.distributed.save_fsdp2_checkpoint` uses it).

    Returns:
        The path written.
    """
    tree, tensors = split_tensors(state)
    return write_state_file(directory, tensors, state=json.dumps(tree))


def load_schedule(directory: str) -> Any:
    """Read back :func:`save_schedule` output: the ``state_dict`` to give the scheduler's ``load_state_dict``."""
    tensors, metadata = read_state_file(directory)
    if "state" not in metadata:
        raise ValueError(
            f"{os.path.join(directory, LISA_STATE_FILE)} holds only the tensors of a Trainer checkpoint; the rest of "
            "its schedule is in trainer_state.json. Resume it with trainer.train(resume_from_checkpoint=...)."
        )
    return join_tensors(json.loads(metadata["state"]), tensors)
