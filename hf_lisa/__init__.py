"""hf-lisa: LISA fine-tuning for the Hugging Face stack.

``import hf_lisa`` registers ``LISA`` as a PEFT method next to LoRA::

    import hf_lisa
    from peft import get_peft_model
    model = get_peft_model(base_model, hf_lisa.LisaConfig(r=8, sparsity=0.4))
"""

from __future__ import annotations

from .blocks import find_blocks
from .tuner import PEFT_TYPE_LISA, LisaConfig, LisaLayer, LisaModel, Linear, register  # noqa: F401 (registers LISA)

__version__ = "0.2.0"

# Hub helpers load lazily: huggingface_hub's upload machinery and the card templates are not needed to train
_LAZY = {"push_to_hub": "hub", "from_pretrained": "hub.load"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LisaConfig", "LisaModel", "LisaLayer", "Linear", "PEFT_TYPE_LISA", "find_blocks", "push_to_hub",
    "from_pretrained", "__version__",
]
