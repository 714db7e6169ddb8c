"""An axolotl plugin that runs hf-lisa's LISA where axolotl's own LISA callback would run.

```yaml
plugins:
  - hf_lisa.integrations.axolotl.LisaPlugin
lisa_n_layers: 2            # γ (axolotl's key)
lisa_step_interval: 20      # K (axolotl's key)
# lisa_layers_attribute: model.layers   (axolotl's key; its default)
lisa_sampling: uniform      # this plugin's keys: hf-lisa train's names
```

Full-parameter LISA (no ``adapter``): axolotl's ``lisa_n_layers`` / ``lisa_step_interval`` / ``lisa_layers_attribute``
go to :class:`~hf_lisa.trainer_callbacks.LisaCallback` (the embeddings, head and final norm train throughout, the
optimizer state of blocks left is dropped, the schedule is checkpointed and resumes exactly), and axolotl's own
``LISACallback`` is taken out of the trainer. LISA adapters: ``adapter: lisa`` (a plugin adapter) builds a
``hf_lisa.LisaConfig`` from axolotl's ``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules`` /
``lora_target_linear``, ``lora_modules_to_save``, the schedule keys above and ``lisa_adapter:`` (a mapping of any
other ``LisaConfig`` setting, e.g. ``{sparsity: 0.4}``), with :class:`~hf_lisa.trainer_callbacks.LisaAdapterCallback`.

The class follows axolotl 0.19's ``axolotl.integrations.base.BasePlugin`` interface and subclasses it when axolotl is
installed; without axolotl this module still imports (a plain base stands in), for tests and tooling.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from ..errors import RunError, UsageError
from ..methods import FULL_LISA, LISA_ADAPTER, Method
from ..tuner.config import LAYER_SCHEDULE_DEFAULTS
from ..tuner.peft_type import PEFT_TYPE_LISA
from .settings import always_trainable, check_settings, full_parameter_callback

logger = logging.getLogger(__name__)
#: what an axolotl user must see: axolotl's logging shows INFO only from loggers named ``axolotl*`` (others from WARNING
#: on; axolotl/logging_config.py), and it prints "LISA will activate ..." when it builds the LISACallback taken out here
notice = logging.getLogger("axolotl.integrations.hf_lisa")

try:
    from axolotl.integrations.base import BasePlugin
except ImportError:  # axolotl is not installed: axolotl calls a plugin's methods by name, so a plain base serves

    class BasePlugin:  # type: ignore[no-redef]
        """Stands in for ``axolotl.integrations.base.BasePlugin`` where axolotl is not installed."""


#: axolotl's ``adapter:`` value of LISA adapters (the PEFT type's name)
ADAPTER = PEFT_TYPE_LISA.value.lower()
#: axolotl's LISA keys (``axolotl.utils.schemas.integrations.LISAConfig``): our name -> theirs
AXOLOTL_KEYS = {
    "lisa_activated_layers": "lisa_n_layers",
    "lisa_interval_steps": "lisa_step_interval",
    "lisa_layers_attribute": "lisa_layers_attribute",
}
#: axolotl's adapter keys that ``adapter: lisa`` reads: our LisaConfig name -> theirs
AXOLOTL_ADAPTER_KEYS = {
    "r": "lora_r",
    "lisa_alpha": "lora_alpha",
    "lisa_dropout": "lora_dropout",
    "target_modules": "lora_target_modules",
    "modules_to_save": "lora_modules_to_save",
}
#: this plugin's own keys (:class:`LisaPluginArgs`) and the LISA forms that use each
PLUGIN_KEYS = {
    "lisa_sampling": (FULL_LISA, LISA_ADAPTER),
    "lisa_optimizer_state_policy": (FULL_LISA, LISA_ADAPTER),
    "lisa_always_trainable": (FULL_LISA,),
    "lisa_adapter": (LISA_ADAPTER,),
}
#: axolotl's own LISA callback (``axolotl.utils.callbacks.lisa.lisa_callback_factory``): module and class name
AXOLOTL_LISA_CALLBACK = ("axolotl.utils.callbacks.lisa", "LISACallback")
WHERE = "axolotl config "


def __getattr__(name: str):
    # the pydantic model axolotl merges into its config schema (get_input_args); pydantic comes with axolotl
    if name == "LisaPluginArgs":
        from pydantic import BaseModel, Field

        class LisaPluginArgs(BaseModel):
            """The plugin's config keys, beside axolotl's ``lisa_n_layers``, ``lisa_step_interval`` and
            ``lisa_layers_attribute``."""

            lisa_sampling: Optional[str] = Field(
                default=None, json_schema_extra={"description": "uniform (default), importance or cyclic"})
            lisa_optimizer_state_policy: Optional[str] = Field(
                default=None, json_schema_extra={"description": "drop (default) or keep the state of blocks left"})
            lisa_always_trainable: Optional[list[str]] = Field(
                default=None, json_schema_extra={"description": "full-parameter LISA: what trains throughout"})
            lisa_adapter: Optional[dict[str, Any]] = Field(
                default=None, json_schema_extra={"description": "adapter: lisa: other LisaConfig settings"})

        globals()[name] = LisaPluginArgs
        return LisaPluginArgs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _get(cfg, key: str):
    """A key of axolotl's config (``DictDefault``: a missing key reads ``None``) or of a plain mapping."""
    return cfg.get(key) if isinstance(cfg, Mapping) or hasattr(cfg, "get") else getattr(cfg, key, None)


