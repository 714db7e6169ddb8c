"""``--packing``: several tokenised training rows per sequence, each row attending only to itself.

Short rows waste most of a padded batch: a batch of 8 rows padded to its longest row of 400 tokens, where the mean row
has 60, computes 3200 positions for 480 tokens. Packing puts whole rows side by side into sequences of at most
``max_seq_length`` tokens, so that a batch of ``per_device_train_batch_size`` *sequences* holds several rows each.

Three things keep the packed loss equal to the unpacked loss over the same rows (``tests/test_packing.py`` checks
logits and losses, on a tiny llama and on the embedded SmolLM2):

* **positions restart at 0 for each row** (``position_ids``), so the rotary (or absolute) positions of a row are those
  it has alone;
* **attention never crosses a row boundary.** No padding ``attention_mask`` goes to the model: with ``sdpa``,
  ``eager`` and ``flex_attention``, transformers' ``create_causal_mask`` then reads the row boundaries from the
  restarting ``position_ids`` (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask.
  A batch passes ``use_cache=False``: with a cache transformers skips that detection (an evaluation run or a model
  whose ``config.use_cache`` is on would otherwise attend across rows). With flash attention (``flash_attention_2/3/4``
  and the kernels' flash variants) the whole batch goes as one row without padding and with the boundaries as
  ``cu_seq_lens_q/k`` and ``max_length_q/k``, transformers' varlen path (``_flash_attention_forward``); a
  flash model given a padded batch of several packs would attend across rows, so it never gets one. Flash attention
  needs a GPU: that path is not exercised on CPU, but the check below runs on it wherever it runs;
* **the first label of every row is -100.** The causal-LM loss predicts ``labels[t + 1]`` from position ``t``: the
  last token of a row would otherwise be trained to predict the first token of the next. Alone, a row's first token is
  never a target either, so the tokens that count, and the Trainer's ``num_items_in_batch`` (taken over
  ``labels[..., 1:]``), are the same packed or not.

Before training, :func:`check_packing_support` runs the model on a packed batch built by the collator it will train
with and refuses ``--packing`` (``UsageError``) when a row's logits change with the tokens of another row in its pack,
or differ from the row's logits alone: a model whose forward takes no ``position_ids``, an attention implementation
without packed-sequence support (a custom registered kernel, for instance), a model that ignores them.

**Packing order** (:func:`pack_rows`, deterministic for a seed): the rows are shuffled with ``--seed``, sorted longest
first (stably, so rows of one length keep the shuffled order), then each goes into the open sequence with the least
free room that still holds it, or opens a new one (best-fit decreasing, which comes close to the fewest sequences: at most 11/9 of them plus one). The
sequences are then shuffled with the same seed. The composition of the sequences is fixed for the run; the Trainer
still shuffles the sequences every epoch.

**Evaluation rows are not packed.** The Trainer averages the evaluation loss per batch, weighted by rows per batch:
packed, the same tokens would give another ``eval_loss``, and ``eval_loss``, perplexity and token accuracy would not
compare with an unpacked run. The validation split is small, and stays one padded row per example.

Example:
    ```py
    >>> from hf_lisa.data.packing import pack_rows
    >>> pack_rows([5, 3, 2, 4], max_seq_length=7, seed=0)  # rows 0+1 (8 tokens) cannot share a sequence
    [[3, 1], [0, 2]]
    ```
"""

from __future__ import annotations

import bisect
import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

IGNORE_INDEX = -100
PACKED_COLUMNS = ("input_ids", "labels", "position_ids")

logger = logging.getLogger("hf_lisa.train")

__all__ = ["PackedCollator", "PackingReport", "check_packing_support", "pack_dataset", "pack_rows",
           "prepare_packing", "uses_flash_attention"]


