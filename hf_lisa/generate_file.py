"""``hf-lisa generate MODEL --prompts FILE --output OUT.jsonl``: one reply per prompt of a file, as JSON lines.

Prompts come from a ``.txt`` file (one per line) or a ``.jsonl`` file (a ``prompt`` string or a ``messages`` list per
line, or an Alpaca or ShareGPT row as ``hf-lisa train`` reads them, its reply left out of the prompt; every other
field is carried to the output, e.g. a ``completion`` or Alpaca ``output`` to compare with). Blank lines are skipped.
Each output line holds the row's carried fields, its ``prompt`` or ``messages``, and the ``generation``, in the input
order. The file is written beside its target and renamed into place when complete (an interrupted run leaves no half
file; what a killed one left, the next run in that folder removes), and an existing output is replaced only with
``--overwrite``, never when it is a file of the model, the adapter or its base. ``--output -`` writes the lines to
stdout instead, a batch at a time.

The prompts file and the output path are checked before the model loads, so a typo fails in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Optional

from .errors import UsageError
from .generate import (GenerationSettings, Sources, add_model_arguments, load_sources, quiet_loading,
                       resolve_sources, seed_everything)
from .generate_guards import check_output_outside_sources, no_space_error, staged_output

logger = logging.getLogger(__name__)

GENERATE_DESCRIPTION = (
    "Generate a reply to every prompt of a .txt file (one per line) or a .jsonl file (a 'prompt' or 'messages' field "
    "per line, other fields carried over) with a model or adapter, and write one JSON line per prompt, in order. "
    "Greedy by default."
)
PROMPT_SUFFIXES = (".txt", ".jsonl")
#: the output field of each reply; a prompts row may not have a field of that name
GENERATION_FIELD = "generation"
DEFAULT_BATCH_SIZE = 8


def add_generate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``hf-lisa generate``; imports nothing heavy."""
    add_model_arguments(parser, temperature=0.0, top_p=None)
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="the prompts: .txt (one per line) or .jsonl ('prompt' string or 'messages' list per line, or "
                        "Alpaca / ShareGPT rows: their reply is the reference, not the prompt)")
    parser.add_argument("--output", required=True, metavar="OUT.jsonl",
                        help="the JSON lines to write (written whole or not at all); '-' for stdout")
    parser.add_argument("--batch_size", "--batch-size", dest="batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                        help=f"prompts per generate call, left-padded (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output once the new one is "
                        "complete")
    return parser


def _bad_messages(messages) -> Optional[str]:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {'role', 'content'} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str):
            return f"messages[{i}] must be an object with a string 'role' and a string 'content'"
    if messages[-1]["role"] == "assistant":
        return ("the last message is the assistant's: a reply follows a user turn; drop it (or keep it in another "
                "field, e.g. 'reference', to compare with)")
    return None


