"""The ``hf-lisa`` command.

::

    hf-lisa train [CONFIG.yaml] [--key value ...]   fine-tune (same as `accelerate launch -m hf_lisa.train ...`)
    hf-lisa demo [--output_dir outputs] [...]       the embedded demo: SmolLM2-135M + LISA on the bundled task
    hf-lisa push OUTPUT_DIR REPO_ID [--mode adapter|merged]
    hf-lisa config-reference [--format markdown|text] [--update-docs [docs/training.md]]
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = __doc__.split("::", 1)[1].strip("\n")

COMMANDS = ("train", "demo", "push", "config-reference")
DOCS_BEGIN, DOCS_END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def update_docs(path: str = "docs/training.md") -> None:
    """Replace the generated configuration reference between the markers in ``path``."""
    with open(path) as f:
        text = f.read()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{path!r} has no {DOCS_BEGIN} ... {DOCS_END} section to update.")
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{DOCS_BEGIN}\n{config_reference('markdown')}{DOCS_END}{tail}")


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
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "required"
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
            target = rest[rest.index("--update-docs") + 1 :][:1] or ["docs/training.md"]
            update_docs(target[0])
            print(f"updated {target[0]}")
            return 0
        fmt = "text" if "--format" in rest and rest[rest.index("--format") + 1 :][:1] == ["text"] else "markdown"
        print(config_reference(fmt), end="")
        return 0
    print(f"hf-lisa: unknown command {command!r}; allowed: {', '.join(COMMANDS)}.\nusage:\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
