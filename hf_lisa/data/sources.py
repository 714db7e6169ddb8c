"""Where training rows come from: files, folders of them, dataset ids with a config and a split, and several sources
mixed by weight.

* **A source spec** is ``--train_file``'s value: one path, or ``path[:weight]`` entries separated by commas
  (``'a.jsonl:0.7,b.jsonl:0.3'``), or, in a config file, a YAML list of paths or ``{path, weight}`` mappings
  (:func:`parse_sources`). A weight is read after an entry's *last* ``:`` and only when it reads as a number, so a
  path may itself hold ``:`` (``C:\\data\\a.jsonl``); a missing weight is 1; weights are normalised to sum to 1. A path
  that holds ``,`` goes in the YAML list.
* **A folder** holds files of one format, read in name order; hidden files are ignored (:func:`folder_files`).
* **A dataset** (``--dataset_name``): a Hub id or a local dataset folder, as ``datasets.load_dataset`` reads it, with
  ``--dataset_config`` and ``--dataset_split`` (:func:`load_named_dataset`).
* **Mixing** (``--mix_strategy``): ``concat``, ``first_exhausted`` or ``all_exhausted``, in :mod:`.mixing`
  (:func:`mixture_order`, :func:`resolve_mix_strategy`, re-exported here).

:mod:`.training_data` puts these together for ``hf-lisa train``: each source loaded, checked and tokenised on its own,
then mixed.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import UsageError
from .mixing import (
    MIX_STRATEGIES,
    MIX_STRATEGY_ALIASES,
    MIXTURE_RULE,
    mixture_order,
    resolve_mix_strategy,
)
from .validation import DataError, add_locations

logger = logging.getLogger(__name__)

EXTENSION_TO_BUILDER = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
VALIDATION_SPLITS = ("validation", "test")  # a dataset's own held-out split, in order of preference
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?|[+-]?(?:nan|inf|infinity)", re.IGNORECASE)
_ALLOWED = ", ".join(EXTENSION_TO_BUILDER)
_HELD_OUT_NAMES = {"test", "validation", "valid", "val", "dev", "eval"}  # file names of a dataset's held-out splits

__all__ = ["EXTENSION_TO_BUILDER", "MIXTURE_RULE", "MIX_STRATEGIES", "MIX_STRATEGY_ALIASES", "SourceSpec",
           "builder_for", "folder_files", "load_named_dataset", "mixture_order", "normalised_weights", "parse_sources",
           "resolve_mix_strategy"]


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``--train_file``: a file or folder and its weight (before normalisation)."""

    path: str
    weight: float = 1.0
    option: str = "train_file"
    weighted: bool = False  # the entry gave a weight (``--mix_strategy auto`` then interleaves)

    @property
    def label(self) -> str:
        """How messages name it: ``"train_file='data/a.jsonl'"``."""
        return f"{self.option}={self.path!r}"


# -- specs -------------------------------------------------------------------------------------------------------------
def _weight_of(value: Any, path: str, option: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"--{option}: the weight of {path!r} is {value!r}; allowed: a number > 0.")
    try:
        weight = float(value)
    except ValueError:
        raise UsageError(f"--{option}: the weight of {path!r} is {value!r}; allowed: a number > 0.") from None
    if not (math.isfinite(weight) and weight > 0):
        raise UsageError(
            f"--{option}: the weight of {path!r} is {value!r}; allowed: a finite number > 0 (weights are normalised to "
            "sum to 1)."
        )
    return weight


def _split_entry(entry: str, option: str) -> SourceSpec:
    """``"a.jsonl:0.7"`` -> ``SourceSpec("a.jsonl", 0.7)``; the weight only after the last ``:``, only a number, and
    not when the whole entry names an existing file or folder."""
    entry = entry.strip()
    head, sep, tail = entry.rpartition(":")
    if sep and _NUMBER.fullmatch(tail.strip()) and not os.path.exists(entry):
        if not head.strip():
            raise UsageError(f"--{option}: the entry {entry!r} has a weight but no path.")
        return SourceSpec(head.strip(), _weight_of(tail.strip(), head.strip(), option), option, weighted=True)
    return SourceSpec(entry, 1.0, option)


