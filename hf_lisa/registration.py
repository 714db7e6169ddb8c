"""Make LISA a first-class PEFT method: a ``PeftType.LISA`` member and ``register_peft_method``.

``PeftType`` is a closed ``str`` enum, yet ``register_peft_method`` requires a member for every method and code
across transformers and PEFT calls ``peft_type.value``. We add the member the way ``enum`` itself stores members, so
that ``PeftType("LISA")``, ``PeftType.LISA`` and ``list(PeftType)`` all see it.
"""

from __future__ import annotations

from peft.utils.peft_types import PeftType


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


def register() -> None:
    """Register LISA with PEFT. Idempotent: importing ``hf_lisa`` twice (or reloading it) does not raise."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import register_peft_method

    from .config import LisaConfig
    from .model import LisaModel

    if PEFT_TYPE_TO_CONFIG_MAPPING.get(PEFT_TYPE_LISA) is LisaConfig and PEFT_TYPE_TO_TUNER_MAPPING.get(
        PEFT_TYPE_LISA
    ) is LisaModel:
        return
    # a reload of hf_lisa defines new classes: replace the stale registration instead of failing on the duplicate
    from peft.mapping import PEFT_TYPE_TO_MIXED_MODEL_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING

    for mapping in (
        PEFT_TYPE_TO_CONFIG_MAPPING,
        PEFT_TYPE_TO_TUNER_MAPPING,
        PEFT_TYPE_TO_MIXED_MODEL_MAPPING,
        PEFT_TYPE_TO_PREFIX_MAPPING,
    ):
        mapping.pop(PEFT_TYPE_LISA, None)
    register_peft_method(name="lisa", config_cls=LisaConfig, model_cls=LisaModel, prefix="lisa_")
