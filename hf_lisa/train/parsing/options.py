"""Which option of ``hf-lisa train`` applies to which method (:data:`OPTION_METHODS`), derived from what each method
is in the registry (:mod:`hf_lisa.methods`), and the one check made from it: a given option that the chosen method
does not use is refused.

An option is *given* when it was typed: named on the command line or a key of the config file (with a value: YAML
``null`` means "not set"), whatever its value, so ``--method lora --lisa_activated_layers 2`` is refused as ``3`` is.
Arguments built in Python, where nothing was typed, count an option as given when its value differs from its default
(:func:`given_options`).

It also says where each option prints in ``hf-lisa train --help`` (:data:`OPTION_GROUPS`, :func:`group_help`)."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from typing import Any, Collection, Optional

from ...errors import UsageError
from ...methods import LORA_CONFIG_NAMES, METHODS, Method, method_defaults, method_names
from ...tuner.config import lisa_config_fields

#: LisaConfig fields that are not options of ``hf-lisa train``, and why
_NOT_OPTIONS = {"fan_in_fan_out": "set automatically for Conv1D targets", "init_weights": "False is for tests only"}
#: the LisaConfig fields that are options of ``hf-lisa train``, in LisaConfig's order
LISA_CONFIG_OPTIONS: tuple[str, ...] = tuple(f.name for f in lisa_config_fields() if f.name not in _NOT_OPTIONS)



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
         "optim_8bit_embeddings", "chunked_loss", "progress_check_steps", "stage", "dpo_beta"),
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


def check_method_options(lisa_args, typed: Optional[Collection[str]] = None, training_args=None) -> None:
    """Refuse the given options (:func:`given_options`, and ``LisaTrainer``'s settings in ``training_args``) that
    ``lisa_args.method`` does not use, naming them, the method and what it uses."""
    method = lisa_args.method
    given = given_options(lisa_args, typed)
    if training_args is not None:  # LisaTrainer's settings, fields of the run's LisaTrainingArguments
        from ...trainer.training_args import TRAINER_OPTIONS

        given.update({name: getattr(training_args, name) for name, default in TRAINER_OPTIONS.items()
                      if name in OPTION_METHODS and (name in typed if typed is not None
                                                     else getattr(training_args, name) != default)})
    refused = {name: value for name, value in given.items() if not uses(method, name)}
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


# ----------------------------------------------------------------------------------------------------------------------
# --help: the titled groups (issue 36), from one mapping option -> group
# ----------------------------------------------------------------------------------------------------------------------
#: the groups of ``hf-lisa train --help``, in their order: title -> what the group holds
HELP_GROUPS: dict[str, str] = {
    "model": "Which model to fine-tune and how to load it.",
    "data": "Where the training data comes from, how it becomes tokens, and how validation rows are scored.",
    "method": "The fine-tuning method and its settings: LISA's layer schedule, the adapters' rank and targets, the "
    "sparse masks. 'Methods:' names the methods that use an option; the others refuse it.",
    "training": "The optimisation: transformers' TrainingArguments (batch, steps, learning rate, precision, logging, "
    "evaluation, engines), then hf-lisa's memory, monitoring and distributed options.",
    "output": "Where the run writes, which checkpoints it saves and keeps, and resuming.",
    "Hub": "Pushing the result to the Hugging Face Hub.",
}

#: every option of hf-lisa's own dataclasses -> its group (tests/test_help_groups.py fails for one missing here);
#: transformers' TrainingArguments are 'training' unless named here or by :func:`option_group`'s prefixes
OPTION_GROUPS: dict[str, str] = {
    **dict.fromkeys((
        "model_name_or_path", "tokenizer_name", "base_model_id", "torch_dtype", "attn_implementation",
        "trust_remote_code", "model_revision", "cache_dir", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type",
        "bnb_4bit_compute_dtype", "use_bnb_nested_quant"), "model"),
    **dict.fromkeys((
        "dataset_name", "dataset_config_name", "dataset_split", "train_file", "mix_strategy", "validation_file",
        "validation_split_percentage", "max_seq_length", "data_format", "prompt_column", "completion_column",
        "messages_column", "text_column", "completion_only_loss", "chat_template", "overlength", "on_bad_row",
        "packing", "chosen_column", "rejected_column", "max_train_samples", "max_eval_samples",
        "preprocessing_num_workers", "overwrite_cache", "eval_generation_samples", "generation_max_new_tokens",
        "answer_pattern", "answer_lenient", "demo_train_samples"), "data"),
    **dict.fromkeys(("method", "stage", "dpo_beta", "lisa_always_trainable", "lisa_optimizer_state_policy",
                     *LISA_CONFIG_OPTIONS), "method"),
    **dict.fromkeys((
        "layerwise_lr_decay", "monitor_plateau_grad_norm", "monitor_plateau_steps", "monitor_block_groups",
        "ddp_comm_hook", "powersgd_rank", "powersgd_start_iter", "optim_step_in_backward", "optim_8bit_embeddings",
        "cpu_allocator", "chunked_loss", "progress_check_steps"), "training"),
    **dict.fromkeys((
        "output_dir", "overwrite_output_dir", "delete_foreign_files", "keep_checkpoints", "enable_jit_checkpoint",
        "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "resume_from_checkpoint",
        "ignore_data_skip", "restore_callback_states_from_checkpoint"), "output"),
    **dict.fromkeys(("push_to_hub", "push_mode"), "Hub"),
}
#: hf-lisa's own options in the groups of transformers' TrainingArguments: printed after transformers' own
_ADDED_TO_THEIRS = frozenset(name for name, group in OPTION_GROUPS.items()
                             if group in ("training", "Hub") and name != "push_to_hub")


def option_group(name: str) -> str:
    """The ``--help`` group of option ``name``: :data:`OPTION_GROUPS`'s, else by transformers' prefixes (``save_*`` is
    output, ``hub_*`` the Hub), else training."""
    if name in OPTION_GROUPS:
        return OPTION_GROUPS[name]
    return "output" if name.startswith("save_") else "Hub" if name.startswith("hub_") else "training"


def group_help(parser: argparse.ArgumentParser) -> None:
    """Print the options of ``parser`` (``hf-lisa train``'s) under the titles of :data:`HELP_GROUPS`, in the parser's
    order (transformers' first in their groups); argparse's own group keeps ``--help``. Parsing is unchanged: argparse
    parses from the parser's actions, the groups only print them."""
    flat = parser._optionals
    groups = {title: parser.add_argument_group(title, text)._group_actions for title, text in HELP_GROUPS.items()}
    for action in [a for a in flat._group_actions if a.option_strings and a.dest != "help"]:
        flat._group_actions.remove(action)
        groups[option_group(action.dest)].append(action)
    for actions in groups.values():
        actions.sort(key=lambda action: action.dest in _ADDED_TO_THEIRS)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """transformers' formatter (each option's default shown) without line breaks at hyphens, so a name such as
    ``--lora_dropout (LLaMA-Factory, ...)`` stays whole on its line and can be searched for."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)
