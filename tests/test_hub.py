"""Hub integration: push adapters and merged models to a real local Hub server and load them back in fresh processes.

How the environment is handled (huggingface_hub reads ``HF_ENDPOINT`` and ``HF_HUB_DISABLE_XET`` once, at import):

- The server (``tests/hub_server.py``) runs in a thread of this process on 127.0.0.1.
- Pushes run in this process and pass ``endpoint=server.url`` to ``push_to_hub`` (``HfApi`` takes it explicitly),
  so they work whichever test module imported huggingface_hub first. hf_xet is installed, and the Xet upload path
  needs a CAS server, so the module sets ``huggingface_hub.constants.HF_HUB_DISABLE_XET`` (what the variable sets at
  import) for its duration; it also makes sure offline mode is off.
- Everything that reads the endpoint from the environment (PEFT, transformers, ``ModelCard.load``, the CLI) runs in
  fresh subprocesses started with ``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET=1``, a ``HF_TOKEN`` and a temporary
  ``HF_HOME``: that is also what "loads in a fresh process" means. One consumer process does all loads to pay the
  import cost once; each test asserts on its own part of that process's report.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubServer, validate_card_metadata  # noqa: E402

import hf_lisa  # noqa: E402
from hf_lisa.errors import MISSING_IMPORT_HINT  # noqa: E402
from hf_lisa.hub import (  # noqa: E402
    PICKLE_SUFFIXES,
    HubPushError,
    TrainingSummary,
    explain_missing_import,
    hub_cli,
    push_to_hub,
    render_model_card,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
WRITE_TOKEN = "hf_lisaTestAliceWrite0123456789abcdef"
OTHER_TOKEN = "hf_lisaTestBobWrite0123456789abcdef"  # a valid user without rights on alice's repos
WRONG_TOKEN = "hf_lisaTestWrongToken0123456789abcdef"
BASE_REPO = "lisa-org/tiny-llama"
INPUT_IDS = [[4, 9, 17, 33, 2, 71, 8, 100, 5, 12], [60, 3, 3, 91, 44, 7, 120, 15, 6, 30]]
TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------------------------------------------------
# tiny models, tokenizer and training output
# ----------------------------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[UNK]", "[PAD]", "<s>", "</s>"] + [f"w{i}" for i in range(124)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                                   eos_token="</s>")


def randomize(model, seed: int) -> None:
    """Non-zero adapter factors and interpolation scalars, so that a lost tensor changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lisa_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits


def png_bytes() -> bytes:
    """A valid 1×1 PNG, written by hand (no plotting library needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def sparse_mixed_config(**kwargs):
    # seed 000's mixed strategy: sparse LISA on q/k/v, dense (LoRA-equivalent) on the FFN, rank 4 on down_proj
    return hf_lisa.LisaConfig(
        target_modules=TARGETS, sparsity=0.5, sparsity_pattern={"up_proj": 0.0, "down_proj": 0.0},
        rank_pattern={"down_proj": 4}, mask_init="random", task_type="CAUSAL_LM", lisa_activated_layers=1,
        lisa_interval_steps=5, **kwargs,
    )


@pytest.fixture(scope="module")
def hub():
    import huggingface_hub.constants as hf_constants

    server = HubServer()
    server.add_token(WRITE_TOKEN, user="alice", orgs=("lisa-org",), write=True)
    server.add_token(OTHER_TOKEN, user="bob", write=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def api(hub):
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=WRITE_TOKEN)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="module")
def base_dir(work, api):
    """The base model, saved locally (what training used) and published as BASE_REPO with an apache-2.0 card."""
    path = work / "base"
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    (path / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# tiny llama\n")
    api.create_repo(BASE_REPO)
    api.upload_folder(repo_id=BASE_REPO, folder_path=str(path), commit_message="base")
    return path


@pytest.fixture(scope="module")
def trained(base_dir, work):
    """A trained LISA adapter model and its training output directory, with the junk a Trainer leaves there."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)  # records the local path as base_model_name_or_path
    model = get_peft_model(base, sparse_mixed_config()).eval()
    randomize(model, seed=1)
    out = work / "output"
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    (out / "loss.png").write_bytes(png_bytes())
    torch.save({"learning_rate": 1e-3}, out / "training_args.bin")  # what Trainer.push_to_hub would upload
    (out / "checkpoint-10").mkdir()
    torch.save({"step": 10}, out / "checkpoint-10" / "optimizer.pt")
    (out / "training_summary.json").write_text(json.dumps({
        "base_model": BASE_REPO, "method": "lisa-adapter",
        "lisa": {"lisa_activated_layers": 2, "lisa_interval_steps": 5, "lisa_sampling": "cyclic"},
        "hyperparameters": {"learning_rate": 0.0005, "num_train_epochs": 1, "per_device_train_batch_size": 4},
        "metrics": {"eval_loss": 1.2345, "exact_match": 0.375}, "datasets": ["openai/gsm8k"],
        "dataset_name": "openai/gsm8k", "loss_plot": "loss.png", "license": None,
    }))
    return {"model": model, "dir": out, "logits": logits_of(model), "base_logits": logits_of(base_model_only(base_dir))}


def base_model_only(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir).eval()


