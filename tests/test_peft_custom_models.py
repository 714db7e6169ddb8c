"""PEFT's own custom-model suite (``tests/test_custom_models.py`` of the installed PEFT's sdist), run on LISA.

PEFT parametrizes ``TestPeftCustomModel`` and ``TestMultipleActiveAdapters`` over module-level case lists (small MLP,
Conv1D and embedding models behind ``MockTransformerWrapper``). Here every generic test of those two classes is copied
and re-parametrized with LISA's cases: dense (ρ = 0, the LoRA path), block, n:m and unstructured masks, a mixed
sparse/dense config, and layer interpolation on a small model with a block list. PEFT's tests of other methods (LoRA,
IA³, trainable tokens, ...) are not copied. ``make test`` fetches the suite (see the Makefile and
``tests/test_peft_generic.py``).
"""

from __future__ import annotations

import functools
import sys
import types
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from torch import nn

import hf_lisa  # noqa: F401  (registers LISA)
from hf_lisa import LisaConfig

GENERIC_DIR = Path(sys.prefix) / "peft_generic"
if not (GENERIC_DIR / "peft_tests" / "test_custom_models.py").exists():
    pytest.skip(
        f"PEFT's custom-model tests are not installed in {GENERIC_DIR}; run `make test` (it fetches them)",
        allow_module_level=True,
    )
sys.path.insert(0, str(GENERIC_DIR))
# imported as a module, not `from ... import TestX`: pytest would collect PEFT's whole classes here otherwise
from peft_tests import test_custom_models as peft_custom  # noqa: E402


class BlockMLP(nn.Module):
    """PEFT's ``MLP`` with its hidden layers in an ``nn.ModuleList``: blocks for layer interpolation to scale."""

    def __init__(self, bias: bool = True, hidden: int = 16, num_blocks: int = 2) -> None:
        super().__init__()
        self.lin0 = nn.Linear(10, hidden, bias=bias)
        self.relu = nn.ReLU()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(hidden, hidden, bias=bias), nn.ReLU())
                                     for _ in range(num_blocks)])
        self.drop = nn.Dropout(0.5)
        self.lin1 = nn.Linear(hidden, 2, bias=bias)
        self.sm = nn.LogSoftmax(dim=-1)
        self.dtype = torch.float

    def forward(self, X):
        X = self.relu(self.lin0(X.to(self.dtype)))
        for block in self.layers:
            X = block(X)
        return self.sm(self.lin1(self.drop(X)))


class LisaMockTransformerWrapper(peft_custom.MockTransformerWrapper):
    """PEFT's model factory plus ``"BlockMLP"``."""

    @classmethod
    def from_pretrained(cls, model_id, dtype=None):
        if model_id == "BlockMLP":
            torch.manual_seed(0)
            return BlockMLP().to(dtype or torch.float32)
        return super().from_pretrained(model_id, dtype=dtype)


def _unsupported(model_id: str, target: str, kind: str):
    reason = (
        f"LISA adapts torch.nn.Linear and transformers' Conv1D only; {kind} ({model_id}.{target}) is rejected with a "
        "TypeError at injection (test_unsupported_layer_types_are_rejected_with_a_clear_error)"
    )
    return pytest.param(f"{model_id} {kind} LISA", model_id, LisaConfig, {"target_modules": [target]},
                        marks=pytest.mark.skip(reason=reason))


