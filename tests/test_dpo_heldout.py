"""``hf-lisa train --stage dpo``: the pairs held out for evaluation are drawn *after* skipping (issue 33, item 11), as
the SFT path holds out its rows (``test_silent_inputs.py``).

* A held-out pair that is skipped (too long for ``--max_seq_length`` under ``--overlength skip``, or a bad pair under
  ``--on_bad_row skip``) is replaced by a kept training pair, seeded: the same pairs on every run and on resume. One
  such pair drawn into a 1-pair split no longer stops the run; it is counted as a skipped training row, as in SFT.
* A held-out split smaller than :data:`~hf_lisa.data.training_data.TINY_VALIDATION` rows is warned about when it is
  drawn, naming its size and ``--validation_split_percentage`` (for preference pairs as for SFT rows).
* When every held-out pair is skipped and no kept pair can replace them, the run stops naming
  ``--validation_split_percentage`` and its value.

The real command on a tiny 2-block llama with a character tokenizer (``tests/train_fixtures.py``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from train_fixtures import build_tiny_lm_dir, write_jsonl

from hf_lisa import cli
from hf_lisa.data.training_data import load_training_data

pytest.importorskip("trl", reason="--stage dpo runs TRL's DPOTrainer (hf-lisa[trl])")
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

LONG = "z" * 80  # with its prompt, longer than --max_seq_length 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_lm_dir(tmp_path_factory.mktemp("dpo_heldout") / "model", num_layers=2)


def pairs(n: int, long_at: tuple[int, ...] = ()) -> list[dict]:
    """``n`` distinct pairs ("say a0" prefers "aa" to "no"); those at ``long_at`` have an overlength chosen response."""
    letters = "abcdefghijklmnopqrstuvwxy"
    rows = [{"prompt": f"say {letters[i % 25]}{i}", "chosen": letters[i % 25] * 2, "rejected": "no"}
            for i in range(n)]
    for i in long_at:
        rows[i]["chosen"] = LONG
    return rows


def held_out_prompts(path: str, seed: int, percentage: float = 5.0) -> list[str]:
    data = load_training_data(train_file=path, seed=seed, validation_split_percentage=percentage)
    return list(data.sources[0].parts[0]["validation"]["prompt"])


def seed_holding_out(path: str, prompts: set, percentage: float = 5.0) -> int:
    """A seed whose held-out split is exactly the rows of ``prompts``."""
    for seed in range(500):
        if set(held_out_prompts(path, seed, percentage)) == prompts:
            return seed
    raise AssertionError(f"no seed holds out exactly {prompts}")


def argv(model: str, path: str, output_dir: Path, seed: int, *extra: str) -> list[str]:
    return [
        "--stage", "dpo", "--model_name_or_path", model, "--train_file", path, "--output_dir", str(output_dir),
        "--method", "lora", "--r", "4", "--max_steps", "3", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "4", "--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none",
        "--use_cpu", "true", "--disable_tqdm", "true", "--max_seq_length", "32", "--seed", str(seed), *extra,
    ]


def train(model: str, path: str, output_dir: Path, seed: int, *extra: str) -> int:
    return cli.main(["train", *argv(model, path, output_dir, seed, "--save_strategy", "no", *extra)])


def one_bad_pair_held_out(directory: Path, bad: str = "too long") -> tuple[str, int]:
    """20 pairs, the 8th ``bad`` ("too long" for --max_seq_length, or "chosen equals rejected"), and a seed whose 5%
    held-out split is that pair alone (1 pair)."""
    rows = pairs(20, long_at=(7,) if bad == "too long" else ())
    if bad == "chosen equals rejected":
        rows[7]["rejected"] = rows[7]["chosen"]
    path = write_jsonl(directory / "pairs.jsonl", rows)
    return path, seed_holding_out(path, {rows[7]["prompt"]})


@pytest.mark.parametrize("bad, reason", [("too long", "longer than max_seq_length=32"),
                                         ("chosen equals rejected", "chosen equals rejected")])
def test_a_skipped_pair_drawn_as_the_only_held_out_pair_is_replaced_and_the_run_trains(model, tmp_path, caplog,
                                                                                       capsys, bad, reason):
    path, seed = one_bad_pair_held_out(tmp_path, bad)
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        status = train(model, path, tmp_path / "out", seed)
    err = capsys.readouterr().err
    assert status == 0, err[-3000:]
    log = caplog.text
    assert "only 1 row held out for evaluation (5% of its rows)" in log  # the tiny split, named with its option
    assert "raise --validation_split_percentage" in log
    assert "1 of the 1 pairs held out for evaluation were skipped; 1 of its training pairs are held out in their " \
           "place" in log
    data = json.loads((tmp_path / "out" / "training_summary.json").read_text())["data"]
    assert data["rows_skipped"] == {"train": {reason: 1}}  # counted as a training row, as SFT counts it
    assert data["rows_kept"] == {"train": 18, "validation": 1}  # 20 pairs, 1 skipped, 1 of the 19 kept held out


def test_a_resumed_run_holds_out_the_same_pairs_and_ends_where_the_uninterrupted_one_does(
        model, tmp_path, capsys):
    """The replacement pair is drawn from the data and ``--seed`` alone: a run resumed from a checkpoint trains on
    the same pairs (a different draw would move another pair out of training and change the weights)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from hf_lisa.train import main

    path, seed = one_bad_pair_held_out(tmp_path)
    full = main(argv(model, path, tmp_path / "full", seed, "--save_strategy", "steps", "--save_steps", "1"))
    capsys.readouterr()
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint-3")
    resumed = main(argv(model, path, tmp_path / "resumed", seed, "--save_strategy", "no",
                        "--resume_from_checkpoint", "latest"))
    steps = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("[hf-lisa] step")]
    assert steps == ["[hf-lisa] step 3/3"], steps  # steps 1-2 came from the checkpoint
    expected = load_file(tmp_path / "full" / "adapter_model.safetensors")
    got = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    assert resumed["metrics"]["eval_loss"] == pytest.approx(full["metrics"]["eval_loss"], abs=1e-6)
    assert resumed["data"]["rows_kept"] == full["data"]["rows_kept"] == {"train": 18, "validation": 1}


