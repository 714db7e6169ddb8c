"""The ``hf-lisa`` command: one ``argparse`` parser with a subcommand each.

::

    hf-lisa train [CONFIG.yaml] [--key value ...]   fine-tune (same as `accelerate launch -m hf_lisa.train ...`)
    hf-lisa demo [--output_dir outputs] [...]       the embedded demo: SmolLM2-135M + LISA on the bundled task
    hf-lisa push OUTPUT_DIR REPO_ID [--mode adapter|merged]
    hf-lisa export {lora,gguf,merged} SOURCE OUT [...]   LoRA adapter / GGUF file / merged weights for serving
    hf-lisa chat MODEL [--base BASE] [--adapter ADAPTER] [...]   talk to a model or adapter, replies streamed
    hf-lisa generate MODEL --prompts FILE --output OUT.jsonl [...]   one JSON line per prompt
    hf-lisa config-reference [--format markdown|text] [--update-docs [FILE ...]]   (docs/training.md)
    hf-lisa --version

``train`` and ``demo`` hand the rest of the command line to ``hf-lisa train``'s ``HfArgumentParser``
(:func:`hf_lisa.train.parse_args`, itself an ``argparse`` parser); ``push`` takes the arguments of
:func:`hf_lisa.hub.cli.add_push_arguments`.

Every failure ends in one message on stderr and an exit status (:func:`exit_status`, the one policy, which
``python -m hf_lisa.train`` follows too): 2 for a usage error (an option, a value, a config or data file, the model
named), 1 for a failure while running, 130 when interrupted (Ctrl-C), with the checkpoint to resume from. ``--debug``
(before the subcommand, or anywhere after ``train``/``demo``) prints the traceback as well.

``--help``, ``--version`` and usage errors import no torch, transformers or PEFT: the subcommands load them when they
run (tests/test_lazy_imports.py).
"""

from __future__ import annotations

import argparse
import errno
import logging
import re
import signal
import sys
import warnings
import traceback
from typing import Optional, Sequence

from .errors import WHILE_RUNNING, RunError, Terminated, UsageError

COMMANDS = ("train", "demo", "push", "export", "chat", "generate", "config-reference")
#: ``hf-lisa train --help``'s text, generated from the parser (``python tests/test_option_names.py --write``)
TRAIN_HELP = "train_help.txt"
DOCS_BEGIN, DOCS_END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
LISA_CONFIG_BEGIN, LISA_CONFIG_END = "<!-- lisa-config-reference:begin -->", "<!-- lisa-config-reference:end -->"
DOC_FILES = ("docs/training.md",)
EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143
#: what the user asked for cannot be used (``UsageError`` and ``DataError`` are ``ValueError``\ s): exit status 2
USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _replace_between(text: str, begin: str, end: str, content: str) -> str:
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{content}{end}{tail}"


def update_docs(path: str = "README.md") -> None:
    """Regenerate the reference sections (between their markers) in ``path``."""
    with open(path) as f:
        text = f.read()
    sections = [(DOCS_BEGIN, DOCS_END, config_reference), (LISA_CONFIG_BEGIN, LISA_CONFIG_END, lisa_config_reference)]
    present = [(b, e, fn) for b, e, fn in sections if b in text and e in text]
    if not present:
        raise ValueError(f"{path!r} has no {DOCS_BEGIN} ... {DOCS_END} section to update.")
    for begin, end, generate in present:
        text = _replace_between(text, begin, end, generate("markdown"))
    with open(path, "w") as f:
        f.write(text)


def _field_default(f):
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def lisa_config_reference(fmt: str = "markdown") -> str:
    """The fields of ``hf_lisa.LisaConfig`` (LISA's own, not PEFT's generic ones), from their help metadata."""
    from .tuner.config import lisa_config_fields

    lines = ["| field | default | description |", "|---|---|---|"] if fmt == "markdown" else []
    for f in lisa_config_fields():
        help_text = f.metadata.get("help", "")
        if fmt == "markdown":
            lines.append(f"| `{f.name}` | `{_field_default(f)!r}` | {help_text.replace('|', chr(92) + '|')} |")
        else:
            lines.append(f"{f.name} (default {_field_default(f)!r}): {help_text}")
    return "\n".join(lines) + "\n"


