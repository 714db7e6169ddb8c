"""LISA inside other tools (``hf_lisa.integrations``): TRL's ``trl sft`` script, an axolotl plugin, a LLaMA-Factory recipe.

* TRL is installed here: its real parser (``TrlParser`` over ``trl sft``'s dataclasses) and ``SFTTrainer`` train a
  tiny llama saved with the embedded SmolLM2 tokenizer, and only the blocks the LISA schedule sampled change.
* axolotl 0.19 and LLaMA-Factory 0.9.5 cannot be installed beside this project's pins (docs/integrations.md): the glue
  is driven through the published interface (the plugin's hooks in the order axolotl's trainer builder calls them;
  ``run_exp(args, callbacks)``) around a real ``transformers.Trainer``; where axolotl is importable, its own
  ``PluginManager``, config validation, adapter loader and LISA callback are used too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

from conftest import TokenDataset, build_tiny_llama, build_training_args
from train_fixtures import copy_task_rows, write_jsonl
from hf_lisa.errors import UsageError
from hf_lisa.integrations import axolotl as ax
from hf_lisa.integrations import llamafactory as lf
from hf_lisa.integrations import trl_sft  # imports TRL only when it runs
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "integrations"
NUM_BLOCKS = 4
ALWAYS_TRAINABLE = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
HAS_AXOLOTL = importlib.util.find_spec("axolotl") is not None
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is the optional extra hf-lisa[trl]")


def block_of(name: str):
    return int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None


def sampled_blocks(callback) -> set[int]:
    return {b for _, active in callback.layer_scheduler.history for b in active}


def changed_parameters(before: dict, model) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_full_lisa_trained_only_sampled_blocks(changed: set[str], callback, names) -> None:
    sampled = sampled_blocks(callback)
    assert 1 <= len(sampled) < NUM_BLOCKS, sampled  # the check means something only if some block stayed out
    assert ALWAYS_TRAINABLE <= changed  # E+H+final norm train throughout
    assert {block_of(n) for n in changed if block_of(n) is not None} == sampled
    assert all(n in changed for n in names if block_of(n) in sampled)  # every weight of a sampled block trained


def assert_adapters_trained_only_in_sampled_blocks(changed: set[str], callback) -> None:
    sampled = sampled_blocks(callback)
    assert 1 <= len(sampled) < NUM_BLOCKS, sampled
    assert all("lisa_" in n for n in changed), sorted(n for n in changed if "lisa_" not in n)  # the base is frozen
    assert {block_of(n) for n in changed if ".lisa_B." in n} == sampled


# ----------------------------------------------------------------------------------------------------------------------
# TRL: python -m hf_lisa.integrations.trl_sft
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_tiny(tmp_path_factory):
    """A 4-block llama saved with the embedded SmolLM2 tokenizer (49152 tokens, a chat template), and a data folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_lisa.models import default_model_path

    root = tmp_path_factory.mktemp("trl_sft")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_jsonl(root / "data" / "train.jsonl", copy_task_rows(32, seed=0))
    return {"model": str(root / "model"), "data": str(root / "data")}


def trl_argv(smol_tiny, output_dir, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", smol_tiny["model"], "--dataset_name", smol_tiny["data"], "--output_dir", str(output_dir),
        "--max_steps", "6", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--max_length", "32",
        "--bf16", "false", "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm",
        "true", "--lisa_interval_steps", "2", "--lisa_activated_layers", "1", *extra,
    ]


def lisa_callback_of(trainer):
    (callback,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, (LisaCallback, LisaAdapterCallback))]
    return callback