def lisa_form(cfg) -> Optional[Method]:
    """Which LISA the config asks for: ``FULL_LISA`` (``lisa_n_layers`` / ``lisa_step_interval`` without an
    adapter), ``LISA_ADAPTER`` (``adapter: lisa``) or ``None``; refuses what could not take effect."""
    adapter = _get(cfg, "adapter")
    schedule = {key: _get(cfg, key) for key in ("lisa_n_layers", "lisa_step_interval") if _get(cfg, key) is not None}
    if adapter == ADAPTER:
        form = LISA_ADAPTER
    elif schedule:
        if adapter:
            raise UsageError(
                f"{WHERE}adapter: {adapter} with {', '.join(f'{k}: {v}' for k, v in schedule.items())}: the LISA "
                f"plugin samples the blocks of the model itself (no adapter) or LISA adapters (adapter: {ADAPTER}); "
                f"set one of those, or leave out {' and '.join(schedule)}.")
        form = FULL_LISA
    else:
        form = None
    for key, forms in PLUGIN_KEYS.items():
        if _get(cfg, key) is not None and form not in forms:
            wanted = " or ".join("lisa_n_layers (no adapter)" if f is FULL_LISA else f"adapter: {ADAPTER}"
                                 for f in forms)
            raise UsageError(f"{WHERE}{key}: {_get(cfg, key)!r} needs {wanted}; leave it out otherwise.")
    return form


def _schedule(cfg) -> dict[str, Any]:
    """The schedule settings of the config, by hf-lisa's names (``None`` where not set)."""
    values = {ours: _get(cfg, theirs) for ours, theirs in AXOLOTL_KEYS.items()}
    values["lisa_sampling"] = _get(cfg, "lisa_sampling")
    return values


def lisa_adapter_config(cfg):
    """The ``hf_lisa.LisaConfig`` of ``adapter: lisa``: axolotl's LoRA keys, the schedule keys, ``lisa_adapter``."""
    from hf_lisa import LisaConfig

    extra = dict(_get(cfg, "lisa_adapter") or {})
    owned = {**AXOLOTL_ADAPTER_KEYS, **AXOLOTL_KEYS, "lisa_sampling": "lisa_sampling"}
    clash = sorted(set(extra) & set(owned))
    if clash:
        raise UsageError(f"{WHERE}lisa_adapter.{clash[0]}: set it as {owned[clash[0]]}: instead (axolotl's key).")
    settings = {ours: _get(cfg, theirs) for ours, theirs in AXOLOTL_ADAPTER_KEYS.items()}
    if _get(cfg, "lora_target_linear"):
        settings["target_modules"] = "all-linear"
    settings.update(_schedule(cfg))
    if settings["lisa_activated_layers"] is None:
        settings["lisa_activated_layers"] = LISA_ADAPTER.defaults["lisa_activated_layers"]
    settings = {name: value for name, value in settings.items() if value is not None}
    settings.update(extra)
    check_settings(settings, where=WHERE, keys={**AXOLOTL_ADAPTER_KEYS, **AXOLOTL_KEYS})
    try:
        return LisaConfig(task_type="CAUSAL_LM", **settings)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{WHERE}adapter: {ADAPTER}: {err}") from None