@dataclass
class PackingReport:
    """What packing made of the training rows: ``rows`` into ``sequences`` of at most ``max_seq_length`` tokens
    holding ``tokens`` tokens."""

    rows: int
    sequences: int
    tokens: int
    max_seq_length: int

    @property
    def ratio(self) -> float:
        """Rows per sequence (the packing ratio)."""
        return self.rows / max(1, self.sequences)

    @property
    def fill(self) -> float:
        """Share of the sequences' ``max_seq_length`` positions that hold a token."""
        return self.tokens / max(1, self.sequences * self.max_seq_length)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "sequences": self.sequences, "tokens": self.tokens,
                "max_seq_length": self.max_seq_length, "ratio": round(self.ratio, 3), "fill": round(self.fill, 3)}

    def line(self) -> str:
        return (f"packing: {self.rows} training rows in {self.sequences} sequences of up to {self.max_seq_length} "
                f"tokens ({self.ratio:.2f} rows per sequence, {self.fill:.0%} of the positions filled); "
                "--per_device_train_batch_size counts sequences")


# -- packing -----------------------------------------------------------------------------------------------------------
def pack_rows(lengths: Sequence[int], max_seq_length: int, seed: int) -> list[list[int]]:
    """Row indices grouped into sequences of at most ``max_seq_length`` tokens, by seeded best-fit decreasing (see the
    module docstring); every row is in exactly one sequence.

    Raises:
        ValueError: a row longer than ``max_seq_length`` or empty.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    for i, n in enumerate(lengths):
        if not 0 < n <= max_seq_length:
            raise ValueError(f"row {i} has {n} tokens; packing needs 1 to max_seq_length={max_seq_length}.")
    order = sorted(rng.permutation(len(lengths)).tolist(), key=lambda i: -lengths[i])  # stable: ties stay shuffled
    packs: list[list[int]] = []
    open_by_room: dict[int, list[int]] = {}  # free room -> the open sequences with exactly that room
    rooms: list[int] = []  # the keys of open_by_room, sorted
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)  # the least room that holds the row
        if k < len(rooms):
            room = rooms[k]
            pack = open_by_room[room].pop()
            if not open_by_room[room]:
                del open_by_room[room], rooms[k]
        else:
            room, pack = max_seq_length, len(packs)
            packs.append([])
        packs[pack].append(i)
        room -= n
        if room:  # a full sequence takes nothing more
            if room not in open_by_room:
                bisect.insort(rooms, room)
                open_by_room[room] = []
            open_by_room[room].append(pack)
    return [packs[j] for j in rng.permutation(len(packs)).tolist()]


def pack_features(rows: Sequence[dict]) -> dict[str, list[int]]:
    """One packed sequence from tokenised rows (``input_ids``, ``labels``): the ids and labels side by side, the first
    label of every row set to -100, ``position_ids`` restarting at 0 at each row."""
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        ids, labels = list(row["input_ids"]), list(row["labels"])
        packed["input_ids"] += ids
        packed["labels"] += [IGNORE_INDEX] + labels[1:]
        packed["position_ids"] += list(range(len(ids)))
    return packed


def pack_dataset(dataset, max_seq_length: int, seed: int):
    """``(packed Dataset with the columns input_ids/labels/position_ids, PackingReport)`` from a tokenised split."""
    import datasets

    columns = dataset.select_columns(["input_ids", "labels"])[:]
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in zip(columns["input_ids"], columns["labels"])]
    lengths = [len(row["input_ids"]) for row in rows]
    packs = [pack_features([rows[i] for i in pack]) for pack in pack_rows(lengths, max_seq_length, seed)]
    packed = datasets.Dataset.from_dict({name: [pack[name] for pack in packs] for name in PACKED_COLUMNS})
    return packed, PackingReport(rows=len(rows), sequences=len(packs), tokens=sum(lengths),
                                 max_seq_length=max_seq_length)


# -- the collator ------------------------------------------------------------------------------------------------------
def uses_flash_attention(model) -> bool:
    """Whether ``model`` runs a flash-attention implementation (the varlen path: the batch flattened to one row)."""
    from transformers.utils.generic import is_flash_attention_requested

    config = getattr(model, "config", None)
    return config is not None and is_flash_attention_requested(config)


class PackedCollator:
    """Batches of packed sequences (rows with ``position_ids``) for the model, and unpacked rows (the evaluation
    split, with an ``attention_mask``) as :func:`hf_lisa.data.pipeline.data_collator` pads them.

    Packed, the batch has ``input_ids``, ``labels``, ``position_ids`` and ``use_cache=False``, and no
    ``attention_mask``:

    * ``flatten=False`` (sdpa, eager, flex attention): the sequences right-padded to the longest; the padding is one more
      segment (its positions restart at 0, its labels are -100), so it attends only to itself;
    * ``flatten=True`` (flash attention): every sequence of the batch side by side in one row, no padding, and the row
      boundaries as ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k``.

    Example:
        ```py
        >>> from hf_lisa.data.packing import PackedCollator, pack_features
        >>> collate = PackedCollator(pad_token_id=0)
        >>> pack = pack_features([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}])
        >>> batch = collate([pack, pack_features([{"input_ids": [4], "labels": [4]}])])
        >>> batch["position_ids"].tolist(), batch["labels"].tolist()
        ([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]], [[-100, 6, 7, -100, 9], [-100, -100, -100, -100, -100]])
        ```
    """

    def __init__(self, pad_token_id: int, flatten: bool = False, unpacked=None) -> None:
        self.pad_token_id = pad_token_id
        self.flatten = flatten
        self.unpacked = unpacked  # the collator of rows that are not packed (evaluation)

    def __call__(self, features: Sequence[dict]) -> dict:
        import torch

        if all("attention_mask" in f for f in features):  # unpacked rows: evaluation
            if self.unpacked is None:
                raise ValueError("PackedCollator got unpacked rows (with an attention_mask) and has no collator for "
                                 "them; pass unpacked=data_collator(tokenizer).")
            return self.unpacked(features)
        missing = [name for name in PACKED_COLUMNS if any(name not in f for f in features)]
        if missing or any("attention_mask" in f for f in features):
            # never a padded batch without the row boundaries: attention would cross rows
            raise ValueError(f"PackedCollator: packed sequences need the columns {list(PACKED_COLUMNS)} and no "
                             f"attention_mask; missing {missing} (was position_ids removed as an unused column?).")
        columns = {name: [list(f[name]) for f in features] for name in PACKED_COLUMNS}
        if self.flatten:
            flat = {name: [sum(values, [])] for name, values in columns.items()}
            starts = [i for i, p in enumerate(flat["position_ids"][0]) if p == 0] + [len(flat["position_ids"][0])]
            cu_seq_lens = torch.tensor(starts, dtype=torch.int32)
            longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
            batch = {name: torch.tensor(values, dtype=torch.long) for name, values in flat.items()}
            batch.update(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=longest,
                         max_length_k=longest)
        else:
            width = max(len(ids) for ids in columns["input_ids"])
            pads = [width - len(ids) for ids in columns["input_ids"]]
            batch = {
                "input_ids": [ids + [self.pad_token_id] * pad for ids, pad in zip(columns["input_ids"], pads)],
                "labels": [labels + [IGNORE_INDEX] * pad for labels, pad in zip(columns["labels"], pads)],
                "position_ids": [pos + list(range(pad)) for pos, pad in zip(columns["position_ids"], pads)],
            }
            batch = {name: torch.tensor(values, dtype=torch.long) for name, values in batch.items()}
        batch["use_cache"] = False  # with a cache, transformers would not read the row boundaries
        return batch


# -- the check on the model --------------------------------------------------------------------------------------------
@contextmanager
def _inference(model):
    """``model`` in eval mode without gradients (dropout off), each module's mode restored afterwards."""
    import torch

    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def _base_forward_parameters(model) -> set[str]:
    get_base = getattr(model, "get_base_model", None)
    return set(inspect.signature((get_base() if get_base else model).forward).parameters)


