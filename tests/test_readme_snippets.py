"""Every ```python block of README.md, and of the docs pages that took README snippets over, runs as written and does
what it says.

How the snippets are run, and the only liberties taken with them:

- ``PAGES`` are the files whose blocks run: README.md and the docs pages its snippets moved to (``docs/method.md``,
  ``docs/trl.md``, ``docs/hub.md``), every block of each. Each block is keyed by its file, the heading above it and
  its number under that heading (``"docs/trl.md: With TRL [1]"``). ``SNIPPETS`` lists every key with what the block
  must have done (``check``, run on the names it defined). A block of a page that is not listed, or a listed block
  that is gone, fails ``test_every_readme_snippet_is_listed``: a new snippet cannot go untested, silently or
  otherwise.
- The code is run unchanged except for ``SHORTER`` (500 training steps become 2). Each block runs in a fresh
  namespace, so a block that uses a name it does not define fails, unless its entry lists the name in ``provides``:
  only the push block of docs/hub.md does, because the page introduces it as working "with a model or a training
  output directory"; the test provides ``model`` (a ``PeftModel`` with a LISA adapter), its ``tokenizer`` and
  ``outputs/smollm2-lisa`` (an adapter output directory, with the ``training_summary.json`` a run writes).
- Hub ids stay as written. All blocks run in one fresh process whose ``HF_ENDPOINT`` is a local Hub server
  (``tests/hub_server.py``; huggingface_hub reads the variable at import, hence the process). On that server,
  ``HuggingFaceTB/SmolLM2-135M-Instruct`` holds a tiny 3-block llama with a character-level tokenizer and a chat
  template, and ``me/smollm2-lisa`` and ``me/smollm2-lisa-gsm8k`` hold LISA adapters for it, published before the
  blocks run. README's Trainer API block needs no Hub: it trains the embedded SmolLM2-135M-Instruct
  (``hf_lisa.models.default_model_path()``), as a user without network runs it. The blocks run in the order of ``PAGES``, each page top to bottom. The blocks' data files
  (``my_data.jsonl``, ``my_preferences.jsonl``) are tiny local files in the process's working directory. Nothing is
  skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from hub_server import HubServer
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: README.md and the docs pages that took its snippets over: every ```python block of each runs, in this order
PAGES = ("README.md", "docs/method.md", "docs/trl.md", "docs/hub.md")
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKEN = "hf_readmeSnippetsMeWrite0123456789abcdef"
PUBLISHED = ("me/smollm2-lisa", "me/smollm2-lisa-gsm8k")
SHORTER = {"max_steps=500": "max_steps=2"}
SHIFT = str.maketrans("abcdefgh", "bcdefghi")
#: the training_summary.json of the output directory the push and card blocks use (what `hf-lisa train` writes)
SUMMARY = {"base_model": MODEL_ID, "method": "lisa-adapter",
           "lisa": {"lisa_activated_layers": 0, "lisa_interval_steps": 20, "lisa_sampling": "uniform"},
           "hyperparameters": {"max_steps": 2}, "metrics": {"eval_loss": 0.4321}, "license": "apache-2.0"}


# ----------------------------------------------------------------------------------------------------------------------
# the snippets
# ----------------------------------------------------------------------------------------------------------------------
def readme_snippets(text: str, page: str = "README.md") -> list[dict]:
    """``{"key", "file", "line", "source"}`` for every ```python block of ``page`` (its ``text``), in order."""
    snippets, heading, per_heading = [], None, {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if line.strip() == "```python":
                per_heading[heading] = per_heading.get(heading, 0) + 1
                snippets.append({"key": f"{page}: {heading} [{per_heading[heading]}]", "file": page, "line": i + 2,
                                 "source": "\n".join(lines[i + 1:end]) + "\n"})
            i = end + 1
            continue
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        i += 1
    return snippets


def page_snippets() -> list[dict]:
    """The snippets of every page of ``PAGES``, in the order they run."""
    return [s for page in PAGES for s in readme_snippets((ROOT / page).read_text(), page)]


def shortened(source: str) -> str:
    for old, new in SHORTER.items():
        source = source.replace(old, new)
    return source


# ----------------------------------------------------------------------------------------------------------------------
# what each snippet must have done (run in the snippets' process, on the names the snippet defined)
# ----------------------------------------------------------------------------------------------------------------------
def _layers(model, kind: str) -> dict:
    from peft.tuners.lora import LoraLayer

    from hf_lisa import LisaLayer

    cls = LoraLayer if kind == "lora" else LisaLayer
    return {name: m for name, m in model.named_modules() if isinstance(m, cls)}