# PEFT's tests train in plain loops, without LISA's schedule: the sparse cases keep the masks they are created with
# (no calibration from |dL/dW|, no re-selection), which a LISA adapter needs to train without LisaAdapterCallback
FIXED_MASKS = {"mask_init": "magnitude", "mask_update_interval": 0}
LISA_TEST_CASES = [
    # dense: ρ = 0 is LoRA's forward
    ("MLP dense lin0", "MLP", LisaConfig, {"target_modules": ["lin0"], "r": 4, "lisa_alpha": 8}),
    # sparse masks
    ("MLP block", "MLP", LisaConfig, {"target_modules": ["lin0", "lin1"], "sparsity": 0.5, **FIXED_MASKS}),
    ("MLP n:m 2:4", "MLP", LisaConfig,
     {"target_modules": ["lin1"], "sparsity": 0.5, "sparsity_structure": "n:m", **FIXED_MASKS}),
    # unstructured, on transformers' Conv1D (fan_in_fan_out) and nn.Linear
    ("EmbConv1D unstructured Conv1D", "EmbConv1D", LisaConfig,
     {"target_modules": ["conv1d", "lin0"], "sparsity": 0.4, "sparsity_structure": "unstructured",
      "mask_init": "random", "mask_update_interval": 0}),
    # seed 000's mixed strategy in one config: sparse here, dense there
    ("MLP_LayerNorm mixed", "MLP_LayerNorm", LisaConfig,
     {"target_modules": ["lin0", "lin1"], "sparsity": 0.5, "sparsity_pattern": {"lin1": 0.0}, **FIXED_MASKS}),
    # layer interpolation (seed 001): α/β per block of BlockMLP.layers, with a dense and a sparse adapter
    ("BlockMLP interpolation", "BlockMLP", LisaConfig,
     {"target_modules": ["lin0", "layers.1.0"], "sparsity": 0.5, "sparsity_pattern": {"lin0": 0.0},
      "layer_interpolation": True}),
    # layer types LISA does not adapt
    _unsupported("Conv1d", "conv1d", "torch.nn.Conv1d"),
    _unsupported("Conv2d", "conv2d", "torch.nn.Conv2d"),
    _unsupported("Conv3d", "conv3d", "torch.nn.Conv3d"),
    _unsupported("EmbConv1D", "emb", "torch.nn.Embedding"),
    _unsupported("MHA", "mha", "torch.nn.MultiheadAttention"),
]
# the dtype matrix (3 dtypes x autocast x low_cpu_mem_usage) runs on dense, two sparse and the interpolation case
DTYPE_AUTOCAST_CASES = [
    case for case in LISA_TEST_CASES
    if type(case) is tuple and case[0] in {  # pytest.param entries (the skipped layer types) are tuples too
        "MLP dense lin0", "MLP n:m 2:4", "EmbConv1D unstructured Conv1D", "BlockMLP interpolation",
    }
]

LISA_MULTIPLE_ACTIVE_ADAPTERS_TEST_CASES = [
    ("LISA dense Same", "lisa", LisaConfig, {"target_modules": ["lin0"], "init_weights": False},
     {"target_modules": ["lin0"], "init_weights": False}),
    ("LISA dense Different", "lisa", LisaConfig, {"target_modules": ["lin0"], "init_weights": False},
     {"target_modules": ["lin1"], "init_weights": False}),
    ("LISA block Same, other masks", "lisa", LisaConfig,
     {"target_modules": ["lin0"], "sparsity": 0.5, "mask_init": "random", "init_weights": False,
      "mask_update_interval": 0},
     {"target_modules": ["lin0"], "sparsity": 0.5, "mask_init": "random", "mask_seed": 1, "init_weights": False,
      "mask_update_interval": 0}),
    ("LISA n:m + unstructured", "lisa", LisaConfig,
     {"target_modules": ["lin1"], "sparsity": 0.5, "sparsity_structure": "n:m", "init_weights": False,
      **FIXED_MASKS},
     {"target_modules": ["lin0", "lin1"], "sparsity": 0.3, "sparsity_structure": "unstructured",
      "init_weights": False, **FIXED_MASKS}),
]

# PEFT's tests that cannot apply to a LISA case, with the reason: test name -> (predicate on config_kwargs, reason)
_INTERPOLATION_NO_MERGE = (
    "layer_interpolation scales whole block outputs (h = α·f(h) + β), which no base weight can express: merging "
    "refuses with a ValueError (tests/test_tuner.py::test_interpolation_init_clamp_penalty_and_merge_refusal; "
    "half-precision forward: test_interpolation_forward_in_half_precision_tracks_float32)"
)
_INTERPOLATION_NO_DIRECT_INJECTION = (
    "peft.inject_adapter_in_model drops the tuner that holds α/β, so it refuses layer_interpolation "
    "(tests/test_transformers_adapter_api.py; the PeftModel low_cpu_mem_usage load of this case is "
    "tests/test_meta_device_loading.py::test_low_cpu_mem_usage_load_equals_normal_load[block+interpolation])"
)


def _interpolation(kwargs: dict) -> bool:
    return bool(kwargs.get("layer_interpolation"))