def subprocess_env(hub, tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(
        HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN=WRITE_TOKEN, HF_HOME=str(tmp / "hf_home"),
        HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1", **extra,
    )
    return env


# ----------------------------------------------------------------------------------------------------------------------
# the pushes (in this process, except the CLI one)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pushed(hub, api, trained, base_dir, work):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    results = {}
    # 1. the training output directory, adapter mode
    results["adapter"] = push_to_hub(trained["dir"], "alice/lisa-adapter", mode="adapter", token=WRITE_TOKEN,
                                     endpoint=hub.url)
    # 2. a different adapter, as a model object, to a new branch of the same repo
    model_v2 = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), sparse_mixed_config()).eval()
    randomize(model_v2, seed=2)
    results["adapter_v2"] = push_to_hub(model_v2, "alice/lisa-adapter", revision="experiment", token=WRITE_TOKEN,
                                        base_model=BASE_REPO, endpoint=hub.url)
    results["logits_v2"] = logits_of(model_v2)
    # 3. private
    results["private"] = push_to_hub(trained["model"], "alice/lisa-private", private=True, token=WRITE_TOKEN,
                                     base_model=BASE_REPO, endpoint=hub.url)
    # 4. layer interpolation: adapter mode carries δ and β
    interp = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        hf_lisa.LisaConfig(target_modules=["q_proj", "v_proj"], layer_interpolation=True, task_type="CAUSAL_LM"),
    ).eval()
    randomize(interp, seed=3)
    results["interp_model"] = interp
    results["interp"] = push_to_hub(interp, "alice/lisa-interp", token=WRITE_TOKEN, base_model=BASE_REPO,
                                    endpoint=hub.url)
    results["logits_interp"] = logits_of(interp)
    # 5. full-parameter LISA output: a plain transformers model, pushed as merged by default
    full = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        full.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    results["full_model"] = full
    results["full"] = push_to_hub(full, "alice/full-lisa", token=WRITE_TOKEN, base_model=BASE_REPO,
                                  tokenizer=tiny_tokenizer(), endpoint=hub.url,
                                  training_summary={"method": "lisa", "lisa": {"lisa_activated_layers": 1}})
    results["logits_full"] = logits_of(full)
    # 6. a pickle-only adapter, uploaded by hand (hf-lisa never writes one), for the loading refusal
    pickled = work / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((trained["dir"] / "adapter_config.json").read_text().replace(
        str(base_dir), BASE_REPO))
    from safetensors.torch import load_file

    torch.save(load_file(trained["dir"] / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    api.create_repo("alice/pickled-adapter")
    api.upload_folder(repo_id="alice/pickled-adapter", folder_path=str(pickled), commit_message="pickle")
    return results


@pytest.fixture(scope="module")
def cli_push(hub, trained, pushed, work):
    """`hf-lisa push OUTPUT_DIR REPO --mode merged --token T` in a fresh process, with debug logging everywhere."""
    code = ("import logging, sys; logging.basicConfig(level=logging.DEBUG); from hf_lisa.hub import hub_cli; "
            "sys.exit(hub_cli(sys.argv[1:]))")
    argv = ["push", str(trained["dir"]), "alice/lisa-merged", "--mode", "merged", "--token", WRITE_TOKEN,
            "--max_shard_size", "20KB"]
    # HF_TOKEN is unset: the token only travels through --token
    env = subprocess_env(hub, work, HF_DEBUG="1", HF_HUB_VERBOSITY="debug")
    env.pop("HF_TOKEN")
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    return proc


CONSUMER = textwrap.dedent('''
    import json, os, sys, traceback
    import torch
    spec = json.load(open(sys.argv[1]))
    ids = torch.tensor(spec["input_ids"])
    out = {}

    def record(name, fn):
        try:
            out[name] = {"ok": fn()}
        except Exception as exc:
            status, cause = None, exc
            while cause is not None and status is None:  # hf_hub_download wraps HTTP errors
                status = getattr(getattr(cause, "response", None), "status_code", None)
                cause = cause.__cause__ or cause.__context__
            out[name] = {"error": type(exc).__name__, "message": str(exc), "status": status,
                         "traceback": traceback.format_exc()[-2000:]}

    def logits(model):
        with torch.no_grad():
            return model(ids).logits.tolist()

    # 1. PEFT without `import hf_lisa`: the bare KeyError users hit today
    from peft import PeftConfig
    missing = {}
    for label, source in (("local", spec["adapter_dir"]), ("hub", "alice/lisa-adapter")):
        try:
            PeftConfig.from_pretrained(source)
            missing[label] = "loaded"
        except KeyError as exc:
            missing[label] = ["KeyError"] + [str(a) for a in exc.args]
            key_error = exc
    out["without_import"] = {"ok": missing, "hf_lisa_imported": "hf_lisa" in sys.modules}

    import hf_lisa
    from hf_lisa.hub.load import explain_missing_import
    out["hint"] = {"ok": str(explain_missing_import(key_error))}

    from huggingface_hub import ModelCard, hf_hub_download, model_info
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record("peft_adapter", lambda: logits(PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(spec["base_repo"]), "alice/lisa-adapter")))
    record("lisa_adapter", lambda: logits(hf_lisa.from_pretrained("alice/lisa-adapter")))
    record("local_adapter", lambda: logits(hf_lisa.from_pretrained(spec["adapter_dir"])))
    record("lisa_adapter_branch", lambda: logits(hf_lisa.from_pretrained("alice/lisa-adapter", revision="experiment")))
    record("lisa_adapter_oid", lambda: logits(hf_lisa.from_pretrained("alice/lisa-adapter",
                                                                      revision=spec["adapter_oid"])))
    record("merged_auto", lambda: logits(AutoModelForCausalLM.from_pretrained("alice/lisa-merged")))
    record("merged_lisa", lambda: logits(hf_lisa.from_pretrained("alice/lisa-merged")))
    record("merged_tokens", lambda: AutoTokenizer.from_pretrained("alice/lisa-merged")("w1 w2 w77")["input_ids"])
    record("interp", lambda: logits(hf_lisa.from_pretrained("alice/lisa-interp")))
    record("full", lambda: logits(AutoModelForCausalLM.from_pretrained("alice/full-lisa")))
    record("pickle_refused", lambda: logits(hf_lisa.from_pretrained("alice/pickled-adapter")))
    record("pickle_allowed", lambda: logits(hf_lisa.from_pretrained("alice/pickled-adapter", allow_pickle=True)))
    for label, token in (("anonymous", False), ("other_user", spec["other_token"]), ("owner", None)):
        record(f"private_{label}", lambda: bool(hf_hub_download("alice/lisa-private", "adapter_config.json",
                                                               token=token, force_download=True)))
    record("private_info_anonymous", lambda: model_info("alice/lisa-private", token=False).id)
    record("private_owner_load", lambda: logits(hf_lisa.from_pretrained("alice/lisa-private")))

    def card(repo):
        loaded = ModelCard.load(repo)
        loaded.validate()  # POST /api/validate-yaml through constants.ENDPOINT, as ModelCard.push_to_hub does
        return loaded.data.to_dict()

    record("card_adapter", lambda: card("alice/lisa-adapter"))
    record("card_merged", lambda: card("alice/lisa-merged"))
    json.dump(out, open(sys.argv[2], "w"))
''')


@pytest.fixture(scope="module")
def consumer(hub, pushed, cli_push, trained, base_dir, work):
    assert cli_push.returncode == 0, cli_push.stderr[-3000:]
    script, spec_path, out_path = work / "consumer.py", work / "spec.json", work / "consumer_out.json"
    script.write_text(CONSUMER)
    spec_path.write_text(json.dumps({
        "input_ids": INPUT_IDS, "adapter_dir": str(trained["dir"]), "base_repo": BASE_REPO,
        "other_token": OTHER_TOKEN, "adapter_oid": pushed["adapter"].oid,
    }))
    proc = subprocess.run([sys.executable, str(script), str(spec_path), str(out_path)],
                          env=subprocess_env(hub, work), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_path.read_text())


def ok(result: dict):
    assert "ok" in result, f"{result.get('error')}: {result.get('message')}\n{result.get('traceback')}"
    return result["ok"]


def close(a, b, atol=1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------------------------------------
# adapter mode
# ----------------------------------------------------------------------------------------------------------------------
def test_adapter_push_uploads_only_safetensors_config_card_plot_and_tokenizer(hub, pushed):
    files = hub.files("alice/lisa-adapter")
    assert set(files) == {
        ".gitattributes", "README.md", "adapter_config.json", "adapter_model.safetensors", "loss.png",
        "tokenizer.json", "tokenizer_config.json",
    }
    assert files["loss.png"] == png_bytes()
    # training recorded a local path; the uploaded config names the Hub base so that anyone can load it
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == BASE_REPO
    # one commit on top of the repo's initial commit
    assert len(hub.commits("alice/lisa-adapter")) == 2
    assert hub.commits("alice/lisa-adapter")[0] == pushed["adapter"].oid


@pytest.mark.slow  # hf-lisa push in a fresh python process (the cli_push fixture)
def test_no_pickle_file_or_token_ever_reaches_the_server(hub, pushed, cli_push):
    named = [p for r in hub.state.requests if "pickled-adapter" not in r.path for p in r.paths]
    assert named, "the server saw no file names at all"
    assert not [p for p in named if p.lower().endswith(PICKLE_SUFFIXES)]
    for (repo_type, repo_id), repo in hub.state.repos.items():
        if repo_id == "alice/pickled-adapter":
            continue
        for commit in repo.commits.values():
            assert not [p for p in commit.files if p.lower().endswith(PICKLE_SUFFIXES)], repo_id
    assert not [sha for sha, data in hub.state.objects.items() if WRITE_TOKEN.encode() in data]


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_adapter_card_places_the_adapter_under_its_base_model(hub, pushed, consumer):
    from huggingface_hub import ModelCard

    card = ModelCard(hub.files("alice/lisa-adapter")["README.md"].decode())
    data = card.data
    assert data.library_name == "peft"
    assert data.base_model == BASE_REPO
    assert data.base_model_relation == "adapter"
    assert {"lisa", "peft", "lisa-adapter"} <= set(data.tags)
    assert data.license == "apache-2.0"  # inherited from the base model's card on the Hub
    assert data.datasets == ["openai/gsm8k"]
    results = {r.metric_name: r for r in data.eval_results}
    assert results["eval_loss"].metric_value == pytest.approx(1.2345)
    assert results["eval_loss"].metric_type == "loss" and results["eval_loss"].dataset_split == "validation"
    assert results["exact_match"].metric_value == pytest.approx(0.375)
    body = card.text
    two_lines = (
        'import hf_lisa  # registers the LISA method with PEFT\nmodel = hf_lisa.from_pretrained("alice/lisa-adapter")'
    )
    assert two_lines in body
    assert "γ = 2 blocks active at a time, switched every K = 5 optimizer steps, cyclic sampling" in body
    assert "| `k_proj`, `q_proj`, `v_proj` | 8 | 8 | 1 | 0.5 | 2×2 blocks |" in body
    assert "| `down_proj` | 4 | 8 | 2 | 0 | dense (LoRA-equivalent) |" in body
    assert "| learning_rate | 0.0005 |" in body and "| exact_match | 0.375 |" in body
    assert "![Training loss](loss.png)" in body
    for package in ("hf-lisa", "peft", "transformers", "torch"):
        assert f"- {package} " in body
    # the client parsed it and the server's validator accepted it, from a fresh process through HF_ENDPOINT
    assert ok(consumer["card_adapter"])["base_model_relation"] == "adapter"
    assert any(r.status == 200 for r in hub.requests_of("validate"))


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_adapter_loads_in_a_fresh_process_with_peft_and_hf_lisa(trained, consumer):
    assert not close(trained["logits"], trained["base_logits"], atol=1e-3)  # the adapter matters
    assert close(ok(consumer["peft_adapter"]), trained["logits"], atol=1e-6)
    assert close(ok(consumer["lisa_adapter"]), trained["logits"], atol=1e-6)
    assert close(ok(consumer["lisa_adapter_oid"]), trained["logits"], atol=1e-6)
    assert close(ok(consumer["local_adapter"]), trained["logits"], atol=1e-6)


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_from_pretrained_honours_revision(trained, pushed, consumer, hub):
    assert hub.repo("alice/lisa-adapter").branches.keys() == {"main", "experiment"}
    branch = ok(consumer["lisa_adapter_branch"])
    assert close(branch, pushed["logits_v2"], atol=1e-6)
    assert not close(branch, trained["logits"], atol=1e-3)


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_missing_import_gives_a_clear_instruction(consumer):
    without = ok(consumer["without_import"])
    assert consumer["without_import"]["hf_lisa_imported"] is False
    assert without == {"local": ["KeyError", "LISA"], "hub": ["KeyError", "LISA"]}
    assert ok(consumer["hint"]) == MISSING_IMPORT_HINT
    assert "import hf_lisa" in MISSING_IMPORT_HINT and "pip install hf-lisa" in MISSING_IMPORT_HINT
    assert explain_missing_import(KeyError("LORA")) is None and explain_missing_import(ValueError("LISA")) is None
    try:
        raise RuntimeError("while loading") from KeyError("LISA")
    except RuntimeError as exc:
        assert str(explain_missing_import(exc)) == MISSING_IMPORT_HINT


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_interpolation_adapter_round_trips_and_refuses_merge(hub, pushed, consumer):
    from safetensors.torch import load

    weights = load(hub.files("alice/lisa-interp")["adapter_model.safetensors"])
    assert any("lisa_interp_delta" in k for k in weights) and any("lisa_interp_beta" in k for k in weights)
    assert close(ok(consumer["interp"]), pushed["logits_interp"], atol=1e-6)
    with pytest.raises(ValueError, match="layer_interpolation.*mode='adapter'"):
        push_to_hub(pushed["interp_model"], "alice/interp-merged", mode="merged", token=WRITE_TOKEN,
                    endpoint=hub.url)
    assert not hub.has_repo("alice/interp-merged")  # refused before any request


# ----------------------------------------------------------------------------------------------------------------------
# merged mode and full-parameter output
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # hf-lisa push in a fresh python process (the cli_push fixture)
def test_cli_pushes_merged_sharded_safetensors_without_leaking_the_token(hub, cli_push):
    assert cli_push.returncode == 0, cli_push.stderr[-3000:]
    files = hub.files("alice/lisa-merged")
    shards = sorted(f for f in files if f.startswith("model-"))
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
            "loss.png"} <= set(files)
    assert set(files) - set(shards) - {"model.safetensors.index.json"} == {
        ".gitattributes", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "README.md", "loss.png"}
    assert cli_push.stdout.strip().endswith(hub.commits("alice/lisa-merged")[0])
    logs = cli_push.stdout + cli_push.stderr
    assert "Authorization: Bearer <TOKEN>" in logs or "<TOKEN>" in logs  # HF_DEBUG logged the requests, redacted
    assert WRITE_TOKEN not in logs
    pushed_line = next(line for line in logs.splitlines() if "Pushing" in line and "files to alice/lisa-merged" in line)
    assert ".safetensors" in pushed_line and not [s for s in PICKLE_SUFFIXES if s in pushed_line]
    assert "training_args.bin" not in logs and "optimizer.pt" not in logs


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_merged_model_reproduces_the_unmerged_adapter(trained, consumer, base_dir):
    from transformers import AutoTokenizer

    assert close(ok(consumer["merged_auto"]), trained["logits"], atol=1e-5)
    assert close(ok(consumer["merged_lisa"]), trained["logits"], atol=1e-5)
    assert ok(consumer["merged_tokens"]) == AutoTokenizer.from_pretrained(base_dir)("w1 w2 w77")["input_ids"]


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_merged_card_metadata(consumer):
    data = ok(consumer["card_merged"])
    assert data["library_name"] == "transformers"
    assert data["base_model"] == BASE_REPO and data["base_model_relation"] == "finetune"
    assert "lisa" in data["tags"] and data["model-index"][0]["results"][0]["metrics"]


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_full_parameter_model_is_pushed_as_merged(hub, pushed, consumer):
    files = hub.files("alice/full-lisa")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(files)
    assert not any(f.startswith("adapter_") for f in files)
    assert close(ok(consumer["full"]), pushed["logits_full"], atol=1e-6)
    with pytest.raises(ValueError, match="mode='merged'"):
        push_to_hub(pushed["full_model"], "alice/full-as-adapter", mode="adapter", token=WRITE_TOKEN,
                    endpoint=hub.url)


# ----------------------------------------------------------------------------------------------------------------------
# safety: pickle, privacy
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_loading_refuses_pickle_unless_allowed(trained, consumer):
    refused = consumer["pickle_refused"]
    assert refused.get("error") == "ValueError" and "allow_pickle=True" in refused["message"]
    assert "adapter_model.bin" in refused["message"]
    assert close(ok(consumer["pickle_allowed"]), trained["logits"], atol=1e-6)


def test_pickle_only_adapter_directory_is_never_uploaded(hub, work, trained):
    folder = work / "pickle-only"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((trained["dir"] / "adapter_config.json").read_text())
    torch.save({"w": torch.zeros(2)}, folder / "adapter_model.bin")
    with pytest.raises(ValueError, match="never uploads"):
        push_to_hub(folder, "alice/pickle-only", token=WRITE_TOKEN, endpoint=hub.url)
    assert not hub.has_repo("alice/pickle-only")


@pytest.mark.slow  # reads what a fresh python process loaded from the hub (the consumer fixture)
def test_private_repo_stays_private(hub, trained, consumer):
    assert hub.repo("alice/lisa-private").private is True
    assert consumer["private_anonymous"]["status"] == 401
    assert consumer["private_other_user"]["status"] == 404
    assert consumer["private_info_anonymous"]["status"] == 401
    assert ok(consumer["private_owner"]) is True
    assert close(ok(consumer["private_owner_load"]), trained["logits"], atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# failures: each names what failed and leaves the repo as it was
# ----------------------------------------------------------------------------------------------------------------------
def snapshot(hub, repo_id):
    return hub.commits(repo_id), hub.files(repo_id)


def test_wrong_token_fails_clearly_without_commit_or_leak(hub, trained, pushed, caplog):
    before = snapshot(hub, "alice/lisa-adapter")
    creates = len(hub.requests_of("create"))
    with caplog.at_level(logging.DEBUG), pytest.raises(HubPushError) as info:
        push_to_hub(trained["dir"], "alice/lisa-adapter", token=WRONG_TOKEN, endpoint=hub.url)
    message = str(info.value)
    assert "HTTP 401" in message and "token is invalid" in message and "creating the repository" in message
    assert info.value.status == 401
    assert len(hub.requests_of("create")) == creates + 1  # a 401 is not retried
    assert WRONG_TOKEN not in message and WRONG_TOKEN not in caplog.text
    assert snapshot(hub, "alice/lisa-adapter") == before


def test_refused_repo_fails_clearly_without_commit(hub, api, trained, pushed):
    api.create_repo("alice/frozen")
    api.upload_file(path_or_fileobj=b"---\nlicense: mit\n---\n# frozen\n", path_in_repo="README.md",
                    repo_id="alice/frozen")
    hub.refuse("alice/frozen")
    before = snapshot(hub, "alice/frozen")
    creates = len(hub.requests_of("create"))
    with pytest.raises(HubPushError, match=r"refused the write \(HTTP 403\).*read-only") as info:
        push_to_hub(trained["dir"], "alice/frozen", token=WRITE_TOKEN, endpoint=hub.url)
    assert info.value.status == 403
    assert len(hub.requests_of("create")) == creates + 1  # a 403 is not retried
    assert snapshot(hub, "alice/frozen") == before
    # another user's namespace is refused the same way
    before = snapshot(hub, "alice/lisa-adapter")
    with pytest.raises(HubPushError, match=r"HTTP 403"):
        push_to_hub(trained["dir"], "alice/lisa-adapter", token=OTHER_TOKEN, endpoint=hub.url)
    assert snapshot(hub, "alice/lisa-adapter") == before


def fresh_adapter(base_dir, seed: int):
    """An adapter whose weights the server has never seen (the LFS store deduplicates by content)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), sparse_mixed_config()).eval()
    randomize(model, seed=seed)
    return model


def test_server_dying_mid_upload_leaves_the_repo_unchanged(hub, pushed, base_dir):
    before = snapshot(hub, "alice/lisa-adapter")
    objects_before = set(hub.state.objects)
    model = fresh_adapter(base_dir, seed=10)
    hub.die_on("commit")  # the weights go up (LFS), then the server dies while receiving the commit
    try:
        with pytest.raises(HubPushError) as info:
            push_to_hub(model, "alice/lisa-adapter", token=WRITE_TOKEN, base_model=BASE_REPO, endpoint=hub.url,
                        max_retries=1, retry_base_wait=0.05)
    finally:
        hub.restart()
    message = str(info.value)
    assert "creating the commit" in message and "2 attempt(s)" in message and info.value.stage == "creating the commit"
    assert "left as it was" in message and WRITE_TOKEN not in message
    assert set(hub.state.objects) - objects_before, "the server died before any upload: nothing was tested"
    assert snapshot(hub, "alice/lisa-adapter") == before


def test_offline_mode_fails_at_once_without_a_request(hub, trained, pushed, monkeypatch):
    import huggingface_hub.constants as hf_constants

    requests = len(hub.state.requests)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    with pytest.raises(HubPushError, match="offline mode is enabled") as info:
        push_to_hub(trained["dir"], "alice/offline", token=WRITE_TOKEN, endpoint=hub.url, retry_base_wait=5.0)
    assert time.monotonic() - started < 5.0  # no backoff: offline mode is not a transient error
    assert info.value.stage == "creating the repository" and info.value.status is None
    assert len(hub.state.requests) == requests and not hub.has_repo("alice/offline")


def test_transient_errors_are_retried_into_exactly_one_commit(hub, pushed, base_dir):
    hub.drop_next("lfs_put")  # huggingface_hub's own backoff retries the upload
    hub.fail_next("commit", status=503)  # huggingface_hub never retries a commit request; push_to_hub does
    info = push_to_hub(fresh_adapter(base_dir, seed=11), "alice/retry", token=WRITE_TOKEN, base_model=BASE_REPO,
                       endpoint=hub.url, retry_base_wait=0.05)
    commits = [r for r in hub.requests_of("commit") if "alice/retry/" in r.path]
    assert [r.status for r in commits] == [503, 200]
    assert [r.status for r in hub.requests_of("lfs_put")][-2:] == [None, 200]
    assert hub.commits("alice/retry") == [info.oid, hub.commits("alice/retry")[-1]]


def test_lost_commit_response_is_not_committed_twice(hub, pushed, base_dir):
    hub.drop_next("commit", after_apply=True)  # the server applies the commit, then the answer is lost
    info = push_to_hub(fresh_adapter(base_dir, seed=12), "alice/lost-answer", token=WRITE_TOKEN, base_model=BASE_REPO,
                       endpoint=hub.url, retry_base_wait=0.05)
    assert len(hub.commits("alice/lost-answer")) == 2  # initial + exactly one push
    assert info.oid == hub.commits("alice/lost-answer")[0]
    assert len([r for r in hub.requests_of("commit") if "alice/lost-answer/" in r.path]) == 1


# ----------------------------------------------------------------------------------------------------------------------
# card validation and CLI errors
# ----------------------------------------------------------------------------------------------------------------------
def test_typed_summary_and_rendered_card_are_used_as_given(hub, trained, pushed):
    adapter_config = json.loads((trained["dir"] / "adapter_config.json").read_text())
    summary = TrainingSummary(base_model=BASE_REPO, method="lisa-adapter", metrics={"eval_loss": 0.5},
                              datasets=["openai/gsm8k"], license="mit", loss_plot="loss.png")
    # the object is used instead of the directory's training_summary.json (eval_loss 1.2345, no license)
    push_to_hub(trained["dir"], "alice/typed-summary", token=WRITE_TOKEN, endpoint=hub.url, training_summary=summary)
    body = hub.files("alice/typed-summary")["README.md"].decode()
    assert "| eval_loss | 0.5 |" in body and "1.2345" not in body and "license: mit" in body
    # a card rendered once (here from the object; the dict renders the same card) is uploaded as it is
    card = render_model_card("alice/card-once", "adapter", adapter_config=adapter_config, summary=summary,
                             loss_plot=summary.loss_plot)
    assert str(render_model_card("alice/card-once", "adapter", adapter_config=adapter_config,
                                 summary=summary.to_dict(), loss_plot=summary.loss_plot)) == str(card)
    push_to_hub(trained["dir"], "alice/card-once", token=WRITE_TOKEN, endpoint=hub.url, training_summary=summary,
                card=card)
    assert hub.files("alice/card-once")["README.md"].decode() == str(card)


def test_training_summary_round_trips_the_json_keys(trained, tmp_path, caplog):
    on_disk = json.loads((trained["dir"] / "training_summary.json").read_text())
    summary = TrainingSummary.from_dir(trained["dir"])
    assert summary.method == "lisa-adapter" and summary.lisa["lisa_activated_layers"] == 2
    assert {k: summary.to_dict()[k] for k in on_disk} == on_disk  # the same keys and values as the file
    summary.save(tmp_path)
    assert TrainingSummary.from_dir(tmp_path) == summary
    assert TrainingSummary.from_dir(tmp_path / "missing") == TrainingSummary()
    with caplog.at_level(logging.WARNING, logger="hf_lisa.hub"):
        assert TrainingSummary.from_dict({"method": "lora", "methd": "x", "datasets": "a/b"}).datasets == ["a/b"]
    assert "Ignoring training summary keys ['methd']" in caplog.text


def test_card_without_hub_base_omits_base_model_and_passes_validation(hub, caplog):
    from huggingface_hub.utils import get_session

    adapter_config = {"peft_type": "LISA", "task_type": "CAUSAL_LM", "r": 8, "lisa_alpha": 16,
                      "base_model_name_or_path": "/home/me/models/base"}
    with caplog.at_level(logging.WARNING, logger="hf_lisa.hub"):
        card = render_model_card("alice/x", "adapter", adapter_config=adapter_config)
    assert "No Hub id is known for the base model" in caplog.text
    assert card.data.base_model is None and "base_model_relation" not in card.data.to_dict()
    assert "a base model that is not on the Hub (`base`)" in card.text and "/home/me" not in str(card)
    response = get_session().post(f"{hub.url}/api/validate-yaml", json={"content": str(card), "repoType": "model"})
    assert response.status_code == 200
    # the server's check is real: a path as base_model is rejected, as the Hub does
    bad = str(card).replace("library_name: peft", "library_name: peft\nbase_model: /home/me/models/base", 1)
    response = get_session().post(f"{hub.url}/api/validate-yaml", json={"content": bad, "repoType": "model"})
    assert response.status_code == 400 and "base_model" in response.json()["errors"][0]["message"]
    assert validate_card_metadata("---\nbase_model_relation: adapter\n---\n")[0] == [
        '"base_model_relation" requires "base_model".']


def test_cli_reports_usage_and_missing_directory(work, capsys):
    assert hub_cli(["push"]) == 2
    assert hub_cli(["push", str(work / "does-not-exist"), "alice/x"]) == 2  # what was asked cannot be pushed
    assert "does not exist" in capsys.readouterr().err
    (work / "empty").mkdir(exist_ok=True)
    assert hub_cli(["push", str(work / "empty"), "alice/x"]) == 2
    assert "holds neither adapter_config.json" in capsys.readouterr().err
    assert hub_cli(["push", str(work / "empty"), "not a repo id"]) == 2


# ----------------------------------------------------------------------------------------------------------------------
# symbolic links out of the output folder (issue 23 item 4)
# ----------------------------------------------------------------------------------------------------------------------
SECRET = b"a file outside the output folder: 7d1f0c9e-never-uploaded"


def linked_output(trained, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the training output with links out of it (a file, a folder, a tokenizer file and the chat templates
    folder, which staging copies by name) and one link inside it (tokenizer_config.json, which must be followed)."""
    import shutil

    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "chat_template.jinja").write_bytes(b"{{ '" + SECRET + b"' }}")
    (outside / "dir" / "extra.jinja").write_bytes(SECRET)
    out = tmp_path / "output"
    shutil.copytree(trained["dir"], out, ignore=shutil.ignore_patterns("checkpoint-*", "training_args.bin"))
    (out / "secret.txt").symlink_to(outside / "secret.txt")
    (out / "extra_dir").symlink_to(outside / "dir", target_is_directory=True)
    (out / "chat_template.jinja").symlink_to(outside / "chat_template.jinja")
    (out / "additional_chat_templates").symlink_to(outside / "dir", target_is_directory=True)
    (out / "inner").mkdir()
    (out / "tokenizer_config.json").rename(out / "inner" / "tokenizer_config.json")
    (out / "tokenizer_config.json").symlink_to(Path("inner") / "tokenizer_config.json")
    return out, outside


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_push_never_follows_a_link_out_of_the_output_folder(mode, hub, trained, pushed, tmp_path, monkeypatch,
                                                             caplog, capsys):
    import huggingface_hub.constants as hf_constants

    from hf_lisa.cli import main

    out, outside = linked_output(trained, tmp_path)
    repo = f"alice/linked-{mode}"
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    with caplog.at_level(logging.WARNING, logger="hf_lisa"):
        assert main(["push", str(out), repo, "--mode", mode, "--token", WRITE_TOKEN]) == 0, capsys.readouterr().err
    files = hub.files(repo)
    assert not [f for f in files if f.startswith(("secret", "extra_dir", "additional_chat_templates", "chat_template"))]
    assert not [sha for sha, data in hub.state.objects.items() if SECRET in data], "an outside file was uploaded"
    # the link inside the folder is followed: the tokenizer config is there, with its content
    assert files["tokenizer_config.json"] == (out / "inner" / "tokenizer_config.json").read_bytes()
    for link, target in (("secret.txt", outside / "secret.txt"), ("extra_dir", outside / "dir"),
                         ("chat_template.jinja", outside / "chat_template.jinja"),
                         ("additional_chat_templates", outside / "dir")):
        assert f"Skipping {link} -> {target}" in caplog.text, caplog.text


def test_push_refuses_weights_behind_a_link_out_of_the_folder(hub, trained, tmp_path, monkeypatch, capsys):
    import shutil

    import huggingface_hub.constants as hf_constants

    from hf_lisa.cli import main

    out, outside = linked_output(trained, tmp_path)
    shutil.move(out / "adapter_model.safetensors", outside / "adapter_model.safetensors")
    (out / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    requests = len(hub.state.requests)
    for mode in ("adapter", "merged"):
        assert main(["push", str(out), "alice/linked-weights", "--mode", mode, "--token", WRITE_TOKEN]) == 2
        err = capsys.readouterr().err
        assert f"adapter_model.safetensors in {str(out)!r} is a symbolic link to " in err, err
        assert str(outside / "adapter_model.safetensors") in err
    assert len(hub.state.requests) == requests and not hub.has_repo("alice/linked-weights")


# ----------------------------------------------------------------------------------------------------------------------
# an adapter whose base model is a local folder (issue 23 item 14)
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_base_push(hub, trained, base_dir, pushed, work):
    """An adapter folder as training saves it, without training_summary.json: its config names the local base_dir and
    no Hub id is known. Pushed without --base_model (refused), then with it."""
    import contextlib
    import io
    import shutil

    import huggingface_hub.constants as hf_constants

    from hf_lisa.cli import main

    folder = work / "local-base"
    folder.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(trained["dir"] / name, folder / name)
    result = {"folder": folder, "recorded": json.loads((folder / "adapter_config.json").read_text())[
        "base_model_name_or_path"]}
    requests = len(hub.state.requests)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(io.StringIO()) as err:
        mp.setattr(hf_constants, "ENDPOINT", hub.url)
        result["refused_status"] = main(["push", str(folder), "alice/local-base", "--token", WRITE_TOKEN])
        result["refused_err"] = err.getvalue()
        result["requests_after_refusal"] = len(hub.state.requests) - requests
        result["repo_after_refusal"] = hub.has_repo("alice/local-base")
        for what, source in (("api_dir", folder), ("api_model", trained["model"])):
            try:
                push_to_hub(source, "alice/local-base", token=WRITE_TOKEN, endpoint=hub.url)
                result[what] = None
            except Exception as exc:  # noqa: BLE001 - recorded for the test to check its type and message
                result[what] = exc
        result["pushed_status"] = main(["push", str(folder), "alice/local-base", "--token", WRITE_TOKEN,
                                        "--base_model", BASE_REPO])
    return result


def test_adapter_on_a_local_base_is_refused_without_a_hub_id(hub, local_base_push, base_dir):
    from hf_lisa.errors import UsageError

    result = local_base_push
    assert result["recorded"] == str(base_dir)  # what training recorded: a folder nobody else has
    assert result["refused_status"] == 2
    err = result["refused_err"]
    assert "--base_model namespace/name" in err and repr(str(base_dir)) in err and "Nothing was uploaded" in err
    assert result["requests_after_refusal"] == 0 and result["repo_after_refusal"] is False
    for what in ("api_dir", "api_model"):  # push_to_hub refuses the folder and the PeftModel alike
        assert isinstance(result[what], UsageError) and "base_model='namespace/name'" in str(result[what]), what
    # with the Hub id: one commit, and the uploaded config names it
    assert result["pushed_status"] == 0
    assert len(hub.commits("alice/local-base")) == 2
    files = hub.files("alice/local-base")
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == BASE_REPO
    assert "base_model: lisa-org/tiny-llama" in files["README.md"].decode()


@pytest.mark.slow  # loads the pushed adapter in a fresh python process
def test_adapter_pushed_with_its_hub_base_loads_from_the_hub(hub, local_base_push, trained, work):
    assert local_base_push["pushed_status"] == 0
    out = work / "local_base_logits.json"
    code = ("import json, sys, torch, hf_lisa; model = hf_lisa.from_pretrained('alice/local-base').eval()\n"
            "with torch.no_grad(): logits = model(torch.tensor(json.loads(sys.argv[1]))).logits\n"
            "json.dump(logits.tolist(), open(sys.argv[2], 'w'))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(INPUT_IDS), str(out)],
                          env=subprocess_env(hub, work), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert close(json.loads(out.read_text()), trained["logits"], atol=1e-6)


def test_train_push_to_hub_of_an_adapter_on_a_local_base_is_refused_before_training(base_dir, tmp_path):
    from hf_lisa.errors import UsageError
    from hf_lisa.train import parse_args

    argv = ["--method", "lisa-adapter", "--model_name_or_path", str(base_dir), "--output_dir", str(tmp_path / "out"),
            "--push_to_hub", "true", "--hub_model_id", "alice/x", "--report_to", "none"]
    with pytest.raises(UsageError, match=r"--push_to_hub: .*local folder .*--base_model_id namespace/name"):
        parse_args(argv)
    assert not (tmp_path / "out").exists()
    parse_args(argv + ["--base_model_id", BASE_REPO])  # the Hub id given: accepted
    parse_args(argv + ["--push_mode", "merged"])  # merged weights need no base to load


# ----------------------------------------------------------------------------------------------------------------------
# full weights as a pickle: never unpickled by a push (issue 33 item 14)
# ----------------------------------------------------------------------------------------------------------------------
_opened: dict = {"watch": None, "seen": []}


def _record_opens(event, args):
    if _opened["watch"] is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if os.path.basename(os.fsdecode(args[0])) in _opened["watch"]:
            _opened["seen"].append(os.fsdecode(args[0]))


def opened_files(*names: str) -> list:
    """The paths this process opens from now on whose file name is one of ``names`` (an audit hook; hooks cannot be
    removed, so it stays installed and records only while watching)."""
    if not getattr(sys, "_hf_lisa_test_open_hook", False):
        sys.addaudithook(_record_opens)
        sys._hf_lisa_test_open_hook = True
    _opened.update(watch=set(names), seen=[])
    return _opened["seen"]


@pytest.mark.parametrize("mode", [None, "merged"])
def test_push_never_unpickles_full_weights_and_names_the_file(mode, hub, tmp_path, monkeypatch, capsys):
    """A full-weights folder with only ``pytorch_model.bin`` was loaded with transformers to convert it: only torch's
    ``weights_only`` default stopped the payload. The push now refuses before opening the file, naming it and how to
    convert it."""
    import huggingface_hub.constants as hf_constants

    from pickle_payload import save_pickled_full_model

    from hf_lisa.cli import main

    folder, marker = tmp_path / "full", tmp_path / "payload-ran"
    weights = save_pickled_full_model(folder, marker, tiny_llama(), tiny_tokenizer())
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    requests = len(hub.state.requests)
    seen = opened_files("pytorch_model.bin")
    try:
        status = main(["push", str(folder), "alice/pickled-full", "--token", WRITE_TOKEN]
                      + (["--mode", mode] if mode else []))
    finally:
        _opened["watch"] = None
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"{str(folder)!r} holds its weights only as pickle (pytorch_model.bin)" in err, err
    assert "never unpickles" in err and "save_pretrained" in err and "weights_only" not in err, err
    assert seen == [], f"the push opened the pickle: {seen}"
    assert not marker.exists()
    assert len(hub.state.requests) == requests and not hub.has_repo("alice/pickled-full")
    torch.load(weights, weights_only=False)  # the payload is live: unpickled, it runs
    assert marker.exists()


def test_push_of_full_weights_reads_only_the_safetensors_beside_a_pickle(hub, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hf_constants

    from pickle_payload import save_pickled_full_model

    from hf_lisa.cli import main

    folder, marker = tmp_path / "full", tmp_path / "payload-ran"
    model = tiny_llama(seed=3)
    save_pickled_full_model(folder, marker, model, tiny_tokenizer())
    model.save_pretrained(folder)  # model.safetensors beside the pickle
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    seen = opened_files("pytorch_model.bin")
    try:
        status = main(["push", str(folder), "alice/full-beside-pickle", "--token", WRITE_TOKEN])
    finally:
        _opened["watch"] = None
    assert status == 0, capsys.readouterr().err
    assert seen == [] and not marker.exists()
    files = hub.files("alice/full-beside-pickle")
    assert "model.safetensors" in files and not [name for name in files if name.endswith(PICKLE_SUFFIXES)]


def test_push_dry_run_prints_the_files_and_card_and_sends_nothing(hub, trained, capsys, monkeypatch):
    """Issue 36 item 6: ``hf-lisa push --dry_run`` shows what a push would upload (file list, the card) without a
    token and without a single request, and refuses what a real push refuses."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    before = len(hub.state.requests)
    assert hub_cli(["push", str(trained["dir"]), "alice/dry-run", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert len(hub.state.requests) == before  # nothing reached the server, not even a lookup
    assert "dry run: nothing was uploaded" in out and "to alice/dry-run (adapter)" in out
    listed = [line.split()[0] for line in out.split("README.md (the model card):")[0].splitlines()
              if line.startswith("  ")]
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "loss.png"} <= set(listed)
    assert not [name for name in listed if name.endswith((".bin", ".pt"))]  # the output dir holds both
    assert f"base_model: {BASE_REPO}" in out and "library_name: peft" in out
    assert ("model", "alice/dry-run") not in hub.state.repos