def check_peft_quick_start(ns: dict) -> None:
    lora, lisa, mixed = ns["lora"], ns["lisa"], ns["mixed"]
    stacked = sorted(_layers(lisa, "lora"))
    assert not stacked, f"LISA was stacked on LoRA (get_peft_model wrapped the same base model twice): {stacked[:3]}"
    assert _layers(lora, "lora") and not _layers(lora, "lisa"), "the LoRA model must hold LoRA layers only"
    assert not _layers(mixed, "lora")
    lisa_layers = _layers(lisa, "lisa")
    assert {n.rsplit(".", 1)[1] for n in lisa_layers} == {"q_proj", "k_proj", "v_proj"}
    assert all(m.lisa_mask_spec["default"]["sparsity"] == 0.4 for m in lisa_layers.values())
    ids = [{id(p) for p in m.parameters()} for m in (lora, lisa, mixed)]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2]), "the three models must not share weights"
    for name, layer in _layers(mixed, "lisa").items():
        ffn = name.rsplit(".", 1)[1] in ("gate_proj", "up_proj", "down_proj")
        assert layer.r["default"] == (8 if ffn else 4), name
        sparsity = layer.lisa_mask_spec.get("default", {}).get("sparsity", 0.0)
        assert sparsity == (0.0 if ffn else 0.4), name


def check_trainer_api(ns: dict) -> None:
    from peft import PeftModel

    from hf_lisa.trainer_callbacks import LisaCallback

    trainer = ns["trainer"]  # the second one (the adapter run before it had to finish for this one to start)
    assert trainer.state.global_step == 2
    model = trainer.model
    assert not isinstance(model, PeftModel) and not any("lisa_" in n for n, _ in model.named_parameters()), (
        "full-parameter LISA must train a plain model, not one that already carries adapters"
    )
    lisa = next(c for c in trainer.callback_handler.callbacks if isinstance(c, LisaCallback))
    assert lisa.layer_scheduler.lisa_activated_layers == 2


def check_trl(ns: dict) -> None:
    from peft import PeftModel
    from trl import DPOTrainer

    from hf_lisa.trainer_callbacks import LisaAdapterCallback

    trainer = ns["trainer"]  # the DPO one; the SFT run before it had to finish for this line to be reached
    assert isinstance(trainer, DPOTrainer) and trainer.state.global_step == 2
    assert isinstance(trainer.model, PeftModel) and trainer.model.peft_config["default"].peft_type == "LISA"
    assert trainer.ref_model is None  # the reference is the base model with the adapters disabled
    lisa = next(c for c in trainer.callback_handler.callbacks if isinstance(c, LisaAdapterCallback))
    assert lisa.layer_scheduler.lisa_activated_layers == 2


def check_lisa_sft_trainer(ns: dict) -> None:
    from hf_lisa.trainer.trl import LisaSFTTrainer

    trainer = ns["trainer"]
    assert isinstance(trainer, LisaSFTTrainer) and trainer.state.global_step == 2
    assert trainer.layerwise_lr_decay == 0.9  # from the LisaSFTConfig field
    rates = {group.get("initial_lr", group["lr"]) for group in trainer.optimizer.param_groups}  # before the schedule
    assert len(rates) > 1, rates  # the decay groups: one rate per block


def check_quantized_base(ns: dict) -> None:
    import bitsandbytes as bnb

    layers = _layers(ns["model"], "lisa")
    assert layers and all(isinstance(m.get_base_layer(), bnb.nn.Linear4bit) for m in layers.values())
    assert all(m.lisa_mask_spec["default"]["sparsity"] == 0.4 for m in layers.values())


def check_loads_published(repo_id: str) -> Callable[[dict], None]:
    def check(ns: dict) -> None:
        from peft import PeftModel, get_peft_model_state_dict
        from safetensors.torch import load_file

        model = ns["model"]
        assert isinstance(model, PeftModel) and model.peft_config["default"].peft_type == "LISA"
        expected = load_file(f"expected/{repo_id.replace('/', '__')}.safetensors")
        loaded = get_peft_model_state_dict(model)
        assert sorted(loaded) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), f"{key} differs from what was published to {repo_id}"

    return check