NOT_APPLICABLE = {
    **{
        name: (_interpolation, _INTERPOLATION_NO_MERGE)
        for name in (
            "test_merge_layers", "test_merge_layers_fp16", "test_merge_layers_is_idempotent",
            "test_merge_layers_is_deterministic_in_train_mode", "test_safe_merge", "test_disable_adapters_with_merging",
            "test_forward_float16", "test_forward_bfloat16", "test_forward_float16_no_autocast",
            "test_forward_bfloat16_no_autocast", "test_delete_merged_adapter_raises_without_mutation",
            "test_delete_merged_adapter_only_rejects_the_merged_one",
        )
    },
    # PEFT's test_save_load_roundtrip_direct_injection recognises the refusal itself (it names shared state)
    "test_load_model_low_cpu_mem_usage": (_interpolation, _INTERPOLATION_NO_DIRECT_INJECTION),
}
# PEFT's tests that train in a plain loop, without LISA's schedule: layer interpolation needs it (the penalty's gradient
# once per step, δ kept in its bound), so its first training forward refuses (tests/test_schedule_guard.py). These
# copies assert that refusal for the interpolation case; its training under the callback is tests/test_trl.py and
# tests/test_scheduler_adapter.py. Test name -> (predicate on config_kwargs, the refusal's message)
REFUSED_WITHOUT_SCHEDULE = {
    name: (_interpolation, r"without its schedule.*layer_interpolation=True")
    for name in ("test_training_custom_models", "test_inference_safetensors", "test_only_params_are_updated",
                 "test_parameters_after_loading_model", "test_disable_adapters")
}
# tests run on a subset of the cases (runtime), test name -> cases
CASES_FOR = {"test_adapter_dtype_autocast": DTYPE_AUTOCAST_CASES}


def _argnames(mark) -> tuple[str, ...]:
    names = mark.args[0]
    return tuple(n.strip() for n in names.split(",")) if isinstance(names, str) else tuple(names)


def _lisa_copies(source_cls: type, replacements: dict[tuple[str, ...], list]) -> dict[str, types.FunctionType]:
    """The tests of ``source_cls`` that PEFT parametrizes over one of ``replacements``' argument tuples, each copied
    with that parametrization swapped for LISA's cases (its other parametrizations, e.g. dtypes, are kept)."""
    copies = {}
    for name, fn in vars(source_cls).items():
        marks = getattr(fn, "pytestmark", [])
        if not name.startswith("test_") or not any(
            m.name == "parametrize" and _argnames(m) in replacements for m in marks
        ):
            continue

        @functools.wraps(fn)
        def test(self, *args, __fn=fn, __name=name, **kwargs):
            rule = NOT_APPLICABLE.get(__name)
            if rule is not None and rule[0](kwargs.get("config_kwargs") or {}):
                pytest.skip(rule[1])
            refusal = REFUSED_WITHOUT_SCHEDULE.get(__name)
            if refusal is not None and refusal[0](kwargs.get("config_kwargs") or {}):
                with pytest.raises(RuntimeError, match=refusal[1]):
                    __fn(self, *args, **kwargs)
                return None
            return __fn(self, *args, **kwargs)

        test.pytestmark = [
            pytest.mark.parametrize(m.args[0], CASES_FOR.get(name, replacements[_argnames(m)])).mark
            if m.name == "parametrize" and _argnames(m) in replacements
            else m
            for m in marks
        ]
        copies[name] = test
    return copies


_CASE_ARGS = ("test_name", "model_id", "config_cls", "config_kwargs")
_MULTI_ARGS = ("test_name", "tuner_method", "config_cls", "config_kwargs_1", "config_kwargs_2")

def _lisa_test_class(name: str, source_cls: type, replacements: dict, doc: str, **overrides) -> type:
    """``source_cls`` with its helpers and LISA copies of its generic tests, on the same bases."""
    attrs = {k: v for k, v in vars(source_cls).items() if not k.startswith(("test_", "__"))}
    attrs.update(overrides)
    attrs.update(_lisa_copies(source_cls, replacements))
    return type(name, source_cls.__bases__, {**attrs, "__module__": __name__, "__doc__": doc})


TestLisaUnderPeftCustomModelChecks = _lisa_test_class(
    "TestLisaUnderPeftCustomModelChecks",
    peft_custom.TestPeftCustomModel,
    {_CASE_ARGS: LISA_TEST_CASES, ("config_cls",): [LisaConfig]},
    "PEFT's ``TestPeftCustomModel`` generic tests with LISA's cases.",
    transformers_class=LisaMockTransformerWrapper,
)
# its other tests are DoRA's
TestLisaUnderPeftMultipleActiveAdapters = _lisa_test_class(
    "TestLisaUnderPeftMultipleActiveAdapters",
    peft_custom.TestMultipleActiveAdapters,
    {_MULTI_ARGS: LISA_MULTIPLE_ACTIVE_ADAPTERS_TEST_CASES},
    "PEFT's ``TestMultipleActiveAdapters`` with two LISA adapters on its MLP.",
)