def test_the_replacement_pairs_are_drawn_from_the_seed_and_the_kept_training_pairs():
    import datasets

    from hf_lisa.data.pipeline import TokenizationReport
    from hf_lisa.data.preference import hold_out_after_skipping
    from hf_lisa.data.validation import add_locations

    def tokenised(ids):
        return datasets.Dataset.from_list([{"prompt_ids": [i], "chosen_ids": [1], "rejected_ids": [2]} for i in ids])

    rows = {split: add_locations(datasets.Dataset.from_list([{"prompt": "p"}] * n), "train_file='p.jsonl'", "line")
            for split, n in (("train", 30), ("validation", 3))}
    picks = {}
    for seed in (0, 0, 1):
        report = TokenizationReport("preference", kept={"train": 28, "validation": 1},
                                    skipped={"train": {"too long": 2}, "validation": {"too long": 2}},
                                    skipped_lines={"train": {"too long": [4, 9]}, "validation": {"too long": [2]}})
        train, validation = hold_out_after_skipping(tokenised(range(100, 128)), tokenised([7]), rows, seed, report, 10)
        moved = [ids[0] for ids in validation["prompt_ids"][:-1]]
        assert validation["prompt_ids"][-1] == [7] and len(moved) == 2  # the kept held-out pair, and two in its place
        assert sorted(moved + [ids[0] for ids in train["prompt_ids"]]) == list(range(100, 128))  # moved, not copied
        assert report.kept == {"train": 26, "validation": 3} and report.skipped == {"train": {"too long": 4}}
        assert report.skipped_lines == {"train": {"too long": [2, 4, 9]}}
        picks.setdefault(seed, []).append(moved)
    assert picks[0][0] == picks[0][1] and picks[1][0] != picks[0][0]


def test_every_held_out_pair_skipped_with_none_left_to_replace_them_stops_naming_the_option(model, tmp_path, capsys):
    rows = pairs(3, long_at=(0, 1))
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    seed = seed_holding_out(path, {rows[0]["prompt"], rows[1]["prompt"]}, percentage=50)  # 2 of the 3 pairs
    status = train(model, path, tmp_path / "out", seed, "--validation_split_percentage", "50")
    err = capsys.readouterr().err
    assert status == 2, err[-2000:]
    assert re.search(r"Every pair held out for evaluation \(2 of train_file='.*pairs\.jsonl', "
                     r"--validation_split_percentage=50\) was skipped, and no training pair is left to take their "
                     r"place \(1 kept\)\. .*--validation_split_percentage 0 to train without evaluation", err), \
        err[-2000:]
    assert not (tmp_path / "out" / "training_summary.json").exists()