def _bad_dataset_row(row: dict) -> Optional[str]:
    """Why an Alpaca (``instruction``, optional ``input``/``system``) or ShareGPT (``conversations``) row cannot be
    prompted, or ``None``. Its reply (``output``, or the trailing assistant turns) is the reference, carried as is."""
    if "instruction" in row:
        for key in ("instruction", "input", "system"):
            if key in row and row[key] is not None and not isinstance(row[key], str):
                return f"Alpaca row: {key!r} must be a string, got {type(row[key]).__name__}"
        return None if row["instruction"].strip() else "Alpaca row: 'instruction' is empty"
    from .data.formats import SHAREGPT_ROLES

    turns = row["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                              and t.get("from") in SHAREGPT_ROLES for t in turns):
        return (f"ShareGPT row: 'conversations' must be a list of {{'from', 'value'}} turns, 'from' one of "
                f"{sorted(SHAREGPT_ROLES)}")
    if not any(SHAREGPT_ROLES[t["from"]] == "user" for t in turns):
        return "ShareGPT row: no user turn to reply to"
    return None


def prompt_of(row: dict, chat: bool):
    """What to render for ``row``: its ``prompt`` or ``messages``; an Alpaca row as training renders it (chat
    messages with a template, the Stanford Alpaca prompt without); a ShareGPT row's turns up to its last user turn
    (the assistant turns after it are the reference, not the prompt)."""
    if "prompt" in row or "messages" in row:
        return row.get("prompt", row.get("messages"))
    from .data.formats import SHAREGPT_ROLES, alpaca_prompt

    system = row.get("system") if isinstance(row.get("system"), str) and row["system"].strip() else None
    head = [{"role": "system", "content": system}] if system else []
    if "instruction" in row:
        if not chat:
            return alpaca_prompt(row["instruction"], row.get("input"), system)
        user = row["instruction"] + (f"\n\n{row['input']}" if (row.get("input") or "").strip() else "")
        return head + [{"role": "user", "content": user}]
    messages = head + [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
    while messages[-1]["role"] != "user":
        messages.pop()
    return messages


def read_prompts(path: str) -> list[dict]:
    """The rows of a prompts file, each with ``prompt`` (str) or ``messages`` (list) and any other fields.

    Raises:
        UsageError: a missing file, another suffix, or a line that is not a JSON object with exactly one of
            ``prompt``/``messages`` (or has a ``generation`` field), naming the file and the line.
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PROMPT_SUFFIXES:
        raise UsageError(f"--prompts={path!r}: the suffix {suffix or '(none)'!r} is not one of {PROMPT_SUFFIXES}.")
    if not os.path.isfile(path):
        raise UsageError(f"--prompts={path!r} does not exist" + (" (it is a folder)." if os.path.isdir(path) else "."))
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            at = f"--prompts={path!r}, line {number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"{at}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); save "
                                 "the file as UTF-8.") from None
            if not line.strip():
                continue
            if suffix == ".txt":
                rows.append({"prompt": line.rstrip("\r\n")})
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{at}: not valid JSON ({exc.msg}).") from None
            if not isinstance(row, dict):
                raise UsageError(f"{at}: a JSON object is expected, got {type(row).__name__}.")
            present = [key for key in ("prompt", "messages") if key in row]
            if not present and ("instruction" in row or "conversations" in row):
                bad = _bad_dataset_row(row)  # an Alpaca or ShareGPT row, as `hf-lisa train` reads them
                if bad:
                    raise UsageError(f"{at}: {bad}.")
                if GENERATION_FIELD in row:
                    raise UsageError(f"{at}: the field {GENERATION_FIELD!r} is where the reply goes; rename it.")
                rows.append(row)
                continue
            if len(present) != 1:
                raise UsageError(f"{at}: a row needs exactly one of 'prompt' (a string) or 'messages' (a list), or "
                                 "an Alpaca 'instruction' or ShareGPT 'conversations'; it has "
                                 f"{present or 'neither'} among {sorted(row)}.")
            if present == ["prompt"] and not isinstance(row["prompt"], str):
                raise UsageError(f"{at}: 'prompt' must be a string, got {type(row['prompt']).__name__}.")
            bad = _bad_messages(row["messages"]) if present == ["messages"] else None
            if bad:
                raise UsageError(f"{at}: {bad}.")
            if GENERATION_FIELD in row:
                raise UsageError(f"{at}: the field {GENERATION_FIELD!r} is where the reply goes; rename it.")
            rows.append(row)
    if not rows:
        raise UsageError(f"--prompts={path!r} holds no prompt.")
    return rows


def check_output(output: str, prompts: str, overwrite: bool, sources=()) -> None:
    """Refuse an output that is the prompts file, a file of what loads (``sources``: ``(what, folder)`` pairs, see
    :func:`hf_lisa.generate_guards.check_output_outside_sources`), a folder, or an existing file without
    ``--overwrite``."""
    if output == "-":
        return
    if os.path.exists(prompts) and os.path.exists(output) and os.path.samefile(output, prompts):
        raise UsageError(f"--output={output!r} is the prompts file; choose another path.")
    if os.path.isdir(output):
        raise UsageError(f"--output={output!r} is a folder; give a file path, e.g. "
                         f"{os.path.join(output, 'generations.jsonl')!r}.")
    check_output_outside_sources(output, sources)
    if os.path.exists(output) and not overwrite:
        raise UsageError(f"--output={output!r} already exists; pass --overwrite to replace it once the new file is "
                         "complete.")


def _source_folders(sources: Sources) -> list[tuple[str, Optional[str]]]:
    if sources.adapter is None:
        return [("the model", sources.model)]
    return [("the adapter", sources.adapter), ("its base", sources.base)]


def _line(row: dict, generation: str) -> str:
    return json.dumps({**row, GENERATION_FIELD: generation}, ensure_ascii=False) + "\n"


def generate_command(args: argparse.Namespace) -> int:
    """Run ``hf-lisa generate`` with parsed arguments; returns 0. Errors propagate to :func:`hf_lisa.cli.main`."""
    settings = GenerationSettings.from_args(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch_size={args.batch_size} must be at least 1.")
    sources = resolve_sources(args.model, args.base, args.adapter)
    rows = read_prompts(args.prompts)
    check_output(args.output, args.prompts, args.overwrite, _source_folders(sources))

    from tqdm.auto import tqdm

    started = time.time()
    quiet_loading()
    loaded = load_sources(sources, device=args.device, torch_dtype=args.torch_dtype, chat_template=args.chat_template,
                          system=args.system)
    # every prompt renders (a conversation without a template is refused) before any generation runs
    encoded = [loaded.encode(prompt_of(row, loaded.chat)) for row in rows]
    check_output_outside_sources(args.output, loaded.folders)  # a Hub adapter's base is known once it has loaded
    print(f"hf-lisa generate: {len(rows)} prompt(s), {loaded.description}, "
          f"{'sampling' if settings.sampling else 'greedy'}", file=sys.stderr, flush=True)
    seed_everything(settings.seed)
    try:
        with contextlib.ExitStack() as stack:
            out = sys.stdout if args.output == "-" else stack.enter_context(staged_output(args.output))
            bar = stack.enter_context(tqdm(total=len(rows), desc="Generating", unit="prompt", file=sys.stderr,
                                           disable=None))
            for start in range(0, len(rows), args.batch_size):
                batch = slice(start, start + args.batch_size)
                replies = loaded.generate_encoded(encoded[batch], settings, args.batch_size, bar)
                out.write("".join(_line(row, reply) for row, reply in zip(rows[batch], replies)))
                out.flush()
    except OSError as exc:
        full = no_space_error(exc, args.output)
        if full is None:
            raise
        raise full from exc
    if loaded.own_system:
        print(f"hf-lisa generate: --system: {loaded.own_system} conversation(s) had their own system message, which "
              "was kept.", file=sys.stderr, flush=True)
    where = "stdout" if args.output == "-" else repr(args.output)
    print(f"hf-lisa generate: wrote {len(rows)} line(s) to {where} in {time.time() - started:.1f} s", file=sys.stderr,
          flush=True)
    return 0