def _entries(value: Any, option: str) -> list[SourceSpec]:
    if isinstance(value, str):
        return [_split_entry(entry, option) for entry in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"--{option}={value!r} is invalid; allowed: a path, 'a.jsonl:0.7,b.jsonl:0.3', or (in a "
                         "config file) a list of paths or {path, weight} mappings.")
    specs = []
    for i, item in enumerate(value, 1):
        if isinstance(item, str):
            specs.append(_split_entry(item, option))
        elif isinstance(item, dict):
            unknown = sorted(set(item) - {"path", "weight"})
            if unknown or not isinstance(item.get("path"), str):
                problem = f"has the key(s) {unknown}" if unknown else "has no 'path' string"
                raise UsageError(f"--{option}: entry {i} ({item!r}) {problem}; allowed keys: path (a string), weight "
                                 "(a number > 0, default 1).")
            path = item["path"].strip()
            specs.append(SourceSpec(path, _weight_of(item.get("weight", 1.0), path, option), option,
                                    weighted="weight" in item))
        else:
            raise UsageError(f"--{option}: entry {i} is {item!r}; allowed: a path or a mapping {{path, weight}}.")
    return specs


def parse_sources(value: Any, option: str = "train_file") -> list[SourceSpec]:
    """The sources of ``--train_file``: a path, ``'a.jsonl:0.7,b.jsonl:0.3'``, or a list of paths / ``{path,
    weight}`` mappings (a config file's YAML list). Reads no file: :func:`check_source_paths` looks at them.

    Example:
        ```py
        >>> [(s.path, s.weight) for s in parse_sources("a.jsonl:0.7,b.jsonl:0.3")]
        [('a.jsonl', 0.7), ('b.jsonl', 0.3)]
        >>> [(s.path, s.weight) for s in parse_sources([{"path": "a.jsonl"}, "b.jsonl:3"])]
        [('a.jsonl', 1.0), ('b.jsonl', 3.0)]
        ```

    Raises:
        UsageError: an empty entry, a weight that is not a finite number > 0 (zero, negative, NaN), an entry of
            the wrong shape, or a source named twice; each names the option and the entry.
    """
    specs = _entries(value, option)
    if not specs:
        raise UsageError(f"--{option} is an empty list; allowed: at least one path.")
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs, 1):
        if not spec.path:
            raise UsageError(f"--{option}={value!r} has an empty entry ({i}); allowed: 'a.jsonl:0.7,b.jsonl:0.3'.")
        key = os.path.normcase(os.path.realpath(spec.path))
        if key in seen:
            raise UsageError(
                f"--{option} names {spec.path!r} twice (entries {seen[key]} and {i}); give each source once, with its "
                "whole weight."
            )
        seen[key] = i
    _check_weight_sum(specs, option)
    return specs


def _check_weight_sum(specs: Sequence[SourceSpec], option: str) -> None:
    """Weights that cannot be normalised in float64: a sum beyond the largest float (``1e308,1e308``), or a source
    whose share rounds to 0 (``1e300,1e-300``), which the mixture would never draw."""
    if len(specs) < 2:
        return
    weights = ", ".join(f"{spec.path}:{spec.weight:g}" for spec in specs)
    total = sum(spec.weight for spec in specs)
    if not math.isfinite(total):
        raise UsageError(f"--{option}: the weights ({weights}) add up to more than the largest number (they overflow "
                         "to inf); give smaller numbers with the same ratios, e.g. 0.7 and 0.3 (weights are "
                         "normalised to sum to 1).")
    never = [spec.path for spec in specs if not spec.weight / total > 0]
    if never:
        raise UsageError(f"--{option}: the weights ({weights}) give {', '.join(map(repr, never))} a share that rounds "
                         "to 0, so no row of it would be drawn; give weights of comparable size, e.g. 0.7 and 0.3.")


