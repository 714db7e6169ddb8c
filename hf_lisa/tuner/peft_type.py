"""The ``PeftType.LISA`` member. A leaf module: it imports nothing from hf-lisa, so the config can use it freely.

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
