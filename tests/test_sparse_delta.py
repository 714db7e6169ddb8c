"""The sparse adapter path (issue 13): the same outputs and gradients as the old graph, without its weight-sized
saved tensors.

The old graph is kept here verbatim (:func:`old_add_adapter_outputs`, the sparse branch of
``LisaLayer.add_adapter_outputs`` before ``hf_lisa.tuner.sparse_delta``): ``delta = s·(B@A)⊙M`` materialised, a hook
on it for importance, ``F.linear(h, delta)``. Every test runs the same computation through the old graph and the
new path and compares outputs, ``dx``, ``dA``, ``dB`` and the importance gradient with ``torch.equal`` (bitwise), except
the opt-in fused path, which rounds differently and is compared with a stated tolerance.
"""

from __future__ import annotations

import functools

import types
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model
from torch import nn

from hf_lisa import LisaConfig
from hf_lisa.tuner import masks as M
from hf_lisa.tuner.layer import LisaLayer, Linear
from hf_lisa.tuner.sparse_delta import MaskLayout, _mask
from tiny_models import randomize_adapters, tiny_gpt2, tiny_llama


# -- the old graph (reference) ----------------------------------------------------------------------------------------
def old_mask(layer: LisaLayer, name: str) -> torch.Tensor:
    """The full boolean mask, expanded from the packed bits as the old ``get_mask`` did."""
    spec = layer.lisa_mask_spec[name]
    grid_shape = M.grid_shape((layer.out_features, layer.in_features), spec["structure"], spec["block_size"])
    return M.expand_grid(M.unpack_mask(layer.lisa_mask[name], grid_shape), spec["structure"], spec["block_size"])


def _add(sums: dict, name: str, grad: torch.Tensor) -> None:
    grad = grad.detach().float()
    sums[name] = grad.clone() if name not in sums else sums[name].add_(grad)


def measure(layer: LisaLayer) -> None:
    """Hand every adapter's ``dL/dW`` in ``layer``'s backward passes to a dict (:func:`sums`), summed per adapter, as
    the mask scheduler does with its own."""
    layer._test_sums = {}
    for name in list(layer.lisa_A):
        layer.lisa_gradient_sinks[name] = functools.partial(_add, layer._test_sums, name)


def sums(layer: LisaLayer) -> dict:
    return getattr(layer, "_test_sums", {})


