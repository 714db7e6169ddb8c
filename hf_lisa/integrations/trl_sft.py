"""``trl sft`` with LISA: TRL 1.16's SFT script (its parser, its arguments, its steps) plus LISA's options.

    python -m hf_lisa.integrations.trl_sft --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/Capybara --output_dir out \\
        --peft_type LISA --lora_r 16 --sparsity 0.4 --lisa_activated_layers 2 --lisa_interval_steps 20
    python -m hf_lisa.integrations.trl_sft --config sft.yaml --lisa_full --lisa_activated_layers 2
    accelerate launch -m hf_lisa.integrations.trl_sft --config sft.yaml --peft_type LISA   # several GPUs

Every argument of ``trl sft`` works unchanged (``--config`` YAML files included; an unknown key is refused), and:

* ``--peft_type LISA`` trains ``hf_lisa.LisaConfig`` adapters where ``--use_peft`` would train LoRA. TRL's adapter
  options keep their names and defaults: ``--lora_r`` (r), ``--lora_alpha`` (lisa_alpha), ``--lora_dropout``,
  ``--lora_target_modules``, ``--lora_modules_to_save``, ``--lora_task_type``; LISA's own settings are ``hf-lisa
  train``'s (``--sparsity``, ``--lisa_activated_layers``, ``--lisa_interval_steps``, ...). ``LisaAdapterCallback``
  runs the layer schedule.
* ``--lisa_full`` runs full-parameter LISA: no adapter, ``LisaCallback`` samples γ blocks every K steps while the
  embeddings, head and final norm train throughout.

TRL's own ``trl sft`` cannot do this: it builds only a ``LoraConfig`` (``trl.get_peft_config``) and takes no
callbacks from its command line or its YAML file (TRL 1.16), hence this script beside it.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..errors import UsageError
from ..methods import FULL_LISA, LISA_ADAPTER
from ..train.parsing.arguments import LisaArguments, lisa_config_kwargs
from ..train.parsing.options import LISA_CONFIG_OPTIONS, uses
from ..tuner.peft_type import PEFT_TYPE_LISA
from .settings import FULL_LISA_SETTINGS, check_settings, full_parameter_callback

PROG = "python -m hf_lisa.integrations.trl_sft"
#: ``--peft_type``'s values: LISA adapters, or TRL's own LoRA (as ``--use_peft``)
LISA, LORA = PEFT_TYPE_LISA.value, "LORA"
#: LisaConfig settings given through TRL's ModelConfig options (ours -> TRL's), so that ``--lora_r 16`` means r = 16
#: for either adapter type
FROM_MODEL_CONFIG = {
    "r": "lora_r",
    "lisa_alpha": "lora_alpha",
    "lisa_dropout": "lora_dropout",
    "target_modules": "lora_target_modules",
    "modules_to_save": "lora_modules_to_save",
}
#: TRL's LoRA-only options, refused with ``--peft_type LISA`` when set (ModelConfig field -> its unset value)
LORA_ONLY = {"use_rslora": False, "use_dora": False, "lora_target_parameters": None}


@dataclass
class _LisaSwitches:
    """How LISA takes part: adapters (``--peft_type LISA``) or full-parameter (``--lisa_full``)."""

    peft_type: Optional[str] = field(
        default=None,
        metadata={"help": f"'{LISA}': train hf_lisa.LisaConfig adapters (with the --lora_* options and "
                          "LISA's own below) instead of --use_peft's LoRA. Unset: TRL's behaviour."},
    )
    lisa_full: bool = field(
        default=False,
        metadata={"help": "Full-parameter LISA: no adapter; gamma blocks train at a time, re-drawn every K steps, "
                          "the embeddings, head and final norm throughout (LisaCallback)."},
    )


def _lisa_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """``hf-lisa train``'s LISA options (same names, types, defaults and help), less those TRL's ModelConfig gives."""
    types = typing.get_type_hints(LisaArguments)
    wanted = (set(LISA_CONFIG_OPTIONS) - set(FROM_MODEL_CONFIG)) | set(FULL_LISA_SETTINGS)
    fields = []
    for f in dataclasses.fields(LisaArguments):
        if f.name in wanted:
            metadata = dict(f.metadata)
            if f.name == "lisa_activated_layers":  # its default depends on the form, named by this script's switches
                metadata["help"] = (
                    f"gamma: blocks trained at a time. Default: {FULL_LISA.defaults[f.name]} with --lisa_full (1 or "
                    f"more), {LISA_ADAPTER.defaults[f.name]} with --peft_type LISA (every block's adapter trains, no "
                    "schedule).")
            if f.default_factory is not dataclasses.MISSING:
                default = field(default_factory=f.default_factory, metadata=metadata)
            else:
                default = field(default=f.default, metadata=metadata)
            fields.append((f.name, types[f.name], default))
    return fields


LisaSftArguments = dataclasses.make_dataclass(
    "LisaSftArguments", _lisa_fields(), bases=(_LisaSwitches,),
    namespace={"__module__": __name__, "__doc__": "LISA's options of the script: the switches, then the settings of "
               "`hf-lisa train` (same names, help and defaults)."},
)


def make_parser(prog: Optional[str] = PROG):
    """TRL's ``trl sft`` parser (``ScriptArguments``, ``SFTConfig``, ``ModelConfig``, ``DatasetMixtureConfig``) with
    :class:`LisaSftArguments` added."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    return TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, LisaSftArguments), prog=prog)


