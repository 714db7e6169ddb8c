"""``hf-lisa train --stage dpo``: the options that apply to it, and its data: preference rows (a prompt, a chosen and a
rejected response) checked, converted to the rows TRL's ``DPOTrainer`` reads, and the rows it cannot train on skipped
and counted, as the SFT path does (:mod:`.validation`, :mod:`.data`).

Rows, from ``--train_file`` / ``--dataset_name`` like SFT data (columns renamed with ``--prompt_column``,
``--chosen_column``, ``--rejected_column``):

* **strings**: ``prompt``, ``chosen``, ``rejected``. With a chat template (``--chat_template auto`` and a tokenizer that
  has one, or ``always``), the prompt becomes a user turn and each response an assistant turn, as SFT renders
  prompt/completion rows; with ``never``, TRL tokenises ``prompt + response`` as plain text and appends EOS.
* **chat messages** (TRL's "conversational" form): ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``.
  The prompt is the ``prompt`` column (messages, or a string: one user turn), or, without that column, the turns the
  two conversations share (TRL's implicit prompt); turns that repeat the prompt at the start of a response are
  dropped from it.

Checked before the model loads (:func:`check_preference_data`): the columns of every split, naming the file, the
columns found and those needed. Row by row (:func:`preference_datasets`): a missing, empty or non-string field, a bad
message, no shared prompt turn, no assistant turn in a response, or a chosen response equal to the rejected one is
skipped and counted (``--on_bad_row skip``) or an error naming the file and line (``error``). Once TRL has tokenised
the rows, :func:`apply_length_policy` applies ``--overlength`` to ``--max_seq_length`` (TRL's ``max_length``). Pairs
held out of the training rows for evaluation (``--validation_split_percentage``) are drawn after skipping, as SFT's
rows are: a skipped held-out pair is replaced by a kept training pair (:func:`hold_out_after_skipping`).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import reprlib
from collections import Counter
from typing import Any, NamedTuple, Optional

from ..errors import UsageError
from .validation import LINE_COLUMN, ROLES, DataError, data_columns, location_of, skip_table, source_of, unit_of, \
    with_locations

logger = logging.getLogger("hf_lisa.train")

SFT, DPO = "sft", "dpo"
#: the values of ``--stage``
STAGES = (SFT, DPO)
#: the ``TokenizationReport.data_format`` of preference rows (the card's data table names it)
PREFERENCE_FORMAT = "preference"
#: what the before/after line and the summary keep of a DPO evaluation (TRL's metric names)
DPO_EVAL_METRICS = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins")
SKIP = "_hf_lisa_skip"
SKIP_EXAMPLES = 5  # lines listed per skip reason
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist = _repr.maxdict = 3

#: the data options that only SFT uses, and why --stage dpo does not (refused when given)
_SFT_ONLY = {
    "completion_column": "preference rows have chosen/rejected columns",
    "messages_column": "chat preference rows keep their messages in the chosen/rejected columns",
    "text_column": "preference rows have chosen/rejected columns",
    "completion_only_loss": "the DPO loss covers the responses only",
    "packing": "TRL's DPOTrainer does not pack pairs",
    "eval_generation_samples": "a DPO run is scored by its reward accuracy and margins, not by generation exact match",
    "answer_pattern": "no generation exact match runs with --stage dpo",
    "answer_lenient": "no generation exact match runs with --stage dpo",
    "generation_max_new_tokens": "no generation exact match runs with --stage dpo",
}
#: the options that only --stage dpo uses (refused with --stage sft when given)
_DPO_ONLY = ("chosen_column", "rejected_column", "dpo_beta")


class PreferenceColumns(NamedTuple):
    """The column names of preference rows (``--prompt_column``, ``--chosen_column``, ``--rejected_column``)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"

    @classmethod
    def of(cls, data_args) -> "PreferenceColumns":
        return cls(data_args.prompt_column, data_args.chosen_column, data_args.rejected_column)


