"""The bundled demo task: short arithmetic word problems whose answers end in ``#### <number>`` (GSM8K's format).

The generator is deterministic (a seeded ``random.Random``, never the global RNG), needs no download, and is sized for
what a 135M-parameter model can learn on a CPU in minutes: one or two additions/subtractions of small numbers, stated
in a dozen templates. The completion spells the computation out before the answer, e.g.::

    prompt:     "Mia has 7 apples. She buys 5 more apples. How many apples does Mia have now?"
    completion: "7 + 5 = 12\\n#### 12"

Exact match is computed on the number after ``####`` (see [`extract_answer`]); the base model rarely uses that format,
so the untrained score also accepts the last number of the answer, which keeps the before/after comparison about
arithmetic rather than formatting alone.

Example:
    ```py
    >>> from hf_lisa.demo_task import generate_problems
    >>> rows = generate_problems(2, seed=0)
    >>> sorted(rows[0])
    ['answer', 'completion', 'prompt']
    ```
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Optional

__all__ = ["ANSWER_MARKER", "NAMES", "OBJECTS", "TASK_VERSION", "announce_bundled_task", "bundled_task_notice",
           "cached_dataset_files", "extract_answer", "generate_problems", "load_task_or_file", "write_demo_dataset"]

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Ada", "Ben", "Lily")
OBJECTS = ("apples", "books", "stickers", "marbles", "pencils", "cookies", "coins", "cards", "shells", "balloons")

# (template, operation). Each template has {name}, {obj}, {a}, {b} (and {c}); the operation maps (a, b, c) to the
# answer and the worked line. Pronouns are avoided so that no name needs a gender.
_TWO_STEP = [
    ("{name} has {a} {obj}. {name} buys {b} more {obj}. How many {obj} does {name} have now?", "+"),
    ("{name} had {a} {obj} and found {b} more. How many {obj} does {name} have?", "+"),
    ("There are {a} {obj} in a box. Someone adds {b} {obj}. How many {obj} are in the box?", "+"),
    ("{name} has {a} {obj} and gives away {b}. How many {obj} are left?", "-"),
    ("{name} had {a} {obj}. {name} lost {b} of them. How many {obj} does {name} have left?", "-"),
    ("A shelf holds {a} {obj}. {b} {obj} are taken away. How many {obj} remain on the shelf?", "-"),
]
_THREE_STEP = [
    ("{name} has {a} {obj}, gets {b} more, then gives away {c}. How many {obj} does {name} have?", "+-"),
    ("{name} had {a} {obj}, lost {b}, then found {c}. How many {obj} does {name} have now?", "-+"),
    ("A jar has {a} {obj}. {b} are added and then {c} more are added. How many {obj} are in the jar?", "++"),
]

ANSWER_MARKER = "####"
# bump when the generator changes: cached copies of the bundled dataset are keyed by it
TASK_VERSION = 1
_MARKER_RE = re.compile(r"####\s*(-?\d+)")
_NUMBER_RE = re.compile(r"-?\d+")


def _problem(rng: random.Random, max_operand: int) -> dict:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    if rng.random() < 0.6:
        template, op = rng.choice(_TWO_STEP)
        a, b = rng.randint(2, max_operand), rng.randint(1, max_operand)
        if op == "-":
            a, b = max(a, b) + 1, min(a, b)  # no negative counts
            answer, work = a - b, f"{a} - {b} = {a - b}"
        else:
            answer, work = a + b, f"{a} + {b} = {a + b}"
        prompt = template.format(name=name, obj=obj, a=a, b=b)
    else:
        template, ops = rng.choice(_THREE_STEP)
        a, b, c = rng.randint(2, max_operand), rng.randint(1, max_operand), rng.randint(1, max_operand)
        if ops[0] == "-":
            a, b = max(a, b) + 1, min(a, b)
        first = a + b if ops[0] == "+" else a - b
        if ops[1] == "-":
            c = min(c, first)
        answer = first + c if ops[1] == "+" else first - c
        work = f"{a} {ops[0]} {b} = {first}\n{first} {ops[1]} {c} = {answer}"
        prompt = template.format(name=name, obj=obj, a=a, b=b, c=c)
    return {"prompt": prompt, "completion": f"{work}\n{ANSWER_MARKER} {answer}", "answer": str(answer)}


def generate_problems(n: int, seed: int = 0, max_operand: int = 20) -> list[dict]:
    """Return ``n`` problems as ``{"prompt", "completion", "answer"}`` dicts; equal seeds give equal lists.

    Args:
        n: number of problems.
        seed: seed of the private generator.
        max_operand: largest number in a problem statement.
    """
    if n < 0:
        raise ValueError(f"n={n} is invalid; expected a non-negative number of problems.")
    if max_operand < 2:
        raise ValueError(f"max_operand={max_operand} is invalid; expected an integer >= 2.")
    rng = random.Random(seed)
    return [_problem(rng, max_operand) for _ in range(n)]


def write_demo_dataset(
    directory: str | Path, n_train: int = 2000, n_validation: int = 64, seed: int = 0
) -> tuple[str, str]:
    """Write ``train.jsonl`` and ``validation.jsonl`` into ``directory``; validation prompts never occur in train.

    Returns:
        The paths of the train and validation files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    validation = generate_problems(n_validation, seed=seed + 1)
    held_out = {row["prompt"] for row in validation}
    train, draw = [], 0
    rng_seed = seed
    while len(train) < n_train:
        batch = generate_problems(n_train, seed=rng_seed + 1000 * draw)
        train.extend(row for row in batch if row["prompt"] not in held_out)
        draw += 1
    train = train[:n_train]
    paths = []
    for split, rows in (("train", train), ("validation", validation)):
        path = directory / f"{split}.jsonl"
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        paths.append(str(path))
    return paths[0], paths[1]


