"""The numeric bounds of ``hf-lisa train``'s options, checked when the arguments are parsed (before any model or data
loads), and the two command-line forms argparse gets wrong on its own: negative numbers in scientific notation as
values (``--learning_rate -1e-4`` would read as an option) and abbreviated flags (refused by the parser).

Each refusal names the option, the value and what is allowed, like every usage error of the command (exit status 2).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from ...errors import UsageError

#: (option, the dataclass it lives in, test, what is allowed); ``None`` values mean "not set" and pass
BOUNDS: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("per_device_train_batch_size", "training", lambda v: v >= 1, "an integer >= 1"),
    ("per_device_eval_batch_size", "training", lambda v: v >= 1, "an integer >= 1"),
    ("gradient_accumulation_steps", "training", lambda v: v >= 1, "an integer >= 1"),
    ("max_steps", "training", lambda v: v == -1 or v >= 1,
     "an integer >= 1, or -1 (the default) to train for --num_train_epochs"),
    ("warmup_steps", "training", lambda v: v >= 0, "a number >= 0"),
    ("weight_decay", "training", lambda v: v >= 0, "a number >= 0"),
    ("max_grad_norm", "training", lambda v: v >= 0, "a number >= 0 (0 turns clipping off)"),
    ("max_seq_length", "data", lambda v: v >= 1, "an integer >= 1"),
    ("max_train_samples", "data", lambda v: v >= 1, "an integer >= 1 (leave it out to use every row)"),
    ("max_eval_samples", "data", lambda v: v >= 1, "an integer >= 1 (leave it out to use every row)"),
    ("validation_split_percentage", "data", lambda v: 0 <= v < 100, "a number in [0, 100)"),
    ("generation_max_new_tokens", "data", lambda v: v >= 1, "an integer >= 1"),
    ("demo_train_samples", "data", lambda v: v >= 1, "an integer >= 1"),
    ("preprocessing_num_workers", "data", lambda v: v >= 1, "an integer >= 1 (leave it out for one process)"),
)


def check_bounds(data_args, training_args) -> None:
    """Refuse an option outside its bounds (:data:`BOUNDS`), and a run that would train no step."""
    owners = {"data": data_args, "training": training_args}
    for name, owner, ok, allowed in BOUNDS:
        value = getattr(owners[owner], name, None)
        if value is not None and not ok(value):
            raise UsageError(f"--{name}={value!r} is invalid; allowed: {allowed}.")
    if training_args.max_steps == -1 and not training_args.num_train_epochs > 0:
        raise UsageError(
            f"--num_train_epochs={training_args.num_train_epochs!r} trains no step; allowed: a number > 0, or "
            "--max_steps N."
        )


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``["--learning_rate", "-1e-4"]`` -> ``["--learning_rate=-1e-4"]``: argparse takes a token that starts with ``-``
    and is not a plain negative number (``-1e-4``, ``-inf``) for an option, and would answer "expected one argument"
    instead of checking the value."""
    out: list[str] = []
    for token in argv:
        previous = out[-1] if out else ""
        if token.startswith("-") and _is_number(token) and previous.startswith("--") and "=" not in previous:
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def check_deepspeed_file(value: Optional[str]) -> None:
    """``--deepspeed`` names a file that exists (transformers' own message names no option). A JSON object or a
    base64 string passes through to transformers."""
    if not isinstance(value, str) or value.lstrip().startswith("{"):
        return
    looks_like_path = value.endswith((".json", ".yaml", ".yml")) or os.sep in value
    if looks_like_path and not os.path.isfile(value):
        raise UsageError(
            f"--deepspeed={value!r}: no such file; allowed: the path of a DeepSpeed JSON config (e.g. one of "
            "examples/accelerate_configs/), or the config as a JSON object."
        )
