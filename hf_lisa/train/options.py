"""Which option of ``hf-lisa train`` applies to which method (:data:`OPTION_METHODS`), derived from what each method
is in the registry (:mod:`hf_lisa.methods`), and the one check made from it: a given option that the chosen method
does not use is refused.

An option is *given* when it was typed: named on the command line or a key of the config file (with a value: YAML
``null`` means "not set"), whatever its value, so ``--method lora --lisa_activated_layers 2`` is refused as ``3`` is.
Arguments built in Python, where nothing was typed, count an option as given when its value differs from its default
(:func:`given_options`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Optional

from ..errors import UsageError
from ..methods import METHODS, Method, method_defaults, method_names
from ..tuner.config import lisa_config_fields

#: LisaConfig fields that are not options of ``hf-lisa train``, and why
_NOT_OPTIONS = {"fan_in_fan_out": "set automatically for Conv1D targets", "init_weights": "False is for tests only"}
#: the LisaConfig fields that are options of ``hf-lisa train``, in LisaConfig's order
LISA_CONFIG_OPTIONS: tuple[str, ...] = tuple(f.name for f in lisa_config_fields() if f.name not in _NOT_OPTIONS)

#: LisaConfig settings that PEFT's LoraConfig has too, and their names there: what LoRA-type adapters use
LORA_CONFIG_NAMES = {
    "r": "r",
    "lisa_alpha": "lora_alpha",
    "lisa_dropout": "lora_dropout",
    "target_modules": "target_modules",
    "exclude_modules": "exclude_modules",
    "layers_to_transform": "layers_to_transform",
    "layers_pattern": "layers_pattern",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
}


def _configures_adapter(option: str):
    """Every LisaConfig setting configures a LISA adapter; the ones LoraConfig shares configure LoRA-type ones too."""
    return lambda m: m.is_lisa_adapter or (m.is_adapter and option in LORA_CONFIG_NAMES)


def _every(method: Method) -> bool:
    return True


#: option -> the methods that use it (names, in the registry's order)
OPTION_METHODS: dict[str, tuple[str, ...]] = {
    **{name: method_names(_configures_adapter(name)) for name in LISA_CONFIG_OPTIONS},
    # the layer schedule: both LISA forms (full-parameter LISA runs it through LisaCallback)
    **{name: method_names(lambda m: m.samples_layers)
       for name in ("lisa_activated_layers", "lisa_interval_steps", "lisa_sampling", "lisa_optimizer_state_policy")},
    # the modules that train besides the sampled blocks (E+H): full-parameter LISA only
    "lisa_always_trainable": method_names(lambda m: m.samples_base_blocks),
    # every method finds the block list: monitoring and layer-wise LR decay use it too
    "lisa_layers_attribute": method_names(_every),
    **dict.fromkeys(
        ("layerwise_lr_decay", "monitor_plateau_grad_norm", "monitor_plateau_steps", "monitor_block_groups",
         "ddp_comm_hook", "powersgd_rank", "powersgd_start_iter", "push_mode", "cpu_allocator",
         "optim_8bit_embeddings", "chunked_loss", "stage", "dpo_beta"),
        method_names(_every),
    ),
    # AdamW stepped in the backward pass: the methods that train base weights (hf_lisa.optim.memory)
    "optim_step_in_backward": method_names(lambda m: m.trains_weights),
}


def uses(method: str, option: str) -> bool:
    """Whether ``method`` uses ``option``."""
    return method in OPTION_METHODS[option]


def resolve_method_defaults(lisa_args, typed: Optional[Collection[str]] = None) -> None:
    """Fill the settings left unset (``None``) with the registry's defaults of ``lisa_args.method``, and an ``alpha``
    not given (``typed``; without it, at LisaConfig's default) from the method's ``alpha_per_rank``."""
    for name, default in method_defaults(lisa_args.method).items():
        if getattr(lisa_args, name) is None:
            setattr(lisa_args, name, list(default) if isinstance(default, (list, tuple)) else default)
    per_rank = METHODS[lisa_args.method].alpha_per_rank
    if per_rank is not None and "lisa_alpha" not in given_options(lisa_args, typed):
        lisa_args.lisa_alpha = per_rank * lisa_args.r


def given_options(lisa_args, typed: Optional[Collection[str]] = None) -> dict[str, Any]:
    """The options of ``lisa_args`` (``method`` aside) that were given, with their values.

    ``typed`` (the option names typed on the command line or in a config file, as :func:`.arguments.parse_args` finds
    them): exactly those, whatever their value. ``None`` (arguments built in Python): those whose value differs from
    their default; a setting whose default depends on the method (γ: 2 for full-parameter LISA, 0 for the adapter
    form) is then not given at any of those defaults."""
    if typed is not None:
        return {f.name: getattr(lisa_args, f.name) for f in dataclasses.fields(lisa_args)
                if f.name != "method" and f.name in typed}
    per_method = [method_defaults(method) for method in METHODS]
    given = {}
    for f in dataclasses.fields(lisa_args):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        defaults = [default, *(d[f.name] for d in per_method if f.name in d)]
        value = getattr(lisa_args, f.name)
        if f.name != "method" and value not in defaults:
            given[f.name] = value
    return given


def check_method_options(lisa_args, typed: Optional[Collection[str]] = None) -> None:
    """Refuse the given options (:func:`given_options`) that ``lisa_args.method`` does not use, naming them, the method
    and what it uses."""
    method = lisa_args.method
    refused = {name: value for name, value in given_options(lisa_args, typed).items() if not uses(method, name)}
    if not refused:
        return
    every = method_names(_every)
    listed = ", ".join(f"--{name}={value!r} (used by {', '.join(OPTION_METHODS[name])})" for name, value in
                       refused.items())
    own = [f"--{name}" for name, methods in OPTION_METHODS.items() if method in methods and methods != every]
    its = f"its own options are {', '.join(own)}" if own else "it has no options of its own"
    raise UsageError(
        f"--method {method} does not use {listed}; {its}, besides those every method takes. Remove the option(s), "
        "or choose a method that uses them."
    )
