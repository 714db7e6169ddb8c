"""Alpaca and ShareGPT rows: their checks, and their conversion to the rows :mod:`hf_lisa.data.pipeline` tokenises.

* **Alpaca** (``instruction`` and ``output``; optional ``input`` and ``system``). With a chat template: an optional
  system turn, a user turn (the instruction, then the input after a blank line when it is not empty) and the output as
  the assistant's turn. Without one (a base model's tokenizer, ``--chat_template never``): the Stanford Alpaca prompt
  (:func:`alpaca_prompt`) as the prompt and the output as the completion, followed by EOS.
* **ShareGPT** (``conversations``, a list of ``{"from", "value"}`` turns; an optional ``system`` column): each turn
  becomes a chat message, its role from :data:`SHAREGPT_ROLES`; it needs a chat template, like ``messages`` rows.

The loss then falls as for the native formats: on the assistant turns (the completion) only, or on every token with
``--completion_only_loss false``. The column names are fixed (the formats' own); rename other columns before training.

Example:
    ```py
    >>> canonical_row({"instruction": "Add.", "input": "2+2", "output": "4"}, "alpaca", chat=True)
    ({'messages': [{'role': 'user', 'content': 'Add.\\n\\n2+2'}, {'role': 'assistant', 'content': '4'}]}, 'messages')
    ```
"""

from __future__ import annotations

from .validation import (
    ALPACA_COLUMNS,
    DATA_FORMATS,
    SHAREGPT_COLUMN,
    BadRow,
    Columns,
    _check_string,
    _describe,
    _repr,
    check_row as check_native_row,
)

ALPACA, SHAREGPT = "alpaca", "sharegpt"
CONVERTED_FORMATS = (ALPACA, SHAREGPT)
CHAT_FORMATS = ("messages", SHAREGPT)  # rows that only a chat template can render
#: ShareGPT's ``from`` -> chat role. ``function_call`` (the model's call of a tool, LLaMA-Factory's name) is the
#: assistant's and trained; ``observation`` (the tool's answer) is a tool turn.
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "tool": "tool", "function_call": "assistant", "observation": "tool",
}
ALPACA_PREAMBLE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.")
ALPACA_PREAMBLE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request."
)

__all__ = [
    "CHAT_FORMATS", "CONVERTED_FORMATS", "SHAREGPT_ROLES", "alpaca_prompt", "canonical_row", "check_format_arguments",
    "check_row",
]


# -- checks ------------------------------------------------------------------------------------------------------------
def _optional_string(row: dict, column: str) -> BadRow | None:
    value = row.get(column)
    if value is not None and not isinstance(value, str):
        return BadRow(f"non-string {column}", f"'{column}' is {_describe(value)}; expected a string (or no value)")
    return None


def _check_alpaca(row: dict) -> BadRow | None:
    for column in ALPACA_COLUMNS:  # instruction, output
        bad = _check_string(row, column)
        if bad:
            return bad
    return _optional_string(row, "input") or _optional_string(row, "system")


def _check_sharegpt(row: dict) -> BadRow | None:
    turns = row.get(SHAREGPT_COLUMN)
    if turns is None:
        return BadRow(f"missing {SHAREGPT_COLUMN}", f"it has no '{SHAREGPT_COLUMN}' (or it is null)")
    if not isinstance(turns, list):
        return BadRow(f"non-list {SHAREGPT_COLUMN}",
                      f"'{SHAREGPT_COLUMN}' is {_describe(turns)}; expected a list of {{\"from\", \"value\"}} turns")
    if not turns:
        return BadRow(f"empty {SHAREGPT_COLUMN}", f"'{SHAREGPT_COLUMN}' is an empty list")
    bad = _optional_string(row, "system")
    if bad:
        return bad
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            return BadRow("turn is not an object",
                          f"turn {i} is {_describe(turn)}; expected an object {{\"from\": ..., \"value\": ...}}")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker is None:
            hint = (" (it has 'role': for role/content turns pass --data_format messages --messages_column "
                    f"{SHAREGPT_COLUMN})") if turn.get("role") is not None else ""
            return BadRow("turn without from", f"turn {i} has no 'from'{hint}")
        if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
            return BadRow("unknown from",
                          f"turn {i} has 'from': {_repr.repr(speaker)}; allowed: {', '.join(SHAREGPT_ROLES)}")
        if value is None:
            return BadRow("turn without value", f"turn {i} ({speaker}) has no 'value'")
        if not isinstance(value, str):
            return BadRow("non-string value",
                          f"turn {i} ({speaker}) has the value {_describe(value)}; expected a string")
        if not value.strip():
            return BadRow(f"empty {speaker} turn", f"turn {i} ({speaker}) has an empty value")
    if (row.get("system") or "").strip() and SHAREGPT_ROLES[turns[0]["from"]] == "system":
        return BadRow("two system prompts", "it has a 'system' value and a system turn; keep one")
    if not any(SHAREGPT_ROLES[turn["from"]] == "assistant" for turn in turns):
        return BadRow("no gpt turn", "it has no gpt (assistant) turn, so nothing would be trained")
    return None


