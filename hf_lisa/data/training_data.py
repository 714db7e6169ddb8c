"""The training data of one ``hf-lisa train`` run: every source loaded, checked and tokenised on its own, then the train
splits mixed by weight and the validation splits put together.

A *source* is one entry of ``--train_file`` (a file or a folder) or ``--dataset_name``; a folder's files stay apart
(*parts*) until they are tokenised, so that every message and skip table names the file and line of a row. Per source:

* **validation rows**: ``--validation_file`` (a file or folder: the validation set of the whole run), else the
  dataset's ``validation``/``test`` split, else ``--validation_split_percentage`` of the source's rows (seeded; of a
  folder's rows as a whole);
* ``--max_train_samples N`` keeps the first N training rows of each source, then the first N rows of the mixture;
  ``--max_eval_samples N`` keeps the first N validation rows of each source;
* the format is detected (or checked against ``--data_format``) per source: a mixture may join a prompt/completion
  file and a chat folder; the files of one folder share one format.

Several sources are mixed by :func:`.mixing.mixture_order` (``--mix_strategy``, seeded by ``--seed``) into one
``Dataset``: the Trainer's sampler and its resume see a fixed list of rows, so a resumed run trains on exactly the rows
of the uninterrupted one.

Example:
    ```py
    >>> from hf_lisa.data.training_data import load_training_data
    >>> data = load_training_data(train_file="a.jsonl:0.7,b.jsonl:0.3", seed=42)  # doctest: +SKIP
    >>> data.check(lambda raw: check_data(raw, 512))  # doctest: +SKIP
    >>> tokenized, report = data.tokenize(lambda raw: tokenize_datasets(raw, tokenizer, 512))  # doctest: +SKIP
    ```
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .mixing import MIXTURE_RULE, resolve_mix_strategy
from .sources import (
    SourceSpec,
    check_source_paths,
    folder_files,
    mixture_order,
    normalised_weights,
    parse_sources,
)
from .validation import FORMAT_TITLES, DataError

logger = logging.getLogger(__name__)

__all__ = ["Source", "TrainingData", "load_training_data"]

#: fewer rows held out for evaluation than this is warned about (its eval loss is noise)
TINY_VALIDATION = 10
#: the fields of ``DataArguments`` that :func:`load_training_data` reads
OPTIONS = ("train_file", "validation_file", "dataset_name", "dataset_config_name", "dataset_split",
           "validation_split_percentage", "max_train_samples", "max_eval_samples", "mix_strategy")


@dataclass
class Source:
    """One source of rows: ``parts`` (one ``{"train"?, "validation"?}`` dict of datasets per file), its normalised
    ``weight`` in the mixture (``None``: validation rows only) and what checking and tokenising found."""

    label: str
    weight: Optional[float]
    parts: list[dict] = field(default_factory=list)
    path: Optional[str] = None  # the file or folder of a --train_file entry
    held_out: int = 0  # validation rows split off its own training rows
    data_format: Optional[str] = None
    report: Any = None  # the TokenizationReport of all its parts
    tokenized: dict = field(default_factory=dict)


def _cap(parts: list[dict], split: str, limit: Optional[int]) -> list[dict]:
    """The first ``limit`` rows of ``split`` across ``parts`` (in order); parts left without rows are dropped."""
    if not limit:
        return parts
    kept, left = [], limit
    for part in parts:
        if split in part:
            n = min(left, len(part[split]))
            part = {**part, split: part[split].select(range(n))} if n < len(part[split]) else part
            left -= n
            if n == 0:
                part = {k: v for k, v in part.items() if k != split}
        if part:
            kept.append(part)
    return kept


def _hold_out(datasets_: list, percentage: float, seed: int, label: str) -> tuple[list[dict], int]:
    """``percentage`` % of the rows of a folder's files, at random (seeded), as their ``validation`` parts."""
    import numpy as np

    total = sum(len(ds) for ds in datasets_)
    if total < 2:
        raise DataError(f"{label} has {total} row; a validation split needs at least 2. Pass validation_file or "
                        "validation_split_percentage=0.")
    n_test = min(total - 1, math.ceil(total * percentage / 100))  # rounded up, as datasets' train_test_split
    test = np.zeros(total, dtype=bool)
    test[np.random.default_rng(seed % 2**64).permutation(total)[:n_test]] = True
    parts, offset = [], 0
    for ds in datasets_:
        mine = test[offset: offset + len(ds)]
        offset += len(ds)
        part = {"train": ds.select(np.flatnonzero(~mine)), "validation": ds.select(np.flatnonzero(mine))}
        parts.append({split: rows for split, rows in part.items() if len(rows)})
    return parts, n_test