def lisa_callbacks(cfg) -> list:
    """The LISA callbacks the config asks for (empty when LISA is off)."""
    form = lisa_form(cfg)
    seed = _get(cfg, "seed")
    seed = 42 if seed is None else seed
    policy = _get(cfg, "lisa_optimizer_state_policy")
    if form is FULL_LISA:
        settings = {**_schedule(cfg), "lisa_optimizer_state_policy": policy,
                    "lisa_always_trainable": always_trainable(_get(cfg, "lisa_always_trainable"))}
        return [full_parameter_callback(settings, seed=seed, where=WHERE, keys=AXOLOTL_KEYS)]
    if form is LISA_ADAPTER:
        from hf_lisa.trainer_callbacks import LisaAdapterCallback

        policy = LAYER_SCHEDULE_DEFAULTS["lisa_optimizer_state_policy"] if policy is None else policy
        check_settings({"lisa_optimizer_state_policy": policy}, where=WHERE)
        return [LisaAdapterCallback(seed=seed, lisa_optimizer_state_policy=policy)]
    return []


def _is_axolotl_lisa_callback(callback) -> bool:
    cls = callback if isinstance(callback, type) else type(callback)
    return (cls.__module__, cls.__name__) == AXOLOTL_LISA_CALLBACK


class LisaPlugin(BasePlugin):
    """axolotl plugin: hf-lisa's LISA for axolotl's LISA keys, and LISA adapters as ``adapter: lisa``.

    Example:
        ```py
        >>> from hf_lisa.integrations.axolotl import LisaPlugin
        >>> [type(c).__name__ for c in LisaPlugin().add_callbacks_pre_trainer(
        ...     {"lisa_n_layers": 2, "lisa_step_interval": 20}, model=None)]
        ['LisaCallback']
        ```
    """

    def get_input_args(self) -> str:
        return f"{__name__}.LisaPluginArgs"

    def get_adapter_capabilities(self) -> list:
        from axolotl.integrations.base import AdapterCapabilities

        return [AdapterCapabilities(name=ADAPTER)]

    def pre_model_load(self, cfg) -> None:
        """Check the LISA keys before any weight loads."""
        form = lisa_form(cfg)
        if form is LISA_ADAPTER:
            lisa_adapter_config(cfg)
        lisa_callbacks(cfg)

    def load_adapter(self, model, cfg, inference: bool = False, config_only: bool = False):
        """``adapter: lisa``: ``(PeftModel, LisaConfig)``, ``(None, LisaConfig)`` for ``config_only``, or a saved LISA
        adapter from ``lora_model_dir``; ``None`` for other adapters (axolotl's own loaders)."""
        if _get(cfg, "adapter") != ADAPTER:
            return None
        config = lisa_adapter_config(cfg)
        if config_only:
            return None, config
        from peft import PeftModel, get_peft_model

        if _get(cfg, "lora_model_dir"):
            model = PeftModel.from_pretrained(model, _get(cfg, "lora_model_dir"), is_trainable=not inference)
            return model, model.peft_config["default"]
        return get_peft_model(model, config), config

    def add_callbacks_pre_trainer(self, cfg, model) -> list:
        """The LISA callback, given to the Trainer's constructor (``post_trainer_create`` hands it the Trainer)."""
        return lisa_callbacks(cfg)

    def post_trainer_create(self, cfg, trainer) -> None:
        """Take axolotl's own LISA callback out of the trainer (it would re-draw blocks on its own schedule), and check
        that ours is in."""
        from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback

        ours = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, (LisaCallback, LisaAdapterCallback))]
        for callback in list(trainer.callback_handler.callbacks):
            if _is_axolotl_lisa_callback(callback):
                trainer.remove_callback(callback)
                settings = (f" (γ={ours[0].lisa_activated_layers}, K={ours[0].lisa_interval_steps})"
                            if ours and isinstance(ours[0], LisaCallback) else "")
                notice.info("hf-lisa's LISA plugin replaces axolotl's LISACallback: hf-lisa's %s runs the schedule%s; "
                            "axolotl's 'LISA will activate ...' line above came from building the callback taken out.",
                            type(ours[0]).__name__ if ours else "LisaCallback", settings)
        if lisa_form(cfg) is not None and not ours:
            raise RunError("The LISA plugin's callback is not in the trainer: this axolotl trainer builder did not "
                           "call the plugins' add_callbacks_pre_trainer. Please report it with your axolotl version.")
        if ours:
            from hf_lisa.trainer_callbacks import prepare_trainer

            prepare_trainer(trainer)  # DDP preparation, the logs' order, the progress guard, calibration's loss


__all__ = ["ADAPTER", "AXOLOTL_KEYS", "LisaPlugin", "lisa_adapter_config", "lisa_callbacks", "lisa_form"]
