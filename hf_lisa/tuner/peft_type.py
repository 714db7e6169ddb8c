"""The ``PeftType.LISA`` member, and the PEFT versions the LISA adapter runs on. A leaf module: it imports nothing from
hf-lisa but :mod:`hf_lisa.errors`, so the config can use it freely.

``PeftType`` is a closed ``str`` enum, yet ``register_peft_method`` requires a member for every method and code
across transformers and PEFT calls ``peft_type.value``. We add the member the way ``enum`` itself stores members, so
that ``PeftType("LISA")``, ``PeftType.LISA`` and ``list(PeftType)`` all see it.

**PEFT versions.** hf-lisa installs beside any PEFT from :data:`MIN_PEFT_FOR_SETTINGS` on (its settings class derives
from ``PeftConfig``), so full-parameter LISA (``LisaCallback``, ``hf-lisa train --method lisa``/``full``) runs in stacks
that pin an older PEFT (axolotl 0.19: 0.20.0; LLaMA-Factory 0.9.5: 0.18.x). The LISA *adapter* needs
:data:`MIN_PEFT_FOR_ADAPTER`: PEFT before 0.21 casts every adapter buffer to the base layer's float dtype when it moves
an adapter to the base layer's device (``BaseTunerLayer._move_adapter_to_device_of_base_layer``), which turns LISA's
bit-packed ``uint8`` mask into floats (measured on 0.20.0 and 0.18.1: ``NotImplementedError: "rshift_cpu" not
implemented for 'Float'`` on the first forward). :func:`require_supported_peft` refuses that with a message instead;
:class:`hf_lisa.tuner.LisaModel` calls it before it injects an adapter.
"""

from __future__ import annotations

from importlib import metadata

from peft.utils.peft_types import PeftType

from ..errors import RunError

#: the oldest PEFT whose adapter machinery keeps LISA's integer mask buffer an integer (see the module docstring)
MIN_PEFT_FOR_ADAPTER = (0, 21)
#: the oldest PEFT hf-lisa imports on (covered by the compatibility lanes, tests/compat/run_lane.sh)
MIN_PEFT_FOR_SETTINGS = (0, 18)


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:  # "0rc1": the release number ends here
            break
    return tuple(numbers)


def installed_peft_version() -> str:
    return metadata.version("peft")


def peft_is_supported(version: str | None = None) -> bool:
    """Whether the installed PEFT (or ``version``) runs the LISA adapter."""
    return _release(version or installed_peft_version()) >= MIN_PEFT_FOR_ADAPTER


class PeftTooOldError(RunError):
    """The installed PEFT is older than the LISA adapter needs; full-parameter LISA does not need it."""


def require_supported_peft() -> None:
    """Raise :class:`PeftTooOldError` with what to do when the installed PEFT cannot run the LISA adapter."""
    version = installed_peft_version()
    if peft_is_supported(version):
        return
    need = ".".join(map(str, MIN_PEFT_FOR_ADAPTER))
    raise PeftTooOldError(
        f"The LISA adapter needs peft>={need}; peft {version} is installed. PEFT before {need} casts adapter buffers "
        "to the base layer's float dtype when it moves an adapter to its device, which corrupts LISA's packed mask. "
        f"Install a newer PEFT (`pip install 'hf-lisa[adapter]'`, or `pip install 'peft>={need}'`) where the rest of "
        "your stack allows it. Full-parameter LISA does not need it: `LisaCallback` in a Trainer, or "
        "`hf-lisa train --method lisa`, runs on this PEFT."
    )


def _add_peft_type_member(name: str) -> PeftType:
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member._sort_order_ = len(PeftType._member_names_)
    type.__setattr__(PeftType, name, member)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    return member


PEFT_TYPE_LISA = _add_peft_type_member("LISA")
