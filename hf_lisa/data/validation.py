"""Training data checked before tokenisation: files read line by line, the data format, and every row.

* **Files** (:func:`scan_file`): ``.jsonl``/``.json`` files are read here, line by line, before ``datasets`` reads them,
  so that a byte that is not UTF-8, a line that is not JSON, a value that is not an object, a row nested too deeply
  to decode (a ``RecursionError``) or a file of blank lines is reported with its file, line and column; ``.csv``/
  ``.txt`` files are checked for UTF-8 the same way.
* **Where each row came from** (:func:`add_locations`): the column ``LINE_COLUMN`` holds each row's line (JSON Lines,
  text) or row number (csv, parquet, Hub datasets); its feature's ``id`` names the file and the unit, e.g.
  ``"train_file='data/train.jsonl', line"``, so that every later message can say ``train_file='data/train.jsonl', line
  7``, also for a validation split held out of the training file.
* **The data format** (:func:`detect_format`, :func:`check_data`): detected from the train split's columns; every
  other split must have its columns, and no file may mix rows of two formats (:func:`rows_by_format` finds them from
  the columns' null masks, without reading the rows into Python).
* **Rows** (:func:`check_row`; Alpaca and ShareGPT rows in :mod:`.formats`): missing, empty or non-string fields,
  messages without a known role or with non-string content, an empty turn, a chat without an assistant turn. Each
  problem has a short *reason* (what the skip counts are keyed by) and a *detail* (what the error under
  ``on_bad_row="error"`` says about the row).

``hf_lisa.data.pipeline`` reads the files, calls these checks and tokenises.
"""

from __future__ import annotations

import codecs
import json
import re
import reprlib
from array import array
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import reduce
from typing import Any, NamedTuple

LINE_COLUMN = "_hf_lisa_line"
FORMATS = ("prompt_completion", "messages", "alpaca", "sharegpt", "text")  # the order `auto` tries them in
DATA_FORMATS = ("auto", *FORMATS)
OVERLENGTH_POLICIES = ("skip", "truncate", "error")
FORMAT_TITLES = {"prompt_completion": "prompt/completion", "messages": "chat", "alpaca": "Alpaca",
                 "sharegpt": "ShareGPT", "text": "plain text"}
ALPACA_COLUMNS = ("instruction", "output")  # what detects Alpaca rows; `input` and `system` are optional
SHAREGPT_COLUMN = "conversations"
ON_BAD_ROW = ("skip", "error")
ROLES = ("system", "developer", "user", "assistant", "tool")
JSON_LINES_HINT = (
    'Expected one JSON object per line (JSON Lines), e.g. {"prompt": "2+2=", "completion": "4"}, or a JSON array of '
    "such objects"
)
_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_repr = reprlib.Repr()  # short previews of values in messages
_repr.maxstring = _repr.maxother = 40
_repr.maxlist = _repr.maxdict = 3


class DataError(ValueError):
    """Bad training data or data arguments; the message names the file, line, column or option at fault."""


class Columns(NamedTuple):
    """The column names of the native row formats (``--prompt_column``, ...); Alpaca's and ShareGPT's are fixed."""

    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    text: str = "text"

    def of(self, data_format: str) -> tuple[str, ...]:
        """The columns a row of ``data_format`` needs."""
        return {"prompt_completion": (self.prompt, self.completion), "messages": (self.messages,),
                "alpaca": ALPACA_COLUMNS, "sharegpt": (SHAREGPT_COLUMN,), "text": (self.text,)}[data_format]


@dataclass(frozen=True)
class BadRow:
    """Why a row cannot be trained on: ``reason`` is the counted category, ``detail`` describes this row."""

    reason: str
    detail: str


