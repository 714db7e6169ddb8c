"""hf-lisa: LISA fine-tuning for the Hugging Face stack.

``import hf_lisa`` registers ``LISA`` as a PEFT method next to LoRA::

    import hf_lisa
    from peft import get_peft_model
    model = get_peft_model(base_model, hf_lisa.LisaConfig(r=8, sparsity=0.4))
"""

from __future__ import annotations

from .registration import PEFT_TYPE_LISA, register

register()

from .blocks import find_blocks  # noqa: E402
from .config import LisaConfig  # noqa: E402
from .layer import LisaLayer, Linear  # noqa: E402
from .model import LisaModel  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LisaConfig", "LisaModel", "LisaLayer", "Linear", "PEFT_TYPE_LISA", "find_blocks", "__version__"]