@pytest.mark.parametrize(
    "model_id,target,layer_type",
    [("Conv1d", "conv1d", "Conv1d"), ("Conv2d", "conv2d", "Conv2d"), ("Conv3d", "conv3d", "Conv3d"),
     ("EmbConv1D", "emb", "Embedding"), ("MHA", "mha", "MultiheadAttention")],
)
def test_unsupported_layer_types_are_rejected_with_a_clear_error(model_id, target, layer_type):
    model = LisaMockTransformerWrapper.from_pretrained(model_id)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=rf"LISA cannot adapt module '{target}' of type {layer_type}.*target_modules"):
        get_peft_model(model, LisaConfig(target_modules=[target]))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# -- what this suite revealed in the tuner, pinned down on its own -----------------------------------------------------
def test_mask_first_read_under_inference_mode_still_serves_training_and_merging():
    """The unpacked mask is cached; cached inside ``torch.inference_mode`` it used to be an inference tensor, which
    autograd refuses to save ("Inference tensors cannot be saved for backward") in a later training step or merge."""
    model = get_peft_model(
        peft_custom.MLP(), LisaConfig(target_modules=["lin0"], sparsity=0.5, mask_init="random", init_weights=False)
    ).eval()
    X = torch.arange(90).view(9, 10)
    with torch.inference_mode():
        expected = model(X).clone()  # first read of the mask
    loss = model(X).sum()
    loss.backward()
    grad_B = model.base_model.model.lin0.lisa_B["default"].weight.grad
    assert grad_B is not None and grad_B.abs().sum() > 0
    merged = model.merge_and_unload()
    torch.testing.assert_close(merged(X), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast_adapter_dtype", [True, False])
def test_interpolation_scalars_follow_autocast_adapter_dtype(autocast_adapter_dtype):
    """α/β take the dtype PEFT gives every adapter weight: fp32 with autocast_adapter_dtype, else the base dtype."""
    base = BlockMLP().to(torch.bfloat16)
    base.dtype = torch.bfloat16
    X = torch.arange(90).view(9, 10)
    with torch.no_grad():
        base_out = base.eval()(X)
    config = LisaConfig(target_modules=["layers.0.0"], layer_interpolation=True)
    model = get_peft_model(base, config, autocast_adapter_dtype=autocast_adapter_dtype).eval()
    model.add_adapter("other", LisaConfig(target_modules=["lin0"], layer_interpolation=True),
                      autocast_adapter_dtype=autocast_adapter_dtype)
    expected = torch.float32 if autocast_adapter_dtype else torch.bfloat16
    tuner = model.base_model
    for name in ("default", "other"):
        assert tuner.lisa_interp_delta[name].dtype == tuner.lisa_interp_beta[name].dtype == expected
    assert model.base_model.model.layers[0][0].lisa_A["default"].weight.dtype == expected
    assert torch.equal(tuner.lisa_interp_delta["default"], torch.zeros(2, dtype=expected))
    with torch.no_grad():
        torch.testing.assert_close(model(X), base_out, rtol=0, atol=0)  # α = 1, β = 0 and B = 0: the base model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpolation_forward_in_half_precision_tracks_float32(dtype):
    model = get_peft_model(
        BlockMLP(),
        LisaConfig(target_modules=["layers.0.0", "layers.1.0"], sparsity=0.5, layer_interpolation=True,
                   init_weights=False),
    ).eval()
    with torch.no_grad():
        model.base_model.lisa_interp_delta["default"].copy_(torch.tensor([0.5, -0.3]))
        model.base_model.lisa_interp_beta["default"].copy_(torch.tensor([0.2, -0.1]))
    X = torch.arange(90).view(9, 10) / 90
    with torch.no_grad():
        expected = model(X)
        model.to(dtype)
        model.base_model.model.dtype = dtype
        out = model(X)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


# FSDP1 (use_orig_params=True) on one gloo process: get_peft_model_state_dict / set_peft_model_state_dict round trip
TestLisaUnderPeftFsdpStateDict = _lisa_test_class(
    "TestLisaUnderPeftFsdpStateDict",
    peft_custom.TestPeftFsdpStateDict,
    {_CASE_ARGS: LISA_TEST_CASES},
    "PEFT's ``TestPeftFsdpStateDict``: a LISA adapter saved from an FSDP-wrapped model reloads with the same outputs.",
    transformers_class=LisaMockTransformerWrapper,
)
