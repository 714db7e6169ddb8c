"""``hf-lisa train`` / ``python -m hf_lisa.train`` end to end on a tiny model, for every method; argument parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

import hf_lisa  # noqa: F401  (registers LISA with PEFT for the reloads)
from hf_lisa import cli
from hf_lisa.train import METHOD_NAMES as METHODS, main, parse_args
from hf_lisa.train.parsing.arguments import lisa_config_kwargs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    model_dir = build_tiny_lm_dir(root / "model", num_layers=3)
    train = write_jsonl(root / "train.jsonl", copy_task_rows(48, seed=0))
    validation = write_jsonl(root / "validation.jsonl", copy_task_rows(8, seed=1))
    return {"root": root, "model": model_dir, "train": train, "validation": validation}


#: the method options these runs set, by method (an option a method does not use is refused)
METHOD_OPTIONS = {
    "lisa": ["--lisa_activated_layers", "1", "--lisa_interval_steps", "2"],
    "lisa-adapter": ["--r", "4", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2"],
    "lora": ["--r", "4"],
    "dora": ["--r", "4"],
    "full": [],
}


def _common(tiny, output_dir, method, *extra) -> list[str]:
    return [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--validation_file", tiny["validation"],
        "--output_dir", str(output_dir), "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8", "--learning_rate", "5e-3", "--logging_steps", "2",
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--eval_generation_samples", "4", "--generation_max_new_tokens", "4", "--max_seq_length", "64",
        "--method", method, *METHOD_OPTIONS[method], *extra,
    ]


def _weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.slow  # full CLI training runs, save and reload, one per method
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_saves_and_reloads(tiny, tmp_path, method):
    out = tmp_path / method
    extra = []
    if method == "lisa-adapter":
        extra += ["--sparsity", "0.5", "--mask_init", "random", "--mask_update_interval", "0"]
    summary = main(_common(tiny, out, method, *extra))

    files = set(os.listdir(out))
    assert {"training_summary.json", "loss.png", "README.md", "training_args.json", "tokenizer.json"} <= files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))], files
    on_disk = json.loads((out / "training_summary.json").read_text())
    assert on_disk["method"] == method and on_disk["base_model"] == tiny["model"]
    for key in ("lisa", "hyperparameters", "metrics", "datasets", "dataset_name", "loss_plot", "license"):
        assert key in on_disk, key
    assert on_disk["loss_plot"] == "loss.png"
    assert on_disk["hyperparameters"]["max_steps"] == 4
    metrics = on_disk["metrics"]
    for name in ("eval_loss", "eval_perplexity", "eval_token_accuracy", "eval_exact_match", "train_loss"):
        assert name in metrics and name + "_before" in metrics or name == "train_loss", name
    assert metrics["eval_loss"] < metrics["eval_loss_before"]  # 4 steps at a high rate do learn something
    assert summary["trainable"]["trainable_params"] > 0

    base = _weights(os.path.join(tiny["model"], "model.safetensors"))
    if method in ("lisa-adapter", "lora", "dora"):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
        adapter = _weights(str(out / "adapter_model.safetensors"))
        factor = "lisa_B" if method == "lisa-adapter" else "lora_B"
        assert any(factor in k and v.abs().sum() > 0 for k, v in adapter.items())  # B started at 0 and trained
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["model"]), out)
        loaded_b = {k: v for k, v in reloaded.state_dict().items() if factor in k}
        assert loaded_b and any(v.abs().sum() > 0 for v in loaded_b.values())
    else:
        from transformers import AutoModelForCausalLM

        assert {"model.safetensors", "config.json", "generation_config.json"} <= files
        trained = _weights(str(out / "model.safetensors"))
        changed = [k for k in base if not torch.equal(base[k], trained[k])]
        if method == "lisa":
            # E+H+γL: the embeddings, head and some block moved; with γ=1, K=2 and 4 steps at most 2 of 3 blocks
            assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
            moved_blocks = {k.split(".")[2] for k in changed if k.startswith("model.layers.")}
            assert 1 <= len(moved_blocks) <= 2
        else:
            assert len(changed) == len(base)
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        assert torch.equal(reloaded.model.embed_tokens.weight, trained["model.embed_tokens.weight"])


def test_yaml_config_with_a_command_line_override(tiny, tmp_path):
    config = {
        "method": "lisa-adapter",
        "learning_rate": 1e-3,
        "max_steps": 7,
        "target_modules": ["q_proj", "v_proj"],
        "sparsity_pattern": {"v_proj": 0.0},
        "gradient_checkpointing": True,
        "report_to": [],
        "output_dir": str(tmp_path / "from_yaml"),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    model_args, data_args, lisa_args, training_args = parse_args([str(path), "--learning_rate", "5e-4"])
    assert training_args.learning_rate == 5e-4  # the command line wins
    assert training_args.max_steps == 7 and training_args.gradient_checkpointing is True
    assert lisa_args.method == "lisa-adapter" and lisa_args.target_modules == ["q_proj", "v_proj"]
    assert lisa_config_kwargs(lisa_args)["sparsity_pattern"] == {"v_proj": 0.0}  # a mapping in YAML, JSON on the CLI
    *_, cli_args, _ = parse_args([str(path), "--sparsity_pattern", '{"v_proj": 0.0}'])
    assert lisa_config_kwargs(cli_args)["sparsity_pattern"] == {"v_proj": 0.0}
    assert training_args.report_to == [] or training_args.report_to == ["none"] or training_args.report_to == "none"
    assert training_args.output_dir == str(tmp_path / "from_yaml")
    # values not given anywhere keep their documented defaults
    assert lisa_args.lisa_interval_steps == 20 and training_args.max_grad_norm == 1.0


def test_a_file_value_is_typed_as_on_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: lisa\nlisa_always_trainable: none\nmax_steps: null\noutput_dir: out\n")
    *_, lisa_args, training_args = parse_args([str(path), "--report_to", "none"])
    assert lisa_args.lisa_always_trainable == ["none"]  # one value for a list option, as `--lisa_always_trainable none`
    assert training_args.max_steps == -1  # null keeps the default
    path.write_text("method: lora\ntarget_modules: q_proj\nrank_pattern: {q_proj: 4}\noutput_dir: out\n")
    *_, lisa_args, _ = parse_args([str(path), "--report_to", "none"])
    assert lisa_config_kwargs(lisa_args)["target_modules"] == ["q_proj"]
    assert lisa_config_kwargs(lisa_args)["rank_pattern"] == {"q_proj": 4}


def test_shipped_example_configs_parse(tmp_path):
    configs = sorted((REPO / "examples" / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        *_, training_args = parse_args([str(path), "--output_dir", str(tmp_path / path.stem)])
        assert training_args.output_dir == str(tmp_path / path.stem)


# -- bad arguments: clear errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "qlora"], r"--method='qlora' is invalid; allowed: lisa, lisa-adapter, lora, dora, full"),
        (["--learnig_rate", "1e-4"],
         r"unrecognised argument\(s\): '--learnig_rate' \(did you mean '--learning_rate'\?\)"),
        (["--push_to_hub", "true"], r"--push_to_hub needs --hub_model_id"),
        (["--layerwise_lr_decay", "1.5"], r"--layerwise_lr_decay=1.5 is invalid; allowed: a float in \(0, 1\]"),
        (["--method", "lisa", "--lisa_activated_layers", "0"],
         r"--method lisa --lisa_activated_layers \(γ\)=0 is invalid; allowed: an integer >= 1"),
        (["--method", "lora", "--rank_pattern", "{up_proj: 4"], r"--rank_pattern=.* is not valid JSON"),
        (["--method", "lisa", "--layer_interpolation", "true"],
         r"--method lisa does not use --layer_interpolation=True \(used by lisa-adapter\)"),
        (["--answer_pattern", "(unclosed"], r"--answer_pattern='\(unclosed' is not a valid regex"),
    ],
)
def test_bad_arguments_give_clear_errors(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(["--output_dir", str(tmp_path), *argv])


def test_unknown_yaml_key_is_named_with_a_suggestion(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("output_dir: out\nlisa_activated_layer: 2\n")
    expected = r"unknown option\(s\) 'lisa_activated_layer' \(did you mean 'lisa_activated_layers'\?\)"
    with pytest.raises(ValueError, match=expected):
        parse_args([str(path)])


def test_more_active_layers_than_blocks_is_refused_before_training(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"larger than the number of transformer blocks \(3\)"):
        main(_common(tiny, tmp_path / "o", "lisa", "--lisa_activated_layers", "5"))


def test_missing_train_file_exits_with_a_message(tiny, tmp_path, capsys):
    code = cli.main(["train", "--output_dir", str(tmp_path), "--train_file", str(tmp_path / "missing.jsonl"),
                     "--model_name_or_path", tiny["model"]])
    assert code == 2
    assert "train_file=" in capsys.readouterr().err


# -- the hf-lisa command -----------------------------------------------------------------------------------------------
def test_config_reference_lists_every_option_and_the_docs_are_in_sync(capsys):
    from dataclasses import fields

    from hf_lisa.train import ARGUMENT_CLASSES

    assert cli.main(["config-reference"]) == 0
    reference = capsys.readouterr().out
    for cls in ARGUMENT_CLASSES:
        for f in fields(cls):
            assert f"`--{f.name}`" in reference, f.name
    for name in cli.DOC_FILES:
        docs = (REPO / name).read_text()
        begin, end = cli.DOCS_BEGIN, cli.DOCS_END
        assert docs.split(begin, 1)[1].split(end, 1)[0].strip() == reference.strip(), (
            f"{name} is out of date: regenerate it with `hf-lisa config-reference --update-docs`"
        )


def test_docs_list_every_lisa_config_field():
    from dataclasses import fields

    from hf_lisa import LisaConfig

    sections = [name for name in cli.DOC_FILES if cli.LISA_CONFIG_BEGIN in (REPO / name).read_text()]
    assert sections, f"none of {cli.DOC_FILES} has the LisaConfig reference ({cli.LISA_CONFIG_BEGIN})"
    for name in sections:
        docs = (REPO / name).read_text()
        section = docs.split(cli.LISA_CONFIG_BEGIN, 1)[1].split(cli.LISA_CONFIG_END, 1)[0]
        assert section.strip() == cli.lisa_config_reference().strip(), (
            f"{name} is out of date: regenerate it with `hf-lisa config-reference --update-docs`"
        )
        for field_name in ("r", "lisa_alpha", "sparsity", "sparsity_structure", "block_size", "n_m", "mask_init",
                           "layer_interpolation", "lisa_activated_layers", "rank_pattern", "sparsity_pattern"):
            assert f"`{field_name}`" in section
    assert {f.name for f in fields(LisaConfig)} >= {"sparsity", "new_block_bonus"}


@pytest.mark.slow  # a full hf-lisa train run, then the push
def test_push_to_hub_goes_through_hf_lisa_hub_and_uploads_no_pickle(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants
    from hub_server import HubServer

    server = HubServer()
    server.add_token("hf_write_token", user="alice", write=True)
    try:
        monkeypatch.setattr(hf_constants, "ENDPOINT", server.url)
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        summary = main(_common(tiny, tmp_path / "lora", "lora", "--push_to_hub", "true",
                               "--hub_model_id", "alice/tiny-lora", "--hub_token", "hf_write_token",
                               "--base_model_id", "alice/tiny-base",
                               "--push_mode", "adapter", "--eval_generation_samples", "0"))
        files = server.files("alice/tiny-lora")
    finally:
        server.stop()
    assert "pushed_to" in summary
    # the card is rendered once, for the target repo: the output directory holds the very card that was uploaded
    assert files["README.md"] == (tmp_path / "lora" / "README.md").read_bytes()
    assert b'AutoPeftModelForCausalLM.from_pretrained("alice/tiny-lora")' in files["README.md"]  # plain PEFT: LoRA
    assert b"import hf_lisa" not in files["README.md"]
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "loss.png"} <= set(files)
    assert not [f for f in files if f.endswith(".bin")]
    assert len(server.commits("alice/tiny-lora")) >= 1


@pytest.mark.slow  # accelerate launch: a launcher process and a training process
def test_accelerate_launch_runs_the_module_with_a_yaml_config(tiny, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "method": "lora", "model_name_or_path": tiny["model"], "train_file": tiny["train"],
        "validation_file": tiny["validation"], "max_steps": 2, "per_device_train_batch_size": 4, "r": 4,
        "save_strategy": "no", "report_to": "none", "max_seq_length": 64, "output_dir": str(tmp_path / "ignored"),
    }))
    out = tmp_path / "launched"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_lisa.train", str(config),
         "--output_dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[hf-lisa] method=lora" in result.stdout
    assert (out / "adapter_model.safetensors").exists() and not (tmp_path / "ignored").exists()


def test_demo_defaults_yield_to_user_flags(tmp_path):
    from hf_lisa.demo import DEMO_DEFAULTS

    argv = ["--max_steps", "5", "--method=lisa-adapter", "--report_to", "none"]
    *_, lisa_args, training_args = parse_args(argv, defaults=DEMO_DEFAULTS)
    assert training_args.max_steps == 5 and lisa_args.method == "lisa-adapter"
    assert training_args.learning_rate == float(DEMO_DEFAULTS["learning_rate"])
    assert training_args.output_dir == "outputs"
    # a config file sits above the demo's defaults and below the command line
    config = tmp_path / "demo.yaml"
    config.write_text("max_steps: 9\nlearning_rate: 1.0e-3\nmethod: lora\n")
    *_, lisa_args, training_args = parse_args([str(config), "--max_steps", "3"], defaults=DEMO_DEFAULTS)
    assert (training_args.max_steps, training_args.learning_rate, lisa_args.method) == (3, 1e-3, "lora")
    assert training_args.warmup_steps == DEMO_DEFAULTS["warmup_steps"]


def test_push_subcommand_dispatches_to_the_hub_cli(capsys):
    assert cli.main(["push", "--help"]) == 0
    assert "hf-lisa push" in capsys.readouterr().out
    assert cli.main(["bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_help_of_the_command_and_of_train(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in cli.COMMANDS)
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: hf-lisa train [CONFIG.yaml" in out and "--lisa_activated_layers" in out and "--learning_rate" in out
    assert cli.main(["config-reference", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_the_loss_plot_marks_the_steps_where_blocks_switched(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from hf_lisa.train.outputs import plot_losses

    drawn = []
    original = Axes.axvline
    monkeypatch.setattr(Axes, "axvline", lambda self, x=0, **kw: drawn.append((x, kw.get("label"))) or original(
        self, x, **kw))
    history = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 9)] + [{"step": 4, "eval_loss": 4.7}]
    path = plot_losses(history, str(tmp_path / "loss.png"), before_eval_loss=5.0, switch_steps=[6, 3, 3])
    assert path and (tmp_path / "loss.png").stat().st_size > 0
    assert drawn == [(3, "blocks switched"), (6, None)]  # once each, in order, one legend entry


@pytest.mark.slow
def test_a_lisa_adapter_at_its_defaults_says_it_is_lora_and_resumes_without_a_schedule(tiny, tmp_path, capsys):
    """Issue 36 item 5: ``--method lisa-adapter`` at γ=0, ρ=0 trains exactly LoRA's update. The start line names
    that, no internal "nothing to schedule" warning reaches the user (no callback runs), and its checkpoints resume
    as a lisa-adapter run."""
    import warnings

    out = tmp_path / "run"
    argv = [
        "--model_name_or_path", tiny["model"], "--train_file", tiny["train"], "--output_dir", str(out),
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--learning_rate", "5e-3", "--save_steps", "2",
        "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true", "--eval_generation_samples", "0",
        "--max_seq_length", "64", "--validation_split_percentage", "0", "--method", "lisa-adapter", "--r", "4",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["train", *argv]) == 0
    printed = capsys.readouterr()
    assert ("method=lisa-adapter (LISA adapters: dense low-rank updates on every block (sparsity 0, no sampling: the "
            "same update as LoRA))") in printed.out
    assert "nothing to schedule" not in printed.err + " ".join(str(w.message) for w in caught)
    assert cli.main(["train", *argv[:-6], "--max_steps", "6", "--method", "lisa-adapter", "--r", "4",
                     "--resume_from_checkpoint", str(out / "checkpoint-4")]) == 0


@pytest.mark.slow
def test_a_sparse_lisa_adapter_says_its_costs_before_the_first_step(tiny, tmp_path, capsys):
    """Issue 36 item 5: the mask calibration's extra passes and the lossy LoRA export are said up front."""
    assert cli.main(["train", *_common(tiny, tmp_path / "run", "lisa-adapter", "--sparsity", "0.5",
                                       "--importance_steps", "2", "--eval_strategy", "no")]) == 0
    out = capsys.readouterr().out
    assert "sparse low-rank updates (sparsity 0.5), 1 block(s) trained at a time, re-sampled every 2 steps" in out
    assert "calibrated from |dL/dW| over 2 extra forward/backward passes" in out
    assert out.index("calibrated from") < out.index("trained 4 steps")
    assert "export lora` of a sparse adapter is a truncated SVD" in out


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_lora_defaults_to_every_linear_layer_with_alpha_twice_the_rank(method):
    """Issue 37: `--method lora`/`dora` train what practitioners run (LLaMA-Factory's lora_target all, axolotl's
    lora_target_linear): every linear layer of the blocks, α = 2r; what is typed decides."""
    _, _, lisa_args, _ = parse_args(["--method", method])
    settings = lisa_config_kwargs(lisa_args)
    assert settings["target_modules"] == "all-linear" and settings["lisa_alpha"] == 16 and settings["r"] == 8
    _, _, lisa_args, _ = parse_args(["--method", method, "--r", "4"])
    assert lisa_config_kwargs(lisa_args)["lisa_alpha"] == 8
    _, _, lisa_args, _ = parse_args(["--method", method, "--r", "4", "--lisa_alpha", "8", "--target_modules", "q_proj"])
    typed = lisa_config_kwargs(lisa_args)
    assert typed["lisa_alpha"] == 8 and typed["target_modules"] == ["q_proj"]
    _, _, lisa_args, _ = parse_args(["--method", method, "--lisa_alpha", "8"])  # typed at LisaConfig's default
    assert lisa_config_kwargs(lisa_args)["lisa_alpha"] == 8
    # the LISA adapter keeps LisaConfig's own defaults (PEFT's per-architecture targets, alpha = r)
    _, _, lisa_args, _ = parse_args(["--method", "lisa-adapter"])
    assert lisa_config_kwargs(lisa_args)["target_modules"] is None and lisa_config_kwargs(lisa_args)["lisa_alpha"] == 8