def _given(lisa_args) -> dict[str, Any]:
    """The LISA settings whose value differs from their default (γ's default depends on the form: None here)."""
    switches = {f.name for f in dataclasses.fields(_LisaSwitches)}
    given = {}
    for f in dataclasses.fields(LisaSftArguments):
        if f.name in switches:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(lisa_args, f.name) != default:
            given[f.name] = getattr(lisa_args, f.name)
    return given


def lisa_method(model_args, lisa_args):
    """The hf-lisa method the arguments ask for (``FULL_LISA``, ``LISA_ADAPTER``), or ``None`` for plain TRL; refuses
    the combinations that cannot take effect."""
    peft_type = (lisa_args.peft_type or "").upper() or None
    if peft_type not in (None, LISA, LORA):
        raise UsageError(f"--peft_type={lisa_args.peft_type!r} is invalid; allowed: {LISA} (LISA adapters) or {LORA} "
                         "(TRL's --use_peft).")
    given = _given(lisa_args)
    if lisa_args.lisa_full:
        if peft_type or model_args.use_peft:
            raise UsageError("--lisa_full trains the base weights, without an adapter: leave out --peft_type and "
                             "--use_peft (or drop --lisa_full for LISA adapters: --peft_type LISA).")
        if model_args.load_in_4bit or model_args.load_in_8bit:
            raise UsageError("--lisa_full trains the base weights, which cannot be quantized: leave out "
                             "--load_in_4bit/--load_in_8bit, or train LISA adapters on the quantized model "
                             "(--peft_type LISA).")
        method = FULL_LISA
    elif peft_type == LISA:
        for name, unset in LORA_ONLY.items():
            if getattr(model_args, name) != unset:
                raise UsageError(f"--{name}={getattr(model_args, name)!r} is a LoRA option; --peft_type LISA has no "
                                 "such setting. Leave it out, or train LoRA (--use_peft without --peft_type LISA).")
        method = LISA_ADAPTER
    else:
        if given:
            name = next(iter(given))
            raise UsageError(f"--{name}={given[name]!r} is a LISA setting, but LISA is not on: add --peft_type LISA "
                             "(LISA adapters) or --lisa_full (full-parameter LISA), or leave the option out.")
        return None
    refused = [name for name in given if not uses(method.name, name)]
    if refused:
        form = "--lisa_full" if method is FULL_LISA else "--peft_type LISA"
        raise UsageError(f"{form} does not use --{refused[0]}={given[refused[0]]!r} (used by "
                         f"{'--peft_type LISA' if method is FULL_LISA else '--lisa_full'}); leave it out.")
    return method