# -- files -------------------------------------------------------------------------------------------------------------
def _decode(data: bytes, label: str, first_line: int = 1) -> str:
    """``data`` as UTF-8 text, or a DataError naming the line and column of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line = first_line + data.count(b"\n", 0, err.start)
        column = len(data[line_start:err.start].decode("utf-8", "replace")) + 1
        raise DataError(
            f"{label}, line {line}, column {column}: the byte 0x{data[err.start]:02x} is not UTF-8. Expected UTF-8 "
            "text: re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 in > out`)."
        ) from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON; use null or a number")


def _json_object(value: Any, label: str, line: int) -> None:
    if not isinstance(value, dict):
        raise DataError(
            f"{label}, line {line}: expected a JSON object ({{...}}) with the row's fields, got {_describe(value)}. "
            f"{JSON_LINES_HINT}."
        )


def _json_error(label: str, line: int, column: int, message: str) -> DataError:
    return DataError(f"{label}, line {line}, column {column}: invalid JSON ({message}). {JSON_LINES_HINT}.")


def _too_deep_error(label: str, line: int) -> DataError:
    """A row whose lists/objects nest deeper than the JSON reader can go (``RecursionError``): not a training row."""
    return DataError(
        f"{label}, line {line} is nested too deeply (lists or objects inside each other, deeper than a JSON reader "
        f"can follow): it is not a valid row. {JSON_LINES_HINT}, whose fields are strings."
    )


def _json_array_lines(text: str, label: str, decoder: json.JSONDecoder) -> array:
    """The line of each object of a JSON array document."""
    lines, line, counted = array("q"), 1, 0
    pos = _JSON_WHITESPACE.match(text, text.index("[") + 1).end()
    ended = text.startswith("]", pos)
    while not ended:
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise _json_error(label, err.lineno, err.colno, err.msg) from None
        except RecursionError:
            raise _too_deep_error(label, line) from None
        _json_object(value, label, line)
        lines.append(line)
        pos = _JSON_WHITESPACE.match(text, end).end()
        ended = text.startswith("]", pos)
        if not ended and not text.startswith(",", pos):
            err = json.JSONDecodeError("expected ',' or ']' after an array element", text, pos)
            raise _json_error(label, err.lineno, err.colno, err.msg)
        pos = pos if ended else _JSON_WHITESPACE.match(text, pos + 1).end()
    pos = _JSON_WHITESPACE.match(text, pos + 1).end()
    if pos < len(text):
        err = json.JSONDecodeError("extra data after the array", text, pos)
        raise _json_error(label, err.lineno, err.colno, err.msg)
    return lines


def _scan_json(path: str, label: str) -> array:
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    with open(path, "rb") as f:
        head = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
        f.seek(0)
        if head.startswith(b"["):  # one JSON array (datasets reads it whole as well)
            return _json_array_lines(_decode(f.read(), label).removeprefix("\ufeff"), label, decoder)
        lines = array("q")
        for number, raw in enumerate(f, 1):
            text = _decode(raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw, label, number)
            if _JSON_WHITESPACE.fullmatch(text):
                continue  # blank lines are not rows (datasets skips them too)
            try:
                value = decoder.decode(text)
            except json.JSONDecodeError as err:  # past the line's end: the line ended too early
                column = err.colno if err.lineno == 1 else len(text.rstrip("\r\n")) + 1
                raise _json_error(label, number, column, err.msg) from None
            except ValueError as err:  # NaN / Infinity
                raise DataError(f"{label}, line {number}: {err}. {JSON_LINES_HINT}.") from None
            except RecursionError:
                raise _too_deep_error(label, number) from None
            _json_object(value, label, number)
            lines.append(number)
    return lines


def scan_file(path: str, label: str, builder: str) -> array | None:
    """Check a local data file before ``datasets`` reads it; return the line of each row of a JSON file.

    Args:
        path: the file.
        label: how messages name it, e.g. ``"train_file='data/train.jsonl'"``.
        builder: its ``datasets`` builder (``"json"``, ``"csv"``, ``"text"``, ``"parquet"``).

    Raises:
        DataError: a byte that is not UTF-8 (json, csv, text), a line that is not JSON or not an object, or a JSON file
            without rows; each names the file, the line and what was expected.
    """
    if builder == "json":
        lines = _scan_json(path, label)
        if not lines:
            raise DataError(f"{label} has no rows, only blank lines or an empty array. {JSON_LINES_HINT}.")
        return lines
    if builder in ("csv", "text"):
        filled = 0
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                filled += not _JSON_WHITESPACE.fullmatch(_decode(raw, label, number))
        if builder == "csv" and filled < 2:
            raise DataError(f"{label} has no rows, only {'a header line' if filled else 'blank lines'}.")
    return None


# -- where each row came from ------------------------------------------------------------------------------------------
def add_locations(ds, source: str, unit: str, numbers: array | None = None):
    """``ds`` with ``LINE_COLUMN``: ``numbers`` (the line of each row) or the row numbers 1, 2, ...

    The feature's ``id`` is ``"<source>, <unit>"`` (``unit`` is ``"line"`` or ``"row"``), read by :func:`location_of`.
    """
    import datasets
    import numpy as np

    if numbers is not None and len(numbers) != len(ds):  # datasets read the file differently: never mislabel lines
        numbers, unit = None, "row"
    values = np.arange(1, len(ds) + 1, dtype=np.int64) if numbers is None else np.frombuffer(numbers, np.int64)
    return ds.add_column(LINE_COLUMN, values, feature=datasets.Value("int64", id=f"{source}, {unit}"))


def location_of(ds) -> str:
    """``"train_file='data/train.jsonl', line"``: the prefix of a row's number in messages (:func:`add_locations`)."""
    return ds.features[LINE_COLUMN].id or "the data, row"