def check_row(row: dict, data_format: str, columns: Columns) -> BadRow | None:
    """Why ``row`` cannot be trained on as ``data_format`` (any of the five formats), or None when it can.

    Alpaca: ``instruction`` and ``output`` non-empty strings, ``input`` and ``system`` strings or absent. ShareGPT:
    ``conversations`` a non-empty list of turns whose ``from`` is in :data:`SHAREGPT_ROLES` and whose ``value`` is a
    non-empty string, with at least one assistant (``gpt``) turn. The native formats: :func:`.validation.check_row`.
    """
    if data_format == ALPACA:
        return _check_alpaca(row)
    if data_format == SHAREGPT:
        return _check_sharegpt(row)
    return check_native_row(row, data_format, columns)


# -- conversion --------------------------------------------------------------------------------------------------------
def alpaca_prompt(instruction: str, input: str | None = None, system: str | None = None) -> str:
    """The Stanford Alpaca prompt (``### Instruction:`` ... ``### Response:\\n``), used without a chat template; a
    ``system`` text replaces its opening sentence."""
    has_input = bool(input and input.strip())
    head = system if system and system.strip() else (ALPACA_PREAMBLE_WITH_INPUT if has_input else ALPACA_PREAMBLE)
    prompt = f"{head}\n\n### Instruction:\n{instruction}\n\n"
    if has_input:
        prompt += f"### Input:\n{input}\n\n"
    return prompt + "### Response:\n"


def _alpaca_messages(row: dict) -> list[dict]:
    system, user = row.get("system"), row["instruction"]
    if row.get("input") and row["input"].strip():
        user += "\n\n" + row["input"]
    head = [{"role": "system", "content": system}] if system and system.strip() else []
    return head + [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def _sharegpt_messages(row: dict) -> list[dict]:
    system = row.get("system")
    head = [{"role": "system", "content": system}] if system and system.strip() else []
    return head + [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in row[SHAREGPT_COLUMN]]


def canonical_row(row: dict, data_format: str, chat: bool) -> tuple[dict, str]:
    """A row that passed :func:`check_row`, as a row of a native format in the default column names (``Columns()``).

    Alpaca becomes ``{"messages": [...]}`` with a chat template (``chat``) and ``{"prompt", "completion"}`` without;
    ShareGPT becomes ``{"messages": [...]}``. Rows of the native formats come back unchanged.

    Returns:
        ``(row, its format)``.
    """
    if data_format == ALPACA:
        if chat:
            return {"messages": _alpaca_messages(row)}, "messages"
        prompt = alpaca_prompt(row["instruction"], row.get("input"), row.get("system"))
        return {"prompt": prompt, "completion": row["output"]}, "prompt_completion"
    if data_format == SHAREGPT:
        return {"messages": _sharegpt_messages(row)}, "messages"
    return row, data_format


# -- options -----------------------------------------------------------------------------------------------------------
def check_format_arguments(data_format: str, chat_template: str) -> None:
    """``--data_format`` and ``--chat_template``, before anything loads: the format's name, the template's name or
    file (:func:`.chat_templates.load_chat_template`), and a chat format never rendered without a template.

    Raises:
        UsageError: naming the option, the value and what is allowed.
    """
    from ..errors import UsageError
    from .chat_templates import load_chat_template

    if data_format not in DATA_FORMATS:
        raise UsageError(f"--data_format={data_format!r} is invalid; allowed: {', '.join(DATA_FORMATS)}.")
    load_chat_template(chat_template)
    if data_format in CHAT_FORMATS and chat_template == "never":
        raise UsageError(
            f"--data_format={data_format!r} rows are chats, which need a chat template, but --chat_template='never'; "
            "allowed with them: auto, always, a built-in name (e.g. chatml) or a Jinja file."
        )
