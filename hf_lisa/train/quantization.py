"""A bitsandbytes-quantized base model for ``hf-lisa train`` (QLoRA-style): the options (as TRL's ``ModelConfig`` has
them), their checks, the ``BitsAndBytesConfig`` the model loads with, and the preparation of the loaded model.

The base model's linear layers load in 4-bit (NF4/FP4) or 8-bit (LLM.int8()) and stay frozen; only adapters train on
them: ``--method lisa-adapter`` (LISA adapters, the layer sampling and sparse masks included), ``lora`` or ``dora``.
Full-parameter LISA and full fine-tuning update the base weights themselves, which quantized weights cannot be, so
they are refused. bitsandbytes is the optional extra ``pip install 'hf-lisa[quant]'``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from dataclasses import field
from typing import Any, Optional

from ..errors import UsageError
from ..methods import get_method, method_names
from ..models import BNB_4BIT_QUANT_TYPES, COMPUTE_DTYPES

logger = logging.getLogger("hf_lisa.train")

#: the methods that train adapters beside the frozen base, and so work on a quantized one
QUANTIZABLE_METHODS = method_names(lambda m: m.is_adapter)


def quantization_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """``(name, type, field)`` of the quantization options, for ``dataclasses.make_dataclass`` (``ModelArguments``)."""
    return [
        ("load_in_8bit", bool, field(default=False, metadata={
            "help": "Load the base model's linear layers in 8-bit (bitsandbytes LLM.int8()) and train adapters on "
            "them; needs the 'quant' extra (bitsandbytes). Adapter methods only (lisa-adapter, lora, dora)."})),
        ("load_in_4bit", bool, field(default=False, metadata={
            "help": "Load the base model's linear layers in 4-bit (bitsandbytes, QLoRA-style) and train adapters on "
            "them; needs the 'quant' extra (bitsandbytes). Adapter methods only (lisa-adapter, lora, dora)."})),
        ("bnb_4bit_quant_type", str, field(default="nf4", metadata={
            "help": "4-bit data type with --load_in_4bit: 'nf4' (NormalFloat4, QLoRA's) or 'fp4'."})),
        ("bnb_4bit_compute_dtype", Optional[str], field(default=None, metadata={
            "help": "dtype the 4-bit layers compute in with --load_in_4bit: 'float32', 'bfloat16' or 'float16'. "
            "Default: --torch_dtype (float32 when that is 'auto')."})),
        ("use_bnb_nested_quant", bool, field(default=False, metadata={
            "help": "With --load_in_4bit, quantize the quantization constants too (nested / double quantization: "
            "about 0.4 bits less per parameter)."})),
    ]


def is_quantized(model_args) -> bool:
    """Whether ``model_args`` asks for a bitsandbytes-quantized base."""
    return bool(model_args.load_in_4bit or model_args.load_in_8bit)


def check_quantization(model_args, lisa_args) -> None:
    """Refuse quantization options that cannot take effect, each error naming the option and what is allowed.

    Raises:
        UsageError: 4-bit and 8-bit together; a quantized base with a method that updates base weights (``lisa``,
            ``full``); a ``--bnb_4bit_*`` option without ``--load_in_4bit``; an unknown 4-bit type or compute
            dtype; bitsandbytes not installed.
    """
    four, eight = model_args.load_in_4bit, model_args.load_in_8bit
    if four and eight:
        raise UsageError("--load_in_4bit and --load_in_8bit exclude each other; choose one.")
    if model_args.bnb_4bit_quant_type not in BNB_4BIT_QUANT_TYPES:
        raise UsageError(f"--bnb_4bit_quant_type={model_args.bnb_4bit_quant_type!r} is invalid; allowed: "
                         f"{', '.join(BNB_4BIT_QUANT_TYPES)}.")
    compute = model_args.bnb_4bit_compute_dtype
    if compute is not None and compute not in COMPUTE_DTYPES:
        raise UsageError(f"--bnb_4bit_compute_dtype={compute!r} is invalid; allowed: {', '.join(COMPUTE_DTYPES)}.")
    if not four:
        given = [
            f"--{name}={value!r}"
            for name, value, default in (
                ("bnb_4bit_quant_type", model_args.bnb_4bit_quant_type, "nf4"),
                ("bnb_4bit_compute_dtype", compute, None),
                ("use_bnb_nested_quant", model_args.use_bnb_nested_quant, False),
            )
            if value != default
        ]
        if given:
            raise UsageError(f"{', '.join(given)} only applies with --load_in_4bit; add --load_in_4bit or remove it.")
    if not (four or eight):
        return
    option = "--load_in_4bit" if four else "--load_in_8bit"
    method = lisa_args.method
    if method not in QUANTIZABLE_METHODS:
        what = ("trains the base weights of the sampled blocks in place" if get_method(method).samples_base_blocks
                else "trains every base weight")
        raise UsageError(
            f"{option} cannot be used with --method {method}: it {what}, and bitsandbytes' quantized weights are "
            "frozen (they can be neither unfrozen nor updated). Use --method lisa-adapter (LISA's layer sampling and "
            f"sparse masks, on adapters over the quantized base), lora or dora, or drop {option}."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError(f"{option} needs bitsandbytes: pip install 'hf-lisa[quant]' (or bitsandbytes>=0.45).")


def bnb_config(model_args):
    """The ``transformers.BitsAndBytesConfig`` that ``model_args`` asks for (:func:`hf_lisa.models.quantization_config`,
    after :func:`check_quantization`), or ``None`` for an unquantized base."""
    from ..models import quantization_config

    if not is_quantized(model_args):
        return None
    return quantization_config(
        model_args.load_in_4bit, model_args.load_in_8bit, quant_type=model_args.bnb_4bit_quant_type,
        compute_dtype=model_args.bnb_4bit_compute_dtype, nested_quant=model_args.use_bnb_nested_quant,
        dtype=model_args.torch_dtype,
    )


def prepare_quantized_model(model, training_args):
    """PEFT's ``prepare_model_for_kbit_training`` on a quantized ``model`` (a no-op for an unquantized one), as TRL
    does, and the guards that keep its bitsandbytes layers trainable after an evaluation, whatever adapter goes on them.

    PEFT's preparation freezes the base, casts its half-precision non-quantized parameters (embeddings, norms, head) to
    float32 for stable training, and, with ``--gradient_checkpointing`` only, turns checkpointing on with inputs that
    require grad. Without ``--gradient_checkpointing`` checkpointing stays off (PEFT's own default would turn it on).

    The guards: 4-bit layers never take bitsandbytes' backward-less CPU inference layout
    (:func:`hf_lisa.tuner.bnb.keep_4bit_layers_trainable`; the evaluation before training used to end every 4-bit run
    there), and 8-bit layers keep their row scales when PEFT's DoRA replaces their weight (:func:`keep_8bit_scales`).
    """
    if not (getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)):
        return model
    from peft import prepare_model_for_kbit_training

    from ..tuner.bnb import keep_4bit_layers_trainable

    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=bool(training_args.gradient_checkpointing),
        gradient_checkpointing_kwargs=training_args.gradient_checkpointing_kwargs,
    )
    keep_4bit_layers_trainable(model)
    keep_8bit_scales(model)
    return model


def _restore_8bit_scales(module, args) -> None:
    weight, state = module.weight, module.state
    if getattr(weight, "CB", None) is not None and getattr(weight, "SCB", None) is None and state.SCB is not None:
        weight.SCB = state.SCB  # the same int8 matrix (CB is the weight's data), so the same row scales


def keep_8bit_scales(model) -> int:
    """Give every bitsandbytes ``Linear8bitLt`` of ``model`` a forward pre-hook that puts its row scales back on a
    weight that lost them; returns how many layers have the hook.

    bitsandbytes moves an 8-bit weight's int8 matrix and row scales into the layer's state at the first forward.
    PEFT's DoRA (``dequantize_module_weight``, every forward on CPU) then replaces the weight with ``weight.to("cpu")``,
    which bitsandbytes 0.50 rebuilds with the matrix but without the scales, so the next forward overwrote the state's
    scales with ``None`` and failed (``'NoneType' object has no attribute 'unsqueeze'``) at the second step: after the
    evaluation before training, or at step 2 without one. Safe to call again.
    """
    if "bitsandbytes" not in sys.modules:
        return 0
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear8bitLt):
            if not getattr(module, "_hf_lisa_scales_hook", False):
                module.register_forward_pre_hook(_restore_8bit_scales)
                module._hf_lisa_scales_hook = True
            count += 1
    return count


def parameter_count(param) -> int:
    """How many weights ``param`` holds: a bitsandbytes 4-bit parameter packs several into each stored element (two per
    byte of its storage dtype), so its ``numel()`` undercounts them, as PEFT's ``get_nb_trainable_parameters`` notes."""
    if type(param).__name__ == "Params4bit":
        return param.numel() * 2 * param.quant_storage.itemsize
    return param.numel()
