"""LISA in LLaMA-Factory: full fine-tuning (``finetuning_type: full``) with ``LisaCallback`` handed to its
``run_exp(args, callbacks)``. LLaMA-Factory has BAdam (a block-coordinate optimizer) but no LISA; its configs take no
callbacks, so this recipe reads LISA's keys out of the config and passes the rest on.

    python -m hf_lisa.integrations.llamafactory examples/integrations/llamafactory_lisa.yaml [key=value ...]

In Python:

```py
from hf_lisa.integrations.llamafactory import run

run("llama3_full_sft.yaml")  # or a dict: the LLaMA-Factory config plus the lisa_* keys below
```

The keys (``hf-lisa train``'s names, as in LMFlow): ``lisa_activated_layers`` (γ, default 2),
``lisa_interval_steps`` (K, default 20), ``lisa_sampling``, ``lisa_always_trainable``, ``lisa_optimizer_state_policy``,
``lisa_layers_attribute``; the sampler's seed is the config's ``seed``. LLaMA-Factory refuses unknown keys, so they
are taken out before ``run_exp`` sees the config.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ..errors import UsageError
from .settings import FULL_LISA_SETTINGS, full_parameter_callback

PROG = "python -m hf_lisa.integrations.llamafactory"
WHERE = "LLaMA-Factory config "
#: LLaMA-Factory's ``finetuning_type`` that LISA needs: the base weights train (its default is ``lora``)
FINETUNING_TYPE = "full"
#: LLaMA-Factory's ``stage`` values checked with LISA here (its default is ``sft``)
STAGES = ("pt", "sft")
#: LLaMA-Factory's switches of other optimizers/methods, which would fight the LISA schedule over what trains
CONFLICTING = ("use_badam", "use_galore", "use_apollo", "use_llama_pro", "use_muon", "use_adam_mini")
#: LLaMA-Factory's switches to trainers that are not a ``transformers.Trainer`` (Megatron-Core, HyperParallel)
OTHER_TRAINERS = ("use_mca", "use_hyper_parallel")
#: LLaMA-Factory's defaults that the checks read (0.9.5's ``FinetuningArguments`` / ``TrainingArguments``)
DEFAULTS = {"finetuning_type": "lora", "stage": "sft", "seed": 42}


def split_config(config: Mapping[str, Any]):
    """``(llamafactory_args, callback)``: the config without LISA's keys, and the ``LisaCallback`` they describe.

    Raises:
        UsageError: a LISA value breaks LISA's rules, or the config is not full fine-tuning of a stage checked here.

    Example:
        ```py
        >>> from hf_lisa.integrations.llamafactory import split_config
        >>> args, callback = split_config({"stage": "sft", "finetuning_type": "full", "lisa_activated_layers": 1,
        ...                                "lisa_interval_steps": 10, "output_dir": "out"})
        >>> sorted(args), callback.lisa_activated_layers, callback.lisa_interval_steps
        (['finetuning_type', 'output_dir', 'stage'], 1, 10)
        ```
    """
    args = {key: value for key, value in config.items() if key not in FULL_LISA_SETTINGS}
    settings = {key: value for key, value in config.items() if key in FULL_LISA_SETTINGS}
    finetuning_type = args.get("finetuning_type", DEFAULTS["finetuning_type"])
    if finetuning_type != FINETUNING_TYPE:
        raise UsageError(
            f"{WHERE}finetuning_type: {finetuning_type!r} (LLaMA-Factory's default is lora); LISA trains sampled "
            f"blocks of the model itself: set finetuning_type: {FINETUNING_TYPE}.")
    stage = args.get("stage", DEFAULTS["stage"])
    if stage not in STAGES:
        raise UsageError(f"{WHERE}stage: {stage!r} is not checked with LISA here; allowed: {', '.join(STAGES)} "
                         "(for preference training: hf-lisa train --stage dpo, or TRL's DPOTrainer with LisaCallback).")
    on = [key for key in CONFLICTING if args.get(key)]
    if on:
        raise UsageError(f"{WHERE}{on[0]}: true chooses which parameters train, as LISA does; use one of them.")
    other = [key for key in OTHER_TRAINERS if args.get(key)]
    if other:
        raise UsageError(f"{WHERE}{other[0]}: true runs a trainer that is not transformers' Trainer, which LISA's "
                         "callback needs; leave it out.")
    seed = args.get("seed", DEFAULTS["seed"])
    return args, full_parameter_callback(settings, seed=seed, where=WHERE)


def load_config(path: Union[str, Path], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A LLaMA-Factory YAML/JSON config, with ``key=value`` overrides (values read as YAML), as ``llamafactory-cli
    train config.yaml key=value`` reads it."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file {str(path)!r} does not exist.")
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict):
        raise UsageError(f"config file {str(path)!r} must hold a mapping of keys to values.")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"override {item!r} is invalid; allowed: key=value, e.g. lisa_activated_layers=4.")
        config[key.lstrip("-")] = yaml.safe_load(value)
    return config


def run(config: Union[str, Path, Mapping[str, Any]], run_exp: Optional[Callable] = None, callbacks: Sequence = ()):
    """Run LLaMA-Factory's ``run_exp`` with the config's LISA keys taken out and ``LisaCallback`` added.

    Args:
        config: a LLaMA-Factory config (path or mapping) with ``finetuning_type: full`` and the ``lisa_*`` keys.
        run_exp: the entry point, ``llamafactory.train.tuner.run_exp`` by default.
        callbacks: further callbacks, after LISA's.
    """
    if not isinstance(config, Mapping):
        config = load_config(config)
    args, callback = split_config(config)
    if run_exp is None:
        try:
            from llamafactory.train.tuner import run_exp
        except ImportError as err:
            raise UsageError(f"LLaMA-Factory is not importable ({err}); install it: pip install llamafactory.") from err
    return run_exp(args, callbacks=[callback, *callbacks])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} CONFIG.yaml [key=value ...]\n\n{__doc__}")
        return 0
    run(load_config(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
