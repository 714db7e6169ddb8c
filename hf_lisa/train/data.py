"""Training data: loading local files or Hub datasets, detecting the row format and tokenising with loss masks.

Three row formats are recognised from the column names:

* **prompt/completion** (``prompt`` and ``completion`` columns): the loss covers the completion only (by default).
  With a tokenizer that has a chat template, the prompt becomes a user turn and the completion the assistant's reply.
* **chat** (a ``messages`` column of ``{"role", "content"}`` lists): rendered with the tokenizer's chat template; the
  loss covers the assistant turns only (by default).
* **plain text** (a ``text`` column): the loss covers every token.

Bad data, and what happens to it (also in ``docs/training.md``):

* missing file, unsupported extension, empty file or split, no recognised columns, a chat dataset with a tokenizer
  that has no chat template: a ``ValueError``/``FileNotFoundError`` that names the file, the column or the option;
* a row with an empty or missing prompt, completion, text or message list, or a chat row whose template rendering is
  not incremental: **skipped, counted and logged** (one warning per split with the counts by reason);
* a row longer than ``max_seq_length``: skipped and counted (``overlength="skip"``, the default), truncated
  (``"truncate"``) or an error naming the row (``"error"``).

Example:
    ```py
    >>> from hf_lisa.data import load_raw_datasets, tokenize_datasets
    >>> raw = load_raw_datasets(train_file="train.jsonl", validation_split_percentage=10)  # doctest: +SKIP
    >>> tokenized, report = tokenize_datasets(raw, tokenizer, max_seq_length=256)  # doctest: +SKIP
    ```
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
EXTENSION_TO_BUILDER = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
DATA_FORMATS = ("auto", "prompt_completion", "messages", "text")
OVERLENGTH_POLICIES = ("skip", "truncate", "error")
CHAT_TEMPLATE_MODES = ("auto", "always", "never")
SKIP_COLUMN = "_hf_lisa_skip"


class DataError(ValueError):
    """Bad training data or data arguments; the message names the file, column or option at fault."""


@dataclass
class TokenizationReport:
    """What tokenisation kept and skipped, per split."""

    data_format: str
    kept: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)

    def total_skipped(self, split: str) -> int:
        return sum(self.skipped.get(split, {}).values())


# -- loading -----------------------------------------------------------------------------------------------------------
def _builder_for(path: str, option: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{option}={path!r} does not exist.")
    if os.path.isdir(path):
        raise DataError(f"{option}={path!r} is a directory; pass a file ({', '.join(EXTENSION_TO_BUILDER)}).")
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSION_TO_BUILDER:
        raise DataError(
            f"{option}={path!r} has the unsupported extension {ext!r}; allowed: {', '.join(EXTENSION_TO_BUILDER)}."
        )
    if os.path.getsize(path) == 0:
        raise DataError(f"{option}={path!r} is empty.")
    return EXTENSION_TO_BUILDER[ext]


def load_raw_datasets(
    train_file: Optional[str] = None,
    validation_file: Optional[str] = None,
    dataset_name: Optional[str] = None,
    dataset_config_name: Optional[str] = None,
    validation_split_percentage: float = 5.0,
    seed: int = 42,
    cache_dir: Optional[str] = None,
):
    """Load a ``DatasetDict`` with a ``train`` and (when possible) a ``validation`` split.

    Local files go through ``datasets``' json/csv/parquet/text builders; ``dataset_name`` loads a Hub dataset (needs
    network). Without a validation file or split, ``validation_split_percentage`` percent of train is held out
    (seeded); 0 means no validation split.

    Raises:
        FileNotFoundError, DataError: for a missing, empty or unsupported file, or for no data source at all.
    """
    import datasets

    if not 0 <= validation_split_percentage < 100:
        raise DataError(
            f"validation_split_percentage={validation_split_percentage!r} is invalid; allowed: a number in [0, 100)."
        )
    if dataset_name is not None:
        if train_file is not None:
            raise DataError("Pass either dataset_name or train_file, not both.")
        raw = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
        if not isinstance(raw, datasets.DatasetDict) or "train" not in raw:
            raise DataError(f"dataset_name={dataset_name!r} has no 'train' split (splits: {list(raw)}).")
        raw = datasets.DatasetDict(
            {k: v for k, v in raw.items() if k in ("train", "validation")}
            | ({"validation": raw["test"]} if "validation" not in raw and "test" in raw else {})
        )
    elif train_file is not None:
        builder = _builder_for(train_file, "train_file")
        data_files = {"train": train_file}
        if validation_file is not None:
            if _builder_for(validation_file, "validation_file") != builder:
                raise DataError(
                    f"train_file={train_file!r} and validation_file={validation_file!r} must have the same format."
                )
            data_files["validation"] = validation_file
        try:
            raw = datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir)
        except Exception as err:  # datasets wraps parser errors in several types; name the file instead
            raise DataError(f"Could not read {data_files} as {builder}: {type(err).__name__}: {err}") from err
    else:
        raise DataError("No training data: pass train_file (jsonl/json/csv/parquet/txt) or dataset_name.")

    for split, ds in raw.items():
        if len(ds) == 0:
            raise DataError(f"The {split} split has no rows ({train_file or dataset_name}).")
    if "validation" not in raw and validation_split_percentage > 0:
        if len(raw["train"]) < 2:
            raise DataError(
                f"The train split has {len(raw['train'])} row; a validation split needs at least 2. Pass "
                "validation_file or validation_split_percentage=0."
            )
        split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        raw = datasets.DatasetDict({"train": split["train"], "validation": split["test"]})
    return raw


# -- format detection --------------------------------------------------------------------------------------------------
def detect_format(
    column_names: list[str],
    data_format: str = "auto",
    text_column: str = "text",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str = "messages",
) -> str:
    """Return ``"prompt_completion"``, ``"messages"`` or ``"text"`` for a dataset with ``column_names``."""
    if data_format not in DATA_FORMATS:
        raise DataError(f"data_format={data_format!r} is invalid; allowed: {DATA_FORMATS}.")
    needed = {
        "prompt_completion": [prompt_column, completion_column],
        "messages": [messages_column],
        "text": [text_column],
    }
    if data_format != "auto":
        missing = [c for c in needed[data_format] if c not in column_names]
        if missing:
            raise DataError(
                f"data_format={data_format!r} needs the column(s) {missing}, but the data has columns {column_names}."
            )
        return data_format
    for fmt in ("prompt_completion", "messages", "text"):
        if all(c in column_names for c in needed[fmt]):
            return fmt
    raise DataError(
        f"Cannot tell the data format from the columns {column_names}. Provide one of: '{prompt_column}' + "
        f"'{completion_column}' (prompt/completion), '{messages_column}' (chat), or '{text_column}' (plain text); "
        "or rename them with --prompt_column/--completion_column/--messages_column/--text_column."
    )


# -- tokenisation ------------------------------------------------------------------------------------------------------
def use_chat_template(tokenizer, mode: str) -> bool:
    """Whether rows are rendered through the tokenizer's chat template: ``mode`` is ``--chat_template``
    (``"auto"``: when the tokenizer has one; ``"always"``: refuse a tokenizer without one; ``"never"``)."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise DataError(f"chat_template={mode!r} is invalid; allowed: {CHAT_TEMPLATE_MODES}.")
    has = getattr(tokenizer, "chat_template", None) is not None
    if mode == "always" and not has:
        raise DataError(
            f"chat_template='always' but the tokenizer {type(tokenizer).__name__} has no chat template; set "
            "tokenizer.chat_template or use chat_template='never'."
        )
    return has if mode == "auto" else mode == "always"


