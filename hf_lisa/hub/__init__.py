"""Share LISA models on the Hugging Face Hub: adapter-only or merged weights, a real model card, one atomic commit.

``push_to_hub`` builds everything in a temporary folder (weights as safetensors, configs, tokenizer, ``README.md``),
checks it, and uploads it as a single ``create_commit``: an upload that fails midway leaves the repo as it was.
What today's stack gets wrong, and this module does not:

- ``PeftModel.push_to_hub`` publishes a card without ``base_model``, so the adapter never shows under its base model;
  the card here carries ``base_model``, ``base_model_relation``, ``library_name``, tags, license and ``model-index``.
- ``Trainer.push_to_hub`` uploads a pickled ``training_args.bin``; nothing pickled is ever uploaded here (allowlist
  plus a final assertion), and loading refuses pickle unless asked.
- Uploads go through ``huggingface_hub``'s own machinery (``http_backoff`` retries transient errors); the one thing it
  does not retry, the commit request, is retried here without ever committing twice: the commit names its parent, and
  a retry first checks whether the previous attempt already landed. Offline mode, 401/403/404 and invalid metadata
  fail at once.

Modules: :mod:`.summary` (the typed training summary), :mod:`.staging` (what is uploaded), :mod:`.card` (the model
card), :mod:`.push` (the commit), :mod:`.load` (``from_pretrained``, ``explain_missing_import``), :mod:`.cli`
(``hf-lisa push``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

from ..errors import MISSING_IMPORT_HINT

if TYPE_CHECKING:  # at run time these resolve on first use (``__getattr__``): `hf-lisa push --help` stays quick
    from .card import render_model_card
    from .cli import hub_cli
    from .load import explain_missing_import, from_pretrained
    from .push import push_to_hub
    from .staging import PICKLE_SUFFIXES, HubPushError
    from .summary import TRAINING_SUMMARY_NAME, TrainingSummary

# public name -> the submodule defining it
_LAZY = {
    "render_model_card": "card", "hub_cli": "cli", "explain_missing_import": "load", "from_pretrained": "load",
    "push_to_hub": "push", "PICKLE_SUFFIXES": "staging", "HubPushError": "staging",
    "TRAINING_SUMMARY_NAME": "summary", "TrainingSummary": "summary",
}

# submodules reachable as attributes of the package, imported on first access
_SUBMODULES = frozenset({"card", "cli", "load", "push", "staging", "summary"})


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, _SUBMODULES)


__all__ = [
    "MISSING_IMPORT_HINT",
    "PICKLE_SUFFIXES",
    "TRAINING_SUMMARY_NAME",
    "HubPushError",
    "TrainingSummary",
    "explain_missing_import",
    "from_pretrained",
    "hub_cli",
    "push_to_hub",
    "render_model_card",
]