def extract_answer(text: str, lenient: bool = True) -> Optional[str]:
    """The number after ``####``; with ``lenient`` the last number in ``text`` when there is no marker.

    Example:
        ```py
        >>> extract_answer("7 + 5 = 12\\n#### 12")
        '12'
        >>> extract_answer("The answer is 12.")
        '12'
        >>> extract_answer("The answer is 12.", lenient=False) is None
        True
        ```
    """
    match = _MARKER_RE.search(text)
    if match:
        return match.group(1)
    if lenient:
        numbers = _NUMBER_RE.findall(text)
        return numbers[-1] if numbers else None
    return None


def cached_dataset_files(n_train: int, n_validation: int = 64) -> tuple[str, str]:
    """``(train.jsonl, validation.jsonl)`` of the bundled task, written once into hf-lisa's cache directory.

    The directory name carries :data:`TASK_VERSION`, so a changed generator never reuses stale files. Shared by
    ``hf-lisa train``, the examples and the benchmark, so that all of them train on the same files.
    """
    from .models import cache_dir

    name = f"v{TASK_VERSION}-n{n_train}" + ("" if n_validation == 64 else f"-v{n_validation}")
    directory = cache_dir() / "demo_task" / name
    if not (directory / "validation.jsonl").exists():
        write_demo_dataset(directory, n_train=n_train, n_validation=n_validation)
    return str(directory / "train.jsonl"), str(directory / "validation.jsonl")


def bundled_task_notice(n_train: int, n_validation: int = 64) -> str:
    """The line ``hf-lisa train`` prints when it trains on this task because no data was named: what it trains on,
    and how to name your own data."""
    return (f"[hf-lisa] no --train_file or --dataset_name: training on the bundled arithmetic task ({n_train} "
            f"generated word problems, {n_validation} more for evaluation; --demo_train_samples sets the count). Pass "
            "--train_file FILE (.jsonl, .json, .csv, .parquet, .txt, or a folder of them) or --dataset_name ID to "
            "train on your data.")


def announce_bundled_task(n_train: int, main_process: bool = True) -> None:
    """Print :func:`bundled_task_notice` (once, on the main process)."""
    if main_process:
        print(bundled_task_notice(n_train), flush=True)


def load_task_or_file(train_file: Optional[str] = None, n_train: int = 1000, n_validation: int = 32):
    """Raw ``train``/``validation`` datasets: ``train_file`` (5% held out) when given, else the bundled task.

    What the examples start from: a user's own file, or, without one, this bundled arithmetic task.

    Returns:
        A ``datasets.DatasetDict``, as :func:`load_raw_datasets` returns it.
    """
    from .data import load_raw_datasets

    if train_file:
        return load_raw_datasets(train_file=train_file, validation_split_percentage=5)
    train, validation = cached_dataset_files(n_train, n_validation)
    return load_raw_datasets(train_file=train, validation_file=validation)