@needs_trl
@pytest.mark.slow  # SFTTrainer, end to end (~5 s)
def test_trl_sft_peft_type_lisa_trains_only_the_sampled_blocks_adapters(smol_tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = trl_sft.main(trl_argv(smol_tiny, tmp_path, "--seed", "1", "--peft_type", "LISA", "--lora_r", "4",
                                    "--lora_target_modules", "q_proj", "v_proj", "--lora_dropout", "0"))
    callback = lisa_callback_of(trainer)
    assert isinstance(callback, LisaAdapterCallback)
    sampled = sampled_blocks(callback)
    assert 1 <= len(sampled) < NUM_BLOCKS, sampled
    # B starts at 0: exactly the sampled blocks' adapters moved; the base model did not
    moved = {block_of(n) for n, p in trainer.model.named_parameters() if ".lisa_B." in n and p.abs().sum() > 0}
    assert moved == sampled
    base = AutoModelForCausalLM.from_pretrained(smol_tiny["model"])
    now = {n.replace(".base_layer", ""): p for n, p in trainer.model.get_base_model().named_parameters()
           if "lisa_" not in n}
    assert all(torch.equal(now[n], p) for n, p in base.named_parameters())
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    # TRL's --lora_* options became the LisaConfig's r and targets; its default lora_alpha (32) its lisa_alpha
    assert (saved["peft_type"], saved["r"], saved["lisa_alpha"], sorted(saved["target_modules"])) == (
        "LISA", 4, 32, ["q_proj", "v_proj"])
    assert (saved["lisa_activated_layers"], saved["lisa_interval_steps"]) == (1, 2)


@needs_trl
@pytest.mark.slow  # SFTTrainer, end to end (~5 s)
def test_trl_sft_lisa_full_from_a_trl_config_file_trains_only_the_sampled_blocks(smol_tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"lisa_full": True, "seed": 1, "logging_steps": 1}))  # TRL's --config file
    trainer = trl_sft.main(["--config", str(config), *trl_argv(smol_tiny, tmp_path / "out")])
    callback = lisa_callback_of(trainer)
    assert isinstance(callback, LisaCallback) and callback.lisa_activated_layers == 1
    base = AutoModelForCausalLM.from_pretrained(smol_tiny["model"])
    before = snapshot(base)
    changed = changed_parameters(before, AutoModelForCausalLM.from_pretrained(tmp_path / "out"))
    assert_full_lisa_trained_only_sampled_blocks(changed, callback, list(before))
    assert any("lisa/active_blocks" in h for h in trainer.state.log_history)  # the callback's logs reached TRL's


def _parsed(*argv):
    return trl_sft.make_parser().parse_args_and_config(["--output_dir", "out", "--bf16", "false", "--use_cpu", "true",
                                                        *argv])


@needs_trl
@pytest.mark.parametrize("argv, message", [
    (["--sparsity", "0.4"], r"--sparsity=0.4 is a LISA setting, but LISA is not on: add --peft_type LISA"),
    (["--lisa_full", "--use_peft"], r"--lisa_full trains the base weights, without an adapter"),
    (["--lisa_full", "--load_in_4bit"], r"cannot be quantized"),
    (["--lisa_full", "--sparsity", "0.4"], r"--lisa_full does not use --sparsity=0.4 \(used by --peft_type LISA\)"),
    (["--peft_type", "LISA", "--lisa_always_trainable", "none"], r"--peft_type LISA does not use "
                                                                 r"--lisa_always_trainable"),
    (["--peft_type", "LISA", "--use_dora"], r"--use_dora=True is a LoRA option"),
    (["--peft_type", "LoHa"], r"--peft_type='LoHa' is invalid; allowed: LISA \(LISA adapters\) or LORA"),
    (["--lisa_full", "--lisa_activated_layers", "0"], r"--lisa_activated_layers \(γ\)=0 is invalid; allowed: an "
                                                      r"integer >= 1"),
    (["--peft_type", "LISA", "--lora_r", "0"], r"--lora_r: r=0 is invalid; allowed: a positive integer"),
])
def test_trl_sft_refuses_what_cannot_take_effect(argv, message):
    _, training_args, model_args, _, lisa_args = _parsed(*argv)
    with pytest.raises(UsageError, match=message):
        trl_sft.lisa_peft_config_and_callbacks(model_args, lisa_args, seed=0)