def source_of(ds) -> str:
    """``"train_file='data/train.jsonl'"``: what the split was read from."""
    return location_of(ds).rsplit(", ", 1)[0]


def unit_of(ds) -> str:
    """``"line"`` or ``"row"``: what the split's numbers count."""
    return location_of(ds).rsplit(", ", 1)[1]


# -- the data format ---------------------------------------------------------------------------------------------------
def data_columns(ds) -> list[str]:
    """The dataset's columns, without ``LINE_COLUMN``."""
    return [c for c in ds.column_names if c != LINE_COLUMN]


def detect_format(
    column_names: list[str],
    data_format: str = "auto",
    text_column: str = "text",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str = "messages",
) -> str:
    """The format (one of ``FORMATS``) of a dataset with ``column_names``: ``data_format``, or with ``"auto"`` the first
    of ``FORMATS`` whose columns are all present (a dataset with ``instruction``, ``output`` and ``text`` is Alpaca)."""
    if data_format not in DATA_FORMATS:
        raise DataError(f"data_format={data_format!r} is invalid; allowed: {DATA_FORMATS}.")
    columns = Columns(prompt_column, completion_column, messages_column, text_column)
    if data_format != "auto":
        missing = [c for c in columns.of(data_format) if c not in column_names]
        if missing:
            raise DataError(
                f"data_format={data_format!r} needs the column(s) {missing}, but the data has columns {column_names}."
            )
        return data_format
    for fmt in FORMATS:
        if all(c in column_names for c in columns.of(fmt)):
            return fmt
    raise DataError(
        f"Cannot tell the data format from the columns {column_names}. Provide one of: '{prompt_column}' + "
        f"'{completion_column}' (prompt/completion), '{messages_column}' (chat), 'instruction' + 'output' (Alpaca), "
        f"'{SHAREGPT_COLUMN}' (ShareGPT), or '{text_column}' (plain text); or rename them with --prompt_column/"
        "--completion_column/--messages_column/--text_column."
    )


def with_locations(raw_datasets: Mapping) -> dict:
    """The splits, each with ``LINE_COLUMN`` (row numbers for a split that ``load_raw_datasets`` did not read)."""
    return {split: ds if LINE_COLUMN in ds.column_names else add_locations(ds, f"the {split} split", "row")
            for split, ds in raw_datasets.items()}