# -- options -----------------------------------------------------------------------------------------------------------
def _given(args, name: str, typed=None) -> bool:
    """Whether the option ``name`` was given: typed (``typed``, the names the command line and the config file
    hold), or, for arguments built in Python (``typed`` None), set to another value than its default.
    ``--eval_generation_samples 0`` (off) is never given."""
    f = next(f for f in dataclasses.fields(args) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    value = getattr(args, name)
    given = name in typed if typed is not None else value != default
    return given and not (name == "eval_generation_samples" and value == 0)


def check_stage_options(data_args, lisa_args, training_args=None, typed=None) -> None:
    """Refuse the options that ``--stage`` does not use (given: :func:`_given`), naming each with why (a
    ``UsageError``); run by :func:`hf_lisa.train.parsing.arguments.validate_args`."""
    stage = lisa_args.stage
    if stage not in STAGES:
        raise UsageError(f"--stage={stage!r} is invalid; allowed: {', '.join(STAGES)}.")
    if stage == SFT:
        given = [f"--{name}={getattr(args, name)!r}" for args in (data_args, lisa_args) for name in _DPO_ONLY
                 if hasattr(args, name) and _given(args, name, typed)]
        if given:
            raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --stage dpo only; pass "
                             "--stage dpo, or remove the option(s).")
        return
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise UsageError("--stage dpo runs TRL's DPOTrainer, which is not installed: pip install 'hf-lisa[trl]'.")
    refused = [f"--{name}={getattr(data_args, name)!r} ({why})" for name, why in _SFT_ONLY.items()
               if hasattr(data_args, name) and _given(data_args, name, typed)]
    if data_args.data_format != "auto":
        refused.append(f"--data_format={data_args.data_format!r} (preference rows are recognised from the "
                       "prompt/chosen/rejected columns)")
    if getattr(lisa_args, "lisa_dropout", 0.0):
        refused.append(f"--lisa_dropout={lisa_args.lisa_dropout!r} (TRL's DPOTrainer turns dropout off, so that the "
                       "policy and the reference are the same function at the start)")
    if getattr(training_args, "label_smoothing_factor", 0.0):
        refused.append(f"--label_smoothing_factor={training_args.label_smoothing_factor!r} (the Trainer's label "
                       "smoother is not part of the DPO loss)")
    if training_args is not None and not training_args.chunked_loss:
        refused.append("--chunked_loss=False (TRL's DPOTrainer computes the log-probabilities through its fused LM "
                       "head, a tile of positions at a time: the vocabulary-sized logits are never built)")
    if refused:
        raise UsageError(f"--stage dpo does not use {'; '.join(refused)}. Remove the option(s), or use --stage sft.")


def refuse_bundled_task() -> None:
    """``--stage dpo`` without ``--train_file`` or ``--dataset_name``: a ``UsageError`` (the bundled task has no
    pairs)."""
    raise UsageError("--stage dpo needs preference rows (prompt, chosen, rejected): pass --train_file or "
                     "--dataset_name (the bundled task is prompt/completion data).")


# -- columns, before the model loads -----------------------------------------------------------------------------------
def _kind(feature) -> Optional[str]:
    """``"text"`` (strings), ``"messages"`` (lists), ``"null"`` (no value in any row) or ``None`` (anything else)."""
    import datasets

    if isinstance(feature, datasets.Value):
        return {"string": "text", "large_string": "text", "null": "null"}.get(feature.dtype)
    lists = tuple(getattr(datasets, name) for name in ("Sequence", "List", "LargeList") if hasattr(datasets, name))
    if isinstance(feature, (list, *lists)):  # List and LargeList: datasets >= 4
        return "messages"
    return None


def check_preference_data(raw, data_args) -> str:
    """The columns of every split, before the model loads; returns the responses' form: ``"text"`` or ``"messages"``.

    Raises:
        DataError: a split without the chosen/rejected columns (or the prompt column, for string responses), a column
            of another type than strings or chat messages, responses of two forms, or a validation split whose form
            differs from train's; each names the file, the columns found and the ones needed.
    """
    columns = PreferenceColumns.of(data_args)
    splits = with_locations(raw)
    forms = {}
    for split, ds in splits.items():
        found = data_columns(ds)
        needed = [columns.chosen, columns.rejected]
        missing = [c for c in needed if c not in found]
        if missing:
            raise DataError(
                f"{source_of(ds)} has the columns {found}, but --stage dpo needs preference rows: "
                f"'{columns.chosen}' and '{columns.rejected}' (--chosen_column, --rejected_column) and "
                f"'{columns.prompt}' (--prompt_column; optional when the responses are chat messages that start with "
                f"the prompt's turns). Missing: {missing}."
            )
        kinds = {c: _kind(ds.features[c]) for c in (*needed, columns.prompt) if c in found}
        for column, kind in kinds.items():
            if kind is None:
                raise DataError(f"{source_of(ds)}: the column '{column}' holds {ds.features[column]}; expected strings "
                                "or lists of chat messages ({\"role\": ..., \"content\": ...}).")
        responses = {kinds[c] for c in needed} - {"null"}
        if len(responses) > 1:
            raise DataError(f"{source_of(ds)}: '{columns.chosen}' is {kinds[columns.chosen]} and '{columns.rejected}' "
                            f"is {kinds[columns.rejected]}; both responses must be strings, or both chat messages.")
        form = responses.pop() if responses else "text"
        if form == "text" and columns.prompt not in found:
            raise DataError(
                f"{source_of(ds)} has the columns {found}: string responses need a '{columns.prompt}' column "
                "(--prompt_column); only chat-message responses can carry their prompt as shared first turns."
            )
        forms[split] = (form, ds)
    train_form, train = forms.pop("train")
    for split, (form, ds) in forms.items():
        if form != train_form:
            raise DataError(f"{source_of(ds)} has {form} responses, but {source_of(train)} has {train_form} responses: "
                            f"give the {split} data the same form.")
    return train_form


