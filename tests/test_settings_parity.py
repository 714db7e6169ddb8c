"""One default per setting, whichever way a run starts: ``hf-lisa train``, ``LisaTrainer``, a plain ``Trainer`` with the
callbacks and TRL's ``SFTTrainer`` resolve the same settings and, on a tiny model with the same seed, train the same
parameters. Also the settings that could not take effect (issue 22, items 6 and 7)."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import OPTConfig, OPTForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hf_lisa
from conftest import TokenDataset
from train_fixtures import build_char_tokenizer, build_tiny_lm_dir, copy_task_rows, write_jsonl
from hf_lisa.scheduler.param_groups import layerwise_lr_decay_param_groups
from hf_lisa.train import main, parse_args
from hf_lisa.train.parsing.arguments import lisa_config_kwargs
from hf_lisa.train.methods import lisa_knobs
from hf_lisa.trainer.lisa_trainer import LisaTrainer
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback

trl = pytest.importorskip("trl", reason="TRL is the optional extra hf-lisa[trl]")
datasets = pytest.importorskip("datasets")

STEPS = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def build_tiny_opt_dir(directory) -> str:
    """A 4-block OPT whose embeddings are narrower than its blocks: ``project_in`` / ``project_out`` sit outside the
    blocks and are neither embeddings, LM head nor a norm (OPT-350m's shape)."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=128, hidden_size=32, word_embed_proj_dim=16, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = OPTForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {
        "opt": build_tiny_opt_dir(root / "opt"),
        "llama": build_tiny_lm_dir(root / "llama", num_layers=3),
        "train": write_jsonl(root / "train.jsonl", copy_task_rows(24, seed=0)),
    }


def cli_args(tiny, model: str, output_dir, method: str, *extra) -> list[str]:
    """Only what every entry point shares (steps, batch, rate); every LISA setting is left at its default."""
    return [
        "--model_name_or_path", tiny[model], "--train_file", tiny["train"], "--output_dir", str(output_dir),
        "--validation_split_percentage", "0", "--eval_generation_samples", "0", "--max_steps", str(STEPS),
        "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--save_strategy", "no", "--report_to",
        "none", "--use_cpu", "true", "--disable_tqdm", "true", "--max_seq_length", "32", "--method", method, *extra,
    ]


def python_args(output_dir, **overrides) -> TrainingArguments:
    """The Trainer's own defaults (seed 42 as on the command line) with the shared steps, batch and rate."""
    return TrainingArguments(
        str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **overrides,
    )


def sft_args(output_dir) -> "trl.SFTConfig":
    return trl.SFTConfig(
        str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, bf16=False, max_length=32, dataloader_num_workers=0,
    )


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {name for name, value in before.items() if name in after and not torch.equal(value, after[name])}


def snapshot(tensors) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tensors.items()}


# ----------------------------------------------------------------------------------------------------------------------
# the defaults
# ----------------------------------------------------------------------------------------------------------------------
def test_full_lisa_defaults_are_the_callbacks(tmp_path):
    _, _, lisa_args, _ = parse_args(["--method", "lisa", "--output_dir", str(tmp_path)])
    resolved = LisaCallback().resolved_settings()
    knobs = lisa_knobs(lisa_args)
    shared = set(resolved) & set(knobs)
    assert shared == {"lisa_activated_layers", "lisa_interval_steps", "lisa_sampling", "lisa_optimizer_state_policy",
                      "lisa_always_trainable", "lisa_layers_attribute"}
    assert {k: knobs[k] for k in shared} == {k: resolved[k] for k in shared}
    assert resolved["lisa_activated_layers"] == 2 and "heads" in resolved["lisa_always_trainable"]


def test_adapter_defaults_are_lisaconfigs(tmp_path):
    _, _, lisa_args, _ = parse_args(["--method", "lisa-adapter", "--output_dir", str(tmp_path)])
    from_cli = hf_lisa.LisaConfig(**lisa_config_kwargs(lisa_args)).to_dict()
    assert from_cli == hf_lisa.LisaConfig().to_dict()
    assert from_cli["lisa_activated_layers"] == 0 and from_cli["lisa_alpha"] == 8