def check_data(
    raw_datasets: Mapping,
    max_seq_length: int,
    data_format: str = "auto",
    overlength: str = "skip",
    on_bad_row: str = "skip",
    columns: Columns | None = None,
) -> str:
    """What can be checked before the tokenizer is loaded; returns the data format.

    The options' values; the format, detected from the train split's columns (or ``data_format``); that every other
    split (a validation file) has that format's columns; and that no split mixes rows of two formats (a file of chat
    rows and plain-text rows). Cheap: the format checks read the columns' null masks, not the rows.
    ``tokenize_datasets`` runs it first; ``hf-lisa train`` also runs it before loading the model. ``columns``: the
    formats' column names (default: ``prompt``, ``completion``, ``messages``, ``text``).

    Raises:
        DataError: naming the option, or the file(s) and the lines of each format.
    """
    if max_seq_length is None or max_seq_length < 2:
        raise DataError(f"max_seq_length={max_seq_length!r} is invalid; allowed: an integer >= 2.")
    if overlength not in OVERLENGTH_POLICIES:
        raise DataError(f"overlength={overlength!r} is invalid; allowed: {OVERLENGTH_POLICIES}.")
    if on_bad_row not in ON_BAD_ROW:
        raise DataError(f"on_bad_row={on_bad_row!r} is invalid; allowed: {ON_BAD_ROW}.")
    splits = with_locations(raw_datasets)
    train = splits["train"]
    columns = columns or Columns()
    try:
        fmt = detect_format(data_columns(train), data_format, columns.text, columns.prompt, columns.completion,
                            columns.messages)
    except DataError as err:
        raise DataError(f"{source_of(train)}: {err}") from None
    for split, ds in splits.items():
        missing = [c for c in columns.of(fmt) if c not in ds.column_names]
        if missing:
            raise DataError(
                f"{source_of(ds)} has the columns {data_columns(ds)}, but {source_of(train)} is {FORMAT_TITLES[fmt]} "
                f"data with the column(s) {list(columns.of(fmt))}: the {split} data lacks {missing}. Give both files "
                "the same format."
            )
        found = rows_by_format(ds, fmt, columns)
        if len(found) > 1:
            raise mixed_formats_error(ds, columns, found)
    return fmt


# -- rows of several formats -------------------------------------------------------------------------------------------
def _any_valid(table, names: list[str]):
    import pyarrow.compute as pc

    return reduce(pc.or_, [pc.is_valid(table.column(name)) for name in names])


def rows_by_format(ds, data_format: str, columns: Columns, examples: int = 5) -> dict[str, tuple[int, list[int]]]:
    """How many rows are in each format, and their first lines, from the columns' null masks (vectorised).

    A row is in ``data_format`` when one of its columns has a value, and in another format when one of that format's
    columns has a value and none of ``data_format``'s does. Rows with no value in any format's columns are left out
    (:func:`check_row` counts them as missing fields). The rows are those of the Arrow table behind ``ds``
    (``ds.data``): for a split held out of a file, or a selection, the whole file, which is what mixes formats.

    Returns:
        ``{format: (number of rows, first lines)}``; more than one key means the file mixes formats.
    """
    import pyarrow.compute as pc

    table = ds.data
    present = set(table.column_names)
    own = [c for c in columns.of(data_format) if c in present]
    others = {fmt: [c for c in columns.of(fmt) if c in present and c not in own] for fmt in FORMATS}
    mine = _any_valid(table, own)
    masks = {data_format: mine, **{fmt: pc.and_(pc.invert(mine), _any_valid(table, names))
                                    for fmt, names in others.items() if fmt != data_format and names}}
    found = {}
    for fmt, mask in masks.items():
        count = pc.sum(mask).as_py() or 0
        if count:
            found[fmt] = (count, pc.filter(table.column(LINE_COLUMN), mask)[:examples].to_pylist())
    return found


def mixed_formats_error(ds, columns: Columns, found: dict[str, tuple[int, list[int]]]) -> DataError:
    """The error for a split whose rows are in several formats (``found`` from :func:`rows_by_format`)."""
    parts = [
        f"{FORMAT_TITLES[fmt]} rows ({', '.join(repr(c) for c in columns.of(fmt))}) at {unit_of(ds)} "
        f"{', '.join(map(str, lines))}{', ...' if total > len(lines) else ''} ({total} row{'s' * (total > 1)})"
        for fmt, (total, lines) in found.items()
    ]
    return DataError(
        f"{source_of(ds)} mixes row formats: {'; '.join(parts)}. A run trains on one format: put each format in its "
        "own file (one run each), or convert the rows to one format."
    )


