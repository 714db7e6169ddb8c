"""Every ``--method`` against every option of ``hf-lisa train``: refused with a message naming both, or accepted.

Only ``parse_args`` runs (no model is loaded). The table under test is ``hf_lisa.train.parsing.options.OPTION_METHODS``; the
value rules are ``hf_lisa.tuner.config.check_lisa_settings``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from hf_lisa import LisaConfig
from hf_lisa.train import METHOD_NAMES as METHODS, LisaArguments, parse_args
from hf_lisa.train.parsing.arguments import _COMMAND_LINE_FORMS, lisa_config_kwargs
from hf_lisa.train.parsing.options import _NOT_OPTIONS, LISA_CONFIG_OPTIONS
from hf_lisa.train.parsing.options import OPTION_METHODS
from hf_lisa.trainer.training_args import TRAINER_OPTIONS
from hf_lisa.tuner.config import LAYER_SCHEDULE_DEFAULTS, lisa_config_fields

#: a valid value, other than the default, of every option (as command-line tokens)
NON_DEFAULT: dict[str, list[str]] = {
    "lisa_always_trainable": ["embeddings", "lm_head"],
    "lisa_optimizer_state_policy": ["keep"],
    "layerwise_lr_decay": ["0.9"],
    "monitor_plateau_grad_norm": ["1e-4"],
    "monitor_plateau_steps": ["10"],
    "monitor_block_groups": ["2"],
    "ddp_comm_hook": ["powersgd"],
    "powersgd_rank": ["2"],
    "powersgd_start_iter": ["20"],
    "push_mode": ["merged"],
    "r": ["4"],
    "lisa_alpha": ["32"],
    "lisa_dropout": ["0.1"],
    "target_modules": ["q_proj", "v_proj"],
    "exclude_modules": ["o_proj"],
    "layers_to_transform": ["0", "1"],
    "layers_pattern": ["layers"],
    "modules_to_save": ["lm_head"],
    "sparsity": ["0.4"],
    "sparsity_structure": ["unstructured"],
    "block_size": ["4x4"],
    "n_m": ["1:4"],
    "mask_init": ["magnitude"],
    "mask_seed": ["3"],
    "mask_update_interval": ["100"],
    "importance_steps": ["4"],
    "mask_keep_learned": ["0.5"],
    "new_block_bonus": ["1.0"],
    "layer_interpolation": ["true"],
    "interpolation_delta_bound": ["3.0"],
    "interpolation_beta_l2": ["0.1"],
    "lisa_activated_layers": ["3"],
    "lisa_interval_steps": ["10"],
    "lisa_sampling": ["cyclic"],
    "lisa_layers_attribute": ["model.layers"],
    "rank_pattern": ['{"q_proj": 4}'],
    "alpha_pattern": ['{"q_proj": 8}'],
    "sparsity_pattern": ['{"q_proj": 0.5}'],
    "fuse_sparse_delta": ["false"],
    "optim_step_in_backward": ["true", "--max_grad_norm", "0"],  # with the clipping it cannot honour turned off
    "cpu_allocator": ["lean"],
    "chunked_loss": ["false"],
    "progress_check_steps": ["0"],
    "optim_8bit_embeddings": ["true", "--optim", "adamw_bnb_8bit"],  # with the 8-bit optimizer it needs
    "stage": ["dpo"],
    "dpo_beta": ["0.5", "--stage", "dpo"],
}
OPTIONS = [f.name for f in dataclasses.fields(LisaArguments) if f.name != "method"] + list(TRAINER_OPTIONS)


def _parse(tmp_path, *argv):
    return parse_args(["--output_dir", str(tmp_path), "--report_to", "none", *argv])


def test_the_table_and_this_test_cover_every_option():
    assert sorted(OPTION_METHODS) == sorted(OPTIONS)
    assert sorted(NON_DEFAULT) == sorted(OPTIONS)
    assert all(set(methods) <= set(METHODS) and methods for methods in OPTION_METHODS.values())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("option", OPTIONS)
def test_method_option_matrix(tmp_path, method, option):
    argv = ["--method", method, f"--{option}", *NON_DEFAULT[option]]
    if method in OPTION_METHODS[option] and option in LAYER_SCHEDULE_DEFAULTS:
        argv += ["--lisa_activated_layers", "1"]  # they take effect only when blocks are sampled
    if method in OPTION_METHODS[option]:
        *_, lisa_args, training_args = _parse(tmp_path, *argv)
        holder = training_args if option in TRAINER_OPTIONS else lisa_args  # LisaTrainer's: LisaTrainingArguments
        assert lisa_args.method == method and getattr(holder, option) != _default(option)
    else:
        with pytest.raises(ValueError) as info:
            _parse(tmp_path, *argv)
        message = str(info.value)
        assert message.startswith(f"--method {method} does not use --{option}="), message
        assert f"(used by {', '.join(OPTION_METHODS[option])})" in message


@pytest.mark.parametrize(
    "argv, refused",
    [
        (["--method", "lora", "--sparsity", "0.4"], "--sparsity=0.4"),
        (["--method", "lora", "--layer_interpolation"], "--layer_interpolation=True"),
        (["--method", "lora", "--lisa_activated_layers", "3"], "--lisa_activated_layers=3"),
        (["--method", "full", "--lisa_sampling", "importance"], "--lisa_sampling='importance'"),
        (["--method", "lisa", "--sparsity", "0.5"], "--sparsity=0.5"),
        (["--method", "lisa", "--layer_interpolation", "true"], "--layer_interpolation=True"),
        (["--method", "dora", "--lisa_always_trainable", "none"], "--lisa_always_trainable=['none']"),
    ],
)
def test_the_cases_of_the_issue_are_refused_naming_option_method_and_what_applies(tmp_path, argv, refused):
    method = argv[1]
    with pytest.raises(ValueError, match=f"^--method {method} does not use {re.escape(refused)}") as info:
        _parse(tmp_path, *argv)
    own = [f"--{name}" for name, methods in OPTION_METHODS.items() if method in methods and methods != METHODS]
    assert all(name in str(info.value) for name in own)


def test_every_refused_option_is_named_at_once(tmp_path):
    with pytest.raises(ValueError) as info:
        _parse(tmp_path, "--method", "lora", "--sparsity", "0.4", "--lisa_sampling", "cyclic", "--r", "4")
    message = str(info.value)
    assert "--sparsity=0.4" in message and "--lisa_sampling='cyclic'" in message
    assert "--r=" not in message  # used by lora


def test_an_option_typed_at_its_default_is_given(tmp_path):
    # issue 33 item 4: what was typed decides, not the value (--method lora --lisa_activated_layers 2 was accepted)
    for method in METHODS:
        argv = ("--method", method, "--lisa_activated_layers", "2", "--lisa_interval_steps", "20")
        if method in OPTION_METHODS["lisa_activated_layers"]:
            _parse(tmp_path, *argv)
        else:
            with pytest.raises(ValueError, match=rf"^--method {method} does not use --lisa_activated_layers=2 "):
                _parse(tmp_path, *argv)
    # the demo's defaults (not typed) state γ = 2 and K = 20: harmless for every method
    from hf_lisa.demo import DEMO_DEFAULTS

    for method in METHODS:
        parse_args(["--method", method, "--output_dir", str(tmp_path), "--report_to", "none"], defaults=DEMO_DEFAULTS)


def test_a_config_file_and_the_command_line_are_refused_alike(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"method": "lora", "sparsity": 0.4, "output_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"^--method lora does not use --sparsity=0.4 \(used by lisa-adapter\)"):
        parse_args([str(path), "--report_to", "none"])
    # the command line overrides the file's method, and the file's option is then used
    *_, lisa_args, _ = parse_args([str(path), "--method", "lisa-adapter", "--report_to", "none"])
    assert lisa_args.sparsity == 0.4
    # and a file's method refuses a command-line option
    path.write_text(yaml.safe_dump({"method": "full", "output_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"^--method full does not use --r=4"):
        parse_args([str(path), "--r", "4", "--report_to", "none"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "lisa", "--lisa_activated_layers", "0"],
         r"--method lisa --lisa_activated_layers \(γ\)=0 is invalid; allowed: an integer >= 1"),
        (["--method", "lisa-adapter", "--lisa_activated_layers", "-1"],
         r"--method lisa-adapter --lisa_activated_layers \(γ\)=-1 is invalid; allowed: an integer >= 0"),
        (["--method", "lisa", "--lisa_interval_steps", "0"],
         r"--method lisa --lisa_interval_steps \(K\)=0 is invalid; allowed: an integer >= 1"),
        (["--method", "lisa", "--lisa_sampling", "greedy"], r"--method lisa --lisa_sampling='greedy' is invalid"),
        (["--method", "lisa-adapter", "--sparsity", "1.0"], r"--method lisa-adapter --sparsity=1.0 is invalid"),
        (["--method", "lisa-adapter", "--block_size", "0x2"], r"--method lisa-adapter --block_size='0x2' is invalid"),
        (["--method", "lisa-adapter", "--mask_update_interval", "4", "--importance_steps", "8"],
         r"--mask_update_interval=4 is shorter than the importance window importance_steps=8"),
        (["--method", "lora", "--r", "0"], r"--method lora --r=0 is invalid; allowed: a positive integer"),
        (["--method", "dora", "--rank_pattern", '{"q_proj": 0}'], r"--method dora --rank_pattern\['q_proj'\]=0"),
    ],
)
def test_values_follow_lisa_config_rules_for_every_method(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(tmp_path, *argv)


def test_gamma_zero_is_the_adapter_form_without_sampling(tmp_path):
    *_, lisa_args, _ = _parse(tmp_path, "--method", "lisa-adapter", "--lisa_activated_layers", "0")
    assert lisa_config_kwargs(lisa_args)["lisa_activated_layers"] == 0


def test_lisa_options_are_generated_from_lisa_config():
    fields = {f.name: f for f in dataclasses.fields(LisaArguments)}
    own = [f for f in lisa_config_fields() if f.name not in _NOT_OPTIONS]
    assert [f.name for f in own] == list(LISA_CONFIG_OPTIONS)
    command_line_defaults = {"lisa_alpha", "lisa_activated_layers"}  # hf-lisa 0.1's command-line defaults
    config_defaults = LisaConfig()
    for f in own:
        option = fields[f.name]
        assert option.metadata["help"].startswith(f.metadata["help"]), f.name
        if f.name in command_line_defaults:
            continue
        default = option.default_factory() if option.default is dataclasses.MISSING else option.default
        converted = lisa_config_kwargs(LisaArguments(**{f.name: default}))[f.name]
        assert LisaConfig(**{f.name: converted}).__dict__[f.name] == getattr(config_defaults, f.name), f.name
    assert set(_COMMAND_LINE_FORMS) <= set(LISA_CONFIG_OPTIONS)


def _default(option: str):
    if option in TRAINER_OPTIONS:
        return TRAINER_OPTIONS[option]
    f = next(f for f in dataclasses.fields(LisaArguments) if f.name == option)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@pytest.mark.parametrize("method", METHODS)
def test_learning_rate_defaults_to_the_methods_own_below_file_and_command_line(tmp_path, method):
    """Without ``--learning_rate`` each method trains at its registry rate (the Trainer's 5e-5 where it has none); a
    config file's value and the command line's win, whichever way the flag is spelled; the demo's defaults too."""
    from hf_lisa.methods import get_method

    out = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--method", method]
    own = get_method(method).learning_rate
    assert parse_args(out)[3].learning_rate == (own if own is not None else 5e-5)
    assert parse_args(out + ["--learning_rate", "3e-6"])[3].learning_rate == 3e-6
    assert parse_args(out + ["--learning-rate=4e-6"])[3].learning_rate == 4e-6
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"method": method, "learning_rate": 7e-6}))
    assert parse_args([str(config)] + out[:4])[3].learning_rate == 7e-6
    config.write_text(yaml.safe_dump({"method": method}))  # the method from the file: its own rate still applies
    assert parse_args([str(config)] + out[:4])[3].learning_rate == (own if own is not None else 5e-5)
    assert parse_args(out, defaults={"learning_rate": 2e-4})[3].learning_rate == 2e-4  # what the demo passes


