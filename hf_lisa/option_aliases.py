"""The names LLaMA-Factory, axolotl and TRL users type from habit, mapped once for ``hf-lisa train`` (a leaf module:
read before torch loads, by :mod:`hf_lisa.option_names` and :mod:`hf_lisa.train.parsing.arguments`).

* :data:`ALIASES`: a peer's name whose meaning is exactly an hf-lisa option's (same unit, same values): accepted on
  the command line and as a config-file key, and translated to the hf-lisa name before parsing.
* :data:`NEAR_MISSES`: a peer's name whose meaning differs: refused with the hf-lisa option(s) to use and the
  difference, never mapped and never answered with a look-alike option of another meaning.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .errors import UsageError

#: peer name -> (hf-lisa option, the tools that spell it so)
ALIASES: dict[str, tuple[str, str]] = {
    "lora_r": ("r", "axolotl"),
    "lora_rank": ("r", "LLaMA-Factory"),
    "lora_alpha": ("lisa_alpha", "LLaMA-Factory, axolotl, PEFT"),
    "lora_dropout": ("lisa_dropout", "LLaMA-Factory, axolotl, PEFT"),
    "cutoff_len": ("max_seq_length", "LLaMA-Factory"),
    "sequence_len": ("max_seq_length", "axolotl"),
    "max_length": ("max_seq_length", "TRL SFTConfig"),
    "micro_batch_size": ("per_device_train_batch_size", "axolotl"),
    "num_epochs": ("num_train_epochs", "axolotl"),
    "sample_packing": ("packing", "axolotl"),
    "lisa_n_layers": ("lisa_activated_layers", "axolotl"),
    "lisa_step_interval": ("lisa_interval_steps", "axolotl, ms-swift"),
}

#: peer name -> what to use instead and why (the peer's meaning differs from every hf-lisa option's)
NEAR_MISSES: dict[str, str] = {
    "base_model": "axolotl's base_model is the model to load: use --model_name_or_path (--base_model_id only records "
    "a Hub id in the model card and training_summary.json; it loads nothing)",
    "dataset": "LLaMA-Factory's dataset names entries of its dataset_info.json: use --train_file (local JSON/JSONL/CSV "
    "files, several as 'a.jsonl:0.7,b.jsonl:0.3') or --dataset_name (a Hub dataset), and --data_format for the format",
    "datasets": "axolotl's datasets is a list of {path, type}: use --train_file (in YAML a list of sources, "
    "[{path: a.jsonl, weight: 0.7}, b.jsonl]) or --dataset_name (a Hub dataset), and --data_format (alpaca, sharegpt, "
    "...) for the type",
    "finetuning_type": "LLaMA-Factory's finetuning_type: use --method (lora -> lora, full -> full; freeze has no "
    "counterpart, --method lisa trains sampled blocks)",
    "adapter": "axolotl's adapter: use --method (lora -> --method lora; qlora -> --method lora --load_in_4bit)",
    "template": "LLaMA-Factory's template names differ from hf-lisa's: use --chat_template ('auto', a built-in such as "
    "chatml or llama-3, or a Jinja file; docs/data.md)",
    "val_size": "LLaMA-Factory's val_size is a fraction (0.1) or a row count: use --validation_split_percentage, a "
    "percentage (10)",
    "val_set_size": "axolotl's val_set_size is a fraction (0.05) or a row count: use --validation_split_percentage, a "
    "percentage (5)",
    "lora_target": "LLaMA-Factory's lora_target is a comma list or 'all': use --target_modules, module names "
    "separated by spaces (a YAML list), or 'all-linear' for every linear layer",
    "lora_target_modules": "axolotl's lora_target_modules: use --target_modules (a list of module names; one string "
    "is not a regex there)",
    "lora_target_linear": "axolotl's lora_target_linear: use --target_modules all-linear",
    "quantization_bit": "LLaMA-Factory's quantization_bit: use --load_in_4bit or --load_in_8bit (with --method lora "
    "or dora)",
}

#: hf-lisa option -> its aliases, in table order (for ``--help`` and the docs)
ALIASES_OF: dict[str, list[str]] = {}
for _alias, (_option, _) in ALIASES.items():
    ALIASES_OF.setdefault(_option, []).append(_alias)


def help_note(option: str) -> str:
    """`` Also: --lora_r (axolotl), --lora_rank (LLaMA-Factory).`` for ``--help``; ``""`` for an option without."""
    aliases = ALIASES_OF.get(option)
    if not aliases:
        return ""
    return " Also: " + ", ".join(f"--{a} ({ALIASES[a][1]})" for a in aliases) + "."


def hint(name: str) -> str:
    """The near-miss refusal of ``name`` (``-`` spelled ``_``), ``""`` when it is none."""
    return NEAR_MISSES.get(name.replace("-", "_"), "")


def _flag_name(token: str) -> str:
    return token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") else ""


def canonical_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with each alias flag spelled as its hf-lisa option (``--lora_r 8`` -> ``--r 8``, ``--cutoff-len=64``
    -> ``--max_seq_length=64``).

    Raises:
        UsageError: when an alias and its option (or two aliases of one option) are both given.
    """
    out, seen = [], {}
    for token in argv:
        name = _flag_name(token)
        option = ALIASES[name][0] if name in ALIASES else name
        if option:
            if option in seen and seen[option] != token.split("=", 1)[0] and (
                    name in ALIASES or _flag_name(seen[option]) in ALIASES):
                raise UsageError(f"{seen[option]} and {token.split('=', 1)[0]} are the same option (--{option}); "
                                 "give one.")
            seen.setdefault(option, token.split("=", 1)[0])
        if name in ALIASES:
            token = f"--{option}" + (token[token.index("="):] if "=" in token else "")
        out.append(token)
    return out


def canonical_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A config file's mapping with each alias key spelled as its hf-lisa option; near-miss keys are refused.

    Raises:
        UsageError: naming ``source`` and the key, for a near-miss key (with the option to use) or an alias given
        with its option.
    """
    misses = [f"{key!r} ({NEAR_MISSES[key]})" for key in values if key in NEAR_MISSES]
    if misses:
        raise UsageError(f"{source}: unknown option(s) {', '.join(misses)}. Run `hf-lisa config-reference` for the "
                         "full list.")
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in values.items():
        option = ALIASES[key][0] if key in ALIASES else key
        if option in out:
            raise UsageError(f"{source}: {origin[option]!r} and {key!r} are the same option ({option}); give one.")
        out[option], origin[option] = value, key
    return out