def config_reference(fmt: str = "markdown") -> str:
    """The configuration reference of ``hf-lisa train``, generated from the dataclasses' help metadata and, for the
    method's options, the methods that use them (``hf_lisa.train.parsing.options.OPTION_METHODS``).

    ``TrainingArguments`` is summarised by a pointer to the transformers documentation rather than repeated.
    """
    import dataclasses

    from .option_aliases import ALIASES, help_note
    from .train import ARGUMENT_CLASSES, METHOD_NAMES
    from .train.parsing.options import OPTION_METHODS

    def flags(text: str) -> str:  # `--lora_r` in markdown, as the option column spells options
        return re.sub(r"(--\w+)", r"`\1`", text) if fmt == "markdown" else text

    from transformers import TrainingArguments

    from .train.run_folder.output_dir import RunTrainingArguments

    theirs_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    lines, options = [], set()
    for cls in (*ARGUMENT_CLASSES, RunTrainingArguments):  # the last: hf-lisa's fields of its TrainingArguments
        title = "LisaTrainingArguments" if cls is RunTrainingArguments else cls.__name__
        doc = ("hf-lisa's additions to `TrainingArguments`: `LisaTrainer`'s settings (the fields of "
               "`hf_lisa.trainer.LisaTrainingArguments`) and the output folder's." if cls is RunTrainingArguments
               else (cls.__doc__ or "").strip())
        if fmt == "markdown":
            lines += [f"### `{title}`", "", doc, "", "| option | default | description |", "|---|---|---|"]
        else:
            lines += [f"{title}: {doc}"]
        for f in dataclasses.fields(cls):
            if cls is RunTrainingArguments and f.name in theirs_fields:
                continue
            default = _field_default(f)
            help_text = f.metadata.get("help", "")
            if OPTION_METHODS.get(f.name, METHOD_NAMES) != METHOD_NAMES:
                help_text += f" Methods: {', '.join(OPTION_METHODS[f.name])}."
            help_text += flags(help_note(f.name))  # the peers' names (hf_lisa.option_aliases)
            options.add(f.name)
            if fmt == "markdown":
                cell = help_text.replace("|", "\\|")
                lines.append(f"| `--{f.name}` | `{default!r}` | {cell} |")
            else:
                lines.append(f"  --{f.name} (default {default!r}): {help_text}")
        lines.append("")
    note = (
        "Every `transformers.TrainingArguments` flag is accepted as well (`--output_dir`, `--max_steps`, "
        "`--learning_rate`, `--lr_scheduler_type`, `--warmup_steps`, `--max_grad_norm` (default 1.0), `--bf16`, "
        "`--gradient_checkpointing`, `--report_to`, `--push_to_hub`, `--hub_model_id`, ...); see the transformers "
        "documentation of `TrainingArguments`."
    )
    theirs = [f"--{alias} ({tools}) for --{option}" for alias, (option, tools) in ALIASES.items()
              if option not in options]
    if theirs:  # the peers' names of TrainingArguments flags
        note += flags(f" Also accepted: {', '.join(theirs)}.")
    lines.append(f"### `TrainingArguments`\n\n{note}" if fmt == "markdown" else f"TrainingArguments: {note}")
    return "\n".join(lines).rstrip() + "\n"


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


#: warnings the libraries raise about their own internals (not about anything the user asked for), kept off the console
INTERNAL_WARNINGS = (r"`is_gradient_checkpointing` is deprecated",)