# -- rows --------------------------------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({_repr.repr(value)})"


def _text_problem(value: Any, column: str) -> Optional[tuple[str, str]]:
    if value is None:
        return f"missing {column}", f"it has no '{column}' (or it is null)"
    if not isinstance(value, str):
        return f"non-string {column}", f"'{column}' is {_describe(value)}; expected a string"
    if not value.strip():
        return f"empty {column}", f"'{column}' is empty"
    return None


def _messages_problem(value: Any, column: str, needs_assistant: bool) -> Optional[tuple[str, str]]:
    if value is None:
        return f"missing {column}", f"it has no '{column}' (or it is null)"
    if not isinstance(value, list):
        return f"non-list {column}", f"'{column}' is {_describe(value)}; expected a list of messages"
    if not value:
        return f"empty {column}", f"'{column}' has no turns"
    for i, message in enumerate(value, 1):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES:
            return "bad message", f"'{column}' message {i} has the role {_repr.repr(role)}; allowed: {', '.join(ROLES)}"
        if not isinstance(content, str) or not content.strip():
            return "bad message", f"'{column}' message {i} ({role}) has the content {_describe(content)}; expected text"
    if needs_assistant and not any(m["role"] == "assistant" for m in value):
        return f"no assistant turn in {column}", f"'{column}' has no assistant message, so nothing would be trained"
    return None