def check_model_card(ns: dict) -> None:
    """The card rendered from the output directory's training summary is the very card the push uploaded."""
    from huggingface_hub import hf_hub_download

    card, summary = ns["card"], ns["summary"]
    assert summary.method == "lisa-adapter" and summary.metrics == SUMMARY["metrics"], "read from training_summary.json"
    assert card.data.base_model == MODEL_ID and card.data.library_name == "peft" and card.data.license == "apache-2.0"
    assert "| eval_loss | 0.4321 |" in str(card)
    uploaded = Path(hf_hub_download("me/smollm2-lisa", "README.md")).read_text(encoding="utf-8")
    if uploaded != str(card):
        import difflib

        diff = "\n".join(difflib.unified_diff(str(card).splitlines(), uploaded.splitlines(), "card", "uploaded", n=1))
        raise AssertionError(f"the push must upload `card` as it is:\n{diff[:3000]}")


def provide_push_inputs() -> dict:
    """The push block's ``model`` and ``tokenizer``: the adapter of ``outputs/smollm2-lisa`` on its base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL_ID), "outputs/smollm2-lisa")
    return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(MODEL_ID)}


def check_pushes_on_the_server(run: dict) -> None:  # run in the test process, which owns the server
    hub = run["hub"]
    adapter = hub.files("me/smollm2-lisa-gsm8k")
    pushed = len(hub.commits("me/smollm2-lisa-gsm8k")) - run["commits_before"]["me/smollm2-lisa-gsm8k"]
    assert pushed == 2, f"expected two adapter pushes (a PeftModel, an output directory), found {pushed} commits"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(adapter)
    assert json.loads(adapter["adapter_config.json"])["base_model_name_or_path"] == MODEL_ID
    merged = hub.files("me/smollm2-lisa-gsm8k-merged")
    assert "config.json" in merged and "adapter_config.json" not in merged
    assert any(re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", name) for name in merged), sorted(merged)


@dataclass
class Snippet:
    check: Optional[Callable[[dict], None]] = None
    provides: Optional[Callable[[], dict]] = None
    server_check: Optional[Callable[[dict], None]] = None
    needs: Optional[str] = None  # an optional package the block imports: the test skips without it


SNIPPETS = {
    "README.md: The Trainer API in your own code [1]": Snippet(check=check_trainer_api),
    "README.md: Hub adapters [1]": Snippet(check=check_loads_published("me/smollm2-lisa")),
    "docs/method.md: The PEFT tuner, next to LoRA [1]": Snippet(check=check_peft_quick_start),
    "docs/method.md: Quantized bases (QLoRA-style) [1]": Snippet(check=check_quantized_base, needs="bitsandbytes"),
    "docs/trl.md: With TRL [1]": Snippet(check=check_trl),
    "docs/trl.md: With TRL [2]": Snippet(check=check_lisa_sft_trainer),
    "docs/hub.md: Share on the Hub [1]": Snippet(check=check_loads_published("me/smollm2-lisa-gsm8k")),
    "docs/hub.md: Share on the Hub [2]": Snippet(check=check_loads_published("me/smollm2-lisa-gsm8k")),
    "docs/hub.md: Two ways to push [1]": Snippet(provides=provide_push_inputs, server_check=check_pushes_on_the_server),
    # pushes me/smollm2-lisa anew: it runs after the README block that checks what was published there
    "docs/hub.md: The model card [1]": Snippet(check=check_model_card),
}

RUNNER = '''
import json, os, sys, time, traceback
sys.path.insert(0, {tests!r})
import test_readme_snippets as spec

report = {{}}
for item in json.load(open(sys.argv[1])):
    entry, start = spec.SNIPPETS.get(item["key"]), time.perf_counter()
    try:
        namespace = {{"__name__": "__readme__"}}
        if entry is not None and entry.provides is not None:
            namespace.update(entry.provides())
        exec(compile(item["source"], item["file"] + ":" + str(item["line"]), "exec"), namespace)
        if entry is not None and entry.check is not None:
            entry.check(namespace)
        report[item["key"]] = {{"ok": True}}
    except BaseException:
        report[item["key"]] = {{"ok": False, "error": traceback.format_exc()[-6000:]}}
    report[item["key"]]["seconds"] = round(time.perf_counter() - start, 1)
    json.dump(report, open(sys.argv[2], "w"), indent=1)
'''


# ----------------------------------------------------------------------------------------------------------------------
# the local Hub and the snippets' process
# ----------------------------------------------------------------------------------------------------------------------
def _publish(hub: HubServer, work: Path) -> None:
    """The stand-in base model under MODEL_ID, two LISA adapters for it, and the push block's output directory."""
    from huggingface_hub import HfApi
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_lisa
    from tiny_models import randomize_adapters

    base_dir = Path(build_tiny_lm_dir(work / "base", num_layers=3))
    (base_dir / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# tiny llama\n")
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(MODEL_ID)
    api.upload_folder(repo_id=MODEL_ID, folder_path=str(base_dir), commit_message="tiny stand-in")

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    (work / "expected").mkdir()
    for seed, repo_id in enumerate(PUBLISHED, start=1):
        config = hf_lisa.LisaConfig(task_type="CAUSAL_LM", r=4, sparsity=0.4, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
        randomize_adapters(model, seed=seed)
        save_file(get_peft_model_state_dict(model), work / "expected" / f"{repo_id.replace('/', '__')}.safetensors")
        hf_lisa.push_to_hub(model, repo_id, tokenizer=tokenizer, base_model=MODEL_ID, endpoint=hub.url, token=TOKEN)

    # what `hf-lisa train --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --output_dir ...` leaves
    output_dir = work / "outputs" / "smollm2-lisa"
    config = hf_lisa.LisaConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    randomize_adapters(model, seed=3)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = MODEL_ID
    (output_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    hf_lisa.hub.TrainingSummary.from_dict(SUMMARY).save(output_dir)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """Run every block of ``PAGES`` in one fresh process against the local Hub; return the report and the server."""
    import huggingface_hub.constants as hf_constants

    work = tmp_path_factory.mktemp("readme")
    hub = HubServer()
    hub.add_token(TOKEN, user="me", orgs=("HuggingFaceTB",), write=True)
    try:
        with pytest.MonkeyPatch.context() as mp:  # what HF_HUB_DISABLE_XET=1 sets at import: no Xet CAS server here
            mp.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
            mp.setattr(hf_constants, "HF_HUB_OFFLINE", False)
            _publish(hub, work)

        write_jsonl(work / "my_data.jsonl", copy_task_rows(24, seed=0))
        write_jsonl(work / "my_preferences.jsonl", [  # "say c" prefers "ccc" to "ddd"
            {"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"].translate(SHIFT)}
            for r in copy_task_rows(24, seed=0)
        ])
        commits_before = {repo_id: len(hub.commits(repo_id)) for repo_id in PUBLISHED}
        snippets = [dict(s, source=shortened(s["source"])) for s in page_snippets()]
        (work / "snippets.json").write_text(json.dumps(snippets))
        (work / "runner.py").write_text(RUNNER.format(tests=str(Path(__file__).resolve().parent)))

        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HOME=str(work / "hf_home"), HF_HUB_DISABLE_XET="1",
                   HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT),
                   OMP_NUM_THREADS="1")  # tiny models: threads only spin against each other on a busy machine
        proc = subprocess.run(
            [sys.executable, str(work / "runner.py"), str(work / "snippets.json"), str(work / "report.json")],
            cwd=work, env=env, capture_output=True, text=True, timeout=600,
        )
        report_path = work / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        yield {"report": report, "hub": hub, "proc": proc, "commits_before": commits_before}
    finally:
        hub.stop()