def quiet_third_parties() -> None:
    """Keep the command's console to what the run says, before the libraries are imported: HTTP request logs at
    WARNING; bitsandbytes' notice that the optional ``kernels`` package is missing (printed at its import on every
    command, whether or not a quantized model is used; it concerns a faster 4-bit CPU path only) and DeepSpeed's
    "Setting accelerator to CPU" (at its import, on every CPU command) dropped; the
    libraries' deprecation notices about their own internals (:data:`INTERNAL_WARNINGS`) off. Warnings about what
    the user passed (a deprecated option) stay."""
    for name in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessage("kernels-community"))
    logging.getLogger("DeepSpeed").addFilter(_DropMessage("Setting accelerator to CPU"))  # deepspeed's import, on CPU
    for message in INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def _refuse_unknown_flags(rest: Sequence[str]) -> None:
    """A mistyped flag is refused before torch, transformers and PEFT are imported (:mod:`hf_lisa.option_names`)."""
    from .option_aliases import canonical_argv
    from .option_names import CONFIG_SUFFIXES, suggestion, unknown_options

    unknown = unknown_options(rest)
    if unknown:
        raise UsageError(f"unrecognised argument(s): {', '.join(suggestion(flag) for flag in unknown)}. Run "
                         "`hf-lisa config-reference` for the full list.")
    canonical_argv(rest)  # an alias given with its option (hf_lisa.option_aliases)
    if rest and not rest[0].startswith("-") and rest[0].endswith(CONFIG_SUFFIXES):
        _refuse_unknown_keys(rest[0])


def _refuse_unknown_keys(path: str) -> None:
    """A config file's unknown or near-miss keys are refused as fast as a mistyped flag (before torch); a file that
    cannot be read here (missing, too large, not a regular file, bad YAML/JSON) is left to the full reader's
    messages."""
    import json
    import os

    from .option_aliases import canonical_keys
    from .option_names import suggestion, unknown_keys

    try:
        if not os.path.isfile(path) or os.path.getsize(path) > 4 * 2**20:
            return
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 -- the full reader (hf_lisa.train.parsing.config_file) names the problem
        return
    if not isinstance(values, dict):
        return
    canonical_keys(values, path)  # near misses, and an alias given with its option
    unknown = sorted(str(key) for key in unknown_keys(list(values)))  # in the full parser's order
    if unknown:
        raise UsageError(f"{path}: unknown option(s) {', '.join(suggestion(key, '') for key in unknown)}. Run "
                         "`hf-lisa config-reference` for the full list.")


def _static_help(rest: Sequence[str]) -> bool:
    """Print ``hf-lisa train --help`` from the text generated with :mod:`hf_lisa.option_names` (no torch, transformers
    or PEFT to import); ``False`` when ``rest`` does not ask for help or the text does not apply (another
    transformers version: the full parser prints it)."""
    from .option_names import matches_installed_transformers

    if not any(token in ("-h", "--help") for token in rest) or not matches_installed_transformers():
        return False
    from importlib.resources import files

    print(files("hf_lisa").joinpath(TRAIN_HELP).read_text(), end="")
    return True


def _train(args: argparse.Namespace) -> int:
    if _static_help(args.rest):
        return 0
    _refuse_unknown_flags(args.rest)
    from .train import main as train_main

    owned = not _process_group_initialized()
    try:
        train_main(args.rest)
    finally:
        # the process group the run created (accelerate's, under `accelerate launch`) ends with the command: left to
        # the interpreter's exit, its threads can be torn down while joinable ("terminate called without an active
        # exception" on a rank after a finished run); a group the caller made before is the caller's to end
        if owned and _process_group_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


def _process_group_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def _demo(args: argparse.Namespace) -> int:
    _refuse_unknown_flags(args.rest)
    from .demo import main as demo_main

    return demo_main(args.rest)


def _push(args: argparse.Namespace) -> int:
    from .hub.cli import push_command

    return push_command(args)


def _export(args: argparse.Namespace) -> int:
    from .export.cli import export_command

    return export_command(args)


def _chat(args: argparse.Namespace) -> int:
    from .chat import chat_command

    return chat_command(args)


def _generate(args: argparse.Namespace) -> int:
    from .generate_file import generate_command

    return generate_command(args)


