"""What a run leaves behind: the trainable-parameter summary, the loss plot, the final model, the summary and the model card."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from torch import nn

from .arguments import ADAPTER_METHODS

logger = logging.getLogger("hf_lisa.train")


TRAINING_SUMMARY_NAME = "training_summary.json"


LOSS_PLOT_NAME = "loss.png"


TRAINING_ARGS_JSON = "training_args.json"


SUMMARY_PREFIX = "hf-lisa"


# ----------------------------------------------------------------------------------------------------------------------
# Start-of-training summary line
# ----------------------------------------------------------------------------------------------------------------------
def _fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def trainable_summary(model: nn.Module, layers_attribute: Optional[str] = None) -> dict:
    """Trainable parameters by group (embeddings / blocks / other) and the active blocks, from ``requires_grad``."""
    from ..scheduler.param_groups import EMBEDDINGS_GROUP, assign_param_groups

    assignment, num_blocks = assign_param_groups(model, layers_attribute)
    counts = {"embeddings": 0, "blocks": 0, "other": 0}
    active: set[int] = set()
    total = 0
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if not param.requires_grad:
            continue
        group = assignment[name]
        if group.startswith("block."):
            counts["blocks"] += param.numel()
            active.add(int(group.split(".", 1)[1]))
        elif group == EMBEDDINGS_GROUP:
            counts["embeddings"] += param.numel()
        else:
            counts["other"] += param.numel()
    return {
        "total_params": total,
        "trainable_params": sum(counts.values()),
        "trainable_by_group": counts,
        "active_blocks": sorted(active),
        "num_blocks": num_blocks,
    }


def _summary_callback(method: str, output_dir: str, layers_attribute: Optional[str], store: dict):
    from transformers import TrainerCallback

    class StartSummaryCallback(TrainerCallback):
        """Prints one line when training starts, after the LISA callbacks have frozen what does not train."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            info = trainable_summary(model, layers_attribute)
            store.update(info)
            groups = info["trainable_by_group"]
            blocks = info["active_blocks"]
            shown = ",".join(map(str, blocks)) if len(blocks) <= 8 else f"{len(blocks)} blocks"
            line = (
                f"[{SUMMARY_PREFIX}] method={method} | trainable {_fmt_count(info['trainable_params'])} of "
                f"{_fmt_count(info['total_params'])} params (embeddings {_fmt_count(groups['embeddings'])}, blocks "
                f"{_fmt_count(groups['blocks'])}, head/other {_fmt_count(groups['other'])}) | active blocks "
                f"{len(blocks)}/{info['num_blocks']} [{shown}] | output_dir={output_dir}"
            )
            if state.is_world_process_zero:
                print(line, flush=True)

    return StartSummaryCallback()


# ----------------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------------
def plot_losses(log_history: list[dict], path: str, before_eval_loss: Optional[float] = None,
                after_eval_loss: Optional[float] = None, final_step: Optional[int] = None,
                title: str = "hf-lisa training") -> Optional[str]:
    """Write a PNG of the training loss (and the eval loss) against the optimizer step; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss plot (pip install matplotlib).")
        return None
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if before_eval_loss is not None:
        evals = [(0, before_eval_loss)] + [p for p in evals if p[0] != 0]
    if after_eval_loss is not None and final_step is not None and not any(s == final_step for s, _ in evals):
        evals.append((final_step, after_eval_loss))
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if evals:
        ax.plot(*zip(*sorted(evals)), "o--", label="eval loss", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "value"):  # enums
        return value.value
    return str(value)


def save_final_model(trainer, model: nn.Module, tokenizer, output_dir: str, method: str) -> None:
    """Adapters as ``adapter_config.json`` + ``adapter_model.safetensors``; full weights as safetensors. No pickle."""
    # gather on every rank (FSDP/DeepSpeed shards), write on the main process only
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if not trainer.args.should_save:
        return
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    os.makedirs(output_dir, exist_ok=True)
    unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    with open(os.path.join(output_dir, TRAINING_ARGS_JSON), "w") as f:
        f.write(trainer.args.to_json_string())
    # the Trainer's own save writes a pickled training_args.bin; the final directory must hold none
    for name in os.listdir(output_dir):
        if name == "training_args.bin":
            os.remove(os.path.join(output_dir, name))


def _write_model_card(output_dir: str, summary: dict, method: str) -> Optional[str]:
    try:
        from ..hub import render_model_card
    except ImportError:  # the Hub module is optional for training
        return None
    mode = "adapter" if method in ADAPTER_METHODS else "merged"

    def read(name):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        return None

    try:
        card = render_model_card(
            None, mode, base_model=summary.get("base_model"), adapter_config=read("adapter_config.json"),
            model_config=read("config.json"), summary=summary, loss_plot=summary.get("loss_plot"),
        )
    except Exception as err:  # a card is a convenience; never lose a finished training run over it
        logger.warning("Could not render the model card: %s", err)
        return None
    path = os.path.join(output_dir, "README.md")
    card.save(path)
    return path


def _license_for(base_model_id: str) -> Optional[str]:
    from ..models import DEFAULT_MODEL_ID, DEFAULT_MODEL_LICENSE

    return DEFAULT_MODEL_LICENSE if base_model_id == DEFAULT_MODEL_ID else None
