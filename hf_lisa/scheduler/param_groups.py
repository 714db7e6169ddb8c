"""Layer-wise learning-rate decay (LLRD): one optimizer parameter group per transformer block.

With ``N`` blocks numbered ``0`` (nearest the input) to ``N-1``, base rate ``lr`` and decay ``d`` in ``(0, 1]``:

* block ``l`` trains at ``lr · d^(N-1-l)``, so the top block gets ``lr`` and each block below it ``d`` times less;
* embedding matrices (every ``nn.Embedding`` outside the blocks) get the lowest rate, ``lr · d^N``;
* everything else outside the blocks (final norm, LM or classification head, LISA interpolation scalars) gets ``lr``.

A tied LM head shares its matrix with the input embedding, so it trains at the embedding's rate. ``d = 1`` gives every
group ``lr`` (plain AdamW). The learning-rate scheduler multiplies each group's initial rate by the same factor, so the
ratios hold throughout training.

Every parameter that requires a gradient when the optimizer is built is included, frozen or not later: the
full-parameter LISA callback freezes blocks *after* the optimizer exists and unfreezes them when sampled, so every
candidate block must already have its group (LMFlow #726 is the bug this avoids).

Example:
    ```py
    >>> import torch
    >>> from hf_lisa.scheduler.param_groups import layerwise_lr_decay_param_groups
    >>> groups = layerwise_lr_decay_param_groups(model, lr=1e-4, decay=0.9)  # doctest: +SKIP
    >>> optimizer = torch.optim.AdamW(groups)  # doctest: +SKIP
    >>> [(g["name"], g["lr"]) for g in optimizer.param_groups][:2]  # doctest: +SKIP
    [('head', 0.0001), ('embeddings', 4.2e-05)]
    ```
"""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from .active_set import EMBEDDINGS_GROUP, HEAD_GROUP, BlockIndex, block_group_name
from ..renamed import renamed_keywords

__all__ = [
    "EMBEDDINGS_GROUP",
    "HEAD_GROUP",
    "assign_param_groups",
    "block_group_name",
    "layerwise_lr",
    "layerwise_lr_decay_param_groups",
]


def layerwise_lr(lr: float, decay: float, num_blocks: int, group: str) -> float:
    """The learning rate the formula gives to ``group`` (``"embeddings"``, ``"head"`` or ``"block.<l>"``)."""
    if group == EMBEDDINGS_GROUP:
        return lr * decay**num_blocks
    if group == HEAD_GROUP:
        return lr
    index = int(group.split(".", 1)[1])
    return lr * decay ** (num_blocks - 1 - index)


@renamed_keywords("layers_attribute")
def assign_param_groups(
    model: nn.Module, lisa_layers_attribute: Optional[str] = None
) -> tuple[dict[str, str], int]:
    """Map every parameter name of ``model`` to its LLRD group; also return the number of blocks.

    Names are those of ``model.named_parameters()`` (works through PeftModel and DDP wrappers). The map is the
    model's :class:`~hf_lisa.scheduler.active_set.BlockIndex` group map, the one the monitor and the summary read.
    """
    index = BlockIndex.of(model, lisa_layers_attribute)
    return dict(index.groups), index.num_blocks


def _is_interpolation_scalar(name: str) -> bool:
    return any(part in ("lisa_interp_delta", "lisa_interp_beta") for part in name.split("."))


@renamed_keywords("layers_attribute")
def layerwise_lr_decay_param_groups(
    model: nn.Module,
    lr: float,
    decay: float,
    weight_decay: float = 0.0,
    no_decay_names: Optional[Iterable[str]] = None,
    lisa_layers_attribute: Optional[str] = None,
) -> list[dict]:
    """Optimizer parameter groups implementing layer-wise learning-rate decay (formula in the module docstring).

    Args:
        model: the model (plain, PEFT-wrapped or DDP-wrapped).
        lr: the base (top block and head) learning rate.
        decay: the per-block factor ``d`` in ``(0, 1]``.
        weight_decay: weight decay of the parameters not in ``no_decay_names``.
        no_decay_names: parameter names without weight decay (the Trainer's biases and norms); `None` decays all.
            LISA's layer-interpolation scalars (``lisa_interp_delta``/``lisa_interp_beta``) never decay.
        lisa_layers_attribute: dotted path of the block list, overriding discovery.

    Returns:
        A list of ``{"params", "lr", "weight_decay", "name"}`` dicts, head first (the Trainer logs the first group's
        rate as ``learning_rate``), then embeddings and blocks bottom-up; ``name`` is ``"<group>"`` or
        ``"<group>/no_decay"``. Parameters with ``requires_grad=False`` are left out, as the Trainer does.
    """
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"layerwise_lr_decay={decay!r} is invalid; allowed: a float in (0, 1] (1 disables decay).")
    index = BlockIndex.of(model, lisa_layers_attribute)
    no_decay = set(no_decay_names or ())
    grouped: dict[str, dict] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        group = index.groups[name]
        # LISA's interpolation scalars δ and β never decay (δ = 0 is α = 1; β has its own L2 penalty)
        decays = (no_decay_names is None or name not in no_decay) and not _is_interpolation_scalar(name)
        key = group if decays else f"{group}/no_decay"
        if key not in grouped:
            grouped[key] = {
                "params": [],
                "lr": layerwise_lr(lr, decay, index.num_blocks, group),
                "weight_decay": weight_decay if decays else 0.0,
                "name": key,
            }
        grouped[key]["params"].append(param)

    def order(key: str) -> tuple[int, str]:
        # head first: the Trainer logs the first group's rate as `learning_rate`, which should be the base rate
        group = key.split("/", 1)[0]
        if group == HEAD_GROUP:
            return (-2, key)
        if group == EMBEDDINGS_GROUP:
            return (-1, key)
        return (int(group.split(".", 1)[1]), key)

    return [grouped[k] for k in sorted(grouped, key=order)]
