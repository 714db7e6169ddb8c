"""``hf-lisa chat MODEL``: talk to a model or adapter in the terminal, the reply streamed token by token.

Each line read from stdin is a user turn; the conversation is kept (rendered with the chat template, as training
rendered it) until ``/reset``. ``/exit`` or end of input (Ctrl-D, or the end of a piped file) ends the chat, Ctrl-C
ends it with exit status 130. On a terminal, a ``>>>`` prompt is shown (with line editing) and a one-line banner on
stderr; with stdin piped, stdout holds the replies only, one per turn, each ending in a newline, so that
``printf 'Hi\\n/reset\\nHello\\n' | hf-lisa chat outputs --temperature 0`` is a script's check of a fine-tune. Without a
chat template (``--chat_template never``, or a base model's tokenizer) each line is completed as raw text and no
conversation is kept. A line that is not UTF-8 is skipped with a note on stderr; the chat goes on.
"""

from __future__ import annotations

import argparse
import sys
from typing import IO, Optional

from .generate import (GenerationSettings, LoadedModel, add_model_arguments, load_sources, quiet_loading,
                       resolve_sources, seed_everything)

CHAT_DESCRIPTION = (
    "Chat with a model or adapter (an hf-lisa train output, an adapter or model folder, a Hub id): each line of stdin "
    "is a user turn, the reply is streamed to stdout. /reset clears the conversation, /exit or end of input ends it. "
    "Works with piped stdin (replies only on stdout)."
)
RESET, EXIT = "/reset", ("/exit", "/quit")
PROMPT = ">>> "


def add_chat_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``hf-lisa chat``; imports nothing heavy. Sampling by default (temperature 0.7, top-p 0.9);
    ``--temperature 0`` is greedy."""
    add_model_arguments(parser, temperature=0.7, top_p=0.9)
    return parser


def _streamer(tokenizer, out: IO[str]):
    """transformers' ``TextStreamer`` (the reply printed as whole words arrive, the prompt skipped) writing to
    ``out``."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _read_turn(stdin: IO[str], interactive: bool) -> Optional[str]:
    """The next line of input without its newline, or ``None`` at the end of input."""
    if interactive and stdin is sys.stdin:  # input(): the prompt, and line editing once readline is imported
        try:
            return input(PROMPT)
        except EOFError:
            print(file=sys.stderr)
            return None
    line = stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def _undecodable(line: str) -> bool:
    """Whether ``line`` holds bytes that were not UTF-8 (read with ``surrogateescape``: lone surrogates)."""
    return any("\udc80" <= char <= "\udcff" for char in line)


def run_chat(loaded: LoadedModel, settings: GenerationSettings, stdin: IO[str], stdout: IO[str],
             interactive: Optional[bool] = None) -> int:
    """The REPL: read turns from ``stdin`` until ``/exit`` or its end, stream each reply to ``stdout``; returns 0.

    ``interactive`` (default: whether ``stdin`` is a terminal) shows the prompt and the banner; notes go to stderr.
    """
    interactive = stdin.isatty() if interactive is None else interactive
    if interactive:
        try:
            import readline  # noqa: F401 - input() gets line editing and history once it is imported
        except ImportError:  # not on every platform
            pass
        mode = "" if loaded.chat else " (no chat template: each line is completed as raw text)"
        print(f"Chatting with {loaded.description}{mode}. {RESET} clears the conversation, {EXIT[0]} or Ctrl-D ends.",
              file=sys.stderr, flush=True)
    history: list[dict] = []
    number = 0
    while True:
        line = _read_turn(stdin, interactive)
        if line is None:
            break
        number += 1
        if _undecodable(line):
            print(f"line {number} of the input is not UTF-8 text (undecodable bytes); it was skipped: send it again as "
                  "UTF-8.", file=sys.stderr, flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        command = text.split()[0].lower()
        if command in EXIT:
            break
        if command == RESET:
            history = []
            if interactive:
                print("(conversation cleared)", file=sys.stderr, flush=True)
            continue
        if command.startswith("/") and command[1:].isalpha():
            print(f"unknown command {command}: {RESET} clears the conversation, {EXIT[0]} ends.", file=sys.stderr,
                  flush=True)
            continue
        turn = {"role": "user", "content": line}
        ids = loaded.encode(history + [turn] if loaded.chat else line)
        try:
            reply = loaded.generate_ids([ids], settings, streamer=_streamer(loaded.tokenizer, stdout))[0]
        except KeyboardInterrupt:  # end the half-streamed line before the command's message
            stdout.write("\n")
            stdout.flush()
            raise
        if loaded.chat:
            history += [turn, {"role": "assistant", "content": loaded.decode(reply)}]
    return 0


def chat_command(args: argparse.Namespace) -> int:
    """Run ``hf-lisa chat`` with parsed arguments; errors propagate to :func:`hf_lisa.cli.main`."""
    settings = GenerationSettings.from_args(args)
    sources = resolve_sources(args.model, args.base, args.adapter)  # before torch loads: a typo fails at once
    quiet_loading()
    loaded = load_sources(sources, device=args.device, torch_dtype=args.torch_dtype, chat_template=args.chat_template,
                          system=args.system)
    seed_everything(settings.seed)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become a note and a skipped line, not a crash
        sys.stdin.reconfigure(errors="surrogateescape")
    return run_chat(loaded, settings, sys.stdin, sys.stdout)