# ----------------------------------------------------------------------------------------------------------------------
# the same parameters trained, by every entry point
# ----------------------------------------------------------------------------------------------------------------------
def _full_python_run(tiny, tmp_path, kind: str) -> tuple[set[str], dict]:
    model = OPTForCausalLM.from_pretrained(tiny["opt"])
    before = snapshot(model.state_dict())
    callback = LisaCallback()
    if kind == "sft":
        tokenizer = build_char_tokenizer()
        trainer = trl.SFTTrainer(model=model, args=sft_args(tmp_path / kind), processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_list(copy_task_rows(24, seed=0)),
                                 callbacks=[callback])
    else:
        cls = LisaTrainer if kind == "lisa_trainer" else Trainer
        trainer = cls(model=model, args=python_args(tmp_path / kind), callbacks=[callback],
                      train_dataset=TokenDataset(num_examples=24, seq_len=12, vocab=128))
    trainer.train()
    return changed(before, model.state_dict()), callback.resolved_settings()


@pytest.mark.slow  # a full hf-lisa train run and three Trainer/LisaTrainer/SFTTrainer runs
def test_full_lisa_trains_the_same_parameters_everywhere(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    summary = main(cli_args(tiny, "opt", out, "lisa"))
    saved = load_file(f"{tiny['opt']}/model.safetensors")  # the tied LM head is saved once, as the embeddings
    cli_changed = changed(saved, load_file(f"{out}/model.safetensors"))
    assert {"model.decoder.project_in.weight", "model.decoder.project_out.weight"} <= cli_changed  # task heads
    blocks = {int(n.split(".")[3]) for n in cli_changed if n.startswith("model.decoder.layers.")}
    assert len(blocks) == 2  # γ = 2 of 4, one draw in 3 steps (K = 20)
    for kind in ("trainer", "lisa_trainer", "sft"):
        trained, resolved = _full_python_run(tiny, tmp_path, kind)
        assert trained & set(saved) == cli_changed, kind
        assert {k: summary["lisa"][k] for k in resolved if k in summary["lisa"]} == {
            k: v for k, v in resolved.items() if k in summary["lisa"]}, kind


@pytest.mark.slow  # a full hf-lisa train run and three Trainer/LisaTrainer/SFTTrainer runs
def test_adapters_train_the_same_parameters_everywhere(tiny, tmp_path):
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    out = tmp_path / "cli"
    main(cli_args(tiny, "llama", out, "lisa-adapter"))
    start = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    torch.manual_seed(0)
    initial = get_peft_model_state_dict(get_peft_model(start, hf_lisa.LisaConfig(task_type="CAUSAL_LM")))
    cli_changed = changed(initial, load_file(f"{out}/adapter_model.safetensors"))
    assert cli_changed and {n.split(".")[-2] for n in cli_changed} == {"lisa_A", "lisa_B"}
    assert {n.split(".")[4] for n in cli_changed} == {"0", "1", "2"}  # γ = 0: every block's adapters
    assert len(cli_changed) == len(initial)

    for kind in ("trainer", "lisa_trainer", "sft"):
        base = AutoModelForCausalLM.from_pretrained(tiny["llama"])
        callback = LisaAdapterCallback()
        if kind == "sft":
            trainer = trl.SFTTrainer(model=base, args=sft_args(tmp_path / kind),
                                     processing_class=build_char_tokenizer(),
                                     train_dataset=datasets.Dataset.from_list(copy_task_rows(24, seed=0)),
                                     peft_config=hf_lisa.LisaConfig(task_type="CAUSAL_LM"), callbacks=[callback])
        else:
            model = get_peft_model(base, hf_lisa.LisaConfig(task_type="CAUSAL_LM"))
            cls = LisaTrainer if kind == "lisa_trainer" else Trainer
            trainer = cls(model=model, args=python_args(tmp_path / kind), callbacks=[callback],
                          train_dataset=TokenDataset(num_examples=24, seq_len=12, vocab=128))
        before = snapshot(get_peft_model_state_dict(trainer.model))
        trainer.train()
        assert changed(before, get_peft_model_state_dict(trainer.model)) == cli_changed, kind
        assert callback.resolved_settings(trainer.model)["lisa_activated_layers"] == 0


def test_the_start_summary_names_what_never_trains(tiny, tmp_path, capsys):
    main(cli_args(tiny, "opt", tmp_path / "out", "lisa", "--lisa_always_trainable", "embeddings", "lm_head", "norm"))
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "never trains" in line)
    assert "model.decoder.project_in.weight" in line and "model.decoder.project_out.weight" in line