def _turns(messages: list) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _shared_turns(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def preference_row(row: dict, columns: PreferenceColumns, form: str, chat: bool, on_bad_row: str,
                   where: str = "row") -> dict:
    """One row as TRL reads it: ``prompt``, ``chosen``, ``rejected`` (strings, or chat turns when ``chat``), and
    ``SKIP`` (why it cannot be trained on, empty when it can); see the module docstring for the conversion."""
    prompt, chosen, rejected = (row.get(c) for c in columns)
    empty = [] if chat else ""
    out = {"prompt": empty, "chosen": empty, "rejected": empty, SKIP: ""}
    problem = None
    if form == "text":
        problem = next(filter(None, (_text_problem(row.get(c), c) for c in columns)), None)
        if problem is None and chat:
            prompt = [{"role": "user", "content": prompt}]
            chosen, rejected = ([{"role": "assistant", "content": r}] for r in (chosen, rejected))
    else:
        problem = next(filter(None, (_messages_problem(row.get(c), c, needs_assistant=True)
                                     for c in (columns.chosen, columns.rejected))), None)
        if problem is None and columns.prompt in row:
            problem = (_text_problem(prompt, columns.prompt) if isinstance(prompt, str) or prompt is None
                       else _messages_problem(prompt, columns.prompt, needs_assistant=False))
        if problem is None:
            chosen, rejected = _turns(chosen), _turns(rejected)
            if columns.prompt in row:  # an explicit prompt; responses that repeat it start after it
                prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _turns(prompt)
                if chosen[:len(prompt)] == prompt and rejected[:len(prompt)] == prompt:
                    chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
            else:  # TRL's implicit prompt: the turns both conversations share
                shared = _shared_turns(chosen, rejected)
                if shared == 0:
                    problem = ("no shared prompt turns", f"'{columns.chosen}' and '{columns.rejected}' share no first "
                               f"turn, and there is no '{columns.prompt}' column")
                prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            for column, response in ((columns.chosen, chosen), (columns.rejected, rejected)):
                if problem is None and not any(m["role"] == "assistant" for m in response):
                    problem = (f"no assistant turn in {column}", f"'{column}' has no assistant turn after the prompt")
    if problem is None and chosen == rejected:
        problem = ("chosen equals rejected", f"'{columns.chosen}' and '{columns.rejected}' are the same: no preference")
    if problem is not None:
        reason, detail = problem
        if on_bad_row == "error":
            raise DataError(f"{where} {row.get(LINE_COLUMN, '?')}: {detail} ({reason}). Fix the row, or pass "
                            "--on_bad_row skip to skip such rows (they are counted and listed).")
        out[SKIP] = reason
        return out
    out.update(prompt=prompt, chosen=chosen, rejected=rejected)
    return out


def _skips(split: str, source, reasons: Counter, every_line: dict, report) -> None:
    """Record ``reasons`` (and their first lines) in ``report`` and log them as one table."""
    lines = {why: heapq.nsmallest(SKIP_EXAMPLES, found) for why, found in every_line.items()}
    skipped = report.skipped.setdefault(split, {})
    for why, n in reasons.items():
        skipped[why] = skipped.get(why, 0) + n
    shown = report.skipped_lines.setdefault(split, {})
    for why, found in lines.items():
        shown[why] = heapq.nsmallest(SKIP_EXAMPLES, shown.get(why, []) + found)
    if reasons:
        logger.warning("Skipped %d %s rows (%s):\n%s", sum(reasons.values()), split, source_of(source),
                       skip_table(reasons, lines, unit_of(source)))


def preference_datasets(raw, tokenizer, data_args, held_out: int = 0):
    """Check and convert every split's rows for TRL's ``DPOTrainer`` (:func:`preference_row`), dropping and counting
    the rows it cannot train on. ``held_out``: the validation rows were held out of the training rows (``> 0``); then
    a validation split left empty is kept (:func:`hold_out_after_skipping` refills it from the training pairs).

    Returns:
        ``(DatasetDict of prompt/chosen/rejected rows with LINE_COLUMN, TokenizationReport)``.

    Raises:
        DataError: chat-message rows without a chat template, a bad row with ``--on_bad_row error``, or a split where
            every row was skipped (but a held-out validation split).
    """
    import datasets

    from .pipeline import TokenizationReport, use_chat_template

    form = check_preference_data(raw, data_args)
    chat = use_chat_template(tokenizer, data_args.chat_template)
    if form == "messages" and not chat:
        raise DataError("The preference rows are chat messages, but the tokenizer has no chat template (or "
                        "--chat_template never); set one, or give the rows as strings.")
    columns = PreferenceColumns.of(data_args)
    report = TokenizationReport(data_format=PREFERENCE_FORMAT)
    converted = {}
    for split, ds in with_locations(raw).items():
        mapped = ds.map(
            preference_row,
            fn_kwargs={"columns": columns, "form": form, "chat": chat, "on_bad_row": data_args.on_bad_row,
                       "where": location_of(ds)},
            remove_columns=data_columns(ds), num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache, desc=f"Checking {split} preference rows",
        )
        reasons, every_line = Counter(), {}
        for why, line in zip(mapped[SKIP], mapped[LINE_COLUMN]):
            if why:
                reasons[why] += 1
                every_line.setdefault(why, []).append(line)
        kept = mapped.filter(lambda why: not why, input_columns=[SKIP], desc=f"Dropping skipped {split} rows")
        _skips(split, ds, reasons, every_line, report)
        if len(kept) == 0 and not (held_out and split == "validation"):
            raise DataError(f"Every row of the {split} split was skipped ({source_of(ds)}: {dict(reasons)}). Check "
                            "the columns (--prompt_column, --chosen_column, --rejected_column).")
        converted[split] = kept.remove_columns([SKIP])
        report.kept[split] = len(kept)
    return datasets.DatasetDict(converted), report


# -- lengths, once TRL has tokenised the rows --------------------------------------------------------------------------
def apply_length_policy(prepared, lines: list, source, split: str, max_seq_length: int, overlength: str, report,
                        required: bool = True):
    """``--overlength`` on the rows TRL tokenised (``prompt_ids``, ``chosen_ids``, ``rejected_ids``), returning the rows
    to train on, without ``LINE_COLUMN``. ``required=False``: a split left empty is returned (a held-out split that
    :func:`hold_out_after_skipping` refills).

    A pair is too long when its prompt and its longer response exceed ``max_seq_length`` tokens: ``skip`` drops and
    counts it, ``error`` stops naming it, ``truncate`` keeps it (TRL's collator keeps the first ``max_seq_length``
    tokens of each sequence). TRL drops the rows whose prompt alone fills ``max_seq_length`` (``lines``, the rows it was
    given, tells which): counted (``skip``/``truncate``) or an error (``error``).

    Raises:
        DataError: a row too long with ``error``, or a ``required`` split where every row was skipped.
    """
    dropped = sorted((Counter(lines) - Counter(prepared[LINE_COLUMN])).elements())
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in
               zip(prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"])]
    too_long = [i for i, n in enumerate(lengths) if n > max_seq_length]
    where = location_of(source)
    if overlength == "error" and (dropped or too_long):
        problem = (f"{where} {dropped[0]}: its prompt alone fills" if dropped else
                   f"{where} {prepared[LINE_COLUMN][too_long[0]]} has {lengths[too_long[0]]} tokens (prompt and longer "
                   "response), more than")
        raise DataError(f"{problem} max_seq_length={max_seq_length}. Raise --max_seq_length, or pass --overlength "
                        "skip|truncate.")
    reasons, every_line = Counter(), {}
    if dropped:
        why = f"prompt fills max_seq_length={max_seq_length}"
        reasons[why], every_line[why] = len(dropped), dropped
    if too_long and overlength == "skip":
        why = f"longer than max_seq_length={max_seq_length}"
        reasons[why], every_line[why] = len(too_long), [prepared[LINE_COLUMN][i] for i in too_long]
        drop = set(too_long)
        prepared = prepared.select([i for i in range(len(prepared)) if i not in drop])
    _skips(split, source, reasons, every_line, report)
    if len(prepared) == 0 and required:
        raise DataError(f"Every row of the {split} split was skipped ({source_of(source)}: "
                        f"{dict(report.skipped.get(split, {}))}). Check --max_seq_length.")
    report.kept[split] = len(prepared)
    return prepared.remove_columns([LINE_COLUMN])


# -- the held-out pairs, drawn after skipping --------------------------------------------------------------------------
def hold_out_after_skipping(train, validation, rows, seed: int, report, percentage: float):
    """The pairs held out for evaluation (out of the training pairs, ``--validation_split_percentage``) drawn *after*
    skipping, as the SFT path holds out its rows (issue 33, item 11): the ``given`` held-out pairs that were skipped
    (bad, or too long) are replaced by kept training pairs (drawn with ``seed``, so every run and a resumed one
    evaluate on the same pairs; one pair always stays to train), and their skips are counted as training rows of the
    source. ``train``/``validation``: the tokenised pairs kept (``validation`` ``None`` when none was) of the
    converted ``rows`` (:func:`preference_datasets`). Returns ``(train, validation)``; nothing skipped: the splits as
    they are.

    Raises:
        DataError: every held-out pair skipped and no training pair left to take their place.
    """
    import datasets
    import numpy as np

    source, kept = rows["validation"], 0 if validation is None else len(validation)
    short = report.total_skipped("validation")  # every held-out pair was kept or skipped
    given = kept + short
    for why, n in report.skipped.pop("validation", {}).items():  # held out after skipping: rows of the source
        report.skipped.setdefault("train", {})[why] = report.skipped.get("train", {}).get(why, 0) + n
    lines = report.skipped_lines.pop("validation", {})
    if lines and location_of(source) == location_of(rows["train"]):  # the same numbers (a folder's differ)
        shown = report.skipped_lines.setdefault("train", {})
        for why, found in lines.items():
            shown[why] = heapq.nsmallest(SKIP_EXAMPLES, shown.get(why, []) + found)
    if short > 0:
        take = min(short, max(0, len(train) - 1))
        if kept + take == 0:
            raise DataError(
                f"Every pair held out for evaluation ({given} of {source_of(source)}, "
                f"--validation_split_percentage={percentage:g}) was skipped, and no training pair is left to take "
                f"their place ({len(train)} kept). Check --max_seq_length and the rows, pass --validation_file, or "
                "--validation_split_percentage 0 to train without evaluation."
            )
        moved = np.sort(np.random.default_rng(seed % 2**64).choice(len(train), size=take, replace=False))
        logger.warning("%s: %d of the %d pairs held out for evaluation were skipped; %d of its training pairs are "
                       "held out in their place (the held-out pairs are drawn from the pairs kept).",
                       source_of(source), short, given, take)
        rest = np.setdiff1d(np.arange(len(train)), moved)
        replacement = train.select(moved)
        validation = replacement if validation is None or kept == 0 else \
            datasets.concatenate_datasets([replacement, validation])
        train = train.select(rest)
    report.kept.update(train=len(train), validation=len(validation))
    return train, validation
