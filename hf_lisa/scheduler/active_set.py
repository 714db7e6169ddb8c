"""The one owner of a model's block structure and of the schedule's active set.

* :class:`BlockIndex`: the transformer blocks of a model (:func:`hf_lisa.blocks.find_blocks`) and the map from every
  parameter name to its group: ``"embeddings"`` (every ``nn.Embedding`` outside the blocks), ``"block.<i>"`` or
  ``"head"`` (everything else: final norm, LM or task head, interpolation scalars). It is built once per model by
  :meth:`BlockIndex.of`, and every consumer reads that one object: the layerwise schedule, layer-wise learning-rate
  decay, the training monitor, the start-of-training summary and FSDP2's per-block sharding.
* :class:`ActiveSet`: which of the scheduled blocks train in the current period. :class:`LayerwiseScheduler` holds
  one and changes it; its :class:`~hf_lisa.scheduler.sampler.LayerSampler` only proposes the next set.

Example:
    ```py
    >>> from hf_lisa.scheduler.active_set import BlockIndex
    >>> index = BlockIndex.of(model)  # doctest: +SKIP
    >>> index.block_names[:2], index.groups["model.layers.0.mlp.up_proj.weight"]  # doctest: +SKIP
    (('model.layers.0', 'model.layers.1'), 'block.0')
    >>> BlockIndex.of(model) is index  # the same object for every consumer of this model  # doctest: +SKIP
    True
    ```
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional, Sequence, Union

from torch import nn

from ..blocks import find_blocks

__all__ = ["EMBEDDINGS_GROUP", "HEAD_GROUP", "ActiveSet", "BlockIndex", "block_group_name"]

EMBEDDINGS_GROUP = "embeddings"
HEAD_GROUP = "head"

LayersAttribute = Optional[Union[str, Sequence[str]]]

# model -> {layers_attribute: BlockIndex}; weak, so an index never keeps a model alive
_INDEXES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def block_group_name(index: int) -> str:
    """The group name of block ``index`` (``"block.<index>"``)."""
    return f"block.{index}"


def _parameter_names(model: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in model.named_parameters())


class BlockIndex:
    """The transformer blocks of a model and the group of each of its parameters; get it with :meth:`of`.

    Parameter names are those of ``model.named_parameters()`` for the very object the index was built for (a plain
    model, a ``PeftModel`` or a wrapper), so a consumer that holds the same model can look its names up directly. The
    index keeps no parameter alive: FSDP2 replaces parameters by shards under the same names and the index stays valid.

    Args:
        model: the model, optionally wrapped by PEFT or DDP.
        layers_attribute: dotted path(s) of the block list, overriding discovery (``lisa_layers_attribute``).

    Attributes:
        blocks: ``(qualified_name, block)`` of every block, from input to output.
        block_names: the blocks' qualified names.
        groups: parameter name -> ``"embeddings"``, ``"block.<i>"`` or ``"head"``.
        discovery_error: why no block was found (then ``blocks`` is empty), else ``None``.
    """

    def __init__(self, model: nn.Module, layers_attribute: LayersAttribute = None) -> None:
        self.layers_attribute = layers_attribute
        self.discovery_error: Optional[str] = None
        try:
            blocks = find_blocks(model, layers_attribute)
        except ValueError as err:
            blocks, self.discovery_error = [], str(err)
        self.blocks: tuple[tuple[str, nn.Module], ...] = tuple(blocks)
        self.block_names: tuple[str, ...] = tuple(name for name, _ in blocks)
        block_of_param = {id(p): i for i, (_, block) in enumerate(blocks) for p in block.parameters()}
        embedding_params = {
            id(p)
            for module in model.modules()
            if isinstance(module, nn.Embedding)
            for p in module.parameters(recurse=False)
        }
        self.groups: dict[str, str] = {}
        self._block_of: dict[str, int] = {}
        for name, param in model.named_parameters():
            if id(param) in block_of_param:
                self._block_of[name] = block_of_param[id(param)]
                self.groups[name] = block_group_name(self._block_of[name])
            elif id(param) in embedding_params:
                self.groups[name] = EMBEDDINGS_GROUP
            else:
                self.groups[name] = HEAD_GROUP
        self._parameter_names = tuple(self.groups)

    @classmethod
    def of(cls, model: nn.Module, layers_attribute: LayersAttribute = None, require_blocks: bool = True) -> BlockIndex:
        """The index of ``model``: built on the first call, the same object afterwards.

        It is built again only if the model's parameter names changed since (e.g. PEFT injected adapters into it).

        Args:
            model: the model whose ``named_parameters()`` names the index uses.
            layers_attribute: dotted path(s) of the block list, overriding discovery.
            require_blocks: raise if no block list is found; ``False`` returns an index without blocks, in which every
                parameter is ``"embeddings"`` or ``"head"``.

        Raises:
            ValueError: with ``require_blocks``, if ``layers_attribute`` names no ``nn.ModuleList`` or no block list
                can be found.
        """
        key = layers_attribute if isinstance(layers_attribute, (str, type(None))) else tuple(layers_attribute)
        per_model = _INDEXES.setdefault(model, {})
        index = per_model.get(key)
        if index is None or index._parameter_names != _parameter_names(model):
            index = per_model[key] = cls(model, layers_attribute)
        if require_blocks and index.discovery_error is not None:
            raise ValueError(index.discovery_error)
        return index

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def block_of(self, name: str) -> Optional[int]:
        """The block that holds parameter ``name``, or ``None`` for parameters outside every block."""
        return self._block_of.get(name)

    def __repr__(self) -> str:
        return f"BlockIndex(num_blocks={self.num_blocks}, blocks={list(self.block_names)}, params={len(self.groups)})"


class ActiveSet:
    """The blocks that train in the current period: the one record of the active set.

    Blocks are numbered by their position in ``block_names``, the blocks the schedule samples from (blocks without a
    trainable parameter are not among them). The sampler proposes; the scheduler applies a set and records it here.

    Args:
        index: the model's :class:`BlockIndex`.
        block_names: the scheduled blocks, a subset of ``index.block_names`` in the same order.
    """

    def __init__(self, index: BlockIndex, block_names: Sequence[str]) -> None:
        unknown = [name for name in block_names if name not in index.block_names]
        if unknown:
            raise ValueError(f"{unknown} are not blocks of this model; its blocks are {list(index.block_names)}.")
        self.index = index
        self.block_names: tuple[str, ...] = tuple(block_names)
        self._blocks: tuple[int, ...] = ()

    @property
    def blocks(self) -> list[int]:
        """The active blocks, sorted (empty before the first draw)."""
        return list(self._blocks)

    @property
    def names(self) -> list[str]:
        """The qualified names of the active blocks."""
        return [self.block_names[b] for b in self._blocks]

    def set(self, blocks: Iterable[int]) -> list[int]:
        """Record ``blocks`` as the active set; returns it sorted and without repeats."""
        chosen = sorted({int(b) for b in blocks})
        bad = [b for b in chosen if not 0 <= b < len(self.block_names)]
        if bad:
            raise IndexError(f"block indices {bad} out of range [0, {len(self.block_names)}) of the scheduled blocks")
        self._blocks = tuple(chosen)
        return list(chosen)

    def __repr__(self) -> str:
        return f"ActiveSet(blocks={self.blocks}, names={self.names})"