@needs_trl
def test_trl_sft_refuses_an_unknown_key_of_its_config_file(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("lisa_activated_layer: 2\n")  # a typo, refused rather than ignored
    with pytest.raises(UsageError, match=r"Unknown arguments from config file: \['--lisa_activated_layer', '2'\]"):
        trl_sft.main(["--config", str(config), "--output_dir", str(tmp_path), "--use_cpu", "true"])


@needs_trl
def test_trl_sft_peft_type_lisa_takes_trls_adapter_options_and_defaults():
    _, _, model_args, _, lisa_args = _parsed("--peft_type", "lisa", "--lora_target_modules", "all-linear",
                                             "--sparsity", "0.4", "--sparsity_pattern", '{"up_proj": 0.0}')
    config, (callback,) = trl_sft.lisa_peft_config_and_callbacks(model_args, lisa_args, seed=3)
    assert (config.r, config.lisa_alpha, config.lisa_dropout) == (16, 32, 0.05)  # TRL's LoRA defaults
    assert config.target_modules == "all-linear" and config.sparsity_pattern == {"up_proj": 0.0}
    assert config.lisa_activated_layers == 0  # the adapter form's default: every block's adapter, no schedule
    assert isinstance(callback, LisaAdapterCallback) and callback.seed == 3
    # without LISA the script is TRL's: its LoraConfig from --use_peft, or no adapter, and no callback
    for argv in (["--use_peft"], ["--peft_type", "LORA"]):
        _, _, model_args, _, lisa_args = _parsed(*argv)
        config, callbacks = trl_sft.lisa_peft_config_and_callbacks(model_args, lisa_args, seed=0)
        assert type(config).__name__ == "LoraConfig" and callbacks == [], argv
    _, _, model_args, _, lisa_args = _parsed()
    assert trl_sft.lisa_peft_config_and_callbacks(model_args, lisa_args, seed=0) == (None, [])


@needs_trl
def test_trl_sft_help_lists_lisa_beside_trls_options():
    text = trl_sft.make_parser().format_help()
    for option in ("--peft_type", "--lisa_full", "--lisa_activated_layers", "--sparsity", "--lora_r",
                   "--dataset_name", "--max_length"):
        assert option in text, option
    assert "--lisa_alpha" not in text  # set through TRL's --lora_alpha: one name per setting


@needs_trl
def test_trl_example_config_parses_into_lisa_adapters():
    *_, model_args, _, lisa_args = _parsed("--config", str(EXAMPLES / "trl_sft_lisa.yaml"))
    config, (callback,) = trl_sft.lisa_peft_config_and_callbacks(model_args, lisa_args, seed=0)
    assert (config.r, config.sparsity, config.lisa_activated_layers, config.lisa_interval_steps) == (16, 0.4, 4, 20)
    assert isinstance(callback, LisaAdapterCallback)


# ----------------------------------------------------------------------------------------------------------------------
# axolotl: hf_lisa.integrations.axolotl.LisaPlugin
# ----------------------------------------------------------------------------------------------------------------------
#: the hooks of axolotl 0.19.0's BasePlugin that LisaPlugin implements, with their parameters (read from the
#: published axolotl/integrations/base.py); axolotl calls them by these names and keywords
AXOLOTL_0_19_HOOKS = {
    "get_input_args": ["self"],
    "get_adapter_capabilities": ["self"],
    "pre_model_load": ["self", "cfg"],
    "load_adapter": ["self", "model", "cfg", "inference", "config_only"],
    "add_callbacks_pre_trainer": ["self", "cfg", "model"],
    "post_trainer_create": ["self", "cfg", "trainer"],
}


class LISACallback(TrainerCallback):
    """axolotl 0.19's own LISA callback (``axolotl.utils.callbacks.lisa``), as far as it acts: at steps K, 2K, ... it
    freezes every block and unfreezes ``n_layers`` random ones. Left in the trainer, it would train other blocks."""

    __module__ = "axolotl.utils.callbacks.lisa"

    def __init__(self, model, n_layers: int, step_interval: int) -> None:
        self.layers, self.n_layers, self.step_interval = model.model.layers, n_layers, step_interval

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.step_interval == 0:
            for layer in self.layers:
                layer.requires_grad_(False)
            for i in random.Random(state.global_step).sample(range(len(self.layers)), self.n_layers):
                self.layers[i].requires_grad_(True)


def axolotl_like_run(cfg, model, tmp_path, axolotl_callback=None, steps: int = 6):
    """Trainer set up in the order of axolotl 0.19's HFCausalTrainerBuilder.build and axolotl.train: the plugins'
    pre-trainer callbacks to the constructor, axolotl's LISA callback added after it, then post_trainer_create."""
    plugin = ax.LisaPlugin()
    plugin.pre_model_load(cfg)
    loaded = plugin.load_adapter(model, cfg)
    model = loaded[0] if loaded is not None else model
    args = build_training_args(tmp_path, max_steps=steps, learning_rate=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=plugin.add_callbacks_pre_trainer(
        cfg, model))
    if axolotl_callback is not None:
        trainer.add_callback(axolotl_callback(trainer))
    plugin.post_trainer_create(cfg, trainer)
    before = snapshot(trainer.model)
    trainer.train()
    return trainer, lisa_callback_of(trainer), changed_parameters(before, trainer.model)


def test_axolotl_plugin_full_parameter_lisa_replaces_axolotls_callback(tmp_path):
    cfg = {"lisa_n_layers": 1, "lisa_step_interval": 2, "lisa_layers_attribute": "model.layers", "seed": 1}
    model = build_tiny_llama(num_layers=NUM_BLOCKS)
    trainer, callback, changed = axolotl_like_run(cfg, model, tmp_path,
                                                  lambda t: LISACallback(t.model, n_layers=3, step_interval=2))
    assert not any(type(c).__name__ == "LISACallback" for c in trainer.callback_handler.callbacks)
    assert isinstance(callback, LisaCallback)
    assert (callback.lisa_activated_layers, callback.lisa_interval_steps) == (1, 2)
    assert_full_lisa_trained_only_sampled_blocks(changed, callback, [n for n, _ in model.named_parameters()])


def test_axolotl_plugin_says_it_replaces_axolotls_callback_where_axolotl_logs(tmp_path):
    """axolotl's logging (axolotl/logging_config.py, 0.19.0): the ``axolotl`` logger at INFO with its own handler and
    ``propagate: False``, the root logger at WARNING. The real ``axolotl train`` printed axolotl's "LISA will activate
    1/4 layers" (its callback's constructor) but not the plugin's notice that it took that callback out: the notice
    went to ``hf_lisa.*``, dropped at the root's WARNING."""
    import logging

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    axolotl_logger, root = logging.getLogger("axolotl"), logging.getLogger()
    saved = (axolotl_logger.level, axolotl_logger.propagate, root.level)
    axolotl_logger.setLevel(logging.INFO), axolotl_logger.addHandler(handler), root.setLevel(logging.WARNING)
    axolotl_logger.propagate = False
    try:
        cfg = {"lisa_n_layers": 1, "lisa_step_interval": 2}
        model = build_tiny_llama(num_layers=NUM_BLOCKS)
        trainer = Trainer(model=model, args=build_training_args(tmp_path, max_steps=1), train_dataset=TokenDataset(),
                          callbacks=ax.LisaPlugin().add_callbacks_pre_trainer(cfg, model))
        trainer.add_callback(LISACallback(model, n_layers=1, step_interval=2))
        ax.LisaPlugin().post_trainer_create(cfg, trainer)
    finally:
        axolotl_logger.removeHandler(handler)
        axolotl_logger.setLevel(saved[0]), root.setLevel(saved[2])
        axolotl_logger.propagate = saved[1]
    messages = [r.getMessage() for r in records]
    assert any("replaces axolotl's LISACallback" in m and "γ=1, K=2" in m for m in messages), messages


def test_axolotl_plugin_lisa_adapter_loads_a_lisa_config_and_trains_only_sampled_adapters(tmp_path):
    cfg = {"adapter": "lisa", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
           "lisa_n_layers": 1, "lisa_step_interval": 2, "lisa_adapter": {"sparsity": 0.4, "mask_init": "magnitude"},
           "seed": 1}
    config = ax.lisa_adapter_config(cfg)
    assert (config.r, config.lisa_alpha, config.lisa_activated_layers, config.lisa_interval_steps) == (4, 8, 1, 2)
    assert config.sparsity == 0.4  # lisa_adapter: LISA's other settings
    assert ax.LisaPlugin().load_adapter(None, cfg, config_only=True)[0] is None
    trainer, callback, changed = axolotl_like_run(cfg, build_tiny_llama(num_layers=NUM_BLOCKS), tmp_path)
    assert isinstance(callback, LisaAdapterCallback)
    assert_adapters_trained_only_in_sampled_blocks(changed, callback)
    # lora_model_dir: the saved LISA adapter, loaded back through the same hook
    trainer.model.save_pretrained(tmp_path / "adapter")
    reloaded, config = ax.LisaPlugin().load_adapter(build_tiny_llama(num_layers=NUM_BLOCKS),
                                                    {**cfg, "lora_model_dir": str(tmp_path / "adapter")})
    assert config.peft_type == "LISA" and config.sparsity == 0.4
    trained = dict(trainer.model.named_parameters())
    assert any(".lisa_B." in n for n, _ in reloaded.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in reloaded.named_parameters() if ".lisa_B." in n)


@pytest.mark.parametrize("cfg, message", [
    ({"adapter": "lora", "lisa_n_layers": 2, "lisa_step_interval": 20}, r"adapter: lora with lisa_n_layers: 2"),
    ({"lisa_sampling": "cyclic"}, r"lisa_sampling: 'cyclic' needs lisa_n_layers \(no adapter\) or adapter: lisa"),
    ({"lisa_n_layers": 2, "lisa_adapter": {"sparsity": 0.4}}, r"lisa_adapter: .* needs adapter: lisa"),
    ({"lisa_n_layers": 0, "lisa_step_interval": 20}, r"axolotl config lisa_n_layers: lisa_activated_layers \(γ\)=0 "
                                                     r"is invalid; allowed: an integer >= 1"),
    ({"lisa_n_layers": 2, "lisa_step_interval": 0}, r"lisa_step_interval: lisa_interval_steps \(K\)=0 is invalid"),
    ({"adapter": "lisa", "lisa_adapter": {"r": 8}}, r"lisa_adapter.r: set it as lora_r: instead"),
    ({"adapter": "lisa", "lisa_adapter": {"sparsity": 1.5}}, r"sparsity=1.5 is invalid"),
])
def test_axolotl_plugin_refuses_what_cannot_take_effect(cfg, message):
    with pytest.raises(UsageError, match=message):
        ax.LisaPlugin().pre_model_load(cfg)


def test_axolotl_plugin_is_inert_without_lisa_keys():
    plugin = ax.LisaPlugin()
    assert plugin.add_callbacks_pre_trainer({"adapter": "lora"}, model=None) == []
    assert plugin.load_adapter(None, {"adapter": "lora"}) is None  # axolotl's own loader handles it


def test_axolotl_plugin_hooks_follow_the_published_interface():
    for hook, parameters in AXOLOTL_0_19_HOOKS.items():
        assert list(inspect.signature(getattr(ax.LisaPlugin, hook)).parameters) == parameters, hook
    assert ax.LisaPlugin().get_input_args() == "hf_lisa.integrations.axolotl.LisaPluginArgs"
    pydantic = pytest.importorskip("pydantic")
    args = ax.LisaPluginArgs(lisa_sampling="cyclic", lisa_adapter={"sparsity": 0.4})
    assert isinstance(args, pydantic.BaseModel) and args.lisa_adapter == {"sparsity": 0.4}
    assert not set(ax.LisaPluginArgs.model_fields) & set(ax.AXOLOTL_KEYS.values())  # axolotl's own keys stay its own


def test_axolotl_example_config_asks_for_full_parameter_lisa():
    cfg = yaml.safe_load((EXAMPLES / "axolotl_lisa.yaml").read_text())
    assert cfg["plugins"] == ["hf_lisa.integrations.axolotl.LisaPlugin"]
    (callback,) = ax.lisa_callbacks(cfg)
    assert (callback.lisa_activated_layers, callback.lisa_interval_steps, callback.lisa_layers_attribute) == (
        2, 20, "model.layers")


@pytest.fixture
def axolotl_env(monkeypatch):
    monkeypatch.setenv("AXOLOTL_DO_NOT_TRACK", "1")  # no telemetry call from a test
    from axolotl.integrations.base import PluginManager

    manager = PluginManager.get_instance()
    manager.plugins.clear()
    yield manager
    manager.plugins.clear()


@pytest.mark.skipif(not HAS_AXOLOTL, reason="axolotl is not installable beside this project's pins (docs)")
def test_axolotl_loads_validates_and_wires_the_plugin(axolotl_env, tmp_path):
    from axolotl.cli.config import load_cfg
    from axolotl.integrations.base import BasePlugin
    from axolotl.loaders.adapter import load_adapter
    from axolotl.utils.callbacks.lisa import lisa_callback_factory

    assert issubclass(ax.LisaPlugin, BasePlugin)
    for hook in AXOLOTL_0_19_HOOKS:
        assert list(inspect.signature(getattr(BasePlugin, hook)).parameters) == AXOLOTL_0_19_HOOKS[hook], hook
    model_dir = tmp_path / "model"
    build_tiny_llama(num_layers=NUM_BLOCKS).save_pretrained(model_dir)
    config = yaml.safe_load((EXAMPLES / "axolotl_lisa.yaml").read_text())
    config.update(base_model=str(model_dir), datasets=[{"path": write_jsonl(tmp_path / "d.jsonl", [
        {"instruction": "say a", "input": "", "output": "aaa"}]), "type": "alpaca"}], output_dir=str(tmp_path / "o"),
        adapter="lisa", lora_r=4, lora_alpha=8, lora_target_modules=["q_proj"], lisa_n_layers=1,
        lisa_adapter={"sparsity": 0.4})
    (tmp_path / "axolotl.yaml").write_text(yaml.safe_dump(config))
    cfg = load_cfg(str(tmp_path / "axolotl.yaml"))  # axolotl's schema with the plugin's keys merged in
    assert (cfg.adapter, cfg.lisa_n_layers, cfg.lisa_adapter) == ("lisa", 1, {"sparsity": 0.4})
    model, peft_config = load_adapter(build_tiny_llama(num_layers=NUM_BLOCKS), cfg, cfg.adapter)
    assert type(peft_config).__name__ == "LisaConfig" and peft_config.sparsity == 0.4
    trainer = Trainer(model=model, args=build_training_args(tmp_path / "t"),
                      train_dataset=TokenDataset(), callbacks=axolotl_env.add_callbacks_pre_trainer(cfg, model))
    trainer.args.lisa_n_layers, trainer.args.lisa_step_interval = 1, 20
    trainer.args.lisa_layers_attribute = "base_model.model.model.layers"
    trainer.add_callback(lisa_callback_factory(trainer))
    axolotl_env.post_trainer_create(cfg, trainer)
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks if "LISA" in type(c).__name__.upper()] == [
        "LisaAdapterCallback"]