def check_source_arguments(data_args) -> None:
    """``--train_file`` (:func:`parse_sources`), ``--mix_strategy`` (:func:`resolve_mix_strategy`),
    ``--validation_file`` and ``--dataset_name`` / ``--dataset_config`` / ``--dataset_split`` together, before anything
    is read (files are looked at when they load).

    Raises:
        UsageError: naming the option, the value and what is allowed.
    """
    specs = parse_sources(data_args.train_file) if data_args.train_file is not None else []
    resolve_mix_strategy(getattr(data_args, "mix_strategy", "auto"), specs)
    for name in ("validation_file", "dataset_name", "dataset_config_name", "dataset_split"):
        value = getattr(data_args, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            flag = "dataset_config" if name == "dataset_config_name" else name
            raise UsageError(f"--{flag}={value!r} is invalid; allowed: one {'name' if 'dataset' in name else 'path'} "
                             "(a non-empty string).")
    validation = data_args.validation_file
    check_distinct_files(specs, SourceSpec(validation, option="validation_file") if validation else None)
    if data_args.dataset_name is not None:
        refuse_model_folder(data_args.dataset_name)
    if data_args.dataset_name is not None and data_args.train_file is not None:
        raise UsageError(
            f"--dataset_name={data_args.dataset_name!r} and --train_file={data_args.train_file!r} both name the "
            "training data; pass one (several local sources mix with --train_file 'a.jsonl:0.7,b.jsonl:0.3')."
        )
    if data_args.dataset_name is None:
        if data_args.dataset_config_name is not None:
            raise UsageError(f"--dataset_config={data_args.dataset_config_name!r} needs --dataset_name (the dataset "
                             "it configures).")
        if data_args.dataset_split != "train":
            raise UsageError(f"--dataset_split={data_args.dataset_split!r} needs --dataset_name (the dataset whose "
                             "split trains); local files train on every row (--validation_file or "
                             "--validation_split_percentage choose the validation rows).")


def normalised_weights(specs: Sequence[SourceSpec]) -> list[float]:
    """The weights of ``specs`` divided by their sum."""
    total = sum(spec.weight for spec in specs)
    return [spec.weight / total for spec in specs]


# -- files and folders -------------------------------------------------------------------------------------------------
def builder_for(path: str, option: str) -> str:
    """The ``datasets`` builder (``json``, ``csv``, ``parquet``, ``text``) that reads the file ``path``.

    Raises:
        FileNotFoundError, DataError: a missing or empty file, a folder, or an unsupported extension, naming
            ``option`` and ``path``.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{option}={path!r} does not exist.")
    if os.path.isdir(path):
        raise DataError(f"{option}={path!r} is a directory; pass a file ({_ALLOWED}).")
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSION_TO_BUILDER:
        raise DataError(f"{option}={path!r} has the unsupported extension {ext!r}; allowed: {_ALLOWED}.")
    if os.path.getsize(path) == 0:
        raise DataError(f"{option}={path!r} is empty.")
    return EXTENSION_TO_BUILDER[ext]


def folder_files(path: str, option: str) -> list[str]:
    """The data files of the folder ``path``, sorted by name: every file of one format (``.json`` and ``.jsonl``
    are one), hidden files (a leading ``.``) left out. Sub-folders are not read (a warning names them).

    Raises:
        DataError: a folder without data files, a file of an unsupported type, or files of several formats; each
            names the option, the folder and the files.
    """
    names = sorted(name for name in os.listdir(path) if not name.startswith("."))
    folders = [name for name in names if os.path.isdir(os.path.join(path, name))]
    if folders:
        logger.warning("%s=%r: its sub-folders are not read: %s.", option, path, ", ".join(folders))
    files = [name for name in names if name not in folders]
    if not files:
        raise DataError(f"{option}={path!r} is a folder without data files; allowed: {_ALLOWED} files (hidden files "
                        "are ignored).")
    unsupported = [name for name in files if os.path.splitext(name)[1].lower() not in EXTENSION_TO_BUILDER]
    if unsupported:
        raise DataError(
            f"{option}={path!r} holds files of an unsupported type: {', '.join(unsupported[:5])}"
            f"{', ...' if len(unsupported) > 5 else ''}; allowed: {_ALLOWED}. Move them out of the folder (or hide "
            "them with a leading '.'); a dataset folder with a README goes to --dataset_name."
        )
    by_builder: dict[str, list[str]] = {}
    for name in files:
        by_builder.setdefault(EXTENSION_TO_BUILDER[os.path.splitext(name)[1].lower()], []).append(name)
    if len(by_builder) > 1:
        kinds = "; ".join(f"{builder}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                          for builder, names in by_builder.items())
        raise DataError(f"{option}={path!r} mixes file formats ({kinds}); a folder holds files of one format. Give "
                        f"each format its own folder and mix them: --{option} 'a/:1,b/:1'.")
    held = [name for name in files if re.split(r"[-_.]", name.lower(), maxsplit=1)[0] in _HELD_OUT_NAMES]
    if held and option == "train_file":  # a dataset folder passed as a folder of files: its test split would train
        logger.warning("%s=%r: every file of a folder trains, %s included; to use them as a dataset's splits, pass "
                       "the folder as --dataset_name.", option, path, ", ".join(held))
    return [os.path.join(path, name) for name in files]


def _files_read(spec: SourceSpec) -> dict[tuple[int, int], str]:
    """The files ``spec`` reads (a file, or a folder's files as :func:`folder_files` lists them), by identity: device
    and inode, so a hard link, a symbolic link or another spelling of a path is the same file. Missing paths: none."""
    try:
        if os.path.isdir(spec.path):
            paths = [os.path.join(spec.path, n) for n in sorted(os.listdir(spec.path)) if not n.startswith(".")]
        else:
            paths = [spec.path]
        found = {}
        for path in paths:
            if os.path.isfile(path):
                info = os.stat(path)
                found.setdefault((info.st_dev, info.st_ino), path)
        return found
    except OSError:
        return {}


def _same_file(a: SourceSpec, path_a: str, b: SourceSpec, path_b: str) -> str:
    """Why ``a`` and ``b`` read one file, in words."""
    def where(spec, path):
        return repr(path) if path == spec.path else f"{path!r} (in the folder {spec.path!r})"

    folders = [spec.path for spec, path in ((a, path_a), (b, path_b)) if path != spec.path]
    if os.path.normpath(path_a) == os.path.normpath(path_b):
        return (f"the folder {folders[0]!r} holds {path_a!r}" if len(folders) == 1 else f"both read {path_a!r}")
    how = ("a symbolic link or another spelling of its path" if os.path.realpath(path_a) == os.path.realpath(path_b)
           else "hard links: the same device and inode")
    return f"{where(a, path_a)} and {where(b, path_b)} are one file ({how})"


def check_distinct_files(specs: Sequence[SourceSpec], validation: SourceSpec | None = None) -> None:
    """No file is read twice: by two ``--train_file`` entries (a file and a hard link to it, a folder and a file in
    it), or as training and validation data (``--validation_file`` the training file, or a file of a training folder).
    Files are compared by identity (device and inode), not by name. Paths that do not exist pass (they are named when
    the sources are read).

    Raises:
        UsageError: naming both entries and the file they share.
    """
    read = [(spec, _files_read(spec)) for spec in specs]
    for i, (a, files_a) in enumerate(read):
        for j, (b, files_b) in enumerate(read[i + 1:], i + 2):
            shared = sorted(set(files_a) & set(files_b))
            if shared:
                why = _same_file(a, files_a[shared[0]], b, files_b[shared[0]])
                raise UsageError(f"--{a.option} names one file twice: entries {i + 1} ({a.path!r}) and {j} "
                                 f"({b.path!r}): {why}, so its rows would train twice. Give each file once (its "
                                 "weight says how much it counts).")
    if validation is None:
        return
    files_v = _files_read(validation)
    for spec, files in read:
        shared = sorted(set(files) & set(files_v))
        if shared:
            why = _same_file(spec, files[shared[0]], validation, files_v[shared[0]])
            raise UsageError(f"--validation_file={validation.path!r} is training data of --{spec.option} "
                             f"({spec.path!r}): {why}, so the run would be evaluated on the rows it trains on. Pass a "
                             "file of other rows, or leave --validation_file out to hold out "
                             "--validation_split_percentage of the training rows.")


def check_source_paths(specs: Sequence[SourceSpec], validation: SourceSpec | None = None) -> None:
    """Every file exists and is supported, every folder holds files of one format, no file is read twice
    (:func:`check_distinct_files`): before anything is read."""
    check_distinct_files(specs, validation)
    for spec in [*specs, *([validation] if validation else [])]:
        if os.path.isdir(spec.path):
            for path in folder_files(spec.path, spec.option):
                builder_for(path, spec.option)
        else:
            if not os.path.exists(spec.path) and ":" in spec.path:
                raise FileNotFoundError(f"{spec.label} does not exist (a weight goes after the last ':' and must be a "
                                        "number, e.g. 'a.jsonl:0.7').")
            builder_for(spec.path, spec.option)


# -- datasets by name --------------------------------------------------------------------------------------------------
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json")


def refuse_model_folder(name: str, option: str = "dataset_name") -> None:
    """A local folder passed as a dataset that holds a model (``config.json`` with weights, an adapter, a tokenizer)
    and no data files: a ``UsageError`` saying which option takes it (``datasets`` would fail on its JSON files)."""
    if not isinstance(name, str) or not os.path.isdir(name):
        return
    try:
        names = set(os.listdir(name))
    except OSError:
        return
    found = [f for f in _MODEL_FILES if f in names]
    weights = {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors"}
    model = (weights & names or any(n.endswith(".safetensors") for n in names)) and (
        "config.json" in names or "adapter_config.json" in names)
    if model:
        raise UsageError(f"--{option}={name!r} is a model folder ({', '.join(found)}), not a dataset; pass it as "
                         "--model_name_or_path, and the training data with --train_file (files or a folder of them) "
                         "or --dataset_name (a Hub id or a dataset folder).")


def load_named_dataset(name: str, config: str | None = None, split: str = "train", cache_dir: str | None = None,
                       line_numbers: bool = False):
    """A Hub dataset id or a local dataset folder (of data files, as ``datasets.load_dataset`` reads it, or written by
    ``save_to_disk``) as a ``DatasetDict``: ``train`` is its split ``split``;
    ``validation`` its ``validation`` split, else its ``test`` split, when it has one (other than ``split``).

    ``line_numbers`` adds ``LINE_COLUMN`` (each row's number, named ``dataset_name='x' (train split), row``).

    Raises:
        DataError: the dataset cannot be loaded (offline, unknown id or config: ``datasets``' reason, and what to
            check), ``split`` is not one of its splits (they are listed), or a split is empty.
    """
    import datasets

    label = f"dataset_name={name!r}" + (f" (dataset_config={config!r})" if config else "")
    refuse_model_folder(name)
    local = os.path.isdir(name)
    if not local and (name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name):  # no Hub id
        raise FileNotFoundError(f"{label} does not exist: no such folder, and not a Hub id ('namespace/name').")
    saved = local and any(os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json"))
    if saved and config:
        raise DataError(f"{label}: a folder written by save_to_disk has no configurations; drop --dataset_config.")
    try:
        loaded = datasets.load_from_disk(name) if saved else datasets.load_dataset(name, config, cache_dir=cache_dir)
    except Exception as err:  # offline, unknown id or config, unreadable files: several exception types
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = ("Check the folder's files and --dataset_config." if local else
                "A Hub id needs network access (or the dataset in the datasets cache, with HF_HUB_OFFLINE=1); a local "
                "dataset folder must exist; a local file goes to --train_file.")
        raise DataError(f"Could not load {label}: {type(err).__name__}: {reason} {hint}") from err
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({"train": loaded})
    if split not in loaded:
        raise DataError(f"dataset_split={split!r} is not a split of {label}; its splits: {', '.join(loaded)}.")
    chosen = {"train": split}
    held = next((s for s in VALIDATION_SPLITS if s in loaded and s != split), None)
    if held:
        chosen["validation"] = held
    for role, original in chosen.items():
        if len(loaded[original]) == 0:
            raise DataError(f"{label} has no rows in its {original} split.")
    return datasets.DatasetDict({
        role: add_locations(loaded[original], f"{label} ({original} split)", "row") if line_numbers
        else loaded[original]
        for role, original in chosen.items()
    })