def lisa_peft_config_and_callbacks(model_args, lisa_args, seed: int):
    """``(peft_config, callbacks)`` for ``SFTTrainer``: a ``LisaConfig`` and ``LisaAdapterCallback`` (``--peft_type
    LISA``), no adapter and ``LisaCallback`` (``--lisa_full``), or TRL's own ``get_peft_config`` and no callback."""
    method = lisa_method(model_args, lisa_args)
    if method is None:
        from trl import get_peft_config

        if (lisa_args.peft_type or "").upper() == LORA:  # --peft_type LORA is TRL's --use_peft
            model_args = dataclasses.replace(model_args, use_peft=True)
        return get_peft_config(model_args), []
    if method is FULL_LISA:
        settings = {name: getattr(lisa_args, name) for name in FULL_LISA_SETTINGS}
        return None, [full_parameter_callback(settings, seed=seed, where="--")]

    from hf_lisa import LisaConfig
    from hf_lisa.trainer_callbacks import LisaAdapterCallback

    values = {name: getattr(lisa_args, name, None) for name in LISA_CONFIG_OPTIONS}
    values.update({ours: getattr(model_args, theirs) for ours, theirs in FROM_MODEL_CONFIG.items()})
    if values["lisa_activated_layers"] is None:
        values["lisa_activated_layers"] = LISA_ADAPTER.defaults["lisa_activated_layers"]
    settings = lisa_config_kwargs(dataclasses.replace(LisaArguments(), **values))
    check_settings(settings, where="--", keys=FROM_MODEL_CONFIG)
    try:
        config = LisaConfig(task_type=model_args.lora_task_type, **settings)
    except ValueError as err:
        raise UsageError(str(err)) from None
    callback = LisaAdapterCallback(seed=seed, lisa_optimizer_state_policy=lisa_args.lisa_optimizer_state_policy)
    return config, [callback]


def run(script_args, training_args, model_args, dataset_args, lisa_args):
    """TRL 1.16's ``trl/scripts/sft.py`` ``main``, with the LISA ``peft_config`` and callbacks; returns the trainer."""
    from datasets import load_dataset
    from trl import SFTTrainer, get_dataset, get_quantization_config

    from hf_lisa.trainer_callbacks import prepare_trainer

    peft_config, callbacks = lisa_peft_config_and_callbacks(model_args, lisa_args, seed=training_args.seed)
    model_init_kwargs = dict(
        revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation, dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    if dataset_args.datasets:  # TRL: the mixture wins over --dataset_name (it warns when both are given)
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                               streaming=script_args.dataset_streaming)
    else:
        raise UsageError("Either `datasets` (a YAML mixture) or --dataset_name must be provided.")

    trainer = SFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=peft_config,
        callbacks=callbacks,
    )
    prepare_trainer(trainer)  # the LISA callbacks are handed the Trainer (DDP under accelerate launch, logs, guard)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers, as TRL's script does
        trainer.end()
    return trainer


def main(argv: Optional[Sequence[str]] = None):
    """Parse ``argv`` (``sys.argv[1:]``) as ``trl sft`` does, plus the LISA options, and train; returns the trainer."""
    parser = make_parser()
    try:  # an unknown key of a --config file, or a value TrainingArguments refuses
        script_args, training_args, model_args, dataset_args, lisa_args = parser.parse_args_and_config(
            None if argv is None else list(argv))
    except ValueError as err:
        raise UsageError(str(err)) from None
    return run(script_args, training_args, model_args, dataset_args, lisa_args)


if __name__ == "__main__":
    try:
        main()
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        sys.exit(2)
