"""``hf-lisa train --stage dpo``: preference rows through TRL's ``DPOTrainer``, with LISA's guarantees.

* **Only the sampled blocks train, bit for bit.** Runs save a checkpoint after every step and log the active blocks
  (``lisa/active_blocks``); between two consecutive checkpoints (the first against the loaded weights) nothing
  outside the blocks active in that step changed, except what trains throughout (E+H+final norm for full-parameter
  LISA), and everything in them did: every weight (full-parameter LISA), every ``lisa_B`` (adapters).
* **The reference** is the model as loaded: the evaluation before training has the DPO loss of a policy equal to its
  reference, log 2, with zero margins; a resumed run (whose weights come from a mid-interval checkpoint) ends where
  the uninterrupted one does, so its reference cannot have come from the checkpoint.
* **The data**: string and chat-message rows (TRL's implicit prompt), bad rows skipped and counted or refused naming
  their line, ``--overlength`` on the tokenised pairs, the columns checked before the model loads.
* **The options**: ``--dpo_beta`` and the preference columns refused without ``--stage dpo``, the SFT-only options
  refused with it, every ``TrainingArguments`` field carried into TRL's ``DPOConfig``.

Tiny 4-block llama (character tokenizer with a chat template) for the bitwise checks; one run on the embedded
SmolLM2-135M (``hf_lisa.models.default_model_path()``, the default model).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import build_char_tokenizer, build_tiny_lm_dir, copy_task_rows, write_jsonl

from hf_lisa import cli
from hf_lisa.train import main, parse_args
from hf_lisa.data.validation import DataError

pytest.importorskip("trl", reason="--stage dpo runs TRL's DPOTrainer (hf-lisa[trl])")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models gain nothing from more threads

NUM_BLOCKS, STEPS, K = 4, 4, 2  # two LISA periods: blocks drawn at steps 0 and 2
ALWAYS_TRAINABLE = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}  # E+H+final norm
SHIFT = str.maketrans("abcdefgh", "bcdefghi")


def preference_rows(n: int, seed: int = 0) -> list[dict]:
    """The copy task as preferences: "say c" prefers "ccc" to "ddd"."""
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"].translate(SHIFT)}
            for r in copy_task_rows(n, seed=seed)]


def chat_rows(n: int) -> list[dict]:
    """The same pairs as chat messages with an implicit prompt (the user turn both conversations share)."""
    return [{"chosen": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["rejected"]}]}
            for r in preference_rows(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage_dpo")
    return {
        "root": root,
        "model": build_tiny_lm_dir(root / "model", num_layers=NUM_BLOCKS),
        "strings": write_jsonl(root / "strings.jsonl", preference_rows(40)),
        "chat": write_jsonl(root / "chat.jsonl", chat_rows(40)),
    }


def dpo_argv(files, output_dir, method: str, data: str = "strings", *extra) -> list[str]:
    schedule = ["--lisa_activated_layers", "1", "--lisa_interval_steps", str(K)]  # γ = 1 of 4 blocks
    method_options = {"lisa": schedule, "full": [], "lora": ["--r", "4"], "dora": ["--r", "4"],
                      "lisa-adapter": ["--r", "4", "--target_modules", "q_proj", "v_proj", "up_proj", *schedule]}
    return [
        "--stage", "dpo", "--model_name_or_path", files["model"], "--train_file", files[data],
        "--output_dir", str(output_dir), "--method", method, *method_options[method],
        "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
        "--learning_rate", "1e-2", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "true",
        "--disable_tqdm", "true", "--max_seq_length", "32", "--validation_split_percentage", "20", "--seed", "0",
        *extra,
    ]


def per_step_run(files, output_dir, method: str, data: str) -> dict:
    summary = main(dpo_argv(files, output_dir, method, data, "--save_strategy", "steps", "--save_steps", "1"))
    return {"summary": summary, "dir": Path(output_dir)}


@pytest.fixture(scope="module")
def runs(files):
    """One run per LISA form, a checkpoint after every step: full-parameter LISA on string rows, LISA adapters on
    chat rows."""
    return {method: per_step_run(files, files["root"] / method, method, data)
            for method, data in (("lisa", "strings"), ("lisa-adapter", "chat"))}


# ----------------------------------------------------------------------------------------------------------------------
# only the sampled blocks change, step by step
# ----------------------------------------------------------------------------------------------------------------------
def block_of(name: str):
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None


def active_blocks(run_dir: Path) -> dict[int, set[int]]:
    """The blocks active in each step, from the run's log (``lisa/active_blocks`` is logged after the step)."""
    state = json.loads((run_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return {h["step"]: {int(b) for b in h["lisa/active_blocks"].split(",")}
            for h in state["log_history"] if "lisa/active_blocks" in h}


def weights_per_step(run_dir: Path, file_name: str, initial: dict) -> list[dict[str, torch.Tensor]]:
    return [initial] + [load_file(run_dir / f"checkpoint-{step}" / file_name) for step in range(1, STEPS + 1)]


def changes(weights: list[dict]) -> dict[int, set[str]]:
    return {step: {n for n, w in weights[step].items() if not torch.equal(w, weights[step - 1][n])}
            for step in range(1, STEPS + 1)}


def assert_one_block_per_period(active: dict[int, set[int]]) -> None:
    assert sorted(active) == list(range(1, STEPS + 1)), active
    assert all(len(blocks) == 1 for blocks in active.values()), active
    for start in range(1, STEPS + 1, K):  # the same blocks through a period of K steps
        assert len({frozenset(active[s]) for s in range(start, start + K)}) == 1, active


def test_full_parameter_lisa_dpo_trains_only_the_sampled_blocks_and_e_h(files, runs):
    run = runs["lisa"]["dir"]
    active = active_blocks(run)
    assert_one_block_per_period(active)
    weights = weights_per_step(run, "model.safetensors", load_file(Path(files["model"]) / "model.safetensors"))
    names = set(weights[0])
    for step, changed in changes(weights).items():
        allowed = {n for n in names if n in ALWAYS_TRAINABLE or block_of(n) in active[step]}
        assert changed <= allowed, f"step {step}: block {active[step]} is active, but {sorted(changed - allowed)} moved"
        assert changed == allowed, f"step {step}: block {active[step]} is active, but {sorted(allowed - changed)} not"


def test_lisa_adapter_dpo_trains_only_the_sampled_blocks_adapters(runs):
    run = runs["lisa-adapter"]["dir"]
    active = active_blocks(run)
    assert_one_block_per_period(active)
    first = load_file(run / "checkpoint-1" / "adapter_model.safetensors")
    initial = {n: torch.zeros_like(w) if ".lisa_B." in n else w for n, w in first.items()}  # B = 0, A as drawn
    weights = weights_per_step(run, "adapter_model.safetensors", initial)
    assert not any(".ref." in n for n in weights[1]), "TRL's copy of the adapter as reference was saved"
    for step, changed in changes(weights).items():
        outside = sorted(n for n in changed if block_of(n) not in active[step])
        assert not outside, f"step {step}: only block {active[step]} may train, but {outside} moved"
        if step == 1:  # A's step-1 values are not on disk: only B is known (zero) before the first step
            changed = {n for n in changed if ".lisa_B." in n}
        needed = {n for n in weights[0] if ".lisa_B." in n and block_of(n) in active[step]}
        assert needed and needed <= changed, f"step {step}: {sorted(needed - changed)} of block {active[step]} did not"


@pytest.mark.parametrize("method", ["lisa", "lisa-adapter"])
def test_the_reference_is_the_model_as_loaded_and_the_pairs_train(runs, method):
    summary = runs[method]["summary"]
    metrics = summary["metrics"]
    # before any step the policy is its reference: loss log 2, no margin (a reference from elsewhere would differ)
    assert metrics["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["eval_rewards/margins_before"] == 0 and metrics["eval_rewards/accuracies_before"] == 0
    assert metrics["eval_loss"] != metrics["eval_loss_before"] and metrics["eval_rewards/margins"] != 0
    assert math.isfinite(metrics["train_loss"])
    assert summary["hyperparameters"]["stage"] == "dpo" and summary["hyperparameters"]["dpo_beta"] == 0.1
    assert summary["data"]["format"] == "preference" and summary["data"]["rows_kept"] == {"train": 32, "validation": 8}
    card = (runs[method]["dir"] / "README.md").read_text()
    assert "preference (prompt, chosen, rejected)" in card and "DPO reward accuracy" in card
    config = json.loads((runs[method]["dir"] / "training_args.json").read_text())
    assert config["beta"] == 0.1 and config["max_length"] == 32 and config["learning_rate"] == 1e-2


# ----------------------------------------------------------------------------------------------------------------------
# resume
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lisa", "lisa-adapter"])
def test_resume_from_a_mid_interval_checkpoint_equals_the_uninterrupted_run(files, runs, tmp_path, capsys, method):
    run = runs[method]
    data = "strings" if method == "lisa" else "chat"
    shutil.copytree(run["dir"], tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / f"checkpoint-{STEPS}")  # latest: checkpoint-3, inside the period [2, 4)
    resumed = main(dpo_argv(files, tmp_path / "out", method, data, "--save_strategy", "no",
                            "--resume_from_checkpoint", "latest"))
    steps = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("[hf-lisa] step")]
    assert steps == [f"[hf-lisa] step {STEPS}/{STEPS}"], steps  # steps 1-3 came from the checkpoint
    name = "model.safetensors" if method == "lisa" else "adapter_model.safetensors"
    expected, got = load_file(run["dir"] / name), load_file(tmp_path / "out" / name)
    assert sorted(got) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    assert resumed["metrics"]["eval_loss"] == pytest.approx(run["summary"]["metrics"]["eval_loss"], abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# the embedded SmolLM2-135M
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # loads the 135M-parameter embedded model (~15 s on 2 cores)
def test_hf_lisa_train_stage_dpo_trains_the_embedded_model_with_lisa_adapters(tmp_path, capsys):
    pairs = [("What is the capital of France?", "Paris.", "London."), ("What is 2 + 2?", "4.", "5."),
             ("Name a primary colour.", "Red.", "Purple."), ("What do bees make?", "Honey.", "Milk.")]
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs])
    code = cli.main([  # no --model_name_or_path: the embedded model; its chat template renders the rows as turns
        "train", "--stage", "dpo", "--train_file", data, "--output_dir", str(tmp_path / "out"),
        "--method", "lisa-adapter", "--r", "4", "--target_modules", "q_proj", "v_proj",
        "--lisa_activated_layers", "2", "--lisa_interval_steps", "2",
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "5e-3", "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--max_seq_length", "64", "--validation_split_percentage", "0", "--seed", "0",
    ])
    assert code == 0
    summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    losses = [line.split("loss ")[1].split(",")[0] for line in capsys.readouterr().out.splitlines()
              if line.startswith("[hf-lisa] step")]
    assert losses[0] == "0.6931"  # log 2: the policy starts as its reference, the base model with adapters disabled
    assert summary["metrics"]["train_loss"] != pytest.approx(math.log(2), abs=1e-6)  # the second step's differs
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    trained = {block_of(n) for n, w in adapter.items() if ".lisa_B." in n and w.abs().sum() > 0}
    assert len(trained) == 2, trained  # one period of K = 2 steps: exactly the 2 sampled blocks' B moved
    assert summary["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow  # the embedded model, and its frozen copy as the reference (~30 s on 2 cores)
def test_hf_lisa_train_stage_dpo_trains_the_embedded_model_with_full_parameter_lisa(tmp_path, capsys):
    from hf_lisa.models import default_model_path

    pairs = [("What is the capital of France?", "Paris.", "London."), ("What is 2 + 2?", "4.", "5.")]
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs])
    code = cli.main([
        "train", "--stage", "dpo", "--train_file", data, "--output_dir", str(tmp_path / "out"),
        "--method", "lisa", "--lisa_activated_layers", "2", "--lisa_interval_steps", "2",
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-5", "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--max_seq_length", "64", "--validation_split_percentage", "0", "--seed", "0",
    ])
    assert code == 0
    losses = [line.split("loss ")[1].split(",")[0] for line in capsys.readouterr().out.splitlines()
              if line.startswith("[hf-lisa] step")]
    assert losses[0] == "0.6931"  # log 2: the policy starts equal to its reference, the frozen copy
    base = load_file(str(Path(default_model_path()) / "model.safetensors"))
    tuned = load_file(str(tmp_path / "out" / "model.safetensors"))
    moved = {name for name, weight in tuned.items() if not torch.equal(weight, base[name])}
    blocks = {block_of(name) for name in moved} - {None}
    assert len(blocks) == 2, blocks  # one period of K = 2 steps: exactly the 2 sampled blocks
    assert {name for name in moved if block_of(name) is None} == {"model.embed_tokens.weight", "model.norm.weight"}


