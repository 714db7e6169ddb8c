"""PEFT's own generic tuner checks (``tests/testing_common.py`` of the installed PEFT's sdist), run on LISA.

``make test`` copies that file from the PEFT sdist into ``$VENV/peft_generic/peft_tests`` (see the Makefile). The
models are tiny Llama (``nn.Linear``) and GPT-2 (``Conv1D``) checkpoints written to a temporary directory, so
``from_pretrained(model_id)`` works offline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import hf_lisa
from tiny_models import tiny_gpt2, tiny_llama

GENERIC_DIR = Path(sys.prefix) / "peft_generic"
if not (GENERIC_DIR / "peft_tests" / "testing_common.py").exists():
    pytest.skip(
        f"PEFT's generic tests are not installed in {GENERIC_DIR}; run `make test` (it fetches them)",
        allow_module_level=True,
    )
sys.path.insert(0, str(GENERIC_DIR))
from peft_tests.testing_common import PeftCommonTester  # noqa: E402

_MODEL_DIRS: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic_models")
    # GPT-2 untied: the safe-merge check saves the merged state dict with safetensors, which refuses shared tensors.
    # The GPT-2 directory avoids "gpt2" in its name: PEFT's helper skips Conv1D checks for methods on its own
    # allow-list, and LISA does support Conv1D
    for name, build in (("llama", lambda: tiny_llama(2)), ("gpt2", lambda: tiny_gpt2(2, tie_word_embeddings=False))):
        path = root / f"tiny-{name.replace('gpt2', 'conv1d')}"
        build().save_pretrained(path)
        _MODEL_DIRS[name] = str(path)
    yield


CONFIGS = {
    # ρ = 0 (the LoRA-equivalent path), a sparse block mask, n:m and unstructured, all with non-zero B so that the
    # merge / disable checks see real deltas. PEFT's loops train without LISA's schedule, so the masks stay fixed
    # (mask_update_interval=0; B != 0, so "importance" has no calibration left to do): test_schedule_guard.py
    "dense": {"r": 4, "init_weights": False},
    "block": {"r": 4, "sparsity": 0.5, "mask_init": "random", "init_weights": False, "mask_update_interval": 0},
    "nm": {"r": 4, "sparsity": 0.5, "sparsity_structure": "n:m", "mask_init": "magnitude", "init_weights": False,
           "mask_update_interval": 0},
    "unstructured": {"r": 4, "sparsity": 0.3, "sparsity_structure": "unstructured", "init_weights": False,
                     "mask_update_interval": 0},
}
MODELS = {"llama": {}, "gpt2": {"fan_in_fan_out": True}}
CASES = [(m, c) for m in MODELS for c in CONFIGS]


class TestLisaUnderPeftGenericChecks(PeftCommonTester):
    transformers_class = AutoModelForCausalLM

    def prepare_inputs_for_testing(self):
        import torch

        input_ids = torch.tensor([[1, 1, 1], [1, 2, 1]])
        attention_mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    @staticmethod
    def _args(model, cfg):
        return _MODEL_DIRS[model], hf_lisa.LisaConfig, {**CONFIGS[cfg], **MODELS[model], "task_type": "CAUSAL_LM"}

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_save_pretrained(self, model, cfg):
        self._test_save_pretrained(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_save_pretrained_selected_adapters(self, model, cfg):
        self._test_save_pretrained_selected_adapters(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_from_pretrained_config_construction(self, model, cfg):
        self._test_from_pretrained_config_construction(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_load_multiple_adapters(self, model, cfg):
        self._test_load_multiple_adapters(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_merge_layers(self, model, cfg):
        self._test_merge_layers(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_merge_layers_nan(self, model, cfg):
        self._test_merge_layers_nan(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_merge_layers_is_idempotent(self, model, cfg):
        self._test_merge_layers_is_idempotent(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_safe_merge(self, model, cfg):
        self._test_safe_merge(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_mixed_adapter_batches(self, model, cfg):
        self._test_mixed_adapter_batches(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_generate(self, model, cfg):
        self._test_generate(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_training(self, model, cfg):
        self._test_training(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_inference_safetensors(self, model, cfg):
        self._test_inference_safetensors(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_training_gradient_checkpointing(self, model, cfg):
        self._test_training_gradient_checkpointing(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_delete_adapter(self, model, cfg):
        self._test_delete_adapter(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_delete_inactive_adapter(self, model, cfg):
        self._test_delete_inactive_adapter(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_unload_adapter(self, model, cfg):
        self._test_unload_adapter(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_disable_adapter(self, model, cfg):
        self._test_disable_adapter(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_adapter_name(self, model, cfg):
        self._test_adapter_name(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_model_attr(self, model, cfg):
        self._test_model_attr(*self._args(model, cfg))

    @pytest.mark.parametrize("model,cfg", CASES)
    def test_prepare_for_training(self, model, cfg):
        self._test_prepare_for_training(*self._args(model, cfg))