def _segments_prompt_completion(row, tokenizer, chat: bool, prompt_column: str, completion_column: str):
    prompt, completion = row.get(prompt_column), row.get(completion_column)
    if not isinstance(prompt, str) or not isinstance(completion, str) or not prompt.strip() or not completion.strip():
        return None, "empty prompt or completion"
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


def _segments_messages(row, tokenizer, messages_column: str, train_on_prompt: bool):
    messages = row.get(messages_column)
    if not isinstance(messages, list) or not messages:
        return None, "empty messages"
    if any(not isinstance(m, dict) or not m.get("role") or m.get("content") is None for m in messages):
        return None, "message without role or content"
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant message"
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


def tokenize_row(
    row: dict,
    tokenizer,
    data_format: str,
    max_seq_length: int,
    chat: bool,
    completion_only_loss: bool = True,
    overlength: str = "skip",
    text_column: str = "text",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str = "messages",
) -> dict[str, Any]:
    """Tokenise one row into ``input_ids``/``attention_mask``/``labels``; a non-empty ``_hf_lisa_skip`` says why not."""
    out = {"input_ids": [], "attention_mask": [], "labels": [], SKIP_COLUMN: ""}
    if data_format == "text":
        text = row.get(text_column)
        if not isinstance(text, str) or not text.strip():
            out[SKIP_COLUMN] = "empty text"
            return out
        segments, reason = [(text, True, True), (None, True, False)], None
    elif data_format == "prompt_completion":
        segments, reason = _segments_prompt_completion(row, tokenizer, chat, prompt_column, completion_column)
    else:
        segments, reason = _segments_messages(row, tokenizer, messages_column, train_on_prompt=not completion_only_loss)
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
        if overlength == "skip":
            out[SKIP_COLUMN] = f"longer than max_seq_length={max_seq_length}"
            return out
        if overlength == "error":
            raise DataError(
                f"A row has {len(input_ids)} tokens, more than max_seq_length={max_seq_length}: "
                f"{str(row)[:200]!r}. Raise --max_seq_length, or pass --overlength skip|truncate."
            )
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
    num_proc: Optional[int] = None,
    load_from_cache_file: bool = True,
):
    """Tokenise every split with ``datasets.map`` (cached, with a progress bar), then drop and count skipped rows.

    Returns:
        ``(tokenized DatasetDict, TokenizationReport)``. The tokenized splits keep only ``input_ids``,
        ``attention_mask`` and ``labels``.

    Raises:
        DataError: bad options, no recognised columns, or a split where every row was skipped.
    """
    if max_seq_length is None or max_seq_length < 2:
        raise DataError(f"max_seq_length={max_seq_length!r} is invalid; allowed: an integer >= 2.")
    if overlength not in OVERLENGTH_POLICIES:
        raise DataError(f"overlength={overlength!r} is invalid; allowed: {OVERLENGTH_POLICIES}.")
    columns = raw_datasets["train"].column_names
    fmt = detect_format(columns, data_format, text_column, prompt_column, completion_column, messages_column)
    chat = use_chat_template(tokenizer, chat_template)
    if fmt == "messages" and not chat:
        raise DataError(
            f"The data has a '{messages_column}' column (chat format) but the tokenizer has no chat template "
            f"(or chat_template='never'); set tokenizer.chat_template or convert the data to prompt/completion."
        )
    report = TokenizationReport(data_format=fmt)
    kwargs = dict(
        tokenizer=tokenizer, data_format=fmt, max_seq_length=max_seq_length, chat=chat,
        completion_only_loss=completion_only_loss, overlength=overlength, text_column=text_column,
        prompt_column=prompt_column, completion_column=completion_column, messages_column=messages_column,
    )
    import datasets

    tokenized = {}
    for split, ds in raw_datasets.items():
        if split != "train":
            fmt_split = detect_format(ds.column_names, fmt, text_column, prompt_column, completion_column,
                                      messages_column)
            assert fmt_split == fmt
        mapped = ds.map(
            tokenize_row,
            fn_kwargs=kwargs,
            remove_columns=ds.column_names,
            num_proc=num_proc,
            load_from_cache_file=load_from_cache_file,
            desc=f"Tokenizing {split} ({fmt})",
        )
        reasons = Counter(r for r in mapped[SKIP_COLUMN] if r)
        kept = mapped.filter(lambda r: not r, input_columns=[SKIP_COLUMN], desc=f"Dropping skipped {split} rows")
        kept = kept.remove_columns(SKIP_COLUMN)
        report.kept[split] = len(kept)
        report.skipped[split] = dict(reasons)
        if reasons:
            logger.warning(
                "Skipped %d of %d %s rows: %s", sum(reasons.values()), len(ds), split,
                ", ".join(f"{n} {why}" for why, n in reasons.most_common()),
            )
        if len(kept) == 0:
            raise DataError(
                f"Every row of the {split} split was skipped ({dict(reasons)}). Check the columns and max_seq_length."
            )
        tokenized[split] = kept
    return datasets.DatasetDict(tokenized), report


def data_collator(tokenizer, pad_to_multiple_of: Optional[int] = None):
    """Right-pads ``input_ids`` with the pad token, ``attention_mask`` with 0 and ``labels`` with -100."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, pad_to_multiple_of=pad_to_multiple_of
    )
