"""Training data: loading local files or Hub datasets, detecting the row format and tokenising with loss masks.

Five row formats are recognised from the column names (or named with ``--data_format``):

* **prompt/completion** (``prompt`` and ``completion`` columns): the loss covers the completion only (by default).
  With a tokenizer that has a chat template, the prompt becomes a user turn and the completion the assistant's reply.
* **chat** (a ``messages`` column of ``{"role", "content"}`` lists): rendered with the tokenizer's chat template; the
  loss covers the assistant turns only (by default).
* **Alpaca** (``instruction``, ``output``, optional ``input``/``system``) and **ShareGPT** (``conversations`` of
  ``{"from", "value"}`` turns): converted to chat messages (Alpaca without a template: the Stanford Alpaca prompt and
  completion) by :mod:`.formats`, then tokenised as those.
* **plain text** (a ``text`` column): the loss covers every token.

``--chat_template`` may name a built-in template or a Jinja file (:mod:`.chat_templates`) that replaces the
tokenizer's.

Bad data, and what happens to it (also in ``docs/training.md``; the checks live in :mod:`.validation`):

* missing file, unsupported extension, empty file or split, a byte that is not UTF-8, a line that is not a JSON object,
  no recognised columns, a validation file in another format than the training file, a file that mixes row formats, a
  chat dataset with a tokenizer that has no chat template: a ``DataError``/``FileNotFoundError`` that names the file
  (and line), the column or the option;
* a row with a missing, empty or non-string field, a message without a known role or with non-string or empty content,
  a chat without an assistant turn: **skipped, counted and logged** (``on_bad_row="skip"``, the default: one table per
  split with the counts and first lines by reason), or an error naming the file and line (``on_bad_row="error"``);
* a row longer than ``max_seq_length``: skipped and counted (``overlength="skip"``, the default), truncated
  (``"truncate"``) or an error naming the row (``"error"``). A row with more characters than ``max_seq_length`` tokens
  of this tokenizer can hold is handled so without being tokenised;
* a chat row whose template rendering is not incremental: skipped and counted.

Example:
    ```py
    >>> from hf_lisa.data.pipeline import load_raw_datasets, tokenize_datasets
    >>> raw = load_raw_datasets(train_file="train.jsonl", validation_split_percentage=10)  # doctest: +SKIP
    >>> tokenized, report = tokenize_datasets(raw, tokenizer, max_seq_length=256)  # doctest: +SKIP
    ```
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from .chat_templates import CHAT_TEMPLATE_MODES, install_chat_template
from .formats import CHAT_FORMATS, CONVERTED_FORMATS, canonical_row, check_row
from .sources import EXTENSION_TO_BUILDER, builder_for, load_named_dataset  # noqa: F401 (EXTENSION_TO_BUILDER: API)
from .validation import (
    DATA_FORMATS,
    LINE_COLUMN,
    OVERLENGTH_POLICIES,
    Columns,
    DataError,
    add_locations,
    cap_row,
    check_data,
    data_columns,
    detect_format,
    location_of,
    row_texts,
    scan_file,
    skip_table,
    source_of,
    unit_of,
    with_locations,
)

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
TEMPLATE_ERROR = "chat template error"  # the skip reason of a row the chat template refused
SKIP_COLUMN = "_hf_lisa_skip"
SKIP_EXAMPLES = 5  # lines listed per skip reason

__all__ = [  # detect_format, check_data, Columns and the constants live in .validation; they are this module's API too
    "CHAT_TEMPLATE_MODES", "DATA_FORMATS", "IGNORE_INDEX", "LINE_COLUMN", "OVERLENGTH_POLICIES", "Columns",
    "DataError", "TokenizationReport", "check_data", "data_collator", "detect_format", "load_raw_datasets",
    "tokenize_datasets", "tokenize_row", "use_chat_template",
]


@dataclass
class TokenizationReport:
    """What tokenisation kept and skipped, per split: ``skipped`` counts rows by reason, ``skipped_lines`` lists the
    first lines (or rows) of each reason."""

    data_format: str
    kept: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped_lines: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    kept_rows: dict[str, Any] = field(default_factory=dict, repr=False)  # positions of the kept rows (int64 arrays)

    def total_skipped(self, split: str) -> int:
        return sum(self.skipped.get(split, {}).values())


# -- loading -----------------------------------------------------------------------------------------------------------
def load_file(path: str, option: str = "train_file", cache_dir: str | None = None, line_numbers: bool = False):
    """One local file as a ``Dataset``, checked line by line first (:func:`.validation.scan_file`); ``option`` is how
    messages name it (``train_file='d.jsonl'``)."""
    import datasets

    builder = builder_for(path, option)
    label = f"{option}={path!r}"
    lines = scan_file(path, label, builder)
    options = {"encoding": "utf-8-sig"} if builder == "text" else {}  # a BOM is not text to train on
    try:
        ds = datasets.load_dataset(builder, data_files={"train": path}, cache_dir=cache_dir, **options)["train"]
    except Exception as err:  # datasets wraps parser errors in several types; name the file instead
        raise DataError(f"Could not read {label} as {builder}: {type(err).__name__}: {err}") from err
    if len(ds) == 0:
        raise DataError(f"{label} has no rows.")
    return add_locations(ds, label, "line" if builder in ("json", "text") else "row", lines) if line_numbers else ds


def load_raw_datasets(
    train_file: str | None = None,
    validation_file: str | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    validation_split_percentage: float = 5.0,
    seed: int = 42,
    cache_dir: str | None = None,
    line_numbers: bool = False,
    dataset_split: str = "train",
):
    """Load a ``DatasetDict`` with a ``train`` and (when possible) a ``validation`` split.

    Local files go through ``datasets``' json/csv/parquet/text builders, each file on its own, after a line-by-line
    check of its encoding (and, for JSON, of every line). ``dataset_name`` is a Hub id (needs network) or a local
    dataset folder (:func:`.sources.load_named_dataset`): its ``dataset_split`` split trains, its ``validation`` (else
    ``test``) split validates. Without a validation file or split, ``validation_split_percentage`` percent of train is
    held out (seeded); 0 means no validation split. Folders of files and weighted mixtures: :mod:`.training_data`.

    ``line_numbers=True`` (``hf-lisa train``'s choice) adds the column ``LINE_COLUMN`` (``"_hf_lisa_line"``) to every
    split: the line (JSON Lines, text) or row (csv, parquet, Hub) each row came from, so that the messages of
    :func:`check_data` and :func:`tokenize_datasets` (which drops it) name the file and line of a row, also in a split
    held out of the training file. Without it they name the split and the row.

    Raises:
        FileNotFoundError, DataError: for a missing, empty, unreadable or unsupported file (naming the line for a byte
            that is not UTF-8 or a line that is not a JSON object), a dataset that cannot be loaded or has no such
            split, or for no data source at all.
    """
    import datasets

    if not 0 <= validation_split_percentage < 100:
        raise DataError(
            f"validation_split_percentage={validation_split_percentage!r} is invalid; allowed: a number in [0, 100)."
        )
    if dataset_name is not None:
        if train_file is not None:
            raise DataError("Pass either dataset_name or train_file, not both.")
        raw = load_named_dataset(dataset_name, dataset_config_name, dataset_split, cache_dir, line_numbers)
    elif train_file is not None:
        builder = builder_for(train_file, "train_file")
        files = {"train": ("train_file", train_file)}
        if validation_file is not None:
            if builder_for(validation_file, "validation_file") != builder:
                raise DataError(
                    f"train_file={train_file!r} and validation_file={validation_file!r} must have the same format."
                )
            files["validation"] = ("validation_file", validation_file)
        # one load per file: a validation file with other columns is reported by check_data, naming both files
        raw = datasets.DatasetDict(
            {split: load_file(path, option, cache_dir, line_numbers) for split, (option, path) in files.items()}
        )
    else:
        raise DataError("No training data: pass train_file (jsonl/json/csv/parquet/txt) or dataset_name.")

    if "validation" not in raw and validation_split_percentage > 0:
        if len(raw["train"]) < 2:
            raise DataError(
                f"The train split has {len(raw['train'])} row; a validation split needs at least 2. Pass "
                "validation_file or validation_split_percentage=0."
            )
        split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


# -- tokenisation ------------------------------------------------------------------------------------------------------
def use_chat_template(tokenizer, mode: str) -> bool:
    """Whether rows are rendered through a chat template: ``mode`` is ``--chat_template`` (``"auto"``: the tokenizer's,
    when it has one; ``"always"``: refuse a tokenizer without one; ``"never"``; or a built-in name or Jinja file, which
    replaces ``tokenizer.chat_template`` here, see :mod:`.chat_templates`)."""
    if install_chat_template(tokenizer, mode):
        return True
    has = getattr(tokenizer, "chat_template", None) is not None
    if mode == "always" and not has:
        raise DataError(
            f"chat_template='always' but the tokenizer {type(tokenizer).__name__} has no chat template; set "
            "tokenizer.chat_template or use chat_template='never'."
        )
    return has if mode == "auto" else mode == "always"


def template_label(tokenizer, mode: str) -> str:
    """How messages name the chat template rows are rendered with: the option and where the template came from."""
    from .chat_templates import builtin_name

    if mode in CHAT_TEMPLATE_MODES:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return f"the tokenizer's own, from {name!r}, with --chat_template={mode!r}"
    kind = "a built-in template" if builtin_name(mode) is not None else "a Jinja file"
    return f"--chat_template={mode!r}, {kind}"


def _template_failure(ds, mapped, split: str, kwargs: dict) -> str:
    """Why the chat template refused the first row it refused in ``split``: that row tokenised again, the error kept."""
    first = next(i for i, why in enumerate(mapped[SKIP_COLUMN]) if why == TEMPLATE_ERROR)
    try:
        tokenize_row(ds[first], **{**kwargs, "on_bad_row": "error"})
    except DataError as err:
        return str(err).split(f" (the template: {kwargs['template']})", 1)[0].replace(
            ": the chat template refused the row:", ":")
    return f"row {first}"


def longest_token_chars(tokenizer) -> int:
    """The length of the tokenizer's longest vocabulary entry: no token of a tokenizer that keeps every character
    covers more characters, so a text of more than ``n`` times this many characters has more than ``n`` tokens."""
    return max(map(len, tokenizer.get_vocab()))


def _segments_prompt_completion(row, tokenizer, chat: bool, columns: Columns):
    prompt, completion = row[columns.prompt], row[columns.completion]
    if chat:
        messages = [{"role": "user", "content": prompt}]
        prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": completion}], tokenize=False
        )
        if not full_text.startswith(prompt_text):
            return None, "chat template not incremental"
        return [(prompt_text, False, False), (full_text[len(prompt_text):], True, False)], None
    # no template: prompt (with the tokenizer's BOS, if any) then completion and EOS
    return [(prompt, False, True), (completion, True, False), (None, True, False)], None


def _segments_messages(row, tokenizer, columns: Columns, train_on_prompt: bool):
    messages = row[columns.messages]
    # render incrementally so that each assistant turn is an exact text span of the whole conversation
    segments, rendered = [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if not before.startswith(rendered):
                return None, "chat template not incremental"
            segments.append((before[len(rendered):], False, False))
            rendered = before
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not upto.startswith(rendered):
            return None, "chat template not incremental"
        segments.append((upto[len(rendered):], message["role"] == "assistant" or train_on_prompt, False))
        rendered = upto
    return [s for s in segments if s[0]], None


def _overlength(out: dict, at: str, size: str, max_seq_length: int, overlength: str) -> dict:
    """A row too long for ``max_seq_length``: skipped (``out`` says why), or the error naming it and its ``size``."""
    if overlength == "error":
        raise DataError(f"{at} has {size}. Raise --max_seq_length, or pass --overlength skip|truncate.")
    out[SKIP_COLUMN] = f"longer than max_seq_length={max_seq_length}"
    return out


def tokenize_row(
    row: dict,
    tokenizer,
    data_format: str,
    max_seq_length: int,
    chat: bool,
    columns: Columns,
    completion_only_loss: bool = True,
    overlength: str = "skip",
    on_bad_row: str = "skip",
    char_limit: int | None = None,
    where: str = "row",
    template: str = "the chat template",
) -> dict[str, Any]:
    """Tokenise one row into ``input_ids``/``attention_mask``/``labels``; a non-empty ``_hf_lisa_skip`` says why not.

    The row is checked first (:func:`.formats.check_row`), and an Alpaca or ShareGPT row converted to chat messages or
    prompt/completion (:func:`.formats.canonical_row`); a bad row is skipped, or refused when ``on_bad_row`` is
    ``"error"``. A row with more than ``char_limit`` characters is too long before any tokenisation: skipped, refused,
    or cut to ``char_limit`` characters per field (``overlength="truncate"``, which keeps the first tokens the same).
    ``where`` prefixes the row's ``LINE_COLUMN`` in messages (``"train_file='d.jsonl', line"``); ``template`` names the
    chat template in them (:func:`template_label`). A template that refuses a row (``raise_exception``, an undefined
    value: a Jinja ``TemplateError``) skips it like a bad row; one that fails otherwise (a ``TypeError`` in its own
    code) stops tokenisation with a ``DataError`` naming it.
    """
    out = {"input_ids": [], "attention_mask": [], "labels": [], SKIP_COLUMN: ""}
    at = f"{where} {row.get(LINE_COLUMN, '?')}"
    bad = check_row(row, data_format, columns)
    if bad:
        if on_bad_row == "error":
            raise DataError(
                f"{at}: {bad.detail} ({bad.reason}). Fix the row, or pass --on_bad_row skip to skip such rows (they "
                "are counted and listed)."
            )
        out[SKIP_COLUMN] = bad.reason
        return out
    if data_format in CONVERTED_FORMATS:  # Alpaca, ShareGPT: as chat messages (or Alpaca's prompt without a template)
        (row, data_format), columns = canonical_row(row, data_format, chat), Columns()
    chars = sum(map(len, row_texts(row, data_format, columns)))
    if char_limit is not None and chars > char_limit:
        if overlength != "truncate":
            size = (f"{chars} characters, more than max_seq_length={max_seq_length} tokens of this tokenizer can "
                    f"hold (at most {char_limit} characters; the row was not tokenised)")
            return _overlength(out, at, size, max_seq_length, overlength)
        row = cap_row(row, data_format, columns, char_limit)
    from jinja2 import TemplateError

    try:
        if data_format == "text":
            segments, reason = [(row[columns.text], True, True), (None, True, False)], None
        elif data_format == "prompt_completion":
            segments, reason = _segments_prompt_completion(row, tokenizer, chat, columns)
        else:
            segments, reason = _segments_messages(row, tokenizer, columns, train_on_prompt=not completion_only_loss)
    except TemplateError as err:  # the template refused the row (raise_exception: "roles must alternate", ...)
        if on_bad_row == "error":
            raise DataError(f"{at}: the chat template refused the row: {err} (the template: {template}). Fix the "
                            "row or the template, or pass --on_bad_row skip to skip such rows.") from None
        segments, reason = None, TEMPLATE_ERROR
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as err:  # the template's own code failed
        raise DataError(f"{at}: the chat template failed: {type(err).__name__}: {err} (the template: {template}). "
                        "Fix the template, or pass another --chat_template (a built-in name, e.g. chatml, or a Jinja "
                        "file).") from None
    if reason:
        out[SKIP_COLUMN] = reason
        return out

    input_ids, labels = [], []
    for text, trained, special in segments:
        if text is None:  # end of sequence
            ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        else:
            ids = tokenizer(text, add_special_tokens=special)["input_ids"]
            if special and tokenizer.eos_token_id is not None and ids and ids[-1] == tokenizer.eos_token_id:
                ids = ids[:-1]  # tokenizers that append EOS themselves: the EOS segment adds it once, at the end
        input_ids += ids
        labels += ids if (trained or not completion_only_loss) else [IGNORE_INDEX] * len(ids)

    if len(input_ids) > max_seq_length:
        if overlength != "truncate":
            size = f"{len(input_ids)} tokens, more than max_seq_length={max_seq_length}"
            return _overlength(out, at, size, max_seq_length, overlength)
        input_ids, labels = input_ids[:max_seq_length], labels[:max_seq_length]
    if all(label == IGNORE_INDEX for label in labels):
        out[SKIP_COLUMN] = "no trained tokens"
        return out
    out.update(input_ids=input_ids, attention_mask=[1] * len(input_ids), labels=labels)
    return out


def tokenize_datasets(
    raw_datasets,
    tokenizer,
    max_seq_length: int,
    data_format: str = "auto",
    completion_only_loss: bool = True,
    overlength: str = "skip",
    chat_template: str = "auto",
    text_column: str = "text",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str = "messages",
    num_proc: int | None = None,
    load_from_cache_file: bool = True,
    on_bad_row: str = "skip",
):
    """Check (:func:`check_data`, then row by row), tokenise every split with ``datasets.map`` (cached, with a progress
    bar), then drop and count skipped rows.

    ``on_bad_row``: a row with a missing, empty or non-string field (see :func:`.formats.check_row`) is skipped and
    counted (``"skip"``) or stops tokenisation with an error naming its file and line (``"error"``). Skips are logged
    as one table per split (reason, rows, first lines).

    Returns:
        ``(tokenized DatasetDict, TokenizationReport)``. The tokenized splits keep only ``input_ids``,
        ``attention_mask`` and ``labels``.

    Raises:
        DataError: bad options, no recognised columns, mixed formats, a bad row under ``on_bad_row="error"``, or a split
            where every row was skipped.
    """
    import datasets
    import numpy as np

    splits = with_locations(raw_datasets)
    columns = Columns(prompt_column, completion_column, messages_column, text_column)
    fmt = check_data(splits, max_seq_length, data_format, overlength, on_bad_row, columns)
    chat = use_chat_template(tokenizer, chat_template)
    if fmt in CHAT_FORMATS and not chat:
        column = messages_column if fmt == "messages" else "conversations"
        raise DataError(
            f"The data has a '{column}' column (chat format) but the tokenizer has no chat template "
            f"(or chat_template='never'); pass --chat_template with a built-in name (e.g. chatml) or a Jinja file, "
            "set tokenizer.chat_template, or convert the data to prompt/completion."
        )
    if fmt == "text" and chat_template not in CHAT_TEMPLATE_MODES:
        logger.warning("chat_template=%r does not change how plain-text rows are tokenised; it is saved with the "
                       "tokenizer (and the model) only.", chat_template)
    report = TokenizationReport(data_format=fmt)
    kwargs = {
        "tokenizer": tokenizer, "data_format": fmt, "max_seq_length": max_seq_length, "chat": chat, "columns": columns,
        "completion_only_loss": completion_only_loss, "overlength": overlength, "on_bad_row": on_bad_row,
        "char_limit": max_seq_length * longest_token_chars(tokenizer),
        "template": template_label(tokenizer, chat_template),
    }
    tokenized = {}
    for split, ds in splits.items():
        mapped = ds.map(
            tokenize_row,
            fn_kwargs={**kwargs, "where": location_of(ds)},
            remove_columns=data_columns(ds),
            num_proc=num_proc,
            load_from_cache_file=load_from_cache_file,
            desc=f"Tokenizing {split} ({fmt})",
        )
        reasons, every_line = Counter(), {}
        for why, line in zip(mapped[SKIP_COLUMN], mapped[LINE_COLUMN]):
            if why:
                reasons[why] += 1
                if line is not None:
                    every_line.setdefault(why, []).append(line)
        # the first lines of the file, in order (the split is shuffled): where a user looks first
        lines = {why: heapq.nsmallest(SKIP_EXAMPLES, found) for why, found in every_line.items()}
        kept = mapped.filter(lambda r: not r, input_columns=[SKIP_COLUMN], desc=f"Dropping skipped {split} rows")
        kept = kept.remove_columns([SKIP_COLUMN, LINE_COLUMN])
        skips = mapped[SKIP_COLUMN]
        kept_rows = np.flatnonzero(np.fromiter((not why for why in skips), dtype=bool, count=len(skips)))
        report.kept[split], report.kept_rows[split] = len(kept), kept_rows
        report.skipped[split] = dict(reasons)
        report.skipped_lines[split] = lines
        if reasons:
            logger.warning(
                "Skipped %d of %d %s rows (%s):\n%s", sum(reasons.values()), len(ds), split, source_of(ds),
                skip_table(reasons, lines, unit_of(ds)),
            )
        if len(kept) == 0 and reasons.get(TEMPLATE_ERROR) == len(ds):
            example = _template_failure(ds, mapped, split, {**kwargs, "where": location_of(ds)})
            raise DataError(
                f"Every row of the {split} split was skipped ({source_of(ds)}): the chat template "
                f"({kwargs['template']}) refused every one, e.g. {example}. Fix the template, or pass another --chat_template (a built-in "
                "name, e.g. chatml, or a Jinja file)."
            )
        if len(kept) == 0:
            raise DataError(
                f"Every row of the {split} split was skipped ({source_of(ds)}: {dict(reasons)}). Check the columns and "
                "max_seq_length."
            )
        tokenized[split] = kept
    return datasets.DatasetDict(tokenized), report


def data_collator(tokenizer, pad_to_multiple_of: int | None = None):
    """Right-pads ``input_ids`` with the pad token, ``attention_mask`` with 0 and ``labels`` with -100."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=pad_to_multiple_of
    )
