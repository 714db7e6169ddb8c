"""Where callbacks that add values to ``logs`` must sit in a Trainer's callback list."""

from __future__ import annotations

from typing import Sequence


def run_before_reporting_integrations(trainer, callbacks: Sequence) -> None:
    """Make ``callbacks`` (already on ``trainer``) run before the reporting integrations and the log printers.

    The Trainer registers the integrations named by ``report_to`` (TensorBoard, W&B, ...) before user callbacks, and
    they write ``logs`` in their own ``on_log``: values a later callback adds to ``logs`` would reach ``log_history``
    but never the integrations. Through the callback handler's public ``pop_callback`` / ``add_callback``, every
    reader that runs before one of ``callbacks`` moves to the end of the list, keeping the readers' relative order;
    nothing else moves. Idempotent.
    """
    from transformers.integrations import INTEGRATION_TO_CALLBACK
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    readers = tuple(c for c in INTEGRATION_TO_CALLBACK.values() if isinstance(c, type)) + (
        PrinterCallback, ProgressCallback)
    present = list(trainer.callback_handler.callbacks)
    positions = [i for i, cb in enumerate(present) if any(cb is ours for ours in callbacks)]
    if not positions:
        return
    early = [cb for cb in present[: max(positions)] if isinstance(cb, readers)]
    handler = trainer.callback_handler  # its methods, not the Trainer's (a subclass may extend add_callback)
    for reader in early:
        handler.pop_callback(reader)
        handler.add_callback(reader)
