"""Discovery of the transformer blocks ("layers" in LISA's vocabulary) of a model.

LISA samples whole blocks, layer interpolation scales each block's output, and layer-wise learning-rate decay gives
each block its own rate. All three need the ordered list of blocks, found here once.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

# Attribute paths of the block lists of common architectures, relative to the bare transformers model.
# Several paths may apply (T5 and BART have an encoder and a decoder stack); all that exist are used, in this order.
# The order is the order of the blocks from input to output, which layer-wise LR decay relies on: an encoder path
# must come before the decoder path of the same model.
KNOWN_BLOCK_PATHS: tuple[str, ...] = (
    "model.layers",  # llama, mistral, qwen2, gemma, phi3 (CausalLM)
    "layers",  # llama-family base models (LlamaModel)
    "model.encoder.layers",  # bart, mbart, whisper encoder (ForConditionalGeneration)
    "model.decoder.layers",  # opt (CausalLM), bart/mbart decoder
    "encoder.layers",  # bart, mbart base model encoder
    "decoder.layers",  # opt base model, bart/mbart base model decoder
    "transformer.h",  # gpt2, gpt-j, bloom (CausalLM)
    "h",  # gpt2 base model
    "gpt_neox.layers",  # gpt-neox, pythia
    "bert.encoder.layer",  # bert heads
    "roberta.encoder.layer",
    "encoder.layer",  # bert base model
    "encoder.block",  # t5 encoder
    "decoder.block",  # t5 decoder
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP-style ``.module`` wrappers, ``PeftModel`` and PEFT tuners down to the transformers model."""
    from peft.tuners.tuners_utils import BaseTuner

    while True:
        if hasattr(model, "get_base_model"):  # PeftModel
            model = model.get_base_model()
        elif isinstance(model, BaseTuner):
            model = model.model
        elif type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            model = model.module
        else:
            return model


def _get_attr_path(root: nn.Module, path: str) -> Optional[nn.Module]:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)  # nn.Module.__getattr__ also resolves ModuleDict/ModuleList children
        if obj is None:
            return None
    return obj


def find_block_lists(model: nn.Module, layers_attribute: Optional[str | Sequence[str]] = None) -> list[tuple[str, nn.ModuleList]]:
    """Return ``[(attribute_path, ModuleList), ...]`` of the model's transformer block lists.

    Args:
        model: a transformers model, optionally wrapped by PEFT or DDP.
        layers_attribute: attribute path(s) overriding discovery, e.g. ``"model.layers"`` (LMFlow's
            ``lisa_layers_attribute``). Paths are relative to the unwrapped transformers model.

    Raises:
        ValueError: if the override does not name a ``ModuleList`` or no block list can be found.
    """
    root = unwrap_model(model)
    if layers_attribute:
        paths = [layers_attribute] if isinstance(layers_attribute, str) else list(layers_attribute)
        found = []
        for path in paths:
            obj = _get_attr_path(root, path)
            if not isinstance(obj, nn.ModuleList):
                raise ValueError(
                    f"lisa_layers_attribute={path!r} does not name an nn.ModuleList on {type(root).__name__} "
                    f"(got {type(obj).__name__}); pass the dotted path of the block list, e.g. 'model.layers'."
                )
            found.append((path, obj))
        return found

    found, seen = [], set()
    for path in KNOWN_BLOCK_PATHS:
        obj = _get_attr_path(root, path)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0 and id(obj) not in seen:
            seen.add(id(obj))
            found.append((path, obj))
    if found:
        return found

    # Fallback: outermost ModuleLists whose children all share one class (the usual shape of a block stack).
    candidates = []
    for name, module in root.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        if any(name.startswith(prev + ".") for prev, _ in candidates):
            continue
        candidates.append((name, module))
    if not candidates:
        raise ValueError(
            f"Could not find the transformer blocks of {type(root).__name__}. Set lisa_layers_attribute to the dotted "
            "path of the block list (an nn.ModuleList), e.g. 'model.layers' or 'transformer.h'."
        )
    return candidates


def find_blocks(model: nn.Module, layers_attribute: Optional[str | Sequence[str]] = None) -> list[tuple[str, nn.Module]]:
    """Flat, ordered list of ``(qualified_name, block)`` over every block list of the model."""
    return [
        (f"{path}.{i}", block)
        for path, blocks in find_block_lists(model, layers_attribute)
        for i, block in enumerate(blocks)
    ]
