"""``hf_lisa.trainer.methods.setup_method``: the library call that builds a training method as ``hf-lisa train`` does
(issue 34 item 4: the benchmarks build their methods through it instead of the CLI's ``apply_method``).

Each method, with the command's defaults and with settings typed, gives the same model (the same adapter config, the
same trainable parameters with the same values) and the same callbacks with the same settings as the command's own
path (``parse_args`` then ``apply_method``); a setting a method does not use is refused, naming what it uses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_llama

from hf_lisa.methods import METHODS
from hf_lisa.train import parse_args
from hf_lisa.train.methods import apply_method
from hf_lisa.trainer.methods import method_settings, setup_method

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import setup_benchmarked_method  # noqa: E402


def _built(model, callbacks):
    config = getattr(model, "peft_config", {}).get("default")
    config = None if config is None else {k: v for k, v in config.to_dict().items() if k != "revision"}
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    settings = [(type(c).__name__, c.resolved_settings() if type(c).__name__ == "LisaCallback" else None)
                for c in callbacks]
    return type(model).__name__, config, trainable, settings


def _assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3]
    assert a[2].keys() == b[2].keys() and a[2]
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


def _command(tmp_path, method, *options):
    _, _, lisa_args, _ = parse_args(["--method", method, "--output_dir", str(tmp_path / "out"), *options])
    torch.manual_seed(0)
    return _built(*apply_method(tiny_llama(), lisa_args, seed=0))


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_at_the_commands_defaults_is_what_the_command_builds(tmp_path, method):
    torch.manual_seed(0)
    library = _built(*setup_method(tiny_llama(), method, seed=0))
    _assert_same(library, _command(tmp_path, method))
    if METHODS[method].alpha_per_rank:  # LoRA / DoRA: every linear layer, alpha = 2r
        linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # PEFT's "all-linear"
        assert set(library[1]["target_modules"]) == linear and library[1]["lora_alpha"] == 2 * library[1]["r"]


@pytest.mark.parametrize("method, options, settings", [
    ("lora", ["--r", "4", "--lisa_alpha", "4", "--target_modules", "q_proj", "v_proj"],
     {"r": 4, "lisa_alpha": 4, "target_modules": ["q_proj", "v_proj"]}),
    ("lisa", ["--lisa_activated_layers", "1", "--lisa_interval_steps", "3", "--lisa_always_trainable", "none"],
     {"lisa_activated_layers": 1, "lisa_interval_steps": 3, "lisa_always_trainable": ["none"]}),
    ("lisa-adapter", ["--sparsity", "0.5", "--lisa_activated_layers", "2", "--r", "4"],
     {"sparsity": 0.5, "lisa_activated_layers": 2, "r": 4, "importance_steps": 8}),
])
def test_typed_settings_decide_as_on_the_command_line(tmp_path, method, options, settings):
    """A typed alpha equal to LisaConfig's default is kept (not replaced by 2r); 'none' always-trainable is honoured;
    a preset's setting that another method does not use (importance_steps) is given to the methods that use it."""
    torch.manual_seed(0)
    benchmark = _built(*setup_benchmarked_method(tiny_llama(), method, 0, settings))
    _assert_same(benchmark, _command(tmp_path, method, *options))


def test_a_setting_the_method_does_not_use_is_refused_naming_what_it_uses():
    with pytest.raises(TypeError, match=r"sparsity is not used by method 'lora'; it uses: .*lisa_alpha.*target_mod"):
        setup_method(tiny_llama(), "lora", seed=0, sparsity=0.5)
    with pytest.raises(TypeError, match=r"r is not used by method 'full'; it uses: none"):
        setup_method(tiny_llama(), "full", seed=0, r=4)
    with pytest.raises(TypeError, match="lisa_always_trainable is used by full-parameter LISA only"):
        setup_method(tiny_llama(), "lisa-adapter", seed=0, lisa_always_trainable=())
    with pytest.raises(TypeError, match="neither LisaConfig settings"):
        setup_benchmarked_method(tiny_llama(), "lora", 0, {"lisa_n_layers": 2})


def test_method_settings_match_the_commands_option_table():
    """What setup_method accepts per method is what ``hf-lisa train`` lets that method be given (its option table),
    less the options the command spends elsewhere: the block list's attribute (the monitor and learning-rate decay of
    every method) and the run-level keywords."""
    from hf_lisa.train.parsing.options import LISA_CONFIG_OPTIONS, uses

    for method, spec in METHODS.items():
        command = {o for o in LISA_CONFIG_OPTIONS if uses(method, o)}
        if not spec.samples_layers:
            command.discard("lisa_layers_attribute")
        assert command <= method_settings(method), method
        assert method_settings(method) - command <= {"lisa_layers_attribute"} | (
            method_settings(method) - set(LISA_CONFIG_OPTIONS)), method