# ----------------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------------
def _raw(path: str):
    from hf_lisa.data.pipeline import load_raw_datasets

    return load_raw_datasets(train_file=path, validation_split_percentage=0, line_numbers=True)


def _data_args(**overrides):
    from hf_lisa.train import DataArguments

    return DataArguments(**overrides)


def test_missing_preference_columns_are_named_before_the_model_loads(tmp_path):
    from hf_lisa.data.preference import check_preference_data

    path = write_jsonl(tmp_path / "sft.jsonl", copy_task_rows(4))
    with pytest.raises(DataError, match=r"sft.jsonl'.*has the columns \['prompt', 'completion'\], but --stage dpo "
                                        r"needs .*'chosen' and 'rejected'.*Missing: \['chosen', 'rejected'\]"):
        check_preference_data(_raw(path), _data_args())
    path = write_jsonl(tmp_path / "no_prompt.jsonl", [{"chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="string responses need a 'prompt' column"):
        check_preference_data(_raw(path), _data_args())
    path = write_jsonl(tmp_path / "renamed.jsonl", [{"q": "say a", "good": "aaa", "bad": "bbb"}])
    assert check_preference_data(_raw(path), _data_args(prompt_column="q", chosen_column="good",
                                                        rejected_column="bad")) == "text"


BAD_ROWS = [
    {"prompt": "say a", "chosen": "aaa", "rejected": "bbb"},  # line 1: fine
    {"prompt": "say a", "chosen": "", "rejected": "bbb"},  # 2: empty chosen
    {"prompt": "say a", "chosen": "aaa", "rejected": None},  # 3: missing rejected
    {"prompt": "say a", "chosen": "aaa", "rejected": "aaa"},  # 4: no preference
    {"prompt": "", "chosen": "aaa", "rejected": "bbb"},  # 5: empty prompt
    {"prompt": "say b", "chosen": "bbb", "rejected": "ccc"},  # 6: fine
]


def test_bad_preference_rows_are_skipped_counted_or_refused_by_line(tmp_path):
    from hf_lisa.data.preference import preference_datasets

    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    rows, report = preference_datasets(_raw(path), build_char_tokenizer(), _data_args(chat_template="never"))
    assert report.skipped["train"] == {"empty chosen": 1, "missing rejected": 1, "chosen equals rejected": 1,
                                       "empty prompt": 1}
    assert report.skipped_lines["train"]["chosen equals rejected"] == [4] and report.kept["train"] == 2
    assert rows["train"]["chosen"] == ["aaa", "bbb"]  # strings kept as strings with --chat_template never
    with pytest.raises(DataError, match=r"bad.jsonl', line 2: 'chosen' is empty \(empty chosen\)\. Fix the row"):
        preference_datasets(_raw(path), build_char_tokenizer(), _data_args(on_bad_row="error"))


def test_rows_become_chat_turns_and_implicit_prompts_are_split_off():
    from hf_lisa.data.preference import PreferenceColumns, preference_row

    columns = PreferenceColumns()
    user, good, bad = ({"role": role, "content": text} for role, text in
                       (("user", "say a"), ("assistant", "aaa"), ("assistant", "bbb")))
    # strings with a chat template: a user turn and assistant turns, as SFT renders prompt/completion rows
    row = preference_row({"prompt": "say a", "chosen": "aaa", "rejected": "bbb"}, columns, "text", True, "skip")
    assert (row["prompt"], row["chosen"], row["rejected"], row["_hf_lisa_skip"]) == ([user], [good], [bad], "")
    # TRL's implicit prompt: the turns both conversations share
    row = preference_row({"chosen": [user, good], "rejected": [user, bad]}, columns, "messages", True, "skip")
    assert (row["prompt"], row["chosen"], row["rejected"]) == ([user], [good], [bad])
    # a string prompt that the responses repeat (as in UltraFeedback's binarized rows)
    row = preference_row({"prompt": "say a", "chosen": [user, good], "rejected": [user, bad]}, columns, "messages",
                         True, "skip")
    assert (row["prompt"], row["chosen"], row["rejected"]) == ([user], [good], [bad])
    row = preference_row({"chosen": [good], "rejected": [bad]}, columns, "messages", True, "skip")
    assert row["_hf_lisa_skip"] == "no shared prompt turns"
    row = preference_row({"chosen": [user, good], "rejected": [user, {"role": "user", "content": "hm"}]}, columns,
                         "messages", True, "skip")
    assert row["_hf_lisa_skip"] == "no assistant turn in rejected"


def _prepared(lengths: list[tuple[int, int, int]]):
    import datasets

    from hf_lisa.data.validation import add_locations

    rows = [{"prompt_ids": [1] * p, "chosen_ids": [2] * c, "rejected_ids": [3] * r} for p, c, r in lengths]
    return add_locations(datasets.Dataset.from_list(rows), "train_file='pairs.jsonl'", "line")


@pytest.mark.parametrize("overlength, kept, skipped", [
    ("skip", 2, {"prompt fills max_seq_length=10": 1, "longer than max_seq_length=10": 1}),
    ("truncate", 3, {"prompt fills max_seq_length=10": 1}),
])
def test_overlength_applies_to_the_tokenised_pairs(overlength, kept, skipped):
    from hf_lisa.data.pipeline import TokenizationReport
    from hf_lisa.data.preference import apply_length_policy

    given = _prepared([(4, 3, 2), (4, 8, 2), (12, 1, 1), (2, 8, 8)])  # line 2 too long; TRL dropped line 3
    prepared = given.select([0, 1, 3])
    report = TokenizationReport("preference", kept={"train": 4})
    result = apply_length_policy(prepared, given["_hf_lisa_line"], given, "train", 10, overlength, report)
    assert len(result) == kept and report.kept["train"] == kept and report.skipped["train"] == skipped
    assert "_hf_lisa_line" not in result.column_names
    with pytest.raises(DataError, match=r"pairs.jsonl', line 3: its prompt alone fills max_seq_length=10\. Raise"):
        apply_length_policy(prepared, given["_hf_lisa_line"], given, "train", 10, "error", report)
    with pytest.raises(DataError, match=r"line 2 has 12 tokens \(prompt and longer response\), more than "
                                        r"max_seq_length=10\. Raise --max_seq_length, or pass --overlength"):
        apply_length_policy(prepared, list(prepared["_hf_lisa_line"]), given, "train", 10, "error", report)


def test_a_run_counts_the_rows_too_long_for_max_seq_length(files, tmp_path):
    rows = preference_rows(20) + [{"prompt": "say a", "chosen": "a" * 40, "rejected": "b"}]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    files = {**files, "long": data}
    summary = main(dpo_argv(files, tmp_path / "out", "lora", "long", "--save_strategy", "no", "--max_steps", "1",
                            "--validation_split_percentage", "0"))
    assert summary["data"]["rows_skipped"] == {"train": {"longer than max_seq_length=32": 1}}
    assert summary["data"]["rows_kept"] == {"train": 20}


# ----------------------------------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------------------------------
def _parse(tmp_path, *argv):
    return parse_args(["--output_dir", str(tmp_path), "--report_to", "none", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--dpo_beta", "0.5"], r"^--dpo_beta=0.5 applies to --stage dpo only"),
    (["--chosen_column", "good", "--rejected_column", "bad"],
     r"^--chosen_column='good', --rejected_column='bad' apply to --stage dpo only"),
    (["--stage", "ppo"], r"^--stage='ppo' is invalid; allowed: sft, dpo"),
    (["--stage", "dpo", "--eval_generation_samples", "8"],
     r"^--stage dpo does not use --eval_generation_samples=8 \(a DPO run is scored by its reward accuracy"),
    (["--stage", "dpo", "--packing", "true", "--completion_only_loss", "false"],
     r"--completion_only_loss=False \(the DPO loss covers the responses only\); --packing=True"),
    (["--stage", "dpo", "--method", "lora", "--lisa_dropout", "0.1"], r"--lisa_dropout=0.1 \(TRL's DPOTrainer turns"),
    (["--stage", "dpo", "--chunked_loss", "false"], r"--chunked_loss=False \(TRL's DPOTrainer computes"),
    (["--stage", "dpo", "--label_smoothing_factor", "0.1"], r"--label_smoothing_factor=0.1 \(the Trainer's label"),
    (["--stage", "dpo", "--data_format", "messages"], r"--data_format='messages' \(preference rows are recognised"),
])
def test_options_that_do_not_apply_to_the_stage_are_refused(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(tmp_path, *argv)


def test_dpo_beta_and_the_columns_parse_with_stage_dpo(tmp_path):
    _, data_args, lisa_args, _ = _parse(tmp_path, "--stage", "dpo", "--dpo_beta", "0.3", "--chosen_column", "good")
    assert (lisa_args.stage, lisa_args.dpo_beta, data_args.chosen_column) == ("dpo", 0.3, "good")


def test_stage_dpo_without_preference_data_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--stage dpo needs preference rows .*pass --train_file or --dataset_name"):
        main(["--stage", "dpo", "--output_dir", str(tmp_path / "out"), "--report_to", "none"])


def test_every_training_argument_is_carried_into_the_dpo_config(tmp_path):
    import dataclasses

    from hf_lisa.train.dpo import DPO_SETTINGS, dpo_config

    *_, training_args = _parse(tmp_path, "--learning_rate", "3e-4", "--lr_scheduler_type", "cosine", "--bf16",
                               "false", "--gradient_checkpointing", "true", "--logging_steps", "3",
                               "--save_total_limit", "2", "--keep_checkpoints", "false", "--warmup_steps", "2")
    config = dpo_config(training_args, beta=0.25, max_seq_length=48, num_proc=None)
    for f in dataclasses.fields(training_args):
        if f.init and f.name not in DPO_SETTINGS:
            assert getattr(config, f.name) == getattr(training_args, f.name), f.name
    assert (config.beta, config.max_length, config.keep_checkpoints, config.bf16) == (0.25, 48, False, False)
    assert config.gradient_checkpointing and config.learning_rate == 3e-4  # not DPOConfig's defaults


# ----------------------------------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------------------------------
def test_a_dpo_run_that_trains_nothing_stops(files, tmp_path):
    """LisaTrainer's progress guard runs under DPO: a loss with no gradient stops the run after its first steps."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_lisa.errors import NothingTrainedError
    from hf_lisa.train.dpo import dpo_config
    from hf_lisa.trainer.trl import LisaDPOTrainer

    class ZeroLoss(LisaDPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 0

    *_, training_args = _parse(tmp_path, "--use_cpu", "true", "--max_steps", "4", "--disable_tqdm", "true",
                               "--per_device_train_batch_size", "4")
    model = AutoModelForCausalLM.from_pretrained(files["model"])
    trainer = ZeroLoss(model=model, ref_model=AutoModelForCausalLM.from_pretrained(files["model"]),
                       args=dpo_config(training_args, beta=0.1, max_seq_length=32, num_proc=None),
                       train_dataset=datasets.Dataset.from_list(preference_rows(16)),
                       processing_class=AutoTokenizer.from_pretrained(files["model"]))
    with pytest.raises(NothingTrainedError):
        trainer.train()


def test_a_fresh_adapters_reference_is_the_base_model_not_a_copy_of_the_adapter(files, tmp_path):
    """TRL 1.16 copies a given PeftModel's adapter into a "ref" adapter; a fresh one is the identity, so it goes."""
    import datasets
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_lisa
    from hf_lisa.train.dpo import dpo_config
    from hf_lisa.trainer.trl import LisaDPOTrainer

    *_, training_args = _parse(tmp_path, "--use_cpu", "true", "--max_steps", "1", "--disable_tqdm", "true")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(files["model"]),
                           hf_lisa.LisaConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    trainer = LisaDPOTrainer(model=model, args=dpo_config(training_args, beta=0.1, max_seq_length=32, num_proc=None),
                             train_dataset=datasets.Dataset.from_list(preference_rows(8)),
                             processing_class=AutoTokenizer.from_pretrained(files["model"]))
    assert list(trainer.model.peft_config) == ["default"] and trainer.ref_model is None
    assert [n for n, p in trainer.model.named_parameters() if p.requires_grad] == names
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:  # the adapters away from the identity: the reference must not follow them
                p.add_(0.5)
        ref_chosen, _ = trainer.compute_ref_log_probs(trainer.model, batch)
        with trainer.model.disable_adapter():
            logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    expected_chosen = (logps * batch["completion_mask"][:, 1:]).sum(-1).chunk(2)[0]
    torch.testing.assert_close(ref_chosen, expected_chosen, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["dora", "full"])
def test_every_other_method_trains_with_dpo(files, tmp_path, method):
    summary = main(dpo_argv(files, tmp_path / "out", method, "strings", "--save_strategy", "no", "--max_steps", "2"))
    metrics = summary["metrics"]
    assert metrics["eval_loss_before"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["eval_loss"] != metrics["eval_loss_before"] and summary["method"] == method
