"""The bundled arithmetic task: deterministic, correct answers, held-out validation, answer extraction."""

from __future__ import annotations

import json
import re

import pytest

from hf_lisa.demo_task import extract_answer, generate_problems, write_demo_dataset


def test_equal_seeds_give_equal_problems_and_different_seeds_differ():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)


def test_every_worked_line_is_correct_arithmetic_and_ends_in_the_answer():
    for row in generate_problems(300, seed=0):
        lines = row["completion"].split("\n")
        assert lines[-1] == f"#### {row['answer']}"
        previous = None
        for line in lines[:-1]:
            a, op, b, eq, result = line.split()
            assert eq == "="
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert value == int(result) >= 0
            if previous is not None:
                assert int(a) == previous  # the second step continues from the first result
            previous = value
        assert previous == int(row["answer"])
        # every number of the worked solution is stated in the prompt (except intermediate results)
        first = lines[0].split()
        assert first[0] in re.findall(r"\d+", row["prompt"]) and first[2] in re.findall(r"\d+", row["prompt"])


def test_written_dataset_holds_out_validation_prompts(tmp_path):
    train_path, validation_path = write_demo_dataset(tmp_path, n_train=500, n_validation=40, seed=0)
    train = [json.loads(line) for line in open(train_path)]
    validation = [json.loads(line) for line in open(validation_path)]
    assert len(train) == 500 and len(validation) == 40
    assert not {r["prompt"] for r in validation} & {r["prompt"] for r in train}


@pytest.mark.parametrize(
    "text, lenient, expected",
    [
        ("7 + 5 = 12\n#### 12", True, "12"),
        ("####-3", False, "-3"),
        ("So she has 9 - 4 = 5 apples.", True, "5"),
        ("So she has 9 - 4 = 5 apples.", False, None),
        ("no numbers here", True, None),
    ],
)
def test_extract_answer(text, lenient, expected):
    assert extract_answer(text, lenient=lenient) == expected


def test_invalid_sizes_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="max_operand=1"):
        generate_problems(3, max_operand=1)
    with pytest.raises(ValueError, match="n=-1"):
        generate_problems(-1)


def test_load_task_or_file_gives_the_bundled_task_or_the_users_file(tmp_path, monkeypatch):
    import json

    from hf_lisa.demo_task import load_task_or_file

    monkeypatch.setenv("HF_LISA_CACHE", str(tmp_path / "cache"))
    bundled = load_task_or_file(n_train=40, n_validation=8)
    assert (len(bundled["train"]), len(bundled["validation"])) == (40, 8)
    assert {"prompt", "completion"} <= set(bundled["train"].column_names)
    train_prompts = set(bundled["train"]["prompt"])
    assert not train_prompts & set(bundled["validation"]["prompt"])
    assert list((tmp_path / "cache" / "demo_task").iterdir())[0].name.endswith("-n40-v8")  # cached once, by size

    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(100)))
    raw = load_task_or_file(str(own))
    assert len(raw["train"]) + len(raw["validation"]) == 100 and len(raw["validation"]) == 5
    assert raw["train"].column_names == ["text"]