# ----------------------------------------------------------------------------------------------------------------------
# LLaMA-Factory: hf_lisa.integrations.llamafactory
# ----------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _LlamaFactoryKeys:
    """The LLaMA-Factory 0.9.5 keys these tests use besides transformers' TrainingArguments (its ModelArguments,
    FinetuningArguments): a stand-in parser as strict as its ``_parse_train_args`` (unknown keys refused)."""

    model_name_or_path: str
    stage: str = "sft"
    finetuning_type: str = "lora"


def llamafactory_run_exp(trained: list):
    """``run_exp(args, callbacks)`` as LLaMA-Factory 0.9.5 calls it: args parsed strictly (``HfArgumentParser.
    parse_dict``, no extra keys), the callbacks given to the Trainer's constructor; here a plain Trainer on tokens."""

    def run_exp(args, callbacks=None):
        keys, training_args = HfArgumentParser((_LlamaFactoryKeys, TrainingArguments)).parse_dict(
            args, allow_extra_keys=False)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(keys.model_name_or_path)
        before = snapshot(model)
        trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(), callbacks=callbacks)
        trainer.train()
        trained.append((trainer, changed_parameters(before, model), list(before)))

    return run_exp


def test_llamafactory_recipe_hands_lisa_to_run_exp_and_trains_only_sampled_blocks(tmp_path):
    model_dir = tmp_path / "model"
    build_tiny_llama(num_layers=NUM_BLOCKS).save_pretrained(model_dir)
    config = {"model_name_or_path": str(model_dir), "stage": "sft", "do_train": True, "finetuning_type": "full",
              "output_dir": str(tmp_path / "out"), "max_steps": 6, "learning_rate": 1e-2, "per_device_train_batch_size": 2,
              "report_to": "none", "use_cpu": True, "save_strategy": "no", "seed": 1,
              "lisa_activated_layers": 1, "lisa_interval_steps": 2, "lisa_sampling": "uniform"}
    trained = []
    lf.run(config, run_exp=llamafactory_run_exp(trained))
    ((trainer, changed, names),) = trained
    callback = lisa_callback_of(trainer)
    assert (callback.lisa_activated_layers, callback.lisa_interval_steps, callback.seed) == (1, 2, 1)
    assert_full_lisa_trained_only_sampled_blocks(changed, callback, names)


