"""``LisaModel``: injects LISA layers into a model and owns the per-block layer-interpolation scalars."""

from __future__ import annotations

from typing import Optional, Union

import torch
from peft import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from ..blocks import find_blocks
from .bnb import keep_4bit_layers_trainable, quantized_layer_class
from .config import LisaConfig
from .layer import LisaLayer, Linear
from .peft_type import require_supported_peft
from .schedule_guard import ScheduleGuard

# The source documents adapt the attention projections (seed 000: q/k/v); architectures not listed fall back to
# PEFT's LoRA defaults.
TRANSFORMERS_MODELS_TO_LISA_TARGET_MODULES_MAPPING: dict[str, list[str]] = {
    **TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
    **{
        arch: ["q_proj", "k_proj", "v_proj"]
        for arch in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "opt")
    },
    "gpt2": ["c_attn"],
    "gpt_neox": ["query_key_value"],
    "bert": ["query", "key", "value"],
    "roberta": ["query", "key", "value"],
    "t5": ["q", "k", "v"],
}


_INJECT_INTERPOLATION_ERROR = (
    "LISA adapter {adapter_name!r} has layer_interpolation=True: its per-block alpha/beta are shared state stored on "
    "the PEFT tuner (LisaModel), which peft.inject_adapter_in_model - and with it transformers' model.load_adapter, "
    "model.add_adapter and AutoModel*.from_pretrained(adapter_dir) - builds and then drops, so alpha/beta would be "
    "silently ignored and never trained. Load the adapter with peft.PeftModel.from_pretrained(base_model, adapter_dir) "
    "or hf_lisa.from_pretrained(adapter_dir), and create one with peft.get_peft_model(model, LisaConfig(...)) (or "
    "keep the tuner yourself: LisaModel(model, {{adapter_name: config}}, adapter_name))."
)


def _conv1d_type():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


