"""The data pipeline: files (or Hub datasets) checked line by line, then tokenised rows with loss masks.

``hf-lisa train`` reads its data through this package, and so can your own code or a benchmark: the same row
formats, checks and tokenisation as the command (a benchmark compares methods on exactly what a user would train on).

Example:
    ```py
    >>> from hf_lisa.data import data_collator, load_raw_datasets, tokenize_datasets
    >>> raw = load_raw_datasets(train_file="train.jsonl", validation_split_percentage=5)  # doctest: +SKIP
    >>> tokenized, report = tokenize_datasets(raw, tokenizer, max_seq_length=512)  # doctest: +SKIP
    ```

The rooms, in the order a run uses them:

* :mod:`.files`: files the user names, read once and bounded;
* :mod:`.sources`, :mod:`.mixing`: which files or datasets, and a weighted mixture of several;
* :mod:`.validation`: rows checked line by line (what is skipped, counted, or refused, naming the file and line);
* :mod:`.formats`, :mod:`.chat_templates`: the row format (prompt/completion, chat, Alpaca, ShareGPT, text) and the
  chat template;
* :mod:`.pipeline`: loading and tokenising (:func:`load_raw_datasets`, :func:`tokenize_datasets`,
  :func:`data_collator`);
* :mod:`.training_data`, :mod:`.packing`, :mod:`.preference`: a run's training rows, packed sequences, and preference
  pairs for DPO.
"""

from __future__ import annotations

from .pipeline import (
    CHAT_TEMPLATE_MODES,
    DATA_FORMATS,
    IGNORE_INDEX,
    LINE_COLUMN,
    OVERLENGTH_POLICIES,
    Columns,
    DataError,
    TokenizationReport,
    check_data,
    data_collator,
    detect_format,
    load_raw_datasets,
    tokenize_datasets,
    tokenize_row,
    use_chat_template,
)

__all__ = [
    "CHAT_TEMPLATE_MODES", "DATA_FORMATS", "IGNORE_INDEX", "LINE_COLUMN", "OVERLENGTH_POLICIES", "Columns",
    "DataError", "TokenizationReport", "check_data", "data_collator", "detect_format", "load_raw_datasets",
    "tokenize_datasets", "tokenize_row", "use_chat_template",
]