@pytest.mark.parametrize("config, message", [
    ({}, r"finetuning_type: 'lora' \(LLaMA-Factory's default is lora\).*set finetuning_type: full"),
    ({"finetuning_type": "freeze"}, r"finetuning_type: 'freeze'"),
    ({"finetuning_type": "full", "stage": "dpo"}, r"stage: 'dpo' is not checked with LISA here; allowed: pt, sft"),
    ({"finetuning_type": "full", "use_badam": True}, r"use_badam: true chooses which parameters train"),
    ({"finetuning_type": "full", "use_mca": True}, r"use_mca: true runs a trainer that is not transformers' Trainer"),
    ({"finetuning_type": "full", "lisa_activated_layers": 0}, r"LLaMA-Factory config lisa_activated_layers \(γ\)=0 "
                                                              r"is invalid"),
    ({"finetuning_type": "full", "lisa_sampling": "random"}, r"lisa_sampling='random' is invalid; allowed: one of"),
])
def test_llamafactory_recipe_refuses_what_cannot_take_effect(config, message):
    with pytest.raises(UsageError, match=message):
        lf.split_config(config)


def test_llamafactory_example_and_overrides(tmp_path):
    config = lf.load_config(EXAMPLES / "llamafactory_lisa.yaml", ["lisa_activated_layers=4", "--seed=7"])
    args, callback = lf.split_config(config)
    assert not any(key.startswith("lisa_") for key in args)  # LLaMA-Factory would refuse them
    assert (args["finetuning_type"], args["seed"]) == ("full", 7)
    assert (callback.lisa_activated_layers, callback.lisa_interval_steps, callback.seed) == (4, 20, 7)
    with pytest.raises(UsageError, match=r"override 'lisa_activated_layers' is invalid; allowed: key=value"):
        lf.load_config(EXAMPLES / "llamafactory_lisa.yaml", ["lisa_activated_layers"])


def test_llamafactory_entry_point_help_and_missing_tool(capsys, tmp_path):
    assert lf.main(["--help"]) == 0
    assert "CONFIG.yaml [key=value ...]" in capsys.readouterr().out
    if importlib.util.find_spec("llamafactory") is None:
        with pytest.raises(UsageError, match=r"LLaMA-Factory is not importable .*pip install llamafactory"):
            lf.run({"finetuning_type": "full", "output_dir": str(tmp_path)})