@pytest.mark.slow
def test_lora_trains_every_linear_layer_and_says_so_at_the_start(tiny, tmp_path, capsys):
    out = tmp_path / "lora"
    argv = _common(tiny, out, "lora", "--eval_strategy", "no", "--eval_generation_samples", "0")
    assert cli.main(["train", *argv]) == 0
    assert ("method=lora (PEFT LoRA r=4, alpha=8 on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"
            in capsys.readouterr().out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                 "v_proj"]
    assert config["lora_alpha"] == 8 and config["r"] == 4


@pytest.mark.parametrize("method", ["lisa", "lora", "full"])
def test_dpo_defaults_to_trls_dpo_learning_rate_and_a_typed_rate_decides(method):
    """Issue 37: `--stage dpo` trained at the SFT rates (1e-4 / 5e-4), 100-500x TRL's DPO default of 1e-6."""
    from hf_lisa.train.parsing.arguments import DPO_LEARNING_RATE

    _, _, _, training_args = parse_args(["--method", method, "--stage", "dpo", "--output_dir", "o"])
    assert training_args.learning_rate == DPO_LEARNING_RATE == 1e-6
    _, _, _, training_args = parse_args(["--method", method, "--stage", "dpo", "--learning_rate", "5e-6",
                                         "--output_dir", "o"])
    assert training_args.learning_rate == 5e-6
