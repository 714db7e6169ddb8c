"""``hf-lisa chat`` / ``generate`` (and the loading that ``export`` shares) against bad inputs and faults (issue 33):
the output never lands on a file of what was loaded, an adapter whose weights do not fit its config is refused, a
relative base path is read from the adapter's folder, a killed run's staged output is removed by the next run, a chat
template's rendering is bounded, and what still reached users raw (non-UTF-8 input, a full disk, pickles, custom code,
a bad recorded base) ends in one line naming the file, line or option.

Fast tests drive ``hf_lisa.cli.main`` in this process on the tiny llama of ``train_fixtures``; the ``slow`` ones start
real processes (a SIGKILLed ``generate``, a full tmpfs, bytes that are not UTF-8 on a real stdin).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_lisa import cli
from test_chat_generate import ADAPTERS, GREEDY, greedy_reply, read_lines, run_cli, save_adapter
from train_fixtures import build_tiny_lm_dir, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

HF_LISA = str(Path(sys.executable).with_name("hf-lisa"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's folder, a LISA and a LoRA adapter on it (with their PeftModels), and a prompts file."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("serving")
    model = build_tiny_lm_dir(root / "model")
    lisa = save_adapter(model, ADAPTERS["lisa-dense"](), root / "lisa")
    lora = save_adapter(model, ADAPTERS["lora"](), root / "lora", seed=3)
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": "say a"}, {"prompt": "hi"}])
    return {"root": root, "model": model, "lisa": lisa, "lora": lora, "prompts": prompts,
            "tokenizer": AutoTokenizer.from_pretrained(model)}


def _copy(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def _config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------------------------------
# item 2: generate never writes into what it loaded
# ----------------------------------------------------------------------------------------------------------------------
def _output_cases(tiny, tmp_path):
    from huggingface_hub.constants import HF_HUB_CACHE

    model = _copy(tiny["model"], tmp_path / "model")
    adapter = _copy(tiny["root"] / "lora", tmp_path / "adapter")
    _config(adapter, base_model_name_or_path=str(model))
    os.link(model / "model.safetensors", tmp_path / "hardlink.safetensors")
    os.symlink(adapter / "adapter_model.safetensors", tmp_path / "symlink.safetensors")
    os.symlink(model, tmp_path / "model-link")
    return model, adapter, {
        "a weights file of the model": ([str(model)], model / "model.safetensors", "is a file of the model"),
        "its config": ([str(model)], model / "config.json", "is a file of the model"),
        "through a folder link": ([str(model)], tmp_path / "model-link" / "model.safetensors",
                                  "is a file of the model"),
        "a hard link of its weights": ([str(model)], tmp_path / "hardlink.safetensors", "is the same file as"),
        "a new config in the model": ([str(model)], model / "generation_config2.json", "would be a new non-.jsonl"),
        "the adapter's weights": ([str(adapter)], adapter / "adapter_model.safetensors", "is a file of the adapter"),
        "a symlink to the adapter's weights": ([str(adapter)], tmp_path / "symlink.safetensors",
                                              "is a file of the adapter"),
        "its base's weights": ([str(adapter)], model / "model.safetensors", "is a file of its base"),
        "--base's weights": (["--adapter", str(adapter), "--base", str(model)], model / "model.safetensors",
                             "is a file of its base"),
        "the Hub cache": ([str(model)], Path(HF_HUB_CACHE) / "models--hf-lisa-test" / "gen.jsonl",
                          "is in the Hugging Face cache"),
    }


def test_generate_refuses_to_write_into_a_file_of_the_model_the_adapter_or_its_base(tiny, tmp_path, capsys):
    from huggingface_hub.constants import HF_HUB_CACHE

    model, adapter, cases = _output_cases(tiny, tmp_path)
    before = {path: path.read_bytes() for folder in (model, adapter) for path in folder.iterdir()}
    for name, (source, output, message) in cases.items():
        status, stdout, err = run_cli(["generate", *source, "--prompts", tiny["prompts"], "--output", str(output),
                                       "--overwrite", *GREEDY], capsys)
        assert status == 2, (name, err)
        assert f"--output={str(output)!r} {message}" in err and "choose a path outside it" in err, (name, err)
        assert stdout == ""
    assert {path: path.read_bytes() for folder in (model, adapter) for path in folder.iterdir()} == before
    assert not list(tmp_path.rglob(".partial-*")) and not (Path(HF_HUB_CACHE) / "models--hf-lisa-test").exists()


def test_a_new_jsonl_file_inside_the_model_folder_is_still_allowed(tiny, tmp_path, capsys):
    model = _copy(tiny["model"], tmp_path / "model")
    status, _, err = run_cli(["generate", str(model), "--prompts", tiny["prompts"], "--output",
                              str(model / "generations.jsonl"), *GREEDY], capsys)
    assert status == 0, err
    assert len(read_lines(model / "generations.jsonl")) == 2


# ----------------------------------------------------------------------------------------------------------------------
# item 6: adapter weights that do not fit their config are refused (chat, generate, and export's loading)
# ----------------------------------------------------------------------------------------------------------------------
def _mislabelled(tiny, tmp_path):
    lora_config = json.loads((tiny["root"] / "lora" / "adapter_config.json").read_text())
    lisa_config = json.loads((tiny["root"] / "lisa" / "adapter_config.json").read_text())
    lisa_as_lora = _copy(tiny["root"] / "lisa", tmp_path / "lisa-as-lora")
    (lisa_as_lora / "adapter_config.json").write_text(json.dumps(lora_config))
    lora_as_lisa = _copy(tiny["root"] / "lora", tmp_path / "lora-as-lisa")
    (lora_as_lisa / "adapter_config.json").write_text(json.dumps(lisa_config))
    fewer = _copy(tiny["root"] / "lora", tmp_path / "fewer-modules")  # the file has v_proj too: 6 tensors fit nowhere
    _config(fewer, target_modules=["q_proj"])
    more = _copy(tiny["root"] / "lora", tmp_path / "more-modules")  # k_proj's 6 weights are in no file
    _config(more, target_modules=["q_proj", "k_proj", "v_proj"])
    return {
        lisa_as_lora: ("peft_type LORA", "12 of the 12 weights its config builds are not in the file",
                       "12 of the file's 12 tensors fit no weight", "lisa_A.weight"),
        lora_as_lisa: ("peft_type LISA", "weights its config builds are not in the file", "lora_A.weight"),
        fewer: ("6 of the file's 12 tensors fit no weight of the model", "v_proj.lora_A.weight"),
        more: ("6 of the 18 weights its config builds are not in the file", "k_proj.lora_A.default.weight"),
    }


def test_an_adapter_whose_weights_do_not_fit_its_config_is_refused_naming_file_counts_and_keys(tiny, tmp_path,
                                                                                                 capsys):
    for adapter, expected in _mislabelled(tiny, tmp_path).items():
        status, stdout, err = run_cli(["generate", str(adapter), "--prompts", tiny["prompts"], "--output", "-",
                                       *GREEDY], capsys)
        assert status == 2, (adapter.name, err)
        line = _last_line(err)
        assert line.startswith(f"hf-lisa generate: error: the adapter weights "
                               f"{str(adapter / 'adapter_model.safetensors')!r} do not match "
                               f"{str(adapter / 'adapter_config.json')!r}"), line
        for part in expected:
            assert part in line, (adapter.name, part, line)
        assert stdout == "" and "Found missing adapter keys" not in err


def test_chat_and_the_library_loader_that_export_uses_refuse_a_mislabelled_adapter_too(tiny, tmp_path, capsys):
    import hf_lisa
    from hf_lisa.errors import UsageError

    adapter = next(iter(_mislabelled(tiny, tmp_path)))
    status, stdout, err = run_cli(["chat", str(adapter), *GREEDY], capsys, stdin="say a\n")
    assert status == 2 and stdout == "" and "do not match" in _last_line(err), err
    with pytest.raises(UsageError, match="12 of the 12 weights its config builds are not in the file"):
        hf_lisa.from_pretrained(str(adapter))


def test_a_matching_adapter_still_serves_its_own_replies(tiny, tmp_path, capsys):
    status, stdout, err = run_cli(["generate", str(tiny["root"] / "lisa"), "--prompts", tiny["prompts"], "--output",
                                   "-", *GREEDY], capsys)
    assert status == 0, err
    expected = [greedy_reply(tiny["lisa"], tiny["tokenizer"], p) for p in ("say a", "hi")]
    assert [json.loads(line)["generation"] for line in stdout.splitlines()] == expected


# ----------------------------------------------------------------------------------------------------------------------
# item 16 and item 12 (a bad recorded base): the base an adapter records
# ----------------------------------------------------------------------------------------------------------------------
def test_a_relative_base_path_is_read_from_the_adapters_folder_not_the_current_directory(tiny, tmp_path, capsys,
                                                                                         monkeypatch):
    import hf_lisa

    project = tmp_path / "project"
    _copy(tiny["model"], project / "base")
    adapter = _copy(tiny["root"] / "lora", project / "adapter")
    _config(adapter, base_model_name_or_path="../base")
    elsewhere = tmp_path / "elsewhere" / "cwd"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)  # no ../base here
    status, stdout, err = run_cli(["generate", str(adapter), "--prompts", tiny["prompts"], "--output", "-", *GREEDY],
                                  capsys)
    assert status == 0, err
    expected = [greedy_reply(tiny["lora"], tiny["tokenizer"], p) for p in ("say a", "hi")]
    assert [json.loads(line)["generation"] for line in stdout.splitlines()] == expected
    assert f"on {project / 'base'}" in err
    model = hf_lisa.from_pretrained(str(adapter))  # the loading export uses
    assert model.peft_config["default"].base_model_name_or_path == "../base"


def test_a_relative_base_path_found_only_from_the_current_directory_is_refused_naming_it(tiny, tmp_path, capsys,
                                                                                        monkeypatch):
    import hf_lisa
    from hf_lisa.errors import UsageError

    adapter = _copy(tiny["root"] / "lora", tmp_path / "shared" / "adapter")
    _config(adapter, base_model_name_or_path="../base")
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    _copy(tiny["model"], tmp_path / "work" / "base")  # ../base from the current directory: some other model
    monkeypatch.chdir(cwd)
    status, stdout, err = run_cli(["generate", str(adapter), "--prompts", tiny["prompts"], "--output", "-", *GREEDY],
                                  capsys)
    assert status == 2 and stdout == "", err
    line = _last_line(err)
    assert f"records base_model_name_or_path='../base', a relative path that is not a folder beside the adapter " \
           f"({str(tmp_path / 'shared' / 'base')!r}); it is one in the current directory " \
           f"({str(tmp_path / 'work' / 'base')!r}), but hf-lisa never resolves" in line, line
    assert str(adapter / "adapter_config.json") in line and "--base BASE" in line
    with pytest.raises(UsageError, match="never resolves an adapter's base against the current directory"):
        hf_lisa.from_pretrained(str(adapter))


@pytest.mark.parametrize("recorded, why", [(42, "42, which names no model"), ("", "'', which names no model"),
                                           ("../../gone/base", "'../../gone/base', a relative path that is not a "
                                            "folder beside the adapter")])
def test_a_bad_recorded_base_names_the_adapter_file_and_the_value(tiny, tmp_path, capsys, recorded, why):
    adapter = _copy(tiny["root"] / "lora", tmp_path / "adapter")
    _config(adapter, base_model_name_or_path=recorded)
    for argv in (["chat", str(adapter), *GREEDY], ["generate", str(adapter), "--prompts", tiny["prompts"], "--output",
                                                   "-", *GREEDY]):
        status, _, err = run_cli(argv, capsys, stdin="hi\n")
        assert status == 2, err
        line = _last_line(err)
        assert f"records base_model_name_or_path={why}" in line and str(adapter / "adapter_config.json") in line, line
        assert "--base BASE" in line and len(err.strip().splitlines()) == 1, err


def test_a_recorded_base_folder_that_is_no_model_names_the_adapter_file(tiny, tmp_path, capsys):
    adapter = _copy(tiny["root"] / "lora", tmp_path / "adapter")
    (tmp_path / "not-a-model").mkdir()
    _config(adapter, base_model_name_or_path=str(tmp_path / "not-a-model"))
    status, _, err = run_cli(["generate", str(adapter), "--prompts", tiny["prompts"], "--output", "-", *GREEDY], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert _last_line(err).startswith(
        f"hf-lisa generate: error: the base model {str(tmp_path / 'not-a-model')!r} (recorded in "
        f"{str(adapter / 'adapter_config.json')!r}) does not load ("), err
    assert "chat/generate --base, export --base_model" in err


# ----------------------------------------------------------------------------------------------------------------------
# item 15: a chat template renders bounded in time and size, and its errors name it and where it came from
# ----------------------------------------------------------------------------------------------------------------------
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}")
HUGE_OUTPUT = "{% for a in range(100000) %}{{ 'x' * 100 }}{% endfor %}{{ messages[0]['content'] }}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("template, message", [
    (NESTED_LOOPS, "did not finish rendering a prompt within 1 s (a loop that runs too long?), so it was stopped"),
    (HUGE_OUTPUT, "rendered a prompt of 10,000,005 characters (more than 4,000,000)"),
    ("{{ raise_exception('no system turns here') }}", "fails on this prompt (TemplateError: no system turns here)"),
], ids=["nested loops", "huge output", "raises"])
def test_an_adapters_own_chat_template_renders_bounded_and_is_named(tiny, tmp_path, capsys, monkeypatch, template,
                                                                    message):
    from hf_lisa import generate_guards

    monkeypatch.setattr(generate_guards, "RENDER_SECONDS", 1.0)  # the bound itself, shortened for the test
    adapter = _copy(tiny["root"] / "lora", tmp_path / "adapter")
    (adapter / "chat_template.jinja").write_text(template)
    started, handler, alarm = time.monotonic(), signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    for argv in (["generate", str(adapter), "--prompts", tiny["prompts"], "--output", str(tmp_path / "o.jsonl")],
                 ["chat", str(adapter)]):
        status, stdout, err = run_cli([*argv, *GREEDY], capsys, stdin="say a\n")
        assert status == 2 and stdout == "", err
        line = _last_line(err)
        assert f"the tokenizer's chat template {str(adapter / 'chat_template.jinja')!r} {message}" in line, line
        assert "pass --chat_template with another template" in line
    assert time.monotonic() - started < 120
    assert not (tmp_path / "o.jsonl").exists()
    assert signal.getsignal(signal.SIGALRM) is handler  # and an alarm that was set (pytest-timeout's) is set again
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    assert (0 < left <= alarm[0]) if alarm[0] > 0 else left == 0, (alarm, left)


def test_a_template_given_with_chat_template_is_named_as_that_option(tiny, tmp_path, capsys, monkeypatch):
    from hf_lisa import generate_guards

    monkeypatch.setattr(generate_guards, "RENDER_SECONDS", 1.0)
    template = tmp_path / "slow.jinja"
    template.write_text(NESTED_LOOPS)
    status, _, err = run_cli(["generate", tiny["model"], "--prompts", tiny["prompts"], "--output", "-",
                              "--chat_template", str(template), *GREEDY], capsys)
    assert status == 2
    assert f"the chat template --chat_template={str(template)!r} did not finish rendering" in _last_line(err)


# ----------------------------------------------------------------------------------------------------------------------
# item 13a: what a killed generate left, the next run removes (only that)
# ----------------------------------------------------------------------------------------------------------------------
KILLED_WRITER = """
import os, sys
from hf_lisa.generate_guards import staged_output
with staged_output(sys.argv[1]) as out:
    out.write('{"half": "a line'); out.flush()
    os.kill(os.getpid(), 9)
