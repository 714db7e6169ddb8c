"""A pickle that runs code when unpickled, for the tests that prove hf-lisa never unpickles (issue 33 item 14).

:func:`save_pickled_full_model` writes a full-weights model folder as older transformers versions saved one
(``config.json`` and ``pytorch_model.bin``), whose pickle also holds a :class:`MarkerPayload`: unpickled without
torch's ``weights_only`` guard (``torch.load(path, weights_only=False)``, the default before torch 2.6), it creates
the marker file. A test asserts the marker never appears, and that the payload is live by unpickling it itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class MarkerPayload:
    """Unpickling this opens ``marker`` for writing, creating the file: proof that code in the pickle ran."""

    def __init__(self, marker) -> None:
        self.marker = os.fspath(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def save_pickled_full_model(folder, marker, model, tokenizer=None) -> Path:
    """``folder`` with ``model``'s config, its weights as the pickle ``pytorch_model.bin`` carrying a
    :class:`MarkerPayload` for ``marker``, and ``tokenizer``'s files. Returns the path of the pickle."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    state["payload"] = MarkerPayload(marker)
    torch.save(state, folder / "pytorch_model.bin")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder / "pytorch_model.bin"
