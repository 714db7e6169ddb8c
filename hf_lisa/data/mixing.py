"""How several training sources become one list of rows: ``--mix_strategy`` (:func:`resolve_mix_strategy`) and the
seeded mixture itself (:func:`mixture_order`). :mod:`.sources` reads the sources; :mod:`.training_data` mixes their
tokenised rows with :func:`mixture_order`.

* ``concat``: every row of every source once, in a seeded shuffle; weights are refused (they would mean nothing).
* ``first_exhausted`` (LLaMA-Factory's ``interleave_under``): draw a source by weight, take its next row; stop before
  the first draw whose source has no row left. No row repeats; shares follow the weights; rows may stay unused.
* ``all_exhausted`` (``interleave_over``): the same draws until every source has given every row; a source that runs
  out starts its rows again (re-used). Every row is used at least once; shares follow the weights.
* ``auto`` (the default): ``concat`` when no ``--train_file`` entry gives a weight, ``first_exhausted`` when one does:
  LLaMA-Factory's default (``concat``, and interleaving only with mixing probabilities), and hf-lisa's rule for
  weighted mixtures before the option existed, so a weighted run trains on the same rows as before.

The mixture is materialised before training from its sizes, weights, seed and strategy alone, so a resumed run rebuilds
exactly the rows of the uninterrupted one. Each checkpoint records the strategy, weights and seed
(:func:`mixture_record_callback`, in ``trainer_state.json``), and a resume that would rebuild another mixture is refused
before the model loads (:func:`check_resumed_mixture`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Sequence

from ..errors import UsageError
from .validation import DataError

#: the rule of a weighted mixture by default: it ends when its first source runs out (no row repeated)
MIXTURE_RULE = "first_exhausted"
#: ``--mix_strategy`` values (``auto`` resolves to one of the others, :func:`resolve_mix_strategy`)
MIX_STRATEGIES = ("auto", "concat", "first_exhausted", "all_exhausted")
#: LLaMA-Factory's names for the same rules
MIX_STRATEGY_ALIASES = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}
#: ``all_exhausted`` refuses weights that would draw more rows than this (a tiny share of a large source)
MAX_MIXTURE_ROWS = 100_000_000

#: the mixture's entry in a checkpoint's ``trainer_state.json`` (``stateful_callbacks``)
MIXTURE_RECORD = "MixtureRecord"

__all__ = ["MAX_MIXTURE_ROWS", "MIXTURE_RECORD", "MIXTURE_RULE", "MIX_STRATEGIES", "MIX_STRATEGY_ALIASES",
           "check_resumed_mixture", "mixture_order", "mixture_record_callback", "mixture_settings",
           "resolve_mix_strategy"]


def resolve_mix_strategy(value: Any, specs: Sequence[Any], option: str = "mix_strategy") -> str:
    """The mixing rule of ``--mix_strategy value`` for the sources ``specs``: ``concat``, ``first_exhausted`` or
    ``all_exhausted``. ``auto`` is ``concat`` when no entry gives a weight and ``first_exhausted`` when one does;
    LLaMA-Factory's ``interleave_under`` / ``interleave_over`` are ``first_exhausted`` / ``all_exhausted``.
    ``specs`` are :class:`.sources.SourceSpec` (``weighted``: the entry gave a weight).

    Example:
        ```py
        >>> from hf_lisa.data.sources import parse_sources
        >>> resolve_mix_strategy("auto", parse_sources("a.jsonl,b.jsonl"))
        'concat'
        >>> resolve_mix_strategy("auto", parse_sources("a.jsonl:0.7,b.jsonl:0.3"))
        'first_exhausted'
        >>> resolve_mix_strategy("interleave_over", parse_sources("a.jsonl:0.7,b.jsonl:0.3"))
        'all_exhausted'
        ```

    Raises:
        UsageError: an unknown value (the allowed ones listed), or ``concat`` with weights (it uses every row once, so
            a weight would be ignored).
    """
    allowed = f"{', '.join(MIX_STRATEGIES)} (or LLaMA-Factory's {', '.join(MIX_STRATEGY_ALIASES)})"
    if not isinstance(value, str) or value.strip() not in (*MIX_STRATEGIES, *MIX_STRATEGY_ALIASES):
        raise UsageError(f"--{option}={value!r} is invalid; allowed: {allowed}.")
    value = value.strip()
    strategy = MIX_STRATEGY_ALIASES.get(value, value)
    weighted = [spec for spec in specs if spec.weighted]
    if strategy == "auto":
        return MIXTURE_RULE if weighted else "concat"
    if strategy == "concat" and weighted:
        given = ", ".join(f"{spec.path}:{spec.weight:g}" for spec in weighted)
        raise UsageError(f"--{option}={value!r} takes every row of every source once, so weights have no meaning, but "
                         f"--{weighted[0].option} gives {given}. Drop the weights, or mix by weight with "
                         f"--{option} first_exhausted (stops when a source runs out) or all_exhausted (re-uses the "
                         "rows of the sources that run out until every row was used).")
    return strategy


def mixture_order(sizes: Sequence[int], weights: Sequence[float], seed: int, strategy: str = MIXTURE_RULE):
    """The rows of a mixture of sources with ``sizes`` rows, in order: ``(source, row)`` as two int64 arrays.

    One ``numpy.random.default_rng(seed)`` draws everything: the same sizes, weights, seed and strategy give the same
    mixture. ``strategy`` (an alias of :data:`MIX_STRATEGY_ALIASES` works too):

    * ``concat``: every row of every source once, in one random order of all of them (``weights`` unused);
    * ``first_exhausted``: each source's rows in a random order; each draw picks source ``i`` with probability
      ``weights[i] / sum(weights)`` and takes its next row; the mixture ends before the first draw whose source has no
      row left: no row repeats, each source's share follows its weight;
    * ``all_exhausted``: the same draws, until every source has given each of its rows once (the mixture ends with the
      draw that takes the last unused row); a source that ran out starts its random order again, so the rows of the
      sources that run out first are re-used.

    Example:
        ```py
        >>> source, row = mixture_order([100, 100], [0.7, 0.3], seed=0)
        >>> bool(len(source) == len(row) and (source == 0).sum() == 100)  # the first source ran out first
        True
        >>> source, row = mixture_order([100, 100], [0.7, 0.3], seed=0, strategy="all_exhausted")
        >>> bool((source == 1).sum() == 100 and (source == 0).sum() > 100)  # the second ran out last; the first re-used
        True
        ```

    Raises:
        ValueError: sizes and weights of different lengths, an empty source, or an unknown strategy.
        DataError: ``all_exhausted`` with weights that would draw more than :data:`MAX_MIXTURE_ROWS` rows.
    """
    import numpy as np

    strategy = MIX_STRATEGY_ALIASES.get(strategy, strategy)
    if strategy not in MIX_STRATEGIES[1:]:
        raise ValueError(f"mixture_order: unknown strategy {strategy!r}; allowed: {', '.join(MIX_STRATEGIES[1:])}.")
    if len(sizes) != len(weights) or not sizes or min(sizes) < 1:
        raise ValueError(f"mixture_order needs one weight per non-empty source; got sizes {list(sizes)} and weights "
                         f"{list(weights)}.")
    rng = np.random.default_rng(seed % 2**64)
    if strategy == "concat":
        order = rng.permutation(sum(sizes))
        source = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)[order]
        return source, np.concatenate([np.arange(n, dtype=np.int64) for n in sizes])[order]
    probabilities = np.asarray(weights, dtype=np.float64)
    probabilities = probabilities / probabilities.sum()
    orders = [rng.permutation(n) for n in sizes]
    if strategy == "first_exhausted":
        draws = rng.choice(len(sizes), size=sum(sizes) + 1, p=probabilities)  # one more than the rows: one runs out
        stop = len(draws)
        for i, n in enumerate(sizes):
            hits = np.flatnonzero(draws == i)
            if len(hits) > n:
                stop = min(stop, int(hits[n]))
    else:
        stop, draws = _until_all_exhausted(rng, sizes, probabilities)
    source = draws[:stop].astype(np.int64)
    row = np.empty(stop, dtype=np.int64)
    for i, n in enumerate(sizes):
        mine = source == i
        row[mine] = orders[i][np.arange(int(mine.sum())) % n]  # past its rows (all_exhausted): its order again
    return source, row


def _until_all_exhausted(rng, sizes: Sequence[int], probabilities):
    """``(stop, draws)``: draws of sources by ``probabilities`` (in chunks, as many as needed) and the number of them
    that gives every source ``sizes[i]`` draws: one past the draw that takes the last unused row."""
    import numpy as np

    expected = max(n / p for n, p in zip(sizes, probabilities))
    if expected > MAX_MIXTURE_ROWS:
        shares = ", ".join(f"{n} rows at share {p:.3g}" for n, p in zip(sizes, probabilities))
        raise DataError(f"--mix_strategy all_exhausted: to use every row of every source ({shares}) the mixture would "
                        f"draw about {expected:,.0f} rows (more than {MAX_MIXTURE_ROWS:,}). Give the small shares "
                        "larger weights (e.g. proportional to the rows), or use --mix_strategy first_exhausted.")
    chunk = int(expected * 1.25) + 64
    draws = rng.choice(len(sizes), size=chunk, p=probabilities)
    while any(int((draws == i).sum()) < n for i, n in enumerate(sizes)):
        draws = np.concatenate([draws, rng.choice(len(sizes), size=chunk, p=probabilities)])
    stop = max(int(np.flatnonzero(draws == i)[n - 1]) for i, n in enumerate(sizes)) + 1
    return stop, draws


# -- resuming a mixed run ----------------------------------------------------------------------------------------------
def mixture_settings(data) -> Optional[dict]:
    """What decides the mixture of a :class:`~.training_data.TrainingData` besides its rows: ``{"mix_strategy"
    (resolved), "mix_strategy_option" (as given), "weights" (normalised; None for concat), "seed", "sources"}``;
    ``None`` for one training source (nothing is mixed)."""
    sources = data.train_sources
    if len(sources) < 2:
        return None
    weighted = data.strategy != "concat"
    return {"mix_strategy": data.strategy, "mix_strategy_option": data.strategy_option, "seed": data.seed,
            "weights": [round(s.weight, 6) for s in sources] if weighted else None,
            "sources": [s.label for s in sources]}


@functools.lru_cache(maxsize=None)
def _record_class():
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class MixtureRecord(TrainerCallback, ExportableState):
        """Does nothing during training; the Trainer writes its :meth:`state` into every checkpoint."""

        def __init__(self, settings: Optional[dict] = None) -> None:
            self.settings = settings

        def state(self) -> dict:
            return {"args": {"settings": self.settings}, "attributes": {}}

    return MixtureRecord  # named as MIXTURE_RECORD: the Trainer keys its state by the class name


def mixture_record_callback(settings: dict):
    """A ``TrainerCallback`` (``ExportableState``) that has the Trainer write ``settings`` (:func:`mixture_settings`)
    into every checkpoint's ``trainer_state.json``, inside the checkpoint as it is saved: read back on resume by
    :func:`check_resumed_mixture`."""
    return _record_class()(settings)


def _weights(weights: Optional[list]) -> str:
    return "none (concat)" if weights is None else ", ".join(f"{w:g}" for w in weights)


def check_resumed_mixture(checkpoint: Optional[str], settings: Optional[dict]) -> None:
    """Refuse resuming ``checkpoint`` with another mixture than the one it trained on (``settings``:
    :func:`mixture_settings` of this run): another ``--mix_strategy``, other ``--train_file`` weights, another
    ``--seed``, or one source where it mixed several. Every difference is named at once, with this run's value and the
    checkpoint's. A checkpoint without a record (one source, or written before the record existed) passes.

    Raises:
        UsageError: naming each option, this run's value and the checkpoint's.
    """
    if not checkpoint:
        return
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as f:
            entry = (json.load(f).get("stateful_callbacks") or {}).get(MIXTURE_RECORD)
    except (OSError, ValueError):  # no state to compare: the Trainer's own resume says what is wrong
        return
    stored = ((entry or {}).get("args") or {}).get("settings") if isinstance(entry, dict) else None
    if not isinstance(stored, dict):
        return
    fix = "Resume with the checkpoint's values, or start a new run in another --output_dir."
    if settings is None:
        raise UsageError(f"--resume_from_checkpoint={checkpoint} was trained on a mixture of {len(stored['sources'])} "
                         f"sources ({', '.join(stored['sources'])}), but this run reads one training source: it would "
                         f"continue on other rows. {fix}")
    changed = []
    if settings["mix_strategy"] != stored.get("mix_strategy"):
        given = settings["mix_strategy_option"]
        resolved = "" if given == settings["mix_strategy"] else f"{settings['mix_strategy']}; "
        changed.append(f"--mix_strategy={given} ({resolved}the checkpoint has {stored.get('mix_strategy')})")
    if len(settings["sources"]) != len(stored.get("sources") or ()):
        changed.append(f"--train_file with {len(settings['sources'])} sources (the checkpoint has "
                       f"{len(stored.get('sources') or ())}: {', '.join(stored.get('sources') or ())})")
    elif None not in (settings["weights"], stored.get("weights")) and settings["weights"] != stored["weights"]:
        changed.append(f"--train_file weights {_weights(settings['weights'])} (the checkpoint has "
                       f"{_weights(stored.get('weights'))})")
    if settings["seed"] != stored.get("seed"):
        changed.append(f"--seed={settings['seed']} (the checkpoint's mixture was drawn with {stored.get('seed')})")
    if changed:
        raise UsageError(f"--resume_from_checkpoint={checkpoint}: this run would rebuild another mixture than the one "
                         f"it continues: {'; '.join(changed)}. {fix}")
