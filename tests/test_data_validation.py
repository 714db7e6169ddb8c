"""Training data validated row by row before tokenisation: one table of bad (and borderline) inputs, each with its
expected outcome: a clear error naming the file and line, a skip counted under the right reason, or correct training.

Every case runs ``load_raw_datasets`` then ``tokenize_datasets`` (what ``hf-lisa train`` does) on a character-level
tokenizer, with a spy on the tokenizer: no case may hand it (or its chat template) a string longer than 100 000
characters, so a huge row is never tokenised whole.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from train_fixtures import (
    build_char_tokenizer,
    build_tiny_lm_dir,
    copy_task_rows,
    write_jsonl,
)

from hf_lisa.data.pipeline import (
    IGNORE_INDEX,
    DataError,
    load_raw_datasets,
    tokenize_datasets,
)

ERROR, SKIPPED, TRAINED = "error", "skipped", "trained"
HUGE, LARGE = 54_000_000, 5_000_000  # the 54 MB and 5 MB rows
PC = {"prompt": "say a", "completion": "aaa"}


def chat(*turns: tuple[str, Any], **extra) -> dict:
    return {"messages": [{"role": role, "content": content, **extra} for role, content in turns]}


CHAT = chat(("user", "hi"), ("assistant", "yo"))
Content = bytes | list | Callable[[], bytes]


@dataclass
class Case:
    """One input: ``train`` (rows as JSON Lines, raw bytes, or a function returning bytes) and its expected outcome.

    ``fragments`` must all appear in the error (``ERROR``); for ``SKIPPED`` the first fragment is the skip reason and
    ``lines`` the lines it must list; for ``TRAINED`` the rows must all be kept (``kept`` of them), and ``first`` is
    the text of the first row that the loss covers, when given.
    """

    id: str
    train: Content
    outcome: str
    fragments: tuple[str, ...] = ()
    lines: list[int] = field(default_factory=list)
    kept: int = 0
    first: str | None = None
    name: str = "train.jsonl"
    validation: Content | None = None
    options: dict = field(default_factory=dict)


def _jsonl(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def _csv(text: str) -> bytes:
    return text.encode()


CASES = [
    # -- mixed formats: refused, with the lines of both kinds ----------------------------------------------------------
    Case("mixed-chat-and-text", [CHAT, {"text": "hello"}, CHAT], ERROR,
         ("train.jsonl' mixes row formats", "chat rows ('messages') at line 1, 3",
          "plain text rows ('text') at line 2")),
    Case("mixed-prompt-completion-and-text", [PC, PC, {"text": "hello"}], ERROR,
         ("mixes row formats", "prompt/completion rows", "at line 1, 2 (2 rows)", "('text') at line 3 (1 row)")),
    Case("mixed-chat-and-prompt-completion", [CHAT, PC], ERROR,
         ("mixes row formats", "('prompt', 'completion') at line 2")),
    Case("mixed-csv-rows", _csv("prompt,completion,text\nsay a,aaa,\n,,hello\n"), ERROR,
         ("train.csv' mixes row formats", "('text') at row 2"), name="train.csv"),
    Case("mixed-only-in-validation-file", [PC, PC], ERROR,
         ("validation_file=", "validation.jsonl' mixes row formats", "at line 2"), validation=[PC, {"text": "t"}]),
    # -- the validation file against the training file -----------------------------------------------------------------
    Case("validation-columns-differ", [PC, PC], ERROR,
         ("validation.jsonl' has the columns ['question', 'answer']", "train.jsonl' is prompt/completion data",
          "the validation data lacks ['prompt', 'completion']"),
         validation=[{"question": "q", "answer": "a"}]),
    Case("validation-other-format", [PC, PC], ERROR, ("validation.jsonl' has the columns ['messages']",
                                                        "train.jsonl' is prompt/completion data"),
         validation=[CHAT]),
    # -- reading the file: decoding, JSON, empty -----------------------------------------------------------------------
    Case("non-utf8-byte", b'{"prompt": "caf\xe9", "completion": "x"}\n', ERROR,
         ("train.jsonl', line 1, column 16: the byte 0xe9 is not UTF-8", "Expected UTF-8 text")),
    Case("non-utf8-byte-on-line-3", _jsonl([PC, PC]) + b'{"text": "\xff"}\n', ERROR, ("line 3, column 11",
                                                                                  "byte 0xff")),
    Case("non-utf8-csv", b"prompt,completion\nsay a,caf\xe9\n", ERROR, ("train.csv', line 2, column 10", "0xe9"),
         name="train.csv"),
    Case("non-utf8-txt", b"hello\n\x80\n", ERROR, ("train.txt', line 2, column 1", "0x80"), name="train.txt"),
    Case("malformed-json-line", [PC, '{"prompt": '], ERROR,
         ("train.jsonl', line 2, column 12: invalid JSON (Expecting value)", "one JSON object per line")),
    Case("json-missing-quote", [PC, '{"prompt": "a, "completion": "b"}'], ERROR, ("line 2, column", "invalid JSON")),
    Case("json-line-is-a-list", [PC, "[1, 2]"], ERROR, ("line 2: expected a JSON object", "got a list")),
    Case("json-line-is-a-string", ['"just text"'], ERROR, ("line 1: expected a JSON object", "got a str")),
    Case("json-nan", ['{"prompt": NaN, "completion": "b"}'], ERROR, ("line 1: NaN is not valid JSON",)),
    Case("pretty-printed-object", b'{\n  "prompt": "a",\n  "completion": "b"\n}\n', ERROR,
         ("line 1, column 2: invalid JSON", "one JSON object per line")),
    Case("only-blank-lines", b"\n\n   \n\r\n", ERROR, ("train.jsonl' has no rows, only blank lines",)),
    Case("empty-file", b"", ERROR, ("train.jsonl' is empty",)),
    Case("empty-json-array", b"[]\n", ERROR, ("has no rows",), name="train.json"),
    Case("json-array-with-a-string", b'[\n {"prompt": "a", "completion": "b"},\n "x"\n]\n', ERROR,
         ("train.json', line 3: expected a JSON object",), name="train.json"),
    Case("json-array-missing-comma", b'[\n {"prompt": "a", "completion": "b"}\n {"prompt": "c"}\n]', ERROR,
         ("train.json', line 3, column 2", "expected ',' or ']'"), name="train.json"),
    Case("csv-header-only", _csv("prompt,completion\n"), ERROR, ("train.csv' has no rows",), name="train.csv"),
    Case("row-nested-too-deeply", lambda: _jsonl([PC, PC]) + b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000
         + b', "completion": "x"}\n', ERROR, ("train.jsonl', line 3 is nested too deeply", "not a valid row")),
    Case("array-element-nested-too-deeply", lambda: b'[\n {"prompt": "a", "completion": "b"},\n {"prompt": '
         + b"{\"a\": " * 10_000 + b"1" + b"}" * 10_000 + b"}\n]\n", ERROR,
         ("train.json', line 3 is nested too deeply", "not a valid row"), name="train.json"),
    Case("no-recognised-columns", [{"question": "q", "answer": "a"}], ERROR,
         ("train.jsonl': Cannot tell the data format from the columns ['question', 'answer']",)),
    # -- bad rows under --on_bad_row error: file, line and what is wrong -----------------------------------------------
    Case("error-empty-assistant-turn", [CHAT, chat(("user", "hi"), ("assistant", ""))], ERROR,
         ("train.jsonl', line 2: message 2 (assistant) has empty content (empty assistant turn)", "--on_bad_row skip"),
         options={"on_bad_row": "error"}),
    Case("error-completion-int", [PC, {"prompt": "a", "completion": 42}], ERROR,
         ("line 2: 'completion' is an int (42); expected a string",), options={"on_bad_row": "error"}),
    Case("error-content-list", [CHAT, chat(("user", "hi"), ("assistant", ["x"]))], ERROR,
         ("line 2: message 2 (assistant) has the content a list (['x']); expected a string",),
         options={"on_bad_row": "error"}),
    Case("error-unknown-role", [chat(("user", "hi"), ("bot", "yo"))], ERROR,
         ("line 1: message 2 has the role 'bot'; allowed: system, developer, user, assistant, tool",),
         options={"on_bad_row": "error"}),
    Case("on-bad-row-invalid-value", [PC], ERROR, ("on_bad_row='ignore' is invalid; allowed: ('skip', 'error')",),
         options={"on_bad_row": "ignore"}),
    Case("error-overlength-tokens", [{"prompt": "p", "completion": "c" * 200}], ERROR,
         ("train.jsonl', line 1 has 2", "tokens, more than max_seq_length=128"), options={"overlength": "error"}),
    Case("error-huge-row-not-tokenised", lambda: _jsonl([PC, {"prompt": "p", "completion": "x" * LARGE}]), ERROR,
         ("line 2 has 5000001 characters, more than max_seq_length=128 tokens", "not tokenised"),
         options={"overlength": "error"}),
    Case("every-row-skipped", [{"prompt": "", "completion": "x"}], ERROR,
         ("Every row of the train split was skipped", "train.jsonl': {'empty prompt': 1}")),
    # -- bad rows, skipped and counted under the right reason, with their lines ----------------------------------------
    Case("empty-assistant-turn", [CHAT, chat(("user", "hi"), ("assistant", "")), CHAT], SKIPPED,
         ("empty assistant turn",), [2], kept=2),
    Case("whitespace-assistant-turn", [CHAT, chat(("user", "hi"), ("assistant", " \n"))], SKIPPED,
         ("empty assistant turn",), [2], kept=1),
    Case("no-assistant-turn", [CHAT, chat(("system", "s"), ("user", "hi"))], SKIPPED, ("no assistant turn",), [2],
         kept=1),
    Case("content-list", [CHAT, chat(("user", "hi"), ("assistant", ["x"]))], SKIPPED, ("non-string content",), [2],
         kept=1),
    Case("content-parts", [CHAT, chat(("user", [{"type": "text", "text": "hi"}]), ("assistant", "yo"))], SKIPPED,
         ("non-string content",), [2], kept=1),
    Case("content-int", [CHAT, chat(("user", 7), ("assistant", "yo"))], SKIPPED, ("non-string content",), [2],
         kept=1),
    Case("content-null", [CHAT, chat(("user", None), ("assistant", "yo"))], SKIPPED, ("message without content",),
         [2], kept=1),
    Case("content-missing", [CHAT, {"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}],
         SKIPPED, ("message without content",), [2], kept=1),
    Case("role-missing", [CHAT, {"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}], SKIPPED,
         ("message without role",), [2], kept=1),
    Case("role-unknown", [CHAT, chat(("human", "hi"), ("assistant", "yo"))], SKIPPED, ("unknown role",), [2],
         kept=1),
    Case("role-not-a-string", [CHAT, chat((1, "hi"), ("assistant", "yo"))], SKIPPED, ("unknown role",), [2], kept=1),
    Case("empty-user-turn", [CHAT, chat(("user", ""), ("assistant", "yo"))], SKIPPED, ("empty user turn",), [2],
         kept=1),
    Case("empty-system-turn", [CHAT, chat(("system", ""), ("user", "hi"), ("assistant", "yo"))], SKIPPED,
         ("empty system turn",), [2], kept=1),
    Case("message-not-an-object", [CHAT, {"messages": ["hi", {"role": "assistant", "content": "yo"}]}], SKIPPED,
         ("message is not an object",), [2], kept=1),
    Case("messages-not-a-list", [CHAT, {"messages": "hi"}], SKIPPED, ("non-list messages",), [2], kept=1),
    Case("messages-empty-list", [CHAT, {"messages": []}], SKIPPED, ("empty messages",), [2], kept=1),
    Case("messages-null", [CHAT, {"messages": None}], SKIPPED, ("missing messages",), [2], kept=1),
    Case("completion-int", [PC, {"prompt": "a", "completion": 42}], SKIPPED, ("non-string completion",), [2],
         kept=1),
    Case("completion-list", [PC, {"prompt": "a", "completion": ["b"]}], SKIPPED, ("non-string completion",), [2],
         kept=1),
    Case("prompt-dict", [PC, {"prompt": {"a": 1}, "completion": "b"}], SKIPPED, ("non-string prompt",), [2], kept=1),
    Case("prompt-missing", [PC, {"completion": "b"}], SKIPPED, ("missing prompt",), [2], kept=1),
    Case("completion-null", [PC, {"prompt": "a", "completion": None}], SKIPPED, ("missing completion",), [2],
         kept=1),
    Case("completion-whitespace", [PC, {"prompt": "a", "completion": "  "}], SKIPPED, ("empty completion",), [2],
         kept=1),
    Case("row-without-format-columns", [PC, {"id": 3}], SKIPPED, ("missing prompt",), [2], kept=1),
    Case("text-empty", [{"text": "hello"}, {"text": ""}], SKIPPED, ("empty text",), [2], kept=1),
    Case("text-int", [{"text": "hello"}, {"text": 5}], SKIPPED, ("non-string text",), [2], kept=1),
    Case("csv-empty-cell", _csv("prompt,completion\nsay a,aaa\nsay b,\n"), SKIPPED, ("missing completion",), [2],
         kept=1, name="train.csv"),
    Case("txt-blank-line", b"hello\n\nworld\n", SKIPPED, ("empty text",), [2], kept=2, name="train.txt"),
    Case("lines-count-blank-lines", _jsonl([PC, "", "  ", {"prompt": "", "completion": "x"}]), SKIPPED,
         ("empty prompt",), [4], kept=1),
    Case("overlength-tokens", [PC, {"prompt": "p", "completion": "c" * 200}], SKIPPED,
         ("longer than max_seq_length=128",), [2], kept=1),
    Case("huge-row-54mb", lambda: _jsonl([PC, {"prompt": "p", "completion": "x" * HUGE}]), SKIPPED,
         ("longer than max_seq_length=128",), [2], kept=1),
    Case("large-chat-row-5mb", lambda: _jsonl([CHAT, chat(("user", "u" * LARGE), ("assistant", "yo"))]), SKIPPED,
         ("longer than max_seq_length=128",), [2], kept=1),
    # -- borderline inputs that are fine and train ---------------------------------------------------------------------
    Case("utf8-bom", b"\xef\xbb\xbf" + _jsonl([PC, PC]), TRAINED, kept=2, first="aaa</s>"),
    Case("crlf-line-ends", _jsonl([PC, PC]).replace(b"\n", b"\r\n"), TRAINED, kept=2),
    Case("non-ascii-text", [{"prompt": "say é", "completion": "ééé"}], TRAINED, kept=1),
    Case("json-array-file", b'[\n {"prompt": "a", "completion": "b"},\n {"prompt": "c", "completion": "d"}\n]\n',
         TRAINED, kept=2, name="train.json"),
    Case("csv-bom-crlf", b"\xef\xbb\xbfprompt,completion\r\nsay a,aaa\r\n", TRAINED, kept=1, first="aaa</s>",
         name="train.csv"),
    Case("txt-bom-crlf", b"\xef\xbb\xbfhello\r\nworld\r\n", TRAINED, kept=2, first="hello</s>", name="train.txt"),
    Case("system-tool-developer-roles", [chat(("system", "s"), ("developer", "d"), ("user", "hi"),
                                              ("assistant", "call"), ("tool", "42"), ("assistant", "it is 42"))],
         TRAINED, kept=1),
    Case("extra-message-keys", [chat(("user", "hi"), ("assistant", "yo"), name="bob")], TRAINED, kept=1),
    Case("extra-columns", [{**PC, "id": 1, "source": "x"}], TRAINED, kept=1),
    Case("prompt-completion-with-unused-text-column", [{**PC, "text": "ignored"}], TRAINED, kept=1),
    Case("validation-file-extra-column", [PC, PC], TRAINED, kept=2, validation=[{**PC, "id": 7}]),
    Case("large-row-truncated", lambda: _jsonl([{"prompt": "p", "completion": "x" * LARGE}]), TRAINED, kept=1,
         options={"overlength": "truncate"}),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def longest_input(tokenizer, monkeypatch) -> list[int]:
    """Records the length of the longest text handed to the tokenizer or its chat template."""
    seen = [0]
    cls = type(tokenizer)
    call, render = cls.__call__, cls.apply_chat_template

    def spy_call(self, text, *args, **kwargs):
        seen[0] = max(seen[0], len(text))
        return call(self, text, *args, **kwargs)

    def spy_render(self, conversation, *args, **kwargs):
        seen[0] = max([seen[0]] + [len(str(m.get("content"))) for m in conversation])
        return render(self, conversation, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", spy_call)
    monkeypatch.setattr(cls, "apply_chat_template", spy_render)
    return seen


def _trained_text(tokenizer, example: dict) -> str:
    return tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != IGNORE_INDEX])


def _write(path, content: Content) -> str:
    content = content() if callable(content) else content
    path.write_bytes(content if isinstance(content, bytes) else _jsonl(content))
    return str(path)


def _load_and_tokenize(tmp_path, tokenizer, case: Case):
    train = _write(tmp_path / case.name, case.train)
    validation = _write(tmp_path / "validation.jsonl", case.validation) if case.validation is not None else None
    raw = load_raw_datasets(train_file=train, validation_file=validation, validation_split_percentage=0,
                            line_numbers=True)
    return tokenize_datasets(raw, tokenizer, max_seq_length=128, load_from_cache_file=False, **case.options)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_data_table(case: Case, tmp_path, tokenizer, longest_input):
    if case.outcome == ERROR:
        with pytest.raises((DataError, FileNotFoundError)) as info:
            _load_and_tokenize(tmp_path, tokenizer, case)
        for fragment in case.fragments:
            assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"
    else:
        tokenized, report = _load_and_tokenize(tmp_path, tokenizer, case)
        if case.outcome == SKIPPED:
            (reason,) = case.fragments
            assert report.skipped["train"] == {reason: len(case.lines)}
            assert report.skipped_lines["train"] == {reason: case.lines}
        else:
            assert report.skipped["train"] == {}
        if case.first is not None:
            assert _trained_text(tokenizer, tokenized["train"][0]) == case.first
        assert report.kept["train"] == case.kept == len(tokenized["train"])
        for example in tokenized["train"]:
            assert len(example["input_ids"]) <= 128
            assert any(label != IGNORE_INDEX for label in example["labels"])
    assert longest_input[0] < 100_000  # a huge row is never tokenised (or rendered) whole


def test_the_table_covers_each_outcome():
    counts = {outcome: sum(c.outcome == outcome for c in CASES) for outcome in (ERROR, SKIPPED, TRAINED)}
    assert counts[ERROR] >= 30 and counts[SKIPPED] >= 25 and counts[TRAINED] >= 10, counts


# -- what the table does not show --------------------------------------------------------------------------------------
def test_skips_are_logged_as_a_table_with_their_lines(tmp_path, tokenizer, caplog):
    rows = [PC, {"prompt": "a", "completion": 42}, {"prompt": "", "completion": "b"}, {"prompt": "a", "completion": 1}]
    case = Case("log", rows, SKIPPED)
    with caplog.at_level(logging.WARNING, logger="hf_lisa.data.pipeline"):
        _load_and_tokenize(tmp_path, tokenizer, case)
    assert "Skipped 3 of 4 train rows (train_file=" in caplog.text
    table = caplog.text[caplog.text.index("reason"):].splitlines()
    assert table[0].split() == ["reason", "rows", "first", "lines"]
    assert table[1].split() == ["non-string", "completion", "2", "2,", "4"]
    assert table[2].split() == ["empty", "prompt", "1", "3"]


def test_an_empty_assistant_turn_among_good_ones_trains_on_the_good_rows_only(tmp_path, tokenizer):
    rows = [chat(("user", "hi"), ("assistant", "yo")), chat(("user", "hey"), ("assistant", "")),
            chat(("user", "ho"), ("assistant", "ok"))]
    tokenized, _ = _load_and_tokenize(tmp_path, tokenizer, Case("x", rows, TRAINED))
    assert [_trained_text(tokenizer, example) for example in tokenized["train"]] == ["yo</s>", "ok</s>"]


def test_lines_survive_the_validation_split(tmp_path, tokenizer):
    rows = [PC] * 9 + [{"prompt": "a", "completion": 42}] + [PC] * 10
    raw = load_raw_datasets(train_file=_write(tmp_path / "d.jsonl", rows), validation_split_percentage=50, seed=0,
                            line_numbers=True)
    _, report = tokenize_datasets(raw, tokenizer, max_seq_length=128, load_from_cache_file=False)
    lines = {split: found.get("non-string completion") for split, found in report.skipped_lines.items()}
    assert sorted(filter(None, lines.values())) == [[10]]


def test_without_line_numbers_messages_name_the_split_and_row(tmp_path, tokenizer):
    import datasets

    raw = datasets.DatasetDict({"train": datasets.Dataset.from_list([PC, {"prompt": "a", "completion": ""}])})
    with pytest.raises(DataError, match="the train split, row 2: 'completion' is empty"):
        tokenize_datasets(raw, tokenizer, max_seq_length=128, load_from_cache_file=False, on_bad_row="error")
    rows = [PC] * 9 + [{"prompt": "a", "completion": 42}] + [PC] * 10
    raw = load_raw_datasets(train_file=_write(tmp_path / "d.jsonl", rows), validation_split_percentage=50, seed=0)
    assert raw["train"].column_names == ["prompt", "completion"]  # no extra column unless asked for
    _, report = tokenize_datasets(raw, tokenizer, max_seq_length=128, load_from_cache_file=False)
    assert sum(found.get("non-string completion", 0) for found in report.skipped.values()) == 1


# -- hf-lisa train -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_lm_dir(tmp_path_factory.mktemp("validation_model") / "model", num_layers=2)


def _train_argv(model: str, train: str, output_dir, *extra: str) -> list[str]:
    return ["train", "--model_name_or_path", model, "--train_file", train, "--output_dir", str(output_dir),
            "--method", "full", "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none",
            "--use_cpu", "true", "--disable_tqdm", "true", "--save_strategy", "no", "--max_seq_length", "64",
            "--validation_split_percentage", "0", *extra]


def test_cli_refuses_mixed_formats_before_loading_the_model(tiny_model, tmp_path, monkeypatch, capsys):
    from hf_lisa import cli

    run_module = sys.modules["hf_lisa.train.run"]  # hf_lisa.train.run is also the name of the function

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(run_module, "load_model_and_tokenizer", no_model)
    train = write_jsonl(tmp_path / "mixed.jsonl", [PC, {"text": "hello"}])
    assert cli.main(_train_argv(tiny_model, train, tmp_path / "out")) == 2
    assert "mixed.jsonl' mixes row formats" in capsys.readouterr().err


def test_cli_on_bad_row_error_names_the_line(tiny_model, tmp_path, capsys):
    from hf_lisa import cli

    train = write_jsonl(tmp_path / "d.jsonl", copy_task_rows(4) + [{"prompt": "a", "completion": 42}])
    assert cli.main(_train_argv(tiny_model, train, tmp_path / "out", "--on_bad_row", "error")) == 2
    assert "d.jsonl', line 5: 'completion' is an int (42)" in capsys.readouterr().err


def test_skips_are_recorded_in_the_training_summary(tiny_model, tmp_path):
    from hf_lisa import cli

    train = write_jsonl(tmp_path / "d.jsonl", copy_task_rows(4) + [{"prompt": "a", "completion": ["b"]}])
    assert cli.main(_train_argv(tiny_model, train, tmp_path / "out")) == 0
    summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert summary["data"]["rows_skipped"] == {"train": {"non-string completion": 1}}
    assert summary["data"]["rows_kept"] == {"train": 4}
    assert summary["arguments"]["data"]["on_bad_row"] == "skip"
