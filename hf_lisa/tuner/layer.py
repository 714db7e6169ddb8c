"""LISA tuner layers: ``y = base(x) + s · x (M ⊙ (B A))ᵀ`` on ``nn.Linear`` and transformers' ``Conv1D``."""

from __future__ import annotations

import warnings
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils.other import transpose
from torch import nn

from . import masks as M
from .config import LisaConfig
from .sparse_delta import MaskLayout, fused_sparse_linear, sparse_delta, sparse_delta_linear, supports_fast_path


class LisaLayer(BaseTunerLayer):
    """Mixin holding the per-adapter state of one adapted module.

    ``lisa_A``/``lisa_B`` are the trainable factors; ``lisa_mask`` holds the structured mask ``M`` bit-packed on its
    selection grid (one bit per block for the block structure), so it travels inside ``adapter_model.safetensors``
    at a 32nd (entries) or 128th (2×2 blocks) of the fp32 weight's size. Adapters with sparsity 0 have no mask and run
    the plain LoRA path.

    A sparse adapter's forward (:mod:`hf_lisa.tuner.sparse_delta`) builds ``M ⊙ (B A)`` from the packed bits, uses it
    and drops it; the backward pass recomputes it. Outputs and gradients are bitwise those of
    ``F.linear(x, s · (B A) ⊙ M)`` under autograd. With ``LisaConfig.fuse_sparse_delta`` (the default; kept per
    adapter in ``lisa_fuse_sparse``) ``Linear.forward`` folds the delta into the base matmul where that computes the
    same function (one fp32 matmul with ``W + Δ``; equal up to rounding, see ``Linear._fused_forward_ok``).
    """

    adapter_layer_names = ("lisa_A", "lisa_B")
    other_param_names = (
        "r", "lisa_alpha", "scaling", "lisa_dropout", "lisa_mask", "lisa_mask_spec", "lisa_fuse_sparse",
    )

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.r: dict[str, int] = {}
        self.lisa_alpha: dict[str, float] = {}
        self.scaling: dict[str, float] = {}
        self.lisa_dropout = nn.ModuleDict({})
        self.lisa_A = nn.ModuleDict({})
        self.lisa_B = nn.ModuleDict({})
        self.lisa_mask = BufferDict({}, persistent=True)
        # structure, sparsity, block size and n:m of each sparse adapter; derived from the config, never saved
        self.lisa_mask_spec: dict[str, dict[str, Any]] = {}
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        # per adapter being measured: where the backward pass hands its dL/dW (the dense gradient of the effective
        # weight). The mask scheduler sets and removes these and keeps what it measures; the layer keeps nothing
        self.lisa_gradient_sinks: dict[str, Callable[[torch.Tensor], None]] = {}
        self._lisa_mask_placeholders: dict[str, tuple[LisaConfig, str]] = {}
        # per adapter (LisaConfig.fuse_sparse_delta): fold a sparse delta into the base matmul where that is the same
        # function (see Linear._fused_forward_ok); x (W + Δ)ᵀ rounds differently from x Wᵀ + x Δᵀ
        self.lisa_fuse_sparse: dict[str, bool] = {}
        in_features, out_features = _get_in_out_features(self.get_base_layer())
        if in_features is None:
            raise TypeError(f"LISA supports nn.Linear and Conv1D targets, got {type(self.get_base_layer()).__name__}.")
        self.in_features, self.out_features = in_features, out_features
        self.kwargs = kwargs

    # -- construction ----------------------------------------------------------------------------------------------------
    def update_layer(
        self,
        adapter_name: str,
        r: int,
        lisa_alpha: float,
        sparsity: float,
        config: LisaConfig,
        module_key: str = "",
        inference_mode: bool = False,
    ) -> None:
        shape = (self.out_features, self.in_features)
        if sparsity > 0:
            reason = M.check_structure_fits(shape, config.sparsity_structure, config.block_size, config.n_m)
            if reason:
                raise ValueError(
                    f"LisaConfig.sparsity_structure={config.sparsity_structure!r} cannot be applied to module "
                    f"{module_key!r}: {reason}. Pick a block_size / n_m that divides the weight, or exclude the module "
                    "(sparsity_pattern={...: 0.0} or exclude_modules)."
                )
        self.r[adapter_name] = r
        self.lisa_alpha[adapter_name] = lisa_alpha
        self.scaling[adapter_name] = lisa_alpha / r
        self.lisa_fuse_sparse[adapter_name] = config.fuse_sparse_delta
        self.lisa_dropout[adapter_name] = nn.Dropout(config.lisa_dropout) if config.lisa_dropout > 0 else nn.Identity()
        self.lisa_A[adapter_name] = nn.Linear(self.in_features, r, bias=False)
        self.lisa_B[adapter_name] = nn.Linear(r, self.out_features, bias=False)
        self.reset_lisa_parameters(adapter_name, config.init_weights)
        if sparsity > 0:
            self.lisa_mask_spec[adapter_name] = {
                "structure": config.sparsity_structure,
                "sparsity": sparsity,
                "block_size": tuple(config.block_size),
                "n_m": tuple(config.n_m),
                "mask_init": config.mask_init,
            }
            if self.lisa_A[adapter_name].weight.is_meta or self.get_base_layer().weight.is_meta:
                # low_cpu_mem_usage / meta-device init: nothing real to score yet, and the state dict usually brings
                # the mask. Keep an empty placeholder of the saved shape; _resolve_mask_placeholder fills it otherwise
                self._add_mask_placeholder(adapter_name, config, module_key)
            else:
                self.set_mask(adapter_name, self._initial_mask(adapter_name, config, module_key))
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def reset_lisa_parameters(self, adapter_name: str, init_weights: bool) -> None:
        # A as in LoRA (Kaiming uniform), B = 0 so that the delta starts at zero. Seed 000's sample code draws B from
        # randn, which would perturb the pretrained model before the first step.
        nn.init.kaiming_uniform_(self.lisa_A[adapter_name].weight, a=5**0.5)
        if init_weights:
            nn.init.zeros_(self.lisa_B[adapter_name].weight)
        else:
            nn.init.normal_(self.lisa_B[adapter_name].weight, std=0.1)

    def _initial_mask(self, adapter_name: str, config: LisaConfig, module_key: str) -> torch.Tensor:
        spec = self.lisa_mask_spec[adapter_name]
        shape = (self.out_features, self.in_features)
        if config.mask_init == "dense":
            return torch.ones(shape, dtype=torch.bool)
        if config.mask_init == "random":
            # one seed per module, stable across processes (no Python hash randomisation)
            scores = M.random_scores(shape, config.mask_seed * 1_000_003 + zlib.crc32(module_key.encode()))
        else:
            # "magnitude", and the provisional mask of "importance" until the scheduler has gradients to score
            scores = M.magnitude_scores(self.base_weight_out_in())
        return M.select_mask(scores, spec["structure"], spec["sparsity"], spec["block_size"], spec["n_m"])

    # -- masks -----------------------------------------------------------------------------------------------------------
    def base_weight_out_in(self) -> torch.Tensor:
        """The base weight in ``(out, in)`` layout, whatever the module stores."""
        return transpose(self.get_base_layer().weight, self.fan_in_fan_out)

    def set_mask(self, adapter_name: str, mask: torch.Tensor) -> None:
        """Install a full ``(out, in)`` boolean mask after checking it has the adapter's structure."""
        spec = self.lisa_mask_spec[adapter_name]
        mask = mask.bool()
        if tuple(mask.shape) != (self.out_features, self.in_features):
            raise ValueError(f"mask shape {tuple(mask.shape)} != ({self.out_features}, {self.in_features})")
        grid = mask
        if spec["structure"] == "block":
            bo, bi = spec["block_size"]
            grid = mask[::bo, ::bi]
            if not torch.equal(M.expand_grid(grid, "block", spec["block_size"]), mask):
                raise ValueError("mask is not made of whole blocks of block_size")
        packed = M.pack_mask(grid.cpu())
        old = self.lisa_mask[adapter_name] if adapter_name in self.lisa_mask else None
        if old is not None and old.shape == packed.shape and not old.is_meta:
            old.copy_(packed.to(old.device))  # in place: DDP/FSDP keep seeing the same buffer
        else:
            # a meta placeholder cannot hold data (copy_ into it is a silent no-op): replace it
            self.lisa_mask[adapter_name] = packed.to(self._mask_device(adapter_name))
        self._mask_placeholders().pop(adapter_name, None)

    def _mask_device(self, adapter_name: str) -> torch.device:
        """Where a new mask goes: beside the adapter's weights, else the base weight, never the meta device."""
        candidates = [self.get_base_layer().weight.device]
        if adapter_name in self.lisa_A:
            candidates.insert(0, self.lisa_A[adapter_name].weight.device)
        return next((d for d in candidates if d.type != "meta"), torch.device("cpu"))

    # -- masks on the meta device (low_cpu_mem_usage=True, meta-initialised models) --------------------------------------
    def _mask_placeholders(self) -> dict[str, tuple[LisaConfig, str]]:
        """``adapter -> (config, module_key)`` of masks that are still empty placeholders on the meta device."""
        return self._lisa_mask_placeholders

    def _add_mask_placeholder(self, adapter_name: str, config: LisaConfig, module_key: str) -> None:
        # the packed shape must be the saved one, or PEFT and transformers report the mask as mismatched and drop it
        spec = self.lisa_mask_spec[adapter_name]
        grid = M.grid_shape((self.out_features, self.in_features), spec["structure"], spec["block_size"])
        self.lisa_mask[adapter_name] = torch.empty(M.packed_size(grid), dtype=torch.uint8, device="meta")
        self._mask_placeholders()[adapter_name] = (config, module_key)

    def _resolve_mask_placeholder(self, adapter_name: str) -> bool:
        """Give a placeholder that no state dict filled the mask the injection would have computed, once the adapter
        and base weights are real. Returns whether a mask was computed."""
        packed = self.lisa_mask[adapter_name] if adapter_name in self.lisa_mask else None
        pending = self._mask_placeholders().get(adapter_name)
        if packed is None or pending is None:
            return False
        if not packed.is_meta:  # filled by a state dict load
            del self._mask_placeholders()[adapter_name]
            return False
        if self.lisa_A[adapter_name].weight.is_meta or self.get_base_layer().weight.is_meta:
            return False
        self.set_mask(adapter_name, self._initial_mask(adapter_name, *pending))
        return True

    @contextmanager
    def detached_mask_placeholders(self) -> Iterator[None]:
        """Take meta mask placeholders out of ``lisa_mask`` for the duration of a PEFT device move.

        PEFT moves an adapter module unless it holds meta *parameters*; the mask dict holds a buffer, so ``.to()``
        would try to copy the placeholder ("Cannot copy out of meta tensor") instead of leaving it for the state dict.
        """
        placeholders = {name: packed for name, packed in self.lisa_mask.items() if packed.is_meta}
        for name in placeholders:
            del self.lisa_mask[name]
        try:
            yield
        finally:
            for name, packed in placeholders.items():
                self.lisa_mask[name] = packed

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: Optional[torch.device] = None) -> None:
        # resolve a placeholder if the weights are real by now; otherwise leave it for the state dict load
        self._resolve_mask_placeholder(adapter_name)
        with self.detached_mask_placeholders():
            super()._move_adapter_to_device_of_base_layer(adapter_name, device=device)

    def mask_layout(self, adapter_name: str) -> MaskLayout:
        """Shape, structure and block size of a sparse adapter's packed mask."""
        spec = self.lisa_mask_spec[adapter_name]
        return MaskLayout((self.out_features, self.in_features), spec["structure"], tuple(spec["block_size"]))

    def get_mask(self, adapter_name: str) -> Optional[torch.Tensor]:
        """The full ``(out, in)`` boolean mask, or ``None`` for a dense (LoRA-equivalent) adapter.

        Expanded from the packed bits at each call and not kept: the forward and backward passes never need it (see
        :mod:`hf_lisa.tuner.sparse_delta`), and a cached copy would hold a byte per weight element for every layer.
        A mask still on the meta device (an adapter created with ``low_cpu_mem_usage=True`` whose state dict has not
        arrived) comes back as a meta tensor of the right shape.
        """
        if adapter_name not in self.lisa_mask:
            return None
        self._resolve_mask_placeholder(adapter_name)
        layout = self.mask_layout(adapter_name)
        # a normal tensor even when read under torch.inference_mode: callers keep it (schedulers compare masks
        # across steps), and autograd refuses to save inference tensors for a later training step or merge
        with torch.inference_mode(False):
            return M.expand_grid(layout.unpack(self.lisa_mask[adapter_name]), layout.structure, layout.block_size)

    @property
    def lisa_track_importance(self) -> bool:
        """Whether the backward pass hands some adapter's ``dL/dW`` to a gradient sink (the mask scheduler's)."""
        return any(sink is not None for sink in self.lisa_gradient_sinks.values())

    # -- delta -----------------------------------------------------------------------------------------------------------
    def _delta_out_in(self, adapter_name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        weight_B, weight_A = self.lisa_B[adapter_name].weight, self.lisa_A[adapter_name].weight
        if adapter_name not in self.lisa_mask:
            if dtype is not None:
                weight_B, weight_A = weight_B.to(dtype), weight_A.to(dtype)
            return (weight_B @ weight_A) * self.scaling[adapter_name]
        self._resolve_mask_placeholder(adapter_name)
        layout, packed = self.mask_layout(adapter_name), self.lisa_mask[adapter_name]
        return sparse_delta(weight_A, weight_B, packed, layout, self.scaling[adapter_name], dtype=dtype)

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        """``s · M ⊙ (B A)`` in the layout of the base weight."""
        weight_B = self.lisa_B[adapter_name].weight
        if weight_B.device.type == "cpu" and weight_B.dtype in (torch.float16, torch.bfloat16):
            # CPU matmul in half precision is slow and inexact: compute in fp32, as PEFT's LoRA does
            with torch.no_grad():
                delta = self._delta_out_in(adapter_name, dtype=torch.float32)
            return transpose(delta, self.fan_in_fan_out).to(weight_B.dtype)
        return transpose(self._delta_out_in(adapter_name), self.fan_in_fan_out)

    def add_adapter_outputs(self, result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``result + Σ s · x (M ⊙ (B A))ᵀ`` over the active adapters; the one adapter forward of every base type.

        ``result`` is the base layer's output for ``x`` (whatever the base: ``nn.Linear``, ``Conv1D`` or a quantized
        linear); it comes back in its own dtype.
        """
        result_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lisa_A:
                continue
            lisa_A = self.lisa_A[name]
            h = self.lisa_dropout[name](self._cast_input_dtype(x, lisa_A.weight.dtype))
            if name in self.lisa_mask:
                result = result + self._sparse_adapter_output(name, h)
            else:
                # dense path: exactly LoRA, two thin matmuls
                result = result + self.lisa_B[name](lisa_A(h)) * self.scaling[name]
        return result.to(result_dtype)

    def _sparse_adapter_output(self, adapter_name: str, h: torch.Tensor) -> torch.Tensor:
        """``s · h (M ⊙ (B A))ᵀ``. Its ``dL/dΔ`` is ``dL/dW`` of the effective weight, i.e. the importance score of
        seed 000, for masked-out entries too; it goes to the adapter's gradient sink (:attr:`lisa_gradient_sinks`)
        while the mask scheduler measures it."""
        self._resolve_mask_placeholder(adapter_name)
        weight_A, weight_B = self.lisa_A[adapter_name].weight, self.lisa_B[adapter_name].weight
        packed = self.lisa_mask[adapter_name]
        sink = self.lisa_gradient_sinks.get(adapter_name)
        if supports_fast_path(h, weight_A, weight_B, packed):
            # recomputes M ⊙ (B A) in the backward pass instead of keeping it (bitwise the graph below)
            return sparse_delta_linear(
                h, weight_A, weight_B, packed, self.mask_layout(adapter_name), self.scaling[adapter_name], sink
            )
        # strided inputs, meta tensors: materialise the delta and let autograd keep it
        delta = self._delta_out_in(adapter_name)
        if sink is not None and delta.requires_grad:
            delta.register_hook(sink)
        return F.linear(h, delta.to(h.dtype))

    def set_scale(self, adapter: str, scale: float) -> None:
        if adapter in self.scaling:
            self.scaling[adapter] = scale * self.lisa_alpha[adapter] / self.r[adapter]


def _declared_requires_grad(module: nn.Module, name: str) -> bool:
    """``requires_grad`` of the parameter ``module.<name>`` as its owner set it.

    Inside the forward of an FSDP1 unit with ``use_orig_params=True``, FSDP puts a plain-tensor view of its flat
    parameter in each parameter's place; the view requires a gradient whenever any parameter of the unit does (the
    adapter's, here), while the original ``nn.Parameter``, kept by the flat parameter, carries the owner's flag. The
    fused path reads that flag, so a frozen base fuses there as it does unwrapped, and an adapter gives the same outputs
    wrapped or not (PEFT's ``TestPeftFsdpStateDict``). Whatever is not recognised counts as trainable: the unfused
    path, which is right for every base.
    """
    tensor = getattr(module, name)
    if isinstance(tensor, nn.Parameter) or not tensor.requires_grad:
        return tensor.requires_grad
    flat = tensor._base
    infos, originals = getattr(flat, "_param_infos", None), getattr(flat, "_params", None)
    if infos is None or originals is None:
        return True
    for info, original in zip(infos, originals):
        if info.module is module and info.param_name == name:
            return original.requires_grad
    return True


class Linear(nn.Module, LisaLayer):
    """LISA on ``nn.Linear`` (``fan_in_fan_out=False``) or transformers' ``Conv1D`` (``fan_in_fan_out=True``)."""

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LisaConfig,
        r: int,
        lisa_alpha: float,
        sparsity: float,
        fan_in_fan_out: bool = False,
        module_key: str = "",
        **kwargs,
    ) -> None:
        super().__init__()
        LisaLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = fan_in_fan_out
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lisa_alpha, sparsity, config, module_key=module_key)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Fold the active adapters' deltas into the base weight.

        Args:
            safe_merge: compute on a copy and refuse (``ValueError``) if the result has NaN or inf.
            adapter_names: adapters to merge; all active adapters by default.
        """
        adapter_names = check_adapters_to_merge(self, adapter_names)
        base = self.get_base_layer()
        for name in adapter_names:
            if name not in self.lisa_A:
                continue
            delta = self.get_delta_weight(name).to(base.weight.dtype)
            if safe_merge:
                merged = base.weight.data + delta
                if not torch.isfinite(merged).all():
                    raise ValueError(
                        # PEFT's wording, so code matching PEFT's message keeps working
                        f"NaNs detected in the merged weights. The adapter {name} seems to be broken (LISA safe_merge "
                        "found NaN or inf; the base weights were left unchanged)."
                    )
                base.weight.data = merged
            else:
                base.weight.data += delta
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Subtract every merged delta again, restoring the base weight (up to floating-point rounding)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        base = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.lisa_A:
                base.weight.data -= self.get_delta_weight(name).to(base.weight.dtype)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            return self.base_layer(x, *args, **kwargs)
        if not args and not kwargs and self._fused_forward_ok(x):
            return self._fused_forward(x)
        result = self.base_layer(x, *args, **kwargs)
        return self.add_adapter_outputs(result, x)

    def _fused_forward_ok(self, x: torch.Tensor) -> bool:
        """Whether ``x (W + s · M ⊙ (B A))ᵀ + b`` computes what ``base(x) + adapter(x)`` computes, so that the delta
        may join the base matmul (:class:`~hf_lisa.tuner.sparse_delta.FusedSparseLinear`).

        Needs one active adapter, sparse, without dropout and with ``fuse_sparse_delta``; a frozen fp32/fp64
        ``nn.Linear`` or ``Conv1D`` base, called directly (no wrapper, no module hooks, no replaced ``forward``:
        DeepSpeed ZeRO-3, accelerate's offload and FSDP gather weights in hooks, which reading ``base.weight`` here
        would bypass; an enclosing FSDP1 unit has gathered them already, and its views count as frozen by their
        original parameters' flag, :func:`_declared_requires_grad`); plain tensors of one dtype and device; no
        autocast (it would run the fused matmul in bf16, where ``W + Δ`` loses small deltas).
        """
        names = [name for name in self.active_adapters if name in self.lisa_A]
        if len(names) != 1 or names[0] not in self.lisa_mask or not self.lisa_fuse_sparse.get(names[0], False):
            return False
        name, base = names[0], self.base_layer
        if not isinstance(self.lisa_dropout[name], nn.Identity) or self.lisa_mask[name].is_meta:
            return False
        is_conv1d = type(base).__name__ == "Conv1D"
        if (type(base) is not nn.Linear and not is_conv1d) or self.fan_in_fan_out != is_conv1d:
            return False
        kinds = ("forward", "forward_pre", "backward", "backward_pre")
        if "forward" in base.__dict__ or hasattr(base, "_hf_hook") or any(getattr(base, f"_{k}_hooks") for k in kinds):
            return False
        if any(getattr(nn.modules.module, f"_global_{k}_hooks") for k in kinds):
            return False
        params = [base.weight, self.lisa_A[name].weight, self.lisa_B[name].weight]
        frozen = ["weight"] if base.bias is None else ["weight", "bias"]
        params += [base.bias] if base.bias is not None else []
        if any(_declared_requires_grad(base, p) for p in frozen):
            return False
        if any(type(p) not in (nn.Parameter, torch.Tensor) for p in params):
            return False
        dtype, device = base.weight.dtype, base.weight.device
        if dtype not in (torch.float32, torch.float64) or device.type == "meta":
            return False
        if torch.is_autocast_enabled(device.type):
            return False
        tensors = [x, *params]
        return x.dim() >= 2 and all(t.dtype == dtype and t.device == device for t in tensors)

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        name = next(name for name in self.active_adapters if name in self.lisa_A)
        base = self.base_layer
        return fused_sparse_linear(
            x, self.lisa_A[name].weight, self.lisa_B[name].weight, self.lisa_mask[name], base.weight, base.bias,
            self.mask_layout(name), self.scaling[name], self.fan_in_fan_out, self.lisa_gradient_sinks.get(name),
        )

    def __repr__(self) -> str:
        return "lisa." + super().__repr__()
