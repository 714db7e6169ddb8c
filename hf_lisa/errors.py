"""Clear errors for the ways users commonly misuse hf-lisa."""

from __future__ import annotations

MISSING_IMPORT_HINT = (
    "This adapter was trained with LISA (adapter_config.json says \"peft_type\": \"LISA\"), a PEFT method provided by "
    "the hf-lisa package. Run `pip install hf-lisa` and `import hf_lisa` before loading it, or load it with "
    "`hf_lisa.from_pretrained(...)`."
)


class LisaNotRegisteredError(KeyError):
    """Raised instead of PEFT's bare ``KeyError: 'LISA'`` when a LISA adapter is loaded without ``import hf_lisa``."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else MISSING_IMPORT_HINT


class UsageError(ValueError):
    """A mistake in what the user asked for: an option, a value, a config file, an input file or the model named.

    The ``hf-lisa`` command ends it with its message and exit status 2 (see :func:`hf_lisa.cli.main`), before any
    weight is loaded where the mistake can be found that early. It is a ``ValueError``, so code that catches
    ``ValueError`` around ``parse_args`` or ``run`` keeps working.
    """


class RunError(RuntimeError):
    """A failure while running whose message is written for the user: the ``hf-lisa`` command ends it with that one
    message and exit status 1 (see :func:`hf_lisa.cli.main`), with no traceback hint."""


class NothingTrainedError(RunError):
    """The first optimizer steps of a run (with a learning rate above 0, updates not deliberately withheld) changed
    no trainable parameter, or every gradient was zero or absent: the run would train nothing. Raised by
    :class:`hf_lisa.trainer_callbacks.progress.TrainingProgressGuard`, out of ``trainer.train()``."""


class Terminated(BaseException):
    """The process received SIGTERM (a scheduler's preemption, ``kill``): raised in the main thread by the ``hf-lisa``
    command's handler so that the run unwinds like Ctrl-C (staged saves removed, the lock released); exit status 143
    with the checkpoint to resume from."""


#: the attribute :func:`hf_lisa.train.run.run` sets on an exception raised while the run evaluates, trains, saves or
#: pushes (its value: the output folder): a failure while running, exit status 1, unless it is a ``UsageError``
WHILE_RUNNING = "hf_lisa_while_running"