# ----------------------------------------------------------------------------------------------------------------------
# settings that could not take effect
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [{"lisa_interval_steps": 5}, {"lisa_sampling": "cyclic"}])
def test_layer_schedule_settings_are_refused_without_sampling(setting):
    name = next(iter(setting))
    with pytest.raises(ValueError, match=rf"{name}.*=.* has no effect with .*lisa_activated_layers.*=0"):
        hf_lisa.LisaConfig(**setting)
    hf_lisa.LisaConfig(lisa_activated_layers=1, **setting)  # with sampling they apply


@pytest.mark.parametrize("option", [["--lisa_interval_steps", "5"], ["--lisa_sampling", "cyclic"],
                                    ["--lisa_optimizer_state_policy", "keep"]])
def test_the_command_line_refuses_them_too(tmp_path, option, capsys):
    from hf_lisa import cli

    assert cli.main(["train", "--method", "lisa-adapter", "--output_dir", str(tmp_path), *option]) == 2
    assert "has no effect with --method lisa-adapter --lisa_activated_layers (γ)=0" in capsys.readouterr().err


def test_the_adapter_callback_refuses_them_with_every_block_training(tiny_llama, training_args):
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(num_layers=2), hf_lisa.LisaConfig(r=2, target_modules=["q_proj"]))
    trainer = Trainer(model=model, args=training_args(max_steps=1), train_dataset=TokenDataset(8),
                      callbacks=[LisaAdapterCallback(lisa_interval_steps=5)])
    with pytest.raises(ValueError, match=r"lisa_interval_steps \(K\)=5 has no effect"):
        trainer.train()


def test_modules_to_save_inside_a_block_train_with_it(tiny_llama, training_args, caplog):
    from peft import get_peft_model

    config = hf_lisa.LisaConfig(r=2, target_modules=["q_proj"], modules_to_save=["post_attention_layernorm"],
                                lisa_activated_layers=1, lisa_interval_steps=2)
    model = get_peft_model(tiny_llama(num_layers=2), config)
    seen = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append({n: p.requires_grad for n, p in model.named_parameters()
                         if ".modules_to_save." in n})

    callback = LisaAdapterCallback()
    trainer = Trainer(model=model, args=training_args(max_steps=2), train_dataset=TokenDataset(8),
                      callbacks=[callback, Record()])
    with caplog.at_level(logging.INFO, logger="hf_lisa"):
        trainer.train()
    assert "modules_to_save inside the blocks train with their block" in caplog.text
    active = callback.layer_scheduler.history[-1][1]
    for flags in seen:
        for name, trains in flags.items():
            block = int(name.split(".layers.")[1].split(".")[0])
            assert trains == (block in active), name


def test_layerwise_lr_decay_never_decays_the_interpolation_scalars(tiny_llama):
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(num_layers=2), hf_lisa.LisaConfig(r=2, target_modules=["q_proj"],
                                                                         layer_interpolation=True))
    groups = layerwise_lr_decay_param_groups(model, lr=1e-3, decay=0.9, weight_decay=0.1, no_decay_names=[])
    interp = {id(p) for n, p in model.named_parameters() if "lisa_interp_" in n}
    assert len(interp) == 2
    for group in groups:
        if any(id(p) in interp for p in group["params"]):
            assert group["weight_decay"] == 0.0, group["name"]
    assert any(g["weight_decay"] == 0.1 for g in groups)  # the others still decay