def test_each_method_and_form_defaults_to_its_study_rate(tmp_path):
    """Issue 37: a rate per method and form, each the method's best in the T = 300 study (docs/training.md cites the
    rows); a LISA adapter that samples blocks (γ >= 1, however γ was given) has its own; a typed rate decides."""
    out = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--method"]
    rate = lambda *argv: parse_args(list(argv))[3].learning_rate  # noqa: E731
    assert {m: rate(*out, m) for m in ("lora", "dora", "lisa-adapter", "lisa", "full")} == {
        "lora": 1e-3, "dora": 1e-3, "lisa-adapter": 1e-3, "lisa": 3e-4, "full": 1e-4}
    assert rate(*out, "lisa-adapter", "--lisa_activated_layers", "2") == 3e-3
    assert rate(*out, "lisa-adapter", "--lisa_activated_layers=1") == 3e-3
    assert rate(*out, "lisa-adapter", "--lisa_activated_layers", "0") == 1e-3
    assert rate(*out, "lisa-adapter", "--lisa_activated_layers", "2", "--learning_rate", "5e-4") == 5e-4
    config = tmp_path / "c.yaml"
    for key in ("lisa_activated_layers", "lisa_n_layers"):  # ours and axolotl's name for γ, from a file
        config.write_text(yaml.safe_dump({"method": "lisa-adapter", key: 2}))
        assert rate(str(config), *out[:4]) == 3e-3, key
    config.write_text(yaml.safe_dump({"method": "lisa-adapter", "lisa_activated_layers": 2, "learning_rate": 2e-3}))
    assert rate(str(config), *out[:4]) == 2e-3
    assert rate(*out, "lora", "--stage", "dpo") == 1e-6  # DPO's rate whatever the method


def test_adapters_default_to_a_higher_learning_rate_than_full_parameter_methods(tmp_path):
    """The value study's finding (docs/benchmarks.md): adapters need a higher rate than the Trainer's 5e-5."""
    from hf_lisa.methods import METHODS as TABLE

    out = ["--output_dir", str(tmp_path / "out"), "--report_to", "none", "--method"]
    adapters = {parse_args(out + [m])[3].learning_rate for m, spec in TABLE.items() if spec.is_adapter}
    full = {parse_args(out + [m])[3].learning_rate for m, spec in TABLE.items() if not spec.is_adapter}
    assert min(adapters) > max(full) > 0