def _folder_parts(spec: SourceSpec, split: str, cache_dir: Optional[str]) -> list[dict]:
    """One part per file of the folder (or the file) ``spec``, its rows under ``split``."""
    from .pipeline import load_file

    files = folder_files(spec.path, spec.option) if os.path.isdir(spec.path) else [spec.path]
    return [{split: load_file(path, spec.option, cache_dir, line_numbers=True)} for path in files]


def _held_out_of(raw) -> int:
    """The rows of ``raw["validation"]`` split off its train rows (both read from one place), else 0."""
    from .validation import source_of

    held = "validation" in raw and source_of(raw["validation"]) == source_of(raw["train"])
    return len(raw["validation"]) if held else 0


def load_training_data(data_args=None, *, seed: int = 42, cache_dir: Optional[str] = None, **options) -> TrainingData:
    """Load every source of a run, hold out validation rows and apply ``max_train_samples``/``max_eval_samples``;
    nothing is tokenised yet. ``data_args`` is a :class:`~hf_lisa.train.DataArguments` (``options``, its fields by
    name, override it); files are checked line by line as they are read (:func:`.data.load_file`).

    Raises:
        FileNotFoundError, DataError, UsageError: a missing, empty or unsupported file, a folder that is empty or mixes
            file formats, a dataset or split that cannot be loaded, a bad source spec; each names the option and path.
    """
    from .pipeline import load_raw_datasets

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"load_training_data() got unknown option(s) {unknown}; allowed: {', '.join(OPTIONS)}.")

    def get(name, default=None):
        return options[name] if name in options else getattr(data_args, name, default)

    train_file, validation_file, dataset_name = get("train_file"), get("validation_file"), get("dataset_name")
    percentage = get("validation_split_percentage", 5.0)
    if dataset_name is not None and train_file is not None:
        raise DataError("Pass either dataset_name or train_file, not both.")
    if dataset_name is not None:
        raw = load_raw_datasets(dataset_name=dataset_name, dataset_config_name=get("dataset_config_name"),
                                dataset_split=get("dataset_split", "train"), validation_split_percentage=percentage,
                                seed=seed, cache_dir=cache_dir, line_numbers=True)
        sources = [Source(f"dataset_name={dataset_name!r}", 1.0, [dict(raw)], held_out=_held_out_of(raw))]
        strategy = resolve_mix_strategy(get("mix_strategy", "auto"), [])
    elif train_file is not None:
        specs = parse_sources(train_file)
        strategy = resolve_mix_strategy(get("mix_strategy", "auto"), specs)
        validation = SourceSpec(validation_file, option="validation_file") if validation_file is not None else None
        check_source_paths(specs, validation)  # every path, no file twice, before any file is read
        # one training file with its validation file: read as a pair, checked against each other (as ever)
        pair = validation and len(specs) == 1 and not any(os.path.isdir(s.path) for s in (specs[0], validation))
        sources = []
        for spec, weight in zip(specs, normalised_weights(specs)):
            if os.path.isdir(spec.path):
                parts, held = _folder_parts(spec, "train", cache_dir), 0
                if validation is None and percentage > 0:
                    parts, held = _hold_out([part["train"] for part in parts], percentage, seed, spec.label)
            else:
                raw = load_raw_datasets(train_file=spec.path, validation_file=validation_file if pair else None,
                                        validation_split_percentage=0 if validation else percentage, seed=seed,
                                        cache_dir=cache_dir, line_numbers=True)
                parts, held = [dict(raw)], _held_out_of(raw)
            sources.append(Source(spec.label, weight, parts, held_out=held, path=spec.path))
        if validation and not pair:
            parts = _folder_parts(validation, "validation", cache_dir)
            if len(sources) == 1:
                sources[0].parts += parts  # the source's own validation rows, in its format
            else:  # the validation set of a mixture: its own format
                sources.append(Source(validation.label, None, parts))
    else:
        raise DataError("No training data: pass train_file (jsonl/json/csv/parquet/txt, or a folder) or dataset_name.")
    if validation_file is not None:
        _warn_shared_rows(sources, validation)
    for source in sources:
        if 0 < source.held_out < TINY_VALIDATION:
            logger.warning("%s: only %d row%s held out for evaluation (%g%% of its rows); an evaluation on so few rows "
                           "says little. Pass --validation_file, or raise --validation_split_percentage.",
                           source.label, source.held_out, "" if source.held_out == 1 else "s", percentage)
    return TrainingData(sources, seed=seed, max_train_samples=get("max_train_samples"),
                        max_eval_samples=get("max_eval_samples"), strategy=strategy,
                        strategy_option=get("mix_strategy", "auto"))