# -- rows --------------------------------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({_repr.repr(value)})"


def _check_string(row: dict, column: str) -> BadRow | None:
    value = row.get(column)
    if value is None:
        return BadRow(f"missing {column}", f"it has no '{column}' (or it is null)")
    if not isinstance(value, str):
        return BadRow(f"non-string {column}", f"'{column}' is {_describe(value)}; expected a string")
    if not value.strip():
        return BadRow(f"empty {column}", f"'{column}' is empty")
    return None


def _check_messages(messages: Any, column: str) -> BadRow | None:
    if messages is None:
        return BadRow(f"missing {column}", f"it has no '{column}' (or it is null)")
    if not isinstance(messages, list):
        return BadRow(f"non-list {column}", f"'{column}' is {_describe(messages)}; expected a list of messages")
    if not messages:
        return BadRow(f"empty {column}", f"'{column}' is an empty list")
    for i, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return BadRow("message is not an object", f"message {i} is {_describe(message)}; expected an object "
                                                      '{"role": ..., "content": ...}')
        role, content = message.get("role"), message.get("content")
        if role is None:
            return BadRow("message without role", f"message {i} has no 'role'")
        if role not in ROLES:
            return BadRow("unknown role", f"message {i} has the role {_repr.repr(role)}; allowed: {', '.join(ROLES)}")
        if content is None:
            return BadRow("message without content", f"message {i} ({role}) has no 'content'")
        if not isinstance(content, str):
            return BadRow("non-string content", f"message {i} ({role}) has the content {_describe(content)}; "
                                                "expected a string")
        if not content.strip():
            return BadRow(f"empty {role} turn", f"message {i} ({role}) has empty content")
    if not any(m["role"] == "assistant" for m in messages):
        return BadRow("no assistant turn", "it has no assistant message, so nothing would be trained")
    return None


def check_row(row: dict, data_format: str, columns: Columns) -> BadRow | None:
    """Why ``row`` cannot be trained on as ``data_format`` (a native format), or None when it can; Alpaca and ShareGPT
    rows: :func:`hf_lisa.data.formats.check_row`, which calls this for the others.

    Every field the format uses must be a non-empty string; chat messages must be objects with a role in ``ROLES`` and
    non-empty string content, and at least one turn must be the assistant's.
    """
    if data_format == "messages":
        return _check_messages(row.get(columns.messages), columns.messages)
    return next(filter(None, (_check_string(row, c) for c in columns.of(data_format))), None)


def row_texts(row: dict, data_format: str, columns: Columns) -> list[str]:
    """The strings of a row that passed :func:`check_row`: what its tokens come from."""
    if data_format == "messages":
        return [m["content"] for m in row[columns.messages]]
    return [row[c] for c in columns.of(data_format)]


def cap_row(row: dict, data_format: str, columns: Columns, limit: int) -> dict:
    """``row`` with each of its strings cut to ``limit`` characters (before truncating a row to its first tokens)."""
    if data_format == "messages":
        return {**row, columns.messages: [{**m, "content": m["content"][:limit]} for m in row[columns.messages]]}
    return {**row, **{c: row[c][:limit] for c in columns.of(data_format)}}


def skip_table(reasons: Counter, lines: dict[str, list[int]], unit: str) -> str:
    """The skipped rows of a split as a text table: reason, rows, first lines."""
    width = max(len("reason"), *map(len, reasons))
    rows = [f"  {'reason':<{width}}  {'rows':>6}  first {unit}s"]
    for why, n in reasons.most_common():
        shown = lines.get(why, [])
        more = ", ..." if n > len(shown) else ""
        rows.append(f"  {why:<{width}}  {n:>6}  {', '.join(map(str, shown))}{more}")
    return "\n".join(rows)