def test_every_readme_snippet_is_listed():
    keys = [s["key"] for s in page_snippets()]
    assert len(keys) == len(set(keys))
    assert sorted(keys) == sorted(SNIPPETS), (
        f"python blocks of {PAGES} not listed in SNIPPETS: {sorted(set(keys) - set(SNIPPETS))}; "
        f"listed but no longer in their page: {sorted(set(SNIPPETS) - set(keys))}"
    )
    assert keys[0].startswith("README.md: "), "README.md keeps a quick start of its own"
    text = "".join((ROOT / page).read_text() for page in PAGES)
    used = [old for old in SHORTER if old in text]
    assert used == list(SHORTER), "a SHORTER substitution no longer matches the README or its docs pages"


@pytest.mark.slow  # the snippets run in a child process against a local Hub server
@pytest.mark.parametrize("key", list(SNIPPETS))
def test_readme_snippet_runs_and_does_what_it_says(readme_run, key):
    if SNIPPETS[key].needs:
        pytest.importorskip(SNIPPETS[key].needs)
    result = readme_run["report"].get(key)
    proc = readme_run["proc"]
    assert result is not None, f"{key!r} did not run (exit {proc.returncode}): {proc.stderr[-4000:]}"
    assert result["ok"], f"block {key!r} failed:\n{result['error']}"
    if SNIPPETS[key].server_check is not None:
        SNIPPETS[key].server_check(readme_run)
