"""One name per setting: the names LISA's settings had before, and how they keep working for one release.

Every LISA setting has one name wherever it is typed: its ``lisa_*`` name, as a :class:`~hf_lisa.LisaConfig` field,
an ``hf-lisa train`` option, a ``LisaTrainingArguments`` field, and a keyword (and attribute) of
:class:`~hf_lisa.trainer_callbacks.LisaCallback`, :class:`~hf_lisa.trainer_callbacks.LisaAdapterCallback`,
:class:`~hf_lisa.scheduler.LayerwiseScheduler`, :class:`~hf_lisa.scheduler.MaskScheduler` and
:class:`~hf_lisa.scheduler.sampler.LayerSampler`. Before 0.3 the callbacks and the schedulers had short names of their
own (``activated_layers``, ``num_active``, ``strategy``, ``update_interval``, ...).

The old names keep working until :data:`REMOVED_IN`, with a ``FutureWarning`` naming the new one: as keywords
(:func:`renamed_keywords`, also what lets a checkpoint written before 0.3 resume, since the Trainer rebuilds a
stateful callback from its stored keywords) and as attributes (:class:`RenamedAttribute`). Typing a setting under
both names is refused. Axolotl's own keys (``lisa_n_layers``, ``lisa_step_interval``) are axolotl's schema and stay;
the peers' names ``hf-lisa train`` accepts are in :mod:`hf_lisa.option_aliases`.

Example:
    ```py
    >>> import warnings
    >>> from hf_lisa.trainer_callbacks import LisaCallback
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     callback = LisaCallback(activated_layers=3)
    >>> callback.lisa_activated_layers, caught[0].category.__name__
    (3, 'FutureWarning')
    ```
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, TypeVar

#: the release that removes the old names
REMOVED_IN = "0.4"

#: old name -> the setting's one name (the same table for every class that had an old name)
RENAMED: dict[str, str] = {
    "activated_layers": "lisa_activated_layers",
    "num_active": "lisa_activated_layers",
    "interval_steps": "lisa_interval_steps",
    "sampling": "lisa_sampling",
    "strategy": "lisa_sampling",
    "optimizer_state_policy": "lisa_optimizer_state_policy",
    "layers_attribute": "lisa_layers_attribute",
    "always_trainable": "lisa_always_trainable",
    "update_interval": "mask_update_interval",
    "keep_learned": "mask_keep_learned",
    "recalibrate": "recalibrate_masks",
}

F = TypeVar("F", bound=Callable[..., Any])


def _warn(owner: str, old: str, new: str, what: str) -> None:
    warnings.warn(
        f"{owner}: the {what} {old!r} is renamed {new!r} (one name per setting, as in LisaConfig and hf-lisa train); "
        f"{old!r} works until hf-lisa {REMOVED_IN}.",
        FutureWarning,
        stacklevel=3,
    )


def renamed_keywords(*old_names: str) -> Callable[[F], F]:
    """Let a function (a constructor) take the ``old_names`` of its settings for one release: each becomes its new
    name (:data:`RENAMED`) with a ``FutureWarning``; both names at once is a ``TypeError``. The signature shown by
    ``help()`` and ``inspect`` is the new one."""
    unknown = [name for name in old_names if name not in RENAMED]
    if unknown:
        raise ValueError(f"{unknown} are not in hf_lisa.renamed.RENAMED")

    def decorate(function: F) -> F:
        owner = function.__qualname__.replace(".__init__", "")

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old in old_names:
                if old not in kwargs:
                    continue
                new = RENAMED[old]
                if new in kwargs:
                    raise TypeError(
                        f"{owner}() got {old}={kwargs[old]!r} and {new}={kwargs[new]!r}: {old!r} is the old name of "
                        f"{new!r}; give {new} only."
                    )
                _warn(owner, old, new, "keyword")
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class RenamedAttribute:
    """``obj.<old>`` reads (and writes) ``obj.<new>`` for one release, with a ``FutureWarning``.

    Example:
        ```py
        >>> class Sampler:
        ...     num_active = RenamedAttribute("lisa_activated_layers")
        ```
    """

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if RENAMED.get(name) != self.new:
            raise ValueError(f"{owner.__name__}.{name}: hf_lisa.renamed.RENAMED maps {name!r} to "
                             f"{RENAMED.get(name)!r}, not {self.new!r}")
        self.old = name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        _warn(type(obj).__name__, self.old, self.new, "attribute")
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        _warn(type(obj).__name__, self.old, self.new, "attribute")
        setattr(obj, self.new, value)


def new_names(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with every old name replaced by its new one (no warning: for stored records read back)."""
    return {RENAMED.get(name, name): value for name, value in settings.items()}
