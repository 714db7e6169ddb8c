"""What the integrations share: LISA's schedule settings given under a tool's own key names, checked by LISA's one set
of rules (:func:`hf_lisa.tuner.config.check_lisa_settings`) with errors that name the tool's key, and the
full-parameter callback built from them.

Example:
    ```py
    >>> from hf_lisa.integrations.settings import full_parameter_callback
    >>> callback = full_parameter_callback({"lisa_activated_layers": 2, "lisa_interval_steps": 50}, seed=0,
    ...                                    where="axolotl config ", keys={"lisa_activated_layers": "lisa_n_layers"})
    >>> callback.lisa_activated_layers, callback.lisa_interval_steps, callback.lisa_always_trainable
    (2, 50, ('embeddings', 'lm_head', 'norm', 'heads'))
    ```
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..errors import UsageError
from ..methods import FULL_LISA
from ..tuner.config import LAYER_SCHEDULE_DEFAULTS, check_lisa_settings

#: full-parameter LISA's settings: ``LisaCallback``'s keywords, which are their ``hf-lisa train`` names too
FULL_LISA_SETTINGS = (
    "lisa_activated_layers",
    "lisa_interval_steps",
    "lisa_sampling",
    "lisa_optimizer_state_policy",
    "lisa_always_trainable",
    "lisa_layers_attribute",
)


def check_settings(values: Mapping[str, Any], *, where: str, keys: Optional[Mapping[str, str]] = None,
                   allow_every_block: bool = True) -> None:
    """LISA's value rules on ``values`` (keyed by ``hf-lisa train`` names); a :class:`~hf_lisa.errors.UsageError`
    naming ``where`` and the tool's key (``keys``: our name -> the tool's) otherwise."""
    try:
        check_lisa_settings(values, where=where, arguments=keys, allow_every_block=allow_every_block)
    except ValueError as err:
        raise UsageError(str(err)) from None


def always_trainable(value: Any) -> Optional[tuple[str, ...]]:
    """``lisa_always_trainable`` as ``LisaCallback`` takes it: one name or a list; ``none`` alone trains only the
    sampled blocks (as ``hf-lisa train --lisa_always_trainable none``); ``None`` keeps the callback's default."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    return tuple(name for name in names if str(name).lower() != "none")


def full_parameter_callback(settings: Mapping[str, Any], *, seed: int, where: str,
                            keys: Optional[Mapping[str, str]] = None):
    """A :class:`~hf_lisa.trainer_callbacks.LisaCallback` from ``settings`` (keys of :data:`FULL_LISA_SETTINGS`; a
    ``None`` value or a missing key keeps the default: γ = 2, K = 20, uniform sampling, E+H+norm+heads trainable).

    Args:
        settings: the values, keyed by their ``hf-lisa train`` names.
        seed: the sampler's seed (the tool's run seed).
        where: how the tool's settings are named in messages, e.g. ``"axolotl config "`` or ``"--"``.
        keys: the tool's own key of a setting, named in messages beside ours, e.g. ``{"lisa_activated_layers":
            "lisa_n_layers"}``.

    Raises:
        UsageError: a value breaks LISA's rules; the message names the tool's key, the value and what is allowed.
    """
    from hf_lisa.trainer_callbacks import LisaCallback

    unknown = sorted(set(settings) - set(FULL_LISA_SETTINGS))
    if unknown:
        raise UsageError(f"{where}{unknown[0]} is not a setting of full-parameter LISA; allowed: "
                         f"{', '.join(FULL_LISA_SETTINGS)}.")
    values = {name: value for name, value in settings.items() if value is not None}
    values.setdefault("lisa_activated_layers", FULL_LISA.defaults["lisa_activated_layers"])
    for name, default in LAYER_SCHEDULE_DEFAULTS.items():
        values.setdefault(name, default)
    check_settings({k: v for k, v in values.items() if k not in ("lisa_always_trainable", "lisa_layers_attribute")},
                   where=where, keys=keys, allow_every_block=False)
    if "lisa_always_trainable" in values:
        values["lisa_always_trainable"] = always_trainable(values["lisa_always_trainable"])
    return LisaCallback(seed=seed, **values)


__all__ = ["FULL_LISA_SETTINGS", "always_trainable", "check_settings", "full_parameter_callback"]
