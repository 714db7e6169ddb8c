"""The ``hf-lisa`` command.

::

    hf-lisa train [CONFIG.yaml] [--key value ...]   fine-tune (same as `accelerate launch -m hf_lisa.train ...`)
    hf-lisa demo [--output_dir outputs] [...]       the embedded demo: SmolLM2-135M + LISA on the bundled task
    hf-lisa push OUTPUT_DIR REPO_ID [--mode adapter|merged]
    hf-lisa config-reference [--format markdown|text] [--update-docs [FILE]]   (default: README.md and docs/training.md)
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = __doc__.split("::", 1)[1].strip("\n")

COMMANDS = ("train", "demo", "push", "config-reference")
DOCS_BEGIN, DOCS_END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
LISA_CONFIG_BEGIN, LISA_CONFIG_END = "<!-- lisa-config-reference:begin -->", "<!-- lisa-config-reference:end -->"
DOC_FILES = ("README.md", "docs/training.md")


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
    import dataclasses

    from peft.config import PeftConfig

    from .tuner.config import LisaConfig

    inherited = {f.name for f in dataclasses.fields(PeftConfig)} - {"modules_to_save"}
    lines = ["| field | default | description |", "|---|---|---|"] if fmt == "markdown" else []
    for f in dataclasses.fields(LisaConfig):
        if f.name in inherited:
            continue
        help_text = f.metadata.get("help", "")
        if fmt == "markdown":
            lines.append(f"| `{f.name}` | `{_field_default(f)!r}` | {help_text.replace('|', chr(92) + '|')} |")
        else:
            lines.append(f"{f.name} (default {_field_default(f)!r}): {help_text}")
    return "\n".join(lines) + "\n"


def config_reference(fmt: str = "markdown") -> str:
    """The configuration reference of ``hf-lisa train``, generated from the dataclasses' help metadata.

    ``TrainingArguments`` is summarised by a pointer to the transformers documentation rather than repeated.
    """
    import dataclasses

    from .train import ARGUMENT_CLASSES

    lines = []
    for cls in ARGUMENT_CLASSES:
        if fmt == "markdown":
            doc = (cls.__doc__ or "").strip()
            lines += [f"### `{cls.__name__}`", "", doc, "", "| option | default | description |", "|---|---|---|"]
        else:
            lines += [f"{cls.__name__}: {(cls.__doc__ or '').strip()}"]
        for f in dataclasses.fields(cls):
            default = _field_default(f)
            help_text = f.metadata.get("help", "")
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
    lines.append(f"### `TrainingArguments`\n\n{note}" if fmt == "markdown" else f"TrainingArguments: {note}")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hf-lisa`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"usage:\n{USAGE}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .train import main as train_main

        if rest and rest[0] in ("-h", "--help"):
            from transformers import HfArgumentParser

            from .train import _argument_classes

            HfArgumentParser(_argument_classes()).print_help()
            return 0
        try:
            train_main(rest)
        except (ValueError, FileNotFoundError) as err:
            print(f"hf-lisa train: error: {err}", file=sys.stderr)
            return 2
        return 0
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "push":
        from .hub import hub_cli

        return hub_cli(rest)
    if command == "config-reference":
        if "--update-docs" in rest:
            targets = rest[rest.index("--update-docs") + 1 :][:1] or list(DOC_FILES)
            for target in targets:
                update_docs(target)
                print(f"updated {target}")
            return 0
        fmt = "text" if "--format" in rest and rest[rest.index("--format") + 1 :][:1] == ["text"] else "markdown"
        print(config_reference(fmt), end="")
        return 0
    print(f"hf-lisa: unknown command {command!r}; allowed: {', '.join(COMMANDS)}.\nusage:\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