def _row_keys(ds) -> list[int]:
    """One hash per row of ``ds``: its fields (not where it came from) as sorted JSON."""
    import json

    from .validation import LINE_COLUMN

    columns = [c for c in ds.column_names if c != LINE_COLUMN]
    keys = []
    for batch in ds.select_columns(columns).iter(batch_size=4096):
        for values in zip(*(batch[c] for c in columns)):
            keys.append(hash(json.dumps(dict(zip(columns, values)), sort_keys=True, default=str)))
    return keys


def _warn_shared_rows(sources: list[Source], validation: SourceSpec) -> None:
    """Warn when rows of ``--validation_file`` are training rows too (the same fields in another file): the
    evaluation then measures rows the run trained on. Counts, the files, and what to do."""
    trained = {key for source in sources for part in source.parts if "train" in part
               for key in _row_keys(part["train"])}
    rows = [key for source in sources for part in source.parts if "validation" in part
            and source.held_out == 0 for key in _row_keys(part["validation"])]
    shared = sum(key in trained for key in rows)
    if shared:
        logger.warning("%d of the %d rows of %s are training rows too (the same fields in %s): the evaluation measures "
                       "rows the run trains on. Remove them from one of the files.", shared, len(rows),
                       validation.label, ", ".join(s.label for s in sources if s.weight is not None))


def _tokenize_held_out(part: dict, tokenize: Callable[[Any], tuple], seed: int, label: str):
    """Tokenise a part whose validation rows were held out of its own training rows, holding out *after* skipping:
    its train and validation rows are tokenised as one split, and the held-out rows that were skipped (too long, bad)
    are replaced by kept training rows (seeded), so the evaluation keeps its size and a skipped row never stops the
    run. Nothing skipped: the same splits as tokenising each on its own. ``part``'s raw splits are updated to match
    (the generation metric's prompts come from them). ``(None, None)`` when ``tokenize`` reports no kept rows.

    Skipped rows are counted as training rows of the source (they were skipped before any row was held out)."""
    import datasets
    import numpy as np

    train, validation = part["train"], part["validation"]
    joined = datasets.concatenate_datasets([train, validation])
    tokenized, report = tokenize(datasets.DatasetDict({"train": joined}))
    if "train" not in report.kept_rows:
        return None, None
    kept = np.asarray(report.kept_rows["train"], dtype=np.int64)  # positions in joined, ascending
    from_train, from_validation = np.flatnonzero(kept < len(train)), np.flatnonzero(kept >= len(train))
    short = len(validation) - len(from_validation)
    moved = np.empty(0, dtype=np.int64)
    if short > 0:  # held-out rows were skipped: hold out kept training rows in their place (one stays to train)
        take = min(short, max(0, len(from_train) - 1))
        moved = np.sort(np.random.default_rng(seed % 2**64).choice(len(from_train), size=take, replace=False))
        logger.warning("%s: %d of the %d rows held out for evaluation were skipped; %d of its training rows are held "
                       "out in their place (the held-out rows are drawn from the rows kept).", label, short,
                       len(validation), take)
    train_idx = np.delete(from_train, moved) if len(moved) else range(len(from_train))
    validation_idx = np.concatenate([from_train[moved], from_validation]) if len(moved) else \
        range(len(from_train), len(kept))
    out = {"train": tokenized["train"].select(train_idx)}
    part["train"] = joined.select(kept[np.asarray(train_idx, dtype=np.int64)])
    if len(validation_idx):
        out["validation"] = tokenized["train"].select(validation_idx)
        part["validation"] = joined.select(kept[np.asarray(validation_idx, dtype=np.int64)])
    else:
        del part["validation"]
        logger.warning("%s: every row held out for evaluation was skipped and no training row is left to replace "
                       "them; it has no validation rows.", label)
    kept_counts = {split: len(ds) for split, ds in out.items()}
    return datasets.DatasetDict(out), dataclasses.replace(report, kept=kept_counts, kept_rows={})


