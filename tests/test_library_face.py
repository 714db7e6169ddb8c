"""The library face (issue 34 item 2): ``hf_lisa.trainer`` holds ``LisaTrainer``, its typed
``LisaTrainingArguments`` (one place per setting, checked once in ``__post_init__``) and the TRL compositions;
``hf-lisa train`` parses into a subclass of the same arguments class."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import TokenDataset, build_tiny_llama, build_training_args

from hf_lisa.errors import UsageError
from hf_lisa.train import parse_args
from hf_lisa.trainer import LisaTrainer, LisaTrainingArguments
from hf_lisa.trainer.training_args import TRAINER_OPTIONS
from hf_lisa.trainer_callbacks import LisaCallback
from hf_lisa.trainer_callbacks.progress import TrainingProgressGuard

BAD = {
    "layerwise_lr_decay": (0.0, r"a float in \(0, 1\]"),
    "optim_step_in_backward": ("yes", "true or false"),
    "optim_8bit_embeddings": (1, "true or false"),
    "cpu_allocator": ("tcmalloc", "default, trim, lean"),
    "chunked_loss": (None, "true or false"),
    "progress_check_steps": (-1, r"an integer >= 0"),
}


def _args(tmp_path, **overrides) -> LisaTrainingArguments:
    base = dict(max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
    return LisaTrainingArguments(str(tmp_path / "out"), **{**base, **overrides})


def test_every_setting_is_a_typed_field_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(LisaTrainingArguments)}
    for name, default in TRAINER_OPTIONS.items():
        assert fields[name].default == default and fields[name].metadata["help"], name
    assert set(BAD) == set(TRAINER_OPTIONS)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_once_naming_the_field_the_value_and_what_is_allowed(tmp_path, name):
    value, allowed = BAD[name]
    with pytest.raises(ValueError, match=rf"LisaTrainingArguments: {name}={value!r} is invalid; allowed: {allowed}"):
        _args(tmp_path, **{name: value})


def test_the_command_names_its_option_and_exits_as_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match=r"^--progress_check_steps=-1 is invalid; allowed: an integer >= 0"):
        parse_args(["--output_dir", str(tmp_path), "--progress_check_steps", "-1"])
    *_, training_args = parse_args(["--output_dir", str(tmp_path), "--progress_check_steps", "0",
                                    "--layerwise_lr_decay", "0.8", "--report_to", "none"])
    assert isinstance(training_args, LisaTrainingArguments)
    assert (training_args.progress_check_steps, training_args.layerwise_lr_decay) == (0, 0.8)


def test_the_trainer_reads_its_settings_from_the_arguments(tmp_path):
    args = _args(tmp_path, layerwise_lr_decay=0.5, chunked_loss=False, progress_check_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the arguments' way warns about nothing
        trainer = LisaTrainer(model=build_tiny_llama(num_layers=4), args=args, train_dataset=TokenDataset(8))
    assert trainer.layerwise_lr_decay == 0.5 and trainer.chunked_loss is False
    guard = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TrainingProgressGuard))
    assert guard.check_steps == 5
    rates = {group["name"]: group["lr"] for group in trainer.create_optimizer().param_groups}
    assert rates["block.0"] == pytest.approx(1e-2 * 0.5 ** 3) and rates["head"] == pytest.approx(1e-2)


def test_a_plain_training_arguments_keeps_the_defaults(tmp_path):
    trainer = LisaTrainer(model=build_tiny_llama(), args=build_training_args(tmp_path), train_dataset=TokenDataset(8))
    assert trainer.layerwise_lr_decay == 1.0 and trainer.chunked_loss is True
    assert len(trainer.create_optimizer().param_groups) == 2  # transformers' own: decay and no decay


def test_keywords_still_work_for_one_release_and_train_the_same_weights(tmp_path):
    def run(new_way: bool):
        torch.manual_seed(0)
        model = build_tiny_llama(num_layers=4)
        callbacks = [LisaCallback(lisa_activated_layers=2, lisa_interval_steps=2, seed=1)]
        if new_way:
            trainer = LisaTrainer(model=model, args=_args(tmp_path, layerwise_lr_decay=0.7, chunked_loss=False),
                                  train_dataset=TokenDataset(16), callbacks=callbacks)
        else:
            with pytest.warns(FutureWarning, match=r"LisaTrainer\(layerwise_lr_decay=\.\.\., chunked_loss=\.\.\.\): "
                                                   r"settings as keywords are deprecated.*LisaTrainingArguments") as w:
                trainer = LisaTrainer(model=model, args=build_training_args(tmp_path / "old", **_SAME),
                                      train_dataset=TokenDataset(16), callbacks=callbacks,
                                      layerwise_lr_decay=0.7, chunked_loss=False)
            assert w[0].filename == __file__  # the warning points at the caller's line
        trainer.train()
        return model.state_dict()

    new, old = run(True), run(False)
    assert all(torch.equal(new[name], old[name]) for name in new)
    assert any(not torch.equal(new[name], build_tiny_llama(num_layers=4).state_dict()[name]) for name in new)


_SAME = dict(max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2)


def test_a_setting_in_two_places_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"LisaTrainer got chunked_loss=False as keyword\(s\) and "
                                        r"args=LisaTrainingArguments.*set them there only"):
        LisaTrainer(model=build_tiny_llama(), args=_args(tmp_path), train_dataset=TokenDataset(8), chunked_loss=False)
    with pytest.raises(ValueError, match=r"LisaTrainer: layerwise_lr_decay=2\.0 is invalid"):
        LisaTrainer(model=build_tiny_llama(), args=build_training_args(tmp_path), train_dataset=TokenDataset(8),
                    layerwise_lr_decay=2.0)


def test_a_subclass_with_other_positional_parameters_reads_its_own_arguments(tmp_path):
    """``LisaDPOTrainer(model, ref_model, args)``: the settings come from the arguments the Trainer resolved."""

    from transformers import Trainer

    class WithReference(Trainer):  # a Trainer whose second positional parameter is not the arguments, as TRL's DPO
        def __init__(self, model, ref_model, args, **kwargs):
            self.ref_model = ref_model
            super().__init__(model=model, args=args, **kwargs)

    class LisaWithReference(LisaTrainer, WithReference):  # composed as hf_lisa.trainer.trl.LisaDPOTrainer is
        pass

    trainer = LisaWithReference(build_tiny_llama(), build_tiny_llama(),
                                _args(tmp_path, layerwise_lr_decay=0.6, progress_check_steps=0),
                                train_dataset=TokenDataset(8))
    assert trainer.layerwise_lr_decay == 0.6
    guards = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TrainingProgressGuard)]
    assert [g.check_steps for g in guards] == [0]
    given = TrainingProgressGuard(check_steps=7)
    trainer = LisaTrainer(model=build_tiny_llama(), args=_args(tmp_path), train_dataset=TokenDataset(8),
                          callbacks=[given])
    assert [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TrainingProgressGuard)] == [given]


def test_the_sft_config_carries_the_fields(tmp_path):
    pytest.importorskip("trl")
    from hf_lisa.trainer.trl import LisaSFTConfig, LisaSFTTrainer

    config = LisaSFTConfig(str(tmp_path), layerwise_lr_decay=0.9, report_to="none", use_cpu=True, bf16=False)
    assert config.layerwise_lr_decay == 0.9 and isinstance(config, LisaTrainingArguments)
    assert issubclass(LisaSFTTrainer, LisaTrainer)


def test_the_dpo_config_checks_the_fields_and_the_command_s_turns_the_chunked_loss_off(tmp_path):
    pytest.importorskip("trl")
    try:
        from trl import DPOTrainer  # noqa: F401
    except (ImportError, RuntimeError) as err:  # TRL 0.x pinned by LLaMA-Factory: DPO needs mergekit
        pytest.skip(f"TRL's DPOTrainer does not import here: {err}")
    from hf_lisa.train.dpo import dpo_config
    from hf_lisa.trainer.trl import LisaDPOConfig
    with pytest.raises(ValueError, match="LisaDPOConfig: cpu_allocator='x' is invalid"):
        LisaDPOConfig(str(tmp_path), cpu_allocator="x", report_to="none", use_cpu=True, bf16=False)
    *_, training_args = parse_args(["--output_dir", str(tmp_path), "--stage", "dpo", "--report_to", "none",
                                    "--layerwise_lr_decay", "0.9"])
    run_config = dpo_config(training_args, beta=0.1, max_seq_length=32, num_proc=None)
    assert isinstance(run_config, LisaDPOConfig)
    assert (run_config.chunked_loss, run_config.layerwise_lr_decay) == (False, 0.9)
