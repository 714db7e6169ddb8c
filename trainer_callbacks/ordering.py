"""Where callbacks that add values to ``logs`` must sit in a Trainer's callback list."""

from __future__ import annotations

from typing import Sequence


def run_before_reporting_integrations(trainer, callbacks: Sequence) -> None:
    """Move ``callbacks`` (already on ``trainer``) ahead of the reporting integrations and the log printers.

    The Trainer registers the integrations named by ``report_to`` (TensorBoard, W&B, ...) before user callbacks, and
    they write ``logs`` in their own ``on_log``: values a later callback adds to ``logs`` would reach ``log_history``
    but never the integrations. Only callbacks behind the first reader move, to just before it, keeping their relative
    order; everything else keeps its place. Idempotent.
    """
    from transformers.integrations import INTEGRATION_TO_CALLBACK
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    handler = trainer.callback_handler
    readers = tuple(c for c in INTEGRATION_TO_CALLBACK.values() if isinstance(c, type)) + (
        PrinterCallback, ProgressCallback)
    first = next((i for i, cb in enumerate(handler.callbacks) if isinstance(cb, readers)), None)
    if first is None:  # nothing reads the logs: leave the order alone
        return
    late = [cb for cb in callbacks if any(cb is present for present in handler.callbacks[first:])]
    handler.callbacks = [cb for cb in handler.callbacks if not any(cb is m for m in late)]
    handler.callbacks[first:first] = late
