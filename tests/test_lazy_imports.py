"""Lazy imports: ``hf-lisa --help``, ``--version`` and usage errors, and a bare ``import hf_lisa``, load none of torch,
transformers, PEFT, datasets or bitsandbytes; LISA is still registered with PEFT whichever is imported first.

Every check runs in a fresh interpreter and reads its ``sys.modules`` (not timings). The CLI checks are quick (no
torch); each registration check imports torch and PEFT, so related checks share one interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hf_lisa

pytestmark = pytest.mark.slow

HEAVY = ("torch", "transformers", "peft", "datasets", "bitsandbytes")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# runs `hf-lisa ARGS...` (the module the console script calls) in this interpreter, then reports its exit status and
# the heavy modules it imported
CLI_DRIVER = textwrap.dedent("""
    import json, runpy, sys
    report, sys.argv = sys.argv[1], ["hf-lisa", *sys.argv[2:]]
    status = 0
    try:
        runpy.run_module("hf_lisa.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        status = exc.code
    heavy = sorted(m for m in sys.modules if m.partition(".")[0] in {heavy!r})
    with open(report, "w") as f:
        json.dump({{"status": status, "heavy": heavy, "modules": len(sys.modules)}}, f)
""").format(heavy=HEAVY)


def _python(code: str, *args: str, cwd, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=timeout, check=False)


# (arguments, exit status, a line of stdout or stderr)
CLI_CASES = [
    (["--help"], 0, "usage: hf-lisa"),
    (["--version"], 0, f"hf-lisa {hf_lisa.__version__}"),
    (["push", "--help"], 0, "usage: hf-lisa push"),
    (["export", "--help"], 0, "usage: hf-lisa export"),
    (["export", "gguf", "--help"], 0, "{f16,q8_0}"),
    (["config-reference", "--help"], 0, "usage: hf-lisa config-reference"),
    (["chat", "--help"], 0, "usage: hf-lisa chat"),
    (["generate", "--help"], 0, "usage: hf-lisa generate"),
    (["bogus"], 2, "hf-lisa: error: argument {train,demo,push,export,chat,generate,config-reference}: invalid choice: "
     "'bogus'"),
    ([], 2, "hf-lisa: error: the following arguments are required: {train,demo,push,export,chat,generate,"
     "config-reference}"),
    (["push"], 2, "hf-lisa push: error: the following arguments are required: output_dir, repo_id"),
    (["push", "out", "me/repo", "--mode", "full"], 2, "hf-lisa push: error: argument --mode: invalid choice: 'full'"),
    (["push", "out", "me/repo", "--nope"], 2, "hf-lisa: error: unrecognized arguments: --nope"),
    (["export", "lora", "adapter"], 2, "hf-lisa export lora: error: the following arguments are required: out_dir"),
    (["export", "gguf", "src", "out.gguf", "--type", "q4"], 2, "argument --type: invalid choice: 'q4'"),
    (["generate", "me/model", "--output", "o.jsonl"], 2, "the following arguments are required: --prompts"),
    (["chat", "me/model", "--device", "tpu"], 2, "argument --device: invalid choice: 'tpu'"),
    # the prompts file and the model's folder are checked before torch loads
    (["generate", "me/model", "--prompts", "missing.jsonl", "--output", "o.jsonl"], 2,
     "hf-lisa generate: error: --prompts='missing.jsonl' does not exist."),
    (["chat", "./no-such-folder"], 2, "hf-lisa chat: error: MODEL='./no-such-folder' does not exist"),
]


@pytest.mark.parametrize("argv,status,expected", CLI_CASES, ids=[" ".join(c[0]) or "no-args" for c in CLI_CASES])
def test_cli_help_version_and_usage_errors_import_no_heavy_module(tmp_path, argv, status, expected):
    report = tmp_path / "report.json"
    done = _python(CLI_DRIVER, str(report), *argv, cwd=tmp_path)
    result = json.loads(report.read_text())
    assert result["status"] == status, done.stderr[-2000:]
    assert expected in (done.stdout if status == 0 else done.stderr), (done.stdout, done.stderr)
    assert result["heavy"] == [], f"hf-lisa {' '.join(argv)} imported {result['heavy']}"


def test_console_script_prints_its_version(tmp_path):
    script = Path(sys.executable).with_name("hf-lisa")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hf_lisa.cli"]
    done = subprocess.run([*command, "--version"], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"hf-lisa {hf_lisa.__version__}\n", "")


def test_import_hf_lisa_is_light(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        import hf_lisa, hf_lisa.hub, hf_lisa.export, hf_lisa.errors, hf_lisa.methods
        assert set(hf_lisa.__all__) <= set(dir(hf_lisa)), set(hf_lisa.__all__) - set(dir(hf_lisa))
        assert set(hf_lisa.hub.__all__) <= set(dir(hf_lisa.hub))
        assert set(hf_lisa.export.__all__) <= set(dir(hf_lisa.export))
        print(hf_lisa.__version__)
        heavy = sorted(m for m in sys.modules if m.partition(".")[0] in {HEAVY!r})
        assert not heavy, heavy
    """)
    done = _python(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == hf_lisa.__version__


def test_public_names_resolve_lazily_to_the_same_objects():
    from hf_lisa import blocks, export, hub, tuner
    from hf_lisa.export import cli as export_cli
    from hf_lisa.export import gguf
    from hf_lisa.hub import load

    for name in hf_lisa.__all__:
        assert getattr(hf_lisa, name) is not None
    assert hf_lisa.LisaConfig is tuner.LisaConfig and hf_lisa.LisaModel is tuner.LisaModel
    assert hf_lisa.find_blocks is blocks.find_blocks and hf_lisa.from_pretrained is load.from_pretrained
    assert hf_lisa.push_to_hub is hub.push_to_hub and hf_lisa.tuner is tuner
    for package in (hf_lisa, hub, export):
        for name in [*package.__all__, *package._SUBMODULES]:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"
    with pytest.raises(AttributeError):
        hf_lisa.no_such_name  # noqa: B018
    # the parser spells out the GGUF types so that it loads no torch: the two must agree
    assert export_cli.GGUF_TYPE_CHOICES == gguf.GGUF_TYPES


# -- registration with PEFT ------------------------------------------------------------------------------------------
# read PEFT's mappings before touching hf_lisa.LisaConfig (which would register by itself), then compare
REGISTERED = textwrap.dedent("""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    config_cls, tuner_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get("LISA"), PEFT_TYPE_TO_TUNER_MAPPING.get("LISA")
    import peft, hf_lisa
    assert config_cls is hf_lisa.LisaConfig and tuner_cls is hf_lisa.LisaModel, (config_cls, tuner_cls)
    assert not [f for f in sys.meta_path if getattr(f, "_hf_lisa_register_on_peft_import", False)], "hook left"
    assert "exec_module" not in vars(peft.__loader__), "peft's loader still wrapped"
    print("REGISTERED")
""")
NO_PEFT_YET = 'assert "peft" not in sys.modules, "PEFT was imported before the step under test"\n'


@pytest.mark.parametrize("first", [
    "import peft; import hf_lisa",  # (iii)
    "from peft import PeftConfig; import hf_lisa",  # (iv)
    "import hf_lisa; import peft",  # (ii)
    "import hf_lisa; from hf_lisa import LisaConfig",  # (vi): hf_lisa.tuner imports PEFT
])  # hf_lisa first, then a PEFT submodule: test_adapter_reloads_with_plain_peft_after_a_bare_import
def test_lisa_is_registered_whichever_is_imported_first(tmp_path, first):
    done = _python(f"import sys\n{first}\n{REGISTERED}", cwd=tmp_path, timeout=180)
    assert "REGISTERED" in done.stdout, done.stderr[-3000:]


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory):
    """A tiny Llama base on disk and a LISA adapter on it (random A/B and masks), with the adapter's logits."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tiny_models import randomize_adapters

    root = tmp_path_factory.mktemp("lazy")
    base_dir, adapter_dir = root / "base", root / "adapter"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=100)).save_pretrained(base_dir)
    config = hf_lisa.LisaConfig(r=4, sparsity=0.5, mask_init="random", task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    randomize_adapters(model)
    model.save_pretrained(adapter_dir)  # base_model_name_or_path: base_dir, for AutoPeftModel
    ids = torch.tensor([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    save_file({"ids": ids, "logits": expected.contiguous()}, root / "expected.safetensors")
    return {"base": str(base_dir), "adapter": str(adapter_dir), "expected": str(root / "expected.safetensors")}


LOGITS = textwrap.dedent("""
    import torch
    from safetensors.torch import load_file
    data = load_file(paths["expected"])
    def check(model, label):
        with torch.no_grad():
            out = model.eval()(input_ids=data["ids"]).logits
        torch.testing.assert_close(out, data["logits"], msg=label)
        print("OK", label)
