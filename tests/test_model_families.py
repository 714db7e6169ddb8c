"""The example configs of the model families users fine-tune (``examples/configs/<family>_*.yaml``), each checked on a
tiny random model of its architecture built from the transformers config class (6 blocks, hidden 32):

* the config parses with ``hf-lisa train``'s parser and names its family's Hub model;
* the blocks discovered with its settings are the language model's blocks, in order;
* its target modules (and per-module patterns) exist in that architecture;
* the checks ``hf-lisa train`` runs on the meta device before loading pass;
* a few Trainer steps with the method ``apply_method`` builds from it train exactly what LISA says: the sampled blocks
  (and E+H+norm) in full-parameter LISA, the sampled blocks' adapters only for LISA adapters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Trainer

from conftest import TokenDataset, build_training_args
from hf_lisa.blocks import find_blocks
from hf_lisa.methods import get_method
from hf_lisa.train import parse_args
from hf_lisa.train.parsing.arguments import lisa_config_kwargs
from hf_lisa.train.methods import apply_method
from hf_lisa.train.preflight import check_on_meta_model
from hf_lisa.trainer_callbacks import LisaAdapterCallback, LisaCallback

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
NUM_BLOCKS = 6
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma3_config():
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=14)
    return transformers.Gemma3Config(text_config={**TEXT, "head_dim": 8}, vision_config=vision, mm_tokens_per_image=4)


#: config file -> (its Hub model, the transformers config of a tiny model of that architecture, its block prefix)
FAMILIES = {
    "llama3_lisa": ("meta-llama/Llama-3.1-8B-Instruct", lambda: transformers.LlamaConfig(**TEXT), "model.layers"),
    "qwen2_5_lisa": ("Qwen/Qwen2.5-7B-Instruct", lambda: transformers.Qwen2Config(**TEXT), "model.layers"),
    "qwen3_lisa_adapter": ("Qwen/Qwen3-8B", lambda: transformers.Qwen3Config(**TEXT, head_dim=8), "model.layers"),
    "mistral_lisa": ("mistralai/Mistral-7B-Instruct-v0.3", lambda: transformers.MistralConfig(**TEXT), "model.layers"),
    "gemma3_lisa": ("google/gemma-3-4b-it", _gemma3_config, "model.language_model.layers"),
    "phi4_lisa_adapter": ("microsoft/Phi-4-mini-instruct", lambda: transformers.Phi3Config(**TEXT), "model.layers"),
}


def tiny(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family][1]())  # the class `hf-lisa train` loads for it


def block_of(name: str, prefix: str):
    marker = prefix.split(".")[-1]  # "layers"
    if f"{prefix}." not in name:
        return None
    return int(name.split(f".{marker}.")[-1].split(".")[0])


@pytest.fixture(params=list(FAMILIES))
def family(request, tmp_path):
    model_args, _, lisa_args, _ = parse_args([str(CONFIGS / f"{request.param}.yaml"), "--output_dir", str(tmp_path)])
    return request.param, model_args, lisa_args


def test_config_names_its_family_and_finds_the_language_blocks(family):
    name, model_args, lisa_args = family
    hub_id, _, prefix = FAMILIES[name]
    assert model_args.model_name_or_path == hub_id
    model = tiny(name)
    blocks = [n for n, _ in find_blocks(model, lisa_args.lisa_layers_attribute)]
    assert blocks == [f"{prefix}.{i}" for i in range(NUM_BLOCKS)]


def test_gemma3_needs_its_block_list_named():
    # without lisa_layers_attribute, discovery also finds the vision tower's blocks: why gemma3_lisa.yaml names it
    discovered = [n for n, _ in find_blocks(tiny("gemma3_lisa"))]
    assert any("vision_tower" in n for n in discovered) and len(discovered) > NUM_BLOCKS


def test_target_modules_exist_in_the_architecture(family):
    name, _, lisa_args = family
    if not get_method(lisa_args.method).is_adapter:
        pytest.skip("full-parameter LISA adapts no module")
    settings = lisa_config_kwargs(lisa_args)
    leaves = {n.rsplit(".", 1)[-1] for n, m in tiny(name).named_modules() if isinstance(m, torch.nn.Linear)}
    missing = set(settings["target_modules"]) - leaves
    assert not missing, f"{name}: {sorted(missing)} are not modules of this architecture ({sorted(leaves)})"
    assert set(settings["sparsity_pattern"]) <= set(settings["target_modules"])


def test_preflight_checks_pass_on_the_meta_model(family):
    name, _, lisa_args = family
    with torch.device("meta"):
        model = tiny(name)
    check_on_meta_model(model, lisa_args, seed=0, label=name)


def test_a_few_lisa_steps_train_exactly_the_sampled_blocks(family, tmp_path):
    name, _, lisa_args = family
    prefix = FAMILIES[name][2]
    lisa_args.lisa_interval_steps = 2  # two periods in 4 steps (the configs' K = 20 is for real runs)
    model, callbacks = apply_method(tiny(name), lisa_args, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=build_training_args(tmp_path, max_steps=4), train_dataset=TokenDataset(),
                      callbacks=callbacks)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    (callback,) = callbacks
    sampled = {b for _, active in callback.layer_scheduler.history for b in active}
    assert 1 <= len(sampled) < NUM_BLOCKS, sampled
    if isinstance(callback, LisaCallback):
        assert {block_of(n, prefix) for n in changed if block_of(n, prefix) is not None} == sampled
        assert all(n in changed for n in before if block_of(n, prefix) in sampled)  # every weight of them trained
        outside = {n for n in changed if block_of(n, prefix) is None}
        assert outside and all("embed_tokens" in n or "norm" in n or "lm_head" in n for n in outside), outside
        assert not any("vision" in n or "multi_modal" in n for n in changed)  # Gemma 3: the vision side stays
    else:
        assert isinstance(callback, LisaAdapterCallback)
        assert all("lisa_" in n for n in changed), sorted(n for n in changed if "lisa_" not in n)
        assert {block_of(n, prefix) for n in changed if ".lisa_B." in n} == sampled


@pytest.mark.parametrize("method", ["lora", "lisa-adapter"])
def test_apply_method_wraps_a_classification_model_with_its_head_trainable(method, tmp_path):
    """``apply_method`` gives PEFT the model's task type (SEQ_CLS here), so PEFT trains and saves the fresh ``score``
    head in full; wrapped as a causal LM, the head would stay frozen at its random init and be lost on save."""
    from peft import PeftModel

    from hf_lisa.train import LisaArguments
    from hf_lisa.trainer.methods import peft_task_type

    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**TEXT, num_labels=3))
    assert peft_task_type(model) == "SEQ_CLS" and peft_task_type(tiny("llama3_lisa")) == "CAUSAL_LM"
    wrapped, _ = apply_method(model, LisaArguments(method=method, r=4, lisa_activated_layers=2), seed=0)
    assert wrapped.peft_config["default"].task_type == "SEQ_CLS"
    head = [n for n, p in wrapped.named_parameters() if p.requires_grad and "score" in n]
    assert head == ["base_model.model.score.modules_to_save.default.weight"]
    with torch.no_grad():
        wrapped.base_model.model.score.modules_to_save["default"].weight.add_(1.0)  # as if trained
    wrapped.save_pretrained(tmp_path)
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.manual_seed(0)  # the same base weights
    reloaded = PeftModel.from_pretrained(
        transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**TEXT, num_labels=3)), tmp_path)
    with torch.no_grad():  # eval mode: a LISA adapter refuses a training forward without its schedule
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, wrapped.eval()(input_ids=ids).logits)