def check_packing_support(model, collator: PackedCollator, seed: int = 0) -> None:
    """Refuse ``--packing`` (``UsageError``) unless ``model`` honours packed sequences as ``collator`` builds them.

    Three rows A (6 tokens), B (5) and C (4) go in as a batch of the sequences [A, B] and [C] (padded, or flattened for
    flash attention), and again with other tokens in A. B's logits must not change with A's tokens (no attention across
    a row boundary: within 1% of the logits' scale, exactly equal on CPU), and each row's logits must match the row run
    alone (positions restart: within 0.1% of the scale in float32, 10% in 16-bit types).
    """
    import torch

    from ..errors import UsageError

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    where = f"--packing: {type(model).__name__} (attn_implementation={impl!r})"
    if "position_ids" not in _base_forward_parameters(model):
        raise UsageError(f"{where} takes no position_ids, so the rows of a packed sequence cannot be kept apart; "
                         "train without --packing.")
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # DeepSpeed ZeRO-3: partitioned weights cannot run a probe here
        logger.warning("%s: weights partitioned by DeepSpeed ZeRO-3, packing was not checked on the model; "
                       "transformers builds the block mask for %r.", where, impl)
        return
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    gen = torch.Generator().manual_seed(seed)
    vocab = min(embeddings.num_embeddings, 32000)
    a, a_other, b, c = (torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 6, 5, 4))

    def logits(rows_per_pack):
        packs = [pack_features([{"input_ids": r, "labels": r} for r in rows]) for rows in rows_per_pack]
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collator(packs).items()}
        batch.pop("labels")
        out = model(**batch).logits.float()
        spans, offset = [], 0  # each row's logits, in order
        for pack_index, rows in enumerate(rows_per_pack):
            offset = offset if collator.flatten else 0
            for row in rows:
                spans.append(out[0 if collator.flatten else pack_index, offset:offset + len(row)])
                offset += len(row)
        return spans

    with _inference(model):
        packed = logits([[a, b], [c]])
        other = logits([[a_other, b], [c]])
        alone = [model(input_ids=torch.tensor([r], device=device), use_cache=False).logits[0].float()
                 for r in (a, b, c)]
    scale = max(float(x.abs().max()) for x in alone) or 1.0
    tol = 1e-3 if embeddings.weight.dtype == torch.float32 else 0.1
    leak = float((packed[1] - other[1]).abs().max())
    if leak > 1e-2 * scale:
        raise UsageError(f"{where} lets attention cross the rows of a packed sequence (a row's logits moved by "
                         f"{leak:.3g} when another row of its sequence changed); train without --packing, or with "
                         "--attn_implementation sdpa, eager or flash_attention_2.")
    for name, got, want in zip("ABC", packed, alone):
        diff = float((got - want).abs().max())
        if diff > tol * scale:
            raise UsageError(f"{where}: row {name} of a packed sequence gives other logits than alone (max "
                             f"difference {diff:.3g}, scale {scale:.3g}); the model does not restart positions at "
                             "each row. Train without --packing.")


def prepare_packing(tokenized, model, tokenizer, max_seq_length: int, seed: int, unpacked=None):
    """``(datasets with train packed, PackedCollator, PackingReport)`` for ``hf-lisa train --packing``, after
    :func:`check_packing_support` on ``model``. The validation split stays unpacked (see the module docstring)."""
    import datasets

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collator = PackedCollator(pad if pad is not None else 0, flatten=uses_flash_attention(model), unpacked=unpacked)
    check_packing_support(model, collator, seed)
    train, report = pack_dataset(tokenized["train"], max_seq_length, seed)
    packed = datasets.DatasetDict({**tokenized, "train": train})
    return packed, collator, report