def _as_train(part: dict) -> tuple[dict, dict]:
    """``part`` as the checks and tokenisation take it (a ``train`` split first), and the names to give back."""
    import datasets

    if "train" in part:
        return datasets.DatasetDict(part), {split: split for split in part}
    return datasets.DatasetDict({"train": part["validation"]}), {"train": "validation"}


def _renamed(report, names: dict):
    return dataclasses.replace(
        report, kept_rows={}, kept={names[s]: n for s, n in report.kept.items()},
        skipped={names[s]: n for s, n in report.skipped.items()},
        skipped_lines={names[s]: n for s, n in report.skipped_lines.items()},
    )


def _merged(reports: list, data_format: str):
    """One report for several: rows kept and skipped added up per split (and reason). The first lines of each reason
    are kept only for a single report: the lines of several files cannot be told apart (their logs name them)."""
    if len(reports) == 1:
        return dataclasses.replace(reports[0], data_format=data_format)
    kept, skipped = Counter(), {}
    for report in reports:
        kept.update(report.kept)
        for split, reasons in report.skipped.items():
            skipped.setdefault(split, Counter()).update(reasons)
    return dataclasses.replace(reports[0], data_format=data_format, kept=dict(kept),
                               skipped={split: dict(reasons) for split, reasons in skipped.items()}, skipped_lines={})


#: what each mixing rule does, for the log line of a mixture
_RULE_WORDS = {
    "concat": "every row of every source once, shuffled",
    "first_exhausted": "drawn by weight until the first source runs out",
    "all_exhausted": "drawn by weight until every source has given every row, re-using the rows of those that ran out",
}
#: a realised share is far from its weight when it differs by more than both of these (absolute, relative)
SHARE_TOLERANCE = (0.05, 0.2)


def mixture_warning(sources: list[Source], sizes: list[int], drawn: list[int]) -> str:
    """What a user must hear about a mixture of ``sources`` with ``sizes`` training rows, of which ``drawn`` were drawn
    (before ``--max_train_samples``), or ``""``: a realised share far from its weight (:data:`SHARE_TOLERANCE`), or
    most rows never drawn; with the numbers, the mixing rule and what to change."""
    total, used = sum(sizes), sum(drawn)
    shares = [n / max(1, used) for n in drawn]
    far = [i for i, source in enumerate(sources)
           if abs(shares[i] - source.weight) > max(SHARE_TOLERANCE[0], SHARE_TOLERANCE[1] * source.weight)]
    if not far and (total - used) * 2 <= total:
        return ""
    out = [source.label for source, n, size in zip(sources, drawn, sizes) if n == size]
    listed = ", ".join(f"{source.label} {share:.3f} (weight {source.weight:.3f}; {n} of its {size} rows)"
                       for source, share, n, size in zip(sources, shares, drawn, sizes))
    proportional = ",".join(f"{source.path or source.label}:{size}" for source, size in zip(sources, sizes))
    return (f"The mixture draws {used} of its {total} training rows ({total - used} unused), with the shares "
            f"{listed}. It stops when its first source runs out ({', '.join(out) or 'none'} did; mixing rule "
            f"{MIXTURE_RULE!r}). To use every row: --mix_strategy all_exhausted (draws by weight until every source "
            "has given every row, re-using the rows of the sources that run out), --mix_strategy concat with the "
            f"weights left out (every row once), weights proportional to the rows (--train_file '{proportional}'), "
            "or more rows to the source that runs out.")


