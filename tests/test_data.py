"""Data loading, format detection, loss masks and the handling of bad data."""

from __future__ import annotations

import logging

import pytest
from train_fixtures import build_char_tokenizer, write_jsonl

from hf_lisa.data.pipeline import (
    IGNORE_INDEX,
    DataError,
    data_collator,
    detect_format,
    load_raw_datasets,
    tokenize_datasets,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _trained_text(tokenizer, example) -> str:
    return tokenizer.decode([t for t, l in zip(example["input_ids"], example["labels"]) if l != IGNORE_INDEX])


def _tokenize(tmp_path, tokenizer, rows, **kwargs):
    raw = load_raw_datasets(train_file=write_jsonl(tmp_path / "d.jsonl", rows), validation_split_percentage=0)
    kwargs.setdefault("max_seq_length", 128)
    return tokenize_datasets(raw, tokenizer, load_from_cache_file=False, **kwargs)


def test_prompt_completion_with_chat_template_trains_on_the_completion_only(tmp_path, tokenizer):
    tokenized, report = _tokenize(tmp_path, tokenizer, [{"prompt": "say a", "completion": "aaa"}])
    example = tokenized["train"][0]
    assert report.data_format == "prompt_completion"
    assert tokenizer.decode(example["input_ids"]) == "<|user|>say a</s><|assistant|>aaa</s>"
    assert _trained_text(tokenizer, example) == "aaa</s>"
    assert example["attention_mask"] == [1] * len(example["input_ids"])


def test_prompt_completion_without_template_appends_eos(tmp_path, tokenizer):
    tokenized, _ = _tokenize(tmp_path, tokenizer, [{"prompt": "Q: 1+1? A: ", "completion": "2"}],
                             chat_template="never")
    example = tokenized["train"][0]
    assert tokenizer.decode(example["input_ids"]) == "Q: 1+1? A: 2</s>"
    assert _trained_text(tokenizer, example) == "2</s>"


def test_completion_only_loss_false_trains_on_every_token(tmp_path, tokenizer):
    tokenized, _ = _tokenize(tmp_path, tokenizer, [{"prompt": "say a", "completion": "aaa"}],
                             completion_only_loss=False)
    example = tokenized["train"][0]
    assert example["labels"] == example["input_ids"]


def test_chat_messages_train_on_every_assistant_turn_only(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    tokenized, report = _tokenize(tmp_path, tokenizer, [{"messages": messages}])
    example = tokenized["train"][0]
    assert report.data_format == "messages"
    assert tokenizer.decode(example["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert _trained_text(tokenizer, example) == "yo</s>ok</s>"


def test_plain_text_trains_on_all_tokens(tmp_path, tokenizer):
    tokenized, report = _tokenize(tmp_path, tokenizer, [{"text": "hello world"}])
    example = tokenized["train"][0]
    assert report.data_format == "text"
    assert _trained_text(tokenizer, example) == "hello world</s>"


def test_bad_rows_are_skipped_counted_and_logged(tmp_path, tokenizer, caplog):
    rows = [
        {"prompt": "say a", "completion": "aaa"},
        {"prompt": "", "completion": "x"},
        {"prompt": "say b", "completion": None},
        {"prompt": "long " * 40, "completion": "zzz"},
    ]
    with caplog.at_level(logging.WARNING, logger="hf_lisa.data.pipeline"):
        tokenized, report = _tokenize(tmp_path, tokenizer, rows, max_seq_length=64)
    assert len(tokenized["train"]) == 1
    assert report.skipped["train"] == {"empty prompt": 1, "missing completion": 1, "longer than max_seq_length=64": 1}
    assert report.skipped_lines["train"] == {"empty prompt": [2], "missing completion": [3],
                                             "longer than max_seq_length=64": [4]}
    assert "Skipped 3 of 4 train rows" in caplog.text


def test_overlength_truncate_and_error(tmp_path, tokenizer):
    rows = [{"prompt": "p", "completion": "c" * 100}]
    tokenized, _ = _tokenize(tmp_path, tokenizer, rows, max_seq_length=32, overlength="truncate")
    assert len(tokenized["train"][0]["input_ids"]) == 32
    with pytest.raises(DataError, match="more than max_seq_length=32"):
        _tokenize(tmp_path, tokenizer, rows, max_seq_length=32, overlength="error")


def test_csv_and_parquet_load_and_validation_is_split_off(tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"prompt": [f"p{i}" for i in range(20)], "completion": [f"c{i}" for i in range(20)]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        raw = load_raw_datasets(train_file=str(tmp_path / name), validation_split_percentage=25, seed=0)
        assert (len(raw["train"]), len(raw["validation"])) == (15, 5)
        assert set(raw["train"]["prompt"]) | set(raw["validation"]["prompt"]) == set(frame["prompt"])


def test_collator_pads_labels_with_ignore_index(tokenizer):
    batch = data_collator(tokenizer)(
        [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
         {"input_ids": [5], "attention_mask": [1], "labels": [5]}]
    )
    assert batch["input_ids"][1].tolist() == [5, tokenizer.pad_token_id, tokenizer.pad_token_id]
    assert batch["labels"][1].tolist() == [5, -100, -100]
    assert batch["attention_mask"][1].tolist() == [1, 0, 0]


# -- clear errors ------------------------------------------------------------------------------------------------------
def test_missing_file_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_file=.*nope.jsonl"):
        load_raw_datasets(train_file=str(tmp_path / "nope.jsonl"))


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_raw_datasets(train_file=str(tmp_path / "empty.jsonl"))


def test_unsupported_extension_lists_the_allowed_ones(tmp_path):
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DataError, match=r"unsupported extension '\.xml'.*\.jsonl"):
        load_raw_datasets(train_file=str(tmp_path / "d.xml"))


def test_unrecognised_columns_name_the_columns_and_the_expected_ones():
    with pytest.raises(DataError, match=r"\['question', 'answer'\].*'prompt' \+ 'completion'"):
        detect_format(["question", "answer"])
    with pytest.raises(DataError, match=r"needs the column\(s\) \['messages'\]"):
        detect_format(["prompt", "completion"], data_format="messages")


def test_chat_data_needs_a_chat_template(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(DataError, match="no chat template"):
        _tokenize(tmp_path, tokenizer, [{"messages": messages}], chat_template="never")


def test_all_rows_skipped_is_an_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="Every row of the train split was skipped"):
        _tokenize(tmp_path, tokenizer, [{"prompt": "x" * 80, "completion": "y"}], max_seq_length=16)


def test_malformed_json_names_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    with pytest.raises(DataError, match="bad.jsonl"):
        load_raw_datasets(train_file=str(path))


def test_the_skip_table_lists_the_first_lines_of_the_file_in_order():
    """The split is shuffled: the table shows the smallest line numbers of each reason, sorted, and says when there
    are more."""
    from collections import Counter

    from hf_lisa.data.validation import skip_table

    table = skip_table(Counter({"empty prompt": 7, "longer than max_seq_length=64": 2}),
                       {"empty prompt": [3, 4, 9, 12, 15], "longer than max_seq_length=64": [8, 20]}, "line")
    assert table.splitlines()[1:] == [
        "  empty prompt                        7  3, 4, 9, 12, 15, ...",
        "  longer than max_seq_length=64       2  8, 20",
    ]