class LisaModel(BaseTuner):
    """
    Creates a LISA model from a pretrained transformers model. Use it through ``peft.get_peft_model``.

    Example:
        ```py
        >>> import hf_lisa  # registers LISA with PEFT
        >>> from peft import get_peft_model
        >>> from transformers import AutoModelForCausalLM
        >>> base = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> model = get_peft_model(base, hf_lisa.LisaConfig(r=8, sparsity=0.4))  # doctest: +SKIP
        >>> model.print_trainable_parameters()  # doctest: +SKIP
        ```

    **Attributes**:
        - **lisa_interp_delta**, **lisa_interp_beta** (`nn.ParameterDict`): per-adapter vectors of δ_l and β_l, one
          entry per transformer block, for adapters with ``layer_interpolation=True``.
    """

    prefix: str = "lisa_"
    tuner_layer_cls = LisaLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LISA_TARGET_MODULES_MAPPING
    #: whether the β penalty is added to ``outputs.loss`` (a custom loop). The scheduler callback turns this
    #: off and applies the penalty's gradient itself, once per optimizer step: trainers that compute their own loss
    #: (TRL, label smoothing) never see ``outputs.loss``, and a loss term is multiplied by the number of micro-batches
    interpolation_penalty_in_loss: bool = True

    def __init__(
        self,
        model: nn.Module,
        peft_config: Union[PeftConfig, dict[str, PeftConfig]],
        adapter_name: str,
        low_cpu_mem_usage: bool = False,
        state_dict: Optional[dict[str, torch.Tensor]] = None,
    ) -> None:
        # Who keeps this tuner? PeftModel (get_peft_model, PeftModel.from_pretrained, hf_lisa.from_pretrained) builds
        # it from a dict {adapter_name: config} and keeps it as ``base_model``; peft.inject_adapter_in_model (and with
        # it transformers' load_adapter/add_adapter) builds it from a bare config and returns only the inner model.
        # Layer interpolation's alpha/beta live on the tuner, so a bare config with layer_interpolation is refused in
        # _pre_injection_hook. Decided from the public constructor's argument, not from the caller's stack frame.
        # A plain attribute: nn.Module.__init__ (run by BaseTuner.__init__ below) keeps it.
        self._lisa_bare_config = isinstance(peft_config, PeftConfig)
        super().__init__(model, peft_config, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage, state_dict=state_dict)

    def _pre_injection_hook(self, model: nn.Module, config: LisaConfig, adapter_name: str) -> None:
        if config.layer_interpolation and self._lisa_bare_config:
            if self.peft_config.get(adapter_name) is config:  # BaseTuner may have added it to the model's own dict
                del self.peft_config[adapter_name]
            raise ValueError(_INJECT_INTERPOLATION_ERROR.format(adapter_name=adapter_name))
        # BaseTuner.__init__ resets nn.Module state first, so the containers are created here, once
        if "lisa_interp_delta" not in self._modules:
            self.lisa_interp_delta = nn.ParameterDict({})
            self.lisa_interp_beta = nn.ParameterDict({})
            self._interp_hooks: list = []
            self._interp_enabled = True
            # refuses a training forward of an adapter whose settings need the schedule while none runs it
            self._schedule_guard = ScheduleGuard(self)
            self._schedule_guard.install(model)

    # -- injection -------------------------------------------------------------------------------------------------------
    def _create_and_replace(self, lisa_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        if current_key is None:
            raise ValueError("current_key must not be None")
        params = lisa_config.resolve(current_key)
        if isinstance(target, LisaLayer):
            target.update_layer(adapter_name, config=lisa_config, module_key=current_key, **params)
            return
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        quantized = quantized_layer_class(base)  # bitsandbytes Linear4bit / Linear8bitLt (nn.Linear subclasses)
        if quantized is not None:
            new_module = quantized(target, adapter_name, lisa_config, module_key=current_key, **params)
        elif isinstance(base, (nn.Linear, _conv1d_type())):
            new_module = Linear(
                target, adapter_name, lisa_config, fan_in_fan_out=not isinstance(base, nn.Linear),
                module_key=current_key, **params,
            )
        else:
            raise TypeError(
                f"LISA cannot adapt module {current_key!r} of type {type(base).__name__}; supported: torch.nn.Linear, "
                "transformers.pytorch_utils.Conv1D and bitsandbytes' Linear4bit / Linear8bitLt. Adjust "
                "LisaConfig.target_modules."
            )
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        # low_cpu_mem_usage: the mask placeholder stays on meta until the state dict fills it (see LisaLayer)
        with new_module.detached_mask_placeholders():
            self._replace_module(parent, target_name, new_module, target)

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        require_supported_peft()  # PEFT < 0.21 corrupts the packed mask (hf_lisa/tuner/peft_type.py)
        # PeftModel.add_adapter calls inject_adapter without the injection hooks, so interpolation is set up here
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        self._add_interpolation(model, self.peft_config[adapter_name], adapter_name)
        # on a 4-bit base, bitsandbytes must never take its backward-less CPU inference layout: an evaluation, a
        # generation or the mask probe would end training silently (hf_lisa.tuner.bnb). Inference-mode adapters too, so
        # that a reloaded adapter computes what the evaluations during training measured
        keep_4bit_layers_trainable(model)

    def _add_interpolation(self, model: nn.Module, config: LisaConfig, adapter_name: str) -> None:
        if "lisa_interp_delta" not in self._modules:
            self._pre_injection_hook(model, config, adapter_name)
        if not config.layer_interpolation:
            return
        n_blocks = len(self._blocks(config))
        # in the base model's float dtype, as PEFT moves every layer adapter; PeftModel's autocast_adapter_dtype then
        # upcasts them with the rest (_cast_adapter_dtype)
        weight = next((p for p in model.parameters() if p.is_floating_point()), None)
        like = {"device": weight.device, "dtype": weight.dtype} if weight is not None else {}
        # δ = 0 and β = 0: α = exp(0) = 1, so the adapted model starts as the base model
        self.lisa_interp_delta[adapter_name] = nn.Parameter(torch.zeros(n_blocks, **like))
        self.lisa_interp_beta[adapter_name] = nn.Parameter(torch.zeros(n_blocks, **like))
        if not self._interp_hooks:
            for index, (_, block) in enumerate(self._blocks(config)):
                self._interp_hooks.append(block.register_forward_hook(self._make_interp_hook(index)))
            self._interp_hooks.append(model.register_forward_hook(self._add_penalty_to_loss))
        if adapter_name not in self.active_adapters or config.inference_mode:
            self.lisa_interp_delta[adapter_name].requires_grad_(False)
            self.lisa_interp_beta[adapter_name].requires_grad_(False)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        super()._cast_adapter_dtype(adapter_name, autocast_adapter_dtype=autocast_adapter_dtype)
        # PEFT casts the adapters inside tuner layers only; α/β live on the tuner and follow the same rule
        if not autocast_adapter_dtype:
            return
        for params in (self.lisa_interp_delta, self.lisa_interp_beta):
            if adapter_name in params and params[adapter_name].dtype in (torch.float16, torch.bfloat16):
                old = params[adapter_name]
                params[adapter_name] = nn.Parameter(old.detach().float(), requires_grad=old.requires_grad)

    def _blocks(self, config: LisaConfig) -> list[tuple[str, nn.Module]]:
        return find_blocks(self.model, config.lisa_layers_attribute)

    # -- layer interpolation -----------------------------------------------------------------------------------------
    def interpolation_alpha(self, adapter_name: str) -> torch.Tensor:
        """α_l = exp(clamp(δ_l, -bound, bound)) for every block."""
        bound = self.peft_config[adapter_name].interpolation_delta_bound
        return torch.exp(self.lisa_interp_delta[adapter_name].clamp(-bound, bound))

    def _make_interp_hook(self, index: int):
        def hook(module, args, output):
            if not self._interp_enabled:
                return output
            hidden = output[0] if isinstance(output, tuple) else output
            for name in self.active_adapters:
                if name in self.lisa_interp_delta:
                    alpha = self.interpolation_alpha(name)[index]
                    beta = self.lisa_interp_beta[name][index]
                    hidden = alpha.to(hidden.dtype) * hidden + beta.to(hidden.dtype)
            return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def interpolation_parameters(self) -> list[nn.Parameter]:
        """Every δ and β parameter (no weight decay belongs on them: δ = 0 and β = 0 are not "small weights")."""
        return [*self.lisa_interp_delta.values(), *self.lisa_interp_beta.values()] if self._has_interp() else []

    def _has_interp(self) -> bool:
        return "lisa_interp_delta" in self._modules

    def interpolation_penalty_terms(self) -> list[tuple[nn.Parameter, float]]:
        """``(β, λ)`` of every active adapter that uses layer interpolation: the penalty is ``Σ λ·Σβ²``."""
        if not self._has_interp():
            return []
        return [(self.lisa_interp_beta[name], float(self.peft_config[name].interpolation_beta_l2))
                for name in self.active_adapters if name in self.lisa_interp_beta]

    @torch.no_grad()
    def apply_interpolation_penalty_grad(self, grad_scale: float = 1.0, skip: frozenset = frozenset()) -> Optional[float]:
        """Add the gradient of λ·Σβ² (``2λβ``) to ``β.grad`` of the active, trainable adapters; returns the penalty.

        Call once per optimizer step, after the backward passes and before ``optimizer.step()``: the penalty then
        counts exactly once per step whatever the loss function, gradient accumulation or world size (β is identical
        on every rank). ``grad_scale`` multiplies the added gradient, for gradients still scaled by a loss scaler;
        ``skip`` holds the ``id`` of each β whose term the backward pass added already (the LISA callbacks add it
        there, :class:`hf_lisa.trainer_callbacks.gradients.PenaltyGradient`). Returns ``None`` when no active adapter
        uses interpolation.
        """
        total = None
        for beta, lam in self.interpolation_penalty_terms():
            total = (total or 0.0) + float(lam * beta.detach().float().pow(2).sum())
            if not beta.requires_grad or lam == 0 or id(beta) in skip:
                continue
            grad = (2 * lam * grad_scale) * beta.detach()
            if beta.grad is None:
                beta.grad = grad.to(beta.dtype)
            else:
                beta.grad.add_(grad.to(beta.grad.dtype))
        return total

    @torch.no_grad()
    def project_interpolation_delta(self) -> None:
        """Clamp every δ into ``[-bound, bound]`` in place. After each optimizer step, so δ never sits outside the
        range where the forward's clamp would cut its gradient to zero forever."""
        if not self._has_interp():
            return
        for name, delta in self.lisa_interp_delta.items():
            bound = self.peft_config[name].interpolation_delta_bound
            delta.clamp_(-bound, bound)

    def interpolation_penalty(self) -> torch.Tensor:
        """λ·Σ_l β_l² summed over the active adapters that use layer interpolation (seed 001)."""
        total = None
        for beta, lam in self.interpolation_penalty_terms():
            term = lam * beta.pow(2).sum()
            total = term if total is None else total + term
        if total is None:
            return torch.zeros((), device=next(self.model.parameters()).device)
        return total

    def _add_penalty_to_loss(self, module, args, outputs):
        # A hook on the wrapped model rather than a LisaModel.forward override: plain PeftModel calls the base model
        # directly, bypassing the tuner. The β penalty thus joins every training loss, so a plain Trainer optimises it.
        if (
            module.training
            and self.interpolation_penalty_in_loss
            and self._interp_enabled
            and any(name in self.lisa_interp_beta for name in self.active_adapters)
            and getattr(outputs, "loss", None) is not None
        ):
            outputs.loss = outputs.loss + self.interpolation_penalty().to(outputs.loss.dtype)
        return outputs

    # -- adapter management ----------------------------------------------------------------------------------------------
    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        super()._enable_adapter_layers(enabled)
        self._interp_enabled = enabled

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        super().set_adapter(adapter_name, inference_mode=inference_mode)
        if "lisa_interp_delta" not in self._modules:  # called during the first injection
            return
        active = {adapter_name} if isinstance(adapter_name, str) else set(adapter_name)
        for params in (self.lisa_interp_delta, self.lisa_interp_beta):
            for name, param in params.items():
                param.requires_grad_(name in active and not inference_mode)

    def delete_adapter(self, adapter_name: str) -> None:
        super().delete_adapter(adapter_name)
        for params in (self.lisa_interp_delta, self.lisa_interp_beta):
            if adapter_name in params:
                del params[adapter_name]
        if not len(self.lisa_interp_delta):
            self._remove_interp_hooks()

    def _remove_interp_hooks(self) -> None:
        for handle in self._interp_hooks:
            handle.remove()
        self._interp_hooks = []

    def _check_merge_allowed(self) -> None:
        super()._check_merge_allowed()
        with_interp = [name for name in self.lisa_interp_delta if name in self.active_adapters]
        if with_interp:
            raise ValueError(
                f"Cannot merge LISA adapter(s) {with_interp}: layer_interpolation scales and shifts whole block outputs "
                "(h = α·f(h) + β), which no weight of the base model can express. Keep the model unmerged (the adapter "
                "loads with PeftModel.from_pretrained), or train with layer_interpolation=False to get mergeable weights."
            )

    def merge_adapter(self, adapter_names: Optional[list[str]] = None, safe_merge: bool = False) -> None:
        names = adapter_names or self.active_adapters
        if any(name in self.lisa_interp_delta for name in names):
            self._check_merge_allowed()
        super().merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge)

    def _unload_and_optionally_merge(self, merge=True, progressbar=False, safe_merge=False, adapter_names=None):
        if merge:
            self._check_merge_allowed()
        model = super()._unload_and_optionally_merge(
            merge=merge, progressbar=progressbar, safe_merge=safe_merge, adapter_names=adapter_names
        )
        self._remove_interp_hooks()
        self._schedule_guard.remove()
        return model

    # -- introspection -------------------------------------------------------------------------------------------------
    def lisa_layers(self) -> list[tuple[str, LisaLayer]]:
        """``(name, layer)`` for every injected LISA layer."""
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, LisaLayer)]