class TrainingData:
    """The sources of a run (:func:`load_training_data`), then their checks (:meth:`check`), tokenisation and mixture
    (:meth:`tokenize`)."""

    def __init__(self, sources: list[Source], seed: int = 42, max_train_samples: Optional[int] = None,
                 max_eval_samples: Optional[int] = None, strategy: str = MIXTURE_RULE,
                 strategy_option: str = "auto") -> None:
        self.sources, self.seed, self.max_train_samples = sources, seed, max_train_samples
        self.strategy, self.strategy_option = strategy, strategy_option  # resolved, and as --mix_strategy gave it
        self.held_out = sum(source.held_out for source in sources)  # before --max_eval_samples: never trained on
        for source in sources:
            source.parts = _cap(_cap(source.parts, "train", max_train_samples), "validation", max_eval_samples)
        self.mixture: dict = {}  # filled by tokenize() for several sources

    @property
    def train_sources(self) -> list[Source]:
        return [source for source in self.sources if source.weight is not None]

    def check(self, check: Callable[[Any], str]) -> list[str]:
        """Run ``check`` (``raw DatasetDict -> data format``, e.g. :func:`.data.check_data`) on every part; the parts
        of one source must share a format. Returns each source's format.

        Raises:
            DataError: ``check``'s, or two files of one source (a folder, a training file and its validation file) in
                different formats, naming both.
        """
        for source in self.sources:
            first = None
            for part in source.parts:
                raw, _ = _as_train(part)
                fmt = check(raw)
                if first is None:
                    first, source.data_format = raw, fmt
                elif fmt != source.data_format:
                    from .validation import source_of

                    raise DataError(
                        f"{source_of(raw['train'])} is {FORMAT_TITLES.get(fmt, fmt)} data but "
                        f"{source_of(first['train'])} is {FORMAT_TITLES.get(source.data_format, source.data_format)} "
                        f"data; the files of {source.label} must have one format (mix sources of several formats "
                        "with --train_file 'a.jsonl:1,b/:1')."
                    )
        return [source.data_format for source in self.sources]

    def tokenize(self, tokenize: Callable[[Any], tuple]):
        """Tokenise every part on its own with ``tokenize`` (``raw DatasetDict -> (tokenized DatasetDict,
        TokenizationReport)``, e.g. :func:`.data.tokenize_datasets`), join each source's parts, mix the sources'
        train splits (:func:`.mixing.mixture_order`, ``--mix_strategy``) and put their validation splits one after
        another.

        Returns:
            ``(DatasetDict, TokenizationReport)``: the report's ``kept`` counts the rows trained and evaluated,
            ``skipped`` adds up every source's skips; each source's own report is ``source.report``, and
            ``self.mixture`` (for several sources) records the weights, rows and realised proportions.
        """
        import datasets

        for source in self.sources:
            reports, splits = [], {}
            for part in source.parts:
                held = source.held_out and "train" in part and "validation" in part
                tokenized, report = (_tokenize_held_out(part, tokenize, self.seed, source.label) if held
                                     else (None, None))
                names = {split: split for split in tokenized or ()}
                if tokenized is None:
                    raw, names = _as_train(part)
                    tokenized, report = tokenize(raw)
                    report = _renamed(report, names)
                reports.append(report)
                for split, ds in tokenized.items():
                    splits.setdefault(names[split], []).append(ds)
            source.data_format = source.data_format or reports[0].data_format
            source.report = _merged(reports, source.data_format)
            source.tokenized = {split: parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
                                for split, parts in splits.items()}
        out = {"train": self._mix()}
        validation = [s.tokenized["validation"] for s in self.sources if "validation" in s.tokenized]
        if validation:
            out["validation"] = validation[0] if len(validation) == 1 else datasets.concatenate_datasets(validation)
        formats = list(dict.fromkeys(source.data_format for source in self.sources))
        report = _merged([source.report for source in self.sources], "+".join(formats))
        report.kept = {split: len(ds) for split, ds in out.items()}
        return datasets.DatasetDict(out), report

    def _mix(self):
        """The training rows: the one source's, or the seeded mixture of several (first ``max_train_samples``)."""
        import datasets
        import numpy as np

        sources = self.train_sources
        if len(sources) == 1:
            return sources[0].tokenized["train"]
        trains = [source.tokenized["train"] for source in sources]
        sizes = [len(ds) for ds in trains]
        which, row = mixture_order(sizes, [source.weight for source in sources], self.seed, self.strategy)
        drawn, full = len(which), which
        if self.max_train_samples:
            which, row = which[: self.max_train_samples], row[: self.max_train_samples]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        mixed = datasets.concatenate_datasets(trains).select(offsets[which] + row)
        counts = np.bincount(which, minlength=len(sources))
        weighted = self.strategy != "concat"  # concat takes no weights: every row once
        self.mixture = {
            "strategy": self.strategy, "strategy_option": self.strategy_option, "seed": self.seed,
            "rows": len(mixed), "rows_drawn": drawn,
            "sources": [
                {"source": source.label, "weight": round(source.weight, 6) if weighted else None,
                 "format": source.data_format, "rows_kept": dict(source.report.kept),
                 "rows_skipped": dict(source.report.skipped), "rows_mixed": int(n),
                 "proportion": round(float(n) / max(1, len(mixed)), 6)}
                for source, n in zip(sources, counts)
            ],
        }
        width = max(len("source"), *(len(s["source"]) for s in self.mixture["sources"]))
        lines = [f"  {'source':<{width}}  {'weight':>6}  {'rows':>8}  {'mixed':>8}  {'share':>6}"] + [
            f"  {s['source']:<{width}}  {'-' if s['weight'] is None else format(s['weight'], '.3f'):>6}  "
            f"{s['rows_kept'].get('train', 0):>8,}  {s['rows_mixed']:>8,}  {s['proportion']:>6.3f}"
            for s in self.mixture["sources"]
        ]
        logger.info("Mixed %d sources into %d training rows (seed %d; --mix_strategy %s: %s%s):\n%s", len(sources),
                    len(mixed), self.seed, self.strategy, _RULE_WORDS[self.strategy],
                    f"; first {self.max_train_samples} kept" if len(mixed) < drawn else "", "\n".join(lines))
        if self.strategy == MIXTURE_RULE:
            warning = mixture_warning(sources, sizes, np.bincount(full, minlength=len(sources)).tolist())
            if warning:
                logger.warning(warning)
        return mixed

    def as_raw(self, reader: str):
        """The rows of the one source as one ``DatasetDict`` (``train``, ``validation``), for a ``reader`` that takes
        raw rows itself (``--stage dpo``: TRL tokenises them). A folder's files are joined, rows numbered across them.

        Raises:
            DataError: several sources (a mixture, or a mixture's validation set) or files that do not join.
        """
        import datasets

        from .validation import LINE_COLUMN, add_locations

        if len(self.sources) > 1:
            raise DataError(f"{reader} reads one source, got {len(self.sources)}: "
                            f"{', '.join(s.label for s in self.sources)}. Weighted mixtures train with --stage sft.")
        source = self.sources[0]
        if len(source.parts) == 1:
            return datasets.DatasetDict(source.parts[0])
        out = {}
        for split in ("train", "validation"):
            pieces = [part[split].remove_columns(LINE_COLUMN) for part in source.parts if split in part]
            if pieces:
                try:
                    joined = datasets.concatenate_datasets(pieces)
                except ValueError as err:  # columns of different types
                    raise DataError(f"The files of {source.label} do not join into one {split} split: {err}") from err
                out[split] = add_locations(joined, f"{source.label} ({split} rows of its files in name order)", "row")
        return datasets.DatasetDict(out)

    def validation_splits(self) -> list[tuple[Any, str]]:
        """``(raw validation rows, data format)`` of every part that has some (for generation samples)."""
        return [(part["validation"], source.data_format) for source in self.sources for part in source.parts
                if "validation" in part]

    def summary(self) -> dict:
        """What ``training_summary.json``'s ``data`` adds for a mixture: ``mixture`` (strategy, seed, rows, and per
        source its weight, format, rows kept and skipped, rows mixed, realised proportion) and a readable ``source``."""
        if not self.mixture:
            return {}
        parts = ", ".join(s["source"] if s["weight"] is None else f"{s['source']} ({s['weight']:.3g})"
                          for s in self.mixture["sources"])
        return {"source": f"mixture of {parts}", "mixture": self.mixture}