def old_add_adapter_outputs(self: LisaLayer, result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``LisaLayer.add_adapter_outputs`` as it was before the sparse path was rewritten."""
    result_dtype = result.dtype
    for name in self.active_adapters:
        if name not in self.lisa_A:
            continue
        lisa_A = self.lisa_A[name]
        h = self.lisa_dropout[name](self._cast_input_dtype(x, lisa_A.weight.dtype))
        if name in self.lisa_mask:
            delta = self.lisa_B[name].weight @ self.lisa_A[name].weight
            delta = delta * old_mask(self, name).to(delta.device)
            delta = delta * self.scaling[name]
            sink = self.lisa_gradient_sinks.get(name)
            if sink is not None and delta.requires_grad:
                delta.register_hook(sink)
            result = result + F.linear(h, delta.to(h.dtype))
        else:
            result = result + self.lisa_B[name](lisa_A(h)) * self.scaling[name]
    return result.to(result_dtype)


@contextmanager
def old_graph(model: nn.Module):
    """Run every LISA layer of ``model`` through :func:`old_add_adapter_outputs`."""
    layers = [m for m in model.modules() if isinstance(m, LisaLayer)]
    for layer in layers:
        layer.add_adapter_outputs = types.MethodType(old_add_adapter_outputs, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.add_adapter_outputs


# -- helpers ----------------------------------------------------------------------------------------------------------
STRUCTURES = {  # (sparsity_structure, block_size, n_m, sparsity) on a 48 x 64 weight
    "block2x2": ("block", (2, 2), (2, 4), 0.4),
    "row": ("block", (1, 64), (2, 4), 0.5),
    "column": ("block", (48, 1), (2, 4), 0.5),
    "n:m": ("n:m", (2, 2), (2, 4), 0.5),
    "unstructured": ("unstructured", (2, 2), (2, 4), 0.3),
}


def sparse_layer(structure: str = "block2x2", dtype: torch.dtype = torch.float32, **config) -> Linear:
    kind, block_size, n_m, sparsity = STRUCTURES[structure]
    torch.manual_seed(0)
    config.setdefault("fuse_sparse_delta", False)  # the exact path; fuse() below turns the fused one on
    cfg = LisaConfig(
        r=4, lisa_alpha=8, sparsity=sparsity, sparsity_structure=kind, block_size=block_size, n_m=n_m,
        mask_init="random", **config,
    )
    layer = Linear(nn.Linear(64, 48), "default", cfg, r=4, lisa_alpha=8, sparsity=sparsity, module_key="proj")
    with torch.no_grad():
        layer.lisa_B["default"].weight.normal_()  # B = 0 would make dA and the output's adapter part zero
    layer.base_layer.requires_grad_(False)
    return layer.to(dtype)


def run_layer(layer: Linear, x: torch.Tensor, old: bool, autocast: bool = False):
    """Forward and backward of ``layer`` on a copy of ``x``; returns output, dx, dA and dB of every adapter, and the
    importance sums."""
    layer.zero_grad(set_to_none=True)
    sums(layer).clear()
    leaf = x.detach().clone().requires_grad_()
    # an activation, as inside a model: autocast caches the casts of leaves that require grad, which couples the
    # base's and the adapter's dx (a test artefact, not a case a model produces)
    inputs = leaf * 1
    with old_graph(layer) if old else _nothing(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    (out * weights).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.requires_grad}
    return out, leaf.grad, grads, dict(sums(layer))


@contextmanager
def _nothing():
    yield


def assert_all_equal(new, old) -> None:
    out, dx, grads, importance = new
    ref_out, ref_dx, ref_grads, ref_importance = old
    assert torch.equal(out, ref_out)
    assert torch.equal(dx, ref_dx)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert grads[name] is not None and torch.equal(grads[name], ref_grads[name]), name
    assert importance.keys() == ref_importance.keys()
    for name in importance:
        assert torch.equal(importance[name], ref_importance[name]), name


def saved_bytes_by_size(fn, params) -> list[int]:
    """Element counts of the tensors autograd saves while ``fn`` runs, other than parameters (kept anyway)."""
    param_ptrs = {p.data_ptr() for p in params}
    sizes = []

    def pack(t):
        if t.data_ptr() not in param_ptrs:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


# -- the mask multiplier -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "structure,block_size",
    [("block", (2, 2)), ("block", (4, 1)), ("block", (8, 8)), ("block", (1, 34)), ("block", (3, 17)),
     ("n:m", (2, 2)), ("unstructured", (2, 2)), ("a-future-structure", (2, 2))],
)
def test_mask_from_packed_bits_is_the_product_with_the_expanded_mask(structure, block_size, dtype):
    layout = MaskLayout((48, 136), structure, block_size)
    gen = torch.Generator().manual_seed(9)
    grid = torch.rand(layout.grid_shape, generator=gen) > 0.5
    packed = M.pack_mask(grid)
    delta = torch.randn(48, 136, generator=gen).to(dtype)
    expected = delta * M.expand_grid(grid, structure, block_size)
    int_type = torch.int16 if dtype == torch.bfloat16 else torch.int32
    # bit patterns, signed zeros included: the same products as with the boolean mask
    assert torch.equal(_mask(delta, packed, layout, inplace=False).view(int_type), expected.view(int_type))
    assert torch.equal(_mask(delta.clone(), packed, layout, inplace=True).view(int_type), expected.view(int_type))


# -- one layer: every structure, fp32 / bf16 / autocast ---------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_layer_matches_old_graph_bitwise(structure, precision):
    layer = sparse_layer(structure, torch.bfloat16 if precision == "bf16" else torch.float32)
    measure(layer)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1)).to(layer.base_layer.weight.dtype)
    new = run_layer(layer, x, old=False, autocast=precision == "autocast")
    old = run_layer(layer, x, old=True, autocast=precision == "autocast")
    assert_all_equal(new, old)
    assert torch.count_nonzero(new[3]["default"][~old_mask(layer, "default")]) > 0  # masked-out entries have dL/dΔ


def test_frozen_adapter_passes_dx_only_and_tracks_nothing():
    layer = sparse_layer()
    measure(layer)  # A and B frozen: the old graph registered no hook either
    layer.lisa_A.requires_grad_(False)
    layer.lisa_B.requires_grad_(False)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    new, old = run_layer(layer, x, old=False), run_layer(layer, x, old=True)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert new[2] == old[2] == {} and new[3] == old[3] == {}


def test_two_active_adapters_and_untracked_importance():
    layer = sparse_layer("n:m")
    kind, _, _, sparsity = STRUCTURES["block2x2"]
    cfg = LisaConfig(r=2, lisa_alpha=4, sparsity=sparsity, sparsity_structure=kind, mask_init="random", mask_seed=5)
    layer.update_layer("other", 2, 4, sparsity, cfg, module_key="proj")
    layer.update_layer("dense", 2, 4, 0.0, cfg, module_key="proj")
    layer.set_adapter(["default", "other", "dense"])
    with torch.no_grad():
        for name in ("other", "dense"):
            layer.lisa_B[name].weight.normal_()
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4))
    new, old = run_layer(layer, x, old=False), run_layer(layer, x, old=True)
    assert_all_equal(new, old)
    assert len(new[2]) == 6 and new[3] == {}


def test_strided_input_takes_the_old_graph():
    layer = sparse_layer()
    measure(layer)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(5)).t()  # not contiguous
    assert_all_equal(run_layer(layer, x, old=False), run_layer(layer, x, old=True))


def test_inference_matches_and_builds_no_graph():
    layer = sparse_layer("unstructured")
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6))
    with old_graph(layer), torch.no_grad():
        ref = layer(x)
    with torch.no_grad():
        out = layer(x)
    with torch.inference_mode():
        out_inference = layer(x)
    assert torch.equal(out, ref) and torch.equal(out_inference, ref) and out.grad_fn is None


@pytest.mark.parametrize("frozen", [False, True])
def test_no_weight_sized_tensor_is_kept_for_backward(frozen):
    layer = sparse_layer()
    layer.lisa_A.requires_grad_(not frozen)
    layer.lisa_B.requires_grad_(not frozen)
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).requires_grad_() * 1)
    weight_size = layer.out_features * layer.in_features
    params = list(layer.parameters())
    new = saved_bytes_by_size(lambda: layer(x), params)
    with old_graph(layer):
        old = saved_bytes_by_size(lambda: layer(x), params)
    assert max(old) >= weight_size  # the old graph kept M ⊙ (B A): this test can tell the two apart
    assert max(new) < weight_size, new


# -- whole models: Conv1D, dropout, gradient checkpointing -------------------------------------------------------------
def run_model(model, ids: torch.Tensor, old: bool, seed: int = 0):
    for p in model.parameters():
        p.grad = None
    for layer in model.modules():
        if isinstance(layer, LisaLayer):
            sums(layer).clear()
    torch.manual_seed(seed)  # dropout draws the same masks in both runs
    with old_graph(model) if old else _nothing():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    importance = {
        f"{n}.{a}": g for n, m in model.named_modules() if isinstance(m, LisaLayer) for a, g in sums(m).items()
    }
    return out.logits, grads, importance


def assert_models_equal(new, old) -> None:
    (logits, grads, importance), (ref_logits, ref_grads, ref_importance) = new, old
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert grads[name] is not None and torch.equal(grads[name], ref_grads[name]), name
    assert importance.keys() == ref_importance.keys() and importance
    for name in importance:
        assert torch.equal(importance[name], ref_importance[name]), name


def sparse_model(build, **config):
    config.setdefault("fuse_sparse_delta", False)  # the exact path; fuse() below turns the fused one on
    config.setdefault("mask_update_interval", 0)  # fixed masks: trains without the schedule (test_schedule_guard.py)
    model = get_peft_model(build(), LisaConfig(r=4, sparsity=0.5, mask_init="random", **config))
    randomize_adapters(model)
    for layer in model.modules():
        if isinstance(layer, LisaLayer):
            measure(layer)
    return model


IDS = torch.tensor([[1, 5, 9, 2, 7, 3, 8], [4, 4, 8, 1, 0, 6, 2]])


def test_conv1d_model_matches_old_graph():
    model = sparse_model(tiny_gpt2, sparsity_structure="n:m").train()
    assert any(m.fan_in_fan_out for m in model.modules() if isinstance(m, LisaLayer))
    assert_models_equal(run_model(model, IDS, old=False), run_model(model, IDS, old=True))


def test_dropout_matches_old_graph():
    model = sparse_model(tiny_llama, lisa_dropout=0.2).train()
    assert_models_equal(run_model(model, IDS, old=False), run_model(model, IDS, old=True))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_matches_old_graph(reentrant):
    model = sparse_model(tiny_llama, lisa_dropout=0.1)
    reference = run_model(model.train(), IDS, old=True)  # no checkpointing
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    model.train()
    assert_models_equal(run_model(model, IDS, old=False), reference)
    assert_models_equal(run_model(model, IDS, old=True), reference)


# -- the fused path (LisaConfig.fuse_sparse_delta, the default) --------------------------------------------------------
#: the fused matmul x (W + Δ)ᵀ rounds differently from x Wᵀ + x Δᵀ: its results must agree with the old graph's to
#: 2e-6 of the tensor's largest magnitude (about 16 fp32 ulps; measured: below 6e-7)
FUSED_TOLERANCE = 2e-6


def assert_close_fused(new: torch.Tensor, old: torch.Tensor) -> None:
    assert new.dtype == old.dtype and new.shape == old.shape
    new, old = new.detach(), old.detach()
    assert float((new - old).abs().max()) <= FUSED_TOLERANCE * float(old.abs().max())


def fuse(model: nn.Module) -> None:
    for layer in model.modules():
        if isinstance(layer, LisaLayer):
            layer.lisa_fuse_sparse = dict.fromkeys(layer.lisa_fuse_sparse, True)


@pytest.mark.parametrize("structure", ["block2x2", "unstructured"])
def test_fused_layer_is_close_to_old_graph(structure):
    layer = sparse_layer(structure)
    measure(layer)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    old = run_layer(layer, x, old=True)
    fuse(layer)
    assert layer._fused_forward_ok(x)
    new = run_layer(layer, x, old=False)
    assert_close_fused(new[0], old[0])
    assert_close_fused(new[1], old[1])
    # the incoming gradient is the same, so dL/dΔ, dA and dB are the old ones bit for bit
    for name in old[2]:
        assert torch.equal(new[2][name], old[2][name]), name
    assert torch.equal(new[3]["default"], old[3]["default"])


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_fused_conv1d_model_is_close_to_old_graph(reentrant):
    model = sparse_model(tiny_gpt2, sparsity_structure="n:m").train()
    old = run_model(model, IDS, old=True)
    fuse(model)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        model.train()
    logits, grads, importance = run_model(model, IDS, old=False)
    assert_close_fused(logits, old[0])
    assert grads.keys() == old[1].keys() and importance.keys() == old[2].keys()
    for name in grads:
        assert_close_fused(grads[name], old[1][name])
    for name in importance:
        assert_close_fused(importance[name], old[2][name])


def fuse_ok(layer: Linear, x: torch.Tensor) -> bool:
    fuse(layer)
    return layer._fused_forward_ok(x)


def test_fused_path_declines_where_it_would_change_the_function():
    layer = sparse_layer()
    x = torch.randn(2, 64)
    assert fuse_ok(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layer._fused_forward_ok(x)  # would run W + Δ in bf16
    assert not layer._fused_forward_ok(x.double())  # the base would fail on it: let it
    handle = layer.base_layer.register_forward_pre_hook(lambda module, args: None)  # e.g. ZeRO-3 gathering
    assert not layer._fused_forward_ok(x)
    handle.remove()
    layer.base_layer.weight.requires_grad_(True)
    assert not layer._fused_forward_ok(x)
    layer.base_layer.weight.requires_grad_(False)
    assert layer._fused_forward_ok(x)
    assert not fuse_ok(sparse_layer(dtype=torch.bfloat16), x.bfloat16())  # W + Δ in bf16 loses small deltas
    assert not fuse_ok(sparse_layer(lisa_dropout=0.1), x)
    two = sparse_layer()
    two.update_layer("other", 2, 4, 0.4, LisaConfig(r=2, sparsity=0.4, mask_init="random"), module_key="proj")
    fuse(two)
    two.set_adapter(["default", "other"])
    assert not fuse_ok(two, x)


def test_fused_path_with_a_base_hook_is_the_exact_path():
    layer = sparse_layer()
    measure(layer)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(8))
    old = run_layer(layer, x, old=True)
    fuse(layer)
    seen = []
    layer.base_layer.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert_all_equal(run_layer(layer, x, old=False), old)
    assert seen == [torch.Size([2, 5, 48])]  # the base module ran, with its hook


# -- FSDP1 (use_orig_params=True): the unit's views of its flat parameter --------------------------------------------
@pytest.fixture
def gloo_process_group():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("base_trains", [False, True])
def test_fsdp1_unit_fuses_like_the_unwrapped_model(gloo_process_group, base_trains):
    """Inside an FSDP1 unit the base weight is a plain view of the flat parameter that requires a gradient (the
    adapter's share of the unit does); the fused path used to take it for a trainable base and decline, so a sparse
    adapter's outputs differed wrapped and unwrapped by the fused path's rounding (PEFT's TestPeftFsdpStateDict failed
    on it). The original parameter's flag decides now: fused where the base is frozen, exact where it trains."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = sparse_model(tiny_llama).train()
    fuse(model)
    proj = model.base_model.model.model.layers[0].self_attn.q_proj
    proj.base_layer.weight.requires_grad_(base_trains)
    fused = []
    ok = proj._fused_forward_ok
    proj._fused_forward_ok = lambda x: fused.append(ok(x)) or fused[-1]
    ref_logits, ref_grads, ref_importance = run_model(model, IDS, old=False)
    wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    logits, grads, importance = run_model(wrapped, IDS, old=False)
    assert fused == [not base_trains] * 2  # unwrapped, then inside the unit
    assert torch.equal(logits, ref_logits)
    grads = {n.replace("_fsdp_wrapped_module.", ""): g for n, g in grads.items()}
    importance = {n.replace("_fsdp_wrapped_module.", ""): g for n, g in importance.items()}
    assert grads.keys() == ref_grads.keys()
    assert ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in grads) == base_trains
    for name, grad in grads.items():
        assert grad is not None and torch.equal(grad, ref_grads[name]), name
    assert importance.keys() == ref_importance.keys() and importance
    for name in importance:
        assert torch.equal(importance[name], ref_importance[name]), name