"""
LIVE_WRITER = """
import sys, time
from hf_lisa.generate_guards import staged_output
with staged_output(sys.argv[1]) as out:
    out.write('x'); out.flush(); print('ready', flush=True); time.sleep(600)
"""


@pytest.mark.slow  # starts the processes that write (one killed, one alive)
def test_staged_outputs_of_killed_runs_are_removed_and_nothing_else(tmp_path):
    from hf_lisa.generate_guards import remove_stale_partials

    folder = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(folder / "gen.jsonl")])
    assert killed.returncode == -signal.SIGKILL
    [left] = folder.glob(".partial-generate-gen-*.jsonl")
    foreign = [folder / ".partial-gen-abc123.jsonl", folder / ".partial-generate-mine.jsonl", folder / "gen.jsonl",
               folder / ".partial-generate-x-1-zzzzzzzz.jsonl"]
    for path in foreign:
        path.write_text("not hf-lisa's to remove\n")
    live = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(folder / "other.jsonl")], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert live.stdout.readline().strip() == "ready"  # a later run into the same folder, still writing
        [running] = folder.glob(".partial-generate-other-*.jsonl")
        assert not left.exists() and all(path.exists() for path in foreign)
        assert remove_stale_partials(str(folder)) == [] and running.exists()  # its writer runs
    finally:
        live.kill()
        live.wait()
    assert remove_stale_partials(str(folder)) == [str(running)]  # its writer gone, its lock released


@pytest.mark.slow  # a real hf-lisa generate killed with SIGKILL while it writes
def test_a_sigkilled_generate_leaves_a_partial_that_the_next_run_removes(tiny, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    prompts = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"prompt {i}"} for i in range(4000)])
    process = subprocess.Popen([HF_LISA, "generate", tiny["model"], "--prompts", prompts, "--output", str(out),
                                "--batch_size", "1", *GREEDY], stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob(".partial-*")) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert list(tmp_path.glob(".partial-*")), "the run never started writing"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert list(tmp_path.glob(".partial-*")) and not out.exists()
    status, _, err = run_cli(["generate", tiny["model"], "--prompts", tiny["prompts"], "--output", str(out),
                              *GREEDY], capsys)
    assert status == 0, err
    assert not list(tmp_path.glob(".partial-*")) and len(read_lines(out)) == 2


# ----------------------------------------------------------------------------------------------------------------------
# item 12: text that is not UTF-8
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, where", [
    ("p.jsonl", b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n', "line 2: not UTF-8 text (byte 0xe9 at column 16)"),
    ("p.txt", b"fine\n\nbad \xff\xfe here\n", "line 3: not UTF-8 text (byte 0xff at column 5)"),
])
def test_a_prompts_file_that_is_not_utf8_names_the_file_and_line(tiny, tmp_path, capsys, name, content, where):
    path = tmp_path / name
    path.write_bytes(content)
    status, _, err = run_cli(["generate", tiny["model"], "--prompts", str(path), "--output", "-", *GREEDY], capsys)
    assert status == 2
    assert _last_line(err) == f"hf-lisa generate: error: --prompts={str(path)!r}, {where}; save the file as UTF-8."


def test_a_prompts_file_with_a_utf8_byte_order_mark_reads(tiny, tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "say a"}\n')
    status, stdout, err = run_cli(["generate", tiny["model"], "--prompts", str(path), "--output", "-", *GREEDY],
                                  capsys)
    assert status == 0, err
    assert json.loads(stdout)["prompt"] == "say a"


def test_chat_skips_a_line_that_is_not_utf8_with_a_note_and_goes_on(tiny, capsys):
    # what sys.stdin (reconfigured with surrogateescape by the command) gives for the bytes b"\xff\xfe hi"
    undecodable = b"\xff\xfe hi".decode("utf-8", "surrogateescape")
    status, stdout, err = run_cli(["chat", tiny["model"], *GREEDY], capsys, stdin=f"say a\n{undecodable}\n/reset\nhi\n")
    assert status == 0, err
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny["model"]).eval()
    assert stdout == "".join(greedy_reply(model, tiny["tokenizer"], p) + "\n" for p in ("say a", "hi"))
    assert "line 2 of the input is not UTF-8 text (undecodable bytes); it was skipped: send it again as UTF-8." in err


@pytest.mark.slow  # the real hf-lisa command, its stdin a pipe of raw bytes
def test_chat_with_non_utf8_bytes_on_a_real_stdin_keeps_the_session(tiny):
    result = subprocess.run([HF_LISA, "chat", tiny["model"], *GREEDY], input=b"\xff\xfe\nsay a\n",
                            capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": ""})
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "line 1 of the input is not UTF-8 text" in err and "TypeError" not in err
    assert len(result.stdout.decode().splitlines()) == 1


# ----------------------------------------------------------------------------------------------------------------------
# item 12: a full disk names --output
# ----------------------------------------------------------------------------------------------------------------------
def _tiny_tmpfs_available(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=16k tmpfs {probe}"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.slow  # a real full file system: a 16 KiB tmpfs in a user namespace
def test_a_full_disk_during_generate_names_output_and_leaves_nothing(tiny, tmp_path):
    if not _tiny_tmpfs_available(tmp_path):
        pytest.skip("no unprivileged mount namespace (unshare -rm) here to make a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    prompts = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "say a", "pad": "y" * 2000} for _ in range(40)])
    out = disk / "gen.jsonl"
    script = (f"mount -t tmpfs -o size=16k tmpfs {disk} && {HF_LISA} generate {tiny['model']} --prompts {prompts} "
              f"--output {out} {' '.join(GREEDY)}; status=$?; ls -A {disk}; exit $status")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stderr
    assert _last_line(result.stderr) == (
        f"hf-lisa generate: error: no space left on the device while writing --output={str(out)!r} (staged beside it, "
        "so nothing was replaced): free some space, or choose another --output, and run again.")
    assert result.stdout.strip() == ""  # the folder on the full disk is empty: no half file, no staged file


@pytest.mark.slow  # the real command with its stdout on /dev/full
def test_a_full_stdout_names_stdout(tiny, tmp_path):
    with open("/dev/full", "w") as full:
        result = subprocess.run([HF_LISA, "generate", tiny["model"], "--prompts", tiny["prompts"], "--output", "-",
                                 *GREEDY], stdout=full, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert "no space left on the device while writing stdout" in result.stderr and "--output_dir" not in result.stderr


# ----------------------------------------------------------------------------------------------------------------------
# item 12: pickles and custom code are refused in one line, and nothing of theirs runs
# ----------------------------------------------------------------------------------------------------------------------
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def unsafe(tiny, tmp_path):
    """Folders whose loading would run code: pickle weights (alone, through a safetensors index, as an adapter's base)
    and a model with custom code; each payload would create ``marker``."""
    marker = tmp_path / "payload-ran"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny["model"]) / name, pickled / name)
    torch.save({"weights": _Payload(marker)}, pickled / "pytorch_model.bin")
    indexed = _copy(pickled, tmp_path / "indexed")
    (indexed / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}}))
    on_pickles = _copy(tiny["root"] / "lora", tmp_path / "adapter-on-pickles")
    _config(on_pickles, base_model_name_or_path=str(pickled))
    custom = _copy(tiny["model"], tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="payload", architectures=["PayloadModel"],
                  auto_map={"AutoConfig": "payload.PayloadConfig", "AutoModelForCausalLM": "payload.PayloadModel"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    custom_tokenizer = _copy(tiny["model"], tmp_path / "custom-tokenizer")
    tokenizer_config = json.loads((custom_tokenizer / "tokenizer_config.json").read_text())
    tokenizer_config.update(tokenizer_class="PayloadTokenizer", auto_map={"AutoTokenizer": ["payload.PayloadTokenizer",
                                                                                            None]})
    (custom_tokenizer / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(custom / "payload.py", custom_tokenizer / "payload.py")
    return {"marker": marker, "pickled": pickled, "indexed": indexed, "on_pickles": on_pickles, "custom": custom,
            "custom_tokenizer": custom_tokenizer}


def test_pickle_weights_are_refused_in_one_line_naming_the_file_and_never_unpickled(tiny, unsafe, capsys):
    cases = {
        "pickled": f"the model {str(unsafe['pickled'])!r} has no model.safetensors, only pickle weights "
                   f"({str(unsafe['pickled'] / 'pytorch_model.bin')!r}), which can run code when loaded",
        "indexed": f"{str(unsafe['indexed'] / 'model.safetensors.index.json')!r} names 'pytorch_model.bin', which is "
                   "not a safetensors file",
        "on_pickles": f"the base model {str(unsafe['pickled'])!r} (recorded in "
                      f"{str(unsafe['on_pickles'] / 'adapter_config.json')!r}) has no model.safetensors, only pickle "
                      f"weights ({str(unsafe['pickled'] / 'pytorch_model.bin')!r})",
    }
    for name, message in cases.items():
        for command in ("generate", "chat"):
            extra = ["--prompts", tiny["prompts"], "--output", "-"] if command == "generate" else []
            status, _, err = run_cli([command, str(unsafe[name]), *extra, *GREEDY], capsys, stdin="hi\n")
            assert status == 2, (name, err)
            assert len(err.strip().splitlines()) == 1, err
            assert message in err and "hf-lisa does not unpickle weights: convert them to safetensors" in err, err
            assert "weights_only" not in err and "allow_pickle" not in err
    assert not unsafe["marker"].exists()


def test_custom_code_is_refused_in_one_line_even_when_stdin_answers_yes(unsafe, tiny, capsys):
    """Before: transformers asked "Do you wish to run the custom code? [y/N]" on stdout and read the answer from stdin,
    so ``printf 'y\\n...' | hf-lisa chat MODEL`` ran the model's (or its tokenizer's) code."""
    messages = {
        "custom": f"directory {str(unsafe['custom'])!r} needs its own Python code to load (custom code named by "
                  "'auto_map' in its config.json or tokenizer_config.json); hf-lisa never runs a model's code: use a "
                  "model whose architecture transformers implements.",
        "custom_tokenizer": f"the tokenizer of {str(unsafe['custom_tokenizer'])!r} needs its own Python code to load "
                            "('auto_map' in its tokenizer_config.json); hf-lisa never runs a model's code: save a "
                            "tokenizer that transformers implements beside the model.",
    }
    for name, message in messages.items():
        for command in ("chat", "generate"):
            extra = ["--prompts", tiny["prompts"], "--output", "-"] if command == "generate" else []
            status, stdout, err = run_cli([command, str(unsafe[name]), *extra, *GREEDY], capsys, stdin="y\ny\ny\n")
            assert status == 2, err
            assert err.strip().splitlines() == [f"hf-lisa {command}: error: {message}"], err
            assert stdout == ""
    assert not unsafe["marker"].exists()


@pytest.mark.slow  # an hf-lisa train run (one step) before the chat
def test_a_run_trained_with_relative_paths_chats_from_where_it_ran_and_is_refused_elsewhere(tiny, tmp_path, capsys,
                                                                                          monkeypatch):
    """``hf-lisa train --model_name_or_path ./base --output_dir out`` records ``./base`` (PEFT keeps the path as given)
    and the relative ``output_dir``: from the directory it ran in, ``out`` is that folder, so ``./base`` means what it
    meant to the run; from anywhere else the relative base is refused."""
    from train_fixtures import copy_task_rows

    project = tmp_path / "project"
    _copy(tiny["model"], project / "base")
    write_jsonl(project / "train.jsonl", copy_task_rows(8))
    monkeypatch.chdir(project)
    status = cli.main(["train", "--model_name_or_path", "./base", "--train_file", "train.jsonl", "--output_dir", "out",
                       "--method", "lora", "--report_to", "none", "--max_steps", "1", "--save_strategy", "no",
                       "--use_cpu", "true", "--eval_generation_samples", "0", "--disable_tqdm", "true",
                       "--per_device_train_batch_size", "4", "--max_seq_length", "64",
                       "--validation_split_percentage", "0"])
    assert status == 0, capsys.readouterr().err
    assert json.loads((project / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == "./base"
    capsys.readouterr()
    status, stdout, err = run_cli(["chat", "out", *GREEDY], capsys, stdin="say a\n")
    assert status == 0 and len(stdout.splitlines()) == 1, err
    (tmp_path / "elsewhere").mkdir()
    _copy(tiny["model"], tmp_path / "elsewhere" / "base")  # another ./base: never the one loaded
    monkeypatch.chdir(tmp_path / "elsewhere")
    status, _, err = run_cli(["chat", str(project / "out"), *GREEDY], capsys, stdin="say a\n")
    assert status == 2 and "records base_model_name_or_path='./base', a relative path that is not a folder beside " \
                           "the adapter" in err, err