""")


def test_adapter_reloads_with_plain_peft_after_a_bare_import(tmp_path, saved_adapter):
    """(vii): a fresh process that only ran ``import hf_lisa`` loads a LISA adapter through PEFT's own entry points."""
    code = "import sys, json\npaths = json.loads(sys.argv[1])\nimport hf_lisa\n" + NO_PEFT_YET + REGISTERED + LOGITS
    code += textwrap.dedent("""
        from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
        from transformers import AutoModelForCausalLM
        assert type(PeftConfig.from_pretrained(paths["adapter"])).__name__ == "LisaConfig"
        check(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["base"]), paths["adapter"]), "peft")
        check(AutoPeftModelForCausalLM.from_pretrained(paths["adapter"]), "auto")
    """)
    done = _python(code, json.dumps(saved_adapter), cwd=tmp_path, timeout=300)
    assert "OK peft" in done.stdout and "OK auto" in done.stdout, done.stderr[-3000:]


def test_transformers_load_adapter_imports_peft_and_finds_lisa(tmp_path, saved_adapter):
    """(v): transformers imported first, PEFT only imported by transformers' own ``load_adapter``."""
    code = "import sys, json\npaths = json.loads(sys.argv[1])\nimport transformers, hf_lisa\n" + LOGITS
    code += textwrap.dedent("""
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(paths["base"])
        assert "peft" not in sys.modules, "PEFT was imported before load_adapter"
        model.load_adapter(paths["adapter"])
        check(model, "load_adapter")
    """) + REGISTERED
    done = _python(code, json.dumps(saved_adapter), cwd=tmp_path, timeout=300)
    assert "OK load_adapter" in done.stdout and "REGISTERED" in done.stdout, done.stderr[-3000:]