def _config_reference(args: argparse.Namespace) -> int:
    if args.update_docs is not None:
        for target in args.update_docs or DOC_FILES:
            update_docs(target)
            print(f"updated {target}")
        return 0
    print(config_reference(args.format), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-lisa`` parser: one subcommand per job, each with its handler as ``func``."""
    # light imports only: --help, --version and usage errors load no torch, transformers or PEFT (test_lazy_imports)
    from . import __version__
    from .chat import CHAT_DESCRIPTION, add_chat_arguments
    from .export.cli import EXPORT_DESCRIPTION, add_export_arguments
    from .generate_file import GENERATE_DESCRIPTION, add_generate_arguments
    from .hub.cli import PUSH_DESCRIPTION, add_push_arguments

    parser = argparse.ArgumentParser(prog="hf-lisa", description="LISA fine-tuning for the Hugging Face stack.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not only its message")
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", required=True)
    # train and demo take no arguments here: the rest of the command line, --help included, goes to hf-lisa train's
    # HfArgumentParser (see main)
    for name, func, summary in (
        ("train", _train, "fine-tune: [CONFIG.yaml] [--option value ...]; `hf-lisa train --help` lists the options"),
        ("demo", _demo, "the embedded demo (SmolLM2-135M + LISA on the bundled task); any train option overrides it"),
    ):
        commands.add_parser(name, help=summary, add_help=False).set_defaults(func=func, takes_train_options=True)
    push = commands.add_parser("push", help="push a training output to the Hub", description=PUSH_DESCRIPTION)
    add_push_arguments(push).set_defaults(func=_push)
    export = commands.add_parser("export", help="export for serving: lora, gguf or merged",
                                 description=EXPORT_DESCRIPTION)
    add_export_arguments(export).set_defaults(func=_export)
    chat = commands.add_parser("chat", help="talk to a model or adapter in the terminal (stdin may be piped)",
                               description=CHAT_DESCRIPTION)
    add_chat_arguments(chat).set_defaults(func=_chat)
    generate = commands.add_parser("generate", help="generate for a file of prompts, to JSON lines",
                                   description=GENERATE_DESCRIPTION)
    add_generate_arguments(generate).set_defaults(func=_generate)
    reference = commands.add_parser(
        "config-reference", help="print the options of hf-lisa train, or regenerate the docs' reference sections"
    )
    reference.add_argument("--format", choices=("markdown", "text"), default="markdown")
    reference.add_argument(
        "--update-docs", "--update_docs", dest="update_docs", nargs="*", metavar="FILE", default=None,
        help=f"rewrite the generated sections of FILE (default: {', '.join(DOC_FILES)}) instead of printing",
    )
    reference.set_defaults(func=_config_reference)
    _refuse_abbreviations(parser)
    return parser


def _refuse_abbreviations(parser: argparse.ArgumentParser) -> None:
    """``--mod`` is not ``--mode``: a prefix of a flag is refused in every (sub)command, as in ``hf-lisa train``."""
    parser.allow_abbrev = False  # read when parsing
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _refuse_abbreviations(subparser)


def exit_status(err: BaseException) -> int:
    """The exit status of a command that raised ``err``, by the kind of failure: 130 for Ctrl-C, 143 for SIGTERM, 2 for
    a usage error (a ``UsageError`` whenever raised; a ``ValueError`` or missing file before the run started), 1 for a
    failure while running (anything raised once the run evaluates, trains, saves or pushes: a crash there is not the
    user's input), and 1 otherwise."""
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(err, Terminated):
        return EXIT_TERMINATED
    if isinstance(err, UsageError):
        return EXIT_USAGE
    if getattr(err, WHILE_RUNNING, None):
        return EXIT_RUNTIME
    return EXIT_USAGE if isinstance(err, USAGE_ERRORS) else EXIT_RUNTIME


def _take_debug_flag(rest: list[str]) -> tuple[list[str], bool]:
    """Remove a bare ``--debug`` from the options of ``train``/``demo``. ``--debug underflow_overflow`` (with a value)
    is transformers' ``TrainingArguments.debug`` and stays."""
    kept, debug = [], False
    for i, token in enumerate(rest):
        if token == "--debug" and (i + 1 == len(rest) or rest[i + 1].startswith("-")):
            debug = True
        else:
            kept.append(token)
    return kept, debug


def _resume_hint(args: argparse.Namespace) -> str:
    """Where an interrupted ``train``/``demo`` run can resume from: the newest complete checkpoint of its output
    directory, or that it has none. The output directory is the one the run's own parse found
    (:func:`hf_lisa.train.parsing.arguments.parsed_output_dir`): nothing is parsed or read again (a FIFO or a slow file named
    by an option would block the interrupt)."""
    if args.command not in ("train", "demo"):
        return ""
    try:
        arguments = sys.modules.get("hf_lisa.train.parsing.arguments")
        output_dir = arguments.parsed_output_dir(list(args.rest)) if arguments is not None else None
        if output_dir is None:  # interrupted before its arguments were parsed
            raise LookupError
        from .train.run_folder.output_dir import latest_checkpoint

        checkpoint = latest_checkpoint(output_dir)
    except BaseException:  # noqa: BLE001 - interrupted during start-up (an import cut short, its own arguments): no hint
        return "It stopped during start-up, before training; a new run starts from the beginning."
    if checkpoint is None:
        return f"No checkpoint was saved in {output_dir!r}; a new run starts from the beginning."
    return f"Resume from {checkpoint} with the same command and --resume_from_checkpoint latest."


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hf-lisa`` script; returns the exit status (see :func:`exit_status`).

    A failure prints ``hf-lisa <command>: error: <message>`` on stderr, without a traceback unless ``--debug`` is given.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        if rest and not getattr(args, "takes_train_options", False):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:  # --help, or invalid arguments
        return int(exc.code or 0)
    except KeyboardInterrupt:  # Ctrl-C before the command started
        print("hf-lisa: interrupted.", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    args.rest, debug = _take_debug_flag(rest)
    debug = debug or args.debug
    prog = f"{parser.prog} {args.command}"
    previous = _raise_on_sigterm()
    quiet_third_parties()
    try:
        return args.func(args)
    except SystemExit as exc:  # hf-lisa train's argparse: --help, or an invalid value, its message already printed
        return exc.code if isinstance(exc.code, int) else EXIT_RUNTIME if exc.code else 0
    except (Exception, KeyboardInterrupt, Terminated) as err:  # noqa: BLE001 - where every failure becomes a message
        try:
            return _report(err, args, prog, debug)
        except (KeyboardInterrupt, Terminated):  # a second Ctrl-C while reporting the first: still one line
            print(f"{prog}: interrupted.", file=sys.stderr, flush=True)
            return exit_status(err)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_on_sigterm():
    """Make SIGTERM raise :class:`~hf_lisa.errors.Terminated` in the main thread (the run unwinds as on Ctrl-C);
    returns the previous handler, or ``None`` where none can be set (not the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum, frame):
        raise Terminated()

    return signal.signal(signal.SIGTERM, terminated)


def _report(err: BaseException, args: argparse.Namespace, prog: str, debug: bool) -> int:
    """Print the one line that ends a failed command; return its exit status."""
    if debug:
        traceback.print_exc()
    status = exit_status(err)
    if status == EXIT_INTERRUPTED:
        message = f"interrupted. {_resume_hint(args)}".rstrip()
    elif status == EXIT_TERMINATED:
        message = f"terminated (SIGTERM). {_resume_hint(args)}".rstrip()
    elif isinstance(err, OSError) and err.errno == errno.ENOSPC:
        where = err.filename or getattr(err, WHILE_RUNNING, None) or "the output folder"
        message = (f"error: no space left on the device while writing {where}: free some space (or choose another "
                   "--output_dir) and run again.")
    else:
        message = f"error: {err}"
        if not isinstance(err, (ValueError, OSError, RunError)) or not str(err):  # not written for the user
            message = f"error: {type(err).__name__}: {err}" + ("" if debug else " (--debug shows the traceback)")
    print(f"{prog}: {message}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
