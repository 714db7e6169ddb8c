"""Fine-tune a causal LM with LISA (or LoRA, DoRA, full fine-tuning) from the command line.

Runs under ``accelerate launch`` as a module, or through the ``hf-lisa`` command::

    accelerate launch -m hf_lisa.train examples/configs/smollm2_lisa.yaml --max_steps 200
    hf-lisa train --method lisa-adapter --train_file data.jsonl --output_dir out --max_steps 100

Arguments are the fields of four dataclasses, parsed by ``HfArgumentParser``: [`ModelArguments`],
[`DataArguments`], [`LisaArguments`] and transformers' full ``TrainingArguments``. Names follow transformers'
``run_clm.py`` where they exist. A YAML (or JSON) file given as the first argument supplies values; command-line
flags after it override them (the command line wins). ``hf-lisa config-reference`` prints every option.

Every ``--method`` uses the same data, the same ``Trainer``, the same evaluation and the same monitoring, so that runs
compare fairly; only the model wrapping and the scheduling callback differ:

* ``lisa``: full-parameter LISA on the plain model (``trainer_callbacks.LisaCallback``), saved as full weights;
* ``lisa-adapter``: a ``LisaConfig`` PEFT adapter (``trainer_callbacks.LisaAdapterCallback``), saved as an adapter;
* ``lora`` / ``dora``: PEFT's LoRA / DoRA with the same ``r``, ``lisa_alpha`` and ``target_modules``;
* ``full``: every parameter trains.

With no ``--model_name_or_path`` the embedded SmolLM2-135M-Instruct is used (see [`hf_lisa.models`]); with no data
argument the bundled arithmetic task (see [`hf_lisa.demo_task`]).

Example (Python):
    ```py
    >>> from hf_lisa.train import main
    >>> argv = ["--method", "lora", "--train_file", "data.jsonl", "--output_dir", "out", "--max_steps", "10"]
    >>> summary = main(argv)  # doctest: +SKIP
    >>> summary["metrics"]["eval_loss"]  # doctest: +SKIP
    ```


The application, in the order a run uses it (its library face is :mod:`hf_lisa.trainer`, its data
:mod:`hf_lisa.data`):

* :mod:`.parsing`: the option dataclasses, command line over a YAML/JSON file, the cross-checks;
* :mod:`.run_folder`: what ``--output_dir`` may be, ``--resume_from_checkpoint latest``, one run per folder;
* :mod:`.preflight`: the model's ``config.json`` and a ``meta``-device model checked before any weights load;
* :mod:`hf_lisa.data`: training files checked line by line, then tokenised rows (prompt/completion, chat messages,
  plain text), preference pairs for ``--stage dpo``;
* :mod:`.methods`, :mod:`.quantization`: the model loaded (:mod:`hf_lisa.models`) and the ``--method`` wrapping;
* the ``Trainer``: the library face's :class:`hf_lisa.trainer.LisaTrainer` (layer-wise learning-rate decay, atomic
  checkpoints), its settings parsed into :class:`~.run_folder.output_dir.RunTrainingArguments`, a
  :class:`hf_lisa.trainer.LisaTrainingArguments`; :mod:`.dpo`: ``--stage dpo`` through TRL's ``DPOTrainer``;
* :mod:`hf_lisa.evaluation`: token metrics and generation exact match;
* :mod:`.outputs`, :mod:`.console`: summary, loss plot, final model (staged, then renamed into place), model card;
* :mod:`.run`: ``run()`` and ``main()``; ``python -m hf_lisa.train`` goes through ``hf_lisa.cli.main`` (one error
  policy: a one-line message, exit status 2 for usage errors, 1 at runtime, 130 on Ctrl-C; ``--debug`` for the
  traceback)."""

from __future__ import annotations

from .parsing.arguments import (
    ADAPTER_METHODS,
    ARGUMENT_CLASSES,
    METHOD_NAMES,
    PUSH_MODES,
    DataArguments,
    LisaArguments,
    ModelArguments,
    parse_args,
    validate_args,
)
from .methods import apply_method, load_model_and_tokenizer, resolve_model_path
from .outputs import TRAINING_SUMMARY_NAME, save_final_model, trainable_summary
from .run import main, run

__all__ = [
    "ADAPTER_METHODS",
    "ARGUMENT_CLASSES",
    "METHOD_NAMES",
    "PUSH_MODES",
    "TRAINING_SUMMARY_NAME",
    "DataArguments",
    "LisaArguments",
    "ModelArguments",
    "apply_method",
    "load_model_and_tokenizer",
    "main",
    "parse_args",
    "resolve_model_path",
    "run",
    "save_final_model",
    "trainable_summary",
    "validate_args",
]
