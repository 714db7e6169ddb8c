"""The LISA adapter's PEFT requirement is checked when an adapter is made, not at install time: on a PEFT older than
0.21 (axolotl 0.19 pins 0.20.0, LLaMA-Factory 0.9.5 0.18.x) the adapter is refused with what to do, and full-parameter
LISA still trains. These run in every lane of `make test-compat` (tests/compat/run_lane.sh) and in `make test`."""

from __future__ import annotations

import pytest
import torch

from hf_lisa.tuner.peft_type import PeftTooOldError, installed_peft_version, peft_is_supported


@pytest.mark.parametrize(("version", "supported"), [
    ("0.18.0", False), ("0.18.1", False), ("0.20.0", False), ("0.21.0", True), ("0.21.2", True), ("0.22.0rc1", True),
    ("0.21.0.dev0", True), ("1.0", True), ("0.9.0", False),
])
def test_which_peft_versions_run_the_adapter(version, supported):
    assert peft_is_supported(version) is supported


def test_an_adapter_on_an_old_peft_is_refused_with_the_versions_and_the_way_out(tiny_llama):
    if peft_is_supported():
        pytest.skip(f"peft {installed_peft_version()} runs the adapter")
    from peft import get_peft_model

    from hf_lisa import LisaConfig

    with pytest.raises(PeftTooOldError) as refused:
        get_peft_model(tiny_llama(), LisaConfig(r=4, sparsity=0.5, mask_init="random", target_modules=["q_proj"]))
    message = str(refused.value)
    assert f"peft {installed_peft_version()} is installed" in message and "peft>=0.21" in message
    assert "hf-lisa train --method lisa" in message


def test_full_parameter_lisa_trains_on_the_installed_peft(tiny_llama, token_dataset, training_args):
    from transformers import Trainer

    from hf_lisa.trainer_callbacks import LisaCallback

    model = tiny_llama(num_layers=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = LisaCallback(lisa_activated_layers=1, lisa_interval_steps=100, seed=0)
    Trainer(model=model, args=training_args(max_steps=2), train_dataset=token_dataset(), callbacks=[callback]).train()
    moved_blocks = {n.split(".")[2] for n, p in model.named_parameters()
                    if n.startswith("model.layers.") and not torch.equal(before[n], p)}
    assert len(moved_blocks) == 1  # γ = 1, one interval
    assert not torch.equal(before["model.embed_tokens.weight"], model.model.embed_tokens.weight)
