"""LISA on bitsandbytes-quantized bases (QLoRA-style): ``Linear4bit`` and ``Linear8bitLt`` layers.

The base layer stays quantized and frozen; the adapter (``lisa_A``, ``lisa_B``, the mask) is a float module beside it,
exactly as on an ``nn.Linear`` base (:meth:`LisaLayer.add_adapter_outputs`). What differs is reading the base weight:
``base_weight_out_in`` (the ``|W|`` magnitude that scores masks) dequantizes it, so scores have the weight's true
``(out, in)`` shape and not that of the packed 4-bit storage. Merging follows PEFT's LoRA on bitsandbytes: dequantize,
add the delta, quantize again, with a warning, since the result is rounded to the quantization grid (a merged and
unmerged adapter does not restore the original weights bit for bit).

bitsandbytes 0.50 on a CPU with AVX512-BF16 repacks a ``Linear4bit`` weight into an inference-only layout the first
time the layer runs in eval mode (an evaluation, a generation, the mask probe, a user's ``model.eval()``): that layout
has no backward, so every later training step gets no gradient, silently. Its own inverse of that layout is lossy
and, for rows of several 4-bit blocks, wrong. :func:`keep_4bit_layers_trainable` therefore keeps the repack from
happening at all (``LisaModel`` calls it on every model it wraps; ``hf-lisa train`` on every quantized base, whatever
the method), and :func:`unpack_cpu_inference_layout` restores a weight that was repacked before that.

bitsandbytes is optional (``pip install hf-lisa[quant]``): this module imports it only once a model holds
bitsandbytes layers, i.e. when bitsandbytes has already been imported.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

import torch
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from .config import LisaConfig
from .layer import LisaLayer


def _bnb():
    import bitsandbytes

    return bitsandbytes


def unpack_cpu_inference_layout(weight: nn.Parameter) -> bool:
    """Restore a bitsandbytes 4-bit weight from its CPU inference layout (AVX512-BF16 kernel) to the layout it was
    quantized in, in place; ``False`` (and nothing done) if it is not in that layout.

    bitsandbytes' own inverse restores the packed 4-bit codes exactly and re-quantizes nested scales, but leaves
    plain (non-nested) scales in the layout's transposed ``(in/blocksize, out)`` order: wrong as soon as a row holds
    more than one block. They are put back in row order here. Either way the scales keep the bfloat16 rounding the
    layout stored them with (relative error under 2^-8), which is what inference in that layout computed with.
    """
    state = getattr(weight, "quant_state", None)
    if not getattr(state, "packing_format_for_cpu", False):
        return False
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    plain_scales = None if state.original_nested else state.absmax  # (in/blocksize, out), bfloat16
    weight.data, state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
    if plain_scales is not None:
        state.absmax = plain_scales.T.reshape(-1).to(torch.float32)  # quantize_4bit's order and dtype
    weight.quant_state = state
    return True


def keep_4bit_layers_trainable(model: nn.Module) -> int:
    """Keep bitsandbytes from repacking any of ``model``'s 4-bit layers into its CPU inference-only layout, and
    restore those it already repacked; returns how many were restored (a warning says so).

    Every ``Linear4bit`` is covered, with an adapter or not: a repacked layer also stops the gradient on its way to
    the adapters before it. Inference in eval mode then runs bitsandbytes' ordinary 4-bit matmul (the one training
    uses), not its AVX512-BF16 kernel. Safe to call again; a no-op when bitsandbytes is not imported.
    """
    if "bitsandbytes" not in sys.modules:
        return 0
    bnb = _bnb()
    restored = []
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # read by Linear4bit.forward: repack only where the CPU supports AVX512-BF16 (bitsandbytes >= 0.48)
            module.support_avx512bf16_for_cpu = False
            if unpack_cpu_inference_layout(module.weight):
                restored.append(name)
    if restored:
        warnings.warn(
            f"{len(restored)} bitsandbytes 4-bit layers (e.g. {restored[0]!r}) were in bitsandbytes' CPU "
            "inference-only layout, which has no backward (the model ran in eval mode before it was prepared for "
            "training); they were restored to the trainable layout, their scales rounded to bfloat16 as that layout "
            "stored them.",
            UserWarning,
            stacklevel=2,
        )
    return len(restored)


def quantized_layer_class(base: nn.Module) -> Optional[type]:
    """The LISA layer class for a bitsandbytes base layer, or ``None`` if ``base`` is not one.

    Never imports bitsandbytes: a model can only hold its layers once it is imported.
    """
    if "bitsandbytes" not in sys.modules:
        return None
    bnb = _bnb()
    if isinstance(base, bnb.nn.Linear4bit):
        return Linear4bit
    if isinstance(base, bnb.nn.Linear8bitLt):
        return Linear8bitLt
    return None


class _QuantizedLinear(nn.Module, LisaLayer):
    """What the 4-bit and 8-bit layers share: the forward, merging through a dequantized copy, the magnitude scores.

    Subclasses define :meth:`dequantized_weight` and :meth:`_set_quantized_weight`.
    """

    bits: int = 0

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LisaConfig,
        r: int,
        lisa_alpha: float,
        sparsity: float,
        module_key: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        LisaLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = False  # bitsandbytes layers are nn.Linear subclasses: weight is (out, in)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lisa_alpha, sparsity, config, module_key=module_key)

    # -- the base weight -------------------------------------------------------------------------------------------------
    def dequantized_weight(self) -> torch.Tensor:
        """The base weight, dequantized, as an ``(out, in)`` tensor in the dtype it was quantized from."""
        raise NotImplementedError

    def _set_quantized_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (``(out, in)``, float) into the base layer, in place of its current weight."""
        raise NotImplementedError

    def base_weight_out_in(self) -> torch.Tensor:
        """The dequantized base weight: magnitude mask scores need the true ``(out, in)`` values, not the packed
        storage (a 4-bit weight is stored as a ``(out·in/2, 1)`` byte tensor)."""
        return self.dequantized_weight()

    # -- merging ---------------------------------------------------------------------------------------------------------
    def _rounding_warning(self, action: str) -> None:
        warnings.warn(
            f"{action} a LISA adapter into a {self.bits}-bit bitsandbytes layer dequantizes its weight, adds the "
            f"delta and quantizes the sum again: the result is rounded to the {self.bits}-bit grid, so outputs "
            "(and generations) can differ from the unmerged adapter's. For exact merged weights, load the base "
            "model unquantized and merge there.",
            UserWarning,
            stacklevel=3,
        )

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Fold the active adapters' deltas into the quantized base weight (dequantize, add, quantize again).

        Args:
            safe_merge: refuse (``ValueError``) if the merged weight has NaN or inf; the base is left unchanged.
            adapter_names: adapters to merge; all active adapters by default.
        """
        adapter_names = check_adapters_to_merge(self, adapter_names)
        for name in adapter_names:
            if name not in self.lisa_A:
                continue
            self._rounding_warning("Merging")
            weight = self.dequantized_weight()
            merged = weight.float() + self.get_delta_weight(name).float().to(weight.device)
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(
                    # PEFT's wording, so code matching PEFT's message keeps working
                    f"NaNs detected in the merged weights. The adapter {name} seems to be broken (LISA safe_merge "
                    "found NaN or inf; the base weights were left unchanged)."
                )
            self._set_quantized_weight(merged.to(weight.dtype))
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Subtract every merged delta again (dequantize, subtract, quantize): the weights come back up to the
        quantization's rounding, not bit for bit."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name not in self.lisa_A:
                continue
            self._rounding_warning("Unmerging")
            weight = self.dequantized_weight()
            restored = weight.float() - self.get_delta_weight(name).float().to(weight.device)
            self._set_quantized_weight(restored.to(weight.dtype))

    # -- forward ---------------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        return self.add_adapter_outputs(result, x)

    def __repr__(self) -> str:
        return "lisa." + super().__repr__()


class Linear4bit(_QuantizedLinear):
    """LISA on a bitsandbytes ``Linear4bit`` base (NF4 or FP4, with or without nested quantization)."""

    bits = 4

    def dequantized_weight(self) -> torch.Tensor:
        bnb = _bnb()
        weight = self.get_base_layer().weight
        unpack_cpu_inference_layout(weight)  # a base repacked for CPU inference (an inference-mode adapter)
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)

    def _set_quantized_weight(self, weight: torch.Tensor) -> None:
        bnb = _bnb()
        base = self.get_base_layer()
        old = base.weight
        new = bnb.nn.Params4bit(
            weight.to("cpu"),
            requires_grad=False,
            blocksize=old.blocksize,
            compress_statistics=old.compress_statistics,
            quant_type=old.quant_type,
            quant_storage=old.quant_storage,
            module=base,
        )
        base.weight = new.to(old.device)  # .to() quantizes (on CPU too)


class Linear8bitLt(_QuantizedLinear):
    """LISA on a bitsandbytes ``Linear8bitLt`` base (LLM.int8())."""

    bits = 8

    def _scales(self) -> Optional[torch.Tensor]:
        # the row scales live on the weight until the first forward, then on the layer's state
        base = self.get_base_layer()
        scales = base.state.SCB if base.state.SCB is not None else getattr(base.weight, "SCB", None)
        return scales

    def dequantized_weight(self) -> torch.Tensor:
        bnb = _bnb()
        weight = self.get_base_layer().weight
        if weight.dtype != torch.int8:  # has_fp16_weights=True: the weight is kept in float
            return weight.data
        scales = self._scales()
        if scales is None:
            raise RuntimeError(
                "This Linear8bitLt layer has int8 weights but no row scales (SCB); it was not quantized through "
                "bitsandbytes (load the model with BitsAndBytesConfig(load_in_8bit=True))."
            )
        return bnb.functional.int8_vectorwise_dequant(weight.data, scales.to(weight.device))

    def _set_quantized_weight(self, weight: torch.Tensor) -> None:
        bnb = _bnb()
        base = self.get_base_layer()
        old = base.weight
        new = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, has_fp16_weights=old.has_fp16_weights)
        base.weight = new.to(old.device)  # .to() quantizes (on CPU too)
        # the layer's state keeps the old int8 matrix and scales after a forward: point it at the new ones
        base.state.reset_grads()
        base.state.CB = None
        base.state.SCB = None
